"""`cossd bench` on SIGTERM, SIGHUP or Ctrl-C: every section's teardown runs (no server, mount daemon or mount of the run left), the run says so and exits 128 + the signal; the one handler (harness/bench/interrupt.py) tested on its own."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cossd.harness.bench import interrupt

SERVER_MODULE = "cossd.server.command"
MOUNT_MODULE = "cossd.fs.mount_main"


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # gone while looked at
    return found


def _mounts_under(folder: Path) -> list[str]:
    prefix = str(folder).rstrip("/") + "/"
    with open("/proc/mounts") as mounts:
        return [line.split()[1] for line in mounts if line.split()[1].startswith(prefix)]


def _still_running(pid: int, cmdline: str) -> bool:
    """Whether `pid` still runs the command it ran (not a zombie, not a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        now = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and now == cmdline


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_mid_net_section_leaves_no_server_or_mount(tmp_path: Path, signum: int) -> None:
    """The net section at a tiny size, signalled once its storage server (`cossd serve`) and
    its local mount are both up and the server is stopped (SIGSTOP: a command to it waits on
    an answer that does not come): the run exits at once with 128 + the signal, says it was
    interrupted, and neither process, nor any mount under the run's folder, nor the folder is
    left. (Before the run's handler, SIGTERM and SIGHUP killed the bench outright: the server
    and the mount daemon, each in a session of its own, ran on, the device mounted; Ctrl-C
    ended it through a KeyboardInterrupt traceback.)"""
    process = subprocess.Popen([sys.executable, "-m", "cossd.tools.cli", "bench", "--sections", "net",
                                "--net-elements", "4096", "--repeat", "1", "--output", str(tmp_path / "out")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
                               # SIGINT as a terminal delivers it: a suite started in the background
                               # inherits SIGINT ignored, which the run would (rightly) keep ignoring.
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: dict[int, str] = {}
    folder: Path | None = None
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            assert time.monotonic() < deadline, f"the run's server and mount never came up: {seen}"
            seen |= {pid: line for pid, line in _children(process.pid).items()
                     if SERVER_MODULE in line or MOUNT_MODULE in line}
            servers = [line for line in seen.values() if SERVER_MODULE in line]
            if servers and folder is None:
                # `cossd serve <run folder>/served/backing ...`: the section's folder.
                folder = Path(servers[0].split(SERVER_MODULE, 1)[1].split()[0]).parent.parent
            if folder is not None and _mounts_under(folder):
                break
            time.sleep(0.02)
        # The mount daemon started after the last look at the children: one more.
        seen |= {pid: line for pid, line in _children(process.pid).items() if MOUNT_MODULE in line}
        assert any(MOUNT_MODULE in line for line in seen.values()), seen
        for pid, line in seen.items():
            if SERVER_MODULE in line and _still_running(pid, line):
                os.kill(pid, signal.SIGSTOP)
        process.send_signal(signum)
        output = process.communicate(timeout=60)[0].decode()
        assert process.returncode == 128 + signum, output
        assert f"cossd bench: interrupted by {signal.Signals(signum).name}: its servers, mounts" in output, output
        assert not [pid for pid, line in seen.items() if _still_running(pid, line)], output
        assert _mounts_under(folder) == [] and not folder.exists(), output
        assert not (tmp_path / "out").exists()  # no report of a cut-short run
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        # Whatever the old code left (servers, mount daemons, their mounts): not into the next test.
        for pid, line in seen.items():
            if _still_running(pid, line):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if folder is not None:
            for mountpoint in _mounts_under(folder):
                subprocess.run(["umount", "-l", mountpoint], check=False)
            shutil.rmtree(folder, ignore_errors=True)


def test_the_first_signal_interrupts_once_and_a_second_is_ignored() -> None:
    """In the block, SIGTERM raises RunInterrupted (a KeyboardInterrupt) with its name noted;
    another signal during the teardown changes nothing; the old handler is back after."""
    before = signal.getsignal(signal.SIGTERM)
    torn_down = False
    with pytest.raises(interrupt.RunInterrupted) as raised:
        with interrupt.signals_end_the_run() as ended:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this is over
            finally:
                os.kill(os.getpid(), signal.SIGHUP)  # ignored: the teardown goes on
                os.kill(os.getpid(), signal.SIGINT)
                torn_down = True
    assert isinstance(raised.value, KeyboardInterrupt) and torn_down
    assert ended == ["SIGTERM"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_waits_for_a_held_block_and_a_nested_block_shares_the_handler() -> None:
    """A signal inside held() is raised only once the block is done (so a start and its
    registration for teardown are never cut apart), and replaces an error the block raised;
    a block inside another installs nothing of its own and shares the outer one's record."""
    steps = []
    with interrupt.signals_end_the_run() as outer:
        handler = signal.getsignal(signal.SIGTERM)
        with interrupt.signals_end_the_run() as inner:
            assert inner is outer and signal.getsignal(signal.SIGTERM) is handler
        with pytest.raises(interrupt.RunInterrupted):
            with interrupt.held():
                os.kill(os.getpid(), signal.SIGTERM)
                steps.append("started")
                steps.append("registered")
        assert steps == ["started", "registered"] and outer == ["SIGTERM"]
    with pytest.raises(interrupt.RunInterrupted) as raised:
        with interrupt.signals_end_the_run():
            with interrupt.held():
                os.kill(os.getpid(), signal.SIGTERM)
                raise OSError("the start failed")
    assert isinstance(raised.value.__context__, OSError)


def test_an_ignored_signal_stays_ignored() -> None:
    """SIGHUP ignored (nohup) when the run starts stays ignored in it: the run goes on."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interrupt.signals_end_the_run() as ended:
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
        assert ended == []
    finally:
        signal.signal(signal.SIGHUP, previous)



def test_servers_and_mount_daemons_a_teardown_left_are_stopped(tmp_path: Path) -> None:
    """The runner's last resort after an interrupt: a storage server and a mount daemon this
    process started and no teardown stopped (as a signal during a start that nothing held
    off leaves them) are stopped, the mount taken off; children it was told to spare are not."""
    from cossd.emulator import Device
    from cossd.fs import daemon
    from cossd.harness.bench import runner
    from cossd.harness.served import ServedDevice, write_token

    Device.format(tmp_path / "served")
    Device.format(tmp_path / "spared")
    Device.format(tmp_path / "mounted")
    (tmp_path / "mnt").mkdir()
    token = write_token(tmp_path / "token")
    others = {pid for pid, _ in runner._daemon_children()}  # the suite's own, if any
    server, spared = ServedDevice(tmp_path / "served", token), ServedDevice(tmp_path / "spared", token)
    mount_pid = daemon.start_background(tmp_path / "mounted", tmp_path / "mnt")
    try:
        stopped = runner.stop_leftover_children(others | {spared.pid})
        assert sorted(stopped) == sorted([f"pid {server.pid} (cossd.server.command)",
                                          f"pid {mount_pid} (cossd.fs.mount_main)"])
        assert not Path(f"/proc/{server.pid}").exists() and not Path(f"/proc/{mount_pid}").exists()
        assert _mounts_under(tmp_path) == []
        assert Path(f"/proc/{spared.pid}").exists()
    finally:
        spared.stop()
        server.stop(5)
        if _mounts_under(tmp_path):
            daemon.stop_background(tmp_path / "mnt", mount_pid)
