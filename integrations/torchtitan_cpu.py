"""Runs torchtitan's trainer (`torchtitan.train`) on a machine without a GPU: its device set to the CPU, the rest of torchtitan as shipped.

torchtitan 0.3.0 picks its device once, at the import of `torchtitan/tools/utils.py`
(line 55: `_get_available_device_type() or "cuda"`), with no option for the CPU: on a
CPU-only torch its Trainer stops at `torchtitan/trainer.py` line 301,
`device_module.set_device(self.device)` -> `torch.cuda.set_device`, `AttributeError: module
'torch._C' has no attribute '_cuda_setDevice'`. This launcher sets that module's
`device_type` to "cpu" (so torch.distributed takes gloo, the model and its data go to the
CPU) and `device_module` to `CpuDeviceModule`, which answers the calls torchtitan makes of
a device module (memory statistics included), before any other torchtitan module reads
them, then runs torchtitan's own `main()`. Its arguments are torchtitan.train's:

    torchrun --nproc-per-node 2 -m cossd.integrations.torchtitan_cpu \\
        --module cossd.trainer.torchtitan --config llama3_debugmodel_cossd ...

`for_cpu(config)` adapts a trainer config to the CPU and gloo where torchtitan's defaults
need a GPU: see its docstring. On a GPU none of this is needed: `torchrun -m
torchtitan.train` with the config as it is.
"""
from __future__ import annotations

import os
import sys
from functools import wraps
from types import SimpleNamespace
from typing import Any, Callable

import torch


class CpuDeviceModule:
    """The parts of a torch device module (torch.cuda's interface) that torchtitan calls,
    for the CPU: one device, no allocator statistics (reported as none, so torchtitan's
    memory figures read 0)."""

    @staticmethod
    def set_device(device: Any) -> None:
        pass  # one CPU device: nothing to select

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def synchronize(device: Any = None) -> None:
        pass  # CPU ops are synchronous

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> SimpleNamespace:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return SimpleNamespace(name="cpu", total_memory=pages * page_size)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def use_cpu() -> None:
    """Point torchtitan's device selection at the CPU. Must run before torchtitan's other
    modules are imported: several copy `device_type`/`device_module` at their import."""
    already = [name for name in ("torchtitan.trainer", "torchtitan.distributed.utils", "torchtitan.components.metrics")
               if name in sys.modules]
    if already:
        raise RuntimeError(f"use_cpu() must run before torchtitan's {already[0]} is imported")
    if torch.cuda.is_available():
        return  # a GPU: torchtitan's own choice stands
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = CpuDeviceModule


def add_set_timeout() -> None:
    """torchtitan 0.3.0 calls `torch.distributed.set_timeout(timeout, group)` after the first
    step (trainer.py line 1062 -> distributed/utils.py line 595), a function torch 2.13.0
    does not have: where it is missing, it is torch's own `_set_pg_timeout`, which does
    exactly that (the same on a GPU machine with torch 2.13)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout  # type: ignore[attr-defined]


def for_cpu(config: Any) -> Any:
    """A torchtitan Trainer.Config adapted to CPU and gloo, through torchtitan's own config
    tree, for what its defaults need a GPU for:

    - attention: `ScaledDotProductAttention` in place of FlexAttention (torch's
      flex_attention has no backward on the CPU: "FlexAttention does not support backward on
      CPU"; the varlen backend calls CUDA's flash kernel). torchtitan's LM configs refuse
      "sdpa" by name because it attends across the documents packed in a sequence, not
      within each: so does this config.
    - `parallelism.spmd_backend = "partial_dtensor"`: FSDP2's fully_shard over the 1-D
      data-parallel mesh (the "spmd_types" default fails at 2 gloo ranks in fully_shard:
      "all parameters must be DTensors on the full SPMD mesh").
    - FSDP2's gradient reduction as SUM (`set_force_sum_reduction_for_comms`): torchtitan
      sets the divide factor to 1 (it scales the loss by the global token count itself),
      which FSDP2 sends as ReduceOp.PREMUL_SUM(1.0), which gloo does not have.
    - `training.disable_cuda_graphs = True`.
    """
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    for _, _, parent, attr in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.disable_cuda_graphs = True
    config.model_spec.parallelize_fn = _summing_reductions(config.model_spec.parallelize_fn)
    return config


def _summing_reductions(parallelize: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(parallelize)
    def parallelize_for_gloo(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.fsdp import FSDPModule

        model = parallelize(*args, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize_for_gloo


def main() -> None:
    use_cpu()
    add_set_timeout()
    from torchtitan.train import main as titan_main

    titan_main()


if __name__ == "__main__":
    main()
