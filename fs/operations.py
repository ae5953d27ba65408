"""pyfuse3 request handlers: each maps one FUSE request onto the device, errors onto errno."""
from __future__ import annotations

import collections
import contextlib
import errno
import functools
import itertools
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Concatenate, Coroutine, Iterator, ParamSpec, TypeVar, cast

import pyfuse3
import trio

from ..emulator.face import DATA_ROLE, LOADABLE_ROLES, AnyNamespace, Controller, Device, DeviceError

from .admin_queue import AdminHandle
from .handles import FileHandle, Stat
from .nodes import FILE_KINDS, SNAPSHOT_KINDS, Kind, Node, fuse_error
from .refusals import RefusedWriteLog
from .times import NodeTimes
from .tree import Tree

if TYPE_CHECKING:
    from .datapath import DataPath

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")
OperationsT = TypeVar("OperationsT", bound="Operations")

# How often the daemon saves the device's health figures (SMART) to superblock.json. A clean
# unmount saves them too; a crash loses at most this much counting.
HEALTH_SAVE_INTERVAL_S = 60.0

# The tensor files the host may write: gradients, and the loadable state before the first
# step. Every other role (param, param_fp8) is read-only for the host: EACCES at open.
HOST_WRITABLE_ROLES = ("grad",) + tuple(LOADABLE_ROLES)


def _guarded(handler: Callable[Concatenate[OperationsT, P], Coroutine[Any, Any, T]]
             ) -> Callable[Concatenate[OperationsT, P], Coroutine[Any, Any, T]]:
    """Turn every failure into an errno: a handler that raises anything else than
    FUSEError would take the whole mount down. The handler keeps its signature, so mypy
    checks it against pyfuse3.Operations'."""

    @functools.wraps(handler)
    async def wrapper(self: OperationsT, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await handler(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:
            raise fuse_error(self.errno_for(exc, handler.__name__, *args)) from None

    return wrapper


def _file_of(node: Node) -> tuple[str | None, str]:
    """The device file a tensor-file or NVM-data node stands for: (tensor, role), or
    (None, "data") for an NVM namespace's data."""
    if node.kind == Kind.DATA:
        return None, DATA_ROLE
    return node.name, node.role


class Operations(pyfuse3.Operations):
    """The cossd file API. Device work runs on worker threads, off the event loop."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, device: Device, *, worker_threads: int | None = None, cmb_bytes: int = 0) -> None:
        super().__init__()
        self.device = device
        self.controller = Controller(device, cmb_bytes)
        self.io = self.controller.io  # tensor and NVM data I/O: the device's one entry (emulator/io.py)
        self.tree = Tree(device)
        self.limiter = trio.CapacityLimiter(worker_threads or max(2, os.cpu_count() or 2))
        self.nursery: trio.Nursery | None = None
        self.errors_by_errno: collections.Counter[int] = collections.Counter()
        self.refused_writes = RefusedWriteLog()  # why a writer got its errno, in the daemon's log
        self._handles: dict[int, AdminHandle | FileHandle] = {}
        # The next file handle: next() of a count is atomic, so the data path's threads and
        # the event loop may open files at once.
        self._fh_counter = itertools.count(1)
        self._flushing: set[int] = set()
        self._uid = os.getuid()
        self._gid = os.getgid()
        self._started_ns = time.time_ns()
        self.times = NodeTimes(device, self.tree, self._started_ns)
        # Tests set this to a callable(op_name) to inject handler failures on purpose.
        self.fault_hook: Callable[[str], None] | None = None
        # The threads serving the frequent requests in front of pyfuse3 (fs/datapath.py).
        self.data_path: DataPath | None = None

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(function, *args, limiter=self.limiter)

    def _fault(self, op: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(op)

    def errno_for(self, exc: BaseException, what: str, *args: Any) -> int:
        """The errno a failed request answers with, counted (and logged when unexpected)."""
        if isinstance(exc, pyfuse3.FUSEError):
            return exc.errno
        if isinstance(exc, DeviceError):
            log.debug("%s: %s", what, exc)
            self.refused_writes.note(exc, what)
            self.errors_by_errno[exc.errno] += 1
            return exc.errno or errno.EIO
        log.error("unexpected error in %s%r", what, args, exc_info=exc)
        self.errors_by_errno[errno.EIO] += 1
        return errno.EIO

    # ------------------------------------------------------------------ attributes

    def _text(self, node: Node) -> bytes:
        if node.kind == Kind.SNAP_TEXT:
            return self.tree.snapshots.text(node)
        namespace = self.tree.namespace(node)
        if node.name == "step":
            return f"{namespace.committed_step}\n".encode()
        if node.name == "config.json":
            return (json.dumps(namespace.config(), indent=2) + "\n").encode()
        return (json.dumps(namespace.statistics(), indent=2, sort_keys=True) + "\n").encode()

    def _size(self, node: Node) -> int:
        if node.kind in (Kind.SNAP_TEXT, Kind.SNAP_ARRAY):
            return self.tree.snapshots.size(node)
        if node.kind == Kind.TEXT:
            return len(self._text(node))
        if node.kind == Kind.ARRAY:
            return self.tree.optimizer_namespace(node).file_size(node.name, node.role)
        if node.kind == Kind.DATA:
            nvm = self.tree.namespace(node).as_nvm()
            if nvm is None:  # only an NVM namespace has a data file (nsids are never reused)
                raise fuse_error(errno.ENOENT)
            return nvm.capacity_bytes
        return 0

    def stat_of(self, node: Node) -> Stat:
        """A node's attributes. Namespaces, steps and sizes change under the client's feet,
        so they are never cached (entry and attribute timeouts 0)."""
        size = self._size(node)
        return Stat(ino=self.tree.inode(node), size=size, blocks=(size + 511) // 512, time_ns=self.times.of(node),
                    mode=self.tree.mode(node), nlink=1 if node.kind in FILE_KINDS else 2, uid=self._uid,
                    gid=self._gid, blksize=1 << 20)

    def _attributes(self, node: Node) -> pyfuse3.EntryAttributes:
        stat = self.stat_of(node)
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino = pyfuse3.InodeT(stat.ino)
        attrs.st_mode = pyfuse3.ModeT(stat.mode)
        attrs.st_nlink = stat.nlink
        attrs.st_uid = stat.uid
        attrs.st_gid = stat.gid
        attrs.st_size = stat.size
        attrs.st_blksize = stat.blksize
        attrs.st_blocks = stat.blocks
        attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = stat.time_ns
        attrs.entry_timeout = 0
        attrs.attr_timeout = 0
        return attrs

    def lookup_node(self, parent_inode: int, name: bytes) -> Node:
        """LOOKUP: the node `name` names in directory `parent_inode` (never blocks)."""
        self._fault("lookup")
        parent = self.tree.node(parent_inode)
        try:
            decoded = name.decode()
        except UnicodeDecodeError:
            raise fuse_error(errno.ENOENT) from None
        return self.tree.lookup(parent, decoded)

    def getattr_node(self, inode: int) -> Node:
        """GETATTR: the node of `inode`."""
        self._fault("getattr")
        return self.tree.node(inode)

    @_guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attributes(self.lookup_node(parent_inode, name))

    @_guarded
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attributes(self.getattr_node(inode))

    @_guarded
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        node = self.tree.node(inode)
        # Sizes are fixed by the tensor table. An O_TRUNC open (shell redirection, open(..., "wb"))
        # is accepted as a no-op so ordinary tools can write whole files.
        if fields.update_mode or fields.update_uid or fields.update_gid:
            raise fuse_error(errno.EPERM)
        if fields.update_size and node.kind in SNAPSHOT_KINDS:
            raise fuse_error(errno.EROFS)
        if fields.update_size and attr.st_size not in (0, self._size(node)):
            raise fuse_error(errno.EINVAL)
        # The device keeps each file's times (fs/times.py): setting one by hand (touch, cp -p)
        # would make a stale file look current to rsync, so it is refused, not ignored.
        if (fields.update_mtime or fields.update_atime) and not fields.update_size:
            raise fuse_error(errno.EPERM)
        return self._attributes(node)

    @_guarded
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = self.device.capacity_bytes // 4096
        data.f_bfree = data.f_bavail = max(0, self.device.capacity_bytes - self.device.allocated_bytes) // 4096
        data.f_namemax = 128
        return data

    # ------------------------------------------------------------------ directories

    @_guarded
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        node = self.tree.node(inode)
        if node.kind in FILE_KINDS:
            raise fuse_error(errno.ENOTDIR)
        return pyfuse3.FileHandleT(inode)  # a directory's handle is its inode: readdir lists it

    @_guarded
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self.tree.children(self.tree.node(fh))
        for index in range(start_id, len(entries)):
            name, child = entries[index]
            if not pyfuse3.readdir_reply(token, pyfuse3.FileNameT(name.encode()), self._attributes(child), index + 1):
                break

    async def releasedir(self, fh: int) -> None:
        return None

    # ------------------------------------------------------------------ open / release

    def _new_handle(self, handle: AdminHandle | FileHandle) -> int:
        fh = next(self._fh_counter)
        self._handles[fh] = handle
        return fh

    @_guarded
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        fh, direct_io, nonseekable = self.open_handle(inode, flags)
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), direct_io=direct_io, nonseekable=nonseekable)

    def open_handle(self, inode: int, flags: int) -> tuple[int, bool, bool]:
        """OPEN (never blocks): a new handle of `inode`, as (fh, direct_io, nonseekable). The
        handler above and the data path (fs/datapath.py) both answer with it."""
        self._fault("open")
        node = self.tree.node(inode)
        access = flags & os.O_ACCMODE
        writes = access in (os.O_WRONLY, os.O_RDWR)
        if node.kind == Kind.ADMIN:
            return self._new_handle(AdminHandle()), True, True
        if node.kind == Kind.TEXT:
            if writes:
                raise fuse_error(errno.EACCES)
            handle = FileHandle(node, False, self._text(node))
            return self._new_handle(handle), True, False
        if node.kind == Kind.DATA:  # an NVM namespace's blocks: read and write at any offset
            return self._new_handle(FileHandle(node, writes)), True, False
        if node.kind in (Kind.SNAP_TEXT, Kind.SNAP_ARRAY):  # a snapshot is read-only
            if writes:
                raise fuse_error(errno.EROFS)
            text = self._text(node) if node.kind == Kind.SNAP_TEXT else b""
            return self._new_handle(FileHandle(node, False, text)), True, False
        if node.kind != Kind.ARRAY:
            raise fuse_error(errno.EISDIR)
        namespace = self.tree.namespace(node)
        # O_RDWR is how fio and many tools open a file they write; only a read-only open of
        # a grad is refused here (its reads are refused as they come: EACCES).
        if node.role == "grad" and not writes:
            raise fuse_error(errno.EACCES)
        if writes and node.role not in HOST_WRITABLE_ROLES:
            # The device's outputs (param, and param_fp8 where the namespace sends FP8
            # params): refused here, not first at their writes.
            raise fuse_error(errno.EACCES)
        if writes and node.role in LOADABLE_ROLES and not namespace.loading:
            raise fuse_error(errno.EROFS)
        # direct_io: every read and write reaches the device (no stale page cache, 1 MiB
        # requests), one request at a time per call. An O_DIRECT open bypasses the page cache
        # by itself, so it goes without: the kernel then sends a large call as several
        # requests at once (asynchronous direct I/O), which the data path serves in parallel.
        # (A mapping of such a descriptor would be cached: not a supported use.)
        direct_io = not flags & os.O_DIRECT
        return self._new_handle(FileHandle(node, writes)), direct_io, False

    async def release(self, fh: int) -> None:
        self.release_handle(fh)

    def release_handle(self, fh: int) -> None:
        """RELEASE (never blocks), for the handler above and the data path."""
        handle = self._handles.pop(fh, None)
        if isinstance(handle, AdminHandle):
            handle.close()  # what its queue pair held goes back to the daemon's budget

    @_guarded
    async def flush(self, fh: int) -> None:
        return None

    @_guarded
    async def fsync(self, fh: int, datasync: bool) -> None:
        """fsync on any file of a namespace makes its committed step durable."""
        handle = self._handles.get(fh)
        if isinstance(handle, FileHandle) and handle.node.kind in (Kind.ARRAY, Kind.TEXT, Kind.DATA):
            await self._run(self.tree.namespace(handle.node).flush)

    # ------------------------------------------------------------------ read / write

    @_guarded
    async def read(self, fh: int, off: int, size: int) -> bytes:
        self._fault("read")
        handle = self._handles.get(fh)
        if handle is None:
            raise fuse_error(errno.EBADF)
        if isinstance(handle, AdminHandle):
            return self._read_completion(handle, size)
        if handle.node.kind in (Kind.TEXT, Kind.SNAP_TEXT):
            return handle.text[off : off + size]
        if handle.node.kind == Kind.SNAP_ARRAY:
            return await self._run(self.tree.snapshots.read, handle.node, off, size)
        namespace = self.tree.namespace(handle.node)
        tensor, role = _file_of(handle.node)
        # On this thread, without a copy, where that cannot block the loop: pyfuse3 replies
        # with the view before this task yields (see Namespace.read_nowait).
        view = self.io.read_nowait(namespace, tensor, role, off, size)
        if view is not None:
            # pyfuse3 replies with any buffer (its stub says bytes): the view goes as it is.
            return cast(bytes, view)
        return await self._run(functools.partial(self.io.read, namespace, tensor, role, off, size, checked=True))

    @_guarded
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self._fault("write")
        handle = self._handles.get(fh)
        if handle is None:
            raise fuse_error(errno.EBADF)
        if isinstance(handle, AdminHandle):
            return await self._write_command(handle, buf)
        if not handle.writable:
            raise fuse_error(errno.EBADF)
        namespace = self.tree.namespace(handle.node)
        tensor, role = _file_of(handle.node)
        # Staging a gradient piece never waits, so it runs on this thread (a hop to a worker
        # thread costs more than the staging); a thread takes what may wait: a begin (it may
        # wait for a flush), a busy lock, the commit of a step, NVM data and state writes.
        staged = self.io.write_nowait(namespace, tensor, role, off, buf)
        if staged is None:
            written = await self._run(functools.partial(self.io.write, namespace, tensor, role, off, buf, checked=True))
        else:
            written = staged.written
            if staged.implicit is not None:
                await self._run(self.io.finish, namespace, staged)
        self.schedule_flush(namespace)
        return written

    # ------------------------------------------------------------------ the data path

    # fs/datapath.py serves reads and writes of open tensor, NVM block, control and text files
    # on its own threads with these blocking calls (and write_command, read_completion,
    # lookup_node, getattr_node, stat_of); they answer as the handlers above do.

    def data_handle(self, fh: int) -> AdminHandle | FileHandle | None:
        """The handle of `fh` where the data path serves its reads and writes (tensor, NVM
        block, control and text files), else None."""
        handle = self._handles.get(fh)
        if isinstance(handle, AdminHandle) or (
                isinstance(handle, FileHandle) and handle.node.kind in (Kind.ARRAY, Kind.DATA, Kind.TEXT)):
            return handle
        return None

    def write_data(self, handle: FileHandle, off: int, buf: memoryview) -> int:
        """A write on the data path. `buf` must not change later: a gradient block may
        still be read from it after this returns."""
        self._fault("write")
        if not handle.writable:
            raise fuse_error(errno.EBADF)
        return self.io.write(self.tree.namespace(handle.node), *_file_of(handle.node), off, buf)

    @contextlib.contextmanager
    def read_data(self, handle: FileHandle, off: int, size: int) -> Iterator[bytes | memoryview]:
        """A read on the data path: the bytes, valid until the block exits."""
        self._fault("read")
        node = handle.node
        if node.kind == Kind.TEXT:  # the snapshot taken at open
            yield handle.text[off : off + size]
            return
        with self.io.read_view(self.tree.namespace(node), *_file_of(node), off, size) as view:
            yield view

    # ------------------------------------------------------------------ control file

    # The control file's queue pairs are bounded (fs/admin_queue.py): a write refused for a full
    # completion queue is EAGAIN, for the daemon's partly written submissions ENOMEM.

    async def _write_command(self, handle: AdminHandle, buf: bytes) -> int:
        # On a worker thread, as the data path runs it: the commands of one write in order,
        # one write of a handle at a time.
        written = await self._run(self.write_command, handle, buf)
        self.schedule_flushes()
        return written

    def write_command(self, handle: AdminHandle, buf: bytes | memoryview) -> int:
        """Submissions written to the control file (blocking); the caller then has
        schedule_flushes() run on the event loop."""
        with handle.lock:
            return handle.take(buf, self.io.submit)

    def read_completion(self, handle: AdminHandle, size: int) -> bytes:
        """_read_completion on the data path."""
        return self._read_completion(handle, size)

    def schedule_flushes(self) -> None:
        """After a command: make whatever it committed durable in the background."""
        for namespace in list(self.device.namespaces.values()):
            self.schedule_flush(namespace)

    def _read_completion(self, handle: AdminHandle, size: int) -> bytes:
        """Completions read as a stream: entry then data; a short read leaves the rest. Never
        waits for a command that is running."""
        return handle.read(size)

    # ------------------------------------------------------------------ background work

    async def save_health_periodically(self, interval_s: float = HEALTH_SAVE_INTERVAL_S) -> None:
        """Save the health figures every `interval_s` until cancelled (at unmount)."""
        while True:
            await trio.sleep(interval_s)
            try:
                await self._run(self.device.save_health)
            except Exception:
                log.exception("saving the health figures failed")

    def schedule_flush(self, namespace: AnyNamespace) -> None:
        """Make a committed step durable in the background (the power-loss-protected mode)."""
        if self.nursery is None or not self.io.flush_wanted(namespace) or namespace.nsid in self._flushing:
            return
        self._flushing.add(namespace.nsid)
        self.nursery.start_soon(self._flush_in_background, namespace)

    async def _flush_in_background(self, namespace: AnyNamespace) -> None:
        try:
            await self._run(namespace.flush)
        except Exception:
            log.exception("background flush of namespace %s failed", namespace.name)
        finally:
            self._flushing.discard(namespace.nsid)
