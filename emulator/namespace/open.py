"""Creating an optimizer namespace on the media, opening it and recovering its newest intact step."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
from pathlib import Path

import numpy as np

from ...protocol.status import DeviceError, Status
from ..layout import Copy, SuperblockFlags, TensorLayout
from ..media import SlotFile, StateFile, atomic_write_json, fsync_dir, media_error, read_json
from .common import hyper_record, hypers_of
from .verify import VERIFY_BACKGROUND, VERIFY_MODES, VERIFY_OPEN
from ..spec import NamespaceSpec
from ..superblock import SkipCounts, Superblock
from .media import NamespaceMedia
from .state import NamespaceCore
from .verify import CopyVerifier

log = logging.getLogger("cossd.emulator.namespace")


@dataclasses.dataclass
class NamespaceFiles:
    """A namespace's files on the media, as created or opened: what Namespace is built from."""

    nsid: int
    spec: NamespaceSpec
    copies: tuple[StateFile, StateFile]
    slots: tuple[SlotFile, SlotFile]
    layouts: list[TensorLayout]
    # The superblocks that may be served, newest first (one, at creation).
    candidates: list[Superblock]
    # Why each damaged copy (re-created as the shadow) could not be used; none at creation.
    damaged: list[str] = dataclasses.field(default_factory=list)

    def close(self) -> None:
        for state in self.copies:
            state.close()


def create_files(directory: Path, nsid: int, spec: NamespaceSpec) -> NamespaceFiles:
    """Lay out and preallocate a namespace at step 0, ready for initial weights."""
    spec.validate()
    layouts, copy_bytes = spec.layout()
    directory.mkdir(parents=True)
    copies: list[StateFile] = []
    try:
        for copy in Copy:
            copies.append(StateFile(directory / f"state.{copy.name}", copy_bytes, create=True))
            # The allocation (size and extents) must be durable before the namespace is:
            # after a power cut, a registered namespace with a short state file is lost.
            copies[-1].sync()
        total_blocks = sum(t.block_count for t in layouts)
        superblock = Superblock(
            seq=1,
            committed_step=spec.initial_step,
            committed_copy=Copy.A,
            flags=SuperblockFlags.LOADING,
            block_crcs=np.zeros(total_blocks, dtype=np.uint32),
            **hyper_record(list(spec.group_hypers)),
        )
        slots = (SlotFile(directory / "sb.0"), SlotFile(directory / "sb.1"))
        encoded = superblock.encode()
        # Both slots get their full size now, so no later commit needs a new block
        # (a full disk fails the create, not a step): a sealed superblock adds its
        # param checksums, 4 bytes a block.
        full_size = len(encoded) + 4 * total_blocks
        for slot in slots:
            slot.allocate(full_size)
        slots[superblock.slot].write(encoded)
        for slot in slots:
            slot.sync()
        meta = {"nsid": nsid, "spec": spec.to_json(), "copy_bytes": copy_bytes}
        atomic_write_json(directory / "meta.json", meta)
        fsync_dir(directory)
        fsync_dir(directory.parent)
    except BaseException:
        for state in copies:
            state.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return NamespaceFiles(nsid, spec, (copies[0], copies[1]), slots, layouts, [superblock])


def open_files(directory: Path) -> NamespaceFiles:
    """An existing namespace's files, with the superblocks that may be served.

    Each state copy is judged on its own: one that is missing or has the wrong size is a
    media error of that copy. Superblocks naming it are passed over, and the copy is
    re-created at full size as the new shadow (its contents are not needed by the step
    served). A link or another file type is refused, never followed (StateFile).
    """
    meta = read_json(directory / "meta.json")
    spec = NamespaceSpec.from_json(meta["spec"])
    layouts, copy_bytes = spec.layout()
    if copy_bytes != meta["copy_bytes"]:
        raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"{directory}: layout mismatch")
    copies: dict[Copy, StateFile] = {}
    damaged: dict[Copy, str] = {}
    try:
        for copy in Copy:
            path = directory / f"state.{copy.name}"
            reason = _copy_damage(path, copy_bytes)
            if reason is None:
                copies[copy] = StateFile(path, copy_bytes, create=False)
            else:
                damaged[copy] = reason
        slots = (SlotFile(directory / "sb.0"), SlotFile(directory / "sb.1"))
        total_blocks = sum(t.block_count for t in layouts)
        groups = len(spec.group_hypers)
        candidates = [Superblock.decode(slot.read(), total_blocks, groups) for slot in slots]
        valid = sorted((sb for sb in candidates if sb is not None), key=lambda sb: -sb.seq)
        if not valid:
            raise DeviceError(
                Status.UNRECOVERED_READ_ERROR, f"namespace {spec.name!r}: no valid superblock"
            )
        usable = [sb for sb in valid if sb.committed_copy not in damaged]
        for superblock in valid:
            if superblock.committed_copy in damaged:
                log.warning("namespace %s: step %d (seq %d) is in a damaged copy (%s); falling back",
                            spec.name, superblock.committed_step, superblock.seq,
                            damaged[superblock.committed_copy])
        if not usable:
            raise DeviceError(
                Status.UNRECOVERED_READ_ERROR,
                f"namespace {spec.name!r}: no committed step can be served "
                f"({'; '.join(damaged.values())})",
            )
        for copy, reason in damaged.items():
            log.error("namespace %s: %s; re-creating it at full size as the shadow copy", spec.name, reason)
            copies[copy] = _recreate_copy(directory / f"state.{copy.name}", copy_bytes)
        return NamespaceFiles(meta["nsid"], spec, (copies[Copy.A], copies[Copy.B]), slots, layouts,
                              usable, list(damaged.values()))
    except BaseException:
        for state in copies.values():
            state.close()
        raise


def _copy_damage(path: Path, copy_bytes: int) -> str | None:
    """Why the state copy at `path` cannot be opened as one (missing, wrong size), or None."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return f"{path.name} is missing"
    if stat.S_ISREG(info.st_mode) and info.st_size != copy_bytes:
        return f"{path.name} has {info.st_size} bytes, expected {copy_bytes}"
    return None  # whole, or a link or foreign file that StateFile refuses


def _recreate_copy(path: Path, copy_bytes: int) -> StateFile:
    """A new, preallocated copy in place of a damaged one, durable before it is used:
    built under a temporary name and renamed into place. The damaged file is kept aside
    as `state.X.damaged` (replacing an older one), never destroyed: recovery may yet find
    no other copy to serve, and what it held is then all there is to salvage."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.unlink(missing_ok=True)
    state = StateFile(temporary, copy_bytes, create=True)
    try:
        state.sync()
        if os.path.lexists(path):
            os.replace(path, path.with_name(f"{path.name}.damaged"))
        os.replace(temporary, path)
        fsync_dir(path.parent)
    except OSError as exc:
        state.close()
        temporary.unlink(missing_ok=True)
        raise media_error(exc, f"re-creating {path.name}") from exc
    except BaseException:
        state.close()
        temporary.unlink(missing_ok=True)
        raise
    state.path = path
    return state


def recover(core: NamespaceCore, media: NamespaceMedia, verifier: CopyVerifier, candidates: list[Superblock],
            verify: str = VERIFY_OPEN, *, durable: bool = False) -> None:
    """Serve the newest superblock whose copy proves intact by its block checksums (with
    VERIFY_BACKGROUND, the newest one with param checksums, verified lazily)."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {VERIFY_MODES}, not {verify!r}")
    deferred = False
    for superblock in candidates:
        if superblock.flags & SuperblockFlags.LOADING:
            chosen = superblock
            break
        if verify == VERIFY_BACKGROUND and superblock.param_crcs is not None:
            chosen = superblock
            deferred = True
            break
        bad = verifier.verify_copy(superblock)
        if not bad:
            chosen = superblock
            break
        core.counters.checksum_failures += len(bad)
        core.recovery_errors.extend(
            (name, block, core.tensors[name].first_block + block) for name, block in bad)
        log.warning(
            "namespace %s: step %d (seq %d) fails %d block checksum(s); falling back",
            core.name, superblock.committed_step, superblock.seq, len(bad),
        )
    else:
        raise DeviceError(
            Status.UNRECOVERED_READ_ERROR,
            f"namespace {core.name!r}: no committed step passes its checksums",
        )
    core.sb = chosen
    core.hypers = hypers_of(chosen)
    core.counters.steps_committed = chosen.steps_committed
    core.recorded_skips = SkipCounts.load(core.directory)
    core.counters.steps_skipped = core.skips().steps_skipped
    # What survived a daemon crash may still sit in the page cache only: make it durable
    # before anything can overwrite the other copy. After a clean close there is none
    # (the close flushed every file before it recorded itself), and these fsyncs would
    # each wait behind whatever the disk has queued: a restart's param reads.
    if not durable:
        for state in core.copies:
            state.sync()
        for slot in core.slots:
            slot.sync()
    media.mark_durable(chosen)
    if deferred:
        verifier.defer(chosen)
