"""start_background when the daemon never says ready: the caller gets a clear error, the daemon
is killed and reaped, and the mount it left behind (answering nothing) is taken off."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import is_mounted
from cossd.client.mounts import MOUNT_FSTYPE, mount_type_at
from cossd.fs import launch

pytestmark = pytest.mark.mount


def test_a_daemon_hung_after_its_mount_is_killed_reaped_and_unmounted(
        backing: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    monkeypatch.setenv("COSSD_FAULT_HOOKS", "hang-before-ready")  # fs/fault_hooks.py
    children_before = _children()
    with pytest.raises(RuntimeError, match=r"mount daemon failed to start \(exit -9\).*log: ") as raised:
        launch.start_background(backing, mountpoint, timeout_s=15)  # room for a slow start on a loaded machine
    # The daemon's last words are in the message: it had mounted and then hung.
    assert "hanging before saying ready" in str(raised.value)
    assert mount_type_at(mountpoint) != MOUNT_FSTYPE and not is_mounted(mountpoint)
    assert _children() == children_before  # reaped: no zombie left behind
    # Killed while in use: the next open recovers as after a crash (the in-use file says so).
    assert (backing / "in-use").exists()


def _children() -> set[int]:
    """This process's children, zombies included."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                found.add(int(entry.name))
    return found


def test_an_interrupt_while_waiting_for_ready_kills_the_daemon_and_takes_its_mount_off(
        backing: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or a bench's signal handler) while the caller waits for "ready": the caller
    never gets the pid, so the start itself must not leave the daemon or its mount behind."""
    import signal
    import time

    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    monkeypatch.setenv("COSSD_FAULT_HOOKS", "hang-before-ready")  # mounted, then waits: the wait is sure
    children_before = _children()

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 3.0)  # the daemon has mounted by then, on a loaded machine too
        with pytest.raises(KeyboardInterrupt):
            launch.start_background(backing, mountpoint, timeout_s=60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    deadline = time.monotonic() + 10
    while mount_type_at(mountpoint) == MOUNT_FSTYPE and time.monotonic() < deadline:
        time.sleep(0.05)  # the lazy unmount is asynchronous
    assert mount_type_at(mountpoint) != MOUNT_FSTYPE and not is_mounted(mountpoint)
    assert _children() == children_before
