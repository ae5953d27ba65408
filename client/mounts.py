"""Which cossd devices this node has mounted, and what holds a mount busy, read from /proc (mountinfo, each process's links)."""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

# How a mount of the daemon shows in /proc/self/mountinfo (fs/daemon.py sets both).
MOUNT_FSTYPE = "fuse.cossd"
FSNAME_PREFIX = "cossd:"
# A remote mount's (fs/remote/daemon.py: a storage server's tree, mounted on this node); its
# source is the server's URL, cossd://HOST:PORT.
REMOTE_MOUNT_FSTYPE = "fuse.cossd-remote"


def _unescape_mountinfo(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


@dataclasses.dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo: its mount ID, the ID of the mount it sits on, where, what type, from where."""

    mount_id: int
    parent_id: int
    mountpoint: Path
    fstype: str
    source: str


def mount_entries(mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo") -> list[MountEntry]:
    """Every mount of this mount namespace, in mount order."""
    entries = []
    with open(mountinfo) as lines:
        for line in lines:
            mount_fields, separator, fs_fields = line.rstrip("\n").partition(" - ")
            fields, fs = mount_fields.split(" "), fs_fields.split(" ")
            if not separator or len(fields) < 5 or len(fs) < 2 or not (fields[0].isdigit() and fields[1].isdigit()):
                continue
            entries.append(MountEntry(int(fields[0]), int(fields[1]), Path(_unescape_mountinfo(fields[4])), fs[0],
                                      _unescape_mountinfo(fs[1])))
    return entries


def shadowed_mount_ids(entries: list[MountEntry]) -> dict[int, Path]:
    """{mount ID: its mountpoint} of each mount that another is mounted on top of (same
    mountpoint, that mount as its parent): its files are not the ones the path shows."""
    by_id = {entry.mount_id: entry for entry in entries}
    return {entry.parent_id: entry.mountpoint for entry in entries
            if entry.parent_id in by_id and by_id[entry.parent_id].mountpoint == entry.mountpoint}


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


def mount_id_at(path: os.PathLike[str], fstype: str,
                mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo") -> int | None:
    """The mount ID of the topmost mount of `fstype` on `path`, or None (a remote mount's
    daemon watches its own ID: gone from the table, the mount was detached)."""
    target = _resolved(path)
    found = None
    for entry in mount_entries(mountinfo):
        if entry.fstype == fstype and str(entry.mountpoint) == target:
            found = entry.mount_id
    return found


def mount_type_at(path: os.PathLike[str], mountinfo: str | os.PathLike[str] = "/proc/self/mountinfo") -> str | None:
    """The filesystem type mounted on `path` (the topmost mount there), or None if nothing is.
    Only the parent is resolved: a stat of a hung FUSE mount itself would hang."""
    target = _resolved(path)
    found = None
    with open(mountinfo) as lines:
        for line in lines:
            mount_fields, separator, fs_fields = line.rstrip("\n").partition(" - ")
            fields, fs = mount_fields.split(" "), fs_fields.split(" ")
            if separator and len(fields) >= 5 and fs and _unescape_mountinfo(fields[4]) == target:
                found = fs[0]  # later lines are mounts on top of earlier ones
    return found


def _resolved(path: str | os.PathLike[str]) -> str:
    """`path` as mountinfo names it: absolute, its parent's links resolved, never the path
    itself (a stat of a hung FUSE mount would hang)."""
    given = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(given)), os.path.basename(given))


def mount_holders(mountpoint: str | os.PathLike[str], limit: int = 5) -> list[str]:
    """What keeps `mountpoint` busy, as "pid N (COMMAND): WHAT" for up to `limit` processes:
    a working directory, root, or open file under it (as fuser -m finds them, from each
    process's /proc links: reading a link never asks the mount's daemon anything)."""
    target = _resolved(mountpoint)
    found: list[str] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or len(found) >= limit:
            continue
        uses = []
        try:
            links = [("cwd", entry / "cwd"), ("root", entry / "root")]
            links += [(f"fd {fd.name}", fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue  # gone, or not ours to look at
        for what, link in links:
            try:
                held = os.readlink(link)
            except OSError:
                continue
            if held == target or held.startswith(target + "/"):
                uses.append(what if what in ("cwd", "root") else f"{what} -> {held}")
        if uses:
            try:
                command = (entry / "comm").read_text().strip()
            except OSError:
                command = "?"
            found.append(f"pid {entry.name} ({command}): {', '.join(uses[:3])}"
                         + (f" and {len(uses) - 3} more" if len(uses) > 3 else ""))
    return found
