"""Simulated power loss: remember what the backing store has synced, and build the disk a cut leaves.

A PowerLossRecorder is installed as the media layer's hooks. It keeps, per inode, the bytes
as of that file's last fsync, and per directory the entries as of its last fsync. At a crash
point it can build the image a power cut would leave behind:

- "drop": only what was synced;
- "keep": everything written (what kill -9 leaves: the page cache survives);
- "tear": what was synced, plus a random subset of the unsynced 512-byte sectors.

build_split_image gives each top-level directory under the root its own variant: several
devices under one root, of which only some lose power ("drop"/"tear") while the others keep
everything ("keep").
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
from pathlib import Path
from typing import Callable, Mapping

from cossd.emulator import media

SECTOR = 512


@dataclasses.dataclass(frozen=True)
class Entry:
    inode: int
    is_dir: bool


class PowerLossRecorder(media.MediaHooks):
    """Tracks durability under `root`; calls `crash_point(label)` around every sync.

    With `write_probability` > 0, writes are crash points too, at random.
    """

    def __init__(self, root: Path, crash_point: Callable[[str], None], *,
                 write_probability: float = 0.0, seed: int = 0) -> None:
        self.root = root
        self.crash_point = crash_point
        self.write_probability = write_probability
        self.rng = random.Random(seed)
        self.content: dict[int, bytes] = {}
        self.entries: dict[Path, dict[str, Entry]] = {}
        self.paused = False
        self._snapshot_everything()

    # ------------------------------------------------------------------ bookkeeping

    def _snapshot_everything(self) -> None:
        """At installation, whatever is on disk counts as durable."""
        for directory, _subdirs, files in os.walk(self.root):
            path = Path(directory)
            self.entries[path] = self._list(path)
            for name in files:
                self.content[os.stat(path / name).st_ino] = (path / name).read_bytes()

    @staticmethod
    def _list(directory: Path) -> dict[str, Entry]:
        listing = {}
        for name in os.listdir(directory):
            st = os.stat(directory / name, follow_symlinks=False)
            listing[name] = Entry(st.st_ino, os.path.isdir(directory / name))
        return listing

    def _inside(self, path: Path) -> bool:
        return path == self.root or self.root in path.parents

    def _point(self, label: str) -> None:
        if not self.paused:
            self.paused = True
            try:
                self.crash_point(label)
            finally:
                self.paused = False

    # ------------------------------------------------------------------ hooks

    def before_write(self, path: Path) -> None:
        if self._inside(path) and self.write_probability and self.rng.random() < self.write_probability:
            self._point(f"write {path.relative_to(self.root)}")

    def before_sync(self, path: Path) -> None:
        if self._inside(path):
            self._point(f"before fsync {path.relative_to(self.root)}")

    def after_sync(self, path: Path) -> None:
        if self._inside(path):
            self.content[os.stat(path).st_ino] = path.read_bytes()
            self._point(f"after fsync {path.relative_to(self.root)}")

    def before_dir_sync(self, path: Path) -> None:
        if self._inside(path):
            self._point(f"before dir fsync {path.relative_to(self.root) or '.'}")

    def after_dir_sync(self, path: Path) -> None:
        if self._inside(path):
            self.entries[path] = self._list(path)
            self._point(f"after dir fsync {path.relative_to(self.root) or '.'}")

    # ------------------------------------------------------------------ crash images

    def build_image(self, dest: Path, variant: str, rng: random.Random) -> int:
        """Write the disk a power cut would leave into `dest`; returns unsynced sectors kept."""
        if variant == "keep":
            shutil.copytree(self.root, dest)
            return -1
        dest.mkdir(parents=True)
        return self._build_dir(self.root, dest, variant, rng)

    def build_split_image(self, dest: Path, variants: Mapping[str, str], rng: random.Random,
                          default: str = "keep") -> int:
        """Like build_image, but each top-level entry under the root named in `variants` gets
        its own variant, and every other one `default`: one device's media cut while the
        others (their own directories under the same root) keep everything."""
        unknown = set(variants) - set(os.listdir(self.root)) - set(self.entries.get(self.root, {}))
        if unknown:
            raise ValueError(f"no entries {sorted(unknown)} under {self.root}")
        dest.mkdir(parents=True)
        kept = 0
        # "keep" parts: what is there now; cut parts: what the root's last dir fsync recorded.
        for name in sorted(os.listdir(self.root)):
            if variants.get(name, default) == "keep":
                if os.path.isdir(self.root / name):
                    shutil.copytree(self.root / name, dest / name)
                else:
                    shutil.copy2(self.root / name, dest / name)
        for name, entry in sorted(self.entries.get(self.root, {}).items()):
            variant = variants.get(name, default)
            if variant != "keep":
                kept += self._build_entry(self.root, name, entry, dest, variant, rng)
        return kept

    def _build_dir(self, source: Path, dest: Path, variant: str, rng: random.Random) -> int:
        kept = 0
        for name, entry in sorted(self.entries.get(source, {}).items()):
            kept += self._build_entry(source, name, entry, dest, variant, rng)
        return kept

    def _build_entry(self, source: Path, name: str, entry: Entry, dest: Path, variant: str,
                     rng: random.Random) -> int:
        """Build `source / name` (durable as `entry`) into `dest / name`; unsynced sectors kept."""
        if entry.is_dir:
            (dest / name).mkdir()
            return self._build_dir(source / name, dest / name, variant, rng)
        data = bytearray(self.content.get(entry.inode, b""))
        kept = 0
        if variant == "tear":
            current = self._current(source / name, entry.inode)
            if current is not None:
                kept = _tear_into(data, current, rng)
        (dest / name).write_bytes(bytes(data))
        return kept

    @staticmethod
    def _current(path: Path, inode: int) -> bytes | None:
        """The file's current bytes, if `path` still names that inode."""
        try:
            if os.stat(path).st_ino != inode:
                return None
            return path.read_bytes()
        except FileNotFoundError:
            return None


def _tear_into(data: bytearray, current: bytes, rng: random.Random) -> int:
    """Apply a random half of the sectors where `current` differs from `data` (in place)."""
    kept = 0
    limit = min(len(data), len(current))
    view = memoryview(current)
    for start in range(0, limit, SECTOR):
        end = min(limit, start + SECTOR)
        if data[start:end] != view[start:end] and rng.random() < 0.5:
            data[start:end] = view[start:end]
            kept += 1
    return kept
