"""A remote mount's connections to its storage server: a few lanes, each one RemoteTransport,
used least busy first and reconnected on first use after the server went away; each loss
logged once and counted as an epoch, so that files opened before it fail (ENOTCONN)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Iterator

from ...client.remote import RemoteTransport
from ...client.watchdog import DeviceTimeoutError

log = logging.getLogger(__name__)

# Lanes a mount opens at most (lazily): one command runs at a time on a connection, so more
# lanes let the kernel's parallel requests (O_DIRECT's asynchronous I/O, several processes)
# run at once, and a commit that waits on the device holds up only its own lane. Each lane
# is a thread on the server.
DEFAULT_LANES = 4


@dataclasses.dataclass(frozen=True)
class Credentials:
    """What the mount presents: a token file and the CA that signed the server's certificate
    (TLS); None falls back to the environment (COSSD_TOKEN_FILE, COSSD_CA; a client certificate
    from COSSD_CLIENT_CERT and COSSD_CLIENT_KEY) as every client does."""

    token_file: str | None = None
    ca: str | None = None


class ServerLost(ConnectionAbortedError):
    """A file opened before the server went away: its handles were the old connections'."""


@dataclasses.dataclass
class Lane:
    transport: RemoteTransport
    epoch: int  # the mount's epoch when it connected


class Lanes:
    """The mount's connections. Thread-safe. The epoch counts the server's losses seen: all
    connections of one epoch go together (one server), so the first loss noticed on any of
    them closes them all, and a connection made after it belongs to the next epoch."""

    def __init__(self, url: str, credentials: Credentials, timeout_s: float, count: int = DEFAULT_LANES) -> None:
        self.url = url
        self.credentials = credentials
        self.timeout_s = timeout_s
        self.epoch = 0
        self._lanes: list[Lane | None] = [None] * max(1, count)
        self._busy = [0] * len(self._lanes)
        self._connecting = [threading.Lock() for _ in self._lanes]
        self._lock = threading.Lock()
        self._down: str | None = None  # why the server is unreachable, while it is
        self._closed = False

    def _connect(self) -> RemoteTransport:
        return RemoteTransport(self.url, self.timeout_s, token_file=self.credentials.token_file,
                               ca=self.credentials.ca)

    def check(self) -> None:
        """Connect the first lane now: an unreachable server, a refused token or TLS fails the
        mount before anything is mounted (the exception's message says why)."""
        self._lanes[0] = Lane(self._connect(), self.epoch)

    def _lane(self, index: int) -> Lane:
        with self._connecting[index]:
            if self._closed:
                raise ConnectionAbortedError(f"the mount of {self.url} is closing")
            current = self._lanes[index]
            if current is not None and current.transport.alive():
                return current
            if current is not None:  # killed or restarted since its last command
                self._lost(current, ConnectionResetError("the server closed an idle connection"))
            try:
                fresh = Lane(self._connect(), self.epoch)
            except (OSError, DeviceTimeoutError) as exc:
                self._lost(None, exc)
                raise
            if self._closed:  # closed while this lane connected
                fresh.transport.close()
                raise ConnectionAbortedError(f"the mount of {self.url} is closing")
            self._lanes[index] = fresh
            if self._down is not None:
                log.warning("reconnected to the cossd server at %s", self.url)
            return fresh

    def _lost(self, lane: Lane | None, exc: BaseException) -> None:
        """The server went away (or stopped answering): log it once until it answers again;
        where `lane` is of the current epoch, close every connection of it and start the next."""
        with self._lock:
            if self._down is None:
                self._down = str(exc)
                log.error("the cossd server at %s is unreachable: %s; file operations fail (ENOTCONN, or "
                          "ETIMEDOUT when it stopped answering) until it is back, and files opened before "
                          "stay failed", self.url, exc)
            if lane is None or lane.epoch != self.epoch:
                return
            self.epoch += 1
            stale = [other for other in self._lanes if other is not None and other.epoch < self.epoch]
        for other in stale:
            other.transport.close()  # a command in flight on it fails at once

    @contextlib.contextmanager
    def use(self, epoch: int | None = None) -> Iterator[tuple[int, Lane]]:
        """(index, lane) of the least busy lane, for the commands of one request. With `epoch`
        (a file's, from its open): ServerLost where the server went away since."""
        with self._lock:
            index = min(range(len(self._busy)), key=lambda i: (self._busy[i], self._lanes[i] is None))
            self._busy[index] += 1
        try:
            lane = self._lane(index)
            if epoch is not None and lane.epoch != epoch:
                raise ServerLost(f"opened before the cossd server at {self.url} went away; open it again")
            try:
                yield index, lane
            except (ConnectionError, DeviceTimeoutError) as exc:
                if not isinstance(exc, ServerLost):
                    self._lost(lane, exc)
                raise
        finally:
            with self._lock:
                self._busy[index] -= 1
        if self._down is not None:  # answered: a later loss is logged again
            with self._lock:
                self._down = None

    def close(self) -> None:
        """Close every connection now; a command in flight on one fails at once. Never waits
        out a lane being connected (that can take the timeout): _lane closes what it made
        once it sees the mount closing."""
        self._closed = True
        for index, connecting in enumerate(self._connecting):
            locked = connecting.acquire(timeout=0.2)
            try:
                lane, self._lanes[index] = self._lanes[index], None
            finally:
                if locked:
                    connecting.release()
            if lane is not None:
                lane.transport.close()


def absolute(path: str | os.PathLike[str] | None) -> str | None:
    """A credential file's absolute path (the daemon runs in another working directory)."""
    return None if path is None else os.path.abspath(path)
