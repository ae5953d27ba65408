"""The device as a front-end sees it: the one module (with cossd.emulator itself) that fs/ and server/ import.

A front-end (the FUSE mount, the network server, or a new one) takes from here the device
(Device, DeviceConfig, its backing directory), the controller and its one I/O entry
(DeviceIO, emulator/io.py), and the types and names its requests carry (a namespace of any
kind, an optimizer namespace, its files' roles, a snapshot). It tells the namespace kinds
apart only through the kinds' own methods (`namespace.as_optimizer()`, the io_* calls
DeviceIO makes), never by their classes. pyproject.toml's import contract "front-ends reach
the device through its face" checks that fs/ and server/ import nothing else of the device,
and names the few exceptions and why.

The names are imported when first used, not with this module (as cossd.emulator's are), so a
front-end's light modules may import it before numpy.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:  # `X as X`: an explicit re-export, so ruff and mypy see what __all__ lists
    from ..protocol.log_limit import LogLimiter as LogLimiter
    from ..protocol.status import DeviceError as DeviceError, Status as Status
    from .accounting import LinkTiming as LinkTiming
    from .backing import SUPERBLOCK_FILE as SUPERBLOCK_FILE, BackingDirectory as BackingDirectory
    from .controller import Controller as Controller
    from .descriptors import raise_descriptor_limit as raise_descriptor_limit
    from .device import Device as Device, DeviceConfig as DeviceConfig
    from .io import (
        DATA_ROLE as DATA_ROLE,
        DeviceIO as DeviceIO,
        Staged as Staged,
        committed_version as committed_version,
    )
    from .kinds import AnyNamespace as AnyNamespace
    from .namespace import (
        LOADABLE_ROLES as LOADABLE_ROLES,
        ROLES as ROLES,
        CommitResult as CommitResult,
        Namespace as Namespace,
    )
    from .namespace.snapshots import Snapshot as Snapshot

# Each exported name, and the module that defines it, relative to this module's name
# (lazy_exports resolves them as a package's: "..kinds" is cossd.emulator.kinds).
_EXPORTS = {
    "AnyNamespace": "..kinds",
    "BackingDirectory": "..backing",
    "CommitResult": "..namespace",
    "Controller": "..controller",
    "DATA_ROLE": "..io",
    "Device": "..device",
    "DeviceConfig": "..device",
    "DeviceError": "...protocol.status",
    "DeviceIO": "..io",
    "LOADABLE_ROLES": "..namespace",
    "LinkTiming": "..accounting",
    "LogLimiter": "...protocol.log_limit",
    "Namespace": "..namespace",
    "ROLES": "..namespace",
    "SUPERBLOCK_FILE": "..backing",
    "Snapshot": "..namespace.snapshots",
    "Staged": "..io",
    "Status": "...protocol.status",
    "committed_version": "..io",
    "raise_descriptor_limit": "..descriptors",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
