"""What a shared step carries (SharedStep) and how the last one ended (SharedOutcome, kept in SharedStepRecord), apart from shared.py so that the step engine records every step's end without importing the shared steps."""
from __future__ import annotations

import dataclasses

from ...protocol.status import DeviceError
from ..spec import Hyperparameters
from ..transaction import StepTransaction
from .common import CommitResult


@dataclasses.dataclass
class SharedStep:
    """What a shared step carries beyond an explicit one: whose it is and who has joined."""

    job: int  # the job's id: every rank of one job sends the same, another job another
    # The job's count of shared steps begun (from 1): a skipped step's number comes again,
    # its seq never does, so a rank asking about one attempt never hears of another.
    seq: int
    ranks: int  # how many ranks take part; the step commits only once all have joined
    joined: set[int]
    hypers: tuple[Hyperparameters, ...]  # the groups' hyperparameters the step runs with
    # Whether the opener sent them (groups): then every joining rank must send the same, so
    # that a rank whose schedule drifted cannot join unseen by sending none.
    hypers_sent: bool = False


@dataclasses.dataclass(frozen=True)
class SharedOutcome:
    """How a shared step ended, kept so that every rank asking later gets the same answer."""

    job: int
    seq: int
    step: int
    result: CommitResult | None
    error: DeviceError | None

    def replay(self) -> CommitResult:
        if self.error is not None:
            raise DeviceError(self.error.status, self.error.message)
        assert self.result is not None
        return self.result


class SharedStepRecord:
    """How the last shared step ended (its ranks may still ask), and whether gradient writes
    may open an implicit step: not while the namespace runs shared steps, where a late write
    of a rank whose step was aborted would otherwise open one (scale 1.0) that a new job's
    ranks could then complete. The step engine records every step's end here; the shared
    steps and the gradient path read it. Guarded by the namespace lock."""

    def __init__(self) -> None:
        self.last: SharedOutcome | None = None
        self.fence = False

    def record(self, tx: StepTransaction, result: CommitResult | None = None,
               error: DeviceError | None = None) -> None:
        """Keep how shared step `tx` ended (any end: commit, skip, abort of any kind). A step
        ends once: the first outcome kept is the true one, and a caller that lost a race to
        end it (its own commit finding the step gone) never replaces it."""
        if tx.shared is None:
            return
        kept = self.last
        if kept is not None and (kept.job, kept.seq) == (tx.shared.job, tx.shared.seq):
            return
        self.last = SharedOutcome(tx.shared.job, tx.shared.seq, tx.step, result, error)
