"""A remote mount's view of the tree: inode numbers for the paths the server's STAT answers,
what kind of file a path is, and the attributes FUSE is given."""
from __future__ import annotations

import enum
import errno
import os
import stat
from typing import Any

import pyfuse3

from ..nodes import fuse_error

ADMIN_NAME = ".admin"
ROOT_INODE = pyfuse3.ROOT_INODE
ADMIN_INODE = ROOT_INODE + 1
NS_INODE = ROOT_INODE + 2
# A node's identity beyond its path: (nsid, snapshot id), so a namespace deleted and created
# again under its name, or a snapshot tag taken again, gets a new inode (as on a local mount).
Key = tuple[int, int]


class RemoteKind(enum.Enum):
    DIRECTORY = "directory"
    ADMIN = "admin"  # the queue pairs: this daemon's own, forwarded command by command
    TEXT = "text"  # config.json, step, stats.json: READ_TEXT at open
    ARRAY = "array"  # a tensor file or an NVM namespace's data: OPEN, then READ/WRITE
    SNAP_TEXT = "snapshot-text"  # a snapshot's step, and its arrays: READ_PATH
    SNAP_ARRAY = "snapshot-array"


def kind_of(path: str, mode: int) -> RemoteKind:
    """What the file at `path` (as the server's tree names it) is served with."""
    if stat.S_ISDIR(mode):
        return RemoteKind.DIRECTORY
    parts = path.split("/")
    if len(parts) > 3 and parts[2] == "snapshots":
        return RemoteKind.SNAP_TEXT if parts[-1] == "step" else RemoteKind.SNAP_ARRAY
    if len(parts) == 3 and parts[2] != "data":
        return RemoteKind.TEXT
    return RemoteKind.ARRAY


def child_path(parent: str, name: bytes) -> str:
    try:
        decoded = name.decode()
    except UnicodeDecodeError:
        raise fuse_error(errno.ENOENT) from None
    if not decoded or "/" in decoded or decoded in (".", ".."):
        raise fuse_error(errno.ENOENT)
    return f"{parent}/{decoded}" if parent else decoded


class InodeTable:
    """Inodes handed out lazily, one per (path, key); runs on the event loop's thread only."""

    def __init__(self) -> None:
        self._inodes: dict[tuple[str, Key], int] = {("", (0, 0)): ROOT_INODE, ("ns", (0, 0)): NS_INODE}
        self._paths: dict[int, tuple[str, Key]] = {inode: entry for entry, inode in self._inodes.items()}
        self._next = NS_INODE + 1

    def inode(self, path: str, key: Key) -> int:
        inode = self._inodes.get((path, key))
        if inode is None:
            inode, self._next = self._next, self._next + 1
            self._inodes[(path, key)] = inode
            self._paths[inode] = (path, key)
        return inode

    def path(self, inode: int) -> tuple[str, Key]:
        found = self._paths.get(inode)
        if found is None:
            raise fuse_error(errno.ENOENT)
        return found


def key_of(answer: dict[str, Any]) -> Key:
    nsid, snapshot_id = answer["key"]
    return int(nsid), int(snapshot_id)


def attributes(inode: int, answer: dict[str, Any]) -> pyfuse3.EntryAttributes:
    """FUSE attributes of a STAT answer (or the control file's own). Nothing is cached
    (entry and attribute timeouts 0): sizes, steps and namespaces change on the server."""
    attrs = pyfuse3.EntryAttributes()
    mode, size = int(answer["mode"]), int(answer["size"])
    attrs.st_ino = pyfuse3.InodeT(inode)
    attrs.st_mode = pyfuse3.ModeT(mode)
    attrs.st_nlink = 2 if stat.S_ISDIR(mode) else 1
    attrs.st_uid = os.getuid()
    attrs.st_gid = os.getgid()
    attrs.st_size = size
    attrs.st_blksize = 1 << 20
    attrs.st_blocks = (size + 511) // 512
    attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = int(answer["time_ns"])
    attrs.entry_timeout = 0
    attrs.attr_timeout = 0
    return attrs


def admin_answer(started_ns: int) -> dict[str, Any]:
    """The control file as a local mount shows it: 0600, empty, the mount's start time."""
    return {"mode": stat.S_IFREG | 0o600, "size": 0, "time_ns": started_ns, "key": [0, 0]}
