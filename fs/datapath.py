"""The data path: threads that serve the frequent requests straight off /dev/fuse (tensor and
control-file reads and writes, LOOKUP, GETATTR) and pass every other request on to pyfuse3.

Why: pyfuse3 runs every request on the one trio thread, and for 1 MiB gradient and param
requests that thread, not the kernels, was the limit (its receive, a bytes copy of each
request, trio's scheduling: the mount alone reached 32-42% of the in-memory kernel). Here
several threads read the FUSE device; a read() or writev() of 1 MiB releases the GIL, so the
copies in and out of the kernel run in parallel with each other and with the block updates,
and the only Python left per request is the namespace's bookkeeping.

How, without a second mount or a change for the client: after pyfuse3 has mounted, its
session descriptor is swapped (dup2) for one end of a SOCK_SEQPACKET socket pair. The data
path's threads own the real device descriptor. A READ or WRITE on an open tensor, NVM block,
control or text file, and every LOOKUP and GETATTR, is served here with Operations' own
blocking calls. Anything else (INIT, OPEN, READDIR, RELEASE, FORGET...) is sent whole through
the socket, where libfuse reads it as if from the device, and pyfuse3's replies come back
through the socket to one pump thread that writes them to the device. Both ends keep message
boundaries, which is all libfuse needs of its descriptor. Such a round trip costs two more
thread wake-ups than pyfuse3 reading the device itself, which is why the requests every
open and stat makes (one LOOKUP per path component: nothing is cached) are served here.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import threading
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

import pyfuse3
import trio

from .admin_queue import AdminHandle
from .handles import FileHandle

if TYPE_CHECKING:
    from ..emulator.namespace import Namespace

    from .handles import Stat
    from .nodes import Node
    from .tree import Tree

log = logging.getLogger(__name__)


class Served(Protocol):
    """What the data path serves requests with: the blocking calls of Operations
    (fs/operations.py), which answer as its pyfuse3 handlers do. Declared here, so the data
    path does not import the handlers that start it."""

    tree: "Tree"

    def data_handle(self, fh: int) -> AdminHandle | FileHandle | None: ...

    def write_data(self, handle: FileHandle, off: int, buf: memoryview) -> int: ...

    def read_data(self, handle: FileHandle, off: int, size: int) -> ContextManager[bytes | memoryview]: ...

    def write_command(self, handle: AdminHandle, buf: bytes | memoryview) -> int: ...

    def read_completion(self, handle: AdminHandle, size: int) -> bytes: ...

    def lookup_node(self, parent_inode: int, name: bytes) -> "Node": ...

    def getattr_node(self, inode: int) -> "Node": ...

    def stat_of(self, node: "Node") -> "Stat": ...

    def errno_for(self, exc: BaseException, what: str, *args: Any) -> int: ...

    def schedule_flushes(self) -> None: ...

    def schedule_flush(self, namespace: "Namespace") -> None: ...


# linux/fuse.h
FUSE_LOOKUP = 1
FUSE_GETATTR = 3
FUSE_READ = 15
FUSE_WRITE = 16
FUSE_INTERRUPT = 36
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
RW_IN = struct.Struct("<QQII")  # fh, offset, size, flags: the head of fuse_read_in and fuse_write_in
RW_IN_SIZE = 40  # sizeof(fuse_read_in) == sizeof(fuse_write_in)
WRITE_DATA_AT = IN_HEADER.size + RW_IN_SIZE
OUT_HEADER = struct.Struct("<IiQ")  # len, error (negative errno), unique
WRITE_OUT = struct.Struct("<IiQII")  # out header + fuse_write_out (size, padding)
INTERRUPT_IN = struct.Struct("<Q")
# fuse_attr: ino, size, blocks, atime, mtime, ctime, their nanoseconds, mode, nlink, uid, gid,
# rdev, blksize, flags (88 bytes)
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ATTR_OUT = struct.Struct("<IiQQII")  # out header + fuse_attr_out's head: attr_valid (s, ns), dummy
ENTRY_OUT = struct.Struct("<IiQQQQQII")  # out header + fuse_entry_out's head: nodeid, generation,
# entry_valid, attr_valid, entry_valid_nsec, attr_valid_nsec (timeouts 0: never cached)

# What libfuse reads at a time (FUSE_MAX_MAX_PAGES pages and a page of headers): the kernel
# refuses a read buffer that could not hold its largest request.
DEVICE_BUFFER = (256 + 1) * 4096
# Each socket direction must hold a whole message (a 1 MiB request or reply); a few of them.
SOCKET_BUFFER = 4 * DEVICE_BUFFER

DEFAULT_THREADS = max(2, len(os.sched_getaffinity(0)))


def fuse_device_fds() -> set[int]:
    """This process's descriptors open on /dev/fuse."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.add(int(name))
        except OSError:
            pass  # closed meanwhile (listdir's own descriptor)
    return found


def _size_buffers(sock: socket.socket) -> bool:
    """Make `sock`'s send buffer hold whole requests; False where the system will not."""
    for option in (getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF):
        if option is None:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            continue  # SO_SNDBUFFORCE needs CAP_NET_ADMIN
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * DEVICE_BUFFER:
            return True
    return False


class DataPath:
    """Serve the frequent requests on `threads` threads in front of pyfuse3 (see the module
    doc).

    attach() must run on the event loop after pyfuse3.init() and before pyfuse3.main() first
    waits on its descriptor; stop() after main() returns and before pyfuse3.close(), which
    then finds its own descriptor back.
    """

    def __init__(self, operations: Served, session_fd: int, threads: int = DEFAULT_THREADS) -> None:
        self.operations = operations
        self.session_fd = session_fd
        self.thread_count = threads
        self._device = -1
        self._ours: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._ended = threading.Event()  # the device is gone (unmounted or aborted)
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._serving: set[int] = set()  # uniques of the requests being served here
        # What the data path served, for tests and the daemon log.
        self._counts_lock = threading.Lock()
        self.requests_served = 0
        self.requests_forwarded = 0

    # ------------------------------------------------------------------ set up, tear down

    @classmethod
    def attach(cls, operations: Served, session_fd: int | None,
               threads: int = DEFAULT_THREADS) -> "DataPath | None":
        """A started data path, or None (pyfuse3 then reads the device itself) where it cannot
        run: no session descriptor found, or socket buffers the system will not size."""
        if session_fd is None or threads < 1:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if not (_size_buffers(ours) and _size_buffers(theirs)):
            log.warning("data path off: socket buffers cannot hold a %d-byte request", DEVICE_BUFFER)
            ours.close()
            theirs.close()
            return None
        path = cls(operations, session_fd, threads)
        path._start(ours, theirs)
        return path

    def _start(self, ours: socket.socket, theirs: socket.socket) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        self._device = os.dup(self.session_fd)
        # Non-blocking, so that idle threads wait in poll() with the wake-up pipe and stop()
        # can end them (a thread blocked in read() on the device could not be woken).
        os.set_blocking(self._device, False)
        os.dup2(theirs.fileno(), self.session_fd)  # libfuse now reads and writes the socket
        theirs.close()
        self._ours = ours
        self._wake_r, self._wake_w = os.pipe()
        for index in range(self.thread_count):
            self._threads.append(threading.Thread(
                target=self._serve_requests, name=f"cossd-io-{index}", daemon=True))
        self._threads.append(threading.Thread(target=self._pump_replies, name="cossd-io-replies", daemon=True))
        for thread in self._threads:
            thread.start()
        log.info("data path: %d threads serve requests in front of pyfuse3", self.thread_count)

    def stop(self) -> None:
        """End the threads and give pyfuse3 its device descriptor back."""
        self._stopping = True
        os.write(self._wake_w, b"x")  # never read: poll() stays readable for every thread
        assert self._ours is not None
        self._ours.shutdown(socket.SHUT_RDWR)  # ends the pump's recv()
        # pyfuse3 has stopped reading its end: shut it too, so that a thread blocked sending it
        # a request (its queue full) fails at once instead of waiting for ever.
        with socket.socket(fileno=os.dup(self.session_fd)) as theirs:
            theirs.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join()
        os.dup2(self._device, self.session_fd)
        for fd in (self._device, self._wake_r, self._wake_w):
            os.close(fd)
        self._ours.close()
        log.info("data path: %d requests served, %d passed to pyfuse3",
                 self.requests_served, self.requests_forwarded)

    # ------------------------------------------------------------------ the threads

    def _receive(self, poller: select.poll) -> bytes | None:
        """The next request from the device; None once the data path should end."""
        while not self._stopping:
            try:
                return os.read(self._device, DEVICE_BUFFER)
            except (BlockingIOError, InterruptedError):
                poller.poll()
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # interrupted before it was read: gone
                    continue
                if exc.errno != errno.ENODEV:
                    log.error("data path: reading the FUSE device failed: %s", exc)
                self._device_gone()
                return None
        return None

    def _serve_requests(self) -> None:
        poller = select.poll()
        poller.register(self._device, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while (request := self._receive(poller)) is not None:
            try:
                if not self._serve(request):
                    self._forward(request)
            except Exception:
                # A bug here must not leave the caller waiting: answer EIO (should a reply have
                # gone out already, the device refuses this one as for an unknown request).
                log.exception("data path: request failed")
                self._reply_error(IN_HEADER.unpack_from(request)[2], errno.EIO)

    def _serve(self, request: bytes) -> bool:
        """Serve `request` here if it is a read or write the data path takes; False to pass
        it on."""
        length, opcode, unique, nodeid = IN_HEADER.unpack_from(request)[:4]
        if opcode == FUSE_INTERRUPT:
            # The data path finishes its requests promptly and does not abandon them; an
            # interrupt for one would wait in libfuse's list forever.
            return INTERRUPT_IN.unpack_from(request, IN_HEADER.size)[0] in self._serving
        if opcode in (FUSE_LOOKUP, FUSE_GETATTR):
            # Each path component of an open or stat is a LOOKUP (nothing is cached): served
            # here, they skip the two thread wake-ups a round trip through pyfuse3 costs.
            self._attributes(unique, opcode, nodeid, request[IN_HEADER.size:length])
            self._count_served()
            return True
        if opcode not in (FUSE_READ, FUSE_WRITE) or length < WRITE_DATA_AT:
            return False
        fh, offset, size, _ = RW_IN.unpack_from(request, IN_HEADER.size)
        handle = self.operations.data_handle(fh)
        if handle is None:
            return False
        if opcode == FUSE_WRITE and length != WRITE_DATA_AT + size:
            return False  # not the layout this code knows: let libfuse judge it
        if log.isEnabledFor(logging.DEBUG):  # `cossd mount --debug`: libfuse logs the rest
            log.debug("data path: %s unique %d fh %d offset %d size %d",
                      "WRITE" if opcode == FUSE_WRITE else "READ", unique, fh, offset, size)
        self._serving.add(unique)
        try:
            if isinstance(handle, AdminHandle):
                self._command(unique, handle, opcode, request, size)
            elif opcode == FUSE_WRITE:
                self._write(unique, handle, offset, memoryview(request)[WRITE_DATA_AT:])
            else:
                self._read(unique, handle, offset, size)
        finally:
            self._serving.discard(unique)
        self._count_served()
        return True

    def _count_served(self) -> None:
        with self._counts_lock:
            self.requests_served += 1

    def _write(self, unique: int, handle: "FileHandle", offset: int, data: memoryview) -> None:
        try:
            written = self.operations.write_data(handle, offset, data)
        except Exception as exc:
            self._reply_error(unique, self.operations.errno_for(exc, "write", offset))
            return
        self._reply(WRITE_OUT.pack(WRITE_OUT.size, 0, unique, written, 0))
        if written and handle.node.role == "grad":
            self._schedule_flush(handle)

    def _read(self, unique: int, handle: "FileHandle", offset: int, size: int) -> None:
        try:
            with self.operations.read_data(handle, offset, size) as data:
                # The reply is written from the committed copy itself, while it is pinned.
                self._reply(OUT_HEADER.pack(OUT_HEADER.size + len(data), 0, unique), data)
        except Exception as exc:
            self._reply_error(unique, self.operations.errno_for(exc, "read", offset))

    def _attributes(self, unique: int, opcode: int, nodeid: int, argument: bytes) -> None:
        """LOOKUP (the argument is the name) or GETATTR of `nodeid`, answered as pyfuse3 would."""
        operations = self.operations
        try:
            if opcode == FUSE_LOOKUP:
                name = argument.split(b"\0", 1)[0]
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("data path: LOOKUP unique %d parent %d name %r", unique, nodeid, name)
                stat = operations.stat_of(operations.lookup_node(nodeid, name))
                head = ENTRY_OUT.pack(ENTRY_OUT.size + ATTR.size, 0, unique, stat.ino, 0, 0, 0, 0, 0)
            else:
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("data path: GETATTR unique %d inode %d", unique, nodeid)
                stat = operations.stat_of(operations.getattr_node(nodeid))
                head = ATTR_OUT.pack(ATTR_OUT.size + ATTR.size, 0, unique, 0, 0, 0)
        except Exception as exc:
            what = "lookup" if opcode == FUSE_LOOKUP else "getattr"
            self._reply_error(unique, operations.errno_for(exc, what, nodeid))
            return
        seconds, nanoseconds = divmod(stat.time_ns, 1_000_000_000)
        self._reply(head + ATTR.pack(stat.ino, stat.size, stat.blocks, seconds, seconds, seconds, nanoseconds,
                                     nanoseconds, nanoseconds, stat.mode, stat.nlink, stat.uid, stat.gid, 0,
                                     stat.blksize, 0))

    def _command(self, unique: int, handle: "AdminHandle", opcode: int, request: bytes, size: int) -> None:
        """The control file: a write submits commands, a read takes completions."""
        try:
            if opcode == FUSE_WRITE:
                written = self.operations.write_command(handle, memoryview(request)[WRITE_DATA_AT:])
                reply = WRITE_OUT.pack(WRITE_OUT.size, 0, unique, written, 0)
            else:
                completion = self.operations.read_completion(handle, size)
                reply = OUT_HEADER.pack(OUT_HEADER.size + len(completion), 0, unique) + completion
        except Exception as exc:
            what = "write" if opcode == FUSE_WRITE else "read"
            self._reply_error(unique, self.operations.errno_for(exc, f"{what} of the control file"))
            return
        self._reply(reply)
        if opcode == FUSE_WRITE:
            self._on_event_loop(self.operations.schedule_flushes)

    def _schedule_flush(self, handle: "FileHandle") -> None:
        """After a commit, make it durable in the background, as pyfuse3's path does."""
        namespace = self.operations.tree.namespace(handle.node)
        if namespace.flush_pending:
            self._on_event_loop(self.operations.schedule_flush, namespace)

    def _on_event_loop(self, function: Callable[..., object], *args: object) -> None:
        """Run `function` on the event loop, which owns the background flushes' bookkeeping;
        without waiting for it."""
        if self._trio_token is not None:
            try:
                self._trio_token.run_sync_soon(function, *args)
            except trio.RunFinishedError:
                pass  # unmounting: the close flushes

    def _forward(self, request: bytes) -> None:
        assert self._ours is not None
        try:
            self._ours.send(request)
        except OSError:
            return  # pyfuse3 has ended (unmounting)
        with self._counts_lock:
            self.requests_forwarded += 1

    def _pump_replies(self) -> None:
        """pyfuse3's replies (and notifications) to the device, one message at a time."""
        assert self._ours is not None
        scratch = bytearray(DEVICE_BUFFER)
        while True:
            try:
                size = self._ours.recv_into(scratch)
            except OSError:
                return
            if not size:
                return  # shut down
            self._reply(memoryview(scratch)[:size])

    def _reply(self, *parts: bytes | memoryview) -> None:
        try:
            os.writev(self._device, parts)
        except OSError as exc:
            # ENOENT: the request was interrupted or aborted meanwhile; ENODEV: unmounted.
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("data path: a reply to the FUSE device failed: %s", exc)

    def _reply_error(self, unique: int, error: int) -> None:
        self._reply(OUT_HEADER.pack(OUT_HEADER.size, -error, unique))

    def _device_gone(self) -> None:
        """The mount is gone: end pyfuse3's loop too (it no longer sees the device)."""
        if self._ended.is_set():
            return
        self._ended.set()
        self._stopping = True
        os.write(self._wake_w, b"x")
        if self._trio_token is not None:
            try:
                self._trio_token.run_sync_soon(pyfuse3.terminate)
            except trio.RunFinishedError:
                pass
