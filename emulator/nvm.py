"""A plain NVM namespace: a raw, LBA-addressed data file with a volatile write cache."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from ..protocol.status import DeviceError, Status
from .lifetime import LifetimeCounters
from .media import StateFile, atomic_write_json, fsync_dir, read_json
from .names import check_name

if TYPE_CHECKING:
    from .namespace import CommitResult, Namespace
    from .namespace.writes import GradPieces
    from .transaction import StepTransaction

log = logging.getLogger(__name__)

KIND = "nvm"
LBA_BYTES = 4096  # the one LBA format: LBADS = 12
LBADS = 12
DATA_FILE = "data"
META_FILE = "meta.json"
# Far above any capacity a device is formatted with; keeps sizes exact in the 128-bit SMART
# fields and in st_size.
MAX_CAPACITY_BYTES = 1 << 60


def _invalid(message: str) -> DeviceError:
    return DeviceError(Status.INVALID_FIELD, message)


@dataclasses.dataclass(frozen=True)
class NvmSpec:
    """What CREATE_NAMESPACE needs for a plain NVM namespace: a name and a fixed size."""

    name: str
    capacity_bytes: int
    kind = KIND

    def validate(self) -> "NvmSpec":
        check_name(self.name, "namespace")
        size = self.capacity_bytes
        if not isinstance(size, int) or isinstance(size, bool):
            raise _invalid(f"capacity_bytes must be an integer, got {size!r}")
        if size <= 0 or size % LBA_BYTES:
            raise _invalid(f"capacity_bytes must be a positive multiple of {LBA_BYTES}, got {size}")
        if size > MAX_CAPACITY_BYTES:
            raise DeviceError(Status.LIMIT_EXCEEDED,
                              f"capacity_bytes {size} exceeds the limit of {MAX_CAPACITY_BYTES}")
        return self

    @property
    def allocation_bytes(self) -> int:
        """Device capacity the namespace takes: all of its blocks (thick provisioned)."""
        return self.capacity_bytes

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": KIND, "capacity_bytes": self.capacity_bytes}

    @classmethod
    def from_json(cls, value: Any) -> "NvmSpec":
        """Parse a create payload with "kind": "nvm"; anything malformed is INVALID_FIELD."""
        if not isinstance(value, dict):
            raise _invalid("namespace description must be a JSON object")
        unknown = set(value) - {"name", "kind", "capacity_bytes"}
        if unknown:
            raise _invalid(f"unknown field(s) for an nvm namespace: {', '.join(sorted(unknown))}")
        if "capacity_bytes" not in value:
            raise _invalid("an nvm namespace needs capacity_bytes")
        return cls(name=value.get("name"), capacity_bytes=value["capacity_bytes"]).validate()  # type: ignore[arg-type]


@dataclasses.dataclass
class NvmCounters:
    """Since the namespace was opened: host I/O on its `data` file, flushes, busy time."""

    bytes_written: int = 0
    bytes_read: int = 0
    read_commands: int = 0
    write_commands: int = 0
    media_bytes_written: int = 0
    flushes: int = 0
    flush_ns: int = 0
    io_ns: int = 0

    def lifetime_share(self) -> LifetimeCounters:
        """What these add to the device's SMART figures (emulator/health.py)."""
        return LifetimeCounters(
            host_bytes_read=self.bytes_read,
            host_bytes_written=self.bytes_written,
            host_read_commands=self.read_commands,
            host_write_commands=self.write_commands,
            busy_ns=self.io_ns + self.flush_ns,
            media_bytes_written=self.media_bytes_written,
        )


class NvmNamespace:
    """One preallocated data file read and written at byte offsets, like a drive's LBAs.

    Writes land in the backing file's page cache (a daemon crash keeps them; a power cut may
    not) until flush() fsyncs it: a drive with a volatile write cache. With a --sync device
    every write is written through before it is acknowledged. Thread-safe: I/O runs outside
    the lock, which guards only the counters and the dirty flag.
    """

    kind = KIND
    # The Device and fs layers treat both kinds alike; an nvm namespace has no steps.
    committed_step = None
    durable_step = None
    loading = False
    step_open = None
    flush_pending = False  # never flushed in the background: only fsync/FLUSH/close do

    def __init__(self, directory: Path, nsid: int, spec: NvmSpec, data: StateFile, write_through: bool) -> None:
        self.directory = directory
        self.nsid = nsid
        self.spec = spec
        self.name = spec.name
        self.capacity_bytes = spec.capacity_bytes
        self.write_through = write_through
        self.path = directory / DATA_FILE
        self.counters = NvmCounters()
        self.recovery_errors: list[tuple[str, int, int]] = []
        self.media_failure: str | None = None
        self._data = data
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._dirty = False

    # ------------------------------------------------------------------ create, open, close

    @classmethod
    def create(cls, directory: Path, nsid: int, spec: NvmSpec, sync: bool) -> "NvmNamespace":
        """Preallocate the data file (reads as zeros) and record the namespace, durably."""
        spec.validate()
        directory.mkdir(parents=True)
        data: StateFile | None = None
        try:
            # The media layer's preallocated file: a full disk fails here, never a write.
            # Read and written with pread/pwrite only: unmapped, so a file cut short can only
            # give a short read (checked), never a bus error.
            data = StateFile(directory / DATA_FILE, spec.capacity_bytes, create=True, mapped=False)
            # Size and extents durable before the registry names the namespace.
            data.sync()
            atomic_write_json(directory / META_FILE, {"kind": KIND, "nsid": nsid, "spec": spec.to_json(),
                                                      "lba_bytes": LBA_BYTES})
            fsync_dir(directory)
            fsync_dir(directory.parent)
        except BaseException:
            if data is not None:
                data.close()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return cls(directory, nsid, spec, data, sync)

    @classmethod
    def open(cls, directory: Path, sync: bool) -> "NvmNamespace":
        meta = read_json(directory / META_FILE)
        spec = NvmSpec.from_json(meta["spec"])
        # A size other than the recorded one is UNRECOVERED_READ_ERROR (StateFile checks).
        data = StateFile(directory / DATA_FILE, spec.capacity_bytes, create=False, mapped=False)
        try:
            # Writes a crashed daemon left in the page cache reach the media now, as the
            # optimizer namespaces' recovery does, before anything new is acknowledged.
            data.sync()
        except BaseException:
            data.close()
            raise
        return cls(directory, int(meta["nsid"]), spec, data, sync)

    def close(self) -> None:
        """Flush the write cache (a clean shutdown) and release the data file."""
        try:
            if self.media_failure is None:
                self.flush()
        finally:
            self._data.close()

    # ------------------------------------------------------------------ description

    @property
    def allocated_bytes(self) -> int:
        return self.capacity_bytes

    @property
    def blocks(self) -> int:
        return self.capacity_bytes // LBA_BYTES

    def config(self) -> dict[str, Any]:
        """config.json of the namespace."""
        return {
            "name": self.name,
            "nsid": self.nsid,
            "kind": KIND,
            "capacity_bytes": self.capacity_bytes,
            "lba_bytes": LBA_BYTES,
            "blocks": self.blocks,
            "write_cache": "write-through" if self.write_through else "volatile",
        }

    def statistics(self) -> dict[str, Any]:
        """stats.json, NAMESPACE_STATISTICS and the C0h page. Lock-free like the optimizer's."""
        return dataclasses.asdict(self.counters) | {
            "name": self.name,
            "nsid": self.nsid,
            "kind": KIND,
            "capacity_bytes": self.capacity_bytes,
            "lba_bytes": LBA_BYTES,
            "blocks": self.blocks,
            "dirty": self._dirty,
        }

    # ------------------------------------------------------------------ I/O

    def read(self, offset: int, size: int) -> bytes:
        """Bytes at any offset; short at the end, empty at or past it (as a file reads)."""
        if offset < 0:
            raise _invalid(f"negative offset {offset}")
        started = time.perf_counter_ns()
        end = min(self.capacity_bytes, offset + max(0, size))
        data = b""
        if end > offset:
            try:
                data = os.pread(self._data.fd, end - offset, offset)
            except OSError as exc:
                raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                                  f"reading {self.path.name}: {exc}") from exc
            if len(data) != end - offset:
                # The file was cut short under the namespace: the missing bytes are lost, not
                # zeros (never serve them as data).
                raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                                  f"reading {self.path.name}: {len(data)} of {end - offset} bytes at "
                                  f"{offset}; {self._data.damage() or 'the file is short'}")
        elapsed = time.perf_counter_ns() - started
        with self._lock:
            # Every read request served counts, an empty one at the end too (as tensor files).
            self.counters.read_commands += 1
            self.counters.bytes_read += len(data)
            self.counters.io_ns += elapsed
        return data

    def write(self, offset: int, data: bytes | memoryview) -> int:
        """Write at any offset and length inside the namespace; past the end nothing is written."""
        length = len(data)
        if offset < 0:
            raise _invalid(f"negative offset {offset}")
        if offset + length > self.capacity_bytes:
            raise DeviceError(
                Status.LBA_OUT_OF_RANGE,
                f"namespace {self.name!r}: write of {length} bytes at {offset} passes the end "
                f"({self.capacity_bytes} bytes)",
            )
        if length == 0:
            return 0
        self._check_media()
        started = time.perf_counter_ns()
        self._data.write_at(offset, data)  # any buffer: it casts to bytes
        with self._lock:
            # Set once the bytes are in the page cache, before the write is acknowledged: a flush
            # that cleared the flag earlier may have synced without them, so the next one must not
            # skip its fsync.
            self._dirty = True
        elapsed = time.perf_counter_ns() - started  # the write-through fsync counts as a flush
        if self.write_through:
            self.flush()
        with self._lock:
            self.counters.write_commands += 1
            self.counters.bytes_written += length
            self.counters.media_bytes_written += length
            self.counters.io_ns += elapsed
        return length

    def flush(self) -> int:
        """Make every write acknowledged so far durable (fsync the data file). Returns 0: an nvm
        namespace has no step to report."""
        self._check_media()
        with self._flush_lock:
            with self._lock:
                if not self._dirty:
                    return 0
                # Cleared before the fsync: a write racing with it sets it again.
                self._dirty = False
            started = time.perf_counter_ns()
            try:
                self._data.sync()
            except DeviceError as exc:
                # Linux reports a failed fsync once and may drop the dirty pages: stop, as the
                # optimizer namespaces do, instead of pretending a retry could succeed.
                with self._lock:
                    self._dirty = True
                self.media_failure = exc.message
                log.error("nvm namespace %s: %s; refusing writes until reopened", self.name, exc.message)
                raise
            with self._lock:
                self.counters.flushes += 1
                self.counters.flush_ns += time.perf_counter_ns() - started
        return 0

    # ------------------------------------------------------------------ the kind's I/O (emulator/io.py)
    # DeviceIO dispatches each request through these, the same methods on every kind, so that
    # no front-end tells the kinds apart: an NVM namespace has one file, its data, addressed
    # by byte offset; `tensor` and `role` name nothing here.

    def as_optimizer(self) -> Namespace | None:
        """None: this kind has no tensors, steps, state copies or snapshots."""
        return None

    def as_nvm(self) -> NvmNamespace:
        """This namespace, as the kind whose one file is its data (the computational kinds too)."""
        return self

    def as_plain_nvm(self) -> NvmNamespace | None:
        """This namespace, as the kind whose data file is LBA-addressed media (None from the
        computational kinds, NVM namespaces to the rest of the device that hold no media)."""
        return self

    # The computational kinds (emulator/computational/namespaces.py) answer these two with
    # themselves. Typed as this class: that module imports this one, and naming its classes
    # here would make the import cycle the contracts forbid.
    def as_compute(self) -> NvmNamespace | None:
        """None: a plain NVM namespace runs no programs."""
        return None

    def as_memory(self) -> NvmNamespace | None:
        """None: a plain NVM namespace's bytes are media, not memory (SLM)."""
        return None

    def io_read(self, tensor: str | None, role: str, offset: int, size: int) -> bytes:
        return self.read(offset, size)

    def io_read_nowait(self, tensor: str | None, role: str, offset: int, size: int) -> memoryview | bytes | None:
        return None  # every read reaches the media file (pread): never without blocking

    @contextlib.contextmanager
    def io_read_view(self, tensor: str | None, role: str, offset: int, size: int) -> Iterator[bytes | memoryview]:
        yield self.read(offset, size)

    @contextlib.contextmanager
    def io_read_many(self, reads: Sequence[tuple[str | None, str, int, int]]) -> Iterator[list[bytes]]:
        yield [self.read(offset, size) for _tensor, _role, offset, size in reads]

    def io_write(self, tensor: str | None, role: str, offset: int, data: bytes | memoryview) -> int:
        return self.write(offset, data)

    def io_write_nowait(self, tensor: str | None, role: str, offset: int,
                        data: bytes) -> tuple[int, StepTransaction | None] | None:
        return None  # a write reaches the media file (and, written through, its fsync)

    def io_finish(self, implicit: StepTransaction) -> None:
        """Nothing to finish: io_write_nowait never stages a write here."""

    def io_write_grads(self, pieces: GradPieces) -> CommitResult | None:
        raise DeviceError(Status.NAMESPACE_KIND_MISMATCH,
                          f"namespace {self.name!r} is a plain {self.kind} namespace: gradients need an "
                          "optimizer namespace")

    def _check_media(self) -> None:
        if self.media_failure is not None:
            raise DeviceError(
                Status.WRITE_FAULT,
                f"namespace {self.name!r} stopped after a failed sync ({self.media_failure}); "
                "remount the device",
            )
