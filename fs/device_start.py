"""Opening the device for the mount daemon, importing neither trio nor pyfuse3: the daemon's entry opens it before those imports, so that the background verification's first part runs beside them."""
from __future__ import annotations

import logging
import resource
from pathlib import Path

from ..emulator import Device, DeviceConfig
from ..kernels import guard
from .mount_options import MountOptions

log = logging.getLogger("cossd.fs.daemon")


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft limit on open descriptors to the hard one; returns (soft, hard) now.

    A namespace keeps its two state copies open (one descriptor each), so 1,024 namespaces
    need more than the usual default soft limit of 1,024. Where the hard limit is unlimited,
    the kernel's per-process ceiling (fs.nr_open) is the target.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.warning("could not raise the descriptor limit from %d to %d: %s", soft, target, exc)
    return soft, hard


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
