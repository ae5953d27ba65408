"""The backing store: every durable write of the device goes through these helpers."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import json
import os
import resource
import stat
from pathlib import Path
from typing import Any

import numpy as np

from .. import settings
from ..kernels import guard

from ..protocol.status import DeviceError, Status


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    # find_library may run ldconfig: once per process is enough.
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def libc_function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """A libc function by name (Linux), or None where libc has none."""
    try:
        function = getattr(_libc(), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = restype
    return function


def _sync_file_range() -> Any:
    return libc_function("sync_file_range", (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint),
                          ctypes.c_int)


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait


def _fstatfs_type() -> Any:
    """fstatfs as a function of a descriptor returning the filesystem's magic number, or None
    where libc has no fstatfs."""
    function = libc_function("fstatfs", (ctypes.c_int, ctypes.c_void_p), ctypes.c_int)
    if function is None:
        return None

    def magic(fd: int) -> int | None:
        buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on Linux x86-64
        if function(fd, buffer) != 0:
            return None
        return ctypes.c_long.from_buffer(buffer).value  # f_type is its first field
    return magic


_FILESYSTEM_MAGIC = _fstatfs_type()
# Filesystems whose shared mappings take stores without faults: they keep no per-page
# dirty accounting, so a page stays writable in the mapping after a sync.
_FAULT_FREE_MAPPINGS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
WRITE_MODES = ("auto", "mapped", "pwrite")


def write_mode_for(fd: int) -> str:
    """How a state copy's new contents should be written on this file's filesystem.

    "mapped": the kernel stores straight into the file's mapping (no copy). Right on tmpfs;
    on a disk filesystem every page the last flush cleaned is write-protected again, and the
    first store into each 4 KiB page takes a fault (measured 3x slower than a copy).
    "pwrite": the kernel writes a per-thread buffer that pwrite copies into the file.
    COSSD_STATE_WRITES=mapped|pwrite overrides the choice (tests and benchmarks).
    """
    forced = settings.STATE_WRITES.read()
    if forced not in WRITE_MODES:
        raise ValueError(f"COSSD_STATE_WRITES must be one of {', '.join(WRITE_MODES)}, not {forced!r}")
    if forced != "auto":
        return forced
    magic = _FILESYSTEM_MAGIC(fd) if _FILESYSTEM_MAGIC is not None else None
    return "mapped" if magic in _FAULT_FREE_MAPPINGS else "pwrite"


class MediaHooks:
    """Sees every write and sync of the backing store; tests install one to simulate power
    loss (which writes were synced when) or to inject faults (raise OSError)."""

    def before_write(self, path: Path) -> None: ...

    def before_sync(self, path: Path) -> None: ...

    def after_sync(self, path: Path) -> None: ...

    def before_dir_sync(self, path: Path) -> None: ...

    def after_dir_sync(self, path: Path) -> None: ...


_hooks: MediaHooks | None = None


def install_hooks(hooks: MediaHooks | None) -> MediaHooks | None:
    """Route the backing store's writes and syncs past `hooks` (None: none); returns the old."""
    global _hooks
    previous, _hooks = _hooks, hooks
    return previous


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames, removals) durable."""
    if _hooks is not None:
        _hooks.before_dir_sync(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise media_error(exc, f"syncing directory {path}") from exc
    if _hooks is not None:
        _hooks.after_dir_sync(path)


def _write_all_synced(fd: int, path: Path, data: bytes) -> None:
    """Write all of `data` at the file position of `fd`, then fsync it (the hooks see both)."""
    if _hooks is not None:
        _hooks.before_write(path)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    _fsync(fd, path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves either the old or the new file.

    tmp file, write, fsync, rename over the target, fsync the directory: the one helper
    for all durable metadata (JSON descriptors, superblock of the device).
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            _write_all_synced(fd, tmp, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise media_error(exc, f"writing {path.name}") from exc


def atomic_write_json(path: Path, value: Any) -> None:
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    """A device JSON file, opened as every device file is: never through a symbolic link or
    anything but a regular file (those at the top of the backing directory that the open's walk
    does not cover, e.g. archive_lineage.json, are refused here instead)."""
    fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
    try:
        _require_regular(fd, path)
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read()
    finally:
        os.close(fd)
    return json.loads(data)


def read_exact(fd: int, size: int, offset: int, what: str) -> bytes:
    """`size` bytes of `fd` at `offset`; UNRECOVERED_READ_ERROR ("`what` ends early") where the
    file ends first."""
    data = os.pread(fd, size, offset)
    while len(data) < size:
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"{what} ends early")
        data += more
    return data


def _fsync(fd: int, path: Path) -> None:
    if _hooks is not None:
        _hooks.before_sync(path)
    os.fsync(fd)
    if _hooks is not None:
        _hooks.after_sync(path)


def sync_fd(fd: int, path: Path) -> None:
    """fsync one backing file; a failure is fatal for the step (Linux cannot retry it)."""
    try:
        _fsync(fd, path)
    except OSError as exc:
        raise media_error(exc, f"syncing {path.name}") from exc


def media_error(exc: OSError, doing: str) -> DeviceError:
    """Translate an OSError of the backing store into the device status a client sees."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return DeviceError(Status.LIMIT_EXCEEDED, f"out of file descriptors while {doing} ({exc.strerror}; "
                                                  f"the daemon's limit is {descriptor_limit()}): raise ulimit -n")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DeviceError(Status.CAPACITY_EXCEEDED, f"backing store full while {doing}: {exc}")
    return DeviceError(Status.WRITE_FAULT, f"backing store failed while {doing}: {exc}")


def open_error(exc: OSError, path: Path, doing: str) -> DeviceError:
    """Translate a failed open of a backing file: a symbolic link or another file type where
    the device keeps a file is refused (never followed), and running out of descriptors says so."""
    if exc.errno == errno.ELOOP:
        return DeviceError(Status.UNRECOVERED_READ_ERROR,
                           f"{path} is a symbolic link: the device never follows links in its backing directory")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return DeviceError(Status.LIMIT_EXCEEDED, f"out of file descriptors while {doing} ({exc.strerror}; "
                                                  f"the daemon's limit is {descriptor_limit()}): raise ulimit -n")
    if exc.errno == errno.ENOENT:
        return DeviceError(Status.UNRECOVERED_READ_ERROR, f"{path} is missing")
    return media_error(exc, doing)


def descriptor_limit() -> int:
    """This process's soft limit on open file descriptors."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _require_regular(fd: int, path: Path) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise DeviceError(Status.UNRECOVERED_READ_ERROR,
                          f"{path} is not a regular file (mode {stat.filemode(info.st_mode)})")
    return info


# Every open of a device file: never through a symbolic link, never blocking on a fifo.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class StateFile:
    """One preallocated copy (A or B) of a namespace's state arrays, mapped shared; or, with
    mapped=False, a preallocated file only read and written with pread/pwrite (NVM data).

    Preallocation (fallocate) makes a full disk fail when the namespace is created rather
    than in the middle of a step. The mapping holds no descriptor of its own (one per copy
    in all) and is guarded (kernels/guard.py): if the file is cut short under it, the access
    completes on a zero page and `damage()` reports the copy, instead of a SIGBUS.
    """

    def __init__(self, path: Path, size_bytes: int, *, create: bool, mapped: bool = True) -> None:
        self.path = path
        self.size_bytes = size_bytes
        flags = os.O_RDWR | _OPEN_FLAGS | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            self.fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise open_error(exc, path, f"opening {path.name}") from exc
        self._mapping: guard.GuardedMapping | None = None
        try:
            info = _require_regular(self.fd, path)
            if create:
                os.posix_fallocate(self.fd, 0, size_bytes)
            elif info.st_size != size_bytes:
                raise DeviceError(
                    Status.UNRECOVERED_READ_ERROR,
                    f"{path} has {info.st_size} bytes, expected {size_bytes}",
                )
            self._identity = (info.st_dev, info.st_ino)
            # Whether every byte had its blocks when opened (preallocated, as the device makes
            # them): such a copy that later has fewer was cut short and extended again (a
            # pwrite past the end), and its holes read as zeros. A filesystem that stores
            # files in fewer blocks than their size (compression) is not checked this way.
            self._whole_at_open = os.fstat(self.fd).st_blocks * 512 >= size_bytes
            if mapped:
                try:
                    self._mapping = guard.GuardedMapping(self.fd, size_bytes)
                except guard.SlotsFull as exc:  # ENOSPC, but no disk is full
                    raise DeviceError(Status.LIMIT_EXCEEDED, f"mapping {path.name}: {exc.strerror}") from exc
            self.write_mode = write_mode_for(self.fd)
        except OSError as exc:
            os.close(self.fd)
            raise open_error(exc, path, f"allocating {path.name}") from exc
        except BaseException:
            os.close(self.fd)
            raise
        self.bytes = (np.frombuffer(self._mapping.buffer, dtype=np.uint8) if self._mapping is not None
                      else np.empty(0, dtype=np.uint8))

    def view(self, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        """A zero-copy array of `count` items of `dtype` starting at byte `offset`."""
        size = count * np.dtype(dtype).itemsize
        return self.bytes[offset : offset + size].view(dtype)

    def faults(self) -> int:
        """Bus errors contained in this copy's mapping so far (see kernels/guard.py)."""
        return self._mapping.faults() if self._mapping is not None else 0

    def damage(self) -> str | None:
        """Why this copy can no longer be trusted, or None: its mapping faulted (the file was
        cut short while mapped), or the file now has another size, or was deleted or replaced.
        A few system calls: cheap enough for every step."""
        name = self.path.name
        faults = self.faults()
        if faults:
            return f"{name}: {faults} page(s) of its mapping faulted (the file was cut short under it)"
        try:
            info = os.fstat(self.fd)
        except OSError as exc:
            return f"{name} cannot be checked: {exc.strerror}"
        if info.st_size != self.size_bytes:
            return f"{name} has {info.st_size} bytes, expected {self.size_bytes} (truncated or extended)"
        if self._whole_at_open and info.st_blocks * 512 < self.size_bytes:
            return (f"{name} has holes ({info.st_blocks * 512} of {self.size_bytes} bytes allocated): "
                    "it was cut short and extended again")
        if info.st_nlink == 0:
            return f"{name} was deleted or replaced while in use"
        try:
            current = os.stat(self.path, follow_symlinks=False)
        except OSError as exc:
            return f"{name} is gone from its directory ({exc.strerror})"
        if (current.st_dev, current.st_ino) != self._identity:
            return f"{name} was replaced by another file while in use"
        return None

    def write_at(self, offset: int, data: np.ndarray | bytes | bytearray | memoryview) -> None:
        """Write `data` at byte `offset` with pwrite rather than through the mapping.

        A page cleaned by the last flush is write-protected in every mapping, so storing
        into it through mmap takes one fault per 4 KiB page; pwrite copies without faulting.
        """
        # An array by its own buffer (numpy's stubs do not declare the buffer protocol).
        view = memoryview(data if isinstance(data, (bytes, bytearray, memoryview)) else data.data).cast("B")
        try:
            if _hooks is not None:
                _hooks.before_write(self.path)
            while view:
                written = os.pwrite(self.fd, view, offset)
                view = view[written:]
                offset += written
        except OSError as exc:
            raise media_error(exc, f"writing {self.path.name}") from exc

    def before_mapped_write(self) -> None:
        """Called before the kernel stores into the mapping (write_mode "mapped"), so the
        media hooks see that write as they see a pwrite."""
        try:
            if _hooks is not None:
                _hooks.before_write(self.path)
        except OSError as exc:
            raise media_error(exc, f"writing {self.path.name}") from exc

    def start_writeback(self, offset: int, size: int) -> None:
        """Let the disk start on a freshly written range now, so that the fsync at the end of
        the step finds little left to do (the step's compute overlaps the disk's work).

        Only a hint: it makes nothing durable and changes no ordering a crash could see.
        """
        if _SYNC_FILE_RANGE is not None and size > 0:
            _SYNC_FILE_RANGE(self.fd, offset, size, _SYNC_FILE_RANGE_WRITE)

    def sync(self) -> None:
        """Write this copy's dirty pages to the media."""
        sync_fd(self.fd, self.path)

    def close(self) -> None:
        # The mapping goes when the last view of it does (GuardedMapping), so an array that
        # escaped (a test holding one) never points at unmapped memory.
        self.bytes = np.empty(0, dtype=np.uint8)
        self._mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SlotFile:
    """A small file rewritten in place with one pwrite (a superblock slot).

    It holds no descriptor between uses: each read, write and sync opens it (never through
    a symbolic link) and closes it again, so a namespace keeps only its two state copies
    open. fsync through a new descriptor syncs the file's dirty pages all the same, and
    reports a writeback error no descriptor has seen yet.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def _open(self, flags: int, doing: str) -> int:
        try:
            fd = os.open(self.path, flags | _OPEN_FLAGS, 0o600)
        except OSError as exc:
            raise open_error(exc, self.path, doing) from exc
        try:
            _require_regular(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read(self) -> bytes:
        """The slot's bytes; empty where the file is missing (no superblock there)."""
        try:
            fd = self._open(os.O_RDONLY, f"reading {self.path.name}")
        except DeviceError:
            if not os.path.lexists(self.path):
                return b""
            raise
        try:
            return os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)

    def allocate(self, size_bytes: int) -> None:
        """Reserve the slot's blocks (it reads as zeros: no valid superblock)."""
        fd = self._open(os.O_RDWR | os.O_CREAT, f"allocating {self.path.name}")
        try:
            os.posix_fallocate(fd, 0, size_bytes)
        except OSError as exc:
            raise media_error(exc, f"allocating {self.path.name}") from exc
        finally:
            os.close(fd)

    def write(self, data: bytes) -> None:
        fd = self._open(os.O_WRONLY | os.O_CREAT, f"writing {self.path.name}")
        try:
            if _hooks is not None:
                _hooks.before_write(self.path)
            written = os.pwrite(fd, data, 0)
            if written != len(data):
                raise OSError(errno.EIO, "short write")
        except OSError as exc:
            raise media_error(exc, f"writing {self.path.name}") from exc
        finally:
            os.close(fd)

    def sync(self) -> None:
        fd = self._open(os.O_RDONLY, f"syncing {self.path.name}")
        try:
            sync_fd(fd, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Nothing to release (no descriptor is held); kept for the callers' symmetry."""


def write_new_file(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist) holding `data`, fsynced. Not atomic by itself: for
    files inside a directory that is made visible by a rename afterwards (snapshots)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all_synced(fd, path, data)
        finally:
            os.close(fd)
    except OSError as exc:
        raise media_error(exc, f"writing {path.name}") from exc


COPY_CHUNK_BYTES = 4 << 20


def copy_range(source_fd: int, dest_fd: int, dest_path: Path, size: int, *, share_extents: bool) -> None:
    """Copy the first `size` bytes of one file into another (from offset 0, not synced).

    share_extents=True lets the kernel copy in place or share extents (reflink on XFS and
    btrfs): right for a file that is never written again. False writes real blocks, so a
    preallocated destination keeps its own blocks and a later overwrite cannot need new
    space (a state copy a step will write into).
    """
    try:
        if _hooks is not None:
            _hooks.before_write(dest_path)
        offset = 0
        if share_extents:
            while offset < size:
                copied = os.copy_file_range(source_fd, dest_fd, size - offset, offset, offset)
                if copied == 0:
                    raise OSError(errno.EIO, f"source ends at {offset} of {size} bytes")
                offset += copied
            return
        buffer = bytearray(min(COPY_CHUNK_BYTES, max(size, 1)))
        while offset < size:
            chunk = memoryview(buffer)[: min(len(buffer), size - offset)]
            got = os.preadv(source_fd, [chunk], offset)
            if got == 0:
                raise OSError(errno.EIO, f"source ends at {offset} of {size} bytes")
            view = chunk[:got]
            position = offset
            while view:
                written = os.pwrite(dest_fd, view, position)
                view, position = view[written:], position + written
            offset += got
    except OSError as exc:
        raise media_error(exc, f"copying into {dest_path.name}") from exc
