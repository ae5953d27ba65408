"""The client side of a cossd device: commands, namespace files and the CMB over a Transport.

Imports only cossd.protocol (and numpy and the standard library), so a trainer or a tool
on a node without the device ships none of its code. Two transports: a local mount
(`LocalMount`: the `.admin` queue pair, the tensor files, the CMB's memfd) and a storage
server (`RemoteTransport`, cossd://HOST:PORT: NVMe/TCP framing, docs/server.md).
The names below are imported when first used, not with the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:  # `X as X`: an explicit re-export, so ruff and mypy see what __all__ lists
    from .admin import AdminClient as AdminClient
    from .cmb import (
        CmbMapping as CmbMapping,
        CmbRegion as CmbRegion,
        claim_region as claim_region,
        plan_cmb_batches as plan_cmb_batches,
    )
    from .mounts import (
        MOUNT_FSTYPE as MOUNT_FSTYPE,
        REMOTE_MOUNT_FSTYPE as REMOTE_MOUNT_FSTYPE,
        mount_type_at as mount_type_at,
        mounted_devices as mounted_devices,
    )
    from .remote import (
        Credentials as Credentials,
        RemoteTransport as RemoteTransport,
        ServerUrl as ServerUrl,
        is_remote as is_remote,
        parse_url as parse_url,
    )
    from .transport import LocalMount as LocalMount, Transport as Transport
    from .watchdog import (
        DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S,
        DeviceTimeoutError as DeviceTimeoutError,
        Watchdog as Watchdog,
    )

# Where each name lives, imported on first use: the mount daemon's launcher reads the mount
# table (.mounts) without numpy and the clients' transports.
_HOMES = {"AdminClient": ".admin", "CmbMapping": ".cmb", "CmbRegion": ".cmb", "Credentials": ".remote",
          "DEFAULT_TIMEOUT_S": ".watchdog", "DeviceTimeoutError": ".watchdog", "LocalMount": ".transport",
          "MOUNT_FSTYPE": ".mounts", "REMOTE_MOUNT_FSTYPE": ".mounts", "RemoteTransport": ".remote",
          "ServerUrl": ".remote", "Transport": ".transport", "Watchdog": ".watchdog", "claim_region": ".cmb",
          "is_remote": ".remote", "mount_type_at": ".mounts", "mounted_devices": ".mounts",
          "parse_url": ".remote", "plan_cmb_batches": ".cmb"}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
