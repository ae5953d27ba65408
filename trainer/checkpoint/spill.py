"""The tiered checkpointer's spill tier: versions as files in a local-SSD directory, each with a sidecar manifest written last, found again after a restart."""
from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import crc32c

from ...protocol import manifest_seal
from . import store as tier_store

DATA_SUFFIX = ".data"
SIDECAR_SUFFIX = ".json"


@dataclasses.dataclass
class Scan:
    """What scan() found in a spill dir."""

    complete: dict[int, dict[str, Any]]   # step: its verified sidecar manifest
    cut_short: list[str]                  # files of spills cut short (no sidecar), removed
    corrupt: list[str]                    # why each version whose sidecar or data failed its checks was discarded
    unchecked: list[str]                  # format-1 sidecars, neither adopted nor removed (not accepted)


class SpillDir:
    """Files vSTEP.data (the version's bytes) and vSTEP.json (its manifest, the store's form,
    sealed by its own CRC32C). A version is complete exactly when its sidecar exists: written
    after the data is fsynced, by a rename, so a process killed mid-spill leaves only a data
    file, which scan() removes."""

    def __init__(self, path: str | os.PathLike[str], accept_unchecked: bool = False) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.accept_unchecked = accept_unchecked  # format-1 sidecars (no checksum of their own)
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
            record = manifest_seal.sealed(tier_store.manifest(step, len(view), chunk_bytes, crcs,
                                                              time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())),
                                          tier_store.MANIFEST_CHECKSUM)
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

    def read_sidecar(self, step: int) -> dict[str, Any]:
        """A version's sidecar, verified (its own checksum, its form, the data file's size);
        FileNotFoundError where it has none, CorruptVersionError saying what is wrong."""
        where = f"the spill dir {self.path}"
        try:
            data = json.loads(self.sidecar_path(step).read_bytes())
        except ValueError:
            raise tier_store.CorruptVersionError(f"version {step} in {where}: its sidecar "
                                                 f"{self.sidecar_path(step).name} is not JSON") from None
        record = tier_store.check_manifest(data, step, where, self.accept_unchecked)
        size = self.data_path(step).stat().st_size
        if size != record["payload_bytes"]:
            raise tier_store.CorruptVersionError(f"version {step} in {where}: its data file holds {size} bytes, "
                                                 f"its sidecar says {record['payload_bytes']}")
        return record

    def scan(self) -> Scan:
        """The complete versions here, their sidecars verified. Files of versions cut short (a
        data file without a sidecar) are removed; so are versions whose sidecar fails its checks
        (damage: a sidecar is only ever written whole, by a rename), each said why. A format-1
        sidecar, not accepted, is left as it is."""
        found = Scan({}, [], [], [])
        steps = set()
        for entry in self.path.iterdir():
            name = entry.name.split(".")[0]
            if name.startswith("v") and name[1:].isdigit() and len(name) == 13:
                steps.add(int(name[1:]))
        for step in sorted(steps):
            files = [p.name for p in (self.data_path(step), self.sidecar_path(step)) if p.exists()]
            try:
                found.complete[step] = self.read_sidecar(step)
            except tier_store.UncheckedManifestError as exc:
                found.unchecked.append(str(exc))
            except FileNotFoundError:  # no sidecar (or no data file): a spill cut short
                found.cut_short.extend(files)
                self.delete(step)
            except (OSError, tier_store.CorruptVersionError) as exc:
                found.corrupt.append(str(exc))
                self.delete(step)
        return found

    def read_range(self, step: int, start: int, stop: int) -> bytes:
        with open(self.data_path(step), "rb") as f:
            return os.pread(f.fileno(), stop - start, start)

    def read_version(self, step: int, record: dict[str, Any], into: bytearray) -> bytearray:
        """A version's bytes into `into`: its sidecar on the disk verified again and matched
        against `record` (what this checkpointer spilled or adopted) first, then every chunk
        checked against its CRC32C."""
        on_disk = self.read_sidecar(step)
        if any(on_disk[key] != record[key] for key in ("payload_bytes", "chunk_bytes", "chunks_crc32c")):
            raise tier_store.CorruptVersionError(f"version {step} in the spill dir {self.path}: its sidecar no "
                                                 "longer matches the version spilled")
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
