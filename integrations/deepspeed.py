"""Which of DeepSpeed's optimizer wrappers a cossd optimizer can step under, found from the call.

DeepSpeed wraps the optimizer a script passes to `deepspeed.initialize`: for FP16/BF16 it
keeps FP32 master copies of the params (FP16_UnfusedOptimizer), for ZeRO 1/2 one flat FP32
partition per param group (DeepSpeedZeroOptimizer, BF16_Optimizer), and puts those in the
optimizer's param groups in place of the model's params. cossd's optimizer follows them
(rebind.Rebind._rebind); this module refuses, with the reason, the wrappers and configs it
cannot follow: ZeRO-3 that deepspeed.initialize did not bind, ZeRO-3's hpZ (partitions other
than one per data-parallel rank), and DeepSpeed's own optimizer offload (cossd's
state already lives on the device).
Nothing here imports deepspeed or the trainer: it only reads DeepSpeed's objects (the
engine's config, the calling wrapper), and is consulted where deepspeed is imported already.
The hooks that open a cossd optimizer's namespace at deepspeed.initialize, and the ZeRO 1/2/3
bindings, are the trainer's (cossd.trainer.deepspeed.zero, deepspeed_zero3).
"""
from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch

# Where DeepSpeed's ZeRO-3 and offload classes live; matched by module, not imported.
_STAGE3_MODULES = ("deepspeed.runtime.zero.stage3", "deepspeed.runtime.superoffload")


def calling_wrapper(optimizer: torch.optim.Optimizer) -> Any | None:
    """The DeepSpeed object whose method is calling into `optimizer` (a wrapper holds it as
    `.optimizer`), found on the stack; None where DeepSpeed is not the caller."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if (candidate is not None and candidate is not optimizer
                and type(candidate).__module__.startswith("deepspeed.")
                and getattr(candidate, "optimizer", None) is optimizer):
            return candidate
        frame = frame.f_back
    return None


def check_rebind(optimizer: torch.optim.Optimizer, old: list[torch.Tensor], new: list[torch.Tensor]) -> None:
    """Raise, saying why, where the params DeepSpeed put in place of `old` cannot be followed."""
    wrapper = calling_wrapper(optimizer)
    module = type(wrapper).__module__ if wrapper is not None else ""
    zero3 = module.startswith(_STAGE3_MODULES) or any(hasattr(p, "ds_id") for p in old + new)
    if zero3:
        raise NotImplementedError(
            "DeepSpeed ZeRO stage 3 put its flat sub-groups in this cossd optimizer's param groups "
            "without deepspeed.initialize binding it (a wrapper cossd does not know): a cossd namespace "
            "follows ZeRO-3 only where deepspeed.initialize is given the cossd optimizer itself")
    if wrapper is None:
        return
    if getattr(wrapper, "cpu_offload", False) or getattr(wrapper, "offload_optimizer", False):
        raise NotImplementedError(
            "DeepSpeed's optimizer offload (zero_optimization.offload_optimizer) and a cossd "
            "optimizer both move the optimizer state off the accelerator; the cossd device "
            "already holds it. Remove offload_optimizer from the DeepSpeed config")
    if getattr(wrapper, "zenflow", False):
        raise NotImplementedError("DeepSpeed ZenFlow steps its own CPU optimizer; it does not run "
                                  "with a cossd optimizer")


def world_size() -> int:
    """The job's world size (DeepSpeed's data-parallel ranks; cossd supports no model parallelism)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


# The variables that launchers set in each rank's environment before any process group
# exists: torchrun and DeepSpeed's launcher (WORLD_SIZE), Open MPI (mpirun, and DeepSpeed's
# MPI-based launchers), MPICH and Intel MPI (PMI_SIZE).
_LAUNCHER_WORLD_VARIABLES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def expected_world_size() -> int:
    """The job's world size as known now: torch.distributed's where it is initialized, else
    the largest that a launcher's variable announces (1 where none is set or readable)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    sizes = [1]
    for variable in _LAUNCHER_WORLD_VARIABLES:
        try:
            sizes.append(int(os.environ.get(variable, "1")))
        except ValueError:  # not a number: says nothing about the job
            continue
    return max(sizes)


def refuse_config(engine: Any) -> None:
    """NotImplementedError, naming the combination, for a DeepSpeed config a cossd optimizer
    does not run under: raised in deepspeed.initialize, before anything reaches the device."""
    stage = int(engine.zero_optimization_stage())
    world = world_size()
    precision = "BF16" if engine.bfloat16_enabled() else "FP16" if engine.fp16_enabled() else "FP32"
    combination = f"DeepSpeed ZeRO stage {stage}, {precision}, {world} rank{'s' if world > 1 else ''}"
    zero = engine._config.zero_config if hasattr(engine, "_config") else None
    if stage == 3 and zero is not None and int(getattr(zero, "zero_hpz_partition_size", 1) or 1) > 1:
        raise NotImplementedError(
            f"{combination} with zero_hpz_partition_size {zero.zero_hpz_partition_size} (hpZ): its secondary "
            "partitions of the params are DeepSpeed's own; cossd runs ZeRO-3 with one partition per "
            "data-parallel rank. Remove zero_hpz_partition_size")
    if engine.zero_cpu_offload() or getattr(engine, "zenflow", False):
        raise NotImplementedError(
            f"{combination} with optimizer offload: DeepSpeed's optimizer offload "
            "(zero_optimization.offload_optimizer, or ZenFlow) and a cossd optimizer both move the "
            "optimizer state off the accelerator; the cossd device already holds it. Remove "
            "offload_optimizer from the DeepSpeed config")
    if stage == 0 and world > 1:
        raise NotImplementedError(
            f"{combination}: with several ranks a cossd optimizer runs under ZeRO stage 1, 2 or 3 "
            "(each rank's partition goes to one namespace, one step for all ranks); set "
            "zero_optimization.stage to 1, 2 or 3")
    if stage in (1, 2) and zero is not None and getattr(zero, "round_robin_gradients", False):
        raise NotImplementedError(
            f"{combination} with round_robin_gradients: its flat groups' order depends on the "
            "world size, where a cossd namespace keeps one order; remove round_robin_gradients")


# DeepSpeedEngine's methods that save or load a ZeRO checkpoint's optimizer state; `tag` is
# a local of each (the checkpoint's tag, resolved from `latest` where the caller gave none).
_CHECKPOINT_METHODS = ("_save_zero_checkpoint", "_load_zero_checkpoint")


def checkpoint_tag() -> str | None:
    """The tag of the DeepSpeed checkpoint being saved or loaded, where DeepSpeedEngine's
    save_checkpoint or load_checkpoint is the caller (found on the stack); else None."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if (frame.f_code.co_name in _CHECKPOINT_METHODS and candidate is not None
                and type(candidate).__module__.startswith("deepspeed.")):
            tag = frame.f_locals.get("tag")
            return None if tag is None else str(tag)
        frame = frame.f_back
    return None
