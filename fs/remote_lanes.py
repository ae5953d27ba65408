"""A remote mount's connections to its storage server: a few lanes, each one RemoteTransport,
reconnected on first use after the server went away, with the loss logged once."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from typing import Iterator

from ..client.remote import RemoteTransport
from ..client.watchdog import DeviceTimeoutError

log = logging.getLogger(__name__)

# Lanes a mount opens at most (lazily): one command runs at a time on a connection, so a
# commit that waits on the device holds up only its own lane. Each is a thread on the server.
DEFAULT_LANES = 4


@dataclasses.dataclass(frozen=True)
class Credentials:
    """What the mount presents: a token file, the CA that signed the server's certificate
    (TLS), a client certificate and key (mutual TLS); None falls back to the environment
    (COSSD_TOKEN_FILE, COSSD_CA, COSSD_CLIENT_CERT, COSSD_CLIENT_KEY) as every client does."""

    token_file: str | None = None
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


class Lanes:
    """The mount's connections. A file opened on the mount is bound to one lane's transport
    for its life (the server's handle belongs to that connection: after a loss the file
    fails, ENOTCONN, and a new open gets a new connection); commands, stats and text reads
    take the least busy lane. Thread-safe."""

    def __init__(self, url: str, credentials: Credentials, timeout_s: float, count: int = DEFAULT_LANES) -> None:
        self.url = url
        self.credentials = credentials
        self.timeout_s = timeout_s
        self._transports: list[RemoteTransport | None] = [None] * max(1, count)
        self._busy = [0] * len(self._transports)
        self._locks = [threading.Lock() for _ in self._transports]
        self._lock = threading.Lock()
        self._next_bound = 0
        self._down: str | None = None  # why the server is unreachable, while it is
        self._closed = False

    def _connect(self) -> RemoteTransport:
        return RemoteTransport(self.url, self.timeout_s, token_file=self.credentials.token_file,
                               ca=self.credentials.ca, cert=self.credentials.cert, key=self.credentials.key)

    def check(self) -> None:
        """Connect the first lane now: an unreachable server, a refused token or TLS fails the
        mount before anything is mounted (the exception's message says why)."""
        self._transports[0] = self._connect()

    def _transport(self, index: int) -> RemoteTransport:
        with self._locks[index]:
            if self._closed:
                raise ConnectionAbortedError(f"the mount of {self.url} is closing")
            current = self._transports[index]
            if current is not None and current.alive():
                return current
            if current is not None:
                current.close()
                self._transports[index] = None
            try:
                fresh = self._connect()
            except (OSError, DeviceTimeoutError) as exc:
                self.lost(exc)
                raise
            self._transports[index] = fresh
            if self._down is not None:
                log.warning("reconnected to the cossd server at %s", self.url)
            return fresh

    def lost(self, exc: BaseException) -> None:
        """Log, once until the server answers again, that it went away (or stopped answering)."""
        with self._lock:
            if self._down is None:
                self._down = str(exc)
                log.error("the cossd server at %s is unreachable: %s; file operations fail (ENOTCONN, or "
                          "ETIMEDOUT when it stopped answering) until it is back", self.url, exc)

    @contextlib.contextmanager
    def any(self) -> Iterator[RemoteTransport]:
        """The least busy lane's transport, for one exchange."""
        with self._lock:
            index = min(range(len(self._busy)), key=lambda i: (self._busy[i], self._transports[i] is None))
            self._busy[index] += 1
        try:
            yield self._transport(index)
        finally:
            with self._lock:
                self._busy[index] -= 1
        if self._down is not None:  # answered: a later loss is logged again
            with self._lock:
                self._down = None

    def bind(self) -> RemoteTransport:
        """A lane's transport for a file being opened (round robin over the lanes)."""
        with self._lock:
            index = self._next_bound
            self._next_bound = (index + 1) % len(self._transports)
        return self._transport(index)

    def close(self) -> None:
        self._closed = True
        for index, lock in enumerate(self._locks):
            with lock:
                transport, self._transports[index] = self._transports[index], None
            if transport is not None:
                transport.close()


def absolute(path: str | os.PathLike[str] | None) -> str | None:
    """A credential file's absolute path (the daemon runs in another working directory)."""
    return None if path is None else os.path.abspath(path)
