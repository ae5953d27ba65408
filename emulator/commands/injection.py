"""The INJECT_ERROR command (D0h): arm failures of chosen commands or tensor-file I/O, corrupt a
block, clear; and log page C3h. The injections themselves: emulator/injection.py."""
from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any, Callable

from ...protocol.entries import NSID_ALL, Command, Completion, IoOpcode, Opcode
from ...protocol.injection import InjectAction, Queue
from ...protocol.logpages import LogId
from ...protocol.status import DeviceError, Status
from ..injection import NOT_INJECTABLE

if TYPE_CHECKING:
    from ..controller import Controller



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
    namespace = controller.device.optimizer_namespace(command.nsid, "corrupting a block (a checksum to fail)")
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
