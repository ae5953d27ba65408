"""One rank of a DCP-checkpointed training job (FSDP2 at 2+ ranks, a plain model in one process) with the cossd optimizer or torch's AdamW, as torchrun would start it; tests/e2e/test_dcp.py runs it."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from cossd.trainer import AdamW

sys.path.insert(0, str(Path(__file__).parent))
from fsdp_job import BASE_LR, Net, full, groups_of, params_of, shard  # noqa: E402
from multirank_job import batch, schedule  # noqa: E402


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint under `root` (rank 0 marks one complete after dcp.save)."""
    done = sorted((int(p.parent.name[4:]), p.parent) for p in root.glob("step*/COMPLETE"))
    return done[-1] if done else None


def make_optimizer(model: Net, config: dict[str, Any]) -> torch.optim.Optimizer:
    if config.get("optimizer") == "torch":
        return torch.optim.AdamW(groups_of(model), lr=BASE_LR, betas=(0.9, 0.95))
    optimizer = AdamW(groups_of(model), lr=BASE_LR, betas=(0.9, 0.95), mount=config["mount"],
                      namespace=config["namespace"], step_timeout_s=60.0)
    if config.get("dcp_form"):
        optimizer.dcp_form = config["dcp_form"]
    return optimizer


def main() -> int:
    config = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out, root = Path(config["out"]), Path(config["checkpoints"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Net()
    if world > 1:
        shard(model, {"dtype": "mixed"})
    optimizer = make_optimizer(model, config)
    timings: dict[str, float] = {}
    first = 1
    found = latest_checkpoint(root) if config.get("resume") else None
    if found is not None:
        step, path = found
        started = time.perf_counter()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        timings["restore_s"] = time.perf_counter() - started
        first = step + 1
    params = params_of(optimizer)
    for step in range(first, config["last"] + 1):
        for group, base in zip(optimizer.param_groups, (BASE_LR, 2 * BASE_LR)):
            group["lr"] = base * schedule(step)
        x, y = batch(step, rank)
        F.cross_entropy(model(x).float(), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % config["save_every"] == 0:
            started = time.perf_counter()
            model_sd, optim_sd = get_state_dict(model, optimizer)
            path = root / f"step{step}"
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
            dist.barrier()
            timings.setdefault("save_s", 0.0)
            timings["save_s"] = max(timings["save_s"], time.perf_counter() - started)
            if rank == 0:
                (path / "COMPLETE").write_text("")
            dist.barrier()
        if config.get("kill_at") == step:
            os.kill(os.getpid(), signal.SIGKILL)  # every rank: the whole job dies, between two saves
        if config.get("stall_at") == step:
            (out / f"stalled{rank}").write_text("")
            time.sleep(600)  # the test kills the daemon, then this rank
    final = [full(p).detach().clone() for p in params]
    masters = optimizer.master_weights() if isinstance(optimizer, AdamW) else None
    if rank == 0:
        torch.save({"params": final, "masters": masters, "first": first, "timings": timings}, out / "rank0.pt")
    if isinstance(optimizer, AdamW):
        optimizer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
