"""The tiered checkpointer's policy: the store's measured throughput and latency and the AIMD upload concurrency (protocol/pacing.py, shared with the device's archiver), an upload bandwidth cap, and the coalescing rule."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

from ...protocol.pacing import AimdWindow, StoreMeter

__all__ = ["AimdWindow", "Candidate", "StoreMeter", "TokenBucket", "coalesce"]


class TokenBucket:
    """An upload bandwidth cap (bytes per second, with one second's burst): a way to leave a
    shared link to training traffic, and the tests' way to hold an upload open on any store."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"upload_bytes_per_s must be positive, got {bytes_per_s}")
        self.rate = float(bytes_per_s)
        self._tokens = self.rate
        self._stamp = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int, stop: threading.Event) -> None:
        """Wait until `nbytes` may go (a part larger than the burst waits for its whole size),
        or until `stop` is set."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.rate, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            stop.wait(wait)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What the coalescing rule needs to know of a version."""

    step: int
    nbytes: int
    uploading: bool


def coalesce(candidates: Sequence[Candidate], need_bytes: int, newer_than_all: int,
             include_uploading: bool) -> list[int]:
    """The coalescing rule: the steps to drop so that `need_bytes` become free, or [] when
    dropping every eligible version would not free them (then nothing is dropped).

    Eligible: versions not yet archived (the caller passes only those, in one tier) that are
    older than `newer_than_all` (the version that needs the room, itself never dropped: the
    newest is always kept), oldest first; the one being uploaded only when
    `include_uploading` (after the bounded stall), since its upload is progress already paid for."""
    eligible = sorted((c for c in candidates if c.step < newer_than_all and (include_uploading or not c.uploading)),
                      key=lambda c: (c.uploading, c.step))
    chosen: list[int] = []
    freed = 0
    for candidate in eligible:
        if freed >= need_bytes:
            break
        chosen.append(candidate.step)
        freed += candidate.nbytes
    return chosen if freed >= need_bytes else []
