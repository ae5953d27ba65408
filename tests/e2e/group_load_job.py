"""One process loading another optimizer state over several devices (mount=[...], a tensor split across them) and killed (-9) at one stage of the group's replace; tests/e2e/test_group_load.py runs it."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from multirank_job import BASE_LR, Net, groups_of, optimizer_params, synthetic_grads  # noqa: E402

from cossd.trainer import AdamW  # noqa: E402

TRAINED_STEPS = 3  # state A: the job's own, after these steps
LOADED_STEP = 7    # state B: another run's, at this step


def other_state(saved: dict[str, Any]) -> dict[str, Any]:
    """State B: A's layout with other moments and masters, at another step (what another
    run's checkpoint would hold)."""
    other = {"state": {}, "param_groups": [dict(group) for group in saved["param_groups"]],
             "cossd_master": {index: (values * 0.5 + 0.01).clone() for index, values in saved["cossd_master"].items()}}
    for index, entry in saved["state"].items():
        other["state"][index] = {"step": torch.tensor(float(LOADED_STEP)),
                                 "exp_avg": entry["exp_avg"] * -2.0 + 0.001,
                                 "exp_avg_sq": entry["exp_avg_sq"] * 3.0 + 1e-6}
    other["param_groups"][0]["lr"] = 0.5 * BASE_LR  # the options come with it
    return other


def open_group(config: dict[str, Any]) -> AdamW:
    torch.manual_seed(0)
    return AdamW(groups_of(Net()), lr=BASE_LR, betas=(0.9, 0.95), mount=config["mounts"],
                 namespace=config["namespace"])


def main() -> int:
    config = json.loads(sys.argv[1])
    out = Path(config["out"])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # every rank loads the same state; rank 0 replaces it on the devices
        dist.init_process_group("gloo", rank=rank, world_size=world)
    optimizer = open_group(config)
    params = optimizer_params(optimizer)
    for step in range(1, TRAINED_STEPS + 1):
        for param, grad in zip(params, synthetic_grads(step, params)):
            param.grad = grad
        optimizer.step()
    saved = optimizer.state_dict()
    other = other_state(saved)
    if rank == 0:
        torch.save({"a": saved, "b": other}, out / "states.pt")

    def hook(stage: str) -> None:
        if stage == config["stage"]:
            os.kill(os.getpid(), signal.SIGKILL)

    optimizer.load_hook = hook
    optimizer.load_state_dict(other)
    (out / f"loaded{rank}.json").write_text(json.dumps({"committed_step": optimizer.committed_step}))
    for step in range(LOADED_STEP + 1, LOADED_STEP + 1 + config.get("then", 0)):
        for param, grad in zip(params, synthetic_grads(step, params)):
            param.grad = grad  # the same on every rank: their mean is themselves
        optimizer.step()
    torch.save({"params": [p.detach().clone() for p in params], "state": optimizer.state_dict()},
               out / f"rank{rank}.pt")
    optimizer.close()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
