"""How a client reaches a device: the Transport interface and today's one, a local mount."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ..protocol.entries import COMPLETION, Completion, decode_completion
from .cmb import CmbMapping
from .watchdog import DEFAULT_TIMEOUT_S, Watchdog, close_quietly

ADMIN_FILE = ".admin"
# What the first read of a completion asks for: the entry and the data of nearly every
# command (an identify page, a log page, a commit's report).
COMPLETION_READ_BYTES = 64 << 10


class Transport(Protocol):
    """One connection to a device: a queue pair for commands, the namespace files, the CMB.

    Paths are relative to the device's tree (`ns/<ns>/tensors/<t>/grad`); file handles are
    whatever the transport hands out. Every call may raise OSError (the errno channel) or
    DeviceTimeoutError (no answer in time). Two implement it: LocalMount (below) and
    RemoteTransport (client/remote.py, a storage server at cossd://HOST:PORT); the clients
    above (AdminClient, the trainer's NamespaceFiles) never see how the bytes travel.

    `write_many` and `read_many` move several ranges: RemoteTransport in as few commands as
    its wire takes, LocalMount one system call at a time. Which ranges a step moves, and
    whether through the files or the CMB, is the step transport's choice (step_transport.py).
    """

    @property
    def location(self) -> Path | str:
        """A mountpoint, or a server's URL."""
        ...

    def exchange(self, submission: bytes) -> Completion:
        """Send one encoded submission and return its completion with its data."""
        ...

    def close(self) -> None: ...

    def reachable(self) -> bool:
        """Whether the device still answers at all (False: gone, not a refused request)."""
        ...

    def open_file(self, path: str, writing: bool, direct: bool) -> int: ...

    def write_at(self, handle: int, data: memoryview, offset: int) -> int: ...

    def read_at(self, handle: int, buffer: memoryview, offset: int) -> int: ...

    def close_file(self, handle: int) -> None: ...

    def write_many(self, items: Sequence[tuple[int, memoryview, int]]) -> int:
        """Write every (handle, data, offset) range whole; the bytes written."""
        ...

    def read_many(self, items: Sequence[tuple[int, memoryview, int]]) -> list[int]:
        """Fill every (handle, buffer, offset) range; each one's byte count (short past the file's end)."""
        ...

    def read_text(self, path: str) -> str: ...

    def map_cmb(self, path: str, size: int) -> CmbMapping:
        """The controller memory buffer the device describes (VENDOR_IDENTIFY's "cmb")."""
        ...


class LocalMount:
    """A device mounted on this node: `.admin` is the queue pair (each open() one), the
    tensor files are read and written with pread/pwrite, and the CMB is the daemon's memfd,
    mapped through its path. Every system call goes through a Watchdog, since one on a
    stopped daemon's files blocks until the daemon resumes or dies."""

    def __init__(self, mountpoint: str | os.PathLike[str],
                 timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
        self.location = Path(mountpoint)
        self.watchdog = Watchdog(self.location, timeout_s)
        self.admin_fd = -1
        path = self.location / ADMIN_FILE
        try:
            self.admin_fd = self.watchdog.call(lambda: os.open(path, os.O_RDWR), if_late=close_quietly)
        except FileNotFoundError:
            raise FileNotFoundError(f"{self.location} is not a mounted cossd device") from None

    # ------------------------------------------------------------------ the queue pair

    def _read_exact(self, count: int) -> bytes:
        chunks = []
        while count:
            chunk = os.read(self.admin_fd, count)
            if not chunk:
                raise OSError("control file returned no completion")
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    def exchange(self, submission: bytes) -> Completion:
        def exchange() -> Completion:
            os.write(self.admin_fd, submission)
            # One read takes the entry and, mostly, all its data: a read never returns bytes
            # of two completions, so asking for more than the entry is safe, and it spares a
            # round trip through the daemon (0.05-0.15 ms on a 2-core VM) a command with data.
            first = os.read(self.admin_fd, COMPLETION_READ_BYTES)
            if not first:
                raise OSError("control file returned no completion")
            if len(first) < COMPLETION.itemsize:
                first += self._read_exact(COMPLETION.itemsize - len(first))
            completion, data_len = decode_completion(first[:COMPLETION.itemsize])
            data = first[COMPLETION.itemsize:]
            if len(data) > data_len:
                raise OSError(f"control file returned {len(data) - data_len} bytes past a completion's data")
            if len(data) < data_len:
                data += self._read_exact(data_len - len(data))
            return Completion(completion.cid, completion.status, completion.result, data)

        return self.watchdog.call(exchange)

    def close(self) -> None:
        # Forget the fd first: close() of a dead mount's file fails (ENOTCONN) yet frees it.
        fd, self.admin_fd = self.admin_fd, -1
        try:
            if fd >= 0 and self.watchdog.stuck:
                self.watchdog.close_later(fd)
            elif fd >= 0:
                self.watchdog.call(lambda: os.close(fd))
        finally:
            self.watchdog.close()

    def reachable(self) -> bool:
        return (self.location / ADMIN_FILE).exists()

    # ------------------------------------------------------------------ the files

    def open_file(self, path: str, writing: bool, direct: bool) -> int:
        flags = os.O_WRONLY if writing else os.O_RDONLY
        if direct:
            flags |= os.O_DIRECT
        return self.watchdog.call(lambda: os.open(self.location / path, flags), if_late=os.close)

    def write_at(self, handle: int, data: memoryview, offset: int) -> int:
        return self.watchdog.call(lambda: os.pwrite(handle, data, offset))

    def read_at(self, handle: int, buffer: memoryview, offset: int) -> int:
        return self.watchdog.call(lambda: os.preadv(handle, [buffer], offset))

    def write_many(self, items: Sequence[tuple[int, memoryview, int]]) -> int:
        written = 0
        for handle, data, offset in items:
            view = memoryview(data).cast("B")
            done = 0
            while done < len(view):  # a write may take less than it was given
                done += self.write_at(handle, view[done:], offset + done)
            written += done
        return written

    def read_many(self, items: Sequence[tuple[int, memoryview, int]]) -> list[int]:
        counts = []
        for handle, buffer, offset in items:
            view = memoryview(buffer).cast("B")
            done = 0
            while done < len(view):
                count = self.read_at(handle, view[done:], offset + done)
                if count == 0:
                    break  # the file's end
                done += count
            counts.append(done)
        return counts

    def close_file(self, handle: int) -> None:
        if self.watchdog.stuck:
            self.watchdog.close_later(handle)  # a close would hang behind the stuck call
        else:
            self.watchdog.call(lambda: os.close(handle))

    def read_text(self, path: str) -> str:
        return self.watchdog.call((self.location / path).read_text)

    # ------------------------------------------------------------------ the CMB

    def map_cmb(self, path: str, size: int) -> CmbMapping:
        return CmbMapping(path, size)
