"""The tiered checkpointer's bookkeeping under one lock: its versions and where each lives, the pool's and the spill dir's use, drops, counters."""
from __future__ import annotations

import collections
import dataclasses
import threading
import warnings
from typing import Any

import torch

from . import policy as tier_policy
from .spill import SpillDir


class Cancelled(Exception):
    """The version being uploaded was dropped, or the checkpointer is abandoning its uploads."""


@dataclasses.dataclass(eq=False)
class Version:
    step: int
    nbytes: int
    chunk_bytes: int
    buffer: torch.Tensor | None = None        # in the memory pool
    spill: dict[str, Any] | None = None       # its spill manifest, once on the local SSD
    archived: bool = False
    uploading: bool = False
    spilling: bool = False
    finishing: bool = False                   # all parts in the store: its manifest is being written
    dropped: bool = False


class TierState:
    """What the save path, the spill thread and the upload thread share. Every method here is
    called with `cv` held; the threads wait on `cv` for each other's progress."""

    def __init__(self, memory_bytes: int, spill_bytes: int, spill: SpillDir | None) -> None:
        self.cv = threading.Condition()
        self.memory_bytes, self.spill_bytes, self.spill = memory_bytes, spill_bytes, spill
        self.versions: dict[int, Version] = {}
        self.pool_used = 0
        self.spill_used = 0
        self.memory_peak = 0
        self.spill_peak = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.floats: dict[str, float] = collections.defaultdict(float)
        self.dropped_steps: collections.deque[int] = collections.deque(maxlen=100)
        self.last_error: str | None = None
        self.stop = False
        self.abandon = threading.Event()

    def pool_free(self) -> int:
        return self.memory_bytes - self.pool_used

    def reserve_pool(self, nbytes: int) -> None:
        self.pool_used += nbytes
        self.memory_peak = max(self.memory_peak, self.pool_used)

    def reserve_spill(self, nbytes: int) -> None:
        self.spill_used += nbytes
        self.spill_peak = max(self.spill_peak, self.spill_used)

    def pending(self) -> list[Version]:
        """Versions still to archive (in the pool or the spill dir, neither archived nor dropped)."""
        return [v for v in self.versions.values() if not (v.archived or v.dropped)
                and (v.buffer is not None or v.spill is not None)]

    def check_live(self, version: Version) -> None:
        if version.dropped or self.abandon.is_set():
            raise Cancelled()

    def release(self, version: Version) -> None:
        """The version's pool buffer freed (never while it is being spilled)."""
        if version.buffer is not None and not version.spilling:
            version.buffer = None
            self.pool_used -= version.nbytes
            self.forget_if_gone(version)

    def unspill(self, version: Version) -> None:
        """The version's spill files deleted and their room given back."""
        if version.spill is not None and not version.spilling:
            assert self.spill is not None
            self.spill.delete(version.step)
            self.spill_used -= version.nbytes
            version.spill = None
            self.forget_if_gone(version)

    def forget_if_gone(self, version: Version) -> None:
        if version.buffer is None and version.spill is None and not version.spilling and \
                self.versions.get(version.step) is version:
            del self.versions[version.step]

    def evict_archived(self, size: int) -> None:
        """Archived versions kept in the pool (for a fast restore) give up their room, oldest
        first, until `size` bytes are free. Not a drop: the store has them."""
        for version in sorted(self.versions.values(), key=lambda v: v.step):
            if self.pool_free() >= size:
                return
            if version.archived:
                self.release(version)

    def drop(self, version: Version, counted: bool = True) -> None:
        """A version not archived leaves every local tier (an upload of it stops at its next
        part; a spill under way ends, then the spill thread removes it)."""
        version.dropped = True
        self.release(version)
        self.unspill(version)
        if counted:
            self.counts["coalesced"] += 1
            self.dropped_steps.append(version.step)
        if self.versions.get(version.step) is version and not version.spilling:
            del self.versions[version.step]
        self.cv.notify_all()

    def coalesce(self, candidates: list[Version], need_bytes: int, newer_than_all: int, include_uploading: bool,
                 why: str) -> bool:
        """Drop versions among `candidates` by the coalescing rule (tier_policy.coalesce) until
        `need_bytes` are freed; warn of it. False where the rule frees too little (nothing dropped)."""
        steps = tier_policy.coalesce([tier_policy.Candidate(v.step, v.nbytes, v.uploading) for v in candidates],
                                     need_bytes, newer_than_all, include_uploading)
        if not steps:
            return False
        for step in steps:
            self.drop(self.versions[step])
        warnings.warn(f"TieredCheckpointer: every tier is full ({why}): dropped version(s) "
                      f"{', '.join(map(str, steps))}, not archived ({self.counts['coalesced']} dropped so far); "
                      "the newest version is kept", RuntimeWarning, stacklevel=3)
        return True
