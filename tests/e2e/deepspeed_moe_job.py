"""One rank of a DeepSpeed ZeRO 1/2 job whose model has a DeepSpeed MoE layer (param groups split by DeepSpeed's MoE helper) on a cossd mount, started as torchrun would start it; tests/e2e/test_deepspeed_moe.py runs it."""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer  # noqa: E402

from cossd.trainer import AdamW  # noqa: E402
from deepspeed_job import LR, MICRO_BATCH, batch  # noqa: E402

HIDDEN, EXPERTS = 32, 2


class TinyMoE(torch.nn.Module):
    """16 -> HIDDEN -> an MoE layer of EXPERTS experts (HIDDEN -> HIDDEN, top-1) -> 16."""

    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, HIDDEN)
        # No random token selection and room for every token: the routing depends on the
        # weights only, so cossd's run and torch's reference route alike.
        self.moe = MoE(hidden_size=HIDDEN, expert=torch.nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS,
                       ep_size=ep_size, k=1, capacity_factor=float(EXPERTS), min_capacity=MICRO_BATCH,
                       use_rts=False)
        self.fc2 = torch.nn.Linear(HIDDEN, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, aux, _ = self.moe(torch.tanh(self.fc1(x)))
        return self.fc2(hidden), aux


def distinct_experts(model: TinyMoE, rank: int, ep_size: int) -> None:
    """Each expert's own initial weights (DeepSpeed deep-copies one expert into every local
    slot), seeded by its global id, so that a rank reading another's expert shows."""
    local = model.moe.deepspeed_moe.experts.deepspeed_experts
    with torch.no_grad():
        for index, expert in enumerate(local):
            generator = torch.Generator().manual_seed(1000 + (rank % ep_size) * len(local) + index)
            for param in expert.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def groups(model: torch.nn.Module) -> list[dict]:
    """The decay / no-decay split, then DeepSpeed's MoE helper: dense groups first, then one
    group per (dense group, expert group) marked moe."""
    named = list(model.named_parameters())
    return split_params_into_different_moe_groups_for_optimizer([
        {"name": "decay", "params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
        {"name": "no_decay", "params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}])


def main() -> int:
    config = json.loads(sys.argv[-1])
    rank = int(os.environ["RANK"])
    os.environ.setdefault("LOCAL_RANK", str(rank))
    out = Path(config["out"])
    warnings.simplefilter("ignore")
    ep_size = int(config["ep_size"])
    deepspeed.init_distributed("gloo")
    torch.manual_seed(0)
    model = TinyMoE(ep_size)
    distinct_experts(model, rank, ep_size)
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": config["stage"]},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "bf16": {"enabled": True}}
    try:
        if config.get("torch"):  # the reference: torch's AdamW under the same DeepSpeed config
            optimizer = torch.optim.AdamW(groups(model), lr=LR)
        else:
            optimizer = AdamW(groups(model), lr=LR, mount=config["mount"], namespace=config["namespace"],
                              step_timeout_s=config.get("step_timeout_s", 60.0))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    except Exception as exc:
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        dist.destroy_process_group()
        return 4
    first = getattr(optimizer, "committed_step", 0) + 1
    losses = {}
    try:
        for step in range(first, config["last"] + 1):
            x, y = batch(step, rank)
            logits, aux = engine(x.to(torch.bfloat16))
            loss = F.cross_entropy(logits.float(), y) + 0.01 * aux.float()
            engine.backward(loss)
            engine.step()
            losses[step] = loss.item()
    except Exception as exc:
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
    params = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    result = {"first": first, "losses": losses}
    if not config.get("torch"):
        result |= {"committed_step": optimizer.committed_step, "restored": optimizer.restored,
                   "names": [(e.name, e.numel) for e in optimizer.entries]}
        optimizer.close()
    torch.save({"result": result, "params": params}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
