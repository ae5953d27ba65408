"""Shared fixtures: formatted devices, real FUSE mounts that always unmount, a daemon handle."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

# The source tree's folders are the package's parts (kernels/, tools/, ...), installed under
# `cossd`; with the tree itself on sys.path (`python -m pytest` puts the working directory
# there) they would also import as top-level packages of their own, and a library that looks
# for a package of the same name (transformers probes for Hugging Face's `kernels`) would
# import ours instead. Tests import cossd as users do: installed.
_TREE = Path(__file__).resolve().parents[1]
sys.path[:] = [entry for entry in sys.path if Path(entry or os.getcwd()).resolve() != _TREE]

from cossd.emulator import Device, DeviceConfig  # noqa: E402
from cossd.fs import daemon  # noqa: E402


# Lines of figures (trials, failures) that torture tests report; printed at the end of the run.
FIGURES: list[str] = []


@pytest.fixture
def figures() -> list[str]:
    """Append a line 'what: N trials, M failures' to report it in the run's summary."""
    return FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.write_sep("=", "reliability figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture
def backing(tmp_path: Path) -> Path:
    path = tmp_path / "backing"
    Device.format(path, capacity_bytes=8 << 30, serial="TESTSERIAL0001")
    return path


@pytest.fixture
def device(backing: Path) -> Iterator[Device]:
    with Device.open(backing) as opened:
        yield opened


@pytest.fixture
def sync_device(backing: Path) -> Iterator[Device]:
    with Device.open(backing, DeviceConfig(sync=True)) as opened:
        yield opened


def is_mounted(mountpoint: Path) -> bool:
    target = str(mountpoint.resolve())
    with open("/proc/self/mounts") as mounts:
        return any(line.split()[1] == target for line in mounts)


def force_unmount(mountpoint: Path) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)


def wait_for_exit(pid: int, timeout_s: float = 60.0) -> None:
    if not daemon.wait_for_exit(pid, timeout_s):
        raise TimeoutError(f"daemon {pid} did not exit")


@dataclasses.dataclass
class Mount:
    """A running daemon serving `backing` at `mountpoint`."""

    backing: Path
    mountpoint: Path
    pid: int
    sync: bool = False

    def kill(self) -> None:
        """kill -9 the daemon (a crash), then detach the dead mount."""
        os.kill(self.pid, signal.SIGKILL)
        wait_for_exit(self.pid)
        force_unmount(self.mountpoint)

    def unmount(self) -> None:
        subprocess.run(["fusermount3", "-u", str(self.mountpoint)], check=True)
        wait_for_exit(self.pid)

    def restart(self, verify: str = "background") -> None:
        """Mount again; `verify` as `cossd mount --verify` ("open": every block checked
        before the mount is ready, as recovery did before background verification)."""
        self.pid = daemon.start_background(self.backing, self.mountpoint, sync=self.sync, verify=verify)


def start_mount(backing: Path, mountpoint: Path, sync: bool = False) -> Mount:
    mountpoint.mkdir(exist_ok=True)
    pid = daemon.start_background(backing, mountpoint, sync=sync)
    assert is_mounted(mountpoint)
    return Mount(backing, mountpoint, pid, sync)


def stop_mount(mounted: Mount) -> None:
    """Unmount (lazily, whatever state the daemon is in) and wait for the daemon to exit,
    killing it after 30 s."""
    if is_mounted(mounted.mountpoint):
        force_unmount(mounted.mountpoint)
    try:
        os.kill(mounted.pid, 0)
    except ProcessLookupError:
        return
    try:
        wait_for_exit(mounted.pid, 30)
    except TimeoutError:
        os.kill(mounted.pid, signal.SIGKILL)


@pytest.fixture
def mount(backing: Path, tmp_path: Path) -> Iterator[Mount]:
    """A real FUSE mount of a fresh device, always unmounted (even when the test failed)."""
    mounted = start_mount(backing, tmp_path / "mnt")
    try:
        yield mounted
    finally:
        stop_mount(mounted)
