"""The tiered checkpointer's spill tier: versions as files in a local-SSD directory, each with a sidecar manifest written last, found again after a restart."""
from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import crc32c

from . import tier_store

DATA_SUFFIX = ".data"
SIDECAR_SUFFIX = ".json"


class SpillDir:
    """Files vSTEP.data (the version's bytes) and vSTEP.json (its manifest, the store's form).
    A version is complete exactly when its sidecar exists: written after the data is fsynced,
    by a rename, so a process killed mid-spill leaves only a data file, which scan() removes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.delete_errors = 0  # files delete() could not remove

    def data_path(self, step: int) -> Path:
        return self.path / (tier_store.version_dir(step) + DATA_SUFFIX)

    def sidecar_path(self, step: int) -> Path:
        return self.path / (tier_store.version_dir(step) + SIDECAR_SUFFIX)

    def write(self, step: int, view: memoryview, chunk_bytes: int,
              needed: Callable[[], bool] = lambda: True) -> dict[str, Any] | None:
        """Write a version; its manifest (with each chunk's CRC32C, computed as it is written).
        `needed()` is asked before each chunk: once it says no (the store has the version, or
        it was dropped) the partial files are removed and None is returned, so a save waiting
        for the pool room this version holds does not wait for the rest of a slow disk."""
        data, sidecar = self.data_path(step), self.sidecar_path(step)
        sidecar.unlink(missing_ok=True)  # a step spilled again: incomplete until the new sidecar
        crcs = []
        try:
            with open(data, "wb") as f:
                for start in range(0, len(view), chunk_bytes):
                    if not needed():
                        break
                    piece = view[start:start + chunk_bytes]
                    crcs.append(crc32c.crc32c(piece))
                    f.write(piece)
                else:
                    f.flush()
                    os.fsync(f.fileno())
            if not needed():
                self.delete(step)
                return None
            record = tier_store.manifest(step, len(view), chunk_bytes, crcs,
                                         time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            temporary = sidecar.with_suffix(".json.tmp")
            with open(temporary, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(temporary, sidecar)
            self._sync_dir()
        except BaseException:
            self.delete(step)
            raise
        return record

    def _sync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, step: int) -> None:
        """Remove a version's files, the sidecar first: from then on the version is not
        complete, whatever else survives. A file that cannot be removed (the directory turned
        read-only, the disk failing) is counted in `delete_errors` and warned of, never raised:
        the caller is an upload or spill thread whose work must go on, and a sidecar left
        behind is only a version the next checkpointer adopts (or removes, archived)."""
        for path in (self.sidecar_path(step), self.sidecar_path(step).with_suffix(".json.tmp"),
                     self.data_path(step)):
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                self.delete_errors += 1
                warnings.warn(f"TieredCheckpointer: the spill file {path} cannot be removed: {exc}",
                              RuntimeWarning, stacklevel=2)

    def scan(self) -> tuple[dict[int, dict[str, Any]], list[str]]:
        """({step: manifest} of the complete versions here, [names removed]): files of
        versions cut short (no sidecar, a sidecar that does not parse, a data file of another
        size) are removed."""
        complete: dict[int, dict[str, Any]] = {}
        removed: list[str] = []
        steps = set()
        for entry in self.path.iterdir():
            name = entry.name.split(".")[0]
            if name.startswith("v") and name[1:].isdigit() and len(name) == 13:
                steps.add(int(name[1:]))
        for step in sorted(steps):
            try:
                record = tier_store.check_manifest(json.loads(self.sidecar_path(step).read_text()), step)
                if self.data_path(step).stat().st_size != record["payload_bytes"]:
                    raise tier_store.CorruptVersionError("size")
                complete[step] = record
            except (OSError, ValueError, tier_store.CorruptVersionError):
                removed.extend(p.name for p in (self.data_path(step), self.sidecar_path(step)) if p.exists())
                self.delete(step)
        return complete, removed

    def read_range(self, step: int, start: int, stop: int) -> bytes:
        with open(self.data_path(step), "rb") as f:
            return os.pread(f.fileno(), stop - start, start)

    def read_version(self, step: int, record: dict[str, Any], into: bytearray) -> bytearray:
        """A version's bytes into `into`, every chunk checked against its CRC32C."""
        view = memoryview(into)
        chunk = record["chunk_bytes"]
        with open(self.data_path(step), "rb") as f:
            for index, expected in enumerate(record["chunks_crc32c"]):
                start = index * chunk
                stop = min(record["payload_bytes"], start + chunk)
                got = f.readinto(view[start:stop])
                if got != stop - start or crc32c.crc32c(view[start:stop]) != expected:
                    raise tier_store.CorruptVersionError(
                        f"version {step} in the spill dir {self.path}: chunk {index} (bytes {start}-{stop - 1}) "
                        "does not match its CRC32C")
        return into
