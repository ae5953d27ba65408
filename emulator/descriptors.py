"""The process's open-descriptor limit, raised for a device's front end (the mount daemon, the network server): a namespace holds a descriptor per state copy."""
from __future__ import annotations

import logging
import resource
from pathlib import Path

log = logging.getLogger("cossd.emulator.descriptors")


def raise_descriptor_limit() -> tuple[int, int]:
    """Raise the soft limit on open descriptors to the hard one; returns (soft, hard) now.

    A namespace keeps its two state copies open (one descriptor each), and the network
    server adds a socket per connection, so 1,024 namespaces, or a few hundred and as many
    unauthenticated peers, exhaust the usual default soft limit of 1,024. Where the hard limit
    is unlimited, the kernel's per-process ceiling (fs.nr_open) is the target.
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
