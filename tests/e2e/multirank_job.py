"""One rank of a multi-rank training job on a cossd mount, as torchrun would start it (RANK, WORLD_SIZE, MASTER_ADDR/PORT); tests/e2e/test_multirank.py runs it."""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cossd.trainer import AdamW, DeviceLostError, StepAbortedError

INPUTS, HIDDEN, CLASSES = 128, 2560, 64  # fc1.weight: 327,680 elements, more than one device block


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(INPUTS, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def groups_of(model: Net) -> list[dict]:
    """Two param groups: the matrices decay, the biases do not and learn twice as fast."""
    return [{"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
            {"params": [model.fc1.bias, model.fc2.bias], "weight_decay": 0.0, "lr": 2 * BASE_LR}]


BASE_LR, WARMUP, TOTAL = 3e-3, 5, 60


def schedule(step: int) -> float:
    """Warmup then cosine, as a multiplier of each group's base lr, for step `step` (from 1)."""
    if step <= WARMUP:
        return step / WARMUP
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - WARMUP) / (TOTAL - WARMUP))))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's micro-batch of a step: its own data, fixed by (step, rank)."""
    generator = torch.Generator().manual_seed(7919 * step + rank)
    return (torch.randn(8, INPUTS, generator=generator),
            torch.randint(0, CLASSES, (8,), generator=generator))


def synthetic_grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients already averaged, the same on every rank and at any world size: a job
    resumed at another world size then trains on exactly the gradients it would have had."""
    generator = torch.Generator().manual_seed(104729 * step)
    return [(torch.randn(p.shape, generator=generator) * 0.01).to(p.dtype) for p in params]


def held_under(folder: str) -> list[str]:
    """The paths under `folder` that this process has open (its /proc/self/fd links)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed since
            continue
        if target == folder or target.startswith(folder.rstrip("/") + "/"):
            held.append(target)
    return held


def main() -> int:
    config = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(config["out"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank (rank 0's go to the device)
    model = Net()
    if config.get("preload") is not None:
        # Before the optimizer is made: the values a load of config["preload"] into the BF16
        # model at step 1 gives (the test's reference for a load after the optimizer).
        model.load_state_dict({key: (value.detach().to(torch.bfloat16) + config["preload"]).float()
                               for key, value in model.state_dict().items()})
    bases = [BASE_LR, 2 * BASE_LR]
    recorder = warnings.catch_warnings(record=True)  # every warning of the run, for the test
    caught = recorder.__enter__()
    warnings.simplefilter("always")
    mount = config.get("mount_of_rank", {}).get(str(rank), config["mount"])
    try:
        optimizer = make_optimizer(model, config, mount)
    except Exception as exc:
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        # What of the device this process still holds open (a failed construction leaves nothing).
        (out / f"held{rank}.txt").write_text("\n".join(held_under(str(mount))))
        if world > 1:
            # Torn down before exit: a live gloo group at interpreter exit can abort the process
            # ("terminate called without an active exception") instead of exiting 4.
            dist.destroy_process_group()
        return 4
    model.to(torch.bfloat16)
    ddp = config["ddp"] and world > 1 and not config.get("synthetic")
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    kill = config.get("kill") or {}
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's restarts so far
    if kill.get("rank") != rank or kill.get("attempt", attempt) != attempt:
        kill = {}  # not this rank's kill, or not on this attempt (torchrun's restart runs clean)
    if kill.get("stage") == "mid_grads" and not optimizer._shard:
        kill["stage"] = "after_join"  # a rank with no shard has no gradients to be killed amid

    def strike() -> None:
        """kill -9 of this rank, or of the device's daemon (kill["pid"]) where the target is
        the daemon; a note first says where, for the test's expectations."""
        note = {"stage": kill["stage"], "step": kill["step"], "shard_empty": not optimizer._shard,
                "committed_step": optimizer.committed_step, "target": kill.get("target", "self")}
        (out / f"kill{rank}.json").write_text(json.dumps(note))
        if note["target"] == "daemon":
            os.kill(int(kill["pid"]), signal.SIGKILL)
        else:
            os.kill(os.getpid(), signal.SIGKILL)

    if kill.get("stage") in ("after_join", "before_commit", "after_commit"):
        # After this rank joined step kill["step"] (before its gradients go), before its first
        # poll for the commit (its gradients all sent), or once the commit answered (before
        # the params come back).
        send = optimizer.files.command
        struck = False

        def command(method, *args, **kwargs):
            nonlocal struck
            name = getattr(method, "__name__", "")
            if (not struck and kill["stage"] == "before_commit" and name == "commit_shared_step"
                    and args[1] == kill["step"]):
                struck = True
                strike()
            answer = send(method, *args, **kwargs)
            if (not struck and kill["stage"] == "after_join" and name == "begin_shared_step"
                    and args[1] == kill["step"]):
                struck = True
                strike()
            if (not struck and kill["stage"] == "after_commit" and name == "commit_shared_step"
                    and args[1] == kill["step"] and "waiting" not in answer):
                struck = True
                strike()
            return answer

        optimizer.files.command = command
    if kill.get("stage") == "mid_grads":
        # In the middle of this rank's gradients of step kill["step"]: half of its first piece
        # reaches the device, the rest never does.
        write = optimizer.files.write_pieces

        def partial(items):
            if optimizer.committed_step + 1 == kill["step"] and items:
                tensor, first, values = items[0]
                write([(tensor, first, values[: max(1, values.numel() // 2)])])
                strike()
            return write(items)

        optimizer.files.write_pieces = partial
    if config.get("fail_masters_once") == rank:
        # This rank's first write of master weights fails (a device error, a lost mount),
        # as the weights loaded before the first step are written as the masters.
        write_pieces = optimizer.files.write_pieces
        failed_once: list[bool] = []

        def failing_once(items, role="grad"):
            if role == "master" and not failed_once:
                failed_once.append(True)
                raise OSError(5, "injected: the masters' write failed")
            return write_pieces(items, role=role)

        optimizer.files.write_pieces = failing_once
    grads_seen: dict[int, list[torch.Tensor]] = {}
    first = optimizer.committed_step + 1
    try:
        for step in range(first, config["last"] + 1):
            for group, base in zip(optimizer.param_groups, bases):
                group["lr"] = base * schedule(step)
            load = config.get("load") or {}
            if load.get("step") == step and rank in load.get("ranks", ()):
                # Weights written into the model outside the optimizer (a model.load_state_dict
                # after it was made): the same values, or others.
                shift = 0.0 if load.get("same") else 0.01
                model.load_state_dict({key: value.detach() + shift for key, value in model.state_dict().items()})
            if config.get("synthetic"):
                for param, grad in zip(optimizer_params(optimizer), synthetic_grads(step, optimizer_params(optimizer))):
                    param.grad = grad
            else:
                x, y = batch(step, rank)
                loss = F.cross_entropy(net(x.to(torch.bfloat16)).float(), y)
                loss.backward()
            overflow = config.get("overflow") or {}
            if overflow.get("rank") == rank and overflow.get("step") == step:
                model.fc1.weight.grad.view(-1)[5] = float("inf")  # one element, on this rank only
            if kill.get("stage") == "before_step" and kill["step"] == step:
                strike()
            if kill.get("stage") == "timer" and kill["step"] == step:
                # At a random instant from here (kill["delay_s"]): whatever the ranks are doing.
                timer = threading.Timer(kill["delay_s"], strike)
                timer.daemon = True  # a job that ended first leaves the daemon alone (the test sees it)
                timer.start()
            if rank == 0:
                # What the optimizer starts from: DDP's averages, or this rank's own (the test
                # averages every rank's for a job without DDP).
                grads_seen[step] = [p.grad.detach().clone() for p in optimizer_params(optimizer)]
            elif not config["ddp"]:
                grads_seen[step] = [p.grad.detach().clone() for p in optimizer_params(optimizer)]
            try:
                optimizer.step()
            except RuntimeError as exc:
                if config.get("fail_masters_once") is None or "writing them as the masters failed" not in str(exc):
                    raise
                # What the optimizer says between the failed write and the next step(), then
                # that step() again (the same gradients): it writes the masters again.
                seen = {"error": str(exc), "committed_step": optimizer.committed_step}
                try:
                    optimizer.state_dict()
                except Exception as refusal:
                    seen["state_dict"] = f"{type(refusal).__name__}: {refusal}"
                (out / f"retried{rank}.json").write_text(json.dumps(seen))
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    except StepAbortedError as exc:
        (out / f"error{rank}.txt").write_text(str(exc))
        optimizer.close()
        return 3
    except DeviceLostError as exc:
        # The device's daemon died: say so, with the last step this rank saw committed (the
        # test checks the device kept it), and close what can be closed.
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        (out / f"lost{rank}.json").write_text(json.dumps({"committed_step": optimizer.committed_step}))
        try:
            optimizer.close()
        except Exception:  # the mount is dead: nothing more to release on it
            pass
        return 5
    except RuntimeError as exc:  # after DeviceLostError, a RuntimeError too
        if "written outside the optimizer" not in str(exc):
            raise
        (out / f"error{rank}.txt").write_text(str(exc))
        (out / f"refused{rank}.json").write_text(json.dumps({"committed_step": optimizer.committed_step}))
        optimizer.close()
        return 6
    result = {"committed_step": optimizer.committed_step, "steps_skipped": optimizer.steps_skipped,
              "first": first, "restored": optimizer.restored, "attempt": attempt,
              "warnings": [str(w.message) for w in caught]}
    torch.save({"grads": grads_seen, "params": [p.detach().clone() for p in optimizer_params(optimizer)],
                "masters": optimizer.master_weights() if rank == 0 else None, "result": result},
               out / f"rank{rank}.pt")
    optimizer.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def make_optimizer(model: Net, config: dict, mount: str) -> AdamW:
    return AdamW(groups_of(model), lr=BASE_LR, betas=(0.9, 0.95), mount=mount, namespace=config["namespace"],
                 max_grad_norm=config.get("clip"), step_timeout_s=config.get("step_timeout_s", 60.0),
                 use_cmb=config.get("use_cmb", True), average_grads=False if config.get("synthetic") else None)


def optimizer_params(optimizer: AdamW) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


if __name__ == "__main__":
    sys.exit(main())
