"""The data path: threads that serve the frequent requests straight off /dev/fuse (tensor and
control-file reads and writes, LOOKUP, GETATTR, and the OPEN, FLUSH and RELEASE of tensor
files) and pass every other request on to pyfuse3.

Why: pyfuse3 runs every request on the one trio thread, and for 1 MiB gradient and param
requests that thread, not the kernels, was the limit (its receive, a bytes copy of each
request, trio's scheduling: the mount alone reached 32-42% of the in-memory kernel). Here
several threads read the FUSE device; a read() or writev() of 1 MiB releases the GIL, so the
copies in and out of the kernel run in parallel with each other and with the block updates,
and the only Python left per request is the namespace's bookkeeping.

How, without a second mount or a change for the client: after pyfuse3 has mounted, its
session descriptor is swapped (dup2) for one end of a SOCK_SEQPACKET socket pair. The data
path's threads own the real device descriptor. A READ or WRITE on an open tensor, NVM block,
control or text file, every LOOKUP and GETATTR, and a tensor file's OPEN, FLUSH and RELEASE
are served here with Operations' own blocking calls. Anything else (INIT, READDIR, the opens
of other files, FORGET...) is sent whole through the socket, where libfuse reads it as if
from the device, and pyfuse3's replies come back through the socket to one pump thread that
writes them to the device. Both ends keep message boundaries, which is all libfuse needs of
its descriptor. Such a round trip costs two more thread wake-ups than pyfuse3 reading the
device itself, which is why the requests every open, close and stat of a tensor file makes
(one LOOKUP and one GETATTR per path component: nothing is cached) are served here.

Larger requests: libfuse asks the kernel for requests of at most 1 MiB (its buffer). The
data path rewrites libfuse's INIT reply on its way to the device to ask for `request_pages`
pages instead (max_write, max_pages), where the mount's kernel limit allows more
(fs/fuse_limits.py) and the sockets can hold such messages; its own reads of the device take
buffers that large. Fewer, larger requests cost fewer reads, replies and rounds of Python.
"""
from __future__ import annotations

import errno
import logging
import os
import select
import socket
import struct
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Protocol

import pyfuse3
import trio

from .admin_queue import AdminHandle
from .handles import FileHandle
from .nodes import Kind

if TYPE_CHECKING:
    from ..emulator.face import Namespace

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

    def open_handle(self, inode: int, flags: int) -> tuple[int, bool, bool]: ...

    def release_handle(self, fh: int) -> None: ...

    def schedule_flushes(self) -> None: ...

    def schedule_flush(self, namespace: "Namespace") -> None: ...


# linux/fuse.h
FUSE_LOOKUP = 1
FUSE_GETATTR = 3
FUSE_OPEN = 14
FUSE_RELEASE = 18
FUSE_FLUSH = 25
FUSE_READ = 15
FUSE_WRITE = 16
FUSE_INIT = 26
FUSE_INTERRUPT = 36
FUSE_MAX_PAGES = 1 << 22  # fuse_init_in/out flags: init_out.max_pages is read
INIT_IN = struct.Struct("<IIII")  # fuse_init_in's head: major, minor, max_readahead, flags
# fuse_init_out's fields this code sets, after the out header: flags at 12, max_write at 20,
# max_pages at 28 (a u16)
INIT_OUT_FLAGS_AT, INIT_OUT_MAX_WRITE_AT, INIT_OUT_MAX_PAGES_AT = 16 + 12, 16 + 20, 16 + 28
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
RW_IN = struct.Struct("<QQII")  # fh, offset, size, flags: the head of fuse_read_in and fuse_write_in
RW_IN_SIZE = 40  # sizeof(fuse_read_in) == sizeof(fuse_write_in)
WRITE_DATA_AT = IN_HEADER.size + RW_IN_SIZE
OUT_HEADER = struct.Struct("<IiQ")  # len, error (negative errno), unique
WRITE_OUT = struct.Struct("<IiQII")  # out header + fuse_write_out (size, padding)
INTERRUPT_IN = struct.Struct("<Q")
OPEN_IN = struct.Struct("<II")  # fuse_open_in: flags, open_flags
OPEN_OUT = struct.Struct("<IiQQIi")  # out header + fuse_open_out: fh, open_flags, backing_id
FOPEN_DIRECT_IO, FOPEN_NONSEEKABLE = 1 << 0, 1 << 2
# The files whose OPEN, FLUSH and RELEASE the data path answers itself (their reads and writes
# too): tensor files and namespaces' text files.
OPENED_HERE = (Kind.ARRAY, Kind.TEXT)
FH_IN = struct.Struct("<Q")  # the head of fuse_release_in and fuse_flush_in: fh
# fuse_attr: ino, size, blocks, atime, mtime, ctime, their nanoseconds, mode, nlink, uid, gid,
# rdev, blksize, flags (88 bytes)
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ATTR_OUT = struct.Struct("<IiQQII")  # out header + fuse_attr_out's head: attr_valid (s, ns), dummy
ENTRY_OUT = struct.Struct("<IiQQQQQII")  # out header + fuse_entry_out's head: nodeid, generation,
# entry_valid, attr_valid, entry_valid_nsec, attr_valid_nsec (timeouts 0: never cached)

PAGE = 4096
# What libfuse reads at a time (FUSE_MAX_MAX_PAGES pages and a page of headers), from the device
# or, with the data path, from its socket: no message to it may be larger.
LIBFUSE_PAGES = 256
DEVICE_BUFFER = (LIBFUSE_PAGES + 1) * PAGE


def device_buffer(request_pages: int) -> int:
    """What one read of the device takes when requests carry up to `request_pages` pages of
    data: the kernel refuses a read buffer that could not hold its largest request."""
    return (max(request_pages, LIBFUSE_PAGES) + 1) * PAGE


def socket_buffer(request_pages: int) -> int:
    """Each socket direction must hold a whole message (a request or reply); a few of them."""
    return 4 * device_buffer(request_pages)

DEFAULT_THREADS = max(2, len(os.sched_getaffinity(0)))
# Python's socket module does not name it; Linux's asm-generic/socket.h does (CAP_NET_ADMIN:
# past net.core.wmem_max).
SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32 if sys.platform.startswith("linux") else None)


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


def _size_buffers(sock: socket.socket, request_pages: int = LIBFUSE_PAGES) -> bool:
    """Make `sock`'s send buffer hold whole requests of `request_pages` pages; False where the
    system will not."""
    for option in (SO_SNDBUFFORCE, socket.SO_SNDBUF):
        if option is None:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, socket_buffer(request_pages))
        except OSError:
            continue  # SO_SNDBUFFORCE needs CAP_NET_ADMIN
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * device_buffer(request_pages):
            return True
    return False


class DataPath:
    """Serve the frequent requests on `threads` threads in front of pyfuse3 (see the module
    doc).

    attach() must run on the event loop after pyfuse3.init() and before pyfuse3.main() first
    waits on its descriptor; stop() after main() returns and before pyfuse3.close(), which
    then finds its own descriptor back.
    """

    def __init__(self, operations: Served, session_fd: int, threads: int = DEFAULT_THREADS,
                 request_pages: int = LIBFUSE_PAGES) -> None:
        self.operations = operations
        self.session_fd = session_fd
        self.thread_count = threads
        # The largest request's data, in pages, that this data path asks the kernel for in
        # its INIT reply (libfuse asks for LIBFUSE_PAGES); the kernel may grant fewer.
        self.request_pages = max(request_pages, LIBFUSE_PAGES)
        self._buffer_size = device_buffer(self.request_pages)
        self._init_unique: int | None = None  # the INIT whose reply is to carry request_pages
        self._device = -1
        self._ours: socket.socket | None = None
        self._wake_r, self._wake_w = -1, -1
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._ended = threading.Event()  # the device is gone (unmounted or aborted)
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._serving: set[int] = set()  # uniques of the requests being served here
        # Per serving thread: whether the request it serves has had its reply (or was passed
        # to pyfuse3, which replies). A failure after that must not answer it a second time.
        self._answered = threading.local()
        # What the data path served, for tests and the daemon log.
        self._counts_lock = threading.Lock()
        self.requests_served = 0
        self.requests_forwarded = 0

    # ------------------------------------------------------------------ set up, tear down

    @classmethod
    def attach(cls, operations: Served, session_fd: int | None, threads: int = DEFAULT_THREADS,
               request_pages: int = LIBFUSE_PAGES) -> "DataPath | None":
        """A started data path, or None (pyfuse3 then reads the device itself) where it cannot
        run: no session descriptor found, or socket buffers the system will not size.

        `request_pages` (more than libfuse's 256: the mount's kernel limit allows it, see
        fs/fuse_limits.py) is asked for in the INIT reply, where the sockets can hold such
        requests; else requests stay at libfuse's size."""
        if session_fd is None or threads < 1:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if not (_size_buffers(ours) and _size_buffers(theirs)):
            log.warning("data path off: socket buffers cannot hold a %d-byte request", DEVICE_BUFFER)
            ours.close()
            theirs.close()
            return None
        pages = LIBFUSE_PAGES
        if request_pages > LIBFUSE_PAGES:
            if _size_buffers(ours, request_pages) and _size_buffers(theirs, request_pages):
                pages = request_pages
            else:
                log.info("FUSE requests stay at %d pages: socket buffers cannot hold a %d-byte request",
                         LIBFUSE_PAGES, device_buffer(request_pages))
                _size_buffers(ours)
                _size_buffers(theirs)
        path = cls(operations, session_fd, threads, pages)
        path._start(ours, theirs)
        return path

    def _start(self, ours: socket.socket, theirs: socket.socket) -> None:
        self._trio_token = trio.lowlevel.current_trio_token()
        self._device = os.dup(self.session_fd)
        # Non-blocking, so that idle threads wait in epoll with the wake-up pipe and stop()
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
        log.info("data path: %d threads serve requests in front of pyfuse3 (asking for requests of up to %d pages)",
                 self.thread_count, self.request_pages)

    def stop(self) -> None:
        """End the threads and give pyfuse3 its device descriptor back."""
        self._stopping = True
        os.write(self._wake_w, b"x")  # never read: it stays readable for every thread
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

    def _receive(self, poller: select.epoll) -> bytes | None:
        """The next request from the device; None once the data path should end."""
        while not self._stopping:
            try:
                return os.read(self._device, self._buffer_size)
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
        # EPOLLEXCLUSIVE: a request wakes one idle thread, not all of them (with poll() every
        # thread woke for each request and all but one went back to sleep empty-handed). The
        # wake-up pipe is not exclusive: stop() wakes them all.
        poller = select.epoll()
        poller.register(self._device, select.EPOLLIN | select.EPOLLEXCLUSIVE)
        poller.register(self._wake_r, select.EPOLLIN)
        try:
            self._serve_until_stopped(poller)
        finally:
            poller.close()

    def _serve_until_stopped(self, poller: select.epoll) -> None:
        while (request := self._receive(poller)) is not None:
            self._answered.done = False
            try:
                if not self._serve(request):
                    self._forward(request)
            except Exception:
                if self._answered.done:
                    # Exactly one reply per request: the caller has its answer (the kernel
                    # would refuse a second as one for an unknown request).
                    log.exception("data path: request failed after its reply (not answered again)")
                    continue
                # A bug here must not leave the caller waiting: answer EIO.
                log.exception("data path: request failed")
                self._reply_error(IN_HEADER.unpack_from(request)[2], errno.EIO)

    def _serve(self, request: bytes) -> bool:
        """Serve `request` here if it is a read or write the data path takes; False to pass
        it on."""
        length, opcode, unique, nodeid = IN_HEADER.unpack_from(request)[:4]
        if opcode == FUSE_INIT:
            # libfuse answers it (through the socket); its reply gets the larger request size
            # on the way back (_pump_replies) where the kernel offers FUSE_MAX_PAGES.
            flags = INIT_IN.unpack_from(request, IN_HEADER.size)[3] if length >= IN_HEADER.size + INIT_IN.size else 0
            if self.request_pages > LIBFUSE_PAGES and flags & FUSE_MAX_PAGES:
                self._init_unique = unique
            return False
        if opcode == FUSE_INTERRUPT:
            # The data path finishes its requests promptly and does not abandon them; an
            # interrupt for one would wait in libfuse's list forever.
            return INTERRUPT_IN.unpack_from(request, IN_HEADER.size)[0] in self._serving
        if opcode in (FUSE_OPEN, FUSE_FLUSH, FUSE_RELEASE) and self._opened_here(opcode, nodeid, request):
            # The opens and closes of tensor and text files: served here, they skip the round
            # trip through pyfuse3 (two thread wake-ups each) that a step's opens and closes
            # waited for, and that made reading a namespace's `step` 1.0-1.5 ms. Other files'
            # (control, snapshot, NVM data) go on to pyfuse3.
            self._serving.add(unique)
            try:
                self._open_or_close(unique, opcode, nodeid, request)
            finally:
                self._serving.discard(unique)
            self._count_served()
            return True
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

    def _opened_here(self, opcode: int, nodeid: int, request: bytes) -> bool:
        """Whether this OPEN (of `nodeid`), FLUSH or RELEASE (of its file handle) is of a
        tensor file or a namespace's text file (step, config.json, stats.json: their text is
        made at the open, as LOOKUP and GETATTR, which are served here, make it for the size)."""
        if len(request) < IN_HEADER.size + FH_IN.size:
            return False
        if opcode == FUSE_OPEN:
            try:
                return self.operations.tree.node(nodeid).kind in OPENED_HERE
            except Exception:
                return False  # pyfuse3 answers (the same errno)
        handle = self.operations.data_handle(FH_IN.unpack_from(request, IN_HEADER.size)[0])
        return isinstance(handle, FileHandle) and handle.node.kind in OPENED_HERE

    def _open_or_close(self, unique: int, opcode: int, nodeid: int, request: bytes) -> None:
        """OPEN of `nodeid`, FLUSH (a no-op, as pyfuse3's handler) or RELEASE, answered as
        pyfuse3 would."""
        operations = self.operations
        if opcode == FUSE_OPEN:
            flags = OPEN_IN.unpack_from(request, IN_HEADER.size)[0]
            if log.isEnabledFor(logging.DEBUG):
                log.debug("data path: OPEN unique %d inode %d flags 0x%x", unique, nodeid, flags)
            try:
                fh, direct_io, nonseekable = operations.open_handle(nodeid, flags)
            except Exception as exc:
                self._reply_error(unique, operations.errno_for(exc, "open", nodeid, flags))
                return
            open_flags = (FOPEN_DIRECT_IO if direct_io else 0) | (FOPEN_NONSEEKABLE if nonseekable else 0)
            if not self._reply(OPEN_OUT.pack(OPEN_OUT.size, 0, unique, fh, open_flags, 0)):
                operations.release_handle(fh)  # the open was interrupted: nobody holds it (as libfuse does)
            return
        fh = FH_IN.unpack_from(request, IN_HEADER.size)[0]
        if log.isEnabledFor(logging.DEBUG):
            log.debug("data path: %s unique %d fh %d", "FLUSH" if opcode == FUSE_FLUSH else "RELEASE", unique, fh)
        if opcode == FUSE_RELEASE:
            operations.release_handle(fh)
        self._reply(OUT_HEADER.pack(OUT_HEADER.size, 0, unique))

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
        """After a commit, make it durable in the background, as pyfuse3's path does. The
        write has been answered: a namespace deleted since (`cossd delete-ns` from another
        process) has nothing left to flush (its close flushed it)."""
        try:
            namespace = self.operations.tree.namespace(handle.node)
        except pyfuse3.FUSEError:
            return
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
        if len(request) > DEVICE_BUFFER:
            # More than libfuse reads at a time (only a WRITE can be: on a handle the data
            # path does not serve, which pyfuse3 refuses as EBADF): it would get it cut short.
            length, opcode, unique = IN_HEADER.unpack_from(request)[:3]
            log.warning("data path: refusing a %d-byte request (opcode %d) larger than libfuse reads", length, opcode)
            self._reply_error(unique, errno.EBADF if opcode == FUSE_WRITE else errno.EIO)
            return
        try:
            self._ours.send(request)
        except OSError:
            return  # pyfuse3 has ended (unmounting)
        self._answered.done = True  # pyfuse3 replies
        with self._counts_lock:
            self.requests_forwarded += 1

    def _pump_replies(self) -> None:
        """pyfuse3's replies (and notifications) to the device, one message at a time."""
        assert self._ours is not None
        scratch = bytearray(self._buffer_size)
        while True:
            try:
                size = self._ours.recv_into(scratch)
            except OSError:
                return
            if not size:
                return  # shut down
            if self._init_unique is not None:
                self._ask_for_larger_requests(scratch, size)
            self._reply(memoryview(scratch)[:size])

    def _ask_for_larger_requests(self, reply: bytearray, size: int) -> None:
        """If `reply` is libfuse's INIT reply, have it ask for requests of request_pages pages
        (max_write and max_pages; the kernel grants up to its limit for the mount). Every
        read of the device takes a buffer that large, so the kernel's check of it passes."""
        _, error, unique = OUT_HEADER.unpack_from(reply)
        if unique != self._init_unique:
            return
        self._init_unique = None
        if error or size < INIT_OUT_MAX_PAGES_AT + 2:
            return
        flags = struct.unpack_from("<I", reply, INIT_OUT_FLAGS_AT)[0]
        if not flags & FUSE_MAX_PAGES:
            return
        struct.pack_into("<I", reply, INIT_OUT_MAX_WRITE_AT, self.request_pages * PAGE)
        struct.pack_into("<H", reply, INIT_OUT_MAX_PAGES_AT, self.request_pages)
        log.info("data path: FUSE requests of up to %d pages (%d KiB) asked for",
                 self.request_pages, self.request_pages * PAGE >> 10)

    def _reply(self, *parts: bytes | memoryview) -> bool:
        """Write a reply to the device; False where the device did not take it."""
        self._answered.done = True  # tried: never a second reply to the request, taken or not
        try:
            os.writev(self._device, parts)
        except OSError as exc:
            # ENOENT: the request was interrupted or aborted meanwhile; ENODEV: unmounted.
            if exc.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("data path: a reply to the FUSE device failed: %s", exc)
            return False
        return True

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
