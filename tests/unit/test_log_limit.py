"""LogLimiter: a bounded share of the log for lines peers can multiply, each window's first lines logged and the next logged line saying how many were not."""
from __future__ import annotations

import logging

import pytest

from cossd.protocol import log_limit
from cossd.protocol.log_limit import LogLimiter


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(log_limit.time, "monotonic", fake)
    return fake


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_a_window_takes_its_lines_and_the_next_logged_line_counts_the_rest(
        clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    limiter = LogLimiter(logging.getLogger("cossd.test.limit"), per_window=2, window_s=1.0)
    with caplog.at_level(logging.WARNING, logger="cossd.test.limit"):
        logged = [limiter.warning(f"refused {n}") for n in range(5)]
        clock.now += 0.5
        assert not limiter.warning("still in the window")
        clock.now += 0.5
        assert limiter.warning("next window")
        assert limiter.warning("and its second line")
    assert logged == [True, True, False, False, False]
    assert _lines(caplog) == [
        "refused 0", "refused 1",
        "next window (4 more such lines not logged: at most 2 every 1 s)",
        "and its second line"]


def test_one_line_a_window_is_once_every_window_from_the_line_before(
        clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    limiter = LogLimiter(logging.getLogger("cossd.test.limit"), window_s=2.0)
    with caplog.at_level(logging.WARNING, logger="cossd.test.limit"):
        assert limiter.warning("first")
        clock.now += 1.9
        assert not limiter.warning("too soon")
        clock.now += 0.1
        assert limiter.warning("due")
        clock.now += 10.0
        assert limiter.warning("quiet since")
    assert _lines(caplog) == ["first", "due (1 more such lines not logged: at most 1 every 2 s)", "quiet since"]
