"""The state every part of an optimizer namespace shares: its spec and layout, the A/B state copies and superblock slots, the lock, the open step, counters and timing."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...protocol.status import DeviceError, Status
from ..accounting import NamespaceTiming
from ..layout import Copy, SuperblockFlags, TensorLayout, region_offset, scale_count
from ..media import SlotFile, StateFile
from ..spec import GRAD_FORMATS, HALF_FORMATS, STATE_FORMATS, Hyperparameters, NamespaceSpec
from ..state_counters import StateCounters
from ..superblock import SkipCounts, Superblock
from ..transaction import StepTransaction
from ..workers import KernelWorkers
from .held_loads import HeldLoads
from .common import BLOCK_ROLES, MOMENT_ROLES, SCALE_ROLES, SCALED_BLOCK_ROLES, NamespaceCounters, hypers_of
from ...protocol import param_fp8


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


class NamespaceCore:
    """What the parts of one namespace (media.py, verify.py, steps.py, shared.py, reads.py,
    writes.py) all read or change, made once by Namespace and handed to each part.

    The lock (and `cond` over it) guards `sb`, `hypers`, `tx` and `pins`; the counters are
    plain ints that statistics() reads without it. State that one part alone uses lives in
    that part.
    """

    def __init__(self, directory: Path, nsid: int, spec: NamespaceSpec, copies: tuple[StateFile, StateFile],
                 slots: tuple[SlotFile, SlotFile], superblock: Superblock, sync: bool,
                 layouts: list[TensorLayout]) -> None:
        self.directory = directory
        self.nsid = nsid
        self.spec = spec
        self.name: str = spec.name
        self.sync_commits = sync  # fsync at every commit ("sync"), or only at flushes ("plp")
        self.copies = copies
        self.slots = slots
        # The superblock in force: the committed step, its copy, checksums and hyperparameters.
        self.sb = superblock
        # The groups' hyperparameters for the next step (recorded with its commit).
        self.hypers: list[Hyperparameters] = hypers_of(superblock)
        self.group_of = {t.name: t.group for t in spec.tensors}
        self.shape_of = {t.name: t.shape for t in spec.tensors}
        self.layouts = layouts
        self.tensors = {t.name: t for t in layouts}
        self.total_blocks = sum(t.block_count for t in layouts)
        # The wire and media formats (spec.GRAD_FORMATS, HALF_FORMATS, STATE_FORMATS; role_dtype
        # and itemsize below give each file's element).
        self.grad_format = GRAD_FORMATS[spec.grad_dtype]
        # The dtype a gradient element is viewed as: 16-bit bits, FP32 itself, FP8 codes.
        self.grad_dtype = np.dtype({2: np.uint16, 4: np.float32, 1: np.uint8}[spec.grad_itemsize])
        self.param_format = HALF_FORMATS[spec.param_dtype]
        self.state_format = STATE_FORMATS[spec.state_dtype]
        # The dtype of one moment code on the media: FP32 itself, BF16 and FP16 bits, INT8 codes.
        self.state_dtype = np.dtype({"fp32": np.float32, "bf16": np.uint16, "fp16": np.uint16,
                                     "int8": np.uint8}[spec.state_dtype])
        # Block-scaled moments (fp16, int8): a float32 scale per 256 elements beside each
        # moment's codes, in the block checksum (common.SCALED_BLOCK_ROLES); the mount tree's
        # moment files read them decoded to FP32.
        self.scaled = spec.scaled_state
        self.block_roles = SCALED_BLOCK_ROLES if self.scaled else BLOCK_ROLES
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.tx: StepTransaction | None = None  # the open step
        # Readers of each copy right now (snapshots copying the committed copy, replies
        # written from it: pinned_committed, read_pinned). A copy changes only once it is the
        # shadow and a step (or a rollback's fill) writes into it, so those wait for its pins,
        # not the commit: a commit flips while a snapshot still copies the step before, and
        # the begin after it waits (new pins always go to the committed copy, never to the
        # shadow a begin waits on, so readers cannot hold a begin off for ever).
        self.pins = {Copy.A: 0, Copy.B: 0}
        self.counters = NamespaceCounters(
            steps_committed=superblock.steps_committed, steps_skipped=superblock.steps_skipped
        )
        # The block-scaled moments' underflows, overflows and scales (emulator/state_counters.py).
        self.state_counters = StateCounters()
        # Modeled device time (model/timing.py); the device swaps in its own profile.
        self.timing = NamespaceTiming()
        # The threads that step its blocks: a pool of its own, started on first use, until the
        # device that opens it attaches the device's (Device._attach).
        self.own_workers = KernelWorkers()
        self.workers = self.own_workers
        self._views: dict[tuple[Copy, str, str], np.ndarray] = {}
        # Blocks (tensor, block in tensor, block in namespace) that failed their checksum in
        # a copy recovery fell back from, or the background pass found; the device puts them
        # in its error log.
        self.recovery_errors: list[tuple[str, int, int]] = []
        # The device's error log, where it attached one (Device._attach_error_log): a damaged
        # copy, and each bad block found after the open.
        self.media_error_sink: Callable[[], None] | None = None
        self.recovery_error_sink: Callable[[tuple[str, int, int]], None] | None = None
        # The skip counters' side record, read on first use (skips()).
        self.recorded_skips: SkipCounts | None = None
        # Wall-clock times (ns) the mount shows as mtime/ctime: of the last change to the
        # committed state (a commit, a rollback, the seal, an initial-state write) and of the
        # hyperparameters, so rsync, backups and `find -newer` see each step. After a
        # restart the backing files' own times stand in (never older than the change).
        self.changed_ns = _backing_mtime_ns(directory)
        self.config_changed_ns = self.changed_ns
        # Parts of block-scaled moments' scale blocks loaded so far, held until each block is
        # whole (held_loads.py); the first step's begin refuses to seal while any is held.
        self.held_loads = HeldLoads(directory=directory, numel_of=self._numel_of)

    # ------------------------------------------------------------------ the state's arrays

    def view(self, copy: Copy, tensor: TensorLayout, role: str) -> np.ndarray:
        """A role's array of one tensor in `copy`, a view of its mapping (made once)."""
        key = (copy, tensor.name, role)
        view = self._views.get(key)
        if view is None:
            count = scale_count(tensor.numel) if role in SCALE_ROLES else tensor.numel
            view = self.copies[copy].view(region_offset(tensor, role), count, self.role_dtype(role))
            self._views[key] = view
        return view

    def drop_views(self) -> None:
        """Forget the views (the copies are about to close)."""
        self._views.clear()

    def role_dtype(self, role: str) -> np.dtype[Any]:
        """The dtype of a role's array on the media (see itemsize for the files' elements)."""
        if role == "master" or role in SCALE_ROLES:
            return np.dtype(np.float32)
        if role == "param":
            return np.dtype(np.uint16)
        return self.state_dtype

    def itemsize(self, role: str) -> int:
        """Bytes of one element of a tensor file: block-scaled moments read (and load) as FP32."""
        if role == "grad":
            return self.grad_dtype.itemsize
        if self.scaled and role in MOMENT_ROLES:
            return 4
        return self.role_dtype(role).itemsize

    def file_bytes(self, tensor: TensorLayout, role: str) -> int:
        """Bytes of one of a tensor's files: its elements times itemsize(role); a param_fp8
        file is its 16-byte header and a byte an element (namespace/param_fp8.py), and exists
        only where the namespace sends FP8 params (INVALID_FIELD elsewhere)."""
        if role == param_fp8.ROLE:
            if self.spec.param_wire_dtype is None:
                raise DeviceError(Status.INVALID_FIELD, f"namespace {self.name!r} has no {param_fp8.ROLE} files "
                                  "(create it with param_wire_dtype fp8_e4m3 or fp8_e5m2)")
            return param_fp8.out_bytes(tensor.numel)
        return tensor.numel * self.itemsize(role)

    def _numel_of(self, name: str) -> int | None:
        tensor = self.tensors.get(name)
        return None if tensor is None else tensor.numel

    def tensor(self, name: str) -> TensorLayout:
        """The tensor named `name`; INVALID_NAMESPACE where there is none."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise DeviceError(
                Status.INVALID_NAMESPACE, f"namespace {self.name!r} has no tensor {name!r}"
            )
        return tensor

    # ------------------------------------------------------------------ shared bookkeeping

    @property
    def loading(self) -> bool:
        """Whether initial state may still be written (no step has sealed it)."""
        return bool(self.sb.flags & SuperblockFlags.LOADING)

    def unpin(self, copy: Copy) -> None:
        """Release one pin of `copy`; a begin waiting to write into it may go on."""
        with self.cond:
            self.pins[copy] -= 1
            self.cond.notify_all()

    def skips(self) -> SkipCounts:
        """The skip counters: the newer of the superblock's (as of the last commit) and the
        side record's (as of the last skip), the record read once per open."""
        recorded = self.recorded_skips
        if recorded is None:
            recorded = self.recorded_skips = SkipCounts.load(self.directory)
        return max(SkipCounts.of(self.sb), recorded)

    # ------------------------------------------------------------------ range checks

    def check_range(self, tensor: TensorLayout, role: str, offset: int, length: int) -> None:
        """Refuse a transfer of a role's file that is not element-aligned or passes its end."""
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

    def check_scaled_load(self, tensor: TensorLayout, role: str, offset: int, length: int,
                          pending: set[tuple[str, str, int]] | None = None) -> None:
        """Refuse (MISALIGNED_ACCESS) a load of block-scaled moments that would leave more
        scale blocks loaded only in part than held_loads holds. A range of whole elements
        may cover parts of scale blocks: those parts are held until the rest of each block
        is written (held_loads.HeldLoads), and the first step refuses to start before."""
        if not (self.scaled and role in MOMENT_ROLES) or length <= 0:
            return
        first = offset // 4
        _, parts = self.held_loads.split(tensor.numel, first, first + length // 4)
        self.held_loads.check_room(tensor.name, role, parts, pending)
