"""One rank of a training job whose optimizer spreads over several devices (mount=[...]), a tensor split across them, as torchrun would start it; tests/e2e/test_group.py runs it."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from multirank_job import BASE_LR, Net, batch, groups_of, optimizer_params, schedule, synthetic_grads  # noqa: E402

from cossd.trainer import AdamW, DeviceLostError, StepAbortedError  # noqa: E402


def arm(optimizer: Any, kill: dict[str, Any], rank: int, out: Path) -> None:
    """kill -9 at kill["stage"] of step kill["step"]: "between_devices" (this process, after
    device 0 committed the step and before any other device's commit was asked for), or
    "daemon" (the last device's daemon, kill["pid"], once this rank's gradients of the step
    are all sent, before any commit), or "daemon_between" (device kill["device"]'s daemon,
    kill["pid"], once the device before it committed the step and before its own commit
    was asked for; the other devices commit it), or "daemon_after_commit" (device
    kill["device"]'s daemon once it committed the step itself). The devices' commits run at
    once (a thread each): a device held back waits for the event of the one it follows."""
    children = optimizer._group
    followed = threading.Event()  # the device the stage follows has committed the step

    def hold(child: Any, then: str) -> None:
        """Hold `child`'s commit of the step until `followed`, then strike `then`."""
        wait = child._wait_for_commit

        def held(step: int) -> Any:
            if step == kill["step"]:
                if not followed.wait(120):
                    raise RuntimeError("the followed device never committed the step")
                strike(then)
            return wait(step)

        child._wait_for_commit = held

    def signal_after(child: Any) -> None:
        wait = child._wait_for_commit

        def waited(step: int) -> Any:
            answer = wait(step)
            if step == kill["step"]:
                followed.set()
            return answer

        child._wait_for_commit = waited

    def strike(target: str) -> None:
        note = {"stage": kill["stage"], "step": kill["step"], "committed_step": optimizer.committed_step}
        (out / f"kill{rank}.json").write_text(json.dumps(note))
        os.kill(int(kill["pid"]) if target == "daemon" else os.getpid(), signal.SIGKILL)

    if kill["stage"] == "between_devices":
        signal_after(children[0])
        for child in children[1:]:
            hold(child, "self")
    elif kill["stage"] == "daemon_between":
        signal_after(children[kill["device"] - 1])
        hold(children[kill["device"]], "daemon")
    elif kill["stage"] == "daemon_after_commit":
        # Device kill["device"]'s daemon right after it committed the step itself.
        before = children[kill["device"]]
        wait_before = before._wait_for_commit

        def commit_then_strike(step: int) -> Any:
            answer = wait_before(step)
            if step == kill["step"]:
                strike("daemon")
            return answer

        before._wait_for_commit = commit_then_strike
    elif kill["stage"] == "daemon":
        last = children[-1]
        begin = last._begin_shared

        def begin_then_strike(pieces: Any, scale: float) -> float:
            spent = begin(pieces, scale)
            if optimizer.committed_step + 1 == kill["step"]:
                strike("daemon")
            return spent

        last._begin_shared = begin_then_strike


def main() -> int:
    config = json.loads(sys.argv[1])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    out = Path(config["out"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = Net()
    caught = warnings.catch_warnings(record=True)
    seen = caught.__enter__()
    warnings.simplefilter("always")
    try:
        optimizer = AdamW(groups_of(model), lr=BASE_LR, betas=(0.9, 0.95), mount=config["mounts"],
                          namespace=config["namespace"], max_grad_norm=config.get("clip"),
                          step_timeout_s=config.get("step_timeout_s", 60.0))
    except Exception as exc:
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        if world > 1:
            # Torn down before exit: a live gloo group at interpreter exit can abort the process
            # ("terminate called without an active exception") instead of exiting 4.
            dist.destroy_process_group()
        return 4
    model.to(torch.bfloat16)
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 and not config.get("synthetic") else model
    kill = config.get("kill") or {}
    if kill and kill.get("rank", 0) == rank:
        arm(optimizer, kill, rank, out)
    params = optimizer_params(optimizer)
    grads_seen: dict[int, list[torch.Tensor]] = {}
    first = optimizer.committed_step + 1
    try:
        for step in range(first, config["last"] + 1):
            for group, base in zip(optimizer.param_groups, (BASE_LR, 2 * BASE_LR)):
                group["lr"] = base * schedule(step)
            if config.get("synthetic"):
                for param, grad in zip(params, synthetic_grads(step, params)):
                    param.grad = grad
            else:
                x, y = batch(step, rank)
                F.cross_entropy(net(x.to(torch.bfloat16)).float(), y).backward()
            overflow = config.get("overflow") or {}
            if overflow.get("rank") == rank and overflow.get("step") == step:
                model.fc2.bias.grad.view(-1)[1] = float("inf")  # on one rank, one device's tensor
            grads_seen[step] = [p.grad.detach().clone() for p in params]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except (StepAbortedError, DeviceLostError, OSError) as exc:
        (out / f"aborted{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        return 3
    finally:
        caught.__exit__(None, None, None)
    result = {"committed_step": optimizer.committed_step, "steps_skipped": optimizer.steps_skipped,
              "restored": optimizer.restored, "first": first, "warnings": [str(w.message) for w in seen]}
    torch.save({"params": [p.detach().clone() for p in params], "masters": optimizer.master_weights(),
                "grads": grads_seen, "result": result,
                "devices": [[(entry.name, entry.numel) for entry in child.entries] for child in optimizer._group]},
               out / f"rank{rank}.pt")
    optimizer.close()
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
