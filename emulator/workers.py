"""The device's kernel workers: the threads that step gradient blocks and split large CMB
copies, one pool per device (a namespace opened on its own gets a pool of its own)."""
from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any, Callable


class KernelWorkers:
    """A thread pool started on first use, one thread per usable core (at least two): the
    kernels and the file writes release the GIL, so blocks run in parallel."""

    def __init__(self, name: str = "cossd-block") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def threads(self) -> int:
        return max(2, len(os.sched_getaffinity(0)))

    def submit(self, function: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the kernel workers are shut down")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.threads, thread_name_prefix=self._name)
            return self._pool.submit(function, *args)

    def shutdown(self) -> None:
        """Wait for the queued work and stop the threads; a later submit is refused."""
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True)
