"""The remote mount's daemon (`cossd mount cossd://HOST:PORT MNT`): connects to the storage
server with the mount's credentials, then serves the server's tree as a FUSE mount on this node."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyfuse3
import trio

from ...client.mounts import REMOTE_MOUNT_FSTYPE, mount_entries, mount_id_at, mount_type_at
from ...client.remote import parse_url
from ...client.watchdog import DEFAULT_TIMEOUT_S

from ..fuse_signals import stop_on_signal
from .lanes import DEFAULT_LANES, Credentials, Lanes, absolute
from .operations import RemoteOperations

log = logging.getLogger(__name__)

READY_MESSAGE = b"ready\n"
ERROR_PREFIX = b"error: "
SUBTYPE = REMOTE_MOUNT_FSTYPE.removeprefix("fuse.")
# How often the daemon looks whether its mount is still in the mount table, and how long it
# gives its requests in flight to end once the mount is gone before it exits regardless.
DETACH_POLL_S = 0.5
EXIT_GRACE_S = 5.0


class RemoteMountError(RuntimeError):
    """The remote mount could not start: the server unreachable, the credentials refused, a
    bad mountpoint. Nothing is left mounted."""


def mount_options(url: str, allow_other: bool, debug: bool) -> set[str]:
    # `mount` shows "cossd://HOST:PORT on MNT type fuse.cossd-remote"; `cossd umount` takes it.
    options = set(pyfuse3.default_options) | {f"fsname={url}", f"subtype={SUBTYPE}", "default_permissions",
                                               "nosuid", "nodev"}
    if allow_other:
        options.add("allow_other")
    if debug:
        options.add("debug")
    return options


def _tell(ready_fd: int | None, message: bytes) -> None:
    if ready_fd is not None:
        try:
            os.write(ready_fd, message)
            os.close(ready_fd)
        except OSError:
            pass


def _exit_after(grace_s: float, why: str) -> None:
    """Exit the process `grace_s` from now if it is still running then. The remote mount holds
    no state (the server does), so nothing is lost; a request stuck on the server (stopped,
    cut off) must not keep a detached mount's daemon alive until its timeout."""
    def stop() -> None:
        log.warning("%s; requests still in flight after %g s: exiting now", why, grace_s)
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(grace_s, stop)
    timer.daemon = True
    timer.start()


async def _watch_mount(mount_id: int | None, mountpoint: str, connections: Lanes) -> None:
    """End the daemon once its mount is gone from the mount table: detached by anyone
    (fusermount3 -u, umount, a lazy detach while files are open), not only by `cossd umount`.
    pyfuse3 ends its loop by itself on a plain unmount; a lazy detach with files still open,
    or a request in flight on a server that stopped answering, would keep it serving a mount
    nobody can reach by its path."""
    if mount_id is None:  # not in this mount namespace's table: nothing to watch
        return
    while True:
        await trio.sleep(DETACH_POLL_S)
        if all(entry.mount_id != mount_id for entry in mount_entries()):
            break
    why = f"the mount at {mountpoint} was detached"
    log.info("%s: closing the connections and exiting", why)
    _exit_after(EXIT_GRACE_S, why)
    pyfuse3.terminate()
    connections.close()  # a command in flight fails at once: its request answers ENOTCONN


async def _stop_on_signal(connections: Lanes) -> None:
    """SIGTERM, SIGINT or SIGHUP: end the loop, and close the connections, since pyfuse3's
    loop ends only once its requests have: one waiting on a stopped or cut-off server would
    hold the daemon until the client's timeout (120 s). Closed, it answers ENOTCONN at once."""
    await stop_on_signal()
    connections.close()


async def _serve(ready_fd: int | None, mount_id: int | None, mountpoint: str, connections: Lanes) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, connections)
        nursery.start_soon(_watch_mount, mount_id, mountpoint, connections)
        _tell(ready_fd, READY_MESSAGE)
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def serve(url: str, mountpoint: str | os.PathLike[str], credentials: Credentials, *,
          timeout_s: float = DEFAULT_TIMEOUT_S, allow_other: bool = False, debug: bool = False,
          ready_fd: int | None = None, lanes: int = DEFAULT_LANES) -> None:
    """Serve the server's tree at `mountpoint` until unmounted or signalled (foreground).
    The first connection is made before the mount: a server that cannot be reached or that
    refuses the credentials fails here, with nothing mounted (and the reason on `ready_fd`)."""
    server = str(parse_url(url))  # the mount's source: the server, without the URL's options
    connections = Lanes(url, credentials, timeout_s, lanes)  # with them (?digest=...)
    try:
        connections.check()
        check_mountpoint(mountpoint)
        operations = RemoteOperations(connections, worker_threads=max(4, 2 * lanes))
        pyfuse3.init(operations, str(mountpoint), mount_options(server, allow_other, debug))
    except BaseException as exc:
        connections.close()
        _tell(ready_fd, ERROR_PREFIX + str(exc).encode(errors="replace") + b"\n")
        raise
    log.info("mounted %s at %s (%d connections at most, timeout %g s)", url, mountpoint, lanes, timeout_s)
    try:
        trio.run(_serve, ready_fd, mount_id_at(Path(mountpoint), REMOTE_MOUNT_FSTYPE), str(mountpoint), connections)
    finally:
        pyfuse3.close(unmount=True)
        connections.close()
        log.info("unmounted %s from %s", server, mountpoint)


def check_mountpoint(mountpoint: str | os.PathLike[str]) -> None:
    """A directory with nothing mounted on it: a mount on top of another hides it (its files,
    its `.admin`) and `cossd list` could no longer tell the two apart."""
    fstype = mount_type_at(Path(mountpoint))
    if fstype is not None:
        raise RemoteMountError(f"{mountpoint} is already a mount point ({fstype}); unmount it first "
                               "or choose another directory")
    if not Path(mountpoint).is_dir():
        raise RemoteMountError(f"mountpoint {mountpoint} is not a directory")


def default_log_path(mountpoint: str | os.PathLike[str]) -> Path:
    """Where a background remote mount logs unless told: the user's cache directory, one file
    per mountpoint (a remote mount has no backing directory of its own)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cossd"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.abspath(mountpoint)).strip("-") or "root"
    return cache / f"remote-mount-{name}.log"


def start_background(url: str, mountpoint: str | os.PathLike[str], credentials: Credentials, *,
                     timeout_s: float = DEFAULT_TIMEOUT_S, allow_other: bool = False, debug: bool = False,
                     log_file: str | os.PathLike[str] | None = None, lanes: int = DEFAULT_LANES,
                     ) -> tuple[int, Path]:
    """Start a remote mount's daemon and return (its pid, its log) once the mount is ready;
    RemoteMountError with the daemon's own reason where it could not mount."""
    parse_url(url)  # a malformed URL: ValueError with a one-line message, nothing started
    check_mountpoint(mountpoint)
    log_path = Path(log_file) if log_file else default_log_path(mountpoint)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "cossd.tools.cli", "mount", "--foreground", "--ready-fd", "{fd}", url,
               os.path.abspath(mountpoint), "--timeout", f"{timeout_s:g}", "--connections", str(lanes)]
    # The client certificate and key come from the environment (COSSD_CLIENT_CERT/KEY), which
    # the daemon inherits, as every client takes them.
    for option, value in (("--token-file", credentials.token_file), ("--ca", credentials.ca)):
        if value is not None:
            command += [option, str(absolute(value))]
    if allow_other:
        command.append("--allow-other")
    if debug:
        command.append("--debug")
    read_fd, write_fd = os.pipe()
    command[command.index("{fd}")] = str(write_fd)
    try:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except BaseException:
        os.close(read_fd)
        os.close(write_fd)
        raise
    with open(log_fd, "ab") as log_stream:
        process = subprocess.Popen(command, pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=log_stream,
                                   stderr=log_stream, start_new_session=True)
    os.close(write_fd)
    # The daemon connects (at most its timeout), then mounts: a few seconds more at most.
    wait_s = timeout_s + 30.0
    message = b""
    with contextlib.closing(os.fdopen(read_fd, "rb", buffering=0)) as reader:
        deadline = time.monotonic() + wait_s
        while not message.endswith(b"\n") and time.monotonic() < deadline:
            readable, _, _ = select.select([reader], [], [], max(0.0, deadline - time.monotonic()))
            chunk = reader.read(4096) if readable else b""
            if not chunk:
                break
            message += chunk
    if message == READY_MESSAGE:
        return process.pid, log_path
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if message.startswith(ERROR_PREFIX):
        raise RemoteMountError(message[len(ERROR_PREFIX):].decode(errors="replace").strip())
    tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] if log_path.exists() else []
    raise RemoteMountError(f"the remote mount daemon failed to start (exit {process.returncode})"
                           + (f": {tail[0]}" if tail else "") + f"; log: {log_path}")


def daemon_pid(mountpoint: str | os.PathLike[str]) -> int | None:
    """The pid of the remote mount daemon serving `mountpoint` (as start_background runs it:
    `cossd.tools.cli mount --foreground ... URL MOUNTPOINT`), found by its command line, or
    None. `cossd umount` waits for it: the server's pid, which VENDOR_IDENTIFY gives, is not
    a process of this node."""
    target = os.path.abspath(mountpoint)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "cossd.tools.cli" in argv and "--foreground" in argv and target in argv and any(
                arg.startswith("cossd://") for arg in argv):
            return int(entry.name)
    return None
