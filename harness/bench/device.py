"""The bench's devices: a temporary device mounted with one tensor, and where its backing lives (disk or tmpfs)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ...client import AdminClient
from ...emulator import Device
from ...fs import daemon


class BenchDevice:
    """A temporary device, mounted, with one namespace of a single n-element tensor."""

    def __init__(self, workdir: Path, n: int, io_threads: int | None = None) -> None:
        self.backing, self.mountpoint = workdir / "backing", workdir / "mnt"
        self.mountpoint.mkdir()
        Device.format(self.backing)
        self.pid = daemon.start_background(self.backing, self.mountpoint, io_threads=io_threads)
        self.front_end = ("pyfuse3 alone" if io_threads == 0
                          else f"data path, {io_threads or daemon.io_threads_from_env()} threads")
        with AdminClient(self.mountpoint) as admin:
            admin.create_namespace({"name": "bench", "tensors": [["w", n]]})
        self.tensor = self.mountpoint / "ns" / "bench" / "tensors" / "w"
        self.n = n

    def stop(self) -> None:
        daemon.stop_background(self.mountpoint, self.pid)


def filesystem_of(path: Path) -> str:
    """The filesystem type and source that hold `path` ('ext4 /dev/vda'), from /proc/mounts."""
    best, found = "", "unknown"
    target = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            source, point, kind = line.split()[:3]
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, found = point, f"{kind} {source}"
    return found


def ram_workdir_available() -> bool:
    """Whether /dev/shm is a writable tmpfs here (ram_workdir can make a directory)."""
    shm = Path("/dev/shm")
    return shm.is_dir() and filesystem_of(shm).startswith("tmpfs") and os.access(shm, os.W_OK)


def ram_workdir() -> Path | None:
    """A fresh directory on /dev/shm (tmpfs), where this machine has one."""
    if not ram_workdir_available():
        return None
    return Path(tempfile.mkdtemp(prefix="cossd-bench-ram-", dir="/dev/shm"))
