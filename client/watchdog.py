"""Time limits on blocking calls to a device: a hung daemon becomes DeviceTimeoutError."""
from __future__ import annotations

import concurrent.futures
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

# How long a client waits for one answer before declaring the daemon hung (None: forever).
DEFAULT_TIMEOUT_S = 120.0

T = TypeVar("T")


class DeviceTimeoutError(TimeoutError):
    """The daemon did not answer in time: stopped (SIGSTOP), hung or badly overloaded."""


class Watchdog:
    """Runs blocking calls on a worker thread, so a hung daemon becomes a DeviceTimeoutError.

    A system call on a FUSE file whose daemon is stopped blocks until the daemon resumes or
    dies. The worker is a daemon thread: if it stays stuck, it does not hold up exit. Once a
    call timed out, every later call fails at once (the worker is still stuck in the old one).
    """

    def __init__(self, mountpoint: Path, timeout_s: float | None) -> None:
        self.mountpoint = mountpoint
        self.timeout_s = timeout_s
        self._jobs: "queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None]" = (
            queue.SimpleQueue())
        self._worker: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stuck: str | None = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(work())
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                    future.set_exception(exc)

    def call(self, work: Callable[[], T], *, if_late: Callable[[T], None] | None = None) -> T:
        """work(), or DeviceTimeoutError after timeout_s. `if_late` receives the result of a
        call that completes after it timed out (to close a file that opened too late)."""
        if self.timeout_s is None:
            return work()
        if self._stuck is not None:
            raise DeviceTimeoutError(self._stuck)
        with self._start_lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="cossd-io", daemon=True)
                self._worker.start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((work, future))
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            if if_late is not None:
                future.add_done_callback(
                    lambda done: if_late(done.result()) if done.exception() is None else None)
            self._stuck = (
                f"the cossd daemon at {self.mountpoint} did not answer within {self.timeout_s:g} s "
                "(stopped, hung or overloaded?); check its process, then remount if it is gone"
            )
            raise DeviceTimeoutError(self._stuck) from None

    @property
    def stuck(self) -> bool:
        return self._stuck is not None

    def close_later(self, fd: int) -> None:
        """Close `fd` without waiting: a close is a request the daemon must answer too."""
        threading.Thread(target=close_quietly, args=(fd,), name="cossd-close", daemon=True).start()

    def close(self) -> None:
        if self._worker is not None and self._stuck is None:
            self._jobs.put(None)
        self._worker = None


def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
