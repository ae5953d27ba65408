"""The bench's measuring primitives: progress lines, timed repetitions, work split over threads."""
from __future__ import annotations

import threading
import time
from typing import Callable


def say(text: str) -> None:
    """A progress line, out at once (the sections run for minutes)."""
    print(text, flush=True)


def timed(work: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeat` calls of work(), after `warmup` untimed ones."""
    for _ in range(warmup):
        work()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        samples.append(time.perf_counter() - started)
    return samples


def split_run(work: Callable[[int, int], object], n: int, threads: int) -> None:
    """Run work(start, stop) on `threads` disjoint slices at once (cffi and numpy drop the GIL)."""
    if threads == 1:
        work(0, n)
        return
    bounds = [n * i // threads for i in range(threads + 1)]
    pool = [threading.Thread(target=work, args=(bounds[i], bounds[i + 1])) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
