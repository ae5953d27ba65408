"""The open files and stat records that the FUSE handlers and the data path share."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

from .nodes import Node


class Stat(NamedTuple):
    """What GETATTR and LOOKUP answer about a node (mtime, ctime and atime are the same:
    fs/times.py)."""

    ino: int
    size: int
    blocks: int
    time_ns: int
    mode: int
    nlink: int
    uid: int
    gid: int
    blksize: int


@dataclasses.dataclass
class FileHandle:
    node: Node
    writable: bool
    text: bytes = b""  # snapshot of a text file taken at open
