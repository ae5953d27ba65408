"""cgroup v1 groups for one worker process: a memory cap (memory controller) and a write-throttled disk (blkio)."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")


def unavailable() -> str | None:
    """Why a worker cannot be capped and throttled here (None: it can): v1 memory and blkio
    hierarchies mounted, writable (root), with the files this module writes."""
    if os.geteuid() != 0:
        return "not root (creating cgroups needs it)"
    for root, needed in ((MEMORY_ROOT, "memory.limit_in_bytes"), (BLKIO_ROOT, "blkio.throttle.write_bps_device")):
        if not (root / needed).exists():
            return f"no cgroup v1 {root.name} controller at {root} ({needed} missing)"
        if not os.access(root, os.W_OK):
            return f"{root} is not writable"
    return None


def disk_of(path: Path) -> str:
    """MAJ:MIN of the whole disk holding `path`, the device blkio rules name (a partition's
    rule is refused: the throttle sits on the disk's request queue). ValueError where `path`
    is not on a block device (tmpfs, overlay, a FUSE mount)."""
    device = os.stat(path).st_dev
    node = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}")
    if not node.exists():
        raise ValueError(f"{path} is not on a block device ({os.major(device)}:{os.minor(device)})")
    if (node / "partition").exists():
        node = node.resolve().parent  # the partition's directory sits inside its disk's
    return (node / "dev").read_text().strip()


class _Group:
    """One child directory of a v1 hierarchy; remove() moves any task left to the root first."""

    def __init__(self, root: Path, name: str) -> None:
        self.path = root / name
        self.path.mkdir()

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        return [int(line) for line in self._read("cgroup.procs").split()]

    def remove(self) -> None:
        if not self.path.exists():
            return
        root = self.path.parent
        for _ in range(50):
            with contextlib.suppress(OSError):
                for pid in self.pids():
                    with contextlib.suppress(OSError):  # gone meanwhile
                        (root / "cgroup.procs").write_text(str(pid))
                self.path.rmdir()
                return
            time.sleep(0.1)  # a task still exiting holds the group for a moment
        self.path.rmdir()  # the last try: its OSError says why


class MemoryGroup(_Group):
    """A memory cap. memsw (memory + swap) is capped too where the kernel has it, so a worker
    over its cap cannot escape into swap; both stay at the cap."""

    def __init__(self, name: str, limit: int) -> None:
        super().__init__(MEMORY_ROOT, name)
        try:
            self.limit = int(self._read("memory.limit_in_bytes"))  # a new group's: no limit
            self.set_limit(limit)
        except BaseException:
            self.remove()
            raise

    def set_limit(self, limit: int) -> None:
        # memsw must stay >= the memory limit at every moment: raise it first, lower it last.
        memsw = (self.path / "memory.memsw.limit_in_bytes").exists()
        raising = limit > self.limit
        if memsw and raising:
            self._write("memory.memsw.limit_in_bytes", str(limit))
        self._write("memory.limit_in_bytes", str(limit))
        if memsw and not raising:
            self._write("memory.memsw.limit_in_bytes", str(limit))
        self.limit = limit

    def usage(self) -> int:
        return int(self._read("memory.usage_in_bytes"))

    def stat(self) -> dict[str, int]:
        """memory.stat: `rss` is anonymous memory (what a process allocates), `cache` the page
        cache charged to the group (files it wrote, reclaimable once clean)."""
        return {key: int(value) for key, value in (line.split() for line in self._read("memory.stat").splitlines())}

    def oom_control(self) -> dict[str, int]:
        """under_oom, and oom_kill: how many tasks the kernel's OOM killer killed in the group."""
        return {key: int(value) for key, value in (line.split() for line in self._read("memory.oom_control").splitlines())}

    def failcnt(self) -> int:
        """How often a charge hit the cap (and reclaim had to run). With memsw capped at the
        same bound and no swap, memsw's counter is the one that meets it first."""
        counts = [int(self._read("memory.failcnt"))]
        if (self.path / "memory.memsw.failcnt").exists():
            counts.append(int(self._read("memory.memsw.failcnt")))
        return max(counts)

    def max_usage(self) -> int:
        return int(self._read("memory.max_usage_in_bytes"))


class BlkioThrottle(_Group):
    """Writes to one disk by the group's tasks limited to `bytes_per_s`. v1 throttles what its
    tasks submit: direct I/O and the writeback their fsync() drives, not the page cache's
    background flush (a kernel thread's); the bench measures that it binds."""

    def __init__(self, name: str, disk: str, bytes_per_s: int) -> None:
        super().__init__(BLKIO_ROOT, name)
        self.disk = disk
        try:
            self._write("blkio.throttle.write_bps_device", f"{disk} {bytes_per_s}")
        except BaseException:
            super().remove()
            raise

    def written(self) -> int:
        """Bytes the group's tasks wrote to the disk, as the throttle counted them."""
        for line in self._read("blkio.throttle.io_service_bytes").splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == self.disk and parts[1] == "Write":
                return int(parts[2])
        return 0

    def remove(self) -> None:
        with contextlib.suppress(OSError):  # a rule of 0 deletes it
            self._write("blkio.throttle.write_bps_device", f"{self.disk} 0")
        super().remove()
