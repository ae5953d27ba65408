"""A RemoteTransport whose command is cut short (KeyboardInterrupt while its answer is awaited) or aborted from another thread gives its connection up at once: later calls fail with ConnectionAbortedError instead of waiting out the reply timeout."""
from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any, Callable

import pytest

from cossd.client import AdminClient, RemoteTransport
from cossd.client.remote import abort_all
# The server's fixtures (a fresh device served on loopback with a token, stopped after).
from test_server import Served, serve, served, token_file  # noqa: F401

# Longer than any wait here: the old code waited all of it before failing.
REPLY_TIMEOUT_S = 300.0


def _unread_bytes_at(port: int) -> int:
    """The bytes waiting unread in the server's established connections on `port` (from
    /proc/net/tcp): with the server stopped, a command sent and awaited."""
    waiting = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()  # sl, local address:port, remote, state, tx_queue:rx_queue, ...
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # ESTABLISHED
            waiting += int(fields[4].split(":")[1], 16)
    return waiting


def _when_awaited(served: Served, then: Callable[[], Any]) -> threading.Thread:
    """A thread that calls `then` once the stopped server holds a command unread."""
    def watch() -> None:
        deadline = time.monotonic() + 60
        while not _unread_bytes_at(served.port) and time.monotonic() < deadline:
            time.sleep(0.02)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_an_interrupted_command_gives_the_connection_up(served: Served, token_file: Path) -> None:
    """Ctrl-C while a command's answer is awaited: KeyboardInterrupt, and the next command on
    that connection fails at once (before, it waited out the timeout for an answer that the
    stream no longer lines up with)."""
    transport = RemoteTransport(served.url, REPLY_TIMEOUT_S, token_file=token_file)
    client = AdminClient(transport)
    client.describe()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    os.kill(served.pid, signal.SIGSTOP)
    try:
        _when_awaited(served, lambda: signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1))
        with pytest.raises(KeyboardInterrupt):
            client.describe()
        assert not transport.reachable()
        with pytest.raises(ConnectionAbortedError) as lost:
            client.describe()
        assert lost.value.errno == errno.ECONNABORTED and "cut short (KeyboardInterrupt)" in str(lost.value)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        os.kill(served.pid, signal.SIGCONT)
        transport.close()


def test_abort_all_wakes_a_thread_waiting_on_an_answer(served: Served, token_file: Path) -> None:
    """abort_all() (a signal handler's call) while another thread awaits an answer from a
    stopped server: that thread raises ConnectionAbortedError with the reason given, now."""
    transport = RemoteTransport(served.url, REPLY_TIMEOUT_S, token_file=token_file)
    client = AdminClient(transport)
    outcome: dict[str, BaseException] = {}

    def ask() -> None:
        try:
            client.describe()
        except BaseException as exc:  # handed to the test
            outcome["error"] = exc

    os.kill(served.pid, signal.SIGSTOP)
    try:
        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        _when_awaited(served, lambda: None).join()
        assert abort_all("the run was ended by SIGTERM") >= 1
        asking.join(30)
        assert not asking.is_alive(), "the waiting thread was not woken"
        assert isinstance(outcome.get("error"), ConnectionAbortedError), outcome
        assert "the run was ended by SIGTERM" in str(outcome["error"])
        with pytest.raises(ConnectionAbortedError):
            client.describe()  # given up for good
    finally:
        os.kill(served.pid, signal.SIGCONT)
        transport.close()
