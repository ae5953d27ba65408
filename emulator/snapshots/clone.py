"""Clones of a snapshot: a new namespace of the device whose committed state is the snapshot's."""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import media
from ..layout import Copy, SuperblockFlags
from ..names import check_name
from ..namespace import Namespace
from ..namespace.snapshots import Snapshot, SnapshotStore
from ..superblock import Superblock

if TYPE_CHECKING:
    from ..device import Device


def clone(store: SnapshotStore, tag: object, new_name: object, device: Device) -> Namespace:
    """A new namespace `new_name` whose committed state is the snapshot's (same tensors,
    dtypes and hyperparameters, at the snapshot's step); it trains on its own."""
    source = store.namespace
    new_name = check_name(new_name, "namespace")
    with store.lock:
        snapshot = store.get(tag)
        # The clone's description: the source's, renamed, starting at the snapshot's step.
        spec = dataclasses.replace(source.spec, name=new_name,
                                   initial_step=snapshot.step).validate()

        def build(directory: Path, nsid: int) -> Namespace:
            return _build_clone(store, snapshot, spec, directory, nsid)

        adopted = device.adopt_namespace(new_name, 2 * store.copy_bytes, build).as_optimizer()
        assert adopted is not None  # build made an optimizer namespace
        return adopted

def _build_clone(store: SnapshotStore, snapshot: Snapshot, spec: Any, directory: Path, nsid: int) -> Namespace:
    store.verify(snapshot)
    try:
        directory.mkdir(parents=True)
        source_fd = store.open_state(snapshot)
        try:
            for copy in Copy:
                path = directory / f"state.{copy.name}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    # Real blocks, preallocated like a created namespace's: no step of
                    # the clone can run out of space.
                    os.posix_fallocate(fd, 0, store.copy_bytes)
                    if copy == Copy.A:
                        media.copy_range(source_fd, fd, path, store.copy_bytes, share_extents=False)
                    media.sync_fd(fd, path)
                finally:
                    os.close(fd)
        finally:
            os.close(source_fd)
        write_fresh_records(directory, nsid, spec, store.copy_bytes, snapshot.superblock)
        # Opening verifies every block of the new copy against the checksums.
        return Namespace.open(directory, store.namespace.sync_commits)
    except OSError as exc:
        shutil.rmtree(directory, ignore_errors=True)
        raise media.media_error(exc, f"cloning snapshot {snapshot.tag!r}") from exc
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def write_fresh_records(directory: Path, nsid: int, spec: Any, copy_bytes: int, source: Superblock) -> Superblock:
    """The records of a namespace built from another's state (a clone, a restore): `source`'s
    superblock as the first of its own (seq 1, copy A, counters at 0) in both slots, then
    meta.json, each durable before the directory is; state.A must already hold the state.
    Returns the superblock written."""
    superblock = dataclasses.replace(
        source, seq=1, committed_copy=Copy.A, flags=SuperblockFlags.NONE,
        steps_committed=0, steps_skipped=0, last_skipped_step=0, block_crcs=source.block_crcs.copy(),
        param_crcs=None if source.param_crcs is None else source.param_crcs.copy())
    encoded = superblock.encode()
    slots = (media.SlotFile(directory / "sb.0"), media.SlotFile(directory / "sb.1"))
    try:
        # Full size in both, param checksums included, so no later commit needs a new block.
        full_size = len(encoded) + (4 * len(superblock.block_crcs) if superblock.param_crcs is None else 0)
        for slot in slots:
            slot.allocate(full_size)
        slots[superblock.slot].write(encoded)
        for slot in slots:
            slot.sync()
    finally:
        for slot in slots:
            slot.close()
    media.atomic_write_json(directory / "meta.json", {"nsid": nsid, "spec": spec.to_json(), "copy_bytes": copy_bytes})
    media.fsync_dir(directory)
    media.fsync_dir(directory.parent)
    return superblock
