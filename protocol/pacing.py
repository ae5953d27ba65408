"""Pacing uploads to an object store: the AIMD window of parts in flight and the store's measured throughput and latency, shared by the device's archiver and the trainer's tiered checkpointer."""
from __future__ import annotations

import collections
import dataclasses
import threading
import time


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
