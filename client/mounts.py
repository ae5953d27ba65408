"""Which cossd devices this node has mounted, read from /proc/self/mountinfo."""
from __future__ import annotations

import os
import re
from pathlib import Path

# How a mount of the daemon shows in /proc/self/mountinfo (fs/daemon.py sets both).
MOUNT_FSTYPE = "fuse.cossd"
FSNAME_PREFIX = "cossd:"
# A remote mount's (fs/remote_daemon.py: a storage server's tree, mounted on this node); its
# source is the server's URL, cossd://HOST:PORT.
REMOTE_MOUNT_FSTYPE = "fuse.cossd-remote"


def _unescape_mountinfo(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def mounted_devices(mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo",
                    fstypes: tuple[str, ...] = (MOUNT_FSTYPE,)) -> list[tuple[Path, Path]]:
    """(mountpoint, backing directory) of every cossd mount, in mount order; with
    REMOTE_MOUNT_FSTYPE in `fstypes` also the remote mounts, their "backing" the server's URL
    (as a Path: for naming the mount, not for opening)."""
    devices = []
    with open(mountinfo) as lines:
        for line in lines:
            mount_fields, separator, fs_fields = line.rstrip("\n").partition(" - ")
            if not separator:
                continue
            fields, fs = mount_fields.split(" "), fs_fields.split(" ")
            if len(fields) < 5 or len(fs) < 2 or fs[0] not in fstypes:
                continue
            source = _unescape_mountinfo(fs[1])
            backing = source.removeprefix(FSNAME_PREFIX)
            devices.append((Path(_unescape_mountinfo(fields[4])), Path(backing)))
    return devices


def mount_type_at(path: os.PathLike[str], mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo") -> str | None:
    """The filesystem type mounted on `path` (the topmost mount there), or None if nothing is.
    Only the parent is resolved: a stat of a hung FUSE mount itself would hang."""
    given = os.path.abspath(path)
    target = os.path.join(os.path.realpath(os.path.dirname(given)), os.path.basename(given))
    found = None
    with open(mountinfo) as lines:
        for line in lines:
            mount_fields, separator, fs_fields = line.rstrip("\n").partition(" - ")
            fields, fs = mount_fields.split(" "), fs_fields.split(" ")
            if separator and len(fields) >= 5 and fs and _unescape_mountinfo(fields[4]) == target:
                found = fs[0]  # later lines are mounts on top of earlier ones
    return found
