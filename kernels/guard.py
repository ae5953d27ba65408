"""Guarded shared mappings of backing files: a bus error (the file truncated under the mapping) becomes a counted fault instead of a SIGBUS that kills the daemon.

The C part is kernels/cossd_guard.c. A faulting page is replaced by a zero page, so the
access completes; the owner of the mapping must poll `faults()` after using it and treat
any fault as a media error of that file (the zeros are not data).
"""
from __future__ import annotations

import errno
import os
from typing import Any

from ._cossd_kernels import ffi as _ffi
from ._cossd_kernels import lib as _lib

__all__ = ["GuardedMapping", "SlotsFull", "install", "installed", "SLOTS"]

SLOTS = int(_lib.COSSD_GUARD_SLOTS)


class SlotsFull(OSError):
    """Every slot of the guard's registry is in use: a limit of this process, not a full disk
    (its errno is ENOSPC, as the C side reports it)."""


def install() -> None:
    """Make the guard the process's SIGBUS handler (again, if something replaced it); the
    handler it replaces still gets every bus error outside the guarded mappings."""
    if _lib.cossd_guard_install() != 0:
        code = _ffi.errno
        raise OSError(code, f"installing the SIGBUS guard: {os.strerror(code)}")


def installed() -> bool:
    return bool(_lib.cossd_guard_installed())


class GuardedMapping:
    """`size` bytes of a file descriptor mapped MAP_SHARED from offset 0, without duplicating
    the descriptor (Python's mmap keeps a dup of it) and guarded against bus errors.

    The range is unmapped once `buffer` and every view made from it are gone, so an array
    that outlives its namespace never points at unmapped memory.
    """

    def __init__(self, fd: int, size: int, *, writable: bool = True) -> None:
        slot = _ffi.new("int *")
        address = _lib.cossd_guard_map(fd, size, 1 if writable else 0, slot)
        if address == _ffi.NULL:
            code = _ffi.errno
            if code == errno.ENOSPC:  # the only ENOSPC of cossd_guard_map: every slot is taken
                raise SlotsFull(code, f"all {SLOTS} guarded mappings of this process are in use (two per open "
                                      "optimizer namespace, and those whose arrays are still referenced): "
                                      "close namespaces or devices, or drop arrays of deleted ones")
            raise OSError(code, os.strerror(code))
        self.slot = int(slot[0])
        self.size = size

        def unmap(pointer: Any, slot: int = self.slot, length: int = size) -> None:
            _lib.cossd_guard_unmap(pointer, length, slot)

        # The buffer keeps this cdata alive; the last reference gone unmaps the range.
        owned = _ffi.gc(address, unmap, size)
        self.buffer = _ffi.buffer(owned, size)

    def faults(self) -> int:
        """Bus errors contained in this mapping so far (0 while its file is whole)."""
        return int(_lib.cossd_guard_faults(self.slot))
