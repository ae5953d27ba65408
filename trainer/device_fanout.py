"""One call per device of a group (mount=[...]) run at once, a thread per device, and their outcomes gathered in device order: so that the devices of a group step work in parallel."""
from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Sequence

import torch


class Outcome:
    """One device's call: its value, or the exception it raised (then `error` is set)."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


def _no_grad(call: Callable[[Any], Any], item: Any) -> Any:
    # Grad mode is per thread: a worker starts with it on, and a child's reads copy into the
    # model's params (leaves that require grad), as step() does under torch.no_grad().
    with torch.no_grad():
        return call(item)


class DeviceFanout:
    """A thread per device (none for one device: its call runs inline). The devices' work is
    in their daemons or servers and on their links; the trainer's side of it (FUSE file I/O,
    sockets, the CMB copies, the polls' sleeps) releases the GIL, so the calls overlap."""

    def __init__(self, devices: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=devices, thread_name_prefix="cossd-device") if devices > 1 else None

    def run(self, call: Callable[[Any], Any], items: Sequence[Any]) -> list[Outcome]:
        """call(item) for every item at once; each one's Outcome, in the items' order. Returns
        only once every call has ended, even when this thread is interrupted meanwhile (then
        re-raising that): nothing may touch a device's files while its call still runs."""
        if self._pool is None or len(items) < 2:
            outcomes = []
            for item in items:
                try:
                    outcomes.append(Outcome(_no_grad(call, item)))
                except Exception as exc:
                    outcomes.append(Outcome(error=exc))
            return outcomes
        futures = [self._pool.submit(_no_grad, call, item) for item in items]
        try:
            concurrent.futures.wait(futures)
        except BaseException:
            concurrent.futures.wait(futures)
            raise
        outcomes = []
        for future in futures:
            error = future.exception()
            outcomes.append(Outcome(error=error) if error is not None else Outcome(future.result()))
        return outcomes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
