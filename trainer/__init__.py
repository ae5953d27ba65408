"""cossd.trainer: PyTorch optimizers that keep their state on a cossd device.

Imports cossd.client and cossd.protocol only (the import contracts check it); the demo and the
bench, which mount devices of their own, are cossd.harness.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Adam", "AdamW", "DeviceLostError", "InconsistentStateError", "StepAbortedError", "TieredCheckpointer"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so torch-free parts (options, the demo's and bench's) load without torch.
    if name in ("Adam", "AdamW"):
        from . import optim

        return getattr(optim, name)
    if name == "DeviceLostError":
        from .namespace.files import DeviceLostError

        return DeviceLostError
    if name == "InconsistentStateError":
        from .session import InconsistentStateError

        return InconsistentStateError
    if name == "StepAbortedError":
        from .sharded import StepAbortedError

        return StepAbortedError
    if name == "TieredCheckpointer":
        from .checkpoint.tiered import TieredCheckpointer

        return TieredCheckpointer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
