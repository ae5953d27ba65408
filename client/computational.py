"""The standard face of a computational SSD, from the host: compute and memory namespaces,
program activation, memory range sets, Execute Program (adamw_step) and SLM I/O, over an
AdminClient's queue pair (docs/command-set.md, "The standard face")."""
from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import numpy as np

from ..protocol.computational import (ADAMW_PROGRAM_INDEX, CP_IDENTIFY_NAMESPACE, CSI_COMPUTE, CSI_MEMORY,
                                      IDENTIFY_CNS_CSI_NAMESPACE, IDENTIFY_CSI_SHIFT, IO_QUEUE_FLAG,
                                      MATTR_CMB_WINDOW, MATTR_VOLATILE, MAX_RANGES, MEMORY_SOURCE_RANGE,
                                      NVM_LBA_BYTES, NVM_SOURCE_RANGE, PROGRAM_DESCRIPTOR, PROGRAM_TABLE_AT,
                                      SLM_IDENTIFY_NAMESPACE, ActivationSelect, ComputeOpcode, CopyFormat,
                                      CpAdminOpcode, MemoryOpcode, RangeSetSelect, encode_hyperparameters,
                                      encode_ranges)
from ..protocol.entries import SUBMISSION, Completion, Opcode, encode_submission, status_error
from ..protocol.status import DeviceError, Status
from .admin import AdminClient, check_field, split_u64

# One range: (mnsid, starting byte, length in bytes).
Range = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class ExecuteResult:
    """An Execute Program's completion: the 64-bit return value and cossd's report."""

    return_value: int
    report: dict[str, Any]


def submission(opcode: int, *, io: bool = False, cid: int = 0, nsid: int = 0, cdw2: int = 0, cdw3: int = 0,
               cdw4: int = 0, payload: bytes = b"", **dwords: int) -> bytes:
    """A 64-byte entry and its payload, with CDW2-4 and the I/O queue flag where given. A field
    out of its width is a ValueError (client/admin.py, check_field): nothing is cut to fit."""
    check_field("opcode", opcode, 8)
    for name, value in (("nsid", nsid), ("cdw2", cdw2), ("cdw3", cdw3), ("cdw4", cdw4), *dwords.items()):
        check_field(name, value, 32)
    raw = bytearray(encode_submission(opcode, cid=cid, nsid=nsid, payload=payload, **dwords))
    entry = np.frombuffer(raw, dtype=SUBMISSION, count=1)
    entry["flags"] = IO_QUEUE_FLAG if io else 0
    entry["cdw2"], entry["cdw3"], entry["mptr"] = cdw2, cdw3, cdw4
    return bytes(raw)


class ComputationalClient:
    """The two command sets over one AdminClient (not thread-safe, as it is not)."""

    def __init__(self, admin: AdminClient) -> None:
        self.admin = admin
        self._cid = 0

    def submit(self, opcode: int, *, io: bool = False, **fields: Any) -> Completion:
        self._cid = (self._cid + 1) & 0xFFFF
        return self.admin.transport.exchange(submission(opcode, io=io, cid=self._cid, **fields))

    def call(self, opcode: int, *, io: bool = False, **fields: Any) -> Completion:
        completion = self.submit(opcode, io=io, **fields)
        if completion.status != Status.SUCCESS:
            raise status_error(completion)
        return completion

    # ------------------------------------------------------------------ namespaces

    def ensure_namespace(self, name: str, kind: str, **fields: Any) -> int:
        """The nsid of namespace `name`, created as `kind` (compute or memory) where absent;
        a namespace of that name and another kind is an error."""
        for entry in self.admin.describe()["namespaces"]:
            if entry["name"] == name:
                if entry["kind"] != kind:
                    raise DeviceError(Status.NAMESPACE_KIND_MISMATCH,
                                      f"namespace {name!r} is a {entry['kind']} namespace, not {kind}")
                return int(entry["nsid"])
        return self.admin.create_namespace({"name": name, "kind": kind, **fields})

    def identify(self, nsid: int) -> dict[str, Any]:
        """The CP-specific Identify Namespace fields and the program table."""
        page = self.admin.call(Opcode.IDENTIFY, nsid=nsid, cdw10=IDENTIFY_CNS_CSI_NAMESPACE,
                               cdw11=CSI_COMPUTE << IDENTIFY_CSI_SHIFT).data
        fields = np.frombuffer(page, dtype=CP_IDENTIFY_NAMESPACE, count=1)[0]
        table = np.frombuffer(page, dtype=PROGRAM_DESCRIPTOR, count=1, offset=PROGRAM_TABLE_AT)
        return {"fields": {name: int(fields[name]) for name in CP_IDENTIFY_NAMESPACE.names or () if name != "reserved7"},
                "programs": [{"index": index, "occupied": int(row["flags"]) & 0x3,
                              "activated": bool(int(row["flags"]) >> 2 & 1), "type": int(row["ptype"]),
                              "pid": int(row["pid"])} for index, row in enumerate(table)]}

    def identify_memory(self, nsid: int) -> dict[str, Any]:
        """The SLM Identify Namespace fields of memory namespace `nsid` (cossd's layout), with
        the copy formats and attribute bits spelled out."""
        page = self.admin.call(Opcode.IDENTIFY, nsid=nsid, cdw10=IDENTIFY_CNS_CSI_NAMESPACE,
                               cdw11=CSI_MEMORY << IDENTIFY_CSI_SHIFT).data
        row = np.frombuffer(page, dtype=SLM_IDENTIFY_NAMESPACE, count=1)[0]
        fields = {name: int(row[name]) for name in SLM_IDENTIFY_NAMESPACE.names or ()}
        return {"fields": fields,
                "copy_formats": [form for form in range(16) if fields["cfmts"] >> form & 1],
                "cmb_window": bool(fields["mattr"] & MATTR_CMB_WINDOW),
                "volatile": bool(fields["mattr"] & MATTR_VOLATILE)}

    # ------------------------------------------------------------------ admin

    def activate(self, nsid: int, index: int = ADAMW_PROGRAM_INDEX, active: bool = True) -> None:
        """Program Activation Management (88h): `index` (16 bits, CDW10 15:0) activated or not."""
        check_field("program index", index, 16)
        select = ActivationSelect.ACTIVATE if active else ActivationSelect.DEACTIVATE
        self.call(CpAdminOpcode.PROGRAM_ACTIVATION_MANAGEMENT, nsid=nsid, cdw10=index | select << 16)

    def create_range_set(self, nsid: int, ranges: list[Range]) -> int:
        check_ranges(ranges)
        return self.call(CpAdminOpcode.MEMORY_RANGE_SET_MANAGEMENT, nsid=nsid, cdw10=RangeSetSelect.CREATE,
                         cdw11=len(ranges), payload=encode_ranges(ranges)).result

    def delete_range_set(self, nsid: int, rsid: int) -> None:
        check_field("memory range set ID", rsid, 16)
        self.call(CpAdminOpcode.MEMORY_RANGE_SET_MANAGEMENT, nsid=nsid, cdw10=RangeSetSelect.DELETE | rsid << 16)

    # ------------------------------------------------------------------ Execute Program

    def execute(self, nsid: int, *, ranges: list[Range] | None = None, range_set: int = 0, step: int = 0,
                grad_scale: float | None = None, hyperparameters: dict[str, Any] | None = None,
                index: int = ADAMW_PROGRAM_INDEX) -> ExecuteResult:
        """Execute Program `index` over inline `ranges` or the range set `range_set`;
        `hyperparameters` (lr, beta1, beta2, eps, weight_decay, and optionally group) go
        after the descriptors."""
        check_field("program index", index, 16)
        check_field("memory range set ID", range_set, 16)
        step_low, step_high = split_u64("step", step)
        inline = ranges or []
        check_ranges(inline)
        data = encode_ranges(inline)
        if hyperparameters is not None:
            data += encode_hyperparameters(**hyperparameters)
        scale = struct.unpack("<Q", struct.pack("<d", grad_scale))[0] if grad_scale is not None else 0
        completion = self.call(ComputeOpcode.EXECUTE_PROGRAM, io=True, nsid=nsid, cdw2=index | range_set << 16,
                               cdw3=len(inline), cdw4=len(data), payload=data, cdw10=step_low,
                               cdw11=step_high, cdw12=scale & 0xFFFFFFFF, cdw13=scale >> 32)
        value = struct.unpack_from("<Q", completion.data)[0]
        return ExecuteResult(value, json.loads(completion.data[8:]))

    # ------------------------------------------------------------------ SLM I/O

    # Offsets are 64 bits (CDW10-11), lengths 32 (CDW12): out of them, ValueError, nothing sent.

    def read(self, nsid: int, offset: int, length: int) -> bytes:
        low, high = split_u64("offset", offset)
        return self.call(MemoryOpcode.MEMORY_READ, io=True, nsid=nsid, cdw10=low, cdw11=high,
                         cdw12=check_field("length", length, 32)).data

    def write(self, nsid: int, offset: int, data: bytes) -> int:
        low, high = split_u64("offset", offset)
        return self.call(MemoryOpcode.MEMORY_WRITE, io=True, nsid=nsid, cdw10=low, cdw11=high,
                         cdw12=check_field("length", len(data), 32), payload=bytes(data)).result

    def fill(self, nsid: int, offset: int, length: int, pattern: int = 0) -> int:
        low, high = split_u64("offset", offset)
        return self.call(MemoryOpcode.MEMORY_FILL, io=True, nsid=nsid, cdw10=low, cdw11=high,
                         cdw12=check_field("length", length, 32), cdw13=check_field("pattern", pattern, 32)).result

    def copy_from_memory(self, nsid: int, offset: int, sources: list[Range]) -> int:
        """Memory Copy (format 4h) from (memory nsid, first byte, bytes) ranges, in order, to
        byte `offset` of memory namespace `nsid`."""
        table = np.zeros(len(sources), dtype=MEMORY_SOURCE_RANGE)
        for row, (source, saddr, nbyte) in zip(table, sources):
            check_field("source nsid", source, 32)
            check_field("source address", saddr, 64)
            check_field("source bytes", nbyte, 32)
            row["snsid"], row["saddr"], row["nbyte"] = source, saddr, nbyte
        return self._copy(nsid, offset, CopyFormat.MEMORY, table.tobytes(), len(sources),
                          sum(nbyte for _, _, nbyte in sources))

    def copy_from_nvm(self, nsid: int, offset: int, sources: list[tuple[int, int, int]]) -> int:
        """Memory Copy (format 2h) from LBA ranges (nvm nsid, first LBA, blocks) of NVM
        namespaces: a restore."""
        table = np.zeros(len(sources), dtype=NVM_SOURCE_RANGE)
        for row, (source, slba, blocks) in zip(table, sources):
            if not 1 <= blocks <= 1 << 16:
                raise ValueError(f"1..65536 blocks a source range (NLB is 16 bits, 0's based), got {blocks}")
            check_field("source nsid", source, 32)
            check_field("source LBA", slba, 64)
            row["snsid"], row["slba"], row["nlb"] = source, slba, blocks - 1
        return self._copy(nsid, offset, CopyFormat.NVM_LBAS, table.tobytes(), len(sources),
                          NVM_LBA_BYTES * sum(blocks for _, _, blocks in sources))

    def _copy(self, nsid: int, offset: int, form: int, payload: bytes, count: int, length: int) -> int:
        if not 1 <= count <= MAX_RANGES:
            raise ValueError(f"1..{MAX_RANGES} source ranges, got {count}")
        length_low, length_high = split_u64("copy length", length)
        low, high = split_u64("offset", offset)
        return self.call(MemoryOpcode.MEMORY_COPY, io=True, nsid=nsid, cdw2=length_low, cdw3=length_high,
                         cdw10=low, cdw11=high, cdw12=(count - 1) | form << 8, payload=payload).result


def check_ranges(ranges: list[Range]) -> None:
    """Each (mnsid, starting byte, length) fits its descriptor's fields (MEMORY_RANGE: 32, 64
    and 32 bits), else ValueError: a value cut to fit would name other bytes."""
    for mnsid, sb, length in ranges:
        check_field("range MNSID", mnsid, 32)
        check_field("range starting byte", sb, 64)
        check_field("range length", length, 32)


# The namespaces a trainer's Execute Program path uses, made on first use: one compute
# namespace and one memory namespace that is a window on the CMB (whose bytes the trainer
# already maps and locks its part of).
TRAINER_COMPUTE_NAMESPACE = "cossd-cp"
TRAINER_WINDOW_NAMESPACE = "cossd-cmb"
GROUPS_PER_EXECUTE = MAX_RANGES // 5


class CmbProgram:
    """adamw_step over gradients and params that sit in the CMB: what CMB_WRITE with
    param_cmb_offset does, through the standard's Execute Program instead."""

    def __init__(self, admin: AdminClient) -> None:
        self.client = ComputationalClient(admin)
        self.compute = self.client.ensure_namespace(TRAINER_COMPUTE_NAMESPACE, "compute")
        self.window = self.client.ensure_namespace(TRAINER_WINDOW_NAMESPACE, "memory", cmb=True)
        self.client.activate(self.compute)  # controller state: again after every restart

    def adamw_step(self, nsid: int, spans: list[tuple[int, int, int, int]], *, step: int = 0,
                   state_itemsize: int = 4, grad_itemsize: int = 2) -> list[ExecuteResult]:
        """Spans (first element in the namespace's table order, elements, gradient CMB offset,
        params CMB offset), fifty to an Execute; step 0: the open step (the caller commits).
        grad_itemsize: bytes of one gradient element (the namespace's grad_dtype)."""
        results = []
        for at in range(0, len(spans), GROUPS_PER_EXECUTE):
            ranges: list[Range] = []
            for first, count, grad_at, params_at in spans[at : at + GROUPS_PER_EXECUTE]:
                ranges += [(self.window, grad_at, grad_itemsize * count), (nsid, 4 * first, 4 * count),
                           (nsid, state_itemsize * first, state_itemsize * count),
                           (nsid, state_itemsize * first, state_itemsize * count), (self.window, params_at, 2 * count)]
            results.append(self.client.execute(self.compute, ranges=ranges, step=step))
        return results
