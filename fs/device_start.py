"""Opening the device for the mount daemon, importing neither trio nor pyfuse3: the daemon's entry opens it before those imports, so that the background verification's first part runs beside them."""
from __future__ import annotations

import logging
from pathlib import Path

from ..emulator import Device, DeviceConfig
from ..emulator.face import raise_descriptor_limit
from ..kernels import guard
from .mount_options import MountOptions

log = logging.getLogger("cossd.fs.daemon")


def open_device(options: MountOptions, *, mark_in_use: bool = True) -> Device:
    """What the daemon does before it serves: the descriptor limit raised (two per
    namespace), the guard that turns a state copy cut short under its mapping into an error
    rather than a crash installed (before anything maps a copy: the background pass reads
    them at once), then Device.open (mark_in_use: see there; serve() makes the mark before
    it mounts)."""
    soft, hard = raise_descriptor_limit()
    log.info("descriptor limit %d (hard %d): two per namespace", soft, hard)
    guard.install()
    config = DeviceConfig(sync=options.sync, profile=options.profile, timed=options.timed, verify=options.verify)
    return Device.open(Path(options.backing).resolve(), config, mark_in_use=mark_in_use)
