"""Waiting in tests for what another thread or process does later: poll with a deadline, never a bare sleep."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.02) -> T:
    """Call `probe` until it returns something true, and return that; past `timeout_s`, return
    its last answer, so that the caller's own assert says what was wrong. A loaded 2-core CI
    machine can stall any thread for a second or more: a deadline of seconds costs nothing
    when things go right."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = probe()
        if answer or time.monotonic() >= deadline:
            return answer
        time.sleep(interval_s)
