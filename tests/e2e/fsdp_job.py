"""One rank of an FSDP2 (fully_shard) or DDP training job on a cossd mount, as torchrun would start it (RANK, WORLD_SIZE, MASTER_ADDR/PORT); tests/e2e/test_fsdp2.py runs it."""
from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cossd.trainer import AdamW, StepAbortedError

sys.path.insert(0, str(Path(__file__).parent))
# The same schedule and per-rank batches as the ZeRO-1 job's (and its model's sizes).
from multirank_job import BASE_LR, CLASSES, INPUTS, batch, schedule  # noqa: E402

# fc1.weight: 327,680 elements, more than one device block (262,144): at 2 ranks its block 0
# is rows 0..1279 of rank 0 and the start of rank 1's, assembled on the device from both.
# gain: 2 rows, so at 3 ranks the last rank's shard of it is empty.
HIDDEN = 2560


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(INPUTS, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, CLASSES)
        self.gain = torch.nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x))) * (1 + self.gain.sum())


def groups_of(model: Net) -> list[dict[str, Any]]:
    """Two param groups, named: the matrices decay, the rest does not and learns twice as fast."""
    return [{"params": [model.fc1.weight, model.fc2.weight], "param_names": ["fc1.weight", "fc2.weight"],
             "weight_decay": 0.1},
            {"params": [model.fc1.bias, model.fc2.bias, model.gain], "param_names": ["fc1.bias", "fc2.bias", "gain"],
             "weight_decay": 0.0, "lr": 2 * BASE_LR}]


def params_of(optimizer: AdamW) -> list[torch.Tensor]:
    return [param for group in optimizer.param_groups for param in group["params"]]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The global tensor on every rank (a collective for a DTensor: every rank calls it)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def shard(model: Net, config: dict[str, Any]) -> None:
    """fully_shard each layer and the root: FP32 params with BF16 compute and FP32
    reduce-scatter ("mixed"), or a BF16 model as it is ("bf16"); "shard1" places the
    layers' matrices as Shard(1), which the optimizer refuses; "hsdp": [replicas, shards]
    shards over a 2-D mesh (HSDP)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    options: dict[str, Any] = {}
    if config.get("hsdp"):
        # HSDP: replicas x shards, a 2-D mesh (Replicate() over dim 0, Shard(0) over dim 1).
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh("cpu", tuple(config["hsdp"]), mesh_dim_names=("replicate", "shard"))
    if config.get("dtype", "mixed") == "mixed":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if config.get("placement") == "shard1":
        options["shard_placement_fn"] = lambda param: Shard(1) if param.dim() == 2 else None
    fully_shard(model.fc1, **options)
    fully_shard(model.fc2, **options)
    fully_shard(model, **options)


def arm_kill(optimizer: AdamW, kill: dict[str, Any], out: Path, rank: int) -> None:
    """kill -9 of this rank in step kill["step"]: "mid_partition", once the first piece of its
    gradients (its rows of fc1.weight) is on the device, the rest of its partition never
    sent; "before_commit", once all of its gradients are on the device, before its first poll
    for the commit. A note (kill<rank>.json) says where first, for the test."""
    def strike() -> None:
        note = {"stage": kill["stage"], "step": kill["step"], "committed_step": optimizer.committed_step}
        (out / f"kill{rank}.json").write_text(json.dumps(note))
        os.kill(os.getpid(), signal.SIGKILL)

    if kill["stage"] == "mid_partition":
        write = optimizer.files.write_pieces

        def partial(items: list[tuple[str, int, torch.Tensor]], role: str = "grad") -> int:
            if role == "grad" and optimizer.committed_step + 1 == kill["step"] and len(items) > 1:
                write(items[:1], role)  # it returns once the device holds the piece
                strike()
            return write(items, role)

        optimizer.files.write_pieces = partial  # type: ignore[method-assign]
    elif kill["stage"] == "before_commit":
        send = optimizer.files.command

        def command(method: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(method, "__name__", "") == "commit_shared_step" and args[1] == kill["step"]:
                strike()
            return send(method, *args, **kwargs)

        optimizer.files.command = command  # type: ignore[method-assign]
    else:
        raise ValueError(f"unknown kill stage {kill['stage']!r}: mid_partition | before_commit")


def main() -> int:
    config = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = Path(config["out"])
    mode = config["mode"]  # "fsdp", or "ddp" (DDP over FP32 params; one process at world 1)
    distributed = world > 1 or mode == "fsdp"  # fully_shard needs a process group, even of one
    if distributed:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net()
    if config.get("dtype") == "bf16":
        model.to(torch.bfloat16)
    if mode == "fsdp":
        shard(model, config)
    if config.get("preload") is not None:
        # Before the optimizer is made: the values a load of config["preload"] at step 1 gives
        # (the test's reference for a load after the optimizer).
        with torch.no_grad():
            for param in model.parameters():
                param.add_(config["preload"])
    recorder = warnings.catch_warnings(record=True)
    caught = recorder.__enter__()
    warnings.simplefilter("always")
    if config.get("fail_masters_rank") == rank:
        # This rank's load of its masters' rows fails (as a device error or a lost mount would).
        from cossd.trainer.namespace.files import NamespaceFiles

        write = NamespaceFiles.write_pieces

        def failing(self: NamespaceFiles, items: list, role: str = "grad") -> int:
            if role == "master":
                raise OSError(5, "injected: the masters' write failed")
            return write(self, items, role)

        NamespaceFiles.write_pieces = failing  # type: ignore[method-assign]
    try:
        optimizer = AdamW(groups_of(model), lr=BASE_LR, betas=(0.9, 0.95), mount=config.get("mounts") or config["mount"],
                          namespace=config["namespace"], max_grad_norm=config.get("clip"),
                          use_cmb=config.get("use_cmb", True),
                          step_timeout_s=config.get("step_timeout_s", 60.0),
                          param_gather=config.get("param_gather", "device"), grad_dtype=config.get("grad_dtype"))
    except Exception as exc:
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        if world > 1:
            # Torn down before exit: a live gloo group at interpreter exit can abort the process
            # ("terminate called without an active exception") instead of exiting 4.
            dist.destroy_process_group()
        return 4
    net = model
    if mode == "ddp" and world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model)
    compute = torch.bfloat16 if config.get("dtype") == "bf16" else torch.float32
    params = params_of(optimizer)
    grads_seen: dict[int, list[torch.Tensor]] = {}
    first = optimizer.committed_step + 1
    norms = []
    kill = config.get("kill") or {}
    if kill.get("rank") == rank:
        arm_kill(optimizer, kill, out, rank)
    try:
        for step in range(first, config["last"] + 1):
            for group, base in zip(optimizer.param_groups, (BASE_LR, 2 * BASE_LR)):
                group["lr"] = base * schedule(step)
            load = config.get("load") or {}
            if load.get("step") == step and rank in load.get("ranks", ()):
                # Params written outside the optimizer (a load into the model after it was made):
                # the same values, or others; into an FSDP2 DTensor, its local shard.
                with torch.no_grad():
                    for param in params:
                        param.copy_(param.clone()) if load.get("same") else param.add_(0.01)
            x, y = batch(step, rank)
            loss = F.cross_entropy(net(x.to(compute)).float(), y)
            loss.backward()
            overflow = config.get("overflow") or {}
            if overflow.get("rank") == rank and overflow.get("step") == step:
                grad = model.fc1.weight.grad
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                local.view(-1)[5] = float("inf")  # one element of this rank's shard only
            # What the optimizer steps on: the averaged gradients, whole (every rank gathers them).
            seen = [full(p.grad).detach().clone() for p in params]
            if rank == 0:
                grads_seen[step] = seen
            fail_read = config.get("fail_read") or {}
            if fail_read.get("rank") == rank and fail_read.get("step") == step:
                # This rank's next read of params from the device fails, once (a device error).
                read_pieces_into = optimizer.files.read_pieces_into
                failed_once: list[bool] = []

                def failing_read(reads, *args, **kwargs):
                    if not failed_once:
                        failed_once.append(True)
                        if fail_read.get("interrupt"):
                            raise KeyboardInterrupt  # Ctrl-C on this rank, mid-read
                        raise OSError(5, "injected: the params' read failed")
                    return read_pieces_into(reads, *args, **kwargs)

                optimizer.files.read_pieces_into = failing_read
            optimizer.step()
            norms.append(optimizer.last_grad_norm)
            optimizer.zero_grad(set_to_none=True)
    except StepAbortedError as exc:
        # The shared step this rank was in did not commit (another rank never sent all of its
        # gradients): the test checks the message, and that the device kept the step before.
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        optimizer.close()
        return 3
    except KeyboardInterrupt:
        # This rank's own interrupt (fail_read's "interrupt"): it stays one here, once the
        # other ranks have been told of it.
        (out / f"error{rank}.txt").write_text("KeyboardInterrupt")
        optimizer.close()
        return 8
    except RuntimeError as exc:
        if "written outside the optimizer" in str(exc):
            (out / f"error{rank}.txt").write_text(str(exc))
            (out / f"committed{rank}.txt").write_text(str(optimizer.committed_step))
            optimizer.close()
            return 7
        if not kill:
            raise
        # A collective of the job's own with a rank that was killed (gloo: the peer closed
        # the connection), after the device committed the step that rank had completed.
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        (out / f"committed{rank}.txt").write_text(str(optimizer.committed_step))
        optimizer.close()
        return 6
    final = [full(p).detach().clone() for p in params]
    local = [p.to_local().detach().clone() if hasattr(p, "to_local") else None for p in params]
    result = {"committed_step": optimizer.committed_step, "steps_skipped": optimizer.steps_skipped,
              "first": first, "restored": optimizer.restored, "norms": norms,
              "shard": [(piece.name, piece.start, piece.stop) for piece in optimizer._shard],
              # Over several devices (mounts=[...]): each device's rows of this rank, in its pieces.
              "devices": [[(child.entries[piece.index].name, child.entries[piece.index].numel, piece.start, piece.stop)
                           for piece in child._shard] for child in optimizer._group or []],
              "cmb": all(child.files.cmb() is not None for child in optimizer._group or [optimizer]),
              "warnings": [str(w.message) for w in caught]}
    torch.save({"grads": grads_seen, "params": final, "local": local,
                "masters": optimizer.master_weights() if rank == 0 else None, "result": result},
               out / f"rank{rank}.pt")
    optimizer.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
