"""Streamed gradients sent in buckets: what backward made while the last send was in flight goes to the device in one command."""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable, Generic, TypeVar

Item = TypeVar("Item")


class GradBuckets(Generic[Item]):
    """A queue of one step's streamed gradients and the one thread that sends them.

    The first gradient backward makes goes out at once; the ones it makes while that send is
    in flight wait and then go together, in one command. So the buckets size themselves to
    the device's pace: no fixed bucket size to tune, no waiting for a bucket to fill while the
    device idles, and one command round trip per bucket instead of one per tensor (a GPT's
    layer norms and biases are many tensors of a few KB each)."""

    def __init__(self, send: Callable[[list[Item]], object], name: str = "cossd-grads") -> None:
        self._send = send
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._queued: list[Item] = []
        self._drain_scheduled = False  # a send is queued on the writer that will take _queued
        self._sends: list[concurrent.futures.Future[object]] = []

    def put(self, item: Item) -> None:
        """Queue one gradient; it leaves with the next send (from any thread: autograd's)."""
        with self._lock:
            self._queued.append(item)
            if self._drain_scheduled:
                return
            self._drain_scheduled = True
            self._sends.append(self._writer.submit(self._drain))

    def _drain(self) -> object:
        with self._lock:
            batch, self._queued = self._queued, []
            self._drain_scheduled = False
        return self._send(batch) if batch else 0

    def wait(self) -> None:
        """Until every queued gradient has been sent; the first send's error is raised (the
        rest of the step's sends are cancelled where they had not started)."""
        with self._lock:
            sends = list(self._sends)
        try:
            for future in sends:
                future.result()
        except BaseException:
            self.cancel()
            raise
        self.clear()

    def cancel(self) -> None:
        """Drop what is queued and wait for the send in flight (an aborted step)."""
        with self._lock:
            self._queued.clear()
            sends = list(self._sends)
        for future in sends:
            future.cancel()
        concurrent.futures.wait(sends)
        with self._lock:
            # A drain cancelled before it ran leaves the flag set: the next put must schedule one.
            self._drain_scheduled = False
            self._sends.clear()

    def clear(self) -> None:
        with self._lock:
            self._sends = [future for future in self._sends if not future.done()]

    def close(self) -> None:
        self._writer.shutdown(wait=True)
