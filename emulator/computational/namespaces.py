"""The compute namespace (CSI 04h) and the memory namespace (CSI 03h): what CREATE_NAMESPACE
takes for each, and the namespaces themselves.

Both are registered like the other kinds (a directory with meta.json, so they reappear at
every mount) and hold no media: a compute namespace's state (which program is active, the
memory range sets) is controller state, and a memory namespace's bytes are memory, which a
restart finds zeroed, as a drive's DRAM after a power cycle. Both take the place of an NVM
namespace in the mount's tree (ns/<name>/config.json, stats.json, data): a memory
namespace's `data` file reads and writes its bytes; a compute namespace's is empty.
"""
from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ...protocol.computational import MAX_MEMORY_BYTES, SLM_ALIGN
from ...protocol.status import DeviceError, Status
from ..cmb import ControllerMemoryBuffer
from ..media import atomic_write_json, fsync_dir, read_json
from ..names import check_name
from ..nvm import NvmCounters, NvmNamespace

COMPUTE_KIND = "compute"
MEMORY_KIND = "memory"
META_FILE = "meta.json"
PAGE_BYTES = 4096


def _invalid(message: str) -> DeviceError:
    return DeviceError(Status.INVALID_FIELD, message)


@dataclasses.dataclass(frozen=True)
class ComputeSpec:
    """A compute namespace: a name only."""

    name: str
    kind = COMPUTE_KIND
    allocation_bytes = 0  # no media

    def validate(self) -> "ComputeSpec":
        check_name(self.name, "namespace")
        return self

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": COMPUTE_KIND}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "ComputeSpec":
        unknown = set(value) - {"name", "kind"}
        if unknown:
            raise _invalid(f"unknown field(s) for a compute namespace: {', '.join(sorted(unknown))}")
        return cls(name=value.get("name")).validate()  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class MemorySpec:
    """A memory namespace: `capacity_bytes` of memory of its own, or (`cmb`) a window onto the
    controller memory buffer, whose bytes clients already map."""

    name: str
    capacity_bytes: int = 0
    cmb: bool = False
    kind = MEMORY_KIND
    allocation_bytes = 0  # memory, not NVM capacity

    def validate(self) -> "MemorySpec":
        check_name(self.name, "namespace")
        if not isinstance(self.cmb, bool):
            raise _invalid(f"cmb must be true or false, got {self.cmb!r}")
        size = self.capacity_bytes
        if not isinstance(size, int) or isinstance(size, bool):
            raise _invalid(f"capacity_bytes must be an integer, got {size!r}")
        if self.cmb:
            if size:
                raise _invalid("a memory namespace on the CMB takes the CMB's size: no capacity_bytes")
            return self
        if size <= 0 or size % PAGE_BYTES:
            raise _invalid(f"capacity_bytes must be a positive multiple of {PAGE_BYTES}, got {size}")
        if size > MAX_MEMORY_BYTES:
            raise DeviceError(Status.LIMIT_EXCEEDED, f"capacity_bytes {size} exceeds {MAX_MEMORY_BYTES}")
        return self

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": MEMORY_KIND, "capacity_bytes": self.capacity_bytes, "cmb": self.cmb}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "MemorySpec":
        unknown = set(value) - {"name", "kind", "capacity_bytes", "cmb"}
        if unknown:
            raise _invalid(f"unknown field(s) for a memory namespace: {', '.join(sorted(unknown))}")
        return cls(name=value.get("name"), capacity_bytes=value.get("capacity_bytes", 0),  # type: ignore[arg-type]
                   cmb=value.get("cmb", False)).validate()


class _VolatileNamespace(NvmNamespace):
    """What both kinds share: registration, counters, and no media to flush. An NvmNamespace
    to the device and the mount's tree (no steps, a `data` file), with none of its file."""

    kind = "volatile"

    def __init__(self, directory: Path, nsid: int, spec: Any) -> None:  # noqa: D107 (no super: no data file)
        self.directory = directory
        self.nsid = nsid
        self.spec = spec
        self.name = spec.name
        self.capacity_bytes = 0
        self.write_through = False
        self.path = directory / META_FILE  # what the tree's times read (there is no data file)
        self.counters = NvmCounters()
        self.recovery_errors: list[tuple[str, int, int]] = []
        self.media_failure: str | None = None
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._dirty = False

    @staticmethod
    def _record(directory: Path, nsid: int, spec: Any) -> None:
        directory.mkdir(parents=True)
        try:
            atomic_write_json(directory / META_FILE, {"kind": spec.kind, "nsid": nsid, "spec": spec.to_json()})
            fsync_dir(directory)
            fsync_dir(directory.parent)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def as_plain_nvm(self) -> None:
        """None: an NVM namespace to the device, with no media (no LBAs) behind it."""
        return None

    @property
    def allocated_bytes(self) -> int:
        return 0

    def flush(self) -> int:
        return 0  # nothing on media

    def close(self) -> None:
        pass

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "nsid": self.nsid, "kind": self.kind}

    def statistics(self) -> dict[str, Any]:
        return dataclasses.asdict(self.counters) | {"name": self.name, "nsid": self.nsid, "kind": self.kind}

    def read(self, offset: int, size: int) -> bytes:
        if offset < 0:
            raise _invalid(f"negative offset {offset}")
        return b""

    def write(self, offset: int, data: bytes | memoryview) -> int:
        if len(data):
            raise DeviceError(Status.LBA_OUT_OF_RANGE, f"namespace {self.name!r} ({self.kind}) has no data to write")
        return 0


class ComputeNamespace(_VolatileNamespace):
    """A compute namespace: the built-in programs, their activation and the memory range sets
    (emulator/computational/programs.py), all controller state."""

    kind = COMPUTE_KIND

    def __init__(self, directory: Path, nsid: int, spec: ComputeSpec) -> None:
        super().__init__(directory, nsid, spec)
        # Set by the command module on first use: the namespace's programs and range sets.
        self.state: Any = None

    def as_compute(self) -> ComputeNamespace:
        """This namespace, as the kind that runs the compute command set's programs."""
        return self

    # The kinds table (emulator/kinds.py) hands each kind its own spec class, so the narrower
    # spec than NvmNamespace.create takes is never met by another.
    @classmethod
    def create(cls, directory: Path, nsid: int, spec: ComputeSpec, sync: bool = False) -> "ComputeNamespace":  # type: ignore[override]
        spec.validate()
        cls._record(directory, nsid, spec)
        return cls(directory, nsid, spec)

    @classmethod
    def open(cls, directory: Path, sync: bool = False) -> "ComputeNamespace":
        meta = read_json(directory / META_FILE)
        return cls(directory, int(meta["nsid"]), ComputeSpec.from_json(meta["spec"]))


class MemoryNamespace(_VolatileNamespace):
    """A memory namespace: byte-addressable memory (SLM). Its own is a memfd that clients may
    map like the CMB (config's `path`); zeroed at every open."""

    kind = MEMORY_KIND

    def __init__(self, directory: Path, nsid: int, spec: MemorySpec) -> None:
        super().__init__(directory, nsid, spec)
        self.on_cmb = spec.cmb
        self.memory: ControllerMemoryBuffer | None = None
        if not spec.cmb:
            self.memory = ControllerMemoryBuffer(spec.capacity_bytes)
            self.capacity_bytes = spec.capacity_bytes  # the data file's size

    def as_memory(self) -> MemoryNamespace:
        """This namespace, as the kind whose bytes are memory (SLM)."""
        return self

    # The kinds table (emulator/kinds.py) hands each kind its own spec class, so the narrower
    # spec than NvmNamespace.create takes is never met by another.
    @classmethod
    def create(cls, directory: Path, nsid: int, spec: MemorySpec, sync: bool = False) -> "MemoryNamespace":  # type: ignore[override]
        spec.validate()
        cls._record(directory, nsid, spec)
        return cls(directory, nsid, spec)

    @classmethod
    def open(cls, directory: Path, sync: bool = False) -> "MemoryNamespace":
        meta = read_json(directory / META_FILE)
        return cls(directory, int(meta["nsid"]), MemorySpec.from_json(meta["spec"]))

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
            self.memory = None

    def config(self) -> dict[str, Any]:
        memory = self.memory
        return super().config() | {"capacity_bytes": self.spec.capacity_bytes, "cmb": self.on_cmb,
                                   "path": memory.path if memory is not None else None}

    def bytes_of(self, memory: ControllerMemoryBuffer | None, sb: int, length: int, what: str) -> np.ndarray:
        """The namespace's bytes [sb, sb + length) in `memory` (its own, or the CMB for a
        window on it): INVALID_MEMORY_RANGE_SET outside it."""
        if memory is None:
            raise DeviceError(Status.INVALID_MEMORY_NAMESPACE,
                              f"{what}: memory namespace {self.name!r} is a window on the CMB, and this "
                              "controller has none (mounted with --cmb-size 0)")
        if sb + length > memory.size:
            raise DeviceError(Status.INVALID_MEMORY_RANGE_SET,
                              f"{what}: bytes {sb}..{sb + length} are outside memory namespace {self.name!r} "
                              f"({memory.size} bytes)")
        return memory.array[sb : sb + length]

    # The data file: the namespace's own memory, dword for dword.
    def read(self, offset: int, size: int) -> bytes:
        if offset < 0:
            raise _invalid(f"negative offset {offset}")
        if self.memory is None:
            return b""
        end = min(self.capacity_bytes, offset + max(0, size))
        data = self.memory.array[offset:end].tobytes() if end > offset else b""
        with self._lock:
            self.counters.read_commands += 1
            self.counters.bytes_read += len(data)
        return data

    def write(self, offset: int, data: bytes | memoryview) -> int:
        if offset < 0:
            raise _invalid(f"negative offset {offset}")
        if self.memory is None or offset + len(data) > self.capacity_bytes:
            raise DeviceError(Status.LBA_OUT_OF_RANGE,
                              f"namespace {self.name!r}: write of {len(data)} bytes at {offset} passes the end "
                              f"({self.capacity_bytes} bytes)")
        self.memory.array[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        with self._lock:
            self.counters.write_commands += 1
            self.counters.bytes_written += len(data)
        return len(data)


def check_slm_span(offset: int, length: int, what: str) -> None:
    """SLM I/O addresses whole dwords: INVALID_FIELD otherwise."""
    if offset % SLM_ALIGN or length % SLM_ALIGN:
        raise DeviceError(Status.INVALID_FIELD,
                          f"{what}: offset {offset} and length {length} must be multiples of {SLM_ALIGN} bytes")
