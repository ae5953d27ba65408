"""A client's side of the controller memory buffer: the mapping, the part it locks, batches."""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import mmap
import os
import struct
from typing import Any

import numpy as np

# Tensors sit in the CMB at offsets aligned to a cache line.
CMB_ALIGN = 64

_F_OFD_GETLK, _F_OFD_SETLK = 36, 37  # linux/fcntl.h; Python's fcntl module lacks the OFD constants
_FLOCK = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid
# The least of the CMB a client claims: below this the files do as well.
MIN_CMB_REGION = 1 << 20


def plan_cmb_batches(sizes: list[int], capacity: int) -> list[list[tuple[int, int, int, int]]]:
    """Cut items of `sizes` bytes into batches that each fit a CMB of `capacity` bytes:
    per batch, segments (item, offset in the item, length, offset in the CMB). An item larger
    than the room left is split (at a multiple of 64 bytes, so at an element boundary)."""
    batches: list[list[tuple[int, int, int, int]]] = []
    batch: list[tuple[int, int, int, int]] = []
    used = 0
    for item, size in enumerate(sizes):
        done = 0
        while done < size:
            length = min(size - done, capacity - used)
            batch.append((item, done, length, used))
            done += length
            used += -(-length // CMB_ALIGN) * CMB_ALIGN
            if used >= capacity:
                batches.append(batch)
                batch, used = [], 0
    if batch:
        batches.append(batch)
    return batches


def _ofd_lock(fd: int, start: int, length: int, test: bool) -> tuple[int, int] | None:
    """An exclusive OFD lock on bytes [start, start + length) of `fd`, or with test=True only
    a look: None where it is (or would be) taken, else the (start, length) of a lock in the
    way. OFD locks belong to the open file, so they exclude other threads and processes
    alike, and go when the file is closed."""
    request = struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0)
    if test:
        kind, _, other_start, other_length, _ = struct.unpack(_FLOCK, fcntl.fcntl(fd, _F_OFD_GETLK, request))
        return None if kind == fcntl.F_UNLCK else (other_start, other_length)
    try:
        fcntl.fcntl(fd, _F_OFD_SETLK, request)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return (start, length)  # taken meanwhile: the caller looks again
        raise
    return None


def claim_region(fd: int, size: int, wanted: int) -> tuple[int, int] | None:
    """Lock a free range of the `size`-byte file `fd` for this client: (start, length), of
    `wanted` bytes where such a range is free, else the largest power-of-two fraction of it
    that is (down to MIN_CMB_REGION, which is also the least it asks for); None if not even
    that is. Ranges are page aligned."""
    least = min(MIN_CMB_REGION, size)
    length = min(size, max(least, -(-wanted // mmap.PAGESIZE) * mmap.PAGESIZE))
    while length >= least:
        start = 0
        while start + length <= size:
            in_the_way = _ofd_lock(fd, start, length, test=True)
            if in_the_way is None:
                in_the_way = _ofd_lock(fd, start, length, test=False)
                if in_the_way is None:
                    return start, length
                continue  # another client got there first: look again from here
            other_start, other_length = in_the_way
            end = size if other_length == 0 else other_start + other_length  # 0: to the end of file
            start = -(-max(end, start + 1) // mmap.PAGESIZE) * mmap.PAGESIZE
        length = length // 2 // mmap.PAGESIZE * mmap.PAGESIZE
    return None


class CmbMapping:
    """A client's mapping of the device's controller memory buffer (see emulator/cmb.py)."""

    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        # The open file that holds this client's lock on its part (claim); -1: none.
        self._lock_fd = -1

    def claim(self, wanted: int) -> "CmbRegion | None":
        """Lock a part of the CMB for this client (claim_region: `wanted` bytes where free,
        else less); None where not even the least is free. The lock lasts until close()."""
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        claimed = claim_region(fd, self.size, wanted)
        if claimed is None:
            os.close(fd)
            return None
        self._lock_fd = fd
        return CmbRegion(self, *claimed)

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a view handed out is still alive; the mapping goes with it
        # The lock goes after the mapping, so no other client takes a part still mapped here.
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


@dataclasses.dataclass
class CmbRegion:
    """The part of the device's CMB this client holds: CMB bytes [base, base + size)."""

    mapping: CmbMapping
    base: int
    size: int

    @property
    def array(self) -> Any:
        return self.mapping.array[self.base : self.base + self.size]
