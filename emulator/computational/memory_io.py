"""SLM I/O on a memory namespace: Memory Read (02h), Write (05h), Fill (04h) and Copy (01h),
the last from memory ranges or from LBA ranges of an NVM namespace (a restore). Byte
offsets and lengths are whole dwords; every source and the destination are checked before
any byte moves, so a refused command changes nothing."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from ...protocol.computational import MAX_RANGES, NVM_SOURCE_RANGE, CopyFormat, MemoryOpcode
from ...protocol.entries import Command, Completion
from ...protocol.status import DeviceError, Status
from ..cmb import ControllerMemoryBuffer
from ..nvm import LBA_BYTES, NvmNamespace
from ..transaction import first_overlap
from .namespaces import MemoryNamespace, check_slm_span
from .ranges import decode, resolve


def memory_namespace(device: Any, nsid: int) -> MemoryNamespace:
    namespace = device.namespace_by_id(nsid)
    if not isinstance(namespace, MemoryNamespace):
        raise DeviceError(Status.NAMESPACE_KIND_MISMATCH,
                          f"namespace {namespace.name!r} is a {namespace.kind} namespace, not memory")
    return namespace


def memory_of(namespace: MemoryNamespace, cmb: ControllerMemoryBuffer | None) -> ControllerMemoryBuffer | None:
    return cmb if namespace.on_cmb else namespace.memory


def _span(namespace: MemoryNamespace, cmb: ControllerMemoryBuffer | None, sb: int, length: int,
          what: str) -> np.ndarray:
    """The namespace's bytes [sb, sb + length): whole dwords (INVALID_FIELD), inside it
    (LBA_OUT_OF_RANGE)."""
    check_slm_span(sb, length, what)
    memory = memory_of(namespace, cmb)
    size = memory.size if memory is not None else 0
    if sb + length > size:
        raise DeviceError(Status.LBA_OUT_OF_RANGE, f"{what}: bytes {sb}..{sb + length} pass the end of memory "
                          f"namespace {namespace.name!r} ({size} bytes)")
    return namespace.bytes_of(memory, sb, length, what)


def _count(namespace: MemoryNamespace, read: int = 0, written: int = 0) -> None:
    with namespace._lock:
        counters = namespace.counters
        if read or not written:
            counters.read_commands += 1
            counters.bytes_read += read
        if written:
            counters.write_commands += 1
            counters.bytes_written += written


def _done(command: Command, moved: int, data: bytes = b"", **report: Any) -> Completion:
    return Completion(command.cid, Status.SUCCESS, result=moved & 0xFFFFFFFF,
                      data=data or json.dumps({"bytes": moved, **report}, sort_keys=True).encode())


def _nvm_sources(device: Any, data: bytes, count: int) -> list[tuple[NvmNamespace, int, int]]:
    """Formats 2h/3h: (namespace, byte offset, bytes) of each LBA range, checked."""
    needed = count * NVM_SOURCE_RANGE.itemsize
    if len(data) != needed:
        raise DeviceError(Status.INVALID_FIELD, f"{count} NVM source ranges take {needed} bytes of data, got {len(data)}")
    sources = []
    for index, row in enumerate(np.frombuffer(data, dtype=NVM_SOURCE_RANGE, count=count)):
        namespace = device.namespace_by_id(int(row["nsid"]))
        if type(namespace) is not NvmNamespace:  # not a compute or memory namespace: they are NVM ones to the device
            raise DeviceError(Status.INVALID_FIELD, f"source {index}: namespace {namespace.name!r} is not an NVM namespace")
        start, blocks = int(row["slba"]), int(row["nlb"])
        if blocks == 0 or (start + blocks) * LBA_BYTES > namespace.capacity_bytes:
            raise DeviceError(Status.LBA_OUT_OF_RANGE, f"source {index}: LBAs {start}..{start + blocks} of "
                              f"{namespace.name!r} ({namespace.blocks} blocks)")
        sources.append((namespace, start * LBA_BYTES, blocks * LBA_BYTES))
    return sources


def copy(device: Any, cmb: ControllerMemoryBuffer | None, namespace: MemoryNamespace, command: Command) -> Completion:
    """Memory Copy: CDW10-11 the destination's first byte, CDW12 bits 7:0 the number of
    source ranges (0's based) and bits 11:8 the format; the data the source descriptors."""
    count, form = (command.cdw12 & 0xFF) + 1, (command.cdw12 >> 8) & 0xF
    if count > MAX_RANGES:
        raise DeviceError(Status.MAX_MEMORY_RANGE_EXCEEDED, f"{count} source ranges; at most {MAX_RANGES}")
    destination_at = command.cdw10_11
    if form == CopyFormat.MEMORY:
        table = decode(command.payload, count)
        ranges = resolve(table, device.namespace_by_id, cmb)
        if any(r.view is None for r in ranges):
            raise DeviceError(Status.INVALID_MEMORY_NAMESPACE, "a Memory Copy's sources are memory ranges")
        total = sum(r.length for r in ranges)
        destination = _span(namespace, cmb, destination_at, total, "destination")
        same = [(r.sb, r.sb + r.length, r.what) for r in ranges
                if memory_of(r.namespace, cmb) is memory_of(namespace, cmb)]
        if first_overlap(same + [(destination_at, destination_at + total, "the destination")]) is not None:
            raise DeviceError(Status.OVERLAPPING_MEMORY_RANGE, "a source range overlaps the destination")
        pieces = [r.view.copy() for r in ranges]  # type: ignore[union-attr]
    elif form in (CopyFormat.NVM_LBAS, CopyFormat.NVM_LBAS_3):
        sources = _nvm_sources(device, command.payload, count)
        total = sum(length for _, _, length in sources)
        destination = _span(namespace, cmb, destination_at, total, "destination")
        pieces = []
        for source, offset, length in sources:
            piece = source.read(offset, length)  # counted as the NVM namespace's reads
            if len(piece) != length:
                raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"{source.name!r}: {len(piece)} of {length} bytes read")
            pieces.append(np.frombuffer(piece, dtype=np.uint8))
    else:
        raise DeviceError(Status.INVALID_FIELD, f"copy format {form:#x}: 0h (memory), 2h or 3h (NVM LBAs)", 48)
    at = 0
    for piece in pieces:
        destination[at : at + len(piece)] = piece
        at += len(piece)
    _count(namespace, written=total)
    return _done(command, total, ranges=count)


def run(device: Any, cmb: ControllerMemoryBuffer | None, namespace: MemoryNamespace, command: Command) -> Completion:
    opcode = command.opcode
    sb = command.cdw10_11
    if opcode == MemoryOpcode.MEMORY_READ:
        view = _span(namespace, cmb, sb, command.cdw12, "read")
        _count(namespace, read=len(view))
        return Completion(command.cid, Status.SUCCESS, result=len(view), data=view.tobytes())
    if opcode == MemoryOpcode.MEMORY_WRITE:
        view = _span(namespace, cmb, sb, len(command.payload), "write")
        view[:] = np.frombuffer(command.payload, dtype=np.uint8)
        _count(namespace, written=len(view))
        return _done(command, len(view))
    if opcode == MemoryOpcode.MEMORY_FILL:
        view = _span(namespace, cmb, sb, command.cdw12, "fill")
        view.view(np.uint32)[:] = command.cdw13  # the pattern, a dword, little-endian
        _count(namespace, written=len(view))
        return _done(command, len(view), pattern=command.cdw13)
    return copy(device, cmb, namespace, command)

