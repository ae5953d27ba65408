"""An ext4 filesystem on a plain NVM namespace of a mount, loop-mounted: where the conventional
checkpoints go, so the same emulated drive counts their bytes (needs root)."""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

from ..protocol.status import DeviceError, Status
from ..client import AdminClient

log = logging.getLogger(__name__)

# mkfs writes every inode table and the whole journal now: nothing is initialised in the
# background after the mount (ext4lazyinit), so the drive's counters during a run count only
# what the run wrote. A FUSE file takes no discard, so mkfs does not try.
MKFS_OPTIONS = ("-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0,nodiscard")
COMMAND_TIMEOUT_S = 120.0


def _run(command: list[str], timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)


def _checked(command: list[str]) -> str:
    result = _run(command)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {(result.stderr or result.stdout).strip()}")
    return result.stdout.strip()


def syncfs(path: Path) -> None:
    """Write back everything dirty on the filesystem holding `path` (only that filesystem)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
    finally:
        os.close(fd)


def loop_devices_of(backing_file: Path) -> list[str]:
    """The loop devices attached to `backing_file` (losetup -j); none where there is no losetup."""
    try:
        result = _run(["losetup", "-j", str(backing_file)])
    except FileNotFoundError:
        return []
    return [line.split(":", 1)[0] for line in result.stdout.splitlines() if line.strip()]


class NvmVolume:
    """A plain NVM namespace `name` of the cossd mount `mountpoint`, with ext4 on its `data` file
    through a loop device, mounted at `directory`.

    Use it as a context manager: leaving it always unmounts the filesystem and detaches the loop
    device, also when the run inside failed (with a lazy unmount if the filesystem is still
    busy); the namespace itself is deleted unless keep_namespace. With create=False it mounts
    the filesystem an earlier volume left on the existing namespace `name`.
    """

    def __init__(self, mountpoint: Path, name: str, size_bytes: int, directory: Path, *,
                 keep_namespace: bool = False, create: bool = True) -> None:
        self.mountpoint = Path(mountpoint)
        self.name = name
        self.size_bytes = size_bytes
        self.path = Path(directory)
        self.keep_namespace = keep_namespace
        self.create = create
        self.data_file = self.mountpoint / "ns" / name / "data"
        self.loop_device: str | None = None
        self.nsid: int | None = None
        self.mounted = False

    # ------------------------------------------------------------------ setup

    def open(self) -> "NvmVolume":
        try:
            with AdminClient(self.mountpoint) as admin:
                if self.create:
                    self.nsid = admin.create_namespace(
                        {"name": self.name, "kind": "nvm", "capacity_bytes": self.size_bytes})
                else:
                    self.nsid = admin.nsid(self.name)
            if self.create:
                _checked(["mkfs.ext4", *MKFS_OPTIONS, str(self.data_file)])
            # losetup, then mount: the loop device is known by name, so close() can always
            # detach it, whatever state the mount is in.
            self.loop_device = _checked(["losetup", "--find", "--show", str(self.data_file)])
            self.path.mkdir(parents=True, exist_ok=True)
            _checked(["mount", "-t", "ext4", self.loop_device, str(self.path)])
            self.mounted = True
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> "NvmVolume":
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the drive's counters

    def statistics(self) -> dict[str, Any]:
        """The namespace's statistics as the drive counts them (NAMESPACE_STATISTICS, as in C0h)."""
        if self.nsid is None:
            raise DeviceError(Status.INVALID_NAMESPACE, f"volume {self.name!r} is not open")
        with AdminClient(self.mountpoint) as admin:
            return admin.statistics(self.nsid)

    def settle(self) -> dict[str, Any]:
        """Write back what the filesystem still holds dirty, then read the counters."""
        syncfs(self.path)
        return self.statistics()

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Unmount, detach the loop device, delete the namespace; each step is tried even if an
        earlier one failed, and the first failure is raised at the end."""
        failures: list[str] = []
        if self.mounted:
            result = _run(["umount", str(self.path)])
            if result.returncode != 0:
                # Busy (a writer thread of a failed run): detach now, freed when it lets go.
                log.warning("umount %s: %s; unmounting lazily", self.path, result.stderr.strip())
                result = _run(["umount", "-l", str(self.path)])
                if result.returncode != 0:
                    failures.append(f"umount {self.path}: {result.stderr.strip()}")
            self.mounted = False
        devices = {self.loop_device} if self.loop_device else set()
        if self.data_file.exists():
            devices.update(loop_devices_of(self.data_file))
        for device in sorted(devices):
            result = _run(["losetup", "-d", device])
            if result.returncode != 0 and device in loop_devices_of(self.data_file):
                failures.append(f"losetup -d {device}: {result.stderr.strip()}")
        self.loop_device = None
        if self.nsid is not None and not self.keep_namespace:
            try:
                with AdminClient(self.mountpoint) as admin:
                    admin.delete_namespace(self.nsid)
            except (OSError, DeviceError) as exc:
                failures.append(f"deleting namespace {self.name!r}: {exc}")
            self.nsid = None
        if failures:
            raise RuntimeError("; ".join(failures))
