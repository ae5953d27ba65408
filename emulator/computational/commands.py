"""The standard face's commands: Load Program (85h), Program Activation Management (88h),
Memory Range Set Management (89h), Identify CNS 05h for CSI 03h/04h, and the I/O commands of
the two namespace kinds (Execute Program; SLM Copy, Read, Fill, Write), which a submission
marks with IO_QUEUE_FLAG. Loaded by the controller (COMMAND_MODULES)."""
from __future__ import annotations

import json
import struct
from typing import Any, Callable

import numpy as np

from ...protocol.computational import (ADAMW_HYPERPARAMETERS, COPY_SOURCE_LAYOUTS, CP_IDENTIFY_NAMESPACE,
                                       CSI_COMPUTE, CSI_MEMORY, IDENTIFY_CNS_CSI_NAMESPACE, IDENTIFY_CSI_SHIFT,
                                       LOAD_GRANULARITY, MATTR_CMB_WINDOW, MATTR_VOLATILE, MAX_ACTIVATED,
                                       MAX_PROGRAM_BYTES, MAX_RANGE_SETS, MAX_RANGES, MEMORY_RANGE, PROGRAM_TABLE_AT,
                                       RANGE_GRANULARITY_SHIFT, SLM_ALIGN, SLM_IDENTIFY_NAMESPACE, SLM_MAX_TRANSFER,
                                       ActivationSelect, ComputeOpcode, CpAdminOpcode, MemoryOpcode, RangeSetSelect)
from ...protocol.entries import Command, Completion, Opcode
from ...protocol.logpages import LBCC
from ...protocol.status import DeviceError, Status
from . import memory_io
from .namespaces import ComputeNamespace, MemoryNamespace
from .programs import PROGRAM_SLOTS, ComputeState, adamw_pieces, hyperparameter_changes, run_adamw
from .ranges import decode, resolve

Handler = Callable[[Command], Completion]
# The I/O commands' effects beyond CSUPP on the effects page (LID 05h). One I/O dword serves
# an opcode of both command sets: 01h is Execute Program (it changes the optimizer state and
# params a namespace serves) and Memory Copy, and Fill (04h) and Write (05h) change memory
# contents too; Memory Read (02h) changes nothing.
IO_EFFECTS: dict[int, int] = {ComputeOpcode.EXECUTE_PROGRAM: LBCC, MemoryOpcode.MEMORY_COPY: LBCC,
                              MemoryOpcode.MEMORY_FILL: LBCC, MemoryOpcode.MEMORY_WRITE: LBCC}
IDENTIFY_BYTES = 4096


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


class ComputationalCommands:
    """The commands, against one controller's device and CMB (`controller` is the Controller;
    not imported, so that this package stays below it)."""

    def __init__(self, controller: Any, identify: Handler | None) -> None:
        self.controller = controller
        self.device = controller.device
        self._identify_base = identify

    # ------------------------------------------------------------------ namespaces

    def compute(self, nsid: int) -> tuple[ComputeNamespace, ComputeState]:
        namespace = self.device.namespace_by_id(nsid)
        compute: ComputeNamespace | None = namespace.as_compute()
        if compute is None:
            raise DeviceError(Status.NAMESPACE_KIND_MISMATCH,
                              f"namespace {namespace.name!r} is a {namespace.kind} namespace: this command "
                              "takes a compute namespace")
        if compute.state is None:
            compute.state = ComputeState()
        return compute, compute.state

    # ------------------------------------------------------------------ admin

    def load_program(self, command: Command) -> Completion:
        """No program can be downloaded: index 0 is built in (maxpb 0)."""
        self.compute(command.nsid)
        index = command.cdw10 & 0xFFFF
        if index >= PROGRAM_SLOTS:
            raise DeviceError(Status.INVALID_PROGRAM_INDEX, f"program index {index}: this namespace holds "
                              f"{PROGRAM_SLOTS} program", 40)
        raise DeviceError(Status.PROGRAM_INDEX_NOT_DOWNLOADABLE,
                          f"program index {index} holds a built-in program; this device takes no downloads "
                          "(maxpb 0)", 40)

    def activation(self, command: Command) -> Completion:
        _, state = self.compute(command.nsid)
        index, select = command.cdw10 & 0xFFFF, (command.cdw10 >> 16) & 0xF
        if index >= PROGRAM_SLOTS:
            raise DeviceError(Status.INVALID_PROGRAM_INDEX, f"program index {index}: this namespace holds "
                              f"{PROGRAM_SLOTS} program", 40)
        if select not in (ActivationSelect.ACTIVATE, ActivationSelect.DEACTIVATE):
            raise DeviceError(Status.INVALID_FIELD, f"program activation SEL {select}: 0 (deactivate) or 1 "
                              "(activate)", 40)
        state.active = select == ActivationSelect.ACTIVATE
        return Completion(command.cid, Status.SUCCESS)

    def range_set(self, command: Command) -> Completion:
        _, state = self.compute(command.nsid)
        select, rsid = command.cdw10 & 0xF, command.cdw10 >> 16
        if select == RangeSetSelect.DELETE:
            state.delete_range_set(rsid)
            return Completion(command.cid, Status.SUCCESS, result=rsid)
        if select != RangeSetSelect.CREATE:
            raise DeviceError(Status.INVALID_FIELD, f"memory range set SEL {select}: 0 (create) or 1 (delete)", 40)
        count = command.cdw11 & 0xFF
        table = decode(command.payload, count)
        if len(command.payload) != count * MEMORY_RANGE.itemsize:
            raise DeviceError(Status.INVALID_FIELD, f"{len(command.payload)} bytes of data for {count} descriptors")
        resolve(table, self.device.namespace_by_id, self.controller.cmb)  # checked now, and again at each use
        rsid = state.add_range_set(table)
        return Completion(command.cid, Status.SUCCESS, result=rsid)

    def identify(self, command: Command) -> Completion:
        """CNS 05h for the two command sets; every other CNS as before."""
        if command.cdw10 & 0xFF != IDENTIFY_CNS_CSI_NAMESPACE:
            if self._identify_base is None:
                raise DeviceError(Status.INVALID_FIELD, "identify is not supported")
            return self._identify_base(command)
        csi = command.cdw11 >> IDENTIFY_CSI_SHIFT
        page = bytearray(IDENTIFY_BYTES)
        if csi == CSI_COMPUTE:
            _, state = self.compute(command.nsid)
            fields = np.zeros((), dtype=CP_IDENTIFY_NAMESPACE)
            for name, value in (("maxact", MAX_ACTIVATED), ("maxmemrs", MAX_RANGE_SETS), ("mrsg", RANGE_GRANULARITY_SHIFT),
                                ("maxmemr", MAX_RANGES), ("maxpb", MAX_PROGRAM_BYTES), ("lpg", LOAD_GRANULARITY)):
                fields[name] = value
            page[: CP_IDENTIFY_NAMESPACE.itemsize] = fields.tobytes()
            table = state.descriptors()
            page[PROGRAM_TABLE_AT : PROGRAM_TABLE_AT + len(table)] = table
        elif csi == CSI_MEMORY:
            page[: SLM_IDENTIFY_NAMESPACE.itemsize] = self.slm_identify(command.nsid)
        else:
            raise DeviceError(Status.INVALID_FIELD, f"identify CNS 05h: CSI {csi:#04x} is not supported "
                              f"(CSI {CSI_MEMORY:#04x} memory, {CSI_COMPUTE:#04x} compute)", 44)
        return Completion(command.cid, Status.SUCCESS, data=bytes(page))

    def slm_identify(self, nsid: int) -> bytes:
        """The memory namespace's SLM Identify Namespace fields (cossd's layout): its size, the
        dword granularity of SLM I/O, the most one Read or Write moves, the most source ranges
        of a Memory Copy and the formats it takes, and whether it is a CMB window."""
        namespace = memory_io.memory_namespace(self.device, nsid)
        memory = memory_io.memory_of(namespace, self.controller.cmb)
        fields = np.zeros((), dtype=SLM_IDENTIFY_NAMESPACE)
        fields["msz"] = memory.size if memory is not None else 0  # a CMB window without a CMB: 0
        fields["mgran"] = SLM_ALIGN
        fields["mxfer"] = SLM_MAX_TRANSFER
        fields["msrc"] = MAX_RANGES
        fields["cfmts"] = sum(1 << int(form) for form in COPY_SOURCE_LAYOUTS)
        fields["mattr"] = MATTR_VOLATILE | (MATTR_CMB_WINDOW if namespace.on_cmb else 0)
        return fields.tobytes()

    # ------------------------------------------------------------------ I/O

    def execute_program(self, command: Command) -> Completion:
        """Execute Program: CDW2 program index (15:0) and range set ID (31:16), CDW3 the number
        of inline ranges, CDW4 the data length, CDW10-11 and CDW12-13 the two parameters.
        adamw_step: parameter 1 the step (0: the open or an implicit step), parameter 2 the
        gradient scale as an IEEE double (0: 1.0, or the open step's); the return value is
        the number of non-finite gradient elements of the step this Execute committed."""
        _, state = self.compute(command.nsid)
        index, rsid, count, length = command.cdw2 & 0xFFFF, command.cdw2 >> 16, command.cdw3, command.cdw4
        state.check_program(index)
        data = command.payload
        if length != len(data):
            raise DeviceError(Status.INVALID_FIELD, f"data length {length} (CDW4) is not the {len(data)} bytes sent", 16)
        if rsid and count:
            raise DeviceError(Status.INVALID_FIELD, f"a range set ({rsid}) and {count} inline ranges at once", 8)
        if rsid:
            table, used = state.range_set(rsid), 0
        else:
            table = decode(data, count)
            used = count * MEMORY_RANGE.itemsize
        rest = data[used:]
        if len(rest) not in (0, ADAMW_HYPERPARAMETERS.itemsize):
            raise DeviceError(Status.INVALID_FIELD, f"{len(rest)} bytes after the descriptors: none, or the "
                              f"{ADAMW_HYPERPARAMETERS.itemsize}-byte hyperparameter block")
        ranges = resolve(table, self.device.namespace_by_id, self.controller.cmb)
        namespace, pieces = adamw_pieces(ranges)
        scale_bits = command.cdw12 | command.cdw13 << 32
        grad_scale = struct.unpack("<d", struct.pack("<Q", scale_bits))[0] if scale_bits else None
        hypers = hyperparameter_changes(rest) if rest else None
        report = run_adamw(namespace, pieces, command.cdw10_11, grad_scale, hypers)
        value = int(report["commit"]["nonfinite_elements"]) if "commit" in report else 0
        report["return_value"] = value
        return Completion(command.cid, Status.SUCCESS, result=value & 0xFFFFFFFF,
                          data=struct.pack("<Q", value) + _json(report))

    def io(self, command: Command) -> Completion:
        """An I/O command: the opcode means what the namespace's command set says."""
        namespace = self.device.namespace_by_id(command.nsid)
        if namespace.as_compute() is not None and command.opcode == ComputeOpcode.EXECUTE_PROGRAM:
            return self.execute_program(command)
        memory: MemoryNamespace | None = namespace.as_memory()
        if memory is not None and command.opcode in tuple(MemoryOpcode):
            return memory_io.run(self.device, self.controller.cmb, memory, command)
        raise DeviceError(Status.INVALID_OPCODE, f"I/O opcode {command.opcode:#04x} is not supported by "
                          f"namespace {namespace.name!r} ({namespace.kind})", 0)


def handlers(controller: Any) -> dict[int, Handler]:
    commands = ComputationalCommands(controller, controller._handlers.get(Opcode.IDENTIFY))
    io_handlers = getattr(controller, "io_handlers", None)
    if io_handlers is not None:
        for opcode in {*tuple(ComputeOpcode), *tuple(MemoryOpcode)}:
            io_handlers[int(opcode)] = commands.io
        controller.io_effects.update(IO_EFFECTS)
    return {CpAdminOpcode.LOAD_PROGRAM: commands.load_program,
            CpAdminOpcode.PROGRAM_ACTIVATION_MANAGEMENT: commands.activation,
            CpAdminOpcode.MEMORY_RANGE_SET_MANAGEMENT: commands.range_set,
            Opcode.IDENTIFY: commands.identify}
