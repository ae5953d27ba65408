"""Starting the mount daemon as a process of its own and waiting until it serves, and stopping it: what `cossd mount` and `cossd umount` run.

Apart from fs/daemon.py, whose imports (trio, pyfuse3, numpy, the emulator) the command line
would otherwise pay before the daemon even starts: a restart waits for both processes'
imports in turn. This module imports the standard library and the light parts of cossd
(the backing directory's checks, the timing profiles, the status codes, the mount table's reader).
"""
from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..client.mounts import MOUNT_FSTYPE, mount_type_at
from ..emulator.backing import SUPERBLOCK_FILE, BackingDirectory
from ..model.profiles import load_profile
from ..protocol.status import DeviceError, Status
from .mount_options import MountOptions

READY_MESSAGE = b"ready\n"  # what the daemon writes to --ready-fd once its mount serves


def open_default_log(path: Path) -> int:
    """Open BACKING/daemon.log for appending, refusing (never following) a link or a file
    of another type there; a descriptor for the daemon's stdout and stderr."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link; a fifo nobody reads
            raise DeviceError(Status.INVALID_FIELD,
                              f"refusing {path}: it is {'a symbolic link' if exc.errno == errno.ELOOP else 'a fifo'}; "
                              "the device never follows links or writes other file types in its "
                              "backing directory (remove it)") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise DeviceError(Status.INVALID_FIELD, f"refusing {path}: it is not a regular file (remove it)")
    os.set_blocking(fd, True)
    return fd


def check_mountpoint(mountpoint: str | os.PathLike[str]) -> None:
    """A directory with nothing mounted on it. A second device mounted on top of a mount hides
    the first (its files, its `.admin`: every tool would talk to the top one), so it is
    refused; checked before the directory itself, whose stat would hang on a hung mount."""
    fstype = mount_type_at(Path(mountpoint))
    if fstype is not None:
        raise DeviceError(Status.INVALID_FIELD, f"{mountpoint} is already a mount point ({fstype}); unmount it "
                                                "first or choose another directory")
    if not Path(mountpoint).is_dir():
        raise DeviceError(Status.INVALID_FIELD, f"mountpoint {mountpoint} is not a directory")


def start_background(backing: str | os.PathLike[str], mountpoint: str | os.PathLike[str], *,
                     log_file: str | os.PathLike[str] | None = None, timeout_s: float = 60.0,
                     **options: Any) -> int:
    """Start a daemon process and return its pid once the mount is ready; `options` are
    MountOptions' fields by name (an unknown one is a TypeError; one given as None keeps its
    default, as a flag left out does), for scripts and tests."""
    given = {name: value for name, value in options.items() if value is not None}
    return start(MountOptions(os.fspath(backing), os.fspath(mountpoint), **given), log_file=log_file,
                 timeout_s=timeout_s)


def start(options: MountOptions, *, log_file: str | os.PathLike[str] | None = None, timeout_s: float = 60.0) -> int:
    """Start a daemon process serving `options` and return its pid once the mount is ready."""
    backing, mountpoint = options.backing, Path(options.mountpoint)
    # Check what can be checked here, so the common mistakes get a clear one-line error.
    if not (Path(backing) / SUPERBLOCK_FILE).is_file():
        raise DeviceError(Status.INVALID_FIELD, f"{backing} is not a cossd device (run `cossd format {backing}`)")
    check_mountpoint(mountpoint)
    load_profile(options.profile)  # an unknown profile, likewise
    # A link or foreign file where the device writes, likewise (the daemon checks again
    # under its lock before it writes anything).
    BackingDirectory.inspect(Path(backing))
    # A device another daemon has open, likewise (taken and released: the daemon takes it
    # for good; a race between the two ends in the daemon's own refusal).
    BackingDirectory.lock(Path(backing)).close()
    read_fd, write_fd = os.pipe()
    # The daemon's own entry, which imports the daemon and not the whole command line
    # (fs/mount_main.py): part of what a restart waits for. The options travel as one JSON
    # argument, every field as it is.
    command = [sys.executable, "-m", "cossd.fs.mount_main", "--ready-fd", str(write_fd),
               "--options", options.for_daemon().to_json()]
    log_path = Path(log_file) if log_file else Path(backing) / "daemon.log"
    try:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666) if log_file \
            else open_default_log(log_path)
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    mounted_before = mount_type_at(mountpoint)
    try:
        with open(log_fd, "ab") as log_stream:
            process = subprocess.Popen(
                command, pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=log_stream,
                stderr=log_stream, start_new_session=True,
            )
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    deadline = time.monotonic() + timeout_s
    message = b""
    try:
        with contextlib.closing(os.fdopen(read_fd, "rb", buffering=0)) as reader:
            # The child writes "ready" or dies (closing the pipe); a hung child times out.
            readable, _, _ = select.select([reader], [], [], timeout_s)
            if readable:
                message = reader.read(len(READY_MESSAGE))
    except BaseException:
        # Interrupted while waiting (Ctrl-C, a bench's signal handler): the caller never gets
        # the pid, so nobody else could stop this daemon or take its mount off.
        _abandon(process, mountpoint, mounted_before)
        raise
    if message != READY_MESSAGE:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _abandon(process, mountpoint, mounted_before)  # hung: it never said ready, so nothing was served
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
        raise RuntimeError(
            f"mount daemon failed to start (exit {process.returncode})"
            + (f": {tail[0]}" if tail else "") + f"; log: {log_path}"
        )
    return process.pid


def _abandon(process: subprocess.Popen[bytes], mountpoint: Path, mounted_before: str | None) -> None:
    """Kill a daemon that never said ready, and take off a FUSE mount it left answering
    nothing, but only a cossd mount that was not there before this start."""
    process.kill()
    process.wait()
    if mounted_before != MOUNT_FSTYPE and mount_type_at(mountpoint) == MOUNT_FSTYPE:
        _unmount(mountpoint, lazy=True)


def wait_for_exit(pid: int, timeout_s: float = 60.0) -> bool:
    """Wait until process `pid` is gone, reaping it if it is our child; False on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            reaped, _ = os.waitpid(pid, os.WNOHANG)
            if reaped == pid:
                return True
        except ChildProcessError:
            pass  # not our child: watch /proc instead
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.01)
    return False


def stop_background(mountpoint: str | os.PathLike[str], pid: int, *, lazy: bool = False,
                    timeout_s: float = 60.0) -> bool:
    """Unmount a daemon started by start_background and wait for it to flush and exit."""
    _unmount(mountpoint, lazy=lazy)
    return wait_for_exit(pid, timeout_s)


def _unmount(mountpoint: str | os.PathLike[str], *, lazy: bool) -> None:
    """fusermount3 -u (-z: detach now, even if busy or answering nothing); its errors are the
    caller's to find (the mount still there, the daemon still running)."""
    subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), str(mountpoint)], capture_output=True)
