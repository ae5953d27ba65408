"""Writes into an optimizer namespace: initial state while loading, gradients staged into blocks that the device's kernel workers step."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Sequence

import numpy as np

from ... import kernels
from ...kernels.state_formats import StateCounts
from ...protocol.status import DeviceError, Status
from ..layout import BLOCK_ELEMS, SCALE_BLOCK, Copy, TensorLayout, region_offset
from .common import BLOCK_ROLES, LOADABLE_ROLES, MOMENT_ROLES, CommitResult, WouldBlock, block_slice
from ..transaction import ReadyBlock, StepTransaction, first_overlap
from .held_loads import check_values
from .media import NamespaceMedia
from .outcomes import SharedStepRecord
from .state import NamespaceCore
from .steps import StepEngine

log = logging.getLogger("cossd.emulator.namespace")

# write_grads_lent stages lent gradients in pieces of this many elements (16 blocks, 4 MiB of
# FP16): each piece is one pass of the lock and of the step's bookkeeping.
_LENT_STAGE_ELEMS = 16 * BLOCK_ELEMS
# Bytes of one param element handed back (FP16/BF16), whatever the gradients' format.
_PARAM_ITEMSIZE = 2
# The most blocks of a step queued for the kernel workers at once from written (not lent)
# gradient bytes, each holding its copy of the request's bytes (512 KiB of FP16/BF16): a writer
# faster than the kernels (a disk-bound step) waits here instead of the daemon's memory growing
# with the step's gradients (docs/benchmarks.md, "Scale"). 64 blocks: 32 MiB.
MAX_QUEUED_BLOCKS = 64

# The most ready blocks of one request a kernel worker takes as one task: a task's Python
# (the hand-off to the worker, the lock, the step's bookkeeping) is paid once for them. Two:
# a step's last task then leaves the other worker idle for one block at most, and a 1 MiB
# write of FP16 gradients (two blocks) is one task.
_BLOCKS_PER_TASK = 2

# Gradients lent to write_grads_lent: (tensor, byte offset in its grad file, the bytes, where
# the new params go or None).
GradPieces = Sequence[tuple[str, int, bytes | memoryview | np.ndarray, np.ndarray | None]]


@dataclasses.dataclass(frozen=True, slots=True)
class _BlockOutcome:
    """What a block's update leaves for the step to record (StepTransaction.finish)."""

    block: ReadyBlock
    crc: int
    param_crc: int
    nonfinite: int
    written: int  # media bytes the update wrote (a discarded non-finite block's too); 0 where it did not run
    elapsed_ns: int


def _immutable(data: bytes | memoryview | np.ndarray) -> bool:
    """Whether `data` can never change: bytes, or a view of bytes."""
    return isinstance(data, bytes) or (isinstance(data, memoryview) and isinstance(data.obj, bytes))


class GradientWrites:
    """Initial-state loading and the gradient path: staging, the blocks' kernels on the device's workers.

    Owns the gradient path's buffers: each worker thread's staging for one block, the kernel
    calls prepared per (copy, tensor), and the bound on blocks queued for the kernels.
    """

    def __init__(self, core: NamespaceCore, media: NamespaceMedia, steps: StepEngine,
                 shared_record: SharedStepRecord) -> None:
        self.core = core
        self.media = media
        self.steps = steps
        self.shared_record = shared_record
        # Blocks of written gradient bytes queued for the kernels at most (MAX_QUEUED_BLOCKS).
        self.max_queued_blocks = MAX_QUEUED_BLOCKS
        # Per (source copy, tensor): the kernel call that steps its blocks into the other copy.
        self._block_updates: dict[tuple[Copy, str], kernels.BlockUpdate] = {}
        self._thread_local = threading.local()  # each worker's staging buffers (_staging)
        # Media bytes a stepped element writes (master, moments, param), counted per block.
        self._bytes_per_stepped_elem = sum(core.role_dtype(role).itemsize for role in BLOCK_ROLES)

    def close(self) -> None:
        """Drop the kernel calls that hold views of the copies (they are about to close)."""
        self._block_updates.clear()

    def _staging(self, count: int) -> dict[str, np.ndarray]:
        """Per-thread buffers for one block, allocated once per worker thread: the outputs
        (the block roles) and "grad", where a lent gradient is copied before it is counted
        and stepped."""
        buffers: dict[str, np.ndarray] | None = getattr(self._thread_local, "buffers", None)
        if buffers is None:
            buffers = {role: np.empty(block_slice(role, 0, BLOCK_ELEMS).stop, dtype=self.core.role_dtype(role))
                       for role in self.core.block_roles}
            buffers["grad"] = np.empty(BLOCK_ELEMS, dtype=self.core.grad_dtype)
            self._thread_local.buffers = buffers
        return {role: array[block_slice(role, 0, count)] for role, array in buffers.items()}

    def write_state(self, tensor_name: str, role: str, offset: int, data: bytes | memoryview) -> int:
        """Load initial master weights or moments (only before the first step). Refused,
        changing nothing: values no step can start from (held_loads.check_values:
        INVALID_FIELD), a range check_range refuses. A block-scaled moment's request that
        covers only part of a scale block has that part held until the rest arrives
        (held_loads.HeldLoads)."""
        tensor = self.core.tensor(tensor_name)
        if role not in LOADABLE_ROLES:
            raise DeviceError(Status.ACCESS_DENIED, f"{role} is not writable")
        length = len(data)
        self.core.check_range(tensor, role, offset, length)
        if length == 0:
            return 0
        itemsize = self.core.itemsize(role)
        first = offset // itemsize
        scaled = self.core.scaled and role in MOMENT_ROLES
        # What the request holds: FP32 (masters, fp32 moments, the FP32 loads of block-scaled
        # ones) or BF16 bits; checked before the lock, nothing changed yet.
        # A copy where the bytes could still change (a view of the CMB): what is checked is
        # what is written.
        source = np.frombuffer(data if _immutable(data) else bytes(data),
                               dtype=np.float32 if scaled else self.core.role_dtype(role))
        check_values(tensor.name, role, first, source)
        with self.core.lock:
            self.media.check()
            if not self.core.loading:
                raise DeviceError(
                    Status.STATE_SEALED,
                    f"{tensor.name}/{role} can only be written before the first step "
                    f"(namespace is at step {self.core.sb.committed_step})",
                )
            if scaled:
                media_bytes = self._load_scaled_moment(tensor, role, first, source)
            else:
                view = self.core.view(self.core.sb.committed_copy, tensor, role)
                view[first : first + len(source)] = source
                media_bytes = length
            if role == "master":
                kernels.master_to_param(
                    view[first : first + length // 4],
                    self.core.view(self.core.sb.committed_copy, tensor, "param")[first : first + length // 4],
                    self.core.param_format,
                )
                media_bytes += length // 2  # the param bytes derived from the master
            self.core.counters.state_bytes_loaded += length
            if media_bytes:
                self.core.changed_ns = time.time_ns()
            self.core.counters.write_commands += 1
            self.core.counters.media_bytes_written += media_bytes
            self.core.timing.add(host_in=length, media_write=media_bytes)
        return length

    def _load_scaled_moment(self, tensor: TensorLayout, role: str, first: int, values: np.ndarray) -> int:
        """Encode FP32 moments written while loading into a block-scaled moment's codes and
        scales, exactly as a step encodes (kernels.encode_state). A scale covers 256 elements:
        whole scale blocks are encoded at once, the parts of blocks at the request's ends are
        held (core.held_loads) until the rest of their block arrives, then encoded. Under the
        lock; returns the media bytes written."""
        held = self.core.held_loads
        stop = first + len(values)
        (lo, hi), parts = held.split(tensor.numel, first, stop)
        held.reserve(tensor.name, role, parts)  # the one refusal: before anything changes
        media_bytes = self._encode_moment(tensor, role, lo, values[lo - first : hi - first])
        if hi > lo:  # a later whole block replaces what was held of it
            held.drop(tensor.name, role, lo // SCALE_BLOCK, -(-hi // SCALE_BLOCK))
        for block, start, end in parts:
            whole = held.add(tensor.name, role, tensor.numel, block, start, values[start - first : end - first])
            if whole is not None:
                media_bytes += self._encode_moment(tensor, role, block * SCALE_BLOCK, whole)
                held.finished(tensor.name, role, block)
        return media_bytes

    def _encode_moment(self, tensor: TensorLayout, role: str, first: int, values: np.ndarray) -> int:
        """Encode whole scale blocks of FP32 moments from element `first` (a block's first, the
        last block ending at the tensor's end) into the committed copy's codes and scales."""
        if not len(values):
            return 0
        stop = first + len(values)
        copy = self.core.sb.committed_copy
        codes = self.core.view(copy, tensor, role)[first:stop]
        scales = self.core.view(copy, tensor, role + "_scale")[block_slice(role + "_scale", first, stop)]
        kernels.encode_state(values, codes, scales, state_format=self.core.state_format,
                             moment=kernels.Moment.EXP_AVG if role == "exp_avg" else kernels.Moment.EXP_AVG_SQ)
        return codes.nbytes + scales.nbytes

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
        if self.core.timing.timed:
            return None
        try:
            with self.core.timing.command("write_grad"):
                return self._stage_grad(tensor_name, offset, data, wait=False)
        except WouldBlock:
            return None

    def check_grads_lent(self, pieces: GradPieces) -> None:
        """Refuse, changing nothing, pieces that write_grads_lent would refuse before taking
        any: a range outside its tensor, a param copy of the wrong size, bytes named twice in
        the batch or already received by the open step. Execute Program checks them before it
        opens a step (a begin seals a loading namespace, which no abort undoes)."""
        spans: dict[str, list[tuple[int, int]]] = {}
        grad_size = self.core.itemsize("grad")
        for tensor_name, offset, data, param_copy in pieces:
            self.core.check_range(self.core.tensor(tensor_name), "grad", offset, len(data))
            if param_copy is not None and len(param_copy) != len(data) // grad_size * _PARAM_ITEMSIZE:
                raise DeviceError(Status.INVALID_FIELD,
                                  f"{tensor_name}: a param copy of {len(param_copy)} bytes for {len(data)} of "
                                  f"{self.core.spec.grad_dtype} gradient (it takes "
                                  f"{len(data) // grad_size * _PARAM_ITEMSIZE})")
            spans.setdefault(tensor_name, []).append((offset, offset + len(data)))
        for tensor_name, ranges in spans.items():
            overlap = first_overlap([(start, end, None) for start, end in ranges])
            if overlap is not None:
                raise DeviceError(
                    Status.GRADIENT_DUPLICATE,
                    f"tensor {tensor_name!r}: gradient bytes from {overlap[0]} are sent twice in one batch",
                )
        with self.core.lock:
            if self.core.tx is not None:
                for tensor_name, ranges in spans.items():
                    for start, end in ranges:
                        self.core.tx.check_free(self.core.tensor(tensor_name), start // grad_size, end // grad_size)

    def write_grads_lent(self, pieces: GradPieces) -> CommitResult | None:
        """Take gradient pieces (tensor, byte offset in its grad file, bytes, param copy) from
        memory the caller lends until this returns, as a drive's DMA reads a host buffer:
        each gradient element is read from it exactly once (a whole block by its kernel
        worker, into that thread's buffer; a part of a block into the block's staging), so
        the lender changing it meanwhile cannot make a step use values other than those it
        was checked on. Returns once every block the pieces completed has run.

        A piece's param copy (None, or as many bytes as its gradient, sharing memory with no
        piece's gradient or other copy; 2 bytes for each gradient element) receives the step's new params for its elements: the
        kernel stores them as it computes them, and when the step ends the rest is filled
        from the committed copy, so once the step is committed, skipped or aborted the copy
        holds the committed params. Until then it is the device's to write.

        The pieces are checked, against each other and against what the open step already
        has, before any is taken, so a batch refused for its ranges changes nothing. Returns
        the commit's result where the pieces completed an implicit step (committed or
        skipped before this returns), else None.
        """
        self.check_grads_lent(pieces)
        grad_size = self.core.itemsize("grad")
        queued: list[concurrent.futures.Future[None]] = []
        implicit = None
        try:
            for piece_index, (tensor_name, offset, data, param_copy) in enumerate(pieces):
                # Staged a few blocks at a time, so the kernel workers start on the first
                # blocks before this thread has staged the whole batch.
                position = 0
                stage_bytes = _LENT_STAGE_ELEMS * grad_size
                while True:
                    # Up to the next multiple of stage_bytes in the file: whole blocks.
                    end = min(len(data), (offset + position) // stage_bytes * stage_bytes + stage_bytes - offset)
                    copy = None if param_copy is None else param_copy[
                        position // grad_size * _PARAM_ITEMSIZE : end // grad_size * _PARAM_ITEMSIZE]
                    with self.core.timing.command("write_grad"):
                        _, completed = self._stage_grad(tensor_name, offset + position, data[position:end],
                                                        wait=True, lent=queued, param_copy=copy)
                    implicit = implicit or completed
                    if position == 0 and piece_index == 0:
                        # Let go of the GIL once: a worker woken for the first blocks would
                        # otherwise wait for it, its core idle, until this thread has staged
                        # the whole batch (hundreds of µs of Python for 16M elements).
                        time.sleep(0)
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
        tensor = self.core.tensor(tensor_name)
        length = len(data)
        self.core.check_range(tensor, "grad", offset, length)
        if length == 0:
            return 0, None
        if lent is None and not _immutable(data):
            # Blocks run after this returns (see below) and may use the caller's buffer in
            # place, so a buffer the caller could reuse is copied; FUSE hands over bytes
            # (or, on the data path, a view of the request's bytes).
            data = bytes(data)
        grad = np.frombuffer(data, dtype=self.core.grad_dtype)
        # Lent memory other than bytes (the CMB) may change under the device at any time, so
        # each of its elements must be read exactly once (see _run_block): nothing here reads
        # it, and the blocks' workers count what they step.
        shared = lent is not None and not _immutable(data)
        if not self.core.lock.acquire(blocking=wait):
            raise WouldBlock
        try:
            tx = self.core.tx
            if lent is None and tx is not None and tx.inflight >= self.max_queued_blocks:
                # Backpressure: the kernels are behind; the request waits (the event loop's
                # caller retries on a thread) until they have caught up.
                if not wait:
                    raise WouldBlock
                self.core.counters.grad_writes_waited += 1
                while self.core.tx is tx and tx.inflight >= self.max_queued_blocks:
                    self.core.cond.wait()
                tx = self.core.tx
            if tx is None:
                if not wait:
                    raise WouldBlock
                if self.shared_record.fence:
                    raise DeviceError(
                        Status.NO_STEP_OPEN,
                        f"namespace {self.core.name!r} runs shared steps (a multi-rank job): gradients "
                        "need their step begun first (BEGIN_STEP); a write opens no implicit step "
                        "until a single client's BEGIN_STEP")
                tx = self.steps.begin_locked(None, 1.0, explicit=False)
            params = None if param_copy is None else np.frombuffer(param_copy, dtype=np.uint16)
            ready = tx.receive(tensor, offset // self.core.grad_dtype.itemsize, grad, shared, params)
            completes_step = tx.all_received and bool(ready) and not tx.explicit
            # Counted before they are queued, so a commit cannot pass blocks not queued yet.
            tx.inflight += len(ready)
            self.core.counters.grad_bytes_in += length
            self.core.counters.write_commands += 1
            self.core.timing.add(host_in=length)
        finally:
            self.core.lock.release()
        # Like an SSD acknowledging a write once it sits in its write buffer, the request
        # returns once its bytes are staged: complete blocks run on the kernel workers, so
        # a single writer's next request overlaps them and both cores update blocks.
        # A block that fails marks the step (tx.error), and its commit reports it.
        queued = 0
        try:
            for first in range(0, len(ready), _BLOCKS_PER_TASK):
                run = ready[first : first + _BLOCKS_PER_TASK]
                future = self.core.workers.submit(self._run_blocks_in_background, tx, run)
                queued += len(run)
                if lent is not None:
                    lent.append(future)
        finally:
            if queued < len(ready):
                with self.core.cond:
                    tx.inflight -= len(ready) - queued
                    tx.error = tx.error or RuntimeError("gradient blocks could not be queued")
                    self.core.cond.notify_all()
        return length, (tx if completes_step else None)

    def finish_implicit_step(self, tx: StepTransaction) -> CommitResult | None:
        """Commit (or skip) implicit step `tx` once its blocks are done: the end of the write
        that completed its gradients. Its result, or None where another thread got there first."""
        with self.core.timing.command("commit_step"), self.core.cond:
            while tx.inflight:
                self.core.cond.wait()
            if self.core.tx is tx:
                return self.steps.commit_locked(tx)
            return None

    def _run_blocks_in_background(self, tx: StepTransaction, blocks: Sequence[ReadyBlock]) -> None:
        """Update a run of ready blocks, one after the other, then record them all in one
        pass of the lock. A block that fails marks the step (tx.error) and the others still
        run, as they would on their own."""
        finished: list[_BlockOutcome] = []
        try:
            skipped = False  # a block of this run was non-finite: the step will be skipped
            for block in blocks:
                try:
                    # Modeled as the controller's own work; in timed mode the block (and so
                    # the commit that waits for it) finishes no earlier than the model says.
                    with self.core.timing.command("kernel_block", host_command=False):
                        outcome = self._run_block(tx, block, skipped)
                except DeviceError:
                    continue  # recorded in tx.error and logged; the commit reports it
                skipped = skipped or outcome.nonfinite > 0
                finished.append(outcome)
        finally:
            with self.core.cond:
                for outcome in finished:
                    tx.finish(outcome.block, outcome.crc, outcome.nonfinite,
                              copied=(outcome.written > 0 and not outcome.nonfinite
                                      and outcome.block.param_copy is not None),
                              param_crc=outcome.param_crc)
                    self.core.counters.kernel_blocks += 1
                    self.core.counters.kernel_ns += outcome.elapsed_ns
                    self.core.counters.media_bytes_written += outcome.written
                tx.inflight -= len(blocks)
                self.core.cond.notify_all()

    def _block_update(self, source: Copy, tensor: TensorLayout) -> kernels.BlockUpdate:
        """The kernel call that steps `tensor`'s blocks from copy `source` into the other one,
        its arrays checked once (a mapped shadow only)."""
        key = (source, tensor.name)
        update = self._block_updates.get(key)
        if update is None:
            update = kernels.BlockUpdate(
                *(self.core.view(source, tensor, role) for role in ("master", "exp_avg", "exp_avg_sq")),
                *(self.core.view(source.other, tensor, role) for role in BLOCK_ROLES),
                grad_format=self.core.grad_format, param_format=self.core.param_format,
                state_format=self.core.state_format)
            self._block_updates[key] = update
        return update

    def _run_scaled_block(self, tensor: TensorLayout, committed: Copy, start: int, stop: int, grad: np.ndarray,
                          scalars: kernels.AdamScalars, param_copy: np.ndarray | None,
                          buffers: dict[str, np.ndarray] | None) -> tuple[int, int, int]:
        """One block of a namespace with block-scaled moments (fp16, int8) from the committed
        copy into the shadow: the one-pass decode, step and encode (kernels.adam_step_q_crcs)
        straight into the shadow's mapping (buffers None), or into this thread's buffers that
        are then written with pwrite. Returns (block CRC, param CRC, media bytes written)."""
        shadow = committed.other
        roles = self.core.block_roles
        inputs = [self.core.view(committed, tensor, role)[block_slice(role, start, stop)] for role in roles[:-1]]
        state = self.core.copies[shadow]
        if buffers is None:
            state.before_mapped_write()
            outputs = [self.core.view(shadow, tensor, role)[block_slice(role, start, stop)] for role in roles]
        else:
            outputs = [buffers[role] for role in roles]
        counts = StateCounts()  # the encoders' underflows, overflows and scales (emulator/state_counters.py)
        crc, param_crc = kernels.adam_step_q_crcs(
            grad, *inputs, *outputs, grad_format=self.core.grad_format, param_format=self.core.param_format,
            state_format=self.core.state_format, scalars=scalars, param_copy=param_copy, counts=counts)
        self.core.state_counters.record_block(tensor.name, start, counts)
        if buffers is not None:
            for role, out in zip(roles, outputs):
                region = region_offset(tensor, role) + block_slice(role, start, stop).start * out.itemsize
                state.write_at(region, out)
                state.start_writeback(region, out.nbytes)
        return crc, param_crc, sum(out.nbytes for out in outputs)

    def _run_block(self, tx: StepTransaction, block: ReadyBlock, skipped: bool) -> "_BlockOutcome":
        """Check and update one complete gradient block into the shadow copy; what the step
        records of it (_run_blocks_in_background records it). `skipped`: a block before it
        was found non-finite, so the step will be skipped and this one need not update."""
        try:
            started = time.perf_counter_ns()
            committed = self.core.sb.committed_copy
            shadow = committed.other
            tensor = block.tensor
            start, stop = tensor.block_range(block.local_block)
            crc = param_crc = 0
            written = 0
            state = self.core.copies[shadow]
            mapped = state.write_mode == "mapped"
            grad = block.grad
            # Once the step is known to be skipped there is no point updating the shadow.
            stepping = not skipped and tx.nonfinite == 0
            # A whole lent block (the CMB) stepped into the shadow's mapping: the kernel reads
            # each element once and counts and steps what it read, in registers or in rounds
            # of a few thousand elements (BlockUpdate.lent): no block-sized copy written and
            # read back.
            lent_kernel = block.shared and mapped and not self.core.scaled and stepping
            # This thread's block buffers, which the lent kernel does without.
            buffers = {} if lent_kernel else self._staging(stop - start)
            if lent_kernel:
                scalars = tx.scalars_of(tensor.name, self.core.group_of[tensor.name], block.local_block)
                state.before_mapped_write()
                crc, nonfinite, param_crc, stepped = self._block_update(committed, tensor).lent(
                    grad, start, scalars, block.param_copy)
                # A non-finite block was stepped too, in part (rounds) or whole (registers):
                # its media bytes count as written, though its outputs are discarded.
                written = stepped * self._bytes_per_stepped_elem
            elif block.shared:
                # Every element of a lent gradient is read from the host's memory exactly once:
                # copied into this thread's buffer, which alone is counted (in the same pass)
                # and stepped, so the step always uses the values it was checked on.
                grad = buffers["grad"]
                nonfinite = kernels.copy_count_nonfinite(block.grad, grad, self.core.grad_format)
            else:
                nonfinite = kernels.count_nonfinite(grad, self.core.grad_format)
            if nonfinite:  # per tensor, for log page C6h's FP8 gradient figures
                self.core.state_counters.grad_nonfinite(tensor.name, nonfinite)
            # Counted before the step, from memory only the device writes: such a block found
            # non-finite never reaches the shadow copy (see StepEngine.commit_locked).
            if not nonfinite and stepping and not lent_kernel:
                # The block's own: an FP8 slice's scale, where its codes carry one.
                scalars = tx.scalars_of(tensor.name, self.core.group_of[tensor.name], block.local_block)
                if self.core.scaled:
                    crc, param_crc, written = self._run_scaled_block(
                        tensor, committed, start, stop, grad, scalars,
                        block.param_copy, None if mapped else buffers)
                elif mapped:
                    # The kernel stores the new state straight into the shadow copy's mapping.
                    state.before_mapped_write()
                    crc, _, param_crc = self._block_update(committed, tensor)(
                        grad, start, scalars, block.param_copy)
                    written = (stop - start) * self._bytes_per_stepped_elem
                else:
                    # Into this thread's buffers, which pwrite then copies into the shadow
                    # (stores into a disk file's mapping would fault once per page).
                    out = buffers
                    # One pass: the step, and the checksum of its outputs while they are in cache.
                    crc, param_crc = kernels.adam_step_crcs(
                        grad,
                        self.core.view(committed, tensor, "master")[start:stop],
                        self.core.view(committed, tensor, "exp_avg")[start:stop],
                        self.core.view(committed, tensor, "exp_avg_sq")[start:stop],
                        out["master"], out["exp_avg"], out["exp_avg_sq"], out["param"],
                        grad_format=self.core.grad_format,
                        param_format=self.core.param_format,
                        state_format=self.core.state_format,
                        scalars=scalars,
                    )
                    if block.param_copy is not None:
                        block.param_copy[:] = out["param"]  # still in cache
                    for role in BLOCK_ROLES:
                        region = region_offset(tensor, role) + start * out[role].itemsize
                        state.write_at(region, out[role])
                        state.start_writeback(region, out[role].nbytes)
                        written += out[role].nbytes
            elapsed = time.perf_counter_ns() - started
        except BaseException as exc:
            with self.core.lock:
                tx.error = exc
            log.exception("namespace %s: kernel failed on %s block %d", self.core.name, block.tensor.name, block.local_block)
            raise DeviceError(Status.INTERNAL_ERROR, f"kernel failed: {exc}") from exc
        if written and not nonfinite:  # the kernel ran: master and moments read, the new state written
            self.core.timing.add(media_read=(stop - start) * (4 + 2 * self.core.state_dtype.itemsize),
                                 media_write=written, elements=stop - start)
        return _BlockOutcome(block, crc, param_crc, nonfinite, written, elapsed)
