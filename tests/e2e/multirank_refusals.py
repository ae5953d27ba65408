"""One rank of a job that tries what a sharded optimizer refuses (tests/e2e/test_multirank.py): each attempt's exception, as JSON on stdout."""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from cossd.trainer import AdamW


def attempt(action) -> str:  # type: ignore[no-untyped-def]
    try:
        action()
    except Exception as exc:  # the refusal is what is reported
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def main() -> int:
    mount = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).to(torch.bfloat16)
    found = {"streaming": attempt(lambda: AdamW(model.parameters(), mount=mount, namespace="refused-stream",
                                                streaming=True))}
    optimizer = AdamW(model.parameters(), mount=mount, namespace="refused", average_grads=False)
    for param in model.parameters():
        param.grad = torch.full_like(param, 0.01)
    optimizer.step()
    stock_model = torch.nn.Linear(64, 32)  # a state of another run: a stock optimizer's, one step on
    stock = torch.optim.AdamW(stock_model.parameters())
    for param in stock_model.parameters():
        param.grad = torch.full_like(param, 0.01)
    stock.step()
    groups_before = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    found["load_state_dict"] = attempt(lambda: optimizer.load_state_dict(stock.state_dict()))
    found["groups_unchanged"] = groups_before == [{k: v for k, v in g.items() if k != "params"}
                                                  for g in optimizer.param_groups]
    # A wrapper (DeepSpeed) puts other tensors in the groups: refused, not stepped silently.
    optimizer.param_groups[0]["params"] = [p.detach().clone().requires_grad_() for p in model.parameters()]
    for param in optimizer.param_groups[0]["params"]:
        param.grad = torch.full_like(param, 0.01)
    found["swapped_params"] = attempt(optimizer.step)
    found["committed_step"] = optimizer.committed_step
    print(json.dumps(found), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
