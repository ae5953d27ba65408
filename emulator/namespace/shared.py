"""Shared steps: one step of an optimizer namespace that the ranks of a job begin (join), feed and commit together, exactly once."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from ...protocol.status import DeviceError, Status
from . import grad_scales as grad_scales_rules
from .common import CommitResult
from ..spec import Hyperparameters
from ..transaction import StepTransaction
from .outcomes import SharedStep, SharedStepRecord
from .state import NamespaceCore
from .steps import StepEngine


class SharedSteps:
    """BEGIN_STEP's join, COMMIT_STEP's bounded-wait poll and ABORT_STEP of a job's step.

    Why it is safe: a shared step commits in one place, `commit_shared_step`, under the
    namespace lock, only when every rank of the job has joined and every gradient block has
    arrived, so it commits at most once and never with a shard missing; whoever asks
    afterwards (another rank's poll) is answered from the recorded outcome. A step that will
    not complete is aborted by a rank whose wait ran out, and that outcome is what every
    other rank then reads.
    """

    def __init__(self, core: NamespaceCore, steps: StepEngine, record: SharedStepRecord) -> None:
        self.core = core
        self.steps = steps
        self.shared_record = record

    def _hypers_from(self, groups: list[dict[str, Any]] | None) -> list[Hyperparameters]:
        """The groups' hyperparameters with `groups` (one dict of changes per group)
        applied, all validated; nothing changes here."""
        if groups is None:
            return list(self.core.hypers)
        if len(groups) != len(self.core.hypers):
            raise DeviceError(Status.INVALID_FIELD, f"groups has {len(groups)} entries; namespace "
                              f"{self.core.name!r} has {len(self.core.hypers)} groups")
        return [hyper.replace(**changes) for hyper, changes in zip(self.core.hypers, groups)]

    def begin_shared_step(self, step: int, grad_scale: float, job: int, seq: int, ranks: int, rank: int,
                          groups: list[dict[str, Any]] | None, grad_scales: Any = None) -> dict[str, Any]:
        """Open step `step` of job `job` (its `seq`th shared step) for `ranks` ranks with
        `groups`' hyperparameters, or join it where another rank of the job opened it with
        the same step, seq, scale and hyperparameters. `grad_scales`: the FP8 scales of the
        slices this rank sends (grad_scales.parse), added to the step's (refused where they
        overlap another rank's). Returns {"step", "grad_scale", "opened", "joined", "ranks"}."""
        if not 0 <= rank < ranks:
            raise DeviceError(Status.INVALID_FIELD, f"rank {rank} outside 0..{ranks - 1}")
        with self.core.lock:
            tx = self.core.tx
            if tx is not None:
                return self._join_locked(tx, step, grad_scale, job, seq, ranks, rank, groups, grad_scales)
            wanted = self._hypers_from(groups)
            previous = self.core.hypers
            # The step's scalars come from the hyperparameters in force at its begin: the
            # opener's groups go in first, and back out if the begin is refused.
            self.core.hypers = wanted
            try:
                tx = self.steps.begin_locked(step, grad_scale, explicit=True, grad_scales=grad_scales)
            except BaseException:
                self.core.hypers = previous
                raise
            if wanted != previous:
                self.core.config_changed_ns = time.time_ns()
            tx.shared = SharedStep(job, seq, ranks, {rank}, tuple(wanted), groups is not None)
            self.shared_record.fence = True
            return {"step": tx.step, "grad_scale": grad_scale, "opened": True, "joined": 1, "ranks": ranks}

    def _join_locked(self, tx: StepTransaction, step: int, grad_scale: float, job: int, seq: int,
                     ranks: int, rank: int, groups: list[dict[str, Any]] | None,
                     grad_scales: Any = None) -> dict[str, Any]:
        shared = tx.shared
        if shared is None or shared.job != job:
            owner = "a single client (not a shared step)" if shared is None else (
                f"another job ({shared.job:#x}: ranks {sorted(shared.joined)} of {shared.ranks} joined)")
            raise DeviceError(Status.STEP_ALREADY_OPEN,
                              f"namespace {self.core.name!r}: step {tx.step} is open for {owner}; it must "
                              "be committed or aborted first")
        if step != tx.step or seq != shared.seq:
            raise DeviceError(Status.STEP_NUMBER_MISMATCH,
                              f"namespace {self.core.name!r}: the job's step {tx.step} (its shared step "
                              f"{shared.seq}) is open, rank {rank} asks for step {step} (shared step {seq})")
        if ranks != shared.ranks:
            raise DeviceError(Status.INVALID_FIELD, f"step {step} was begun for {shared.ranks} ranks, "
                              f"rank {rank} counts {ranks}")
        if grad_scale != tx.grad_scale:
            raise DeviceError(Status.INVALID_FIELD,
                              f"step {step}: rank {rank} sends grad scale {grad_scale!r}, the step was "
                              f"begun with {tx.grad_scale!r}; every rank must send the same (the same "
                              "loss scale and clip coefficient)")
        if groups is None and shared.hypers_sent:
            raise DeviceError(Status.INVALID_FIELD,
                              f"step {step}: rank {rank} sent no hyperparameters (groups); the step was "
                              f"begun with {[dataclasses.asdict(h) for h in shared.hypers]}, and every rank "
                              "must send the same")
        if groups is not None:
            asked = [dataclasses.replace(hyper, **changes) for hyper, changes in
                     zip(shared.hypers, groups)] if len(groups) == len(shared.hypers) else None
            if asked != list(shared.hypers):
                raise DeviceError(Status.INVALID_FIELD,
                                  f"step {step}: rank {rank}'s hyperparameters differ from those the "
                                  f"step was begun with ({[dataclasses.asdict(h) for h in shared.hypers]})")
        if rank in shared.joined:
            raise DeviceError(Status.STEP_ALREADY_OPEN, f"step {step}: rank {rank} has joined it already")
        # This rank's FP8 scales, checked against the step's before the rank counts as joined:
        # a refused join changes nothing (the rank may not send, and the step waits for it).
        slices = grad_scales_rules.parse(self.core, tx.step, grad_scale, grad_scales)
        grad_scales_rules.add(tx, slices, f"rank {rank}")
        self.core.state_counters.fp8_scales_taken(tx.step, slices)
        shared.joined.add(rank)
        return {"step": tx.step, "grad_scale": grad_scale, "opened": False, "joined": len(shared.joined),
                "ranks": ranks}

    def _open_shared_locked(self, step: int, job: int, seq: int) -> StepTransaction:
        """The open step, where it is step `step` of job `job`, its `seq`th; else NO_STEP_OPEN."""
        tx = self.core.tx
        if tx is None or tx.shared is None or (tx.shared.job, tx.shared.seq, tx.step) != (job, seq, step):
            raise DeviceError(Status.NO_STEP_OPEN,
                              f"namespace {self.core.name!r}: step {step} of job {job:#x} is not open "
                              f"(committed step {self.core.sb.committed_step})")
        return tx

    def commit_shared_step(self, step: int, job: int, seq: int, rank: int) -> CommitResult | str:
        """Commit step `step` of job `job` once every rank has joined and every gradient
        block has arrived; until then, what it still waits for (a str: the rank asks again,
        within its bound). A step that has ended answers with its outcome, the same for
        every rank."""
        with self.core.cond:
            outcome = self.shared_record.last
            if outcome is not None and (outcome.job, outcome.seq) == (job, seq):
                return outcome.replay()
            tx = self._open_shared_locked(step, job, seq)
            shared = tx.shared
            assert shared is not None
            if rank not in shared.joined:
                raise DeviceError(Status.INVALID_FIELD, f"step {step}: rank {rank} has not joined it")
            if len(shared.joined) < shared.ranks or not tx.all_received:
                # Not an error: a progress report (an error would fill the error log at
                # every poll of every rank).
                return self._waiting_for(tx)
            try:
                # Both waits here (kernels in flight, readers of the committed copy) let go of
                # the lock: another rank's poll may commit the step meanwhile.
                result = self.steps.commit_locked(self.steps.quiesced_step_locked())
            except DeviceError as exc:
                ended = self.shared_record.last
                if ended is not None and (ended.job, ended.seq) == (job, seq):
                    return ended.replay()  # it ended while this poll waited: its outcome
                if self.core.tx is not tx:  # the step ended (aborted): every rank hears the same
                    self.shared_record.record(tx, error=exc)
                raise
            self.shared_record.record(tx, result=result)
            return result

    def abort_shared_step(self, step: int, job: int, seq: int, rank: int, reason: str) -> int:
        """Abort step `step` of job `job` (a rank whose wait ran out); every rank then hears
        why. A step that has ended already is left as it ended (its ranks read how)."""
        with self.core.cond:
            outcome = self.shared_record.last
            if outcome is not None and (outcome.job, outcome.seq) == (job, seq):
                return step
            tx = self._open_shared_locked(step, job, seq)
            self.steps.quiesced_step_locked()  # may let go of the lock: another rank may end it
            if self.core.tx is not tx:
                return step  # it ended meanwhile, and stays as it ended
            self.core.tx = None
            self.core.counters.steps_aborted += 1
            self.steps.settle_param_copies(tx, committed=False)
            self.shared_record.record(tx, error=DeviceError(
                Status.NO_STEP_OPEN, f"step {step} of job {job:#x} was aborted by rank {rank}: {reason}"))
            return step

    def _waiting_for(self, tx: StepTransaction) -> str:
        """What a shared step still waits for, for the rank that asks (and its error)."""
        shared = tx.shared
        assert shared is not None
        parts = []
        absent = sorted(set(range(shared.ranks)) - shared.joined)
        if absent:
            parts.append(f"ranks {absent} of {shared.ranks} have not joined")
        if not tx.all_received:
            parts.append(f"gradients incomplete for {', '.join(tx.unreceived(self.core.layouts))}")
        return f"step {tx.step}: " + "; ".join(parts)

    def shared_state(self) -> dict[str, Any] | None:
        """The open shared step as statistics() shows it (lock-free, as statistics is)."""
        tx = self.core.tx
        shared = None if tx is None else tx.shared
        if shared is None:
            return None
        return {"job": shared.job, "seq": shared.seq, "ranks": shared.ranks, "joined": sorted(shared.joined)}
