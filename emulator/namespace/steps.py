"""An optimizer namespace's step commands: begin, commit or skip, abort; hyperparameters; the committed copy pinned for and restored from snapshots."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from typing import Any, Callable, Iterator

import numpy as np

from ... import kernels
from ...protocol.status import DeviceError, Status
from ..layout import SuperblockFlags
from ..media import StateFile
from . import grad_scales as grad_scales_rules
from .common import CommitResult, hyper_record, hypers_of
from ..spec import Hyperparameters
from ..superblock import SkipCounts, Superblock
from ..transaction import StepTransaction, block_range_of
from .media import NamespaceMedia
from .outcomes import SharedStepRecord
from .state import NamespaceCore
from .verify import CopyVerifier

log = logging.getLogger("cossd.emulator.namespace")


class StepEngine:
    """The step transaction (begin, commit or skip, abort), hyperparameters, and the flips that snapshots pin and restore.

    Owns no state of its own: a step is core.tx, the committed step core.sb. It flips the
    superblock through the media part, checks copies through the verifier, and tells the
    shared steps' record how each step ended (a shared step's ranks ask it afterwards).
    """

    def __init__(self, core: NamespaceCore, media: NamespaceMedia, verifier: CopyVerifier,
                 shared_record: SharedStepRecord) -> None:
        self.core = core
        self.media = media
        self.verifier = verifier
        self.shared_record = shared_record

    def begin_step(self, step: int | None = None, grad_scale: float = 1.0,
                   grad_scales: dict[str, Any] | None = None) -> int:
        """Open step `step` (default: the next one) with a combined gradient scale, and per
        tensor (or block-aligned slice) of an FP8 namespace the scale its codes carry
        (namespace/grad_scales.py). Where the step is open already and named again with
        scales, they are added to it (a streaming client sends each tensor's before its
        gradients)."""
        with self.core.lock:
            tx = self.core.tx
            if grad_scales and tx is not None and tx.explicit and tx.shared is None and step == tx.step:
                # The open step named again with scales: a streaming trainer's next tensors'
                # scales, each sent before that tensor's gradients (grad_scales.add).
                if grad_scale != tx.grad_scale:
                    raise DeviceError(Status.INVALID_FIELD, f"step {tx.step} is open with grad scale "
                                      f"{tx.grad_scale!r}; scales added to it come with the same, not {grad_scale!r}")
                slices = grad_scales_rules.parse(self.core, tx.step, grad_scale, grad_scales)
                grad_scales_rules.add(tx, slices, "the client")
                self.core.state_counters.fp8_scales_taken(tx.step, slices)
                return tx.step
            opened = self.begin_locked(step, grad_scale, explicit=True, grad_scales=grad_scales).step
            # A single client's explicit step: implicit steps may open again after it.
            self.shared_record.fence = False
            return opened

    def begin_implicit_step(self, grad_scale: float) -> int:
        """Open an implicit step carrying `grad_scale`: Execute Program with CPARAM1 0 and a
        CPARAM2. Like the one a gradient write opens (scale 1), it commits when the write that
        completes its gradients ends; not while a multi-rank job fences implicit steps off."""
        with self.core.lock:
            if self.shared_record.fence:
                raise DeviceError(
                    Status.NO_STEP_OPEN,
                    f"namespace {self.core.name!r} runs shared steps (a multi-rank job): gradients "
                    "need their step begun first (BEGIN_STEP); no implicit step opens until a single "
                    "client's BEGIN_STEP")
            return self.begin_locked(None, grad_scale, explicit=False).step

    def begin_locked(self, step: int | None, grad_scale: float, explicit: bool,
                     grad_scales: dict[str, Any] | None = None) -> StepTransaction:
        # A step reads the committed master and moments: they must have passed their checksums.
        self.verifier.await_verified_locked()
        # The step writes into the shadow copy: not while a reader (a snapshot's copy, a
        # reply) still reads it as the step before (pinned before the last commit flipped).
        while self.core.pins[self.core.sb.committed_copy.other] and self.core.tx is None:
            self.core.cond.wait()
        self.media.check()
        if self.core.tx is not None:
            raise DeviceError(
                Status.STEP_ALREADY_OPEN,
                f"namespace {self.core.name!r}: step {self.core.tx.step} is already open "
                "(commit or abort it first)",
            )
        expected = self.core.sb.committed_step + 1
        if step is not None and step != expected:
            raise DeviceError(
                Status.STEP_NUMBER_MISMATCH,
                f"namespace {self.core.name!r}: next step is {expected}, not {step}",
            )
        if not (isinstance(grad_scale, float) and math.isfinite(grad_scale) and grad_scale > 0):
            raise DeviceError(
                Status.INVALID_FIELD, f"grad_scale must be a finite number > 0, got {grad_scale!r}"
            )
        try:
            scalars = [kernels.adam_scalars(h.kernel, expected, grad_scale) for h in self.core.hypers]
        except kernels.KernelArgumentError as exc:
            raise DeviceError(Status.INVALID_FIELD, str(exc)) from None
        slices = grad_scales_rules.parse(self.core, expected, grad_scale, grad_scales)
        if self.core.loading:
            # Not from moments written only in part (held_loads.py): refused, still loading.
            self.core.held_loads.refuse_held(self.core.name)
            self._seal_locked()
        # The shadow copy still holds the previous step; it may be the only complete
        # copy on the media until the committed step is durable. Never overwrite it first.
        self.media.flush_to(self.core.sb)
        self.core.tx = StepTransaction(expected, grad_scale, scalars, explicit, self.core.total_blocks)
        grad_scales_rules.add(self.core.tx, slices, "the client")
        self.core.state_counters.fp8_scales_taken(expected, slices)
        return self.core.tx

    def _seal_locked(self) -> None:
        """End the loading phase: checksum the initial state and make it durable."""
        crcs = np.zeros(self.core.total_blocks, dtype=np.uint32)
        param_crcs = np.zeros(self.core.total_blocks, dtype=np.uint32)
        copy = self.core.sb.committed_copy
        for tensor in self.core.layouts:
            for block in range(tensor.block_count):
                index = tensor.first_block + block
                crcs[index], param_crcs[index] = self.verifier.block_crcs(copy, tensor, block)
        self.media.sync(self.core.copies[copy])
        sealed = self.core.sb.successor(flags=SuperblockFlags.NONE, block_crcs=crcs, param_crcs=param_crcs)
        self.media.write_superblock(sealed, sync=True)

    def quiesced_step_locked(self) -> StepTransaction:
        """The open step, once no kernel of it is still running (caller holds the lock)."""
        tx = self.core.tx
        if tx is None:
            raise DeviceError(Status.NO_STEP_OPEN, f"namespace {self.core.name!r}: no step is open")
        while tx.inflight:
            self.core.cond.wait()
        return tx

    def commit_step(self) -> CommitResult:
        """Commit the open step once all its gradient blocks are in (or skip it)."""
        with self.core.cond:
            tx = self.quiesced_step_locked()
            try:
                result = self.commit_locked(tx)
            except DeviceError as exc:
                if self.core.tx is not tx:
                    self.shared_record.record(tx, error=exc)  # a shared step's ranks hear how it ended
                raise
            self.shared_record.record(tx, result=result)
            return result

    def abort_step(self) -> int:
        """Drop the open step; the committed state is untouched. Returns its number."""
        with self.core.cond:
            tx = self.quiesced_step_locked()
            self.core.tx = None
            self.core.counters.steps_aborted += 1
            self.settle_param_copies(tx, committed=False)
            self.shared_record.record(tx, error=DeviceError(
                Status.NO_STEP_OPEN, f"step {tx.step} was aborted (ABORT_STEP of the whole step)"))
            return tx.step

    def commit_locked(self, tx: StepTransaction) -> CommitResult:
        # No wait for readers of the committed copy: the flip leaves its bytes as they are,
        # and the next begin waits for them before anything writes into it.
        if self.core.tx is not tx:
            raise DeviceError(Status.NO_STEP_OPEN, f"namespace {self.core.name!r}: step {tx.step} was aborted")
        if self.media.failure is not None:
            self.core.tx = None
            self.core.counters.steps_aborted += 1
            self.media.check()
        if tx.error is not None:
            self.core.tx = None
            self.core.counters.steps_aborted += 1
            self.settle_param_copies(tx, committed=False)
            raise DeviceError(
                Status.INTERNAL_ERROR, f"step {tx.step} failed and was aborted: {tx.error}"
            )
        if not tx.all_done:
            raise DeviceError(
                Status.GRADIENT_INCOMPLETE,
                f"step {tx.step}: gradients incomplete for {', '.join(tx.missing(self.core.layouts))}",
            )
        ended = False  # True once the step is committed: the kernel's param copies stand
        try:
            if tx.nonfinite:
                # A skip writes no superblock: both slots keep naming the committed step and
                # the one before it, the fallback should the committed copy fail its checksums.
                self._record_skip_locked(tx.step)
                self.core.counters.nonfinite_elements += tx.nonfinite
                log.info("namespace %s: step %d skipped (%d non-finite gradient elements)",
                         self.core.name, tx.step, tx.nonfinite)
                return CommitResult(tx.step, self.core.sb.committed_step, True, tx.nonfinite)
            shadow = self.core.sb.committed_copy.other
            if self.core.sync_commits:
                self.media.sync(self.core.copies[shadow])
            # The last look at both copies before the flip: a shadow cut short or punched
            # while its blocks were written (pwrite extends it again, leaving holes that read
            # as zeros) must fail this step, not become the committed one.
            self.media.check()
            skips = self.core.skips()
            committed = self.core.sb.successor(
                committed_step=tx.step,
                committed_copy=shadow,
                block_crcs=tx.block_crcs,
                param_crcs=tx.param_crcs,
                steps_committed=self.core.sb.steps_committed + 1,
                steps_skipped=skips.steps_skipped,
                last_skipped_step=skips.last_skipped_step,
                last_grad_scale=tx.grad_scale,
                **hyper_record(self.core.hypers),
            )
            self.media.write_superblock(committed, sync=self.core.sync_commits)
            self.core.counters.steps_committed += 1
            self.core.state_counters.step_committed(tx.step)  # fold fp16/int8 blocks' counts
            ended = True
            return CommitResult(tx.step, tx.step, False)
        except DeviceError:
            self.core.counters.steps_aborted += 1
            raise
        finally:
            self.core.tx = None
            if self.media.failure is None:
                self.settle_param_copies(tx, committed=ended)

    def revert_step(self, step: int) -> dict[str, Any]:
        """REVERT_STEP: undo committed step `step`, making the step before it the committed
        one again, from the copy it still lies in (a group commit's recovery: one device of a
        job that reached `step` while another stayed before it; docs/architecture.md).

        Possible only while that copy is untouched since `step` committed: the other
        superblock slot must name step - 1 in the other copy (seq one lower), and that copy
        must pass every block checksum the slot records. A step begun since (committed,
        skipped or aborted) has written into it, and the revert is refused with nothing
        changed. Already at step - 1: nothing to do ({"reverted": false}). Crash safe like a
        commit: one durable superblock write flips back."""
        with self.core.cond:
            self.verifier.await_verified_locked()  # step's own copy first: a failure there stops it all
            self.media.check()
            if self.core.tx is not None:
                raise DeviceError(Status.STEP_ALREADY_OPEN, f"namespace {self.core.name!r}: step {self.core.tx.step} "
                                  "is open (commit or abort it before reverting a step)")
            if self.core.loading:
                raise DeviceError(Status.NAMESPACE_NOT_READY, f"namespace {self.core.name!r} is still loading "
                                  "its initial state and has no committed step to revert")
            current = self.core.sb
            if current.committed_step == step - 1:
                return {"committed_step": current.committed_step, "reverted": False}
            if current.committed_step != step:
                raise DeviceError(Status.STEP_NUMBER_MISMATCH,
                                  f"namespace {self.core.name!r}: committed step is {current.committed_step}; "
                                  f"cannot revert step {step}")
            other = Superblock.decode(self.core.slots[current.slot ^ 1].read(), self.core.total_blocks,
                                      len(self.core.hypers))
            if (other is None or other.seq != current.seq - 1 or other.committed_step != step - 1
                    or other.committed_copy != current.committed_copy.other
                    or other.flags & SuperblockFlags.LOADING):
                raise DeviceError(Status.STEP_NUMBER_MISMATCH,
                                  f"namespace {self.core.name!r}: step {step - 1} is no longer recorded on "
                                  f"the media (the other superblock slot names "
                                  f"{'nothing valid' if other is None else f'step {other.committed_step}'}); "
                                  f"step {step} stays committed")
            bad = self.verifier.verify_copy(other)
            if bad:
                tensor, block = bad[0]
                raise DeviceError(Status.STEP_NUMBER_MISMATCH,
                                  f"namespace {self.core.name!r}: the copy of step {step - 1} has been written "
                                  f"since (a step began after {step}): {len(bad)} block(s) differ, first "
                                  f"{tensor} block {block}; step {step} stays committed")
            # The write below replaces the slot of step - 1: the slot of `step` must be
            # durable first, or a cut in the middle could leave neither.
            self.media.flush_to(current)
            self.media.sync(self.core.copies[other.committed_copy])
            reverted = current.successor(
                committed_step=other.committed_step,
                committed_copy=other.committed_copy,
                flags=SuperblockFlags.NONE,
                block_crcs=other.block_crcs.copy(),
                param_crcs=None if other.param_crcs is None else other.param_crcs.copy(),
                last_grad_scale=other.last_grad_scale,
                **hyper_record(hypers_of(other)),
            )
            self.media.write_superblock(reverted, sync=True)
            self.core.hypers = hypers_of(reverted)
            self.core.config_changed_ns = time.time_ns()
            self.core.counters.steps_reverted += 1
            log.warning("namespace %s: step %d reverted; step %d is committed again", self.core.name, step, step - 1)
            return {"committed_step": reverted.committed_step, "reverted": True}

    def _record_skip_locked(self, step: int) -> None:
        """Count skipped step `step`: durably in the side record, and in the superblock in
        force in memory only, so that the next superblock written carries it."""
        skips = SkipCounts(self.core.skips().steps_skipped + 1, step)
        written = skips.store_or_warn(self.core.directory)
        self.core.counters.media_bytes_written += written
        self.core.timing.add(media_write=written)
        self.core.recorded_skips = skips
        self.core.sb = dataclasses.replace(
            self.core.sb, steps_skipped=skips.steps_skipped, last_skipped_step=skips.last_skipped_step)
        self.core.counters.steps_skipped = skips.steps_skipped

    def settle_param_copies(self, tx: StepTransaction, committed: bool) -> None:
        """Fill what the kernel has not of the host's param copies (write_grads_lent), from
        the committed copy: blocks assembled from pieces, and every block of a step that
        ended without committing. Caller holds the lock; the step has ended."""
        if not tx.param_copies:
            return
        moved = 0
        for tensor, first, copy in tx.param_copies:
            params = self.core.view(self.core.sb.committed_copy, tensor, "param")
            end = first + len(copy)
            for block in block_range_of(first, end):
                if committed and (tensor.name, block) in tx.copied:
                    continue
                start, stop = tensor.block_range(block)
                lo, hi = max(first, start), min(end, stop)
                copy[lo - first : hi - first] = params[lo:hi]
            moved += copy.nbytes
        # Param bytes to the host, as a read of the param file would count them.
        self.core.counters.bytes_read += moved
        self.core.counters.param_bytes_out += moved
        self.core.timing.add(host_out=moved)

    def _wait_for_shadow_pins_locked(self) -> None:
        """Wait until nothing reads the shadow copy (caller holds the lock, about to write it)."""
        while self.core.pins[self.core.sb.committed_copy.other]:
            self.core.cond.wait()

    def set_hyperparameters(self, group: int | None = None, **changes: Any) -> Hyperparameters:
        """Change hyperparameters for the next step (persisted with the next commit).

        `group` picks one group; None changes every group. Nothing changes unless every
        new value validates. Returns the (first) changed group's hyperparameters.
        """
        if "mode" in changes:
            raise DeviceError(Status.INVALID_FIELD, "mode is fixed when a namespace is created")
        with self.core.lock:
            if group is None:
                targets = range(len(self.core.hypers))
            elif isinstance(group, int) and not isinstance(group, bool) and 0 <= group < len(self.core.hypers):
                targets = range(group, group + 1)
            else:
                raise DeviceError(
                    Status.INVALID_FIELD,
                    f"group {group!r} outside 0..{len(self.core.hypers) - 1}",
                )
            updated = {index: self.core.hypers[index].replace(**changes) for index in targets}
            for index, hyper in updated.items():
                self.core.hypers[index] = hyper
            self.core.config_changed_ns = time.time_ns()
            return updated[targets[0]]

    @contextlib.contextmanager
    def pinned_committed(self) -> Iterator[tuple[Superblock, StateFile]]:
        """The committed superblock and its copy, held still while the block runs: a commit
        or rollback waits until it exits (a step may stay open and keep computing: it only
        writes the shadow). Emulator/snapshots.py copies the state under it."""
        with self.core.lock:
            self.verifier.await_verified_locked()  # a snapshot or export copies master and moments too
            self.media.check()
            if self.core.loading:
                raise DeviceError(
                    Status.NAMESPACE_NOT_READY,
                    f"namespace {self.core.name!r} is still loading its initial state and has no "
                    f"committed step yet (step {self.core.sb.committed_step + 1} seals it)",
                )
            self.core.pins[self.core.sb.committed_copy] += 1
            superblock = self.core.sb
        try:
            yield superblock, self.core.copies[superblock.committed_copy]
        finally:
            self.core.unpin(superblock.committed_copy)

    def restore_committed(self, source: Superblock, fill: Callable[[StateFile], None]) -> int:
        """Make `source`'s state (a snapshot's) the committed one: `fill` writes its bytes
        into the shadow copy, which must then match `source`'s block checksums, and a new
        superblock (seq + 1) commits it durably. Returns the step it replaced.

        Crash safe like a step: the committed copy is untouched until the slot write flips.
        """
        with self.core.cond:
            self.verifier.await_verified_locked()
            self.media.check()
            self._wait_for_shadow_pins_locked()  # the fill writes into the shadow
            if self.core.tx is not None:
                raise DeviceError(
                    Status.STEP_ALREADY_OPEN,
                    f"namespace {self.core.name!r}: step {self.core.tx.step} is open (commit or abort it "
                    "before rolling back)",
                )
            previous = self.core.sb.committed_step
            # As for a begin: the shadow may hold the only complete older step until the
            # committed one is durable, so never overwrite it first.
            self.media.flush_to(self.core.sb)
            shadow = self.core.sb.committed_copy.other
            fill(self.core.copies[shadow])
            bad = self.verifier.verify_copy(dataclasses.replace(source, committed_copy=shadow))
            if bad:
                tensor, block = bad[0]
                raise DeviceError(
                    Status.UNRECOVERED_READ_ERROR,
                    f"snapshot of step {source.committed_step} fails its checksum in {len(bad)} "
                    f"block(s) (first: {tensor} block {block}); namespace {self.core.name!r} is unchanged",
                )
            self.media.sync(self.core.copies[shadow])
            restored = self.core.sb.successor(
                committed_step=source.committed_step,
                committed_copy=shadow,
                flags=SuperblockFlags.NONE,
                block_crcs=source.block_crcs.copy(),
                param_crcs=None if source.param_crcs is None else source.param_crcs.copy(),
                last_grad_scale=source.last_grad_scale,
                **hyper_record(hypers_of(source)),
            )
            self.media.write_superblock(restored, sync=True)
            self.core.hypers = hypers_of(restored)
            self.core.counters.media_bytes_written += self.core.copies[shadow].size_bytes
            return previous
