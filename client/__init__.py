"""The client side of a cossd device: commands, namespace files and the CMB over a Transport.

Imports only cossd.protocol (and numpy and the standard library), so a trainer or a tool
on a node without the device ships none of its code. Today's transport is a local mount
(`LocalMount`: the `.admin` queue pair, the tensor files, the CMB's memfd); a network one
implements `Transport` too.
"""

from .admin import AdminClient
from .cmb import CmbMapping, CmbRegion, claim_region, plan_cmb_batches
from .mounts import MOUNT_FSTYPE, mount_type_at, mounted_devices
from .transport import LocalMount, Transport
from .watchdog import DEFAULT_TIMEOUT_S, DeviceTimeoutError, Watchdog

__all__ = [
    "AdminClient",
    "CmbMapping",
    "CmbRegion",
    "DEFAULT_TIMEOUT_S",
    "DeviceTimeoutError",
    "LocalMount",
    "MOUNT_FSTYPE",
    "Transport",
    "Watchdog",
    "claim_region",
    "mount_type_at",
    "mounted_devices",
    "plan_cmb_batches",
]
