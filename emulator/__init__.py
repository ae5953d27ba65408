"""The emulated computational SSD: device, namespaces, step transactions, media, commands.

Synchronous and importable without FUSE; imports only cossd.protocol (the wire format it
speaks), cossd.kernels, numpy and the standard library. fs/ drives it from its event loop;
tests drive it directly. DeviceError and Status are re-exported from cossd.protocol because
the device's own API raises them.

The names below are imported when first used, not with the package: the mount daemon
imports geometry.py and prefetch.py (standard library alone) before numpy, to start reading
a restarted device's params while the rest of its imports run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:  # `X as X`: an explicit re-export, so ruff and mypy see what __all__ lists
    from ..protocol.status import DeviceError as DeviceError, Status as Status
    from .device import Device as Device, DeviceConfig as DeviceConfig
    from .namespace import (
        CommitResult as CommitResult,
        Namespace as Namespace,
        NamespaceSpec as NamespaceSpec,
        TensorSpec as TensorSpec,
    )

# Each exported name, and the module (relative to this package) that defines it.
_EXPORTS = {
    "CommitResult": ".namespace",
    "Device": ".device",
    "DeviceConfig": ".device",
    "DeviceError": "..protocol.status",
    "Namespace": ".namespace",
    "NamespaceSpec": ".namespace",
    "Status": "..protocol.status",
    "TensorSpec": ".namespace",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
