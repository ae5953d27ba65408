"""The tiered checkpointer's policy: the store's measured throughput and latency, AIMD upload concurrency, an upload bandwidth cap, and the coalescing rule."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence


class AimdWindow:
    """How many parts may be in flight to the store. Additive increase, multiplicative
    decrease, as TCP's congestion window: one more after a part that succeeded within the
    latency target, half (at least `minimum`) after a slow or failed one. A store that is
    slower than versions arrive thus gets fewer concurrent requests, not a growing queue."""

    def __init__(self, initial: int, maximum: int, latency_target_s: float, minimum: int = 1) -> None:
        if not 1 <= minimum <= initial <= maximum:
            raise ValueError(f"concurrency must satisfy 1 <= minimum ({minimum}) <= initial ({initial}) "
                             f"<= maximum ({maximum})")
        if latency_target_s <= 0:
            raise ValueError(f"the latency target must be positive, got {latency_target_s}")
        self.minimum, self.maximum = minimum, maximum
        self.latency_target_s = latency_target_s
        self._limit = initial
        self._lock = threading.Lock()
        self.increases = 0
        self.decreases = 0

    @property
    def limit(self) -> int:
        return self._limit

    def success(self, latency_s: float) -> None:
        if latency_s > self.latency_target_s:
            self._halve()
            return
        with self._lock:
            if self._limit < self.maximum:
                self._limit += 1
                self.increases += 1

    def failure(self) -> None:
        self._halve()

    def _halve(self) -> None:
        with self._lock:
            halved = max(self.minimum, self._limit // 2)
            if halved < self._limit:
                self.decreases += 1
            self._limit = halved


@dataclasses.dataclass(frozen=True)
class _Sample:
    start: float
    end: float
    nbytes: int
    ok: bool


class StoreMeter:
    """The store's recent behaviour: the last `samples` parts (or those of the last `window_s`
    seconds), their throughput (bytes over the time span they covered, so concurrent parts
    add up) and latency."""

    def __init__(self, samples: int = 64, window_s: float = 30.0) -> None:
        self._samples: collections.deque[_Sample] = collections.deque(maxlen=samples)
        self._window_s = window_s
        self._lock = threading.Lock()

    def record(self, start: float, end: float, nbytes: int, ok: bool) -> None:
        with self._lock:
            self._samples.append(_Sample(start, end, nbytes, ok))

    def _recent(self) -> list[_Sample]:
        now = time.monotonic()
        with self._lock:
            return [s for s in self._samples if now - s.end <= self._window_s]

    def summary(self) -> dict[str, float | int | None]:
        recent = self._recent()
        done = [s for s in recent if s.ok]
        latencies = sorted(s.end - s.start for s in done)
        span = (max(s.end for s in done) - min(s.start for s in done)) if done else 0.0
        return {
            "throughput_bytes_per_s": (sum(s.nbytes for s in done) / span) if span > 0 else None,
            "latency_s_mean": (sum(latencies) / len(latencies)) if latencies else None,
            "latency_s_p90": latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))] if latencies else None,
            "recent_parts": len(recent),
            "recent_failures": len(recent) - len(done),
        }


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
