"""The OOM bench's throttled sink: ext4 on a loop device, mounted sync, so a blkio v1 write throttle binds every byte written to it.

Why not the disk itself: v1's throttle acts on the I/O a group's own tasks submit (direct
I/O, the writeback their fsync() drives), and a buffered write is submitted later by the
kernel's flusher threads, outside the group. Under a memory cap that escape is large: when
dirty page cache crowds a group at its cap, reclaim wakes the flusher. On /dev/vda itself a
tiered run spilled 2475 MB of which its own tasks wrote only 497 MB under the throttle
(docs/tiers.md). Mounted sync, each write() is on the device before it returns, submitted by
the writing task: all of it passes the throttle.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from .. import cgroups


class SinkUnavailable(RuntimeError):
    """This machine cannot make the sink (no losetup or mkfs.ext4, no loop device): why."""


def _checked(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SinkUnavailable(f"{' '.join(command[:2])} failed: {(result.stderr or result.stdout).strip()[:300]}")
    return result.stdout.strip()


class SyncSink:
    """An image file of `size` bytes (sparse) in `root`, ext4 on a loop device over it, mounted
    with -o sync at root/mnt. `disk` is the loop device's MAJ:MIN (what the throttle names);
    close() unmounts, detaches and deletes the image, whatever state it is in."""

    def __init__(self, root: Path, size: int) -> None:
        for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                raise SinkUnavailable(f"{tool} is not installed")
        self.image, self.mountpoint = root / "sink.img", root / "mnt"
        self.loop: str | None = None
        self.mounted = False
        try:
            with open(self.image, "wb") as image:
                image.truncate(size)
            # nodiscard: the image is sparse already; lazy init off: nothing writes in the
            # background after the mount, so the throttle's count is the workers' alone.
            _checked(["mkfs.ext4", "-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0",
                      str(self.image)])
            self.loop = _checked(["losetup", "--find", "--show", str(self.image)])
            self.mountpoint.mkdir()
            _checked(["mount", "-o", "sync", self.loop, str(self.mountpoint)])
            self.mounted = True
            self.disk = cgroups.disk_of(self.mountpoint)
            self.backing = cgroups.disk_of(root)
        except BaseException:
            self.close()
            raise

    def describe(self) -> str:
        return f"ext4 on {self.loop} ({self.disk}), mounted sync, over an image file on the disk {self.backing}"

    def close(self) -> None:
        if self.mounted:
            for _ in range(20):  # a worker just killed may hold a file a moment longer
                if subprocess.run(["umount", str(self.mountpoint)], capture_output=True).returncode == 0:
                    break
                time.sleep(0.25)
            else:
                subprocess.run(["umount", "-l", str(self.mountpoint)], capture_output=True)
            self.mounted = False
        if self.loop is not None:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
            self.loop = None
        with contextlib.suppress(OSError):
            os.unlink(self.image)

    def __enter__(self) -> "SyncSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
