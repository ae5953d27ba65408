"""One rank of a DeepSpeed job (deepspeed.initialize with a cossd AdamW) on a cossd mount, started as torchrun or the deepspeed launcher would start it; tests/e2e/test_deepspeed_zero.py runs it."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator at import

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cossd.trainer import AdamW, StepAbortedError  # noqa: E402

MICRO_BATCH, LR = 8, 1e-2


class Tiny(torch.nn.Module):
    """16 -> hidden -> 16: 2,128 params at the hidden width of 64 the tests train."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, hidden)
        self.fc2 = torch.nn.Linear(hidden, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def groups(model: torch.nn.Module) -> list[dict]:
    """The usual decay / no-decay split."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's micro-batch of a step, fixed by (step, rank): a random linear teacher's labels."""
    teacher = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
    x = torch.randn(MICRO_BATCH, 16, generator=torch.Generator().manual_seed(7919 * step + rank))
    return x, (x @ teacher).argmax(dim=1)


def ds_config(config: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
           "gradient_clipping": 1.0, "zero_optimization": {"stage": config["stage"]} | config.get("zero", {}),
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    if config["precision"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif config["precision"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def main() -> int:
    # The last argument: the deepspeed launcher puts --local_rank=N before it (torchrun does not).
    config = json.loads(sys.argv[-1])
    rank = int(os.environ["RANK"])
    os.environ.setdefault("LOCAL_RANK", str(rank))
    out = Path(config["out"])
    warnings.simplefilter("ignore")
    if config["precision"] == "fp16":
        # DeepSpeed's CPU accelerator refuses FP16 where oneDNN has no FP16 kernels; torch runs it anywhere.
        from deepspeed.accelerator import get_accelerator
        type(get_accelerator()).is_fp16_supported = lambda self: True
    torch.manual_seed(0)
    model = Tiny(config.get("hidden", 64))
    early = None
    if config.get("optimizer_before_ranks"):
        # Made before any process group, where only the launcher's WORLD_SIZE tells of the
        # ranks; what committed_step reads then is recorded.
        optimizer = AdamW(groups(model), lr=LR, mount=config["mount"], namespace=config["namespace"],
                          step_timeout_s=config.get("step_timeout_s", 60.0))
        early = optimizer.committed_step
    deepspeed.init_distributed("gloo")
    try:
        if config.get("torch"):  # the reference: torch's AdamW under the same DeepSpeed config
            optimizer = torch.optim.AdamW(groups(model), lr=LR)
        elif not config.get("optimizer_before_ranks"):
            mount = config.get("mount_of_rank", {}).get(str(rank), config["mount"])
            optimizer = AdamW(groups(model), lr=LR, mount=mount, namespace=config["namespace"],
                              step_timeout_s=config.get("step_timeout_s", 60.0), grad_dtype=config.get("grad_dtype"))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(config))
    except Exception as exc:
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        dist.destroy_process_group()
        return 4
    kill = config.get("kill") or {}
    if kill.get("rank") == rank:
        # kill -9 of this rank in step kill["step"], once its partition of param group 0 is on
        # the device and before its partition of group 1 goes: the step cannot commit.
        write = optimizer.files.write_pieces

        def write_pieces(items, role="grad"):
            if (role == "grad" and optimizer.committed_step + 1 == kill["step"]
                    and any(name == "zero.g1" for name, _, _ in items)):
                (out / f"kill{rank}.json").write_text(json.dumps({"committed_step": optimizer.committed_step}))
                os.kill(os.getpid(), signal.SIGKILL)
            return write(items, role=role)

        optimizer.files.write_pieces = write_pieces
    checkpoints = config.get("checkpoints")
    timings: dict[str, float] = {}
    if config.get("load_tag"):
        # A restart from a DeepSpeed checkpoint: the device rolls back to its tag's snapshot.
        try:
            dist.barrier()
            started = time.perf_counter()
            loaded, _ = engine.load_checkpoint(checkpoints, tag=config["load_tag"])
            dist.barrier()
            timings["restore_s"] = time.perf_counter() - started
        except Exception as exc:
            (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
            return 5
        assert loaded is not None, f"no checkpoint {config['load_tag']} in {checkpoints}"
    dtype = next(engine.module.parameters()).dtype
    # cossd: where the device stands; torch's AdamW: where DeepSpeed's checkpoint left the engine.
    first = getattr(optimizer, "committed_step", engine.global_steps) + 1
    losses = {}
    try:
        for step in range(first, config["last"] + 1):
            x, y = batch(step, rank)
            loss = F.cross_entropy(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            losses[step] = loss.item()
            if config.get("save_every") and step % config["save_every"] == 0:
                dist.barrier()  # the save stall: every rank from the step's end to the save's
                started = time.perf_counter()
                engine.save_checkpoint(checkpoints, tag=f"step{step}")
                dist.barrier()
                timings["save_s"] = time.perf_counter() - started
            if step == config.get("kill_at"):
                dist.barrier()  # every rank past the step, then the whole job is killed (kill -9)
                os.kill(os.getpid(), signal.SIGKILL)
            if step == config.get("stall_at"):
                (out / f"stalled{rank}").write_text(str(step))  # the test kills the daemon, then us
                time.sleep(3600)
    except StepAbortedError as exc:
        (out / f"error{rank}.txt").write_text(f"{exc}\ncommitted_step={optimizer.committed_step}")
        return 3
    if config["stage"] == 3:
        # ZeRO-3 keeps each rank's slice only (the module's params are empty between
        # forwards): gathered whole on every rank to be compared.
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().clone() for p in engine.module.parameters()]
    else:
        params = [p.detach().clone() for p in engine.module.parameters()]
    if config.get("torch"):
        torch.save({"result": {"losses": losses, "first": first, "timings": timings}, "params": params},
                   out / f"rank{rank}.pt")
    else:
        result = {"committed_step": optimizer.committed_step, "first": first, "restored": optimizer.restored,
                  "early_committed_step": early,
                  "losses": losses, "names": [(e.name, e.numel) for e in optimizer.entries], "timings": timings}
        torch.save({"result": result, "params": params,
                    "masters": optimizer.master_weights() if rank == 0 else None}, out / f"rank{rank}.pt")
        optimizer.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
