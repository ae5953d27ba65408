"""A remote mount's daemon (`cossd mount cossd://...`) signalled while one of its requests waits on a stopped server ends at once, unmounted, instead of at its client's reply timeout."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import force_unmount, is_mounted, wait_for_exit
from helpers import run_cli
# The server's fixtures (a fresh device served on loopback with a token, stopped after).
from test_server import Served, serve, served, token_file  # noqa: F401

pytestmark = pytest.mark.mount

# Longer than the test would ever wait: before the fix the daemon ended only at this timeout.
REPLY_TIMEOUT_S = 300


def _unread_bytes_at(port: int) -> int:
    """The bytes waiting unread in the server's established connections on `port` (from
    /proc/net/tcp): with the server stopped, a request the daemon sent and awaits."""
    waiting = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()  # sl, local address:port, remote, state, tx_queue:rx_queue, ...
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # ESTABLISHED
            waiting += int(fields[4].split(":")[1], 16)
    return waiting


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_the_daemon_while_a_request_waits_on_a_stopped_server(
        served: Served, token_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], signum: int) -> None:
    mountpoint = tmp_path / "rmnt"
    mountpoint.mkdir()
    code, out, err = run_cli(capsys, "mount", served.url, mountpoint, "--token-file", token_file, "--timeout",
                             REPLY_TIMEOUT_S, "--log-file", tmp_path / "rmnt.log", "-o", "json")
    assert code == 0, err
    daemon_pid = json.loads(out)["pid"]
    os.kill(served.pid, signal.SIGSTOP)
    lookup = None
    try:
        # A name never looked up: the kernel asks the daemon, which asks the server.
        lookup = subprocess.Popen(["stat", str(mountpoint / "ns" / "never-looked-up")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while not _unread_bytes_at(served.port):
            assert time.monotonic() < deadline, "the daemon never asked the stopped server"
            time.sleep(0.05)
        os.kill(daemon_pid, signum)
        wait_for_exit(daemon_pid, 60)  # not REPLY_TIMEOUT_S: the request fails at once
        assert not is_mounted(mountpoint)
        assert lookup.wait(30) != 0  # the request failed (the connection closed), not answered
        log = (tmp_path / "rmnt.log").read_text()
        assert f"signal {int(signum)}: unmounting" in log and "unmounted" in log, log
    finally:
        os.kill(served.pid, signal.SIGCONT)
        if lookup is not None and lookup.poll() is None:
            lookup.kill()
            lookup.wait()
        if is_mounted(mountpoint):
            force_unmount(mountpoint)
        try:
            wait_for_exit(daemon_pid, 15)
        except TimeoutError:
            os.kill(daemon_pid, signal.SIGKILL)
