"""Disaster recovery from the archive tier: a namespace (on a fresh device, or on an existing
one) rebuilt from an archived version, every chunk's CRC32C and every block checksum verified
before the namespace is registered; nothing is built when one fails."""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import kernels
from ...protocol.status import DeviceError, Status
from .. import media
from ..layout import Copy
from ..namespace import Namespace, NamespaceSpec
from ..superblock import Superblock
from .versions import chunk_ranges, read_manifest
from ..snapshots.clone import write_fresh_records
from .store import (DEFAULT_MEMORY_BYTES, MANIFEST_OBJECT, META_OBJECT, MIN_CHUNK_BYTES, STATE_OBJECT,
                            SUPERBLOCK_OBJECT, Location, Store, object_key, parse_url)
from ..backing import SUPERBLOCK_FILE, BackingDirectory

log = logging.getLogger("cossd.emulator.archive")

# A fresh device is built in this directory inside the target and moved up only when whole,
# so a restore killed midway leaves no device that looks good (the next restore clears it).
STAGING_DIR = ".cossd-restore"


def _checked_object(store: Store, version: Location, manifest: dict[str, Any], name: str) -> bytes:
    data = store.get(version.bucket, object_key(version, manifest, name))
    expected = manifest["objects"][name]
    if len(data) != expected["bytes"] or kernels.crc32c(data) != expected["crc32c"]:
        raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                          f"{version.url}/{name} fails its CRC32C (or size); nothing was restored")
    return data


def download_state(store: Store, version: Location, manifest: dict[str, Any], fd: int, path: Path,
                   memory_bytes: int, progress: Callable[[int], None]) -> None:
    """Write the state object into `fd`, chunk by chunk, each checked against its CRC32C
    before it is written; at most memory_bytes of chunks are held at once."""
    size, chunk = int(manifest["state_bytes"]), int(manifest["chunk_bytes"])
    ranges = chunk_ranges(size, chunk)
    crcs = manifest["chunks_crc32c"]
    if len(crcs) != len(ranges):
        raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                          f"{version.url}: the manifest lists {len(crcs)} chunks, its sizes give {len(ranges)}")
    key = object_key(version, manifest, STATE_OBJECT)
    stored = store.size(version.bucket, key)
    if stored != size:
        raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                          f"{version.url}/{STATE_OBJECT} holds {stored} bytes, the manifest says {size}")

    def fetch(index: int) -> None:
        start, stop = ranges[index]
        data = store.get(version.bucket, key, (start, stop)) if stop > start else b""
        if len(data) != stop - start or kernels.crc32c(data) != int(crcs[index]):
            raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                              f"{version.url}/{STATE_OBJECT}: chunk {index} (bytes {start}-{stop}) fails "
                              "its CRC32C; nothing was restored")
        view = memoryview(data)
        offset = start
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
        progress(stop - start)

    workers = max(1, memory_bytes // chunk)
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cossd-restore") as pool:
        # Submitted in windows of `workers`, so no more chunks are held than that.
        for first in range(0, len(ranges), workers):
            for future in [pool.submit(fetch, i) for i in range(first, min(len(ranges), first + workers))]:
                future.result()
    media.sync_fd(fd, path)


def _checked_manifest(store: Store, version: Location, accept_unchecked: bool) -> dict[str, Any]:
    """The version's manifest, verified, and naming the namespace and tag its URL ends with
    (a manifest copied from another version's place is refused)."""
    manifest = read_manifest(store, version, accept_unchecked=accept_unchecked)
    named = version.prefix.split("/")[-2:]
    if named != [manifest["namespace"], manifest["tag"]]:
        raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                          f"{version.url}/{MANIFEST_OBJECT} describes {manifest['namespace']}/{manifest['tag']}, "
                          f"not the {'/'.join(named)} its place names; nothing was restored")
    if not manifest["manifest_checked"]:
        log.warning("%s: manifest format 1 (no checksum of its own) accepted as asked", version.url)
    return manifest


# In the staging directory while its device is moved up into the target: {name: [st_dev,
# st_ino]} of each entry moved (superblock.json last). A rename keeps the inode, so a restore
# cut short during the move knows, entry by entry, which of the target's entries it put there.
MOVED_FILE = ".moved.json"


def _lock_target(backing: Path) -> BackingDirectory:
    """The target's lock (the one a mount or an open of a device there takes), held by a
    restore that builds a fresh device for its whole run: a daemon serving a device there, or
    another restore into it, is refused before anything is looked at or removed."""
    try:
        return BackingDirectory.lock(backing)
    except DeviceError as exc:
        if exc.status != Status.NAMESPACE_NOT_READY:
            raise
        raise DeviceError(Status.NAMESPACE_NOT_READY,
                          f"{backing} is in use: a daemon serves the device there (unmount it first: a restore "
                          "runs offline), or another restore into it is running; nothing was changed") from None


def _moved_up(backing: Path) -> list[str]:
    """The entries of `backing` that a restore's move (MOVED_FILE) put there, as they still are
    (same name, same inode): superblock.json first where it is one of them. Nothing where
    there is no record, or one that cannot be read: then none of them counts as the restore's."""
    try:
        record = media.read_json(backing / STAGING_DIR / MOVED_FILE)
    except (OSError, ValueError):
        return []
    own = []
    for name, inode in (record.items() if isinstance(record, dict) else ()):
        if not isinstance(name, str) or name in ("", ".", "..", STAGING_DIR) or "/" in name:
            continue
        try:
            found = os.lstat(backing / name)
        except OSError:
            continue
        if isinstance(inode, list) and inode == [found.st_dev, found.st_ino]:
            own.append(name)
    return sorted(own, key=lambda name: name != SUPERBLOCK_FILE)


def _remove_own(backing: Path, moved: list[str]) -> None:
    """What a restore made in `backing` and nothing else: the entries its move put there
    (superblock.json first, so `backing` is no device from the first removal on), then its
    staging directory."""
    for name in moved:
        path = backing / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    staging = backing / STAGING_DIR
    if staging.is_dir() and not staging.is_symlink():
        shutil.rmtree(staging)
    media.fsync_dir(backing)


def _clear_leftover(backing: Path, *, device_there: bool) -> None:
    """Remove what a restore cut short left in `backing` (its lock held): its staging directory,
    and where no device is there, the entries its move had put up already (_moved_up). Anything
    else in `backing` is not the restore's: refused (INVALID_FIELD, naming it), nothing
    removed. A staging directory that a process has open as a device is refused likewise."""
    staging = backing / STAGING_DIR
    moved = [] if device_there else _moved_up(backing)
    if not device_there:
        foreign = sorted(entry.name for entry in backing.iterdir() if entry.name not in {STAGING_DIR, *moved})
        if foreign:
            shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
            raise DeviceError(Status.INVALID_FIELD, (
                f"{backing} holds what a restore cut short left ({STAGING_DIR}"
                + "".join(f", {name}" for name in moved) + f") and also what is not that restore's: {shown}; "
                "nothing was removed. Move those elsewhere, or restore into another (absent or empty) directory"))
    try:
        held = BackingDirectory.lock(staging)
    except DeviceError as exc:
        raise DeviceError(exc.status, f"{staging}, left by a restore cut short, cannot be cleared: {exc.message}; "
                                      "nothing was removed") from None
    try:
        log.warning("%s: a restore into it was cut short (%s is left%s): cleared, restoring again", backing,
                    STAGING_DIR, "" if device_there else ", no device")
        _remove_own(backing, moved)
    finally:
        held.close()


def _prepare_target(backing: Path) -> bool:
    """True where `backing` gets a fresh device (absent or an empty directory), False where it
    holds one; the caller holds its lock. What a restore killed before it finished left is
    cleared here, and only that (_clear_leftover): beside a superblock.json, the staging
    directory; without one, the staging directory and the entries its move had put up, where
    nothing else is there."""
    staging = backing / STAGING_DIR
    has_staging = staging.is_dir() and not staging.is_symlink()
    if (backing / SUPERBLOCK_FILE).exists():
        if has_staging:
            _clear_leftover(backing, device_there=True)
        return False
    if has_staging:
        _clear_leftover(backing, device_there=False)
    elif any(backing.iterdir()):
        raise DeviceError(Status.INVALID_FIELD, f"{backing} is neither a device nor an empty directory")
    return True


def _move_up(staging: Path, backing: Path) -> None:
    """The device built in `staging` becomes `backing`'s: every entry renamed up, superblock.json
    last (from then on `backing` is a device), then the staging directory removed. Each entry's
    inode is recorded first (MOVED_FILE), so a restore killed midway is cleared entry by entry."""
    names = sorted(entry.name for entry in staging.iterdir()
                   if entry.name not in (SUPERBLOCK_FILE, MOVED_FILE, f".{MOVED_FILE}.tmp"))
    names.append(SUPERBLOCK_FILE)
    inodes = {name: [(found := os.lstat(staging / name)).st_dev, found.st_ino] for name in names}
    media.atomic_write_json(staging / MOVED_FILE, inodes)
    for name in names:
        os.rename(staging / name, backing / name)
    media.fsync_dir(backing)
    os.unlink(staging / MOVED_FILE)
    staging.rmdir()
    media.fsync_dir(backing)


def restore(url: str, backing: Path, *, name: str | None = None, endpoint_url: str | None = None,
            memory_bytes: int = DEFAULT_MEMORY_BYTES, sync: bool = False,
            progress: Callable[[int, int], None] | None = None, capacity_bytes: int | None = None,
            accept_unchecked: bool = False) -> dict[str, Any]:
    """Build namespace `name` (default: the archived one's) in the device at `backing` from the
    version at `url`; bit-identical. The manifest's own checksum, `sb` and `meta.json` are
    verified before anything is created, each chunk of `state` before its bytes are written,
    every block checksum before the namespace is registered. Where `backing` holds no device,
    one of `capacity_bytes` (default: the filesystem's free space, as `cossd format`) is built
    in a staging directory inside it and moved up only when whole. Whatever fails leaves the
    device as it was (and no device where there was none). `accept_unchecked` accepts a
    format-1 manifest, which has no checksum of its own."""
    from ..device import Device, DeviceConfig

    version = parse_url(url)
    backing = Path(backing)
    if capacity_bytes is not None and (not isinstance(capacity_bytes, int) or capacity_bytes <= 0):
        raise DeviceError(Status.INVALID_FIELD, f"capacity must be a positive number of bytes, got {capacity_bytes!r}")
    store = Store(endpoint_url, max(1, memory_bytes // MIN_CHUNK_BYTES), holder="this process (cossd restore)")
    manifest = _checked_manifest(store, version, accept_unchecked)
    superblock_bytes = _checked_object(store, version, manifest, SUPERBLOCK_OBJECT)
    _checked_object(store, version, manifest, META_OBJECT)
    spec = dataclasses.replace(NamespaceSpec.from_json(manifest["spec"]),
                               name=name or manifest["namespace"],
                               initial_step=int(manifest["step"])).validate()
    layouts, copy_bytes = spec.layout()  # fp16/int8 moments: their scale regions too
    total_blocks = sum(t.block_count for t in layouts)
    superblock = Superblock.decode(superblock_bytes, total_blocks, len(spec.group_hypers))
    if copy_bytes != manifest["state_bytes"] or superblock is None:
        raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                          f"{version.url}: its superblock or sizes do not fit its namespace's layout")
    done = 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, copy_bytes)

    def build(directory: Path, nsid: int) -> Namespace:
        try:
            directory.mkdir(parents=True)
            for copy in Copy:
                path = directory / f"state.{copy.name}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, copy_bytes)  # as a created namespace's copies
                    if copy == Copy.A:
                        download_state(store, version, manifest, fd, path, memory_bytes, advance)
                    media.sync_fd(fd, path)
                finally:
                    os.close(fd)
            restored = write_fresh_records(directory, nsid, spec, copy_bytes, superblock)
            namespace = Namespace.open(directory, sync)
            bad = namespace.snapshots.bad_blocks(directory / "state.A", restored)
            if bad:
                namespace.close()
                raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                                  f"{version.url}: {len(bad)} block(s) fail the superblock's checksums "
                                  f"(first: {bad[0][0]} block {bad[0][1]}); nothing was restored")
            return namespace
        except OSError as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise media.media_error(exc, f"restoring {version.url}") from exc
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    if os.path.lexists(backing) and not backing.is_dir():
        raise DeviceError(Status.INVALID_FIELD, f"{backing} is neither a device nor an empty directory")
    created_dir = not os.path.lexists(backing)
    try:
        backing.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise media.media_error(exc, f"creating {backing}") from exc
    staging = backing / STAGING_DIR
    try:
        # Held from the look at the target to the end of the move (released before an
        # existing device is opened, which takes the same lock itself).
        held = _lock_target(backing)
    except BaseException:
        if created_dir:  # only where still empty: another restore that made it too may hold it
            with contextlib.suppress(OSError):
                backing.rmdir()
        raise
    try:
        formatted = _prepare_target(backing)
        if capacity_bytes is not None and not formatted:
            raise DeviceError(Status.INVALID_FIELD, f"{backing} holds a device already: --capacity is for a fresh "
                                                    "one (its capacity was set when it was formatted)")
        if not formatted:
            held.close()
        started = time.monotonic()
        try:
            if formatted:
                Device.format(staging, capacity_bytes=capacity_bytes)
            with Device.open(staging if formatted else backing, DeviceConfig(sync=sync)) as device:
                namespace = device.adopt_namespace(spec.name, 2 * copy_bytes, build)
                result = {"namespace": namespace.name, "nsid": namespace.nsid,
                          "step": namespace.committed_step, "bytes": copy_bytes,
                          "backing": str(backing), "formatted": formatted, "source": version.url,
                          "capacity_bytes": device.capacity_bytes,
                          "manifest_checked": manifest["manifest_checked"],
                          "network_bytes_received": store.traffic.network_bytes_received}
            if formatted:
                _move_up(staging, backing)
            result["seconds"] = round(time.monotonic() - started, 3)
        except BaseException:
            if formatted:  # nothing built: what this call made goes again, and only that
                with contextlib.suppress(OSError, DeviceError):
                    _remove_own(backing, _moved_up(backing))
            raise
    except BaseException:
        if created_dir:
            with contextlib.suppress(OSError):
                backing.rmdir()  # only where empty: nothing but what this call made was there
        raise
    finally:
        held.close()
    return result
