"""The storage server's receive memory: one budget shared by every connection's WRITE buffers
(cossd serve --recv-memory), waited for up to a bound, then refused with a clear status."""
from __future__ import annotations

import threading
import time
from typing import Any

from ..emulator import DeviceError, Status

# The default: the wire's largest WRITE (2 GiB), so any WRITE a client may send fits alone and
# none is refused for its size unless the operator asks for less; many at once share it.
DEFAULT_RECV_MEMORY = 2 << 30
DEFAULT_RECV_WAIT_S = 10.0
# The least budget: a streamed WRITE's one slot (an H2CData PDU of up to 16 MiB) and more.
MIN_RECV_MEMORY = 32 << 20


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} bytes"


class RecvMemory:
    """Bytes of receive buffers the connections may hold at once, `capacity` in all.

    A connection takes what a WRITE needs before the first byte of its data is received and
    gives it back when it is idle or closes. A request that does not fit waits until others
    give memory back, at most `wait_s`; one larger than the whole budget is refused at once.
    A connection holds nothing while it waits (it gave its own buffer back first), so two
    waiting connections can never wait on each other.
    """

    def __init__(self, capacity: int = DEFAULT_RECV_MEMORY, wait_s: float = DEFAULT_RECV_WAIT_S) -> None:
        if capacity <= 0:
            raise ValueError(f"receive memory must be > 0 bytes, got {capacity}")
        self.capacity = capacity
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self.held = 0
        self.counters = {"peak": 0, "waits": 0, "refused_too_large": 0, "refused_timeout": 0,
                         "streamed_writes": 0, "idle_releases": 0}

    def acquire(self, nbytes: int, what: str) -> None:
        """Take `nbytes` for `what` (the request, for the refusal's message), waiting for it
        up to wait_s. LIMIT_EXCEEDED where it can never fit, COMMAND_INTERRUPTED where it did
        not within wait_s; either way nothing was taken."""
        if nbytes <= 0:
            return
        with self._cond:
            if nbytes > self.capacity:
                self.counters["refused_too_large"] += 1
                raise DeviceError(Status.LIMIT_EXCEEDED,
                                  f"{what} needs {_size(nbytes)} of receive memory; the server has "
                                  f"{_size(self.capacity)} in all (--recv-memory): send it in smaller WRITEs")
            if self.held + nbytes > self.capacity:
                self.counters["waits"] += 1
                deadline = time.monotonic() + self.wait_s
                while self.held + nbytes > self.capacity:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.counters["refused_timeout"] += 1
                        raise DeviceError(Status.COMMAND_INTERRUPTED,
                                          f"{what} waited {self.wait_s:g} s for {_size(nbytes)} of receive "
                                          f"memory, all {_size(self.capacity)} of which other connections hold "
                                          "(--recv-memory); nothing was written: retry")
                    self._cond.wait(left)
            self.held += nbytes
            self.counters["peak"] = max(self.counters["peak"], self.held)

    def release(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._cond:
            self.held -= nbytes
            assert self.held >= 0, self.held
            self._cond.notify_all()

    def count(self, counter: str) -> None:
        with self._cond:
            self.counters[counter] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return dict(self.counters) | {"capacity": self.capacity, "held": self.held, "wait_s": self.wait_s}
