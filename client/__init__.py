"""The client side of a cossd device: commands, namespace files and the CMB over a Transport.

Imports only cossd.protocol (and numpy and the standard library), so a trainer or a tool
on a node without the device ships none of its code. Two transports: a local mount
(`LocalMount`: the `.admin` queue pair, the tensor files, the CMB's memfd) and a storage
server (`RemoteTransport`, cossd://HOST:PORT: NVMe/TCP framing, docs/server.md).
"""

from .admin import AdminClient
from .cmb import CmbMapping, CmbRegion, claim_region, plan_cmb_batches
from .mounts import MOUNT_FSTYPE, REMOTE_MOUNT_FSTYPE, mount_type_at, mounted_devices
from .remote import Credentials, RemoteTransport, ServerUrl, is_remote, parse_url
from .transport import LocalMount, Transport
from .watchdog import DEFAULT_TIMEOUT_S, DeviceTimeoutError, Watchdog

__all__ = [
    "AdminClient",
    "CmbMapping",
    "CmbRegion",
    "Credentials",
    "DEFAULT_TIMEOUT_S",
    "DeviceTimeoutError",
    "LocalMount",
    "MOUNT_FSTYPE",
    "REMOTE_MOUNT_FSTYPE",
    "RemoteTransport",
    "ServerUrl",
    "Transport",
    "Watchdog",
    "claim_region",
    "is_remote",
    "mount_type_at",
    "mounted_devices",
    "parse_url",
    "plan_cmb_batches",
]
