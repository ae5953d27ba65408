"""An optimizer namespace: A/B state copies on the media, step transactions, recovery.

Namespace is one object with one lock, composed of parts that each own the state they alone
use and share the rest through one NamespaceCore (state.py: spec, layout, copies, superblock,
lock, open step, counters). The parts, built in this order, each given what it needs:
media.py (NamespaceMedia: fsyncs, the durable step, damaged copies), verify.py (CopyVerifier:
block checksums, a reopened copy verified lazily, scrub), shared.py (SharedStepRecord, and
SharedSteps: a step the ranks of a job share), steps.py (StepEngine: begin, commit, abort,
revert, hyperparameters, snapshot flips), reads.py (Reads), writes.py (GradientWrites:
initial state, the gradient path) and open.py (creating and opening the files, recovery).
Namespace delegates its public methods to them.
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable, Generic, Iterator, Self, Sequence, TypeVar, overload

import numpy as np

from ...protocol.status import DeviceError, Status
from ..accounting import NamespaceTiming, modeled_command
from ..layout import BLOCK_ELEMS, Copy, TensorLayout, region_offset
from ..media import SlotFile, StateFile
from ..spec import Hyperparameters, NamespaceSpec, TensorSpec
from ..superblock import Superblock
from ..transaction import StepTransaction
from ..workers import KernelWorkers
from . import param_fp8
from .common import LOADABLE_ROLES, ROLES, CommitResult, NamespaceCounters
from .media import NamespaceMedia
from .open import NamespaceFiles, create_files, open_files, recover
from .reads import Reads
from .outcomes import SharedStepRecord
from .shared import SharedSteps
from .snapshots import SnapshotStore
from .state import NamespaceCore
from .steps import StepEngine
from .verify import VERIFY_OPEN, CopyVerifier
from .writes import GradientWrites, GradPieces

__all__ = ["CommitResult", "Namespace", "NamespaceCounters", "NamespaceSpec", "TensorSpec", "ROLES",
           "LOADABLE_ROLES"]

T = TypeVar("T")


class _OnCore(Generic[T]):
    """A Namespace attribute that is the core's of the same name (the device and the
    features set some of them: timing, workers, sync_commits, the error sinks)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, namespace: None, owner: type[Namespace]) -> Self: ...

    @overload
    def __get__(self, namespace: Namespace, owner: type[Namespace]) -> T: ...

    def __get__(self, namespace: Namespace | None, owner: type[Namespace]) -> T | Self:
        if namespace is None:
            return self
        value: T = getattr(namespace.core, self.name)
        return value

    def __set__(self, namespace: Namespace, value: T) -> None:
        setattr(namespace.core, self.name, value)


class Namespace:
    """One optimizer: its tensors, hyperparameters and state, committed step by step.

    Thread-safe: the fs layer calls write_grad from several worker threads; kernels for
    distinct blocks run in parallel outside the lock (cffi releases the GIL).
    """

    kind = "optimizer"  # beside emulator/nvm.py's plain NVM namespaces

    directory: _OnCore[Path] = _OnCore("directory")
    nsid: _OnCore[int] = _OnCore("nsid")
    spec: _OnCore[NamespaceSpec] = _OnCore("spec")
    name: _OnCore[str] = _OnCore("name")
    sync_commits: _OnCore[bool] = _OnCore("sync_commits")
    layouts: _OnCore[list[TensorLayout]] = _OnCore("layouts")
    tensors: _OnCore[dict[str, TensorLayout]] = _OnCore("tensors")
    total_blocks: _OnCore[int] = _OnCore("total_blocks")
    counters: _OnCore[NamespaceCounters] = _OnCore("counters")
    timing: _OnCore[NamespaceTiming] = _OnCore("timing")
    workers: _OnCore[KernelWorkers] = _OnCore("workers")
    recovery_errors: _OnCore[list[tuple[str, int, int]]] = _OnCore("recovery_errors")
    media_error_sink: _OnCore[Callable[[], None] | None] = _OnCore("media_error_sink")
    recovery_error_sink: _OnCore[Callable[[tuple[str, int, int]], None] | None] = _OnCore("recovery_error_sink")
    changed_ns: _OnCore[int] = _OnCore("changed_ns")
    config_changed_ns: _OnCore[int] = _OnCore("config_changed_ns")

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
        self.core = NamespaceCore(directory, nsid, spec, copies, slots, superblock, sync, layouts)
        self.media = NamespaceMedia(self.core)
        self.verifier = CopyVerifier(self.core, self.media)
        self.shared_record = SharedStepRecord()
        self.steps = StepEngine(self.core, self.media, self.verifier, self.shared_record)
        self.shared = SharedSteps(self.core, self.steps, self.shared_record)
        self.reads = Reads(self.core, self.media, self.verifier)
        self.writes = GradientWrites(self.core, self.media, self.steps, self.shared_record)
        self.snapshots = SnapshotStore(self)
        # Media errors of whole copies found at open (re-created as the shadow), for the
        # device's error log and SMART figures.
        self.damaged_copies: list[str] = []

    # ------------------------------------------------------------------ creating and opening

    @classmethod
    def create(cls, directory: Path, nsid: int, spec: NamespaceSpec, sync: bool) -> Self:
        """Lay out and preallocate a namespace at step 0, ready for initial weights."""
        return cls._from_files(directory, create_files(directory, nsid, spec), sync)

    @classmethod
    def open(cls, directory: Path, sync: bool, verify: str = VERIFY_OPEN, *, durable: bool = False) -> Self:
        """Open an existing namespace, recovering to the newest valid committed step.

        `durable`: the device was closed cleanly last time (every namespace flushed), so
        nothing of this namespace can sit in the page cache only, and recovery need not
        fsync its files (see open.recover).

        `verify` (namespace.verify.VERIFY_MODES): VERIFY_OPEN checks every block of the step
        before this returns; VERIFY_BACKGROUND serves the newest step at once where its
        superblock has param checksums, checking each param block as first served and the
        whole copy in a thread (a failure then stops the namespace; see CopyVerifier).

        A damaged state copy is a media error of that copy alone (open.open_files).
        """
        files = open_files(directory)
        try:
            namespace = cls._from_files(directory, files, sync)
            namespace.damaged_copies = list(files.damaged)
            namespace.counters.checksum_failures += len(files.damaged)
            recover(namespace.core, namespace.media, namespace.verifier, files.candidates, verify,
                    durable=durable and not files.damaged)
        except BaseException:
            files.close()
            raise
        return namespace

    @classmethod
    def _from_files(cls, directory: Path, files: NamespaceFiles, sync: bool) -> Self:
        return cls(directory, files.nsid, files.spec, files.copies, files.slots, files.candidates[0], sync,
                   files.layouts)

    def close(self) -> None:
        """Flush the committed step and release the media. An open step is abandoned."""
        core = self.core
        try:
            self.verifier.stop()
            with core.cond:
                # Blocks still updating the shadow copy must finish before its file closes.
                while core.tx is not None and core.tx.inflight:
                    core.cond.wait()
            self.flush()
        finally:
            core.drop_views()
            self.writes.close()
            core.held_loads.forget(core.name)
            for state in core.copies:
                state.close()
            for slot in core.slots:
                slot.close()
            core.own_workers.shutdown()

    # ------------------------------------------------------------------ steps (steps.py, shared.py)

    @modeled_command("begin_step")
    def begin_step(self, step: int | None = None, grad_scale: float = 1.0,
                   grad_scales: dict[str, Any] | None = None) -> int:
        """Open step `step` (default: the next one) with a combined gradient scale, and for an
        FP8 namespace each tensor's or slice's FP8 scale (its codes are the gradient times it);
        naming the open step, add scales to it (StepEngine.begin_step)."""
        return self.steps.begin_step(step, grad_scale, grad_scales)

    def begin_implicit_step(self, grad_scale: float) -> int:
        """Open an implicit step with a gradient scale: it commits once its gradients are
        complete (StepEngine.begin_implicit_step). Part of the command whose gradients it
        takes, as the implicit step a write opens: no host command of its own to model."""
        return self.steps.begin_implicit_step(grad_scale)

    @modeled_command("commit_step")
    def commit_step(self) -> CommitResult:
        """Commit the open step once all its gradient blocks are in (or skip it)."""
        return self.steps.commit_step()

    def abort_step(self) -> int:
        """Drop the open step; the committed state is untouched. Returns its number."""
        return self.steps.abort_step()

    def revert_step(self, step: int) -> dict[str, Any]:
        """REVERT_STEP: make step - 1 the committed step again (StepEngine.revert_step)."""
        return self.steps.revert_step(step)

    def set_hyperparameters(self, group: int | None = None, **changes: Any) -> Hyperparameters:
        """Change hyperparameters for the next step (StepEngine.set_hyperparameters)."""
        return self.steps.set_hyperparameters(group, **changes)

    def pinned_committed(self) -> contextlib.AbstractContextManager[tuple[Superblock, StateFile]]:
        """The committed superblock and its copy, held still (StepEngine.pinned_committed)."""
        return self.steps.pinned_committed()

    def restore_committed(self, source: Superblock, fill: Callable[[StateFile], None]) -> int:
        """Make a snapshot's state the committed one (StepEngine.restore_committed)."""
        return self.steps.restore_committed(source, fill)

    @modeled_command("begin_step")  # each rank's begin, a host command as a single client's is
    def begin_shared_step(self, step: int, grad_scale: float, job: int, seq: int, ranks: int, rank: int,
                          groups: list[dict[str, Any]] | None, grad_scales: Any = None) -> dict[str, Any]:
        """Open or join step `step` of job `job` (SharedSteps.begin_shared_step); grad_scales:
        this rank's FP8 slices' scales."""
        return self.shared.begin_shared_step(step, grad_scale, job, seq, ranks, rank, groups, grad_scales)

    @modeled_command("commit_step")  # each poll is a host command; the commit's work is in the one that commits
    def commit_shared_step(self, step: int, job: int, seq: int, rank: int) -> CommitResult | str:
        """Commit step `step` of job `job` once complete (SharedSteps.commit_shared_step)."""
        return self.shared.commit_shared_step(step, job, seq, rank)

    def abort_shared_step(self, step: int, job: int, seq: int, rank: int, reason: str) -> int:
        """Abort step `step` of job `job` (SharedSteps.abort_shared_step)."""
        return self.shared.abort_shared_step(step, job, seq, rank, reason)

    def shared_state(self) -> dict[str, Any] | None:
        """The open shared step as statistics() shows it."""
        return self.shared.shared_state()

    # ------------------------------------------------------------------ reads and writes (reads.py, writes.py)

    @modeled_command("read")
    def read(self, tensor_name: str, role: str, offset: int, size: int) -> bytes:
        """Bytes of a committed state array (param, master or a moment)."""
        return self.reads.read(tensor_name, role, offset, size)

    def read_nowait(self, tensor_name: str, role: str, offset: int, size: int) -> memoryview | None:
        """read() without the copy and without blocking (Reads.read_nowait)."""
        return self.reads.read_nowait(tensor_name, role, offset, size)

    def read_pinned(self, tensor_name: str, role: str, offset: int,
                    size: int) -> contextlib.AbstractContextManager[bytes | memoryview]:
        """read() without the copy, the committed copy pinned meanwhile (Reads.read_pinned)."""
        return self.reads.read_pinned(tensor_name, role, offset, size)

    def read_pinned_many(self, reads: Sequence[tuple[str, str, int, int]]
                         ) -> contextlib.AbstractContextManager[list[bytes | memoryview]]:
        """read_pinned of several ranges under one pin (Reads.read_pinned_many)."""
        return self.reads.read_pinned_many(reads)

    def check_read(self, tensor_name: str, role: str, offset: int, length: int) -> None:
        """Refuse, changing nothing, a read not wholly inside a readable file."""
        self.reads.check_read(tensor_name, role, offset, length)

    def check_write(self, tensor_name: str, role: str, offset: int, length: int,
                    data: bytes | memoryview | None = None,
                    pending: set[tuple[str, str, int]] | None = None) -> None:
        """Refuse, changing nothing, a write that write_state would refuse (with `data`, its
        values too; with `pending`, one set per batch, the held scale blocks of the batch's
        writes before it counted too)."""
        self.reads.check_write(tensor_name, role, offset, length, data, pending)

    @modeled_command("write_state")
    def write_state(self, tensor_name: str, role: str, offset: int, data: bytes | memoryview) -> int:
        """Load initial master weights or moments (only before the first step)."""
        return self.writes.write_state(tensor_name, role, offset, data)

    @modeled_command("write_grad")
    def write_grad(self, tensor_name: str, offset: int, data: bytes | memoryview) -> int:
        """Take gradient bytes of the open step (GradientWrites.write_grad)."""
        return self.writes.write_grad(tensor_name, offset, data)

    def write_grad_nowait(self, tensor_name: str, offset: int,
                          data: bytes | memoryview) -> tuple[int, StepTransaction | None] | None:
        """write_grad's part that never blocks (GradientWrites.write_grad_nowait)."""
        return self.writes.write_grad_nowait(tensor_name, offset, data)

    def check_grads_lent(self, pieces: GradPieces) -> None:
        """Refuse, changing nothing, what write_grads_lent would refuse before taking a byte."""
        self.writes.check_grads_lent(pieces)

    def write_grads_lent(self, pieces: GradPieces) -> CommitResult | None:
        """Take gradient pieces from lent memory (GradientWrites.write_grads_lent)."""
        return self.writes.write_grads_lent(pieces)

    def finish_implicit_step(self, tx: StepTransaction) -> CommitResult | None:
        """Commit (or skip) implicit step `tx` once its blocks are done."""
        return self.writes.finish_implicit_step(tx)

    @property
    def max_queued_blocks(self) -> int:
        """Blocks of written gradient bytes queued for the kernels at most."""
        return self.writes.max_queued_blocks

    @max_queued_blocks.setter
    def max_queued_blocks(self, value: int) -> None:
        self.writes.max_queued_blocks = value

    # ------------------------------------------------------------------ media and verification

    @modeled_command("flush")
    def flush(self) -> int:
        """Make the committed step durable; returns the durable step."""
        return self.media.flush()

    @property
    def flush_pending(self) -> bool:
        return self.media.flush_pending

    @property
    def media_failure(self) -> str | None:
        """Why the namespace stopped (a failed fsync, a damaged state copy), or None."""
        return self.media.failure

    def scrub(self) -> list[tuple[str, int]]:
        """Verify every block checksum of the committed copy; returns the bad blocks."""
        return self.verifier.scrub_blocks()[1]

    def scrub_blocks(self) -> tuple[int, list[tuple[str, int]]]:
        """(blocks verified, bad blocks) of the committed copy."""
        return self.verifier.scrub_blocks()

    def corrupt_block(self, tensor_name: str, block: int) -> dict[str, Any]:
        """Fault injection (INJECT_ERROR): one byte of a block changed on the media."""
        return self.verifier.corrupt_block(tensor_name, block)

    def wait_verified(self, timeout: float | None = None) -> bool:
        """Block until the background verification is over; False on timeout."""
        return self.verifier.wait_verified(timeout)

    @property
    def verifying(self) -> bool:
        """Whether the committed copy is still verified in the background."""
        return self.verifier.verifying

    @property
    def verified_in_s(self) -> float | None:
        """Seconds the background verification took, once it is over."""
        return self.verifier.verified_in_s

    def verification_state(self) -> dict[str, Any]:
        return self.verifier.verification_state()

    # ------------------------------------------------------------------ the layout

    def itemsize(self, role: str) -> int:
        """Bytes of one element of a tensor file: block-scaled moments read (and load) as FP32."""
        return self.core.itemsize(role)

    def role_dtype(self, role: str) -> np.dtype[Any]:
        """The dtype of a role's array on the media."""
        return self.core.role_dtype(role)

    @property
    def block_roles(self) -> tuple[str, ...]:
        """The arrays a block checksum covers, in checksum order."""
        return self.core.block_roles

    @property
    def state_format(self) -> Any:
        """The moments' format on the media (spec.STATE_FORMATS)."""
        return self.core.state_format

    def file_size(self, tensor_name: str, role: str) -> int:
        return self.core.file_bytes(self.core.tensor(tensor_name), role)

    @property
    def roles(self) -> tuple[str, ...]:
        """A tensor's files: ROLES, and param_fp8 where the namespace sends FP8 params."""
        return ROLES + ((param_fp8.ROLE,) if self.reads.param_fp8 is not None else ())

    @property
    def param_wire_dtype(self) -> str | None:
        """The FP8 format of the param_fp8 files, or None where there are none."""
        return self.core.spec.param_wire_dtype

    def fill_param_fp8_places(self, places: list[tuple[str, np.ndarray]]) -> None:
        """After a CMB_WRITE of whole gradients: each tensor's FP8 params (param_fp8 bytes) into
        its place in the CMB (ParamFp8.fill_step_places says which step's)."""
        assert self.reads.param_fp8 is not None
        with self.core.lock:
            self.reads.param_fp8.fill_step_places([(self.core.tensor(name), place) for name, place in places])

    # ------------------------------------------------------------------ properties

    @property
    def committed_step(self) -> int:
        return self.core.sb.committed_step

    @property
    def durable_step(self) -> int:
        return self.media.durable_step

    @property
    def loading(self) -> bool:
        return self.core.loading

    @property
    def hyper(self) -> Hyperparameters:
        """Group 0's hyperparameters (a namespace's only group unless it has several)."""
        return self.core.hypers[0]

    @property
    def hypers(self) -> tuple[Hyperparameters, ...]:
        return tuple(self.core.hypers)

    @property
    def step_open(self) -> int | None:
        tx = self.core.tx
        return None if tx is None else tx.step

    @property
    def seq(self) -> int:
        """The superblock sequence: moves at every commit, rollback and seal."""
        return self.core.sb.seq

    def config(self) -> dict[str, Any]:
        """The namespace's description as config.json shows it."""
        core = self.core
        hypers = core.hypers
        return {
            "name": core.name,
            "nsid": core.nsid,
            "hyperparameters": dataclasses.asdict(hypers[0]),
            "groups": [dataclasses.asdict(h) for h in hypers],
            "grad_dtype": core.spec.grad_dtype,
            "param_dtype": core.spec.param_dtype,
            "state_dtype": core.spec.state_dtype,
            "durability": "sync" if core.sync_commits else "plp",
            # Elements per gradient block: a client splitting the gradients among several
            # writers (the ranks of a sharded job) splits at these boundaries, so each block
            # arrives whole from one writer.
            "block_elems": BLOCK_ELEMS,
            "tensors": [
                # shape: the model's, as recorded at creation; null where none was (then the
                # export writes the tensor flat).
                {"name": t.name, "numel": t.numel, "group": core.group_of[t.name],
                 "shape": _shape_list(core.shape_of[t.name])}
                for t in core.layouts
            ],
        } | ({"param_wire_dtype": core.spec.param_wire_dtype} if core.spec.param_wire_dtype else {})

    @property
    def allocated_bytes(self) -> int:
        """Device capacity the namespace takes: both state copies and its snapshots."""
        return 2 * self.core.copies[0].size_bytes + self.snapshots.bytes_used

    def statistics(self) -> dict[str, Any]:
        # Lock-free on purpose: the fs layer reads it on its event loop, and the lock may be
        # held across an fsync. Counters are plain ints; a torn view is off by one at most.
        core = self.core
        counters = dataclasses.asdict(core.counters)
        skips = core.skips()
        return counters | {
            "name": core.name,
            "nsid": core.nsid,
            "steps_skipped": skips.steps_skipped,
            "committed_step": core.sb.committed_step,
            "durable_step": self.media.durable_step,
            "last_skipped_step": skips.last_skipped_step,
            "step_open": self.step_open,
            "shared_step": self.shared_state(),
            "loading": self.loading,
            "tensors": len(core.layouts),
            "parameters": sum(t.numel for t in core.layouts),
            "state_bytes_per_copy": core.copies[0].size_bytes,
            # How new state reaches the shadow copy here (media.write_mode_for).
            "state_writes": core.copies[0].write_mode,
            # The superblock sequence: moves at every commit, rollback and seal (trainer's
            # load_state_dict tells its own state from an older one of the same step by it).
            "seq": core.sb.seq,
            "verification": self.verification_state(),
            "model": core.timing.snapshot(),
        } | ({} if self.reads.param_fp8 is None else {
            # FP8 params out: values beyond the format (saturated) and nonzero masters whose
            # code is zero, over the steps encoded since the namespace was opened.
            "param_fp8_overflows": self.reads.param_fp8.overflows,
            "param_fp8_underflows": self.reads.param_fp8.underflows})

    def state_counter_figures(self) -> dict[str, Any]:
        """The block-scaled moments' counters (emulator/state_counters.py), for log page C6h."""
        return self.core.state_counters.figures()

    # ------------------------------------------------------------------ reached from outside the parts
    # Tests, the computational programs and the snapshot export look at these internals by
    # their old names; each is the core's or a part's own.

    @property
    def _sb(self) -> Superblock:
        return self.core.sb

    @property
    def _tx(self) -> StepTransaction | None:
        return self.core.tx

    @property
    def _lock(self) -> Any:
        return self.core.lock

    @property
    def _cond(self) -> Any:
        return self.core.cond

    @property
    def _copies(self) -> tuple[StateFile, StateFile]:
        return self.core.copies

    @property
    def _slots(self) -> tuple[SlotFile, SlotFile]:
        return self.core.slots

    @property
    def _state_format(self) -> Any:
        return self.core.state_format

    @property
    def _verify_thread(self) -> Any:
        return self.verifier._verify_thread

    def _view(self, copy: Copy, tensor: TensorLayout, role: str) -> np.ndarray:
        return self.core.view(copy, tensor, role)

    def _role_dtype(self, role: str) -> np.dtype[Any]:
        return self.core.role_dtype(role)

    _region_offset = staticmethod(region_offset)

    def _tensor(self, name: str) -> TensorLayout:
        return self.core.tensor(name)

    def _check_range(self, tensor: TensorLayout, role: str, offset: int, length: int) -> None:
        self.core.check_range(tensor, role, offset, length)

    def _verify_copy(self, superblock: Superblock) -> list[tuple[str, int]]:
        return self.verifier.verify_copy(superblock)

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

    def as_plain_nvm(self) -> None:
        """None: this kind has no LBA-addressed data file."""
        return None

    def as_compute(self) -> None:
        """None: this kind runs the optimizer's step, not the compute command set's programs."""
        return None

    def as_memory(self) -> None:
        """None: this kind's state is media, not memory (SLM)."""
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


def _shape_list(shape: Any) -> list[int] | None:
    """A tensor's recorded shape as config.json lists it, or None where none was recorded."""
    return None if shape is None else list(shape)


def _tensor_named(tensor: str | None) -> str:
    """The tensor a file of an optimizer namespace belongs to (every one has one)."""
    if tensor is None:
        raise DeviceError(Status.INVALID_FIELD, "a file of an optimizer namespace is a tensor's")
    return tensor
