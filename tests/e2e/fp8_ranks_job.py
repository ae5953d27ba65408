"""One rank of a job stepping FP8 gradients on a cossd mount (or several: "mounts"), as torchrun would start it; tests/e2e/test_grad_fp8_ranks.py runs it and rebuilds its gradients."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from multirank_job import Net  # noqa: E402  (fc1.weight spans two device blocks)

from cossd.trainer import AdamW  # noqa: E402

# Every TINY_STRIDE-th element of each gradient is scaled down to about 1e-9 of the rest: far below
# E4M3's smallest code at any scale the tensor's amax gives, so every one of them underflows.
TINY_STRIDE = 997
# The element of fc1.weight made inf at INF_STEP: in rank 1's shard at two ranks (its elements
# 262144.. onwards), so only that rank's slice carries it.
INF_ELEMENT = 300_000


def gradients(step: int, params: list[torch.Tensor], inf_step: int) -> list[torch.Tensor]:
    """The step's gradients, already averaged: the same on every rank (average_grads=False)."""
    generator = torch.Generator().manual_seed(7717 * step)
    grads = []
    for param in params:
        # Falling 64-fold along the tensor: wherever a rank's shard or a device's piece is cut,
        # the parts have different amaxes, so each slice's own scale differs from the others'.
        grad = torch.randn(param.numel(), generator=generator) * torch.logspace(-2, -2 - 1.8, param.numel())
        grad[::TINY_STRIDE] *= 1e-7
        if step == inf_step and param.numel() > INF_ELEMENT:
            grad[INF_ELEMENT] = float("inf")
        grads.append(grad.view(param.shape).to(param.dtype))
    return grads


def main() -> int:
    config = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(config["out"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = Net().to(torch.bfloat16)
        params = list(model.parameters())
        mount = config["mounts"] if "mounts" in config else config["mount"]
        optimizer = AdamW(params, lr=3e-3, mount=mount, namespace=config["namespace"],
                          grad_dtype=config.get("grad_dtype", "fp8_e4m3"), average_grads=False)
        skipped = []
        for step in range(1, config["last"] + 1):
            for param, grad in zip(params, gradients(step, params, config.get("inf_step", 0))):
                param.grad = grad
            optimizer.step()
            if optimizer.last_step_skipped:
                skipped.append(step)
        result = {"committed_step": optimizer.committed_step, "skipped": skipped}
        torch.save({"params": [p.detach().clone() for p in params], "masters": optimizer.master_weights(),
                    "result": result}, out / f"rank{rank}.pt")
        optimizer.close()
    except Exception as exc:
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
