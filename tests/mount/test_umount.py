"""Unmounting and mount points, attacked as users meet them: a remote mount's daemon detached by anyone (a
reconnected server, a stopped one), a busy umount, a device mounted onto a mount, `cossd list` of a shadowed one."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.emulator import Device
from cossd.fs import launch
from cossd.fs.remote.daemon import daemon_pid
from served import ServedDevice, write_token
from helpers import run_cli
from waiting import wait_until

pytestmark = pytest.mark.mount

# A client timeout far longer than any bound below: a daemon that only ends when a stuck
# request times out fails these tests.
LONG_TIMEOUT_S = 120


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServedDevice]:
    backing = tmp_path / "served"
    Device.format(backing, capacity_bytes=1 << 30, serial="SERVEDSERIAL01")
    served = ServedDevice(backing, write_token(tmp_path / "token"))
    try:
        yield served
    finally:
        try:
            os.kill(served.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        served.stop()


def _mount_remote(capsys: pytest.CaptureFixture[str], server: ServedDevice, mountpoint: Path) -> int:
    mountpoint.mkdir(exist_ok=True)
    code, out, err = run_cli(capsys, "mount", server.url, mountpoint, "--token-file", server.token_file,
                             "--timeout", LONG_TIMEOUT_S, "--log-file", mountpoint.with_suffix(".log"), "-o", "json")
    assert code == 0, err
    return int(json.loads(out)["pid"])


def _cleanup(mountpoint: Path, pid: int) -> None:
    if is_mounted(mountpoint):
        force_unmount(mountpoint)
    try:
        wait_for_exit(pid, 15)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)


def test_a_lazily_detached_remote_mount_ends_its_daemon_though_a_file_stays_open(
        server: ServedDevice, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The server killed and restarted (the mount reconnects), a trainer's file still open,
    then `fusermount3 -u -z`: the mount is gone from every path, so its daemon must go too
    (before, it served the detached mount until the file was closed: forever for a trainer
    that keeps it)."""
    mountpoint = tmp_path / "rmnt"
    pid = _mount_remote(capsys, server, mountpoint)
    held = -1
    try:
        code, _, err = run_cli(capsys, "create-ns", mountpoint, "k", "--tensor", "x:100")
        assert code == 0, err
        server.crash()
        server.restart()
        assert wait_until(lambda: _step_of(mountpoint) == "0\n", 30)  # reconnected
        held = os.open(mountpoint / "ns/k/tensors/x/param", os.O_RDONLY)
        subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=True, capture_output=True)
        assert not is_mounted(mountpoint)
        wait_for_exit(pid, 20)
        assert "was detached" in mountpoint.with_suffix(".log").read_text()
        with pytest.raises(OSError) as failed:  # the holder gets an error, not a hang
            os.pread(held, 10, 0)
        assert failed.value.errno == errno.ENOTCONN
    finally:
        if held >= 0:
            try:
                os.close(held)  # frees it, though the connection is gone (ENOTCONN)
            except OSError:
                pass
        _cleanup(mountpoint, pid)


def _step_of(mountpoint: Path) -> str | None:
    try:
        return (mountpoint / "ns/k/step").read_text()
    except OSError:
        return None


def test_umount_of_a_remote_mount_whose_server_stopped_is_bounded(
        server: ServedDevice, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A request in flight on a stopped server (SIGSTOP): `cossd umount --lazy` returns and the
    daemon exits within seconds, not after the request's 120 s timeout; the stuck caller gets
    an error, not a hang."""
    mountpoint = tmp_path / "rmnt"
    pid = _mount_remote(capsys, server, mountpoint)
    outcome: list[object] = []
    try:
        os.kill(server.pid, signal.SIGSTOP)

        def stuck_stat() -> None:
            try:
                outcome.append(os.stat(mountpoint / "ns" / "anything"))
            except OSError as exc:
                outcome.append(exc.errno)

        caller = threading.Thread(target=stuck_stat, daemon=True)
        caller.start()
        caller.join(0.5)
        assert caller.is_alive()  # waiting on the stopped server
        code, _, err = run_cli(capsys, "umount", mountpoint, "--lazy", "--timeout", 30)
        assert code == 0, err
        assert not is_mounted(mountpoint)
        wait_for_exit(pid, 5)  # umount waited for it
        caller.join(15)
        assert not caller.is_alive() and outcome and isinstance(outcome[0], int), outcome
    finally:
        _cleanup(mountpoint, pid)


def test_umount_names_the_pid_when_the_daemon_outlives_its_timeout(
        server: ServedDevice, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A daemon that cannot exit (stopped): the mount is detached, and umount gives up after
    --timeout with a line naming the mount and the pid, never waiting on."""
    mountpoint = tmp_path / "rmnt"
    pid = _mount_remote(capsys, server, mountpoint)
    try:
        os.kill(pid, signal.SIGSTOP)
        code, _, err = run_cli(capsys, "umount", mountpoint, "--timeout", 1)
        assert code == 1, err
        assert f"pid {pid}" in err and str(mountpoint) in err and "still running after 1 s" in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not is_mounted(mountpoint)
    finally:
        os.kill(pid, signal.SIGCONT)
        _cleanup(mountpoint, pid)


def test_a_busy_umount_names_what_holds_it(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    """A shell's working directory in the mount: one line naming the process and the way out,
    not fusermount3's bare EBUSY; the mount stays."""
    holder = subprocess.Popen(["sleep", "60"], cwd=mount.mountpoint / "ns")
    try:
        code, _, err = run_cli(capsys, "umount", mount.mountpoint)
        assert code == 1
        assert f"in use by pid {holder.pid} (sleep): cwd" in err and "--lazy" in err, err
        assert len(err.strip().splitlines()) == 1
        assert is_mounted(mount.mountpoint)
    finally:
        holder.kill()
        holder.wait()
    code, _, err = run_cli(capsys, "umount", mount.mountpoint)
    assert code == 0, err


def test_a_device_mounted_onto_a_mount_is_refused_and_nothing_starts(
        mount: Mount, server: ServedDevice, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other"
    Device.format(other, capacity_bytes=1 << 30, serial="OTHERSERIAL001")
    before = Path("/proc/self/mountinfo").read_text().count(f" {mount.mountpoint} ")
    for argv in (["mount", other, mount.mountpoint], ["mount", other, mount.mountpoint, "--foreground"],
                 ["mount", server.url, mount.mountpoint, "--token-file", server.token_file]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 1 and "already a mount point (fuse.cossd)" in err, (argv, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert Path("/proc/self/mountinfo").read_text().count(f" {mount.mountpoint} ") == before == 1
    assert not (other / "daemon.log").exists()  # no daemon started for it
    assert daemon_pid(mount.mountpoint) is None  # no remote daemon either


def test_list_reads_a_shadowed_mount_from_its_own_backing(mount: Mount, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two devices on one mountpoint (made as before the refusal, by skipping the check): each
    row says its own serial, the hidden one marked shadowed (before, both said the top one's)."""
    top = tmp_path / "top"
    Device.format(top, capacity_bytes=1 << 30, serial="TOPSERIAL00001")
    monkeypatch.setattr(launch, "check_mountpoint", lambda mountpoint: None)
    pid = launch.start_background(top, mount.mountpoint)
    try:
        code, out, err = run_cli(capsys, "list", "-o", "json")
        assert code == 0, err
        rows = {row["Backing"]: row for row in json.loads(out)["cossd"]["Devices"]
                if row["DevicePath"] == str(mount.mountpoint)}
        assert rows[str(mount.backing)]["SerialNumber"] == "TESTSERIAL0001"
        assert rows[str(mount.backing)]["State"].startswith("shadowed")
        assert rows[str(top)]["SerialNumber"] == "TOPSERIAL00001" and rows[str(top)]["State"] == "live"
    finally:
        subprocess.run(["fusermount3", "-u", str(mount.mountpoint)], capture_output=True)  # the top one
        wait_for_exit(pid, 30)
