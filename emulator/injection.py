"""Error injection (INJECT_ERROR, D0h): fail chosen commands or tensor-file I/O, corrupt a block."""
from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

from ..protocol.status import DeviceError, Status
from .health import Health
from ..protocol.entries import IoOpcode, Opcode
from ..protocol.injection import Queue
from ..protocol.logpages import DATA_PATH_SQID, NOT_APPLICABLE

# At most this many injections armed at once; and the fired / corrupted history kept for C3h.
MAX_ARMED = 64
HISTORY_ENTRIES = 64
# A failure that stands for an error must be one: not SUCCESS, not the skip (a completion).
NOT_INJECTABLE = (Status.SUCCESS, Status.STEP_SKIPPED_NONFINITE)


def opcode_name(queue: Queue, opcode: int) -> str:
    try:
        return (IoOpcode(opcode) if queue == Queue.IO else Opcode(opcode)).name
    except ValueError:
        return f"{opcode:#04x}"


@dataclasses.dataclass
class Injection:
    """Fail the next `remaining` commands (or I/Os) of `opcode`, of namespace `nsid` or any."""

    id: int
    queue: Queue
    opcode: int
    status: Status
    nsid: int | None
    remaining: int
    fired: int = 0

    def matches(self, queue: Queue, opcode: int, nsid: int) -> bool:
        return self.queue == queue and self.opcode == opcode and self.nsid in (None, nsid)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "queue": self.queue.value, "opcode": self.opcode,
                "opcode_name": opcode_name(self.queue, self.opcode), "status": self.status.name,
                "nsid": self.nsid, "remaining": self.remaining, "fired": self.fired}


class Injector:
    """The armed injections of one controller; consulted before every command and every
    tensor-file read or write. Thread-safe."""

    def __init__(self, health: Health) -> None:
        self._health = health
        self._lock = threading.Lock()
        self._armed: list[Injection] = []
        self._fired: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_ENTRIES)
        self._corrupted: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY_ENTRIES)
        self._next_id = 1
        self.fired_total = 0

    def arm(self, queue: Queue, opcode: int, status: Status, count: int, nsid: int | None) -> Injection:
        with self._lock:
            if len(self._armed) >= MAX_ARMED:
                raise DeviceError(Status.LIMIT_EXCEEDED, f"at most {MAX_ARMED} injections armed at once")
            injection = Injection(self._next_id, queue, opcode, status, nsid, count)
            self._next_id += 1
            self._armed.append(injection)
            return injection

    def clear(self) -> int:
        """Disarm every injection; returns how many were armed. The history stays."""
        with self._lock:
            count = len(self._armed)
            self._armed.clear()
            return count

    @property
    def armed(self) -> list[dict[str, Any]]:
        with self._lock:
            return [injection.describe() for injection in self._armed]

    def take(self, queue: Queue, opcode: int, nsid: int, cid: int | None = None) -> DeviceError | None:
        """The failure to answer with instead of running this command or I/O, or None. The
        oldest matching injection fires; it is disarmed once its count is used up."""
        if not self._armed:  # the common case, without the lock
            return None
        with self._lock:
            injection = next((i for i in self._armed if i.matches(queue, opcode, nsid)), None)
            if injection is None:
                return None
            injection.remaining -= 1
            injection.fired += 1
            self.fired_total += 1
            if injection.remaining == 0:
                self._armed.remove(injection)
            self._fired.appendleft({"id": injection.id, "queue": queue.value, "opcode": opcode,
                                    "opcode_name": opcode_name(queue, opcode), "nsid": nsid, "cid": cid,
                                    "status": injection.status.name})
            return DeviceError(injection.status,
                               f"injected error {injection.id}: {injection.status.name} for "
                               f"{opcode_name(queue, opcode)} ({injection.remaining} more armed)")

    def check_io(self, opcode: IoOpcode, nsid: int) -> None:
        """Before a tensor-file read or write: raise the armed failure, after logging it as the
        controller logs a failed command (the fs layer turns it into the status's errno)."""
        error = self.take(Queue.IO, opcode, nsid)
        if error is not None:
            self._health.log_error(int(error.status), sqid=DATA_PATH_SQID, cmdid=NOT_APPLICABLE,
                                   nsid=nsid, opcode=int(opcode))
            raise error

    def record_corruption(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self._corrupted.appendleft(entry)

    def log_page(self) -> dict[str, Any]:
        """Log page C3h: what is armed, what fired (newest first), what was corrupted."""
        with self._lock:
            return {"armed": [injection.describe() for injection in self._armed],
                    "fired": list(self._fired), "fired_total": self.fired_total,
                    "corrupted": list(self._corrupted)}
