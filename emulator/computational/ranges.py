"""Memory range descriptors: decoded, resolved to the bytes they name, and checked (count,
alignment, namespace, bounds, overlap) before any command uses them, so that a refused
command changes nothing."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ...protocol.computational import MAX_RANGES, MEMORY_RANGE, RANGE_GRANULARITY
from ...protocol.status import DeviceError, Status
from ..cmb import ControllerMemoryBuffer
from ..namespace import Namespace
from ..transaction import first_overlap
from .namespaces import MemoryNamespace


@dataclasses.dataclass(frozen=True)
class MemoryRange:
    """One descriptor, resolved: the bytes of a memory namespace (`view`), or a byte range of
    an optimizer namespace's state (`view` None; which array the program's use of the range
    says)."""

    index: int
    namespace: Any  # MemoryNamespace or Namespace
    sb: int
    length: int
    view: np.ndarray | None

    @property
    def what(self) -> str:
        return f"range {self.index}"


def decode(data: bytes | memoryview, count: int, at: int = 0) -> np.ndarray:
    """`count` descriptors from byte `at` of `data`; INVALID_FIELD where the data is short."""
    if count > MAX_RANGES:
        raise DeviceError(Status.MAX_MEMORY_RANGE_EXCEEDED, f"{count} memory ranges; at most {MAX_RANGES}")
    if count < 1:
        raise DeviceError(Status.INVALID_FIELD, "no memory ranges")
    needed = at + count * MEMORY_RANGE.itemsize
    if len(data) < needed:
        raise DeviceError(Status.INVALID_FIELD,
                          f"{count} memory range descriptors need {needed} bytes of data, got {len(data)}")
    return np.frombuffer(data, dtype=MEMORY_RANGE, count=count, offset=at).copy()


def resolve(table: np.ndarray, namespace_by_id: Callable[[int], Any],
            cmb: ControllerMemoryBuffer | None) -> list[MemoryRange]:
    """Each descriptor's namespace and bytes, every check passed: alignment to the range
    granularity (INVALID_MEMORY_RANGE_SET), a memory or optimizer namespace (INVALID_MEMORY_NAMESPACE),
    inside a memory namespace (INVALID_MEMORY_RANGE_SET), no two memory ranges sharing a byte
    (OVERLAPPING_MEMORY_RANGE)."""
    if len(table) > MAX_RANGES:
        raise DeviceError(Status.MAX_MEMORY_RANGE_EXCEEDED, f"{len(table)} memory ranges; at most {MAX_RANGES}")
    ranges = []
    for index, row in enumerate(table):
        mnsid, sb, length = int(row["mnsid"]), int(row["sb"]), int(row["length"])
        if bytes(row["reserved"]) != bytes(16):
            raise DeviceError(Status.INVALID_FIELD, f"range {index}: reserved bytes 16-31 are not zero")
        if length == 0 or sb % RANGE_GRANULARITY or length % RANGE_GRANULARITY:
            # The prototype's status for a range off the granularity (its cpcs_mrs_validate).
            raise DeviceError(Status.INVALID_MEMORY_RANGE_SET,
                              f"range {index}: start {sb} and length {length} must be non-zero multiples of "
                              f"{RANGE_GRANULARITY} bytes (mrsg)")
        try:
            namespace = namespace_by_id(mnsid)
        except DeviceError:
            raise DeviceError(Status.INVALID_MEMORY_NAMESPACE, f"range {index}: no namespace with nsid {mnsid}") from None
        memory_namespace: MemoryNamespace | None = namespace.as_memory()
        optimizer: Namespace | None = namespace.as_optimizer()
        if memory_namespace is not None:
            memory = cmb if memory_namespace.on_cmb else memory_namespace.memory
            view = memory_namespace.bytes_of(memory, sb, length, f"range {index}")
            ranges.append(MemoryRange(index, memory_namespace, sb, length, view))
        elif optimizer is not None:
            ranges.append(MemoryRange(index, optimizer, sb, length, None))
        else:
            raise DeviceError(Status.INVALID_MEMORY_NAMESPACE,
                              f"range {index}: namespace {namespace.name!r} is a {namespace.kind} namespace, "
                              "not memory")
    check_disjoint(ranges, cmb)
    return ranges


def check_disjoint(ranges: list[MemoryRange], cmb: ControllerMemoryBuffer | None) -> None:
    """OVERLAPPING_MEMORY_RANGE where two memory ranges share a byte: the same memory
    namespace, or two windows on the CMB (they share its bytes)."""
    by_memory: dict[int, list[tuple[int, int, str]]] = {}
    for r in ranges:
        if r.view is None:
            continue
        key = id(cmb) if r.namespace.on_cmb else id(r.namespace)
        by_memory.setdefault(key, []).append((r.sb, r.sb + r.length, r.what))
    for spans in by_memory.values():
        overlap = first_overlap(spans)
        if overlap is not None:
            start, first, second = overlap
            raise DeviceError(Status.OVERLAPPING_MEMORY_RANGE, f"{first} and {second} overlap from byte {start}")
