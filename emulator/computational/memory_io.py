"""SLM I/O on a memory namespace: Memory Read (02h), Write (05h), Fill (04h) and Copy (01h),
the last from memory ranges or from LBA ranges of an NVM namespace (a restore). Byte
offsets and lengths are whole dwords; every source and the destination are checked before
any byte moves, so a refused command changes nothing."""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from ...protocol.computational import (COPY_SOURCE_LAYOUTS, MAX_RANGES, SLM_MAX_TRANSFER, CopyFormat,
                                       MemoryOpcode)
from ...protocol.entries import Command, Completion
from ...protocol.status import DeviceError, Status
from ..cmb import ControllerMemoryBuffer
from ..nvm import LBA_BYTES, NvmNamespace
from ..transaction import first_overlap
from .namespaces import MemoryNamespace, check_slm_span


def memory_namespace(device: Any, nsid: int) -> MemoryNamespace:
    namespace = device.namespace_by_id(nsid)
    memory: MemoryNamespace | None = namespace.as_memory()
    if memory is None:
        raise DeviceError(Status.NAMESPACE_KIND_MISMATCH,
                          f"namespace {namespace.name!r} is a {namespace.kind} namespace, not memory")
    return memory


def memory_of(namespace: MemoryNamespace, cmb: ControllerMemoryBuffer | None) -> ControllerMemoryBuffer | None:
    return cmb if namespace.on_cmb else namespace.memory


def _span(namespace: MemoryNamespace, cmb: ControllerMemoryBuffer | None, sb: int, length: int,
          what: str) -> np.ndarray:
    """The namespace's bytes [sb, sb + length): whole dwords, inside it (INVALID_FIELD either
    way, as the prototype answers both)."""
    check_slm_span(sb, length, what)
    memory = memory_of(namespace, cmb)
    size = memory.size if memory is not None else 0
    if sb + length > size:
        raise DeviceError(Status.INVALID_FIELD, f"{what}: bytes {sb}..{sb + length} pass the end of memory "
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


def _source_table(command: Command, form: int, count: int) -> np.ndarray:
    """The `count` source descriptors of `form` that make up the whole payload."""
    layout = COPY_SOURCE_LAYOUTS.get(form)  # type: ignore[call-overload]
    if layout is None:
        raise DeviceError(Status.INVALID_FIELD, f"copy format {form:#x}: 2h or 3h (LBA ranges of NVM namespaces) "
                          "or 4h (memory ranges)", 48)
    if len(command.payload) != count * layout.itemsize:
        raise DeviceError(Status.INVALID_FIELD, f"{count} format {form:#x} source ranges take "
                          f"{count * layout.itemsize} bytes of data, got {len(command.payload)}")
    return np.frombuffer(command.payload, dtype=layout, count=count)


def _nvm_sources(device: Any, table: np.ndarray, destination_nsid: int) -> list[tuple[NvmNamespace, int, int]]:
    """Formats 2h/3h: (namespace, byte offset, bytes) of each LBA range, checked."""
    sources = []
    for index, row in enumerate(table):
        if int(row["snsid"]) == destination_nsid:
            raise DeviceError(Status.INVALID_NAMESPACE, f"source {index}: LBA ranges of the destination itself")
        namespace = device.namespace_by_id(int(row["snsid"]))
        # Not a compute or memory namespace either: NVM namespaces to the device, with no LBAs.
        nvm: NvmNamespace | None = namespace.as_plain_nvm()
        if nvm is None:
            raise DeviceError(Status.INVALID_NAMESPACE, f"source {index}: namespace {namespace.name!r} is not an "
                              "NVM namespace (formats 2h and 3h name LBAs)")
        start, blocks = int(row["slba"]), int(row["nlb"]) + 1  # NLB is 0's based
        if (start + blocks) * LBA_BYTES > nvm.capacity_bytes:
            raise DeviceError(Status.LBA_OUT_OF_RANGE, f"source {index}: LBAs {start}..{start + blocks} of "
                              f"{nvm.name!r} ({nvm.blocks} blocks)")
        sources.append((nvm, start * LBA_BYTES, blocks * LBA_BYTES))
    return sources


def _memory_sources(device: Any, cmb: ControllerMemoryBuffer | None,
                    table: np.ndarray) -> list[tuple[MemoryNamespace, int, np.ndarray]]:
    """Format 4h: (namespace, first byte, its bytes) of each memory range, checked."""
    sources = []
    for index, row in enumerate(table):
        snsid, saddr, nbyte = int(row["snsid"]), int(row["saddr"]), int(row["nbyte"])
        if bytes(row["reserved4"]) != bytes(4) or bytes(row["reserved20"]) != bytes(2) \
                or bytes(row["reserved24"]) != bytes(8):
            raise DeviceError(Status.INVALID_FIELD, f"source {index}: reserved bytes are not zero")
        namespace = device.namespace_by_id(snsid)
        memory: MemoryNamespace | None = namespace.as_memory()
        if memory is None:
            raise DeviceError(Status.INVALID_NAMESPACE, f"source {index}: namespace {namespace.name!r} is a "
                              f"{namespace.kind} namespace (format 4h names memory ranges)")
        sources.append((memory, saddr, _span(memory, cmb, saddr, nbyte, f"source {index}")))
    return sources


def copy(device: Any, cmb: ControllerMemoryBuffer | None, namespace: MemoryNamespace, command: Command) -> Completion:
    """Memory Copy: CDW2-3 the bytes copied in all, CDW10-11 the destination's first byte,
    CDW12 bits 7:0 the number of source ranges (0's based) and bits 11:8 the format; the data
    the source descriptors."""
    count, form = (command.cdw12 & 0xFF) + 1, (command.cdw12 >> 8) & 0xF
    if count > MAX_RANGES:
        raise DeviceError(Status.MAX_MEMORY_RANGE_EXCEEDED, f"{count} source ranges; at most {MAX_RANGES}")
    table = _source_table(command, form, count)
    destination_at = command.cdw10_11
    pieces: list[np.ndarray] = []
    if form == CopyFormat.MEMORY:
        memory_sources = _memory_sources(device, cmb, table)
        total = sum(len(view) for _, _, view in memory_sources)
        _check_length(command, total)
        destination = _span(namespace, cmb, destination_at, total, "destination")
        target = memory_of(namespace, cmb)
        same = [(saddr, saddr + len(view), f"source {index}") for index, (source, saddr, view)
                in enumerate(memory_sources) if len(view) and memory_of(source, cmb) is target]
        if first_overlap(same + [(destination_at, destination_at + total, "the destination")]) is not None:
            raise DeviceError(Status.OVERLAPPING_IO_RANGE, "a source range overlaps the destination")
        pieces = [view.copy() for _, _, view in memory_sources]
    else:
        sources = _nvm_sources(device, table, namespace.nsid)
        total = sum(length for _, _, length in sources)
        _check_length(command, total)
        destination = _span(namespace, cmb, destination_at, total, "destination")
        for source, offset, length in sources:
            piece = source.read(offset, length)  # counted as the NVM namespace's reads
            if len(piece) != length:
                raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"{source.name!r}: {len(piece)} of {length} bytes read")
            pieces.append(np.frombuffer(piece, dtype=np.uint8))
    at = 0
    for chunk in pieces:
        destination[at : at + len(chunk)] = chunk
        at += len(chunk)
    _count(namespace, written=total)
    return _done(command, total, ranges=count)


def _check_length(command: Command, total: int) -> None:
    """CDW2-3, the Memory Copy's length (the prototype's reading), must be what the sources add up to."""
    length = command.cdw2 | command.cdw3 << 32
    if length != total:
        raise DeviceError(Status.INVALID_FIELD, f"length {length} (CDW2-3) is not the {total} bytes the sources name", 8)


def run(device: Any, cmb: ControllerMemoryBuffer | None, namespace: MemoryNamespace, command: Command) -> Completion:
    opcode = command.opcode
    sb = command.cdw10_11
    if opcode == MemoryOpcode.MEMORY_READ:
        if command.cdw12 > SLM_MAX_TRANSFER:
            raise DeviceError(Status.INVALID_FIELD, f"read of {command.cdw12} bytes: at most {SLM_MAX_TRANSFER} "
                              "in one command (mxfer)", 48)
        view = _span(namespace, cmb, sb, command.cdw12, "read")
        _count(namespace, read=len(view))
        return Completion(command.cid, Status.SUCCESS, result=len(view), data=view.tobytes())
    if opcode == MemoryOpcode.MEMORY_WRITE:
        if command.cdw12 != len(command.payload):
            raise DeviceError(Status.INVALID_FIELD, f"write length {command.cdw12} (CDW12) is not the "
                              f"{len(command.payload)} bytes sent", 48)
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

