"""Snapshots of an optimizer namespace: committed states kept on the media under a tag."""
from __future__ import annotations

import builtins
import contextlib
import dataclasses
import json
import logging
import os
import stat
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ... import kernels

from .. import media
from ...protocol.status import DeviceError, Status
from ..layout import BLOCK_ELEMS, SCALE_BLOCK, TensorLayout, region_offset
from ..names import check_name
from .common import BLOCK_ROLES, MOMENT_ROLES, block_slice, decoded_moment_bytes
from ..superblock import Superblock



class SnapshotSource(Protocol):
    """What a snapshot store needs of the namespace it belongs to (Namespace, namespace/core.py)."""

    name: str
    nsid: int
    directory: Path
    spec: Any
    layouts: list[TensorLayout]
    tensors: dict[str, TensorLayout]
    total_blocks: int
    sync_commits: bool

    @property
    def block_roles(self) -> tuple[str, ...]: ...

    @property
    def state_format(self) -> Any: ...

    def itemsize(self, role: str) -> int: ...

    def role_dtype(self, role: str) -> Any: ...

    def pinned_committed(self) -> contextlib.AbstractContextManager[tuple[Superblock, media.StateFile]]: ...

    def restore_committed(self, source: Superblock, fill: Callable[[media.StateFile], None]) -> int: ...

log = logging.getLogger(__name__)

SNAPSHOTS_DIR = "snapshots"
STATE_FILE = "state"
SUPERBLOCK_FILE = "sb"
META_FILE = "meta.json"
MAX_SNAPSHOTS = 1024  # per namespace
# The arrays a block checksum covers, in checksum order.
CHECKSUM_ROLES = BLOCK_ROLES

Reserve = Callable[[int, str], contextlib.AbstractContextManager[None]]




@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One retained committed state: its directory, the superblock of its step, identity."""

    tag: str
    snapshot_id: int  # random, so a tag deleted and taken again is a different snapshot
    directory: Path
    superblock: Superblock
    created: str
    size_bytes: int

    @property
    def step(self) -> int:
        return self.superblock.committed_step

    @property
    def state_path(self) -> Path:
        return self.directory / STATE_FILE

    def describe(self) -> dict[str, Any]:
        return {"tag": self.tag, "step": self.step, "created": self.created,
                "bytes": self.size_bytes, "state": "ready"}


@dataclasses.dataclass(frozen=True)
class Damaged:
    """A snapshot directory that cannot be read back (listed, deletable, never served)."""

    tag: str
    reason: str
    size_bytes: int

    def describe(self) -> dict[str, Any]:
        return {"tag": self.tag, "bytes": self.size_bytes, "state": "damaged", "error": self.reason}


def _tree_bytes(directory: Path) -> int:
    total = 0
    for child in directory.iterdir():
        with contextlib.suppress(OSError):
            total += child.stat().st_size
    return total


class SnapshotStore:
    """The snapshots of one namespace, under `NAMESPACE_DIR/snapshots/<tag>/`.

    A snapshot is built in `.<tag>.tmp/`, fsynced, renamed into place and the rename made
    durable, so a crash leaves it whole or absent; entries starting with '.' (tags cannot)
    are leftovers of an interrupted create or delete and are removed when the store opens.
    """

    def __init__(self, namespace: SnapshotSource) -> None:
        self.namespace = namespace
        self.root = namespace.directory / SNAPSHOTS_DIR
        spec = namespace.spec
        _, self.copy_bytes = spec.layout()
        self._itemsizes = {role: namespace.itemsize(role) for role in CHECKSUM_ROLES}
        # What a block checksum covers on the media: each role's array and its element size
        # there (block-scaled moments: the codes, then their scales; see common.SCALED_BLOCK_ROLES).
        self._block_roles: tuple[str, ...] = namespace.block_roles
        self._media_itemsizes = {role: namespace.role_dtype(role).itemsize for role in self._block_roles}
        self.lock = threading.Lock()  # one create, delete, rollback or clone at a time
        self._snapshots: dict[str, Snapshot] = {}
        self._damaged: dict[str, Damaged] = {}
        # Blocks (global indices) of each snapshot already verified for reads from the mount.
        self._verified: dict[int, set[int]] = {}
        self._verified_lock = threading.Lock()
        self._load()

    # ------------------------------------------------------------------ listing

    def _load(self) -> None:
        try:
            mode = os.lstat(self.root).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(mode):
            # Never listed (nor its '.'-entries removed) through a link: the device's own
            # check at open refuses this first (emulator/backing.py).
            raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                              f"{self.root} is not a directory (a link is never followed)")
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith("."):
                log.warning("namespace %s: removing leftover %s of an interrupted snapshot "
                            "create or delete", self.namespace.name, entry.name)
                shutil.rmtree(entry, ignore_errors=True)
                continue
            try:
                self._snapshots[entry.name] = self._read(entry)
            except (OSError, ValueError, KeyError, TypeError, DeviceError) as exc:
                reason = exc.message if isinstance(exc, DeviceError) else str(exc)
                log.error("namespace %s: snapshot %s cannot be read: %s",
                          self.namespace.name, entry.name, reason)
                self._damaged[entry.name] = Damaged(entry.name, reason, _tree_bytes(entry))

    def _read(self, directory: Path) -> Snapshot:
        meta = media.read_json(directory / META_FILE)
        if meta["tag"] != directory.name:
            raise ValueError(f"meta.json names tag {meta['tag']!r}")
        namespace = self.namespace
        superblock = Superblock.decode((directory / SUPERBLOCK_FILE).read_bytes(),
                                       namespace.total_blocks, len(namespace.spec.group_hypers))
        if superblock is None:
            raise ValueError("its superblock is torn or of another layout")
        size = (directory / STATE_FILE).stat().st_size
        if size != self.copy_bytes:
            raise ValueError(f"its state has {size} bytes, expected {self.copy_bytes}")
        return Snapshot(directory.name, int(meta["id"]), directory, superblock, str(meta["created"]),
                        _tree_bytes(directory))

    @property
    def bytes_used(self) -> int:
        """Media bytes the snapshots take (lock-free: the device sums it under its own lock)."""
        entries: list[Snapshot | Damaged] = [*list(self._snapshots.values()),
                                             *list(self._damaged.values())]
        return sum(entry.size_bytes for entry in entries)

    def list(self) -> list[dict[str, Any]]:
        """Every snapshot, oldest step first, then the damaged ones (lock-free: the mount
        lists them on its event loop while a create may be running)."""
        snapshots = sorted(self._snapshots.values(), key=lambda s: (s.step, s.tag))
        damaged = sorted(self._damaged.values(), key=lambda d: d.tag)
        return [s.describe() for s in snapshots] + [d.describe() for d in damaged]

    def tags(self) -> builtins.list[str]:  # `list` here is the method above
        return [entry["tag"] for entry in self.list() if entry["state"] == "ready"]

    def find(self, tag: str, snapshot_id: int | None = None) -> Snapshot | None:
        """The ready snapshot `tag` (only if its id is `snapshot_id`, when given), or None."""
        snapshot = self._snapshots.get(tag)
        if snapshot is None or (snapshot_id is not None and snapshot.snapshot_id != snapshot_id):
            return None
        return snapshot

    def get(self, tag: object) -> Snapshot:
        tag = check_name(tag, "snapshot tag")
        snapshot = self._snapshots.get(tag)
        if snapshot is not None:
            return snapshot
        if tag in self._damaged:
            raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                              f"snapshot {tag!r} of namespace {self.namespace.name!r} cannot be "
                              f"read: {self._damaged[tag].reason}")
        raise DeviceError(Status.SNAPSHOT_NOT_FOUND,
                          f"namespace {self.namespace.name!r} has no snapshot {tag!r}")

    # ------------------------------------------------------------------ checksums

    def bad_blocks(self, path: Path, superblock: Superblock,
                   only: Iterable[int] | None = None) -> builtins.list[tuple[str, int]]:
        """Blocks of the state file `path` whose checksum differs from `superblock`'s."""
        wanted = None if only is None else set(only)
        bad = []
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"{path} cannot be read: {exc}") from None
        try:
            size = os.fstat(fd).st_size
            if size != self.copy_bytes:
                raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                                  f"{path}: {size} bytes, expected {self.copy_bytes}")
            # Read with pread, not through a mapping: a file cut short meanwhile gives a short
            # read (an error), never a SIGBUS in the daemon.
            for tensor in self.namespace.layouts:
                for block in range(tensor.block_count):
                    index = tensor.first_block + block
                    if wanted is not None and index not in wanted:
                        continue
                    if self._block_crc(fd, path, tensor, block) != int(superblock.block_crcs[index]):
                        bad.append((tensor.name, block))
        finally:
            os.close(fd)
        return bad

    def _block_crc(self, fd: int, path: Path, tensor: TensorLayout, block: int) -> int:
        start, stop = tensor.block_range(block)
        crc = 0
        for role in self._block_roles:
            size = self._media_itemsizes[role]
            owned = block_slice(role, start, stop)
            offset = region_offset(tensor, role) + owned.start * size
            length = (owned.stop - owned.start) * size
            data = os.pread(fd, length, offset)
            if len(data) != length:
                raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                                  f"{path} ends inside {tensor.name} block {block} (cut short)")
            crc = kernels.crc32c(data, crc)
        return crc

    @staticmethod
    def open_state(snapshot: Snapshot) -> int:
        """A read-only descriptor of the snapshot's state file."""
        try:
            return os.open(snapshot.state_path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                              f"snapshot {snapshot.tag!r} cannot be read: {exc}") from None

    def check_committed(self) -> None:
        """NAMESPACE_NOT_READY (or WRITE_FAULT) unless there is a committed step to copy:
        the same check the copy itself makes, made before anything is created."""
        with self.namespace.pinned_committed():
            pass

    def verify(self, snapshot: Snapshot) -> None:
        """Raise UNRECOVERED_READ_ERROR unless every block of `snapshot` passes its checksum."""
        bad = self.bad_blocks(snapshot.state_path, snapshot.superblock)
        if bad:
            tensor, block = bad[0]
            raise DeviceError(
                Status.UNRECOVERED_READ_ERROR,
                f"snapshot {snapshot.tag!r} of namespace {self.namespace.name!r} fails its "
                f"checksum in {len(bad)} block(s) (first: {tensor} block {block})",
            )

    # ------------------------------------------------------------------ create, delete

    def _ensure_root(self) -> None:
        if not self.root.is_dir():
            try:
                self.root.mkdir()
            except OSError as exc:
                raise media.media_error(exc, "creating the snapshots directory") from exc
            media.fsync_dir(self.namespace.directory)

    def capture(self, directory: Path) -> Superblock:
        """Copy the committed state into `directory/state` (not synced, not verified) and
        return its superblock: the consistent source an export of the live namespace reads."""
        state_path = directory / STATE_FILE
        try:
            fd = os.open(state_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise media.media_error(exc, f"creating {state_path}") from exc
        try:
            with self.namespace.pinned_committed() as (superblock, copy):
                media.copy_range(copy.fd, fd, state_path, copy.size_bytes, share_extents=True)
        finally:
            os.close(fd)
        return superblock

    def create(self, tag: object, reserve: Reserve) -> Snapshot:
        """Snapshot the committed step under `tag`; `reserve(bytes, what)` holds the device's
        capacity for it while it is built."""
        tag = check_name(tag, "snapshot tag")
        with self.lock:
            if tag in self._snapshots or tag in self._damaged:
                raise DeviceError(Status.SNAPSHOT_EXISTS,
                                  f"namespace {self.namespace.name!r} already has a snapshot {tag!r}")
            if len(self._snapshots) + len(self._damaged) >= MAX_SNAPSHOTS:
                raise DeviceError(Status.LIMIT_EXCEEDED,
                                  f"at most {MAX_SNAPSHOTS} snapshots per namespace")
            self.check_committed()
            with reserve(self.copy_bytes, f"snapshot {tag!r}"):
                snapshot = self._build(tag)
                self._snapshots[tag] = snapshot
        log.info("namespace %s: snapshot %s of step %d", self.namespace.name, tag, snapshot.step)
        return snapshot

    def _build(self, tag: str) -> Snapshot:
        self._ensure_root()
        staging = self.root / f".{tag}.tmp"
        final = self.root / tag
        shutil.rmtree(staging, ignore_errors=True)
        renamed = False
        try:
            staging.mkdir()
            # Commits wait only while the bytes are copied, not for the fsyncs after it.
            superblock = self.capture(staging)
            state_path = staging / STATE_FILE
            fd = os.open(state_path, os.O_RDONLY)
            try:
                media.sync_fd(fd, state_path)
            finally:
                os.close(fd)
            bad = self.bad_blocks(state_path, superblock)
            if bad:
                tensor, block = bad[0]
                raise DeviceError(
                    Status.UNRECOVERED_READ_ERROR,
                    f"step {superblock.committed_step} of namespace {self.namespace.name!r} fails "
                    f"its checksum in {len(bad)} block(s) (first: {tensor} block {block}); "
                    "not snapshotted",
                )
            media.write_new_file(staging / SUPERBLOCK_FILE, superblock.encode())
            meta = {"tag": tag, "id": secrets.randbits(63), "step": superblock.committed_step,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "namespace": self.namespace.name, "nsid": self.namespace.nsid,
                    "copy_bytes": self.copy_bytes}
            media.write_new_file(staging / META_FILE,
                                 (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode())
            media.fsync_dir(staging)
            os.rename(staging, final)
            renamed = True
            # The directory's own entries first, then its name in snapshots/.
            media.fsync_dir(final)
            media.fsync_dir(self.root)
            return self._read(final)
        except OSError as exc:
            self._discard(staging, final if renamed else None)
            raise media.media_error(exc, f"building snapshot {tag!r}") from exc
        except BaseException:
            self._discard(staging, final if renamed else None)
            raise

    @staticmethod
    def _discard(*directories: Path | None) -> None:
        for directory in directories:
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)

    def delete(self, tag: object) -> None:
        tag = check_name(tag, "snapshot tag")
        with self.lock:
            if tag not in self._snapshots and tag not in self._damaged:
                raise DeviceError(Status.SNAPSHOT_NOT_FOUND,
                                  f"namespace {self.namespace.name!r} has no snapshot {tag!r}")
            doomed = self.root / f".{tag}.deleted"
            try:
                os.rename(self.root / tag, doomed)
            except OSError as exc:
                raise media.media_error(exc, f"deleting snapshot {tag!r}") from exc
            self._snapshots.pop(tag, None)
            self._damaged.pop(tag, None)
            # Once the rename is durable the snapshot is gone even if the removal below is
            # cut short: a leftover '.'-entry is removed at the next open.
            media.fsync_dir(self.root)
            shutil.rmtree(doomed, ignore_errors=True)

    # ------------------------------------------------------------------ read back

    def read(self, tag: str, snapshot_id: int, tensor_name: str, role: str, offset: int,
             size: int) -> bytes:
        """Bytes of one array of a snapshot, for the mount; each block is verified against
        its checksum the first time it is read (UNRECOVERED_READ_ERROR if it fails)."""
        snapshot = self.find(tag, snapshot_id)
        if snapshot is None:
            raise DeviceError(Status.SNAPSHOT_NOT_FOUND, f"snapshot {tag!r} no longer exists")
        tensor = self.namespace.tensors[tensor_name]
        itemsize = self._itemsizes[role]
        file_size = tensor.numel * itemsize
        if offset >= file_size or size <= 0:
            return b""
        end = min(file_size, offset + size)
        first, last = offset // itemsize // BLOCK_ELEMS, (end - 1) // itemsize // BLOCK_ELEMS
        wanted = {tensor.first_block + block for block in range(first, last + 1)}
        with self._verified_lock:
            unverified = wanted - self._verified.get(snapshot_id, set())
        if unverified:
            bad = self.bad_blocks(snapshot.state_path, snapshot.superblock, unverified)
            if bad:
                raise DeviceError(
                    Status.UNRECOVERED_READ_ERROR,
                    f"snapshot {tag!r}: {bad[0][0]} block {bad[0][1]} fails its checksum",
                )
            with self._verified_lock:
                self._verified.setdefault(snapshot_id, set()).update(unverified)
        fd = self.open_state(snapshot)
        try:
            if self.namespace.spec.scaled_state and role in MOMENT_ROLES:
                return self._read_decoded(fd, snapshot, tensor, role, offset, end)
            return os.pread(fd, end - offset, region_offset(tensor, role) + offset)
        finally:
            os.close(fd)

    def _read_decoded(self, fd: int, snapshot: Snapshot, tensor: TensorLayout, role: str, offset: int,
                      end: int) -> bytes:
        """Bytes [offset, end) of a block-scaled moment of a snapshot, as FP32: the 256-element
        blocks the range touches, their codes and scales read (verified above) and decoded."""
        first = offset // 4 // SCALE_BLOCK * SCALE_BLOCK
        last_element = -(-end // 4)  # one past the last element the range touches
        last = min(tensor.numel, -(-last_element // SCALE_BLOCK) * SCALE_BLOCK)
        code_size = self._media_itemsizes[role]
        raw = os.pread(fd, (last - first) * code_size, region_offset(tensor, role) + first * code_size)
        owned = block_slice(role + "_scale", first, last)
        scales = os.pread(fd, (owned.stop - owned.start) * 4, region_offset(tensor, role + "_scale") + owned.start * 4)
        if len(raw) != (last - first) * code_size or len(scales) != (owned.stop - owned.start) * 4:
            raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"snapshot {snapshot.tag!r} ends inside {tensor.name}")
        codes = np.frombuffer(raw, dtype=np.uint8 if code_size == 1 else np.uint16)
        decoded = decoded_moment_bytes(codes, np.frombuffer(scales, dtype=np.float32),
                                       self.namespace.state_format, role, offset - 4 * first, end - 4 * first)
        return decoded.tobytes()

    # ------------------------------------------------------------------ rollback (clones: emulator/snapshots/clone.py)

    def rollback(self, tag: object) -> tuple[Snapshot, int]:
        """Commit the snapshot's state as the namespace's newest step (no step may be open);
        returns the snapshot and the step it replaced."""
        with self.lock:
            snapshot = self.get(tag)
            fd = self.open_state(snapshot)
            try:
                previous = self.namespace.restore_committed(
                    snapshot.superblock,
                    lambda state: media.copy_range(fd, state.fd, state.path, state.size_bytes,
                                                   share_extents=False),
                )
            finally:
                os.close(fd)
        log.info("namespace %s: rolled back from step %d to snapshot %s (step %d)",
                 self.namespace.name, previous, snapshot.tag, snapshot.step)
        return snapshot, previous
