"""The controller: decode, validate and dispatch commands; exactly one completion each."""
from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import struct
from typing import Any, Callable


from ..protocol import logpages
from .cmb import ControllerMemoryBuffer
from .device import Device
from ..protocol.status import DeviceError, Status
from .health import CRITICAL_TEMP_KELVIN, WARNING_TEMP_KELVIN
from ..protocol.injection import Queue
from .injection import Injector
from .io import DeviceIO
from ..protocol.logpages import CSUPP, DATA_PATH_SQID, LBCC, NIC, NOT_APPLICABLE, LogId
from ..protocol.entries import NSID_ALL, Command, Completion, IdentifyCns, Opcode, decode_submission
from ..protocol.hyperparameters import GROUP_FIELDS, SET_HYPERPARAMETERS_KEYS
from ..protocol.computational import IO_QUEUE_FLAG
from . import kinds
from . import shared_steps
from .spec import GRAD_FORMATS

log = logging.getLogger(__name__)

IDENTIFY_BYTES = 4096

# Modules that add command families beside the ones below. Each has `handlers(controller)`
# returning {opcode: handler}; a handler takes a Command and returns a Completion or raises
# DeviceError (see Controller.execute).
COMMAND_MODULES: tuple[str, ...] = ("cossd.emulator.commands.injection", "cossd.emulator.features",
                                    "cossd.emulator.snapshots.commands", "cossd.emulator.commands.cmb",
                                    "cossd.emulator.archive.commands",
                                    "cossd.emulator.computational.commands",
                                    "cossd.emulator.state_counters")

# Effects beyond CSUPP that the Commands Supported and Effects page (LID 05h) announces.
COMMAND_EFFECTS: dict[int, int] = {
    Opcode.CREATE_NAMESPACE: NIC,  # a namespace appears
    Opcode.DELETE_NAMESPACE: NIC,  # a namespace disappears
    Opcode.COMMIT_STEP: LBCC,  # the state and params a namespace serves change
}

# The error log's sqid for a failed I/O command (IO_QUEUE_FLAG): I/O queue 1, as the data
# path's injected failures (their cs is an I/O opcode too); admin commands are queue 0.
IO_SQID = DATA_PATH_SQID

# Byte of the submission that an error names in its error log entry (parameter error
# location); any other failure has none (FFFFh). Keyed by (opcode or None for any, status).
ERROR_LOCATION: dict[tuple[int | None, Status], int] = {
    (None, Status.INVALID_OPCODE): 0,  # opcode
    (None, Status.INVALID_NAMESPACE): 4,  # nsid
    (None, Status.NAMESPACE_KIND_MISMATCH): 4,  # nsid: a namespace of the other kind
    (Opcode.IDENTIFY, Status.INVALID_FIELD): 40,  # cdw10: CNS
    (Opcode.GET_LOG_PAGE, Status.INVALID_LOG_PAGE): 40,  # cdw10: LID
    (Opcode.GET_LOG_PAGE, Status.INVALID_FIELD): 4,  # nsid (SMART is controller wide)
    (Opcode.BEGIN_STEP, Status.STEP_NUMBER_MISMATCH): 40,  # cdw10-11: step
}


# GET LOG PAGE's byte offset (LPOL, LPOU): cdw12 and cdw13, bytes 48 and 52 of a submission;
# cdw14 (byte 56) holds the offset type (bit 23: LPO is an index, not a byte offset).
LOG_PAGE_OFFSET_AT = 48
LOG_PAGE_OFFSET_UPPER_AT = 52
LOG_PAGE_CDW14_AT = 56
LOG_PAGE_OFFSET_TYPE_INDEX = 1 << 23


def log_range(command: Command, page: bytes) -> bytes:
    """The part of a log page a GET LOG PAGE asks for, as NVMe has it: NUMD + 1 dwords (NUMD
    zero's based: NUMDL in cdw10 bits 31:16, NUMDU in cdw11 bits 15:0) from byte offset LPO
    (cdw12, cdw13; a multiple of 4). Where the page ends first the data is shorter, and the
    completion's data_len says how long; so NUMD all ones reads any page whole. An offset
    given as an index (cdw14 bit 23, OT) is not supported: no page here is a list of
    entries that an index would pick."""
    if command.cdw14 & LOG_PAGE_OFFSET_TYPE_INDEX:
        raise DeviceError(Status.INVALID_FIELD, "log page offset type 1 (an index) is not supported",
                          LOG_PAGE_CDW14_AT)
    dwords = ((command.cdw11 & 0xFFFF) << 16 | command.cdw10 >> 16) + 1
    offset = command.cdw12 | command.cdw13 << 32
    if offset % 4:
        raise DeviceError(Status.INVALID_FIELD, f"log page offset {offset} is not a multiple of 4",
                          LOG_PAGE_OFFSET_AT)
    if offset > len(page):
        raise DeviceError(Status.INVALID_FIELD, f"log page offset {offset} is past the page's end "
                          f"({len(page)} bytes)", LOG_PAGE_OFFSET_UPPER_AT if command.cdw13 else LOG_PAGE_OFFSET_AT)
    return page[offset : offset + 4 * dwords]


# Commands whose payload is JSON, and when (a snapshot command's payload may be empty,
# INJECT_ERROR's clear takes none): such a payload is decoded with the protocol's limits
# (decode_json_payload: depth, duplicate keys, NaN, 64-bit numbers) before the handler runs,
# so that no shape of JSON reaches a handler as anything but INVALID_FIELD.
def _always(command: Command) -> bool:
    return True


def _if_given(command: Command) -> bool:
    return bool(command.payload)


JSON_PAYLOADS: dict[int, Callable[[Command], bool]] = {
    Opcode.CREATE_NAMESPACE: _always,
    Opcode.SET_HYPERPARAMETERS: _always,
    Opcode.SNAPSHOT_CREATE: _if_given,
    Opcode.SNAPSHOT_DELETE: _if_given,
    Opcode.SNAPSHOT_ROLLBACK: _if_given,
    Opcode.SNAPSHOT_CLONE: _if_given,
    Opcode.EXPORT: _if_given,
    Opcode.INJECT_ERROR: lambda command: command.cdw10 & 0xFF in (0, 1),  # arm, corrupt
    Opcode.CMB_WRITE: _always,
    Opcode.CMB_READ: _always,
    Opcode.ARCHIVE: _always,
    Opcode.ARCHIVE_LIST: _always,
    # The shared-step forms (a job's ranks on one namespace: emulator/shared_steps.py).
    Opcode.BEGIN_STEP: _if_given,
    Opcode.COMMIT_STEP: _if_given,
    Opcode.ABORT_STEP: _if_given,
    # SET_FEATURES decodes C0h's and C1h's payloads itself (emulator/features.py).
}
# SET_HYPERPARAMETERS: the fields a payload may change (mode is fixed at creation: refused by
# the namespace with its own message), and "group", which picks one group.


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def _ascii_field(text: str, size: int) -> bytes:
    """NVMe ASCII identify fields: left-justified, space padded."""
    return text.encode("ascii", "replace")[:size].ljust(size, b" ")


class Controller:
    """Executes commands against a Device. Synchronous; safe to call from worker threads."""

    def __init__(self, device: Device, cmb_bytes: int = 0) -> None:
        self.device = device
        # The controller memory buffer (emulator/cmb.py), if it has one.
        self.cmb = ControllerMemoryBuffer(cmb_bytes) if cmb_bytes else None
        self.commands_completed = 0
        self.commands_failed = 0
        # Armed error injections (INJECT_ERROR, emulator/injection.py), checked before dispatch.
        self.injector = Injector(device.health)
        # The device's one I/O entry (emulator/io.py): the CMB's transfers reach the namespaces
        # through it, as the mount's and the server's requests do.
        self.io = DeviceIO(device, self.injector, self.submit)
        self._handlers: dict[int, Callable[[Command], Completion]] = {
            Opcode.GET_LOG_PAGE: self._get_log_page,
            Opcode.IDENTIFY: self._identify,
            Opcode.VENDOR_IDENTIFY: self._vendor_identify,
            Opcode.CREATE_NAMESPACE: self._create_namespace,
            Opcode.DELETE_NAMESPACE: self._delete_namespace,
            Opcode.BEGIN_STEP: self._begin_step,
            Opcode.COMMIT_STEP: self._commit_step,
            Opcode.ABORT_STEP: self._abort_step,
            Opcode.REVERT_STEP: self._revert_step,
            Opcode.SET_HYPERPARAMETERS: self._set_hyperparameters,
            Opcode.NAMESPACE_STATISTICS: self._namespace_statistics,
            Opcode.FLUSH: self._flush,
            Opcode.SCRUB: self._scrub,
        }
        # Vendor log pages that command modules add: LID -> page builder (see _get_log_page).
        self.log_pages: dict[int, Callable[[Command], bytes]] = {}
        # What command modules stop at close, before the device closes (their threads).
        self.closers: list[Callable[[], None]] = []
        # Figures command modules keep (name -> a reader of them), for the metrics endpoints.
        self.figures: dict[str, Callable[[], dict[str, Any]]] = {}
        # I/O commands of the compute and memory namespaces (a submission with IO_QUEUE_FLAG):
        # opcode -> handler, which command modules add (emulator/computational/commands.py).
        self.io_handlers: dict[int, Callable[[Command], Completion]] = {}
        # Their effects beyond CSUPP, for the I/O dwords of the effects page (LID 05h): opcode ->
        # bits, which the same modules add.
        self.io_effects: dict[int, int] = {}
        for module in COMMAND_MODULES:
            self._handlers.update(importlib.import_module(module).handlers(self))

    def submit(self, raw: bytes) -> Completion:
        """Execute one raw submission. Raises SubmissionError if it is malformed."""
        return self.execute(decode_submission(raw))

    def execute(self, command: Command) -> Completion:
        io_command = bool(command.flags & IO_QUEUE_FLAG)
        handler = self._handlers.get(command.opcode)
        if io_command:  # an I/O command: its opcodes are not the admin ones
            handler = self.io_handlers.get(command.opcode)
        # An armed injection answers in the command's place: the command does not run. Queue
        # "admin" names admin opcodes, so it never fires on an I/O command that shares one
        # (02h: Get Log Page, Memory Read); these I/O commands take no injection.
        injected = None if io_command else self.injector.take(Queue.ADMIN, command.opcode, command.nsid,
                                                              command.cid)
        location: int | None = None  # the submission byte a refusal names, where the handler says
        if injected is not None:
            completion = Completion(command.cid, injected.status, data=injected.message.encode())
        elif handler is None:
            completion = Completion(
                command.cid, Status.INVALID_OPCODE,
                data=f"opcode {command.opcode:#04x} is not supported".encode(),
            )
        else:
            try:
                takes_json = JSON_PAYLOADS.get(command.opcode)
                if takes_json is not None and takes_json(command):
                    _ = command.json  # INVALID_FIELD unless well-formed; handlers parse it again
                completion = handler(command)
            except DeviceError as exc:
                completion = Completion(command.cid, exc.status, data=exc.message.encode())
                location = exc.location
            except Exception as exc:  # a bug must not take the device down
                log.exception("opcode %#04x failed", command.opcode)
                completion = Completion(
                    command.cid, Status.INTERNAL_ERROR, data=f"internal error: {exc}".encode()
                )
        if completion.status in (Status.SUCCESS, Status.STEP_SKIPPED_NONFINITE):
            self.commands_completed += 1
        else:
            self.commands_failed += 1
            self._log_error(command, completion, location)
        return completion

    def _log_error(self, command: Command, completion: Completion, location: int | None = None) -> None:
        """Every failed command gets an Error Information entry (LID 01h)."""
        status = completion.status
        io_command = bool(command.flags & IO_QUEUE_FLAG)
        if location is None:
            location = NOT_APPLICABLE
            if isinstance(status, Status):
                # ERROR_LOCATION's opcodes are admin ones: an I/O command of the same opcode
                # (02h Memory Read, not Get Log Page) takes only the locations of any opcode.
                specific = None if io_command else ERROR_LOCATION.get((command.opcode, status))
                location = specific if specific is not None else ERROR_LOCATION.get((None, status), NOT_APPLICABLE)
        # An I/O command came through the I/O queue that IO_QUEUE_FLAG stands for, which the
        # entry's sqid says, so that its opcode (cs) is not read as the admin one.
        self.device.health.log_error(int(status), sqid=IO_SQID if io_command else 0, cmdid=command.cid,
                                     nsid=command.nsid, opcode=command.opcode, parm_error_location=location)

    def _namespace(self, command: Command) -> kinds.AnyNamespace:
        return self.device.namespace_by_id(command.nsid)

    # ------------------------------------------------------------------ identify

    def _identify(self, command: Command) -> Completion:
        cns = command.cdw10 & 0xFF
        page = bytearray(IDENTIFY_BYTES)
        identity = self.device.identity
        if cns == IdentifyCns.CONTROLLER:
            struct.pack_into("<HH", page, 0, identity["vid"], identity["vid"])
            page[4:24] = _ascii_field(identity["serial"], 20)
            page[24:64] = _ascii_field(identity["model"], 40)
            page[64:72] = _ascii_field(identity["firmware_revision"], 8)
            capacity = self.device.capacity_bytes
            unallocated = max(0, capacity - self.device.allocated_bytes)
            page[280:296] = capacity.to_bytes(16, "little")
            page[296:312] = unallocated.to_bytes(16, "little")
            page[261] = 0x02  # lpa: the commands supported and effects page exists
            page[262] = logpages.ERROR_LOG_ENTRIES - 1  # elpe (0's based)
            struct.pack_into("<HH", page, 266, WARNING_TEMP_KELVIN, CRITICAL_TEMP_KELVIN)  # wctemp, cctemp
            struct.pack_into("<I", page, 516, 1024)  # nn: namespaces supported
            logpages.fill_identify_controller(page, identity)  # VER, CNTRLTYPE, SQES, CQES, SUBNQN
            vendor = _json({"kernels": ["adamw", "adam"], "grad_dtypes": list(GRAD_FORMATS),
                            "param_dtypes": ["fp16", "bf16"], "state_dtypes": ["fp32", "bf16", "fp16", "int8"],
                            "profile": self.device.timing_model.profile.name,
                            "timed": self.device.config.timed})
            page[3072 : 3072 + len(vendor)] = vendor[:1024]
        elif cns == IdentifyCns.NAMESPACE:
            namespace = self._namespace(command)
            size = namespace.allocated_bytes // 4096  # state copies, or an nvm namespace's blocks
            struct.pack_into("<QQQ", page, 0, size, size, size)  # nsze, ncap, nuse in 4 KiB blocks
            struct.pack_into("<I", page, 128 + 0, 12 << 16)  # lbaf0: 2^12 byte blocks
        elif cns == IdentifyCns.ACTIVE_NAMESPACES:
            ids = sorted(ns.nsid for ns in self.device.namespaces.values() if ns.nsid > command.nsid)
            struct.pack_into(f"<{min(len(ids), 1024)}I", page, 0, *ids[:1024])
        else:
            raise DeviceError(Status.INVALID_FIELD, f"identify CNS {cns:#04x} is not supported")
        return Completion(command.cid, Status.SUCCESS, data=bytes(page))

    # ------------------------------------------------------------------ log pages

    def _get_log_page(self, command: Command) -> Completion:
        """cdw10 bits 7:0 select the page; NUMD and the offset the part of it (log_range)."""
        lid = command.cdw10 & 0xFF
        if lid == LogId.ERROR:
            entries = [entry.fields() for entry in self.device.health.error_entries()]
            data = logpages.encode_error_log(entries)
        elif lid == LogId.SMART:
            if command.nsid not in (0, NSID_ALL):
                raise DeviceError(Status.INVALID_FIELD, "the SMART / health log is controller wide: "
                                                        f"nsid must be 0 or 0xffffffff, not {command.nsid:#x}")
            data = logpages.encode_smart(self.device.smart())
        elif lid == LogId.COMMANDS_SUPPORTED_AND_EFFECTS:
            data = logpages.encode_effects(
                {opcode: CSUPP | COMMAND_EFFECTS.get(opcode, 0) for opcode in self._handlers},
                {opcode: CSUPP | self.io_effects.get(opcode, 0) for opcode in self.io_handlers})
        elif lid == LogId.OPTIMIZER_STATISTICS:
            if command.nsid in (0, NSID_ALL):
                namespaces = sorted(self.device.namespaces.values(), key=lambda ns: ns.nsid)
            else:
                namespaces = [self._namespace(command)]
            data = _json({ns.name: ns.statistics() for ns in namespaces})
        elif lid in self.log_pages:
            data = self.log_pages[lid](command)
        else:
            raise DeviceError(Status.INVALID_LOG_PAGE, f"invalid log page {lid:#04x}")
        return Completion(command.cid, Status.SUCCESS, data=log_range(command, data))

    def _vendor_identify(self, command: Command) -> Completion:
        description = self.device.describe()
        description["cmb"] = self.cmb.describe() if self.cmb is not None else None
        return Completion(command.cid, Status.SUCCESS, data=_json(description))

    def close(self) -> None:
        for close in reversed(self.closers):
            close()
        self.closers.clear()
        if self.cmb is not None:
            self.cmb.close()
            self.cmb = None

    # ------------------------------------------------------------------ namespaces

    def _create_namespace(self, command: Command) -> Completion:
        spec = kinds.spec_from_payload(command.json)  # optimizer or nvm
        namespace = self.device.create_namespace(spec)
        return Completion(command.cid, Status.SUCCESS, result=namespace.nsid,
                          data=_json(namespace.config()))

    def _delete_namespace(self, command: Command) -> Completion:
        # By registry, so that a namespace that failed recovery can still be deleted.
        self.device.delete_namespace(self.device.name_of(command.nsid))
        return Completion(command.cid, Status.SUCCESS, result=command.nsid)

    # ------------------------------------------------------------------ steps

    def _begin_step(self, command: Command) -> Completion:
        namespace = self.device.optimizer_namespace(command.nsid, "begin step")
        step = command.cdw10_11 or None
        grad_scale = command.cdw12_13_f64 if (command.cdw12 or command.cdw13) else 1.0
        grad_scales = None
        if command.payload:
            value = command.json  # INVALID_FIELD for anything malformed
            if not (isinstance(value, dict) and set(value) == {"grad_scales"}):
                # a job's ranks sharing the step
                return shared_steps.begin(namespace, command, command.cdw10_11, grad_scale)
            grad_scales = value["grad_scales"]
            if not isinstance(grad_scales, dict):
                raise DeviceError(Status.INVALID_FIELD, "grad_scales must be a JSON object {tensor: scale}")
        opened = namespace.begin_step(step, grad_scale, grad_scales)
        return Completion(command.cid, Status.SUCCESS, result=opened & 0xFFFFFFFF,
                          data=_json({"step": opened, "grad_scale": grad_scale}))

    def _commit_step(self, command: Command) -> Completion:
        namespace = self.device.optimizer_namespace(command.nsid, "commit step")
        if command.payload:
            return shared_steps.commit(namespace, command)
        result = namespace.commit_step()
        status = Status.STEP_SKIPPED_NONFINITE if result.skipped else Status.SUCCESS
        return Completion(command.cid, status, result=result.committed_step & 0xFFFFFFFF,
                          data=_json(dataclasses.asdict(result)))

    def _abort_step(self, command: Command) -> Completion:
        namespace = self.device.optimizer_namespace(command.nsid, "abort step")
        if command.payload:
            return shared_steps.abort(namespace, command)
        step = namespace.abort_step()
        return Completion(command.cid, Status.SUCCESS, result=step & 0xFFFFFFFF,
                          data=_json({"aborted_step": step}))

    def _revert_step(self, command: Command) -> Completion:
        namespace = self.device.optimizer_namespace(command.nsid, "revert step")
        step = command.cdw10_11
        if not step:
            raise DeviceError(Status.INVALID_FIELD, "REVERT_STEP names the committed step to undo (cdw10-11)", 40)
        reverted = namespace.revert_step(step)
        return Completion(command.cid, Status.SUCCESS, result=reverted["committed_step"] & 0xFFFFFFFF,
                          data=_json(reverted))

    def _set_hyperparameters(self, command: Command) -> Completion:
        changes = command.json
        if not isinstance(changes, dict):
            raise DeviceError(Status.INVALID_FIELD, "payload must be a JSON object")
        unknown = sorted(set(changes) - set(SET_HYPERPARAMETERS_KEYS))
        if unknown:
            raise DeviceError(Status.INVALID_FIELD, f"unknown hyperparameter(s) {', '.join(map(repr, unknown))[:200]}; "
                              f"this command takes {', '.join(GROUP_FIELDS)} and group")
        group = changes.pop("group", None)  # checked by the namespace: an int in 0..G-1
        hyper = self.device.optimizer_namespace(command.nsid, "set hyperparameters").set_hyperparameters(group, **changes)
        return Completion(command.cid, Status.SUCCESS, data=_json(dataclasses.asdict(hyper)))

    def _namespace_statistics(self, command: Command) -> Completion:
        return Completion(command.cid, Status.SUCCESS,
                          data=_json(self._namespace(command).statistics()))

    def _scrub(self, command: Command) -> Completion:
        """Verify every block checksum of one namespace or all; bad blocks are media errors
        (counted by the namespace) and error log entries."""
        if command.nsid == NSID_ALL:  # every namespace that has checksums: not the nvm ones
            namespaces = sorted((optimizer for ns in self.device.namespaces.values()
                                 if (optimizer := ns.as_optimizer()) is not None), key=lambda ns: ns.nsid)
        else:
            namespaces = [self.device.optimizer_namespace(command.nsid, "scrub (block checksums)")]
        report: dict[str, Any] = {}
        for namespace in namespaces:
            blocks, bad = namespace.scrub_blocks()
            report[namespace.name] = {"blocks": blocks, "bad": [[tensor, block] for tensor, block in bad]}
            for tensor, block in bad:
                self.device.health.log_error(
                    Status.UNRECOVERED_READ_ERROR, sqid=0, cmdid=command.cid, nsid=namespace.nsid,
                    lba=namespace.tensors[tensor].first_block + block, opcode=command.opcode,
                )
        bad_blocks = sum(len(entry["bad"]) for entry in report.values())
        return Completion(command.cid, Status.SUCCESS, result=bad_blocks, data=_json(report))

    def _flush(self, command: Command) -> Completion:
        if command.nsid == NSID_ALL:
            for namespace in list(self.device.namespaces.values()):
                namespace.flush()
            return Completion(command.cid, Status.SUCCESS)
        durable = self._namespace(command).flush()
        return Completion(command.cid, Status.SUCCESS, result=durable & 0xFFFFFFFF)
