"""Error injection (INJECT_ERROR, D0h): fail chosen commands or tensor-file I/O, corrupt a block."""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import threading
from typing import TYPE_CHECKING, Any, Callable

from ..protocol.status import DeviceError, Status
from .health import Health
from ..protocol.entries import NSID_ALL, Command, Completion, IoOpcode, Opcode
from ..protocol.injection import InjectAction, Queue
from ..protocol.logpages import DATA_PATH_SQID, NOT_APPLICABLE, LogId

if TYPE_CHECKING:
    from .controller import Controller

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


# ---------------------------------------------------------------------- the command


def _payload_object(command: Command, keys: set[str]) -> dict[str, Any]:
    value = command.json  # INVALID_FIELD for anything malformed (protocol.decode_json_payload)
    if not isinstance(value, dict):
        raise DeviceError(Status.INVALID_FIELD, "payload must be a JSON object")
    unknown = set(value) - keys
    if unknown:
        raise DeviceError(Status.INVALID_FIELD, f"unknown key(s): {', '.join(sorted(unknown))}")
    return value


def _json_int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DeviceError(Status.INVALID_FIELD, f"{what} must be an integer from {low} to {high}, got {value!r}")
    return value


def parse_status(value: Any) -> Status:
    """A Status by name ("WRITE_FAULT", any case) or by value ((SCT << 8) | SC)."""
    status: Status | None = None
    if isinstance(value, str):
        status = Status.__members__.get(value.strip().upper())
    elif isinstance(value, int) and not isinstance(value, bool):
        try:
            status = Status(value)
        except ValueError:
            pass
    if status is None:
        raise DeviceError(Status.INVALID_FIELD, f"status {value!r} is not a status of this device")
    if status in NOT_INJECTABLE:
        raise DeviceError(Status.INVALID_FIELD, f"{status.name} is not a failure to inject")
    return status


def _arm(controller: Controller, command: Command) -> Completion:
    spec = _payload_object(command, {"opcode", "queue", "status", "count"})
    try:
        queue = Queue(spec.get("queue", Queue.ADMIN.value))
    except ValueError:
        raise DeviceError(Status.INVALID_FIELD, f"queue must be 'admin' or 'io', got {spec.get('queue')!r}") from None
    if "opcode" not in spec or "status" not in spec:
        raise DeviceError(Status.INVALID_FIELD, "arming needs an opcode and a status")
    opcode = _json_int(spec["opcode"], "opcode", 0, 0xFF)
    if queue == Queue.IO and opcode not in {int(o) for o in IoOpcode}:
        raise DeviceError(Status.INVALID_FIELD, f"the data path has opcodes 01h (write) and 02h (read), not {opcode:#04x}")
    if queue == Queue.ADMIN and opcode not in {int(o) for o in Opcode}:
        raise DeviceError(Status.INVALID_FIELD, f"opcode {opcode:#04x} is not a command of this device")
    if queue == Queue.ADMIN and opcode == Opcode.INJECT_ERROR:
        raise DeviceError(Status.INVALID_FIELD, "INJECT_ERROR itself cannot fail (it clears the others)")
    status = parse_status(spec["status"])
    count = _json_int(spec.get("count", 1), "count", 1, 0xFFFFFFFF)
    nsid: int | None = None
    if command.nsid not in (0, NSID_ALL):
        controller.device.name_of(command.nsid)  # INVALID_NAMESPACE unless registered
        nsid = command.nsid
    injection = controller.injector.arm(queue, opcode, status, count, nsid)
    return Completion(command.cid, Status.SUCCESS, result=injection.id,
                      data=json.dumps(injection.describe(), sort_keys=True).encode())


def _corrupt(controller: Controller, command: Command) -> Completion:
    spec = _payload_object(command, {"tensor", "block"})
    tensor, block = spec.get("tensor"), spec.get("block", 0)
    if not isinstance(tensor, str):
        raise DeviceError(Status.INVALID_FIELD, f"tensor must be a tensor name, got {tensor!r}")
    namespace = controller.device.namespace_by_id(command.nsid)
    where = namespace.corrupt_block(tensor, block)
    entry = {"namespace": namespace.name, "nsid": namespace.nsid} | where
    controller.injector.record_corruption(entry)
    return Completion(command.cid, Status.SUCCESS, result=where["lba"],
                      data=json.dumps(entry, sort_keys=True).encode())


def _inject(controller: Controller, command: Command) -> Completion:
    action = command.cdw10 & 0xFF
    if action == InjectAction.ARM:
        return _arm(controller, command)
    if action == InjectAction.CORRUPT:
        return _corrupt(controller, command)
    if action == InjectAction.CLEAR:
        cleared = controller.injector.clear()
        return Completion(command.cid, Status.SUCCESS, result=cleared,
                          data=json.dumps({"cleared": cleared}).encode())
    raise DeviceError(Status.INVALID_FIELD, f"inject action {action:#04x} is not 00h (arm), 01h (corrupt) or 02h (clear)")


def handlers(controller: Controller) -> dict[int, Callable[[Command], Completion]]:
    controller.log_pages[LogId.INJECTED_ERRORS] = lambda command: json.dumps(
        controller.injector.log_page(), sort_keys=True).encode()
    return {Opcode.INJECT_ERROR: functools.partial(_inject, controller)}
