"""One process over several devices (mount=[...], fc1.weight split) that saves a DCP checkpoint by reference, trains on, and is killed (-9) at one stage of loading it back, or has a device's daemon killed there; tests/e2e/test_dcp_group.py runs it."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

sys.path.insert(0, str(Path(__file__).parent))
from multirank_job import BASE_LR, Net, groups_of, optimizer_params, synthetic_grads  # noqa: E402

from cossd.trainer import AdamW  # noqa: E402

SAVED_AT, TRAINED_TO = 2, 4


def open_optimizer(mounts: list[str] | str, namespace: str) -> tuple[Net, AdamW]:
    torch.manual_seed(0)
    model = Net()
    return model, AdamW(groups_of(model), lr=BASE_LR, betas=(0.9, 0.95), mount=mounts, namespace=namespace)


def train(optimizer: AdamW, steps: range) -> None:
    params = optimizer_params(optimizer)
    for step in steps:
        for param, grad in zip(params, synthetic_grads(step, params)):
            param.grad = grad
        optimizer.step()


def main() -> int:
    config = json.loads(sys.argv[1])
    model, optimizer = open_optimizer(config["mounts"], config["namespace"])
    train(optimizer, range(1, SAVED_AT + 1))
    dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=config["checkpoint"])
    train(optimizer, range(SAVED_AT + 1, TRAINED_TO + 1))

    def hook(stage: str) -> None:
        # The job itself killed, or (config["daemon_pid"]) a device's daemon, the job going on
        # to meet a dead device at its next command there.
        if stage == config["stage"]:
            os.kill(config.get("daemon_pid") or os.getpid(), signal.SIGKILL)

    optimizer.load_hook = hook
    template = get_optimizer_state_dict(model, optimizer)
    dcp.load({"optim": template}, checkpoint_id=config["checkpoint"])
    try:
        set_optimizer_state_dict(model, optimizer, template)
    except Exception as exc:  # the dead device: the load fails, saying so
        (Path(config["checkpoint"]).parent / "failed.txt").write_text(f"{type(exc).__name__}: {exc}")
        return 3
    finally:
        optimizer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
