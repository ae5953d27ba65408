"""The emulated computational SSD: device, namespaces, step transactions, media, commands.

Synchronous and importable without FUSE; imports only cossd.protocol (the wire format it
speaks), cossd.kernels, numpy and the standard library. fs/ drives it from its event loop;
tests drive it directly. DeviceError and Status are re-exported from cossd.protocol because
the device's own API raises them.
"""

from ..protocol.status import DeviceError, Status
from .device import Device, DeviceConfig
from .namespace import Namespace, NamespaceSpec, TensorSpec, CommitResult

__all__ = [
    "CommitResult",
    "Device",
    "DeviceConfig",
    "DeviceError",
    "Namespace",
    "NamespaceSpec",
    "Status",
    "TensorSpec",
]
