"""A group commit's recovery rule: the one step that every device of a job can be brought back to, and which devices must revert to reach it."""
from __future__ import annotations

import dataclasses
from typing import Sequence


class GroupDisagreementError(RuntimeError):
    """The devices of one job hold steps that no revert can bring together (more than one
    step apart): a device was used by another job, restored from an older snapshot, or its
    media lost more than the protocol allows. Nothing is changed."""


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """Where a job's devices go: `step`, reached by reverting the devices in `revert` (indices
    into the list of committed steps) from step + 1."""

    step: int
    revert: tuple[int, ...]


def common_step(committed: Sequence[int], names: Sequence[str] | None = None) -> GroupPlan:
    """The recovery of a job whose namespaces on several devices were stepped as one group.

    The trainer's protocol (docs/architecture.md, "Several devices: one group commit") never
    begins step N + 1 on any device before every device has committed step N durably; a
    device at N + 1 therefore still holds step N in its other copy, untouched, until the next
    begin. So after any crash the committed steps are at most one apart, and the devices
    ahead revert (REVERT_STEP) to the lowest. Steps further apart are refused.
    """
    if not committed:
        raise ValueError("a group has at least one device")
    labels = list(names) if names is not None else [f"device {index}" for index in range(len(committed))]
    low, high = min(committed), max(committed)
    if high - low > 1:
        listing = ", ".join(f"{label} at step {step}" for label, step in zip(labels, committed))
        raise GroupDisagreementError(
            f"the devices of this job are more than one step apart ({listing}); a group commit "
            "leaves them at most one apart, so at least one was changed outside the job (another "
            "job, a snapshot rollback, a restore) and no common step can be made. Nothing was changed")
    return GroupPlan(low, tuple(index for index, step in enumerate(committed) if step != low))
