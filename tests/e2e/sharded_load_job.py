"""One rank of a job that loads another run's state mid-training (FSDP2 or DDP with the sharded optimizer, on one device or several): tests/e2e/test_sharded_load.py runs it."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cossd.trainer import AdamW

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_job as job  # noqa: E402  (the model, its groups, the schedule and batches)

# Trained to this step, then the state of another run, at LOADED_STEP, is loaded.
BEFORE_LOAD = 3


def main() -> int:
    config = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(config["out"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = job.Net()
    if config["mode"] == "fsdp":
        job.shard(model, {})
    optimizer = AdamW(job.groups_of(model), lr=job.BASE_LR, betas=(0.9, 0.95), mount=config["mounts"],
                      namespace=config["namespace"], step_timeout_s=60.0)
    net = torch.nn.parallel.DistributedDataParallel(model) if config["mode"] == "ddp" and world > 1 else model
    params = job.params_of(optimizer)
    state = torch.load(config["state"])
    loaded_step = int(state["state"][0]["step"])
    grads: dict[int, list[torch.Tensor]] = {}
    for step in [*range(1, BEFORE_LOAD + 1), None, *range(loaded_step + 1, loaded_step + 4)]:
        if step is None:
            optimizer.load_state_dict(state)
            assert optimizer.committed_step == loaded_step, optimizer.committed_step
            continue
        for group, base in zip(optimizer.param_groups, (job.BASE_LR, 2 * job.BASE_LR)):
            group["lr"] = base * job.schedule(step)
        x, y = job.batch(step, rank)
        F.cross_entropy(net(x), y).backward()
        grads[step] = [job.full(p.grad).detach().clone() for p in params]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    final = [job.full(p).detach().clone() for p in params]
    masters = optimizer.master_weights()
    torch.save({"grads": grads, "params": final, "masters": masters, "committed_step": optimizer.committed_step},
               out / f"rank{rank}.pt")
    optimizer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
