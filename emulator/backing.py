"""The backing directory held by one process: a lock on the directory itself, and a check that no link or foreign file type sits where the device writes or deletes."""
from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Iterator

from ..protocol.status import DeviceError, Status

# Files at the top of the backing directory that the device writes (or the CLI appends to),
# and the type each must have. Anything else at the top is the user's and is left alone.
SUPERBLOCK_FILE = "superblock.json"  # the device's own record: identity, namespaces, health
TOP_LEVEL = {
    SUPERBLOCK_FILE: stat.S_IFREG,
    ".superblock.json.tmp": stat.S_IFREG,
    "in-use": stat.S_IFREG,
    "daemon.log": stat.S_IFREG,
    "ns": stat.S_IFDIR,
    "exports": stat.S_IFDIR,
}
NAMESPACES_DIR = "ns"
# An empty file a mount daemon creates before it serves and removes at a clean close: the
# in-use mark the next open can see at once (emulator/device.py, Device.mark_in_use).
IN_USE_FILE = "in-use"
EXPORTS_DIR = "exports"


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a fifo"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "an unknown file type"


def refusal(path: Path, found: str, wanted: str) -> DeviceError:
    return DeviceError(
        Status.INVALID_FIELD,
        f"refusing the backing directory: {path} is {found}, where the device keeps {wanted}; "
        "the device never follows links or writes other file types in its backing directory "
        "(remove or replace it)",
    )


class BackingDirectory:
    """An open descriptor of the backing directory, flocked exclusively.

    The lock is on the directory itself, not on a file in it: deleting or replacing any file
    cannot release it, and a second open (a second daemon, `cossd format --force`) fails as
    long as this process holds the descriptor.
    """

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        self.fd = fd

    @classmethod
    def lock(cls, root: Path) -> "BackingDirectory":
        """Take the device's lock; NAMESPACE_NOT_READY where another process holds it."""
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise DeviceError(Status.INVALID_FIELD, f"cannot open {root}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DeviceError(
                    Status.NAMESPACE_NOT_READY,
                    f"{root} is already opened by another process (a mounted daemon): it is in use",
                ) from None
            raise DeviceError(Status.INVALID_FIELD, f"cannot lock {root}: {exc.strerror}") from None
        return cls(root, fd)

    @classmethod
    def inspect(cls, root: Path) -> None:
        """check() without taking the lock (the CLI, before it starts a daemon, for a clear
        error): it reads only."""
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise DeviceError(Status.INVALID_FIELD, f"cannot open {root}: {exc.strerror}") from None
        backing = cls(root, fd)
        try:
            backing.check()
        finally:
            backing.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the flock
            self.fd = -1

    @property
    def held(self) -> bool:
        return self.fd >= 0

    # ------------------------------------------------------------------ the in-use file

    def in_use_file_exists(self) -> bool:
        return self._lstat(self.fd, IN_USE_FILE) is not None

    def create_in_use_file(self) -> None:
        """The empty in-use file, not fsynced (the caller makes it durable as it sees fit)."""
        # O_NONBLOCK: a fifo put there since the check must not hang the daemon (ENXIO instead).
        fd = os.open(IN_USE_FILE, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600, dir_fd=self.fd)
        try:
            mode = os.fstat(fd).st_mode
        finally:
            os.close(fd)
        if not stat.S_ISREG(mode):
            raise refusal(self.root / IN_USE_FILE, _kind(mode), _kind(stat.S_IFREG))

    def remove_in_use_file(self) -> bool:
        """Unlink the in-use file (not the directory fsync); whether there was one."""
        try:
            os.unlink(IN_USE_FILE, dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    # ------------------------------------------------------------------ the check

    def check(self) -> None:
        """Refuse (INVALID_FIELD, naming the path) a symbolic link or a foreign file type
        wherever the device writes or deletes: the known top-level files, everything under
        ns/ (namespaces, their files, snapshots and leftovers) and under exports/ (whose
        '.'-entries, and those of its per-namespace directories, a mount removes). Walked
        relative to the directory's descriptor, never through a link."""
        for name, wanted in TOP_LEVEL.items():
            mode = self._lstat(self.fd, name)
            if mode is not None and stat.S_IFMT(mode) != wanted:
                raise refusal(self.root / name, _kind(mode), _kind(wanted))
        for top in (NAMESPACES_DIR, EXPORTS_DIR):
            for relative, mode in self._walk(top):
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise refusal(self.root / relative, _kind(mode), "only files and directories")

    @staticmethod
    def _lstat(dir_fd: int, name: str) -> int | None:
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None

    def _walk(self, top: str) -> Iterator[tuple[str, int]]:
        """(path relative to the root, lstat mode) of each entry under directory `top` (the
        top itself is checked above)."""
        try:
            top_fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=self.fd)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise refusal(self.root / top, "not a directory", "a directory") from exc
        pending = [(top_fd, top)]
        try:
            while pending:
                fd, relative = pending.pop()
                try:
                    with os.scandir(fd) as entries:
                        listed = [(entry.name, entry.stat(follow_symlinks=False).st_mode) for entry in entries]
                    for name, mode in listed:
                        path = f"{relative}/{name}"
                        yield path, mode
                        if stat.S_ISDIR(mode):
                            # Opened from its parent's descriptor, without following: a swap
                            # to a link after the listing fails instead of leaving the tree.
                            try:
                                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                                | os.O_CLOEXEC, dir_fd=fd)
                            except OSError as exc:
                                raise refusal(self.root / path, "not a directory any more",
                                              "a directory") from exc
                            pending.append((child, path))
                finally:
                    os.close(fd)
        finally:
            for fd, _ in pending:
                os.close(fd)
