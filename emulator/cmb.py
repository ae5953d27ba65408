"""The controller memory buffer (CMB): host-visible memory of the device, shared with clients.

NVMe lets a controller expose memory of its own (the CMB) that the host, or a GPU by
peer-to-peer DMA, reads and writes directly; a command's data may then sit in the CMB
instead of travelling with the command. cossd's CMB is a memfd: the daemon maps it, a client
opens the path `describe()` gives (/proc/PID/fd/N) and maps it too, so gradients a trainer
puts there reach the kernel and params come back with no copy through FUSE. The CMB_WRITE
and CMB_READ commands (emulator/commands/cmb.py) move a tensor file's bytes between it and
the namespace, with the same checks as a file write or read.

A memfd, not a file in /dev/shm: it goes away with the daemon, however that ends, so a
killed daemon leaves nothing behind. It is sealed against resizing, so no client can cut it
short under the daemon's mapping.
"""
from __future__ import annotations

import fcntl
import mmap
import os
from typing import Any

import numpy as np

from ..protocol.status import DeviceError, Status
from .workers import KernelWorkers

from .geometry import DEFAULT_CMB_BYTES, MAX_CMB_BYTES  # noqa: F401 (this module's sizes, kept light there)
# Copies into or out of the CMB larger than this are split across the kernel workers.
_PARALLEL_COPY_BYTES = 4 << 20


def parallel_copy(destination: np.ndarray, source: np.ndarray | memoryview | bytes,
                  workers: KernelWorkers | None) -> None:
    """destination[:] = source (uint8, same length), large copies split across cores (on
    `workers`, the device's kernel workers: numpy copies release the GIL; None: on this
    thread alone)."""
    source_array = np.frombuffer(source, dtype=np.uint8) if not isinstance(source, np.ndarray) else source
    length = len(destination)
    if workers is None or length < 2 * _PARALLEL_COPY_BYTES:
        destination[:] = source_array
        return
    pieces = workers.threads
    bounds = [length * k // pieces for k in range(pieces + 1)]

    def copy(lo: int, hi: int) -> None:
        destination[lo:hi] = source_array[lo:hi]

    futures = [workers.submit(copy, bounds[k], bounds[k + 1]) for k in range(1, pieces)]
    copy(bounds[0], bounds[1])  # this thread takes the first piece
    for future in futures:
        future.result()


class ControllerMemoryBuffer:
    """`size` bytes of shared memory. Thread-safe: ranges are only handed out, never moved."""

    def __init__(self, size: int) -> None:
        if not 0 < size <= MAX_CMB_BYTES or size % mmap.PAGESIZE:
            raise ValueError(f"CMB size must be a multiple of {mmap.PAGESIZE} in 1..{MAX_CMB_BYTES}, got {size}")
        self.size = size
        self.fd = os.memfd_create("cossd-cmb", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            # Every client opens this memfd read-write: unsealed, one ftruncate by any of them
            # would make the daemon's next CMB access a SIGBUS (this mapping is not guarded).
            # Sealed, its size is fixed (ftruncate fails with EPERM) and the seals themselves
            # cannot be changed; writes through mappings stay allowed.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.array = np.frombuffer(self._map, dtype=np.uint8)

    @property
    def path(self) -> str:
        """Where a client of this machine opens the CMB (the daemon's descriptor)."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size}

    def region(self, offset: int, length: int, what: str) -> np.ndarray:
        """The CMB's bytes [offset, offset + length): a view, after a bounds check that names
        `what` in its error."""
        if isinstance(offset, bool) or isinstance(length, bool) or not isinstance(offset, int) \
                or not isinstance(length, int):
            raise DeviceError(Status.INVALID_FIELD, f"{what}: cmb_offset and length must be integers")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise DeviceError(
                Status.LBA_OUT_OF_RANGE,
                f"{what}: CMB bytes {offset}..{offset + length} are outside the "
                f"{self.size}-byte controller memory buffer",
            )
        return self.array[offset : offset + length]

    def close(self) -> None:
        # Views handed out may outlive this (numpy keeps the mmap referenced); the memfd's
        # pages go when the last mapping does.
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self._map.close()
        except BufferError:
            pass  # a view is still alive; the mapping goes with it
        os.close(self.fd)
