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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..protocol.status import DeviceError, Status
    from .device import Device, DeviceConfig
    from .namespace import CommitResult, Namespace, NamespaceSpec, TensorSpec

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
