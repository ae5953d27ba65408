"""`cossd bench`'s one signal mechanism: SIGTERM, SIGHUP and SIGINT end the run as Ctrl-C does (a KeyboardInterrupt), so every section's teardown runs."""
from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Iterator

from ...client.remote import abort_all

# The signals that end a run. SIGINT is among them (not left to Python's own handler) so
# that Ctrl-C too gives up the server connections at once; one ignored when the block starts
# (SIGINT in a job a shell started in the background, SIGHUP under nohup) stays ignored.
ENDING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class RunInterrupted(KeyboardInterrupt):
    """The run was ended by a signal (a KeyboardInterrupt, so that whatever treats Ctrl-C as
    the user's stop, `finally` blocks and `except Exception` alike, treats all of them alike)."""


class _RunSignals:
    """The state of the one active block: the signals taken (the first one's name is what
    ended the run), how deep the held() blocks are, and whether a held signal waits."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        self.holding = 0
        self.pending = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.ended:  # a second signal: the teardown the first one started is under way
            return
        self.ended.append(signal.Signals(signum).name)
        # Every server connection of this process given up: a thread waiting on an answer
        # (a group's device, a thread each) raises now, not at its 120 s reply timeout.
        abort_all(f"the run was ended by {self.ended[0]}")
        if self.holding:
            self.pending = True  # raised when the held block is done
            return
        raise RunInterrupted(self.ended[0])


_active: list[_RunSignals] = []  # the outermost block's state, while one is open


@contextlib.contextmanager
def signals_end_the_run() -> Iterator[list[str]]:
    """For the block, ENDING_SIGNALS (those not ignored) end the run: server connections are
    given up and RunInterrupted is raised in the main thread, once; a later signal is ignored,
    so the teardown it started is not cut short. Yields the list the signal's name goes into
    (empty while none came). A block inside another (a section the runner started) shares the
    outer one's handler and list: one mechanism. The old handlers are put back after. Outside
    the main thread (where no handler can be set) and outside any block, the list stays empty."""
    if _active:
        yield _active[0].ended
        return
    state = _RunSignals()
    if threading.current_thread() is not threading.main_thread():
        yield state.ended
        return
    previous = {}
    for signum in ENDING_SIGNALS:
        if signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, state.handle)
    _active.append(state)
    try:
        yield state.ended
    finally:
        _active.pop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """A signal that ends the run waits until the block is done (its connections are given
    up at once all the same): for starting a server or a mount and registering it for
    teardown, which an interrupt between the two would leak. Outside signals_end_the_run, and
    outside the main thread (where no handler runs), nothing changes."""
    if not _active or threading.current_thread() is not threading.main_thread():
        yield
        return
    state = _active[0]
    state.holding += 1
    try:
        yield
    finally:
        state.holding -= 1
        # Once the block is done, whether or not it raised: the interrupt replaces an error
        # (which stays its __context__), so no `except Exception` on the way up goes on.
        if state.holding == 0 and state.pending:
            state.pending = False
            raise RunInterrupted(state.ended[0])  # noqa: B012 - on purpose, see above
