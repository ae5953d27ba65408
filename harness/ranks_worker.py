"""One rank of `cossd bench --sections ranks`: a sharded cossd AdamW on a shared namespace, its steps timed, its params back read from the device or all-gathered (started by harness/bench/ranks.py as torchrun would: RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ..trainer import AdamW


def main() -> int:
    config = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # the ranks share the machine's cores, as torchrun's do
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(config["width"], config["width"], bias=False) for _ in range(config["layers"])]
    model = torch.nn.Sequential(*layers).to(torch.bfloat16)
    params = list(model.parameters())
    # The gradients are taken as averaged already (as DDP leaves them): the step alone is timed.
    gather = config.get("param_gather", "device")
    optimizer = AdamW(params, mount=config["mount"], namespace=f"ranks-{gather}", lr=1e-4, average_grads=False,
                      param_gather=gather)
    generator = torch.Generator().manual_seed(1)
    grads = [(torch.randn(p.shape, generator=generator) * 0.01).to(torch.bfloat16) for p in params]
    step_s: list[float] = []
    params_s: list[float] = []
    moved: list[dict[str, int]] = []  # the params' bytes of each timed step: from the device, all-gathered
    total = sum(2 * p.numel() for p in params)  # BF16 params: what reading every one of them moves
    before: dict[str, int] = {}
    try:
        for index in range(config["warmup"] + config["steps"]):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            if world > 1:
                dist.barrier()  # every rank starts the step together: the slowest sets the time
            if index == config["warmup"]:
                # The device's counts, every rank's, from here: read while every rank waits
                # (all of the warm-up's traffic is in, none of the timed steps' yet).
                if rank == 0:
                    before = optimizer.files.statistics()
                if world > 1:
                    dist.barrier()
            started = time.perf_counter()
            optimizer.step()
            if index >= config["warmup"]:
                step_s.append(time.perf_counter() - started)
                params_s.append(optimizer.last_timing.get("params_s", 0.0))
                if world > 1 and gather == "allgather":
                    moved.append(dict(optimizer.last_param_bytes or {}))
                else:
                    moved.append({"device": total, "allgather_sent": 0, "allgather_received": 0})
        if world > 1:
            dist.barrier()
        counted = {}
        if rank == 0:
            after = optimizer.files.statistics()
            counted = {key: after[key] - before[key] for key in ("grad_bytes_in", "bytes_read", "steps_committed")}
        # One process steps every param; a rank of a job its shard (which may be empty).
        shard_elements = sum(p.numel() for p in params) if world == 1 else \
            sum(piece.numel for piece in optimizer._shard)
        print(json.dumps({"rank": rank, "step_s": step_s, "params_s": params_s, "moved": moved,
                          "param_gather": gather, "shard_elements": shard_elements,
                          "elements": sum(p.numel() for p in params),
                          "committed_step": optimizer.committed_step, "device": counted}), flush=True)
    finally:
        optimizer.close()
        if world > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
