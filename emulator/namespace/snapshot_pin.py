"""A snapshot pinned for a job that reads it in the background (ARCHIVE, EXPORT): its state file's descriptor and its own labels, checked to be the snapshot the device listed."""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ...protocol.status import DeviceError, Status
from ..superblock import Superblock
from .snapshots import META_FILE, STATE_FILE, SUPERBLOCK_FILE, Snapshot


def same_state(a: Superblock, b: Superblock) -> bool:
    """The same committed state: step, hyperparameters and every block's checksum (not the
    record's sequence, copy or counters, which a restore or a clone starts afresh)."""
    return (a.committed_step == b.committed_step and a.mode == b.mode
            and all(getattr(a, f) == getattr(b, f) for f in ("lr", "beta1", "beta2", "eps", "weight_decay",
                                                               "last_grad_scale"))
            and np.array_equal(a.block_crcs, b.block_crcs) and np.array_equal(a.extra_groups, b.extra_groups))


def read_at(dir_fd: int, name: str) -> bytes:
    """The whole of file `name` in the directory open as `dir_fd` (no symlink followed)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def pin(namespace: Any, tag: object, job: str, nothing: str) -> tuple[Snapshot, int, bytes, bytes]:
    """Snapshot `tag` as the namespace lists it, with a read-only descriptor of its state file
    and the bytes of its superblock and meta.json: all three read through one descriptor of its
    directory, which is checked to be that snapshot's (meta.json's random id; the superblock's
    step and block checksums). A snapshot directory never changes once made, and its files stay
    readable through their descriptors when it is deleted, so what the job reads is one
    snapshot, whole, and its labels (step, id, created) are its own. A tag deleted, or deleted
    and taken again, between the lookup and the pin is SNAPSHOT_NOT_FOUND, with nothing pinned:
    never the old snapshot's step on the new one's state, nor the old superblock beside the new
    state. `job` names the job in the errors ("archive"), `nothing` what it left undone
    ("nothing was uploaded")."""
    snapshot: Snapshot = namespace.snapshots.get(tag)
    gone = DeviceError(Status.SNAPSHOT_NOT_FOUND,
                       f"snapshot {snapshot.tag!r} of namespace {namespace.name!r} was deleted or replaced (by "
                       f"another of the same tag) while the {job} started; {nothing}: {job} it again")
    try:
        dir_fd = os.open(snapshot.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise gone from None
    except OSError as exc:
        raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"snapshot {snapshot.tag!r} cannot be read: {exc}") from None
    state_fd = -1
    try:
        try:
            meta = read_at(dir_fd, META_FILE)
            superblock = read_at(dir_fd, SUPERBLOCK_FILE)
            state_fd = os.open(STATE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:  # removed meanwhile (a delete renames, then removes the files)
            raise gone from None
        except OSError as exc:
            raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                              f"snapshot {snapshot.tag!r} cannot be read: {exc}") from None
        try:
            same = int(json.loads(meta)["id"]) == snapshot.snapshot_id  # as SnapshotStore._read reads it
        except (ValueError, TypeError, KeyError):
            same = False
        if not same:
            raise gone
        decoded = Superblock.decode(superblock, namespace.total_blocks, len(namespace.spec.group_hypers))
        if decoded is None or not same_state(decoded, snapshot.superblock):
            raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                              f"snapshot {snapshot.tag!r}: its superblock on the media is not the one the "
                              f"device read when it listed the snapshot; {nothing}")
    except BaseException:
        if state_fd >= 0:
            os.close(state_fd)
        raise
    finally:
        os.close(dir_fd)
    return snapshot, state_fd, superblock, meta
