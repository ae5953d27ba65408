"""An optimizer namespace: A/B state copies on the media, step transactions, recovery.

The class is one object with one lock; its methods live in modules by job beside this one:
open.py (create, open, recover), reads.py (reads, pins, range checks), writes.py (initial
state, the gradient path), steps.py (begin, commit, abort, hyperparameters, snapshot flips),
shared.py (shared steps), media.py (durability, damage, checksums) and verify.py (verifying a
reopened copy lazily: params as served, the rest in the background).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ... import kernels
from ...protocol.status import DeviceError, Status
from ..accounting import NamespaceTiming
from ..layout import BLOCK_ELEMS, Copy, SuperblockFlags, TensorLayout, region_offset, scale_count
from ..media import SlotFile, StateFile
from .common import (BLOCK_ROLES, LOADABLE_ROLES, MOMENT_ROLES, ROLES, SCALE_ROLES, SCALED_BLOCK_ROLES,
                     CommitResult, NamespaceCounters, block_slice, hypers_of)
from .media import _Media
from .open import _Opening
from .reads import _Reads
from .shared import SharedOutcome, _SharedSteps
from .steps import _Steps
from .verify import _Verifying
from .writes import MAX_QUEUED_BLOCKS, GradPieces, _Writes
from .snapshots import SnapshotStore
from ..spec import HALF_FORMATS, STATE_FORMATS, Hyperparameters, NamespaceSpec, TensorSpec
from ..superblock import Superblock
from ..transaction import StepTransaction
from ..workers import KernelWorkers

__all__ = ["CommitResult", "Namespace", "NamespaceCounters", "NamespaceSpec", "TensorSpec", "ROLES",
           "LOADABLE_ROLES"]


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


class Namespace(_Opening, _Reads, _Writes, _Steps, _SharedSteps, _Media, _Verifying):
    """One optimizer: its tensors, hyperparameters and state, committed step by step.

    Thread-safe: the fs layer calls write_grad from several worker threads; kernels for
    distinct blocks run in parallel outside the lock (cffi releases the GIL).
    """

    # Set in __init__ and by the step and shared-step mixins; declared so that each sees the type.
    changed_ns: int
    config_changed_ns: int

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
        # Taken only to record a damaged state copy once (_Media._media_damaged).
        self._damage_lock = threading.Lock()
        self._init_verification()  # namespace/verify.py: nothing deferred until _recover says so
        self.directory = directory
        self.nsid = nsid
        self.spec = spec
        self.name = spec.name
        self.sync_commits = sync
        self._copies = copies
        self._slots = slots
        self._sb = superblock
        self._hypers = hypers_of(superblock)
        self._group_of = {t.name: t.group for t in spec.tensors}
        self._shape_of = {t.name: t.shape for t in spec.tensors}
        self.layouts = layouts
        self.tensors = {t.name: t for t in layouts}
        self.total_blocks = sum(t.block_count for t in layouts)
        self._grad_format = HALF_FORMATS[spec.grad_dtype]
        self._param_format = HALF_FORMATS[spec.param_dtype]
        self._state_format = STATE_FORMATS[spec.state_dtype]
        # The dtype of one moment code on the media: FP32 itself, BF16 and FP16 bits, INT8 codes.
        self._state_dtype = np.dtype({"fp32": np.float32, "bf16": np.uint16, "fp16": np.uint16,
                                      "int8": np.uint8}[spec.state_dtype])
        # Block-scaled moments (fp16, int8): a float32 scale per 256 elements beside each
        # moment's codes, in the block checksum (common.SCALED_BLOCK_ROLES); the mount tree's
        # moment files read them decoded to FP32.
        self._scaled = spec.scaled_state
        self._block_roles = SCALED_BLOCK_ROLES if self._scaled else BLOCK_ROLES
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._flush_lock = threading.Lock()
        self._durable_seq = superblock.seq
        self._durable_step = superblock.committed_step
        self._tx: StepTransaction | None = None
        # Shared steps (namespace/shared.py): how the last one ended, and whether a gradient
        # write outside a step is refused rather than opening an implicit step.
        self._last_shared: SharedOutcome | None = None
        self._shared_fence = False
        self.counters = NamespaceCounters(
            steps_committed=superblock.steps_committed, steps_skipped=superblock.steps_skipped
        )
        # Modeled device time (model/timing.py); the device swaps in its own profile.
        self.timing = NamespaceTiming()
        # The threads that step its blocks: a pool of its own, started on first use, until the
        # device that opens it attaches the device's (Device._attach).
        self._own_workers = KernelWorkers()
        self.workers = self._own_workers
        # Blocks of written gradient bytes queued for the kernels at most (namespace/writes.py).
        self.max_queued_blocks = MAX_QUEUED_BLOCKS
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
        # Readers of each copy right now (snapshots copying the committed copy, replies
        # written from it: pinned_committed, read_pinned). A copy changes only once it is the
        # shadow and a step (or a rollback's fill) writes into it, so those wait for its pins,
        # not the commit: a commit flips while a snapshot still copies the step before, and
        # the begin after it waits (new pins always go to the committed copy, never to the
        # shadow a begin waits on, so readers cannot hold a begin off for ever).
        self._pins = {Copy.A: 0, Copy.B: 0}
        self.snapshots = SnapshotStore(self)
        # Wall-clock times (ns) the mount shows as mtime/ctime: of the last change to the
        # committed state (a commit, a rollback, the seal, an initial-state write) and of the
        # hyperparameters, so rsync, backups and `find -newer` see each step. After a
        # restart the backing files' own times stand in (never older than the change).
        self.changed_ns = _backing_mtime_ns(directory)
        self.config_changed_ns = self.changed_ns


    def close(self) -> None:
        """Flush the committed step and release the media. An open step is abandoned."""
        try:
            self._stop_verification()
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
            self._own_workers.shutdown()

    # ------------------------------------------------------------------ views of the state

    def _view(self, copy: Copy, tensor: TensorLayout, role: str) -> np.ndarray:
        key = (copy, tensor.name, role)
        view = self._views.get(key)
        if view is None:
            count = scale_count(tensor.numel) if role in SCALE_ROLES else tensor.numel
            view = self._copies[copy].view(self._region_offset(tensor, role), count, self._role_dtype(role))
            self._views[key] = view
        return view

    def _staging(self, count: int) -> dict[str, np.ndarray]:
        """Per-thread buffers for one block, allocated once per worker thread: the outputs
        (the block roles) and "grad", where a lent gradient is copied before it is counted
        and stepped."""
        buffers = getattr(self._thread_local, "buffers", None)
        if buffers is None:
            buffers = {role: np.empty(block_slice(role, 0, BLOCK_ELEMS).stop, dtype=self._role_dtype(role))
                       for role in self._block_roles}
            buffers["grad"] = np.empty(BLOCK_ELEMS, dtype=np.uint16)
            self._thread_local.buffers = buffers
        return {role: array[block_slice(role, 0, count)] for role, array in buffers.items()}

    def _role_dtype(self, role: str) -> np.dtype:
        """The dtype of a role's array on the media (see itemsize for the files' elements)."""
        if role == "master" or role in SCALE_ROLES:
            return np.dtype(np.float32)
        if role == "param":
            return np.dtype(np.uint16)
        return self._state_dtype

    _region_offset = staticmethod(region_offset)

    def itemsize(self, role: str) -> int:
        """Bytes of one element of a tensor file: block-scaled moments read (and load) as FP32."""
        if role == "grad":
            return 2
        if self._scaled and role in MOMENT_ROLES:
            return 4
        return self._role_dtype(role).itemsize

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
            # Elements per gradient block: a client splitting the gradients among several
            # writers (the ranks of a sharded job) splits at these boundaries, so each block
            # arrives whole from one writer.
            "block_elems": BLOCK_ELEMS,
            "tensors": [
                # shape: the model's, as recorded at creation; null where none was (then the
                # export writes the tensor flat).
                {"name": t.name, "numel": t.numel, "group": self._group_of[t.name],
                 "shape": None if self._shape_of[t.name] is None else list(self._shape_of[t.name])}
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
            "shared_step": self.shared_state(),
            "loading": self.loading,
            "tensors": len(self.layouts),
            "parameters": sum(t.numel for t in self.layouts),
            "state_bytes_per_copy": self._copies[0].size_bytes,
            # How new state reaches the shadow copy here (media.write_mode_for).
            "state_writes": self._copies[0].write_mode,
            # The superblock sequence: moves at every commit, rollback and seal (trainer's
            # load_state_dict tells its own state from an older one of the same step by it).
            "seq": self._sb.seq,
            "verification": self.verification_state(),
            "model": self.timing.snapshot(),
        }

    # ------------------------------------------------------------------ the kind's I/O (emulator/io.py)
    # DeviceIO dispatches each request through these, the same methods on every kind (an NVM
    # namespace's are in emulator/nvm.py), so that no front-end tells the kinds apart: here a
    # file is a tensor's `role` array, and a write of "grad" is a gradient of the step.

    def as_optimizer(self) -> Namespace:
        """This namespace, as the kind with tensors, steps, state copies and snapshots."""
        return self

    def as_nvm(self) -> None:
        """None: this kind's files are its tensors' arrays, not one data file."""
        return None

    def io_read(self, tensor: str | None, role: str, offset: int, size: int) -> bytes:
        return self.read(_tensor_named(tensor), role, offset, size)

    def io_read_nowait(self, tensor: str | None, role: str, offset: int, size: int) -> memoryview | bytes | None:
        return self.read_nowait(_tensor_named(tensor), role, offset, size)

    @contextlib.contextmanager
    def io_read_view(self, tensor: str | None, role: str, offset: int, size: int) -> Iterator[bytes | memoryview]:
        with self.read_pinned(_tensor_named(tensor), role, offset, size) as view:
            yield view

    @contextlib.contextmanager
    def io_read_many(self, reads: Sequence[tuple[str | None, str, int, int]]) -> Iterator[list[bytes | memoryview]]:
        named = [(_tensor_named(tensor), role, offset, size) for tensor, role, offset, size in reads]
        with self.read_pinned_many(named) as views:
            yield views

    def io_write(self, tensor: str | None, role: str, offset: int, data: bytes | memoryview) -> int:
        if role == "grad":
            return self.write_grad(_tensor_named(tensor), offset, data)
        return self.write_state(_tensor_named(tensor), role, offset, data)

    def io_write_nowait(self, tensor: str | None, role: str, offset: int,
                        data: bytes) -> tuple[int, StepTransaction | None] | None:
        if role != "grad":
            return None  # initial state goes through the blocking write
        return self.write_grad_nowait(_tensor_named(tensor), offset, data)

    def io_finish(self, implicit: StepTransaction) -> None:
        self.finish_implicit_step(implicit)

    def io_write_grads(self, pieces: GradPieces) -> CommitResult | None:
        return self.write_grads_lent(pieces)


def _tensor_named(tensor: str | None) -> str:
    """The tensor a file of an optimizer namespace belongs to (every one has one)."""
    if tensor is None:
        raise DeviceError(Status.INVALID_FIELD, "a file of an optimizer namespace is a tensor's")
    return tensor
