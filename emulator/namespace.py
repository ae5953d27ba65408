"""An optimizer namespace: A/B state copies on the media, step transactions, recovery."""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import os
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cossd import kernels

from .accounting import NamespaceTiming, modeled_command
from ..protocol.status import DeviceError, Status
from .layout import BLOCK_ELEMS, Copy, SuperblockFlags, TensorLayout, plan_layout, region_offset
from .media import SlotFile, StateFile, atomic_write_json, fsync_dir, media_error, read_json
from .snapshots import SnapshotStore
from .spec import HALF_FORMATS, STATE_FORMATS, Hyperparameters, NamespaceSpec, TensorSpec
from .superblock import GROUP_FIELDS, SkipCounts, Superblock
from .transaction import ReadyBlock, StepTransaction, block_range_of, first_overlap

log = logging.getLogger(__name__)

_workers: concurrent.futures.ThreadPoolExecutor | None = None
_workers_lock = threading.Lock()
# Taken only to record a damaged state copy once (Namespace._media_damaged).
_damage_lock = threading.Lock()


def kernel_workers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that run gradient blocks, one per usable core, shared by all namespaces
    (the kernels and file writes release the GIL, so they run in parallel)."""
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(2, len(os.sched_getaffinity(0))), thread_name_prefix="cossd-block")
        return _workers

ROLES = ("grad", "param", "master", "exp_avg", "exp_avg_sq")
LOADABLE_ROLES = ("master", "exp_avg", "exp_avg_sq")
# The arrays a block checksum covers, in checksum order.
BLOCK_ROLES = ("master", "exp_avg", "exp_avg_sq", "param")

__all__ = ["CommitResult", "Namespace", "NamespaceSpec", "TensorSpec", "ROLES"]


def _hypers_of(superblock: Superblock) -> list[Hyperparameters]:
    """The hyperparameters of every group, as a superblock recorded them with its step."""
    mode = "adamw" if superblock.decoupled else "adam"
    first = Hyperparameters(
        **{field: getattr(superblock, field) for field in GROUP_FIELDS}, mode=mode
    )
    rest = [
        Hyperparameters(**{f: float(v) for f, v in zip(GROUP_FIELDS, row)}, mode=mode)
        for row in superblock.extra_groups
    ]
    return [first, *rest]


def _hyper_record(hypers: list[Hyperparameters]) -> dict[str, Any]:
    """Superblock fields recording `hypers` (group 0 in the header, the rest in a table)."""
    record: dict[str, Any] = {field: getattr(hypers[0], field) for field in GROUP_FIELDS}
    record["decoupled"] = hypers[0].mode == "adamw"
    record["extra_groups"] = np.array(
        [[getattr(h, field) for field in GROUP_FIELDS] for h in hypers[1:]], dtype=np.float64
    ).reshape(len(hypers) - 1, len(GROUP_FIELDS))
    return record


# write_grads_lent stages lent gradients in pieces of this many bytes (4 blocks).
_LENT_STAGE_BYTES = 4 * BLOCK_ELEMS * 2


def _immutable(data: bytes | memoryview) -> bool:
    """Whether `data` can never change: bytes, or a view of bytes."""
    return isinstance(data, bytes) or (isinstance(data, memoryview) and isinstance(data.obj, bytes))


def _backing_mtime_ns(directory: Path) -> int:
    """The newest mtime among a namespace's files on the media (its state last changed no
    later than that), or now where none can be read."""
    times = []
    for name in ("meta.json", "sb.0", "sb.1", "state.A", "state.B"):
        try:
            times.append(os.lstat(directory / name).st_mtime_ns)
        except OSError:
            pass
    return max(times) if times else time.time_ns()


class _WouldBlock(Exception):
    """A *_nowait call found that it would have to wait (for the lock or a flush)."""


@dataclasses.dataclass(frozen=True)
class CommitResult:
    """What a commit did: the step now current, and whether this one was skipped."""

    step: int
    committed_step: int
    skipped: bool
    nonfinite_elements: int = 0


@dataclasses.dataclass
class NamespaceCounters:
    """Since the namespace was opened (the step counts: over its life, from its superblock).

    The device's SMART figures add these up (emulator/health.py), so each counts exactly what
    its name says: host bytes and requests on the tensor files, media bytes, busy time.
    """

    steps_committed: int = 0
    steps_skipped: int = 0
    steps_aborted: int = 0
    nonfinite_elements: int = 0
    grad_bytes_in: int = 0
    state_bytes_loaded: int = 0
    bytes_read: int = 0
    param_bytes_out: int = 0
    read_commands: int = 0
    write_commands: int = 0
    media_bytes_written: int = 0
    kernel_blocks: int = 0
    kernel_ns: int = 0
    flushes: int = 0
    flush_ns: int = 0
    checksum_failures: int = 0


class Namespace:
    """One optimizer: its tensors, hyperparameters and state, committed step by step.

    Thread-safe: the fs layer calls write_grad from several worker threads; kernels for
    distinct blocks run in parallel outside the lock (cffi releases the GIL).
    """

    kind = "optimizer"  # beside emulator/nvm.py's plain NVM namespaces

    def __init__(
        self,
        directory: Path,
        nsid: int,
        spec: NamespaceSpec,
        copies: tuple[StateFile, StateFile],
        slots: tuple[SlotFile, SlotFile],
        superblock: Superblock,
        sync: bool,
        layouts: list[TensorLayout],
    ) -> None:
        self.directory = directory
        self.nsid = nsid
        self.spec = spec
        self.name = spec.name
        self.sync_commits = sync
        self._copies = copies
        self._slots = slots
        self._sb = superblock
        self._hypers = _hypers_of(superblock)
        self._group_of = {t.name: t.group for t in spec.tensors}
        self.layouts = layouts
        self.tensors = {t.name: t for t in layouts}
        self.total_blocks = sum(t.block_count for t in layouts)
        self._grad_format = HALF_FORMATS[spec.grad_dtype]
        self._param_format = HALF_FORMATS[spec.param_dtype]
        self._state_format = STATE_FORMATS[spec.state_dtype]
        self._state_dtype = np.dtype(np.float32 if spec.state_dtype == "fp32" else np.uint16)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._flush_lock = threading.Lock()
        self._durable_seq = superblock.seq
        self._durable_step = superblock.committed_step
        self._tx: StepTransaction | None = None
        self.counters = NamespaceCounters(
            steps_committed=superblock.steps_committed, steps_skipped=superblock.steps_skipped
        )
        # Modeled device time (model/timing.py); the device swaps in its own profile.
        self.timing = NamespaceTiming()
        self._views: dict[tuple[Copy, str, str], np.ndarray] = {}
        # Per (source copy, tensor): the kernel call that steps its blocks into the other copy.
        self._block_updates: dict[tuple[Copy, str], kernels.BlockUpdate] = {}
        self._thread_local = threading.local()
        # Blocks (tensor, block in tensor, block in namespace) that failed their checksum in
        # a copy recovery fell back from; the device puts them in its error log.
        self.recovery_errors: list[tuple[str, int, int]] = []
        # Set when an fsync failed: Linux reports such an error once and may have dropped
        # the dirty pages, so a retry could "succeed" over lost data. Like PostgreSQL, the
        # namespace then refuses further steps until the device is opened again.
        self.media_failure: str | None = None
        # Snapshots copying the committed copy right now (pinned_committed): commits and
        # rollbacks wait for them, so the copy cannot change under a snapshot.
        self._pins = 0
        # Flips (commits, rollbacks) waiting for the pins to go: new read pins wait behind
        # them, so that readers one after another cannot hold a commit off for ever.
        self._flips_waiting = 0
        self.snapshots = SnapshotStore(self)
        # Wall-clock times (ns) the mount shows as mtime/ctime: of the last change to the
        # committed state (a commit, a rollback, the seal, an initial-state write) and of the
        # hyperparameters, so rsync, backups and `find -newer` see each step. After a
        # restart the backing files' own times stand in (never older than the change).
        self.changed_ns = _backing_mtime_ns(directory)
        self.config_changed_ns = self.changed_ns

    # ------------------------------------------------------------------ creation, opening

    @classmethod
    def create(cls, directory: Path, nsid: int, spec: NamespaceSpec, sync: bool) -> "Namespace":
        """Lay out and preallocate a namespace at step 0, ready for initial weights."""
        spec.validate()
        layouts, copy_bytes = plan_layout(
            [(t.name, t.numel) for t in spec.tensors],
            spec.state_itemsize,
            2,
        )
        directory.mkdir(parents=True)
        copies: list[StateFile] = []
        try:
            for copy in Copy:
                copies.append(StateFile(directory / f"state.{copy.name}", copy_bytes, create=True))
                # The allocation (size and extents) must be durable before the namespace is:
                # after a power cut, a registered namespace with a short state file is lost.
                copies[-1].sync()
            total_blocks = sum(t.block_count for t in layouts)
            superblock = Superblock(
                seq=1,
                committed_step=spec.initial_step,
                committed_copy=Copy.A,
                flags=SuperblockFlags.LOADING,
                block_crcs=np.zeros(total_blocks, dtype=np.uint32),
                **_hyper_record(list(spec.group_hypers)),
            )
            slots = (SlotFile(directory / "sb.0"), SlotFile(directory / "sb.1"))
            encoded = superblock.encode()
            # Both slots get their full size now, so no later commit needs a new block
            # (a full disk fails the create, not a step).
            slots[1 - superblock.slot].allocate(len(encoded))
            slots[superblock.slot].write(encoded)
            for slot in slots:
                slot.sync()
            meta = {"nsid": nsid, "spec": spec.to_json(), "copy_bytes": copy_bytes}
            atomic_write_json(directory / "meta.json", meta)
            fsync_dir(directory)
            fsync_dir(directory.parent)
        except BaseException:
            for state in copies:
                state.close()
            shutil.rmtree(directory, ignore_errors=True)
            raise
        return cls(directory, nsid, spec, (copies[0], copies[1]), slots, superblock, sync, layouts)

    @classmethod
    def open(cls, directory: Path, sync: bool) -> "Namespace":
        """Open an existing namespace, recovering to the newest valid committed step.

        Each state copy is judged on its own: one that is missing or has the wrong size is a
        media error of that copy. Superblocks naming it are passed over, and the copy is
        re-created at full size as the new shadow (its contents are not needed by the step
        served). A link or another file type is refused, never followed (StateFile).
        """
        meta = read_json(directory / "meta.json")
        spec = NamespaceSpec.from_json(meta["spec"])
        layouts, copy_bytes = plan_layout(
            [(t.name, t.numel) for t in spec.tensors], spec.state_itemsize, 2
        )
        if copy_bytes != meta["copy_bytes"]:
            raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"{directory}: layout mismatch")
        copies: dict[Copy, StateFile] = {}
        damaged: dict[Copy, str] = {}
        try:
            for copy in Copy:
                path = directory / f"state.{copy.name}"
                reason = cls._copy_damage(path, copy_bytes)
                if reason is None:
                    copies[copy] = StateFile(path, copy_bytes, create=False)
                else:
                    damaged[copy] = reason
            slots = (SlotFile(directory / "sb.0"), SlotFile(directory / "sb.1"))
            total_blocks = sum(t.block_count for t in layouts)
            groups = len(spec.group_hypers)
            candidates = [Superblock.decode(slot.read(), total_blocks, groups) for slot in slots]
            valid = sorted((sb for sb in candidates if sb is not None), key=lambda sb: -sb.seq)
            if not valid:
                raise DeviceError(
                    Status.UNRECOVERED_READ_ERROR, f"namespace {spec.name!r}: no valid superblock"
                )
            usable = [sb for sb in valid if sb.committed_copy not in damaged]
            for superblock in valid:
                if superblock.committed_copy in damaged:
                    log.warning("namespace %s: step %d (seq %d) is in a damaged copy (%s); falling back",
                                spec.name, superblock.committed_step, superblock.seq,
                                damaged[superblock.committed_copy])
            if not usable:
                raise DeviceError(
                    Status.UNRECOVERED_READ_ERROR,
                    f"namespace {spec.name!r}: no committed step can be served "
                    f"({'; '.join(damaged.values())})",
                )
            for copy, reason in damaged.items():
                log.error("namespace %s: %s; re-creating it at full size as the shadow copy", spec.name, reason)
                copies[copy] = cls._recreate_copy(directory / f"state.{copy.name}", copy_bytes)
            namespace = cls(directory, meta["nsid"], spec, (copies[Copy.A], copies[Copy.B]), slots,
                            usable[0], sync, layouts)
            # Media errors of whole copies, for the device's error log and SMART figures.
            namespace.damaged_copies = list(damaged.values())
            namespace.counters.checksum_failures += len(damaged)
            namespace._recover(usable)
        except BaseException:
            for state in copies.values():
                state.close()
            raise
        return namespace

    @staticmethod
    def _copy_damage(path: Path, copy_bytes: int) -> str | None:
        """Why the state copy at `path` cannot be opened as one (missing, wrong size), or None."""
        try:
            info = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return f"{path.name} is missing"
        if stat.S_ISREG(info.st_mode) and info.st_size != copy_bytes:
            return f"{path.name} has {info.st_size} bytes, expected {copy_bytes}"
        return None  # whole, or a link or foreign file that StateFile refuses

    @staticmethod
    def _recreate_copy(path: Path, copy_bytes: int) -> StateFile:
        """A new, preallocated copy in place of a damaged one, durable before it is used:
        built under a temporary name and renamed into place. The damaged file is kept aside
        as `state.X.damaged` (replacing an older one), never destroyed: recovery may yet find
        no other copy to serve, and what it held is then all there is to salvage."""
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.unlink(missing_ok=True)
        state = StateFile(temporary, copy_bytes, create=True)
        try:
            state.sync()
            if os.path.lexists(path):
                os.replace(path, path.with_name(f"{path.name}.damaged"))
            os.replace(temporary, path)
            fsync_dir(path.parent)
        except OSError as exc:
            state.close()
            temporary.unlink(missing_ok=True)
            raise media_error(exc, f"re-creating {path.name}") from exc
        except BaseException:
            state.close()
            temporary.unlink(missing_ok=True)
            raise
        state.path = path
        return state

    def _recover(self, candidates: list[Superblock]) -> None:
        """Serve the newest superblock whose copy proves intact by its block checksums."""
        for superblock in candidates:
            if superblock.flags & SuperblockFlags.LOADING:
                chosen = superblock
                break
            bad = self._verify_copy(superblock)
            if not bad:
                chosen = superblock
                break
            self.counters.checksum_failures += len(bad)
            self.recovery_errors.extend(
                (name, block, self.tensors[name].first_block + block) for name, block in bad)
            log.warning(
                "namespace %s: step %d (seq %d) fails %d block checksum(s); falling back",
                self.name, superblock.committed_step, superblock.seq, len(bad),
            )
        else:
            raise DeviceError(
                Status.UNRECOVERED_READ_ERROR,
                f"namespace {self.name!r}: no committed step passes its checksums",
            )
        self._sb = chosen
        self._hypers = _hypers_of(chosen)
        self.counters.steps_committed = chosen.steps_committed
        self._recorded_skips = SkipCounts.load(self.directory)
        self.counters.steps_skipped = self._skips().steps_skipped
        # What survived a daemon crash may still sit in the page cache only: make it durable
        # before anything can overwrite the other copy.
        for state in self._copies:
            state.sync()
        for slot in self._slots:
            slot.sync()
        self._durable_seq = chosen.seq
        self._durable_step = chosen.committed_step

    def close(self) -> None:
        """Flush the committed step and release the media. An open step is abandoned."""
        try:
            with self._cond:
                # Blocks still updating the shadow copy must finish before its file closes.
                while self._tx is not None and self._tx.inflight:
                    self._cond.wait()
            self.flush()
        finally:
            self._views.clear()
            self._block_updates.clear()
            for state in self._copies:
                state.close()
            for slot in self._slots:
                slot.close()

    # ------------------------------------------------------------------ views of the state

    def _view(self, copy: Copy, tensor: TensorLayout, role: str) -> np.ndarray:
        key = (copy, tensor.name, role)
        view = self._views.get(key)
        if view is None:
            view = self._copies[copy].view(
                self._region_offset(tensor, role), tensor.numel, self._role_dtype(role)
            )
            self._views[key] = view
        return view

    def _staging(self, count: int) -> dict[str, np.ndarray]:
        """Per-thread buffers for one block, allocated once per worker thread: the outputs
        (BLOCK_ROLES) and "grad", where a lent gradient is copied before it is counted and
        stepped."""
        buffers = getattr(self._thread_local, "buffers", None)
        if buffers is None:
            buffers = {role: np.empty(BLOCK_ELEMS, dtype=self._role_dtype(role)) for role in BLOCK_ROLES}
            buffers["grad"] = np.empty(BLOCK_ELEMS, dtype=np.uint16)
            self._thread_local.buffers = buffers
        return {role: array[:count] for role, array in buffers.items()}

    def _role_dtype(self, role: str) -> np.dtype:
        if role == "master":
            return np.dtype(np.float32)
        if role == "param":
            return np.dtype(np.uint16)
        return self._state_dtype

    _region_offset = staticmethod(region_offset)

    def _block_crc(self, copy: Copy, tensor: TensorLayout, local_block: int) -> int:
        start, stop = tensor.block_range(local_block)
        crc = 0
        for role in BLOCK_ROLES:
            crc = kernels.crc32c(self._view(copy, tensor, role)[start:stop], crc)
        return crc

    def _verify_copy(self, superblock: Superblock) -> list[tuple[str, int]]:
        """Blocks of the copy `superblock` names whose checksum does not match."""
        bad = []
        for tensor in self.layouts:
            for block in range(tensor.block_count):
                crc = self._block_crc(superblock.committed_copy, tensor, block)
                if crc != int(superblock.block_crcs[tensor.first_block + block]):
                    bad.append((tensor.name, block))
        return bad

    def itemsize(self, role: str) -> int:
        return 2 if role == "grad" else self._role_dtype(role).itemsize

    def file_size(self, tensor_name: str, role: str) -> int:
        return self._tensor(tensor_name).numel * self.itemsize(role)

    def _tensor(self, name: str) -> TensorLayout:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise DeviceError(
                Status.INVALID_NAMESPACE, f"namespace {self.name!r} has no tensor {name!r}"
            )
        return tensor

    # ------------------------------------------------------------------ properties

    @property
    def committed_step(self) -> int:
        return self._sb.committed_step

    @property
    def durable_step(self) -> int:
        return self._durable_step

    @property
    def loading(self) -> bool:
        return bool(self._sb.flags & SuperblockFlags.LOADING)

    @property
    def hyper(self) -> Hyperparameters:
        """Group 0's hyperparameters (a namespace's only group unless it has several)."""
        return self._hypers[0]

    @property
    def hypers(self) -> tuple[Hyperparameters, ...]:
        return tuple(self._hypers)

    @property
    def step_open(self) -> int | None:
        tx = self._tx
        return None if tx is None else tx.step

    def config(self) -> dict[str, Any]:
        """The namespace's description as config.json shows it."""
        return {
            "name": self.name,
            "nsid": self.nsid,
            "hyperparameters": dataclasses.asdict(self._hypers[0]),
            "groups": [dataclasses.asdict(h) for h in self._hypers],
            "grad_dtype": self.spec.grad_dtype,
            "param_dtype": self.spec.param_dtype,
            "state_dtype": self.spec.state_dtype,
            "durability": "sync" if self.sync_commits else "plp",
            "tensors": [
                {"name": t.name, "numel": t.numel, "group": self._group_of[t.name]}
                for t in self.layouts
            ],
        }

    @property
    def allocated_bytes(self) -> int:
        """Device capacity the namespace takes: both state copies and its snapshots."""
        return 2 * self._copies[0].size_bytes + self.snapshots.bytes_used

    def statistics(self) -> dict[str, Any]:
        # Lock-free on purpose: the fs layer reads it on its event loop, and the lock may be
        # held across an fsync. Counters are plain ints; a torn view is off by one at most.
        counters = dataclasses.asdict(self.counters)
        skips = self._skips()
        return counters | {
            "name": self.name,
            "nsid": self.nsid,
            "steps_skipped": skips.steps_skipped,
            "committed_step": self._sb.committed_step,
            "durable_step": self._durable_step,
            "last_skipped_step": skips.last_skipped_step,
            "step_open": self.step_open,
            "loading": self.loading,
            "tensors": len(self.layouts),
            "parameters": sum(t.numel for t in self.layouts),
            "state_bytes_per_copy": self._copies[0].size_bytes,
            # How new state reaches the shadow copy here (media.write_mode_for).
            "state_writes": self._copies[0].write_mode,
            # The superblock sequence: moves at every commit, rollback and seal (trainer's
            # load_state_dict tells its own state from an older one of the same step by it).
            "seq": self._sb.seq,
            "model": self.timing.snapshot(),
        }

    # ------------------------------------------------------------------ file API

    @modeled_command("read")
    def read(self, tensor_name: str, role: str, offset: int, size: int) -> bytes:
        """Bytes of a committed state array (param, master or a moment)."""
        return self._read(tensor_name, role, offset, size, wait=True, copy=True)

    def read_nowait(self, tensor_name: str, role: str, offset: int, size: int) -> memoryview | None:
        """read() without the copy and without blocking, for the fs layer's event loop.

        A view of the committed copy: valid while the caller does not yield, because a later
        step can only write into this copy after a step that begins on a request this same
        loop has yet to take. None where it would block (timed mode, or the namespace lock is
        held, perhaps across a flush): call read() in a thread instead.
        """
        if self.timing.timed:
            return None
        try:
            with self.timing.command("read"):
                return self._read(tensor_name, role, offset, size, wait=False, copy=False)
        except _WouldBlock:
            return None

    @contextlib.contextmanager
    def read_pinned(self, tensor_name: str, role: str, offset: int, size: int) -> Iterator[bytes | memoryview]:
        """read() without the copy, for a reply written from the committed copy itself (the
        fs data path's threads): a commit or rollback waits until the block exits, so the
        view cannot change under the reply. In timed mode the wait comes before the view."""
        with self.read_pinned_many([(tensor_name, role, offset, size)]) as views:
            yield views[0]

    @contextlib.contextmanager
    def read_pinned_many(self, reads: Sequence[tuple[str, str, int, int]]) -> Iterator[list[bytes | memoryview]]:
        """read_pinned of several (tensor, role, offset, size) ranges under one pin, so every
        view is of the same committed step."""
        if not reads:
            yield []
            return
        with self.timing.command("read"):
            views = [self._read(*reads[0], wait=True, copy=False, pin=True)]
        try:
            # The pin holds the committed copy: the rest need not (and must not: a flip
            # waiting for this pin would hold a second one back) pin again.
            for tensor_name, role, offset, size in reads[1:]:
                with self.timing.command("read"):
                    views.append(self._read(tensor_name, role, offset, size, wait=True, copy=False))
            yield views
        finally:
            self._unpin()

    def _unpin(self) -> None:
        """Release one pin of the committed copy; a flip waiting for the pins may go on."""
        with self._cond:
            self._pins -= 1
            self._cond.notify_all()

    def _read(self, tensor_name: str, role: str, offset: int, size: int, *, wait: bool, copy: bool,
              pin: bool = False) -> Any:
        """The bytes (copy=True: copied while no commit can move the committed copy) or a view.
        pin=True holds the committed copy (see pinned_committed); the caller unpins."""
        tensor = self._tensor(tensor_name)
        if role == "grad":
            raise DeviceError(Status.ACCESS_DENIED, "grad files are write-only")
        file_size = tensor.numel * self.itemsize(role)
        if not self._lock.acquire(blocking=wait):
            raise _WouldBlock
        try:
            if pin:
                while self._flips_waiting:
                    self._cond.wait()
            state = self._copies[self._sb.committed_copy]  # after any flip the wait let by
            # A damaged copy (cut short, holes, replaced; a page the guard replaced with
            # zeros) is never served as the state: refused before the pin, so no unpin is owed.
            self._refuse_damaged(state)
            if pin:
                self._pins += 1  # first: nothing below raises, so the caller's unpin matches
            # Every read request served counts, an empty one at the end of the file too.
            self.counters.read_commands += 1
            if offset >= file_size or size <= 0:
                return b""
            end = min(file_size, offset + size)
            view = self._view(self._sb.committed_copy, tensor, role).view(np.uint8)[offset:end]
            self.counters.bytes_read += len(view)
            if role == "param":
                self.counters.param_bytes_out += len(view)
            self.timing.add(host_out=len(view), media_read=len(view))
            if not copy:
                return memoryview(view)
            data = view.tobytes()
            if state.faults():  # the copy itself met a page cut from under the mapping
                self._refuse_damaged(state)
            return data
        finally:
            self._lock.release()

    def _refuse_damaged(self, state: StateFile) -> None:
        """UNRECOVERED_READ_ERROR where `state` can no longer be trusted (StateFile.damage:
        a few system calls, next to a read of up to 1 MiB): what a read would give may be
        zeros standing in for the state."""
        reason = state.damage()
        if reason is not None:
            self._media_damaged(reason)
            raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"namespace {self.name!r}: {reason}")

    def check_write(self, tensor_name: str, role: str, offset: int, length: int) -> None:
        """Refuse, changing nothing, a write that write_state would refuse for its file,
        range or timing (state is writable only before the first step)."""
        tensor = self._tensor(tensor_name)
        if role not in LOADABLE_ROLES:
            raise DeviceError(Status.ACCESS_DENIED, f"{role} is not writable")
        self._check_range(tensor, role, offset, length)
        if not self.loading:
            raise DeviceError(
                Status.STATE_SEALED,
                f"{tensor.name}/{role} can only be written before the first step "
                f"(namespace is at step {self.committed_step})",
            )

    def check_read(self, tensor_name: str, role: str, offset: int, length: int) -> None:
        """Refuse, changing nothing, a read of bytes [offset, offset + length) of a tensor file
        that is not wholly inside a readable file (a transfer whose size the reader fixed
        beforehand, as CMB_READ's, cannot end short the way a file read does)."""
        tensor = self._tensor(tensor_name)
        if role not in ROLES:
            raise DeviceError(Status.INVALID_FIELD, f"{tensor_name}: no file {role!r} (one of {', '.join(ROLES)})")
        if role == "grad":
            raise DeviceError(Status.ACCESS_DENIED, "grad files are write-only")
        size = tensor.numel * self.itemsize(role)
        if offset < 0 or length < 0 or offset + length > size:
            raise DeviceError(
                Status.LBA_OUT_OF_RANGE,
                f"{tensor_name}/{role}: read of {length} bytes at {offset} passes the end ({size} bytes)",
            )

    def _check_range(self, tensor: TensorLayout, role: str, offset: int, length: int) -> None:
        itemsize = self.itemsize(role)
        if offset < 0 or offset % itemsize or length % itemsize:
            raise DeviceError(
                Status.MISALIGNED_ACCESS,
                f"{tensor.name}/{role}: writes must start and end on {itemsize}-byte "
                f"element boundaries (offset {offset}, length {length})",
            )
        if offset + length > tensor.numel * itemsize:
            raise DeviceError(
                Status.LBA_OUT_OF_RANGE,
                f"{tensor.name}/{role}: write of {length} bytes at {offset} passes the end "
                f"({tensor.numel * itemsize} bytes)",
            )

    @modeled_command("write_state")
    def write_state(self, tensor_name: str, role: str, offset: int, data: bytes | memoryview) -> int:
        """Load initial master weights or moments (only before the first step)."""
        tensor = self._tensor(tensor_name)
        if role not in LOADABLE_ROLES:
            raise DeviceError(Status.ACCESS_DENIED, f"{role} is not writable")
        length = len(data)
        self._check_range(tensor, role, offset, length)
        if length == 0:
            return 0
        with self._lock:
            self._check_media()
            if not self.loading:
                raise DeviceError(
                    Status.STATE_SEALED,
                    f"{tensor.name}/{role} can only be written before the first step "
                    f"(namespace is at step {self._sb.committed_step})",
                )
            itemsize = self.itemsize(role)
            first = offset // itemsize
            view = self._view(self._sb.committed_copy, tensor, role)
            source = np.frombuffer(data, dtype=view.dtype)
            view[first : first + len(source)] = source
            media_bytes = length
            if role == "master":
                kernels.master_to_param(
                    view[first : first + len(source)],
                    self._view(self._sb.committed_copy, tensor, "param")[first : first + len(source)],
                    self._param_format,
                )
                media_bytes += 2 * len(source)  # the param bytes derived from the master
            self.counters.state_bytes_loaded += length
            self.changed_ns = time.time_ns()
            self.counters.write_commands += 1
            self.counters.media_bytes_written += media_bytes
            self.timing.add(host_in=length, media_write=media_bytes)
        return length

    @modeled_command("write_grad")
    def write_grad(self, tensor_name: str, offset: int, data: bytes | memoryview) -> int:
        """Take gradient bytes of the open step (opening an implicit step if none is).

        The write that completes the last gradient of an implicit step returns only once
        that step is committed or skipped.
        """
        length, implicit = self._stage_grad(tensor_name, offset, data, wait=True)
        if implicit is not None:
            self.finish_implicit_step(implicit)
        return length

    def write_grad_nowait(
        self, tensor_name: str, offset: int, data: bytes | memoryview
    ) -> tuple[int, StepTransaction | None] | None:
        """write_grad's part that never blocks, for the fs layer's event loop.

        None where it would block (timed mode, the namespace lock held, or no step open: a
        begin may wait for a flush); call write_grad in a thread instead. Otherwise
        (length, implicit): `implicit`, when not None, is the implicit step this write
        completed, and finish_implicit_step (which blocks) must commit it before the write
        is acknowledged.
        """
        if self.timing.timed:
            return None
        try:
            with self.timing.command("write_grad"):
                return self._stage_grad(tensor_name, offset, data, wait=False)
        except _WouldBlock:
            return None

    def write_grads_lent(
        self, pieces: Sequence[tuple[str, int, bytes | memoryview | np.ndarray, np.ndarray | None]]
    ) -> CommitResult | None:
        """Take gradient pieces (tensor, byte offset in its grad file, bytes, param copy) from
        memory the caller lends until this returns, as a drive's DMA reads a host buffer:
        each gradient element is read from it exactly once (a whole block by its kernel
        worker, into that thread's buffer; a part of a block into the block's staging), so
        the lender changing it meanwhile cannot make a step use values other than those it
        was checked on. Returns once every block the pieces completed has run.

        A piece's param copy (None, or as many bytes as its gradient, sharing memory with no
        piece's gradient or other copy) receives the step's new params for its elements: the
        kernel stores them as it computes them, and when the step ends the rest is filled
        from the committed copy, so once the step is committed, skipped or aborted the copy
        holds the committed params. Until then it is the device's to write.

        The pieces are checked, against each other and against what the open step already
        has, before any is taken, so a batch refused for its ranges changes nothing. Returns
        the commit's result where the pieces completed an implicit step (committed or
        skipped before this returns), else None.
        """
        spans: dict[str, list[tuple[int, int]]] = {}
        for tensor_name, offset, data, param_copy in pieces:
            self._check_range(self._tensor(tensor_name), "grad", offset, len(data))
            if param_copy is not None and len(param_copy) != len(data):
                raise DeviceError(Status.INVALID_FIELD,
                                  f"{tensor_name}: a param copy of {len(param_copy)} bytes for {len(data)} of gradient")
            spans.setdefault(tensor_name, []).append((offset, offset + len(data)))
        for tensor_name, ranges in spans.items():
            overlap = first_overlap([(start, end, None) for start, end in ranges])
            if overlap is not None:
                raise DeviceError(
                    Status.GRADIENT_DUPLICATE,
                    f"tensor {tensor_name!r}: gradient bytes from {overlap[0]} are sent twice in one batch",
                )
        with self._lock:
            if self._tx is not None:
                for tensor_name, ranges in spans.items():
                    for start, end in ranges:
                        self._tx.check_free(self._tensor(tensor_name), start // 2, end // 2)
        queued: list[concurrent.futures.Future[None]] = []
        implicit = None
        try:
            for tensor_name, offset, data, param_copy in pieces:
                # Staged a few blocks at a time, so the kernel workers start on the first
                # blocks before this thread has staged the whole batch.
                position = 0
                while True:
                    # Up to the next multiple of _LENT_STAGE_BYTES in the file: whole blocks.
                    end = min(len(data), (offset + position) // _LENT_STAGE_BYTES * _LENT_STAGE_BYTES
                              + _LENT_STAGE_BYTES - offset)
                    copy = None if param_copy is None else param_copy[position:end]
                    with self.timing.command("write_grad"):
                        _, completed = self._stage_grad(tensor_name, offset + position, data[position:end],
                                                        wait=True, lent=queued, param_copy=copy)
                    implicit = implicit or completed
                    position = end
                    if position >= len(data):
                        break
        finally:
            # Even after a failure: the lender may reuse its memory once this returns.
            concurrent.futures.wait(queued)
        return self.finish_implicit_step(implicit) if implicit is not None else None

    def _stage_grad(
        self, tensor_name: str, offset: int, data: bytes | memoryview | np.ndarray, *, wait: bool,
        lent: list[concurrent.futures.Future[None]] | None = None, param_copy: np.ndarray | None = None,
    ) -> tuple[int, StepTransaction | None]:
        """Receive gradient bytes and queue the blocks they complete; see write_grad_nowait.
        With `lent`, `data` is lent memory, read only by the blocks' workers (see _run_block),
        and the futures of the blocks queued are appended to it (write_grads_lent waits for
        them)."""
        tensor = self._tensor(tensor_name)
        length = len(data)
        self._check_range(tensor, "grad", offset, length)
        if length == 0:
            return 0, None
        if lent is None and not _immutable(data):
            # Blocks run after this returns (see below) and may use the caller's buffer in
            # place, so a buffer the caller could reuse is copied; FUSE hands over bytes
            # (or, on the data path, a view of the request's bytes).
            data = bytes(data)
        grad = np.frombuffer(data, dtype=np.uint16)
        # Lent memory other than bytes (the CMB) may change under the device at any time, so
        # each of its elements must be read exactly once (see _run_block): nothing here reads
        # it, and the blocks' workers count what they step.
        shared = lent is not None and not _immutable(data)
        if not self._lock.acquire(blocking=wait):
            raise _WouldBlock
        try:
            tx = self._tx
            if tx is None:
                if not wait:
                    raise _WouldBlock
                tx = self._begin_locked(None, 1.0, explicit=False)
            params = None if param_copy is None else np.frombuffer(param_copy, dtype=np.uint16)
            ready = tx.receive(tensor, offset // 2, grad, shared, params)
            completes_step = tx.all_received and bool(ready) and not tx.explicit
            # Counted before they are queued, so a commit cannot pass blocks not queued yet.
            tx.inflight += len(ready)
            self.counters.grad_bytes_in += length
            self.counters.write_commands += 1
            self.timing.add(host_in=length)
        finally:
            self._lock.release()
        # Like an SSD acknowledging a write once it sits in its write buffer, the request
        # returns once its bytes are staged: complete blocks run on the kernel workers, so
        # a single writer's next request overlaps them and both cores update blocks.
        # A block that fails marks the step (tx.error), and its commit reports it.
        queued = 0
        try:
            for block in ready:
                future = kernel_workers().submit(self._run_block_in_background, tx, block)
                queued += 1
                if lent is not None:
                    lent.append(future)
        finally:
            if queued < len(ready):
                with self._cond:
                    tx.inflight -= len(ready) - queued
                    tx.error = tx.error or RuntimeError("gradient blocks could not be queued")
                    self._cond.notify_all()
        return length, (tx if completes_step else None)

    def finish_implicit_step(self, tx: StepTransaction) -> CommitResult | None:
        """Commit (or skip) implicit step `tx` once its blocks are done: the end of the write
        that completed its gradients. Its result, or None where another thread got there first."""
        with self.timing.command("commit_step"), self._cond:
            while tx.inflight:
                self._cond.wait()
            if self._tx is tx:
                return self._commit_locked(tx)
            return None

    def _run_block_in_background(self, tx: StepTransaction, block: ReadyBlock) -> None:
        try:
            # Modeled as the controller's own work; in timed mode the block (and so the
            # commit that waits for it) finishes no earlier than the model says.
            with self.timing.command("kernel_block", host_command=False):
                self._run_block(tx, block)
        except DeviceError:
            pass  # recorded in tx.error and logged; the commit reports it
        finally:
            with self._cond:
                tx.inflight -= 1
                self._cond.notify_all()

    def _block_update(self, source: Copy, tensor: TensorLayout) -> kernels.BlockUpdate:
        """The kernel call that steps `tensor`'s blocks from copy `source` into the other one,
        its arrays checked once (a mapped shadow only)."""
        key = (source, tensor.name)
        update = self._block_updates.get(key)
        if update is None:
            update = kernels.BlockUpdate(
                *(self._view(source, tensor, role) for role in ("master", "exp_avg", "exp_avg_sq")),
                *(self._view(source.other, tensor, role) for role in BLOCK_ROLES),
                grad_format=self._grad_format, param_format=self._param_format,
                state_format=self._state_format)
            self._block_updates[key] = update
        return update

    def _run_block(self, tx: StepTransaction, block: ReadyBlock) -> None:
        """Check and update one complete gradient block into the shadow copy."""
        try:
            started = time.perf_counter_ns()
            committed = self._sb.committed_copy
            shadow = committed.other
            tensor = block.tensor
            start, stop = tensor.block_range(block.local_block)
            crc = 0
            written = 0
            state = self._copies[shadow]
            mapped = state.write_mode == "mapped"
            buffers = self._staging(stop - start)
            grad = block.grad
            if block.shared:
                # Every element of a lent gradient is read from the host's memory exactly once:
                # copied into this thread's buffer, which alone is counted and stepped, so the
                # step always uses the values it was checked on.
                grad = buffers["grad"]
                np.copyto(grad, block.grad)
            # Counted before the step, from memory only the device writes: a block found
            # non-finite never reaches the shadow copy, which still holds the step before
            # the committed one (the fallback; see _commit_locked).
            nonfinite = kernels.count_nonfinite(grad, self._grad_format)
            # Once the step is known to be skipped there is no point updating the shadow.
            if not nonfinite and tx.nonfinite == 0:
                if mapped:
                    # The kernel stores the new state straight into the shadow copy's mapping.
                    state.before_mapped_write()
                    crc, _ = self._block_update(committed, tensor)(
                        grad, start, tx.scalars[self._group_of[tensor.name]], block.param_copy)
                    written = (stop - start) * sum(self._role_dtype(role).itemsize for role in BLOCK_ROLES)
                else:
                    # Into this thread's buffers, which pwrite then copies into the shadow
                    # (stores into a disk file's mapping would fault once per page).
                    out = buffers
                    # One pass: the step, and the checksum of its outputs while they are in cache.
                    crc = kernels.adam_step_crc(
                        grad,
                        self._view(committed, tensor, "master")[start:stop],
                        self._view(committed, tensor, "exp_avg")[start:stop],
                        self._view(committed, tensor, "exp_avg_sq")[start:stop],
                        out["master"], out["exp_avg"], out["exp_avg_sq"], out["param"],
                        grad_format=self._grad_format,
                        param_format=self._param_format,
                        state_format=self._state_format,
                        scalars=tx.scalars[self._group_of[tensor.name]],
                    )
                    if block.param_copy is not None:
                        block.param_copy[:] = out["param"]  # still in cache
                    for role in BLOCK_ROLES:
                        region = self._region_offset(tensor, role) + start * out[role].itemsize
                        state.write_at(region, out[role])
                        state.start_writeback(region, out[role].nbytes)
                        written += out[role].nbytes
            elapsed = time.perf_counter_ns() - started
        except BaseException as exc:
            with self._lock:
                tx.error = exc
            log.exception("namespace %s: kernel failed on %s block %d", self.name, block.tensor.name, block.local_block)
            raise DeviceError(Status.INTERNAL_ERROR, f"kernel failed: {exc}") from exc
        with self._lock:
            tx.finish(block, crc, nonfinite, copied=written > 0 and block.param_copy is not None)
            self.counters.kernel_blocks += 1
            self.counters.kernel_ns += elapsed
            self.counters.media_bytes_written += written
        if written:  # the kernel ran: master and moments read, the new state written
            self.timing.add(media_read=(stop - start) * (4 + 2 * self._state_dtype.itemsize),
                            media_write=written, elements=stop - start)

    # ------------------------------------------------------------------ step commands

    @modeled_command("begin_step")
    def begin_step(self, step: int | None = None, grad_scale: float = 1.0) -> int:
        """Open step `step` (default: the next one) with a combined gradient scale."""
        with self._lock:
            return self._begin_locked(step, grad_scale, explicit=True).step

    def _begin_locked(self, step: int | None, grad_scale: float, explicit: bool) -> StepTransaction:
        self._check_media()
        if self._tx is not None:
            raise DeviceError(
                Status.STEP_ALREADY_OPEN,
                f"namespace {self.name!r}: step {self._tx.step} is already open "
                "(commit or abort it first)",
            )
        expected = self._sb.committed_step + 1
        if step is not None and step != expected:
            raise DeviceError(
                Status.STEP_NUMBER_MISMATCH,
                f"namespace {self.name!r}: next step is {expected}, not {step}",
            )
        if not (isinstance(grad_scale, float) and math.isfinite(grad_scale) and grad_scale > 0):
            raise DeviceError(
                Status.INVALID_FIELD, f"grad_scale must be a finite number > 0, got {grad_scale!r}"
            )
        try:
            scalars = [kernels.adam_scalars(h.kernel, expected, grad_scale) for h in self._hypers]
        except kernels.KernelArgumentError as exc:
            raise DeviceError(Status.INVALID_FIELD, str(exc)) from None
        if self.loading:
            self._seal_locked()
        # The shadow copy still holds the previous step; it may be the only complete
        # copy on the media until the committed step is durable. Never overwrite it first.
        self._flush_to(self._sb)
        self._tx = StepTransaction(expected, grad_scale, scalars, explicit, self.total_blocks)
        return self._tx

    def _seal_locked(self) -> None:
        """End the loading phase: checksum the initial state and make it durable."""
        crcs = np.zeros(self.total_blocks, dtype=np.uint32)
        copy = self._sb.committed_copy
        for tensor in self.layouts:
            for block in range(tensor.block_count):
                crcs[tensor.first_block + block] = self._block_crc(copy, tensor, block)
        self._sync(self._copies[copy])
        sealed = self._sb.successor(flags=SuperblockFlags.NONE, block_crcs=crcs)
        self._write_superblock(sealed, sync=True)

    def _quiesced_step_locked(self) -> StepTransaction:
        """The open step, once no kernel of it is still running (caller holds the lock)."""
        tx = self._tx
        if tx is None:
            raise DeviceError(Status.NO_STEP_OPEN, f"namespace {self.name!r}: no step is open")
        while tx.inflight:
            self._cond.wait()
        return tx

    @modeled_command("commit_step")
    def commit_step(self) -> CommitResult:
        """Commit the open step once all its gradient blocks are in (or skip it)."""
        with self._cond:
            return self._commit_locked(self._quiesced_step_locked())

    def abort_step(self) -> int:
        """Drop the open step; the committed state is untouched. Returns its number."""
        with self._cond:
            tx = self._quiesced_step_locked()
            self._tx = None
            self.counters.steps_aborted += 1
            self._settle_param_copies(tx, committed=False)
            return tx.step

    def _commit_locked(self, tx: StepTransaction) -> CommitResult:
        self._wait_for_pins_locked()  # a snapshot or a reply is reading the committed copy
        if self._tx is not tx:
            raise DeviceError(Status.NO_STEP_OPEN, f"namespace {self.name!r}: step {tx.step} was aborted")
        if self.media_failure is not None:
            self._tx = None
            self.counters.steps_aborted += 1
            self._check_media()
        if tx.error is not None:
            self._tx = None
            self.counters.steps_aborted += 1
            self._settle_param_copies(tx, committed=False)
            raise DeviceError(
                Status.INTERNAL_ERROR, f"step {tx.step} failed and was aborted: {tx.error}"
            )
        if not tx.all_done:
            raise DeviceError(
                Status.GRADIENT_INCOMPLETE,
                f"step {tx.step}: gradients incomplete for {', '.join(tx.missing(self.layouts))}",
            )
        ended = False  # True once the step is committed: the kernel's param copies stand
        try:
            if tx.nonfinite:
                # A skip writes no superblock: both slots keep naming the committed step and
                # the one before it, the fallback should the committed copy fail its checksums.
                self._record_skip_locked(tx.step)
                self.counters.nonfinite_elements += tx.nonfinite
                log.info("namespace %s: step %d skipped (%d non-finite gradient elements)",
                         self.name, tx.step, tx.nonfinite)
                return CommitResult(tx.step, self._sb.committed_step, True, tx.nonfinite)
            shadow = self._sb.committed_copy.other
            if self.sync_commits:
                self._sync(self._copies[shadow])
            # The last look at both copies before the flip: a shadow cut short or punched
            # while its blocks were written (pwrite extends it again, leaving holes that read
            # as zeros) must fail this step, not become the committed one.
            self._check_media()
            skips = self._skips()
            committed = self._sb.successor(
                committed_step=tx.step,
                committed_copy=shadow,
                block_crcs=tx.block_crcs,
                steps_committed=self._sb.steps_committed + 1,
                steps_skipped=skips.steps_skipped,
                last_skipped_step=skips.last_skipped_step,
                last_grad_scale=tx.grad_scale,
                **_hyper_record(self._hypers),
            )
            self._write_superblock(committed, sync=self.sync_commits)
            self.counters.steps_committed += 1
            ended = True
            return CommitResult(tx.step, tx.step, False)
        except DeviceError:
            self.counters.steps_aborted += 1
            raise
        finally:
            self._tx = None
            if self.media_failure is None:
                self._settle_param_copies(tx, committed=ended)

    def _skips(self) -> SkipCounts:
        """The skip counters: the newer of the superblock's (as of the last commit) and the
        side record's (as of the last skip), the record read once per open."""
        recorded = getattr(self, "_recorded_skips", None)  # set on first use, not at open
        if recorded is None:
            recorded = self._recorded_skips = SkipCounts.load(self.directory)
        return max(SkipCounts.of(self._sb), recorded)

    def _record_skip_locked(self, step: int) -> None:
        """Count skipped step `step`: durably in the side record, and in the superblock in
        force in memory only, so that the next superblock written carries it."""
        skips = SkipCounts(self._skips().steps_skipped + 1, step)
        written = skips.store_or_warn(self.directory)
        self.counters.media_bytes_written += written
        self.timing.add(media_write=written)
        self._recorded_skips = skips
        self._sb = dataclasses.replace(
            self._sb, steps_skipped=skips.steps_skipped, last_skipped_step=skips.last_skipped_step)
        self.counters.steps_skipped = skips.steps_skipped

    def _settle_param_copies(self, tx: StepTransaction, committed: bool) -> None:
        """Fill what the kernel has not of the host's param copies (write_grads_lent), from
        the committed copy: blocks assembled from pieces, and every block of a step that
        ended without committing. Caller holds the lock; the step has ended."""
        if not tx.param_copies:
            return
        moved = 0
        for tensor, first, copy in tx.param_copies:
            params = self._view(self._sb.committed_copy, tensor, "param")
            end = first + len(copy)
            for block in block_range_of(first, end):
                if committed and (tensor.name, block) in tx.copied:
                    continue
                start, stop = tensor.block_range(block)
                lo, hi = max(first, start), min(end, stop)
                copy[lo - first : hi - first] = params[lo:hi]
            moved += copy.nbytes
        # Param bytes to the host, as a read of the param file would count them.
        self.counters.bytes_read += moved
        self.counters.param_bytes_out += moved
        self.timing.add(host_out=moved)

    def _wait_for_pins_locked(self) -> None:
        """Wait until nothing reads the committed copy (caller holds the lock, about to flip)."""
        self._flips_waiting += 1
        try:
            while self._pins:
                self._cond.wait()
        finally:
            self._flips_waiting -= 1
            self._cond.notify_all()

    def _sync(self, media: StateFile | SlotFile) -> None:
        """fsync one file; a failure stops the namespace (see media_failure)."""
        try:
            media.sync()
        except DeviceError as exc:
            self.media_failure = exc.message
            log.error("namespace %s: %s; refusing further steps until reopened", self.name, exc.message)
            raise

    def _check_media(self) -> None:
        """Refuse to go on once the media failed: a failed fsync (WRITE_FAULT), or a state copy
        damaged under the namespace (UNRECOVERED_READ_ERROR), which every call checks for
        first (a few system calls: both copies' size, link count and identity, and the
        guard's fault counts)."""
        if self.media_failure is None:
            self._check_copies()
        failure = self.media_failure
        if failure is not None:
            raise DeviceError(
                self.__dict__.get("_media_status", Status.WRITE_FAULT),
                f"namespace {self.name!r} stopped ({failure}); "
                "remount the device to recover the last durable step",
            )

    def _check_copies(self) -> None:
        """Stop the namespace if either state copy is damaged (see StateFile.damage)."""
        for state in self._copies:
            reason = state.damage()
            if reason is not None:
                self._media_damaged(reason)
                return

    def _media_damaged(self, reason: str) -> str:
        """Record a damaged state copy: a media error (SMART, statistics), logged, and the
        namespace refuses steps until the device is opened again, when recovery judges each
        copy on its own. Returns the failure as media_failure gives it."""
        with _damage_lock:
            if self.__dict__.get("_media_failure") is None:
                self._media_status = Status.UNRECOVERED_READ_ERROR
                self._media_failure = reason
                self.counters.checksum_failures += 1
                log.error("namespace %s: media error: %s; refusing steps until remounted", self.name, reason)
                sink = self.__dict__.get("media_error_sink")  # the device's error log
                if sink is not None:
                    sink()
            return str(self._media_failure)

    @property
    def media_failure(self) -> str | None:
        """Why the namespace stopped (a failed fsync, a damaged state copy), or None.

        Reading it also collects the bus errors the guard contained in either copy's mapping
        (kernels/guard.py): a step whose kernels read or wrote a page cut from under them
        reads zeros there, and the commit, which checks this first, refuses it.
        """
        failure: str | None = self.__dict__.get("_media_failure")
        if failure is None:
            for state in self.__dict__.get("_copies", ()):
                if state.faults():
                    return self._media_damaged(state.damage() or f"{state.path.name}: its mapping faulted")
        return failure

    @media_failure.setter
    def media_failure(self, value: str | None) -> None:
        self._media_failure = value

    def _write_superblock(self, superblock: Superblock, sync: bool) -> None:
        slot = self._slots[superblock.slot]
        encoded = superblock.encode()
        slot.write(encoded)
        self.counters.media_bytes_written += len(encoded)
        self.timing.add(media_write=len(encoded))
        if sync:
            self._sync(slot)
            self._durable_seq = superblock.seq
            self._durable_step = superblock.committed_step
        self._sb = superblock
        self.changed_ns = time.time_ns()

    def set_hyperparameters(self, group: int | None = None, **changes: Any) -> Hyperparameters:
        """Change hyperparameters for the next step (persisted with the next commit).

        `group` picks one group; None changes every group. Nothing changes unless every
        new value validates. Returns the (first) changed group's hyperparameters.
        """
        if "mode" in changes:
            raise DeviceError(Status.INVALID_FIELD, "mode is fixed when a namespace is created")
        with self._lock:
            if group is None:
                targets = range(len(self._hypers))
            elif isinstance(group, int) and not isinstance(group, bool) and 0 <= group < len(self._hypers):
                targets = range(group, group + 1)
            else:
                raise DeviceError(
                    Status.INVALID_FIELD,
                    f"group {group!r} outside 0..{len(self._hypers) - 1}",
                )
            updated = {index: self._hypers[index].replace(**changes) for index in targets}
            for index, hyper in updated.items():
                self._hypers[index] = hyper
            self.config_changed_ns = time.time_ns()
            return updated[targets[0]]

    # ------------------------------------------------------------------ durability

    @modeled_command("flush")
    def flush(self) -> int:
        """Make the committed step durable; returns the durable step."""
        with self._lock:
            superblock = self._sb
        self._flush_to(superblock)
        return self._durable_step

    @property
    def flush_pending(self) -> bool:
        return self._durable_seq < self._sb.seq

    def _flush_to(self, superblock: Superblock) -> None:
        """Sync the copy and the superblock slot of `superblock` (data first, then the record)."""
        with self._flush_lock:
            if self._durable_seq >= superblock.seq:
                return
            started = time.perf_counter_ns()
            self._sync(self._copies[superblock.committed_copy])
            self._sync(self._slots[superblock.slot])
            self._durable_seq = superblock.seq
            self._durable_step = superblock.committed_step
            self.counters.flushes += 1
            self.counters.flush_ns += time.perf_counter_ns() - started
            self.timing.add(flushes=1)

    def scrub(self) -> list[tuple[str, int]]:
        """Verify every block checksum of the committed copy; returns the bad blocks."""
        return self.scrub_blocks()[1]

    def scrub_blocks(self) -> tuple[int, list[tuple[str, int]]]:
        """(blocks verified, bad blocks) of the committed copy. A namespace still loading has
        no checksums yet, so nothing is verified."""
        with self._lock:
            if self.loading:
                return 0, []
            bad = self._verify_copy(self._sb)
            self.counters.checksum_failures += len(bad)
            return self.total_blocks, bad

    def corrupt_block(self, tensor_name: str, block: int) -> dict[str, Any]:
        """Fault injection (INJECT_ERROR): change one byte of `block` of `tensor_name` in the
        committed copy on the media, as a media error would, so that scrub and recovery find
        the block's checksum wrong. Returns where the byte was."""
        tensor = self._tensor(tensor_name)
        if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block < tensor.block_count:
            raise DeviceError(
                Status.INVALID_FIELD,
                f"{tensor.name} has blocks 0..{tensor.block_count - 1}, not {block!r}",
            )
        with self._lock:
            if self.loading:
                raise DeviceError(
                    Status.INVALID_FIELD,
                    f"namespace {self.name!r} is still loading: there are no checksums to fail",
                )
            copy = self._sb.committed_copy
            start, _ = tensor.block_range(block)
            offset = tensor.master_offset + start * 4  # the block's first master byte
            state = self._copies[copy]
            # +1 rather than a bit flip, so that corrupting the same block twice does not undo it.
            state.write_at(offset, np.array([(int(state.bytes[offset]) + 1) & 0xFF], dtype=np.uint8))
        return {"tensor": tensor.name, "block": block, "lba": tensor.first_block + block,
                "copy": copy.name, "offset": offset}

    # ------------------------------------------------------------------ snapshots

    @contextlib.contextmanager
    def pinned_committed(self) -> Iterator[tuple[Superblock, StateFile]]:
        """The committed superblock and its copy, held still while the block runs: a commit
        or rollback waits until it exits (a step may stay open and keep computing: it only
        writes the shadow). Emulator/snapshots.py copies the state under it."""
        with self._lock:
            self._check_media()
            if self.loading:
                raise DeviceError(
                    Status.NAMESPACE_NOT_READY,
                    f"namespace {self.name!r} is still loading its initial state and has no "
                    f"committed step yet (step {self._sb.committed_step + 1} seals it)",
                )
            self._pins += 1
            superblock = self._sb
        try:
            yield superblock, self._copies[superblock.committed_copy]
        finally:
            self._unpin()

    def restore_committed(self, source: Superblock, fill: Callable[[StateFile], None]) -> int:
        """Make `source`'s state (a snapshot's) the committed one: `fill` writes its bytes
        into the shadow copy, which must then match `source`'s block checksums, and a new
        superblock (seq + 1) commits it durably. Returns the step it replaced.

        Crash safe like a step: the committed copy is untouched until the slot write flips.
        """
        with self._cond:
            self._check_media()
            self._wait_for_pins_locked()
            if self._tx is not None:
                raise DeviceError(
                    Status.STEP_ALREADY_OPEN,
                    f"namespace {self.name!r}: step {self._tx.step} is open (commit or abort it "
                    "before rolling back)",
                )
            previous = self._sb.committed_step
            # As for a begin: the shadow may hold the only complete older step until the
            # committed one is durable, so never overwrite it first.
            self._flush_to(self._sb)
            shadow = self._sb.committed_copy.other
            fill(self._copies[shadow])
            bad = self._verify_copy(dataclasses.replace(source, committed_copy=shadow))
            if bad:
                tensor, block = bad[0]
                raise DeviceError(
                    Status.UNRECOVERED_READ_ERROR,
                    f"snapshot of step {source.committed_step} fails its checksum in {len(bad)} "
                    f"block(s) (first: {tensor} block {block}); namespace {self.name!r} is unchanged",
                )
            self._sync(self._copies[shadow])
            restored = self._sb.successor(
                committed_step=source.committed_step,
                committed_copy=shadow,
                flags=SuperblockFlags.NONE,
                block_crcs=source.block_crcs.copy(),
                last_grad_scale=source.last_grad_scale,
                **_hyper_record(_hypers_of(source)),
            )
            self._write_superblock(restored, sync=True)
            self._hypers = _hypers_of(restored)
            self.counters.media_bytes_written += self._copies[shadow].size_bytes
            return previous
