"""pyfuse3 handlers of a remote mount: each FUSE request of the tree becomes commands to the
storage server (STAT, OPEN, READ, WRITE, READ_TEXT, READ_PATH, admin submissions), each
refusal the errno a local mount gives, a lost server ENOTCONN (ETIMEDOUT if it stopped)."""
from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Concatenate, Coroutine, ParamSpec, TypeVar, cast

import pyfuse3
import trio

from ...client.remote import RemoteTransport
from ...client.watchdog import DeviceTimeoutError
from ...protocol.entries import Completion, Opcode, encode_submission
from ...protocol.status import Status

from ..admin_queue import AdminHandle
from ..nodes import fuse_error
from ..refusals import RefusedWriteLog
from .lanes import Lanes
from .tree import (ADMIN_INODE, ADMIN_NAME, ROOT_INODE, InodeTable, Key, RemoteKind, admin_answer,
                          attributes, child_path, key_of, kind_of)

log = logging.getLogger(__name__)
REFUSED_WRITES = RefusedWriteLog()  # one for the daemon: its window spans every handle

T = TypeVar("T")
P = ParamSpec("P")
OperationsT = TypeVar("OperationsT", bound="RemoteOperations")


def _guarded(handler: Callable[Concatenate[OperationsT, P], Coroutine[Any, Any, T]]
             ) -> Callable[Concatenate[OperationsT, P], Coroutine[Any, Any, T]]:
    """Every failure becomes an errno (anything else would take the mount down): a device
    refusal its status's errno (the client raises OSError with it), a lost server ENOTCONN,
    a server that stopped answering ETIMEDOUT, a bug EIO with its traceback in the log. The
    handler keeps its signature, so mypy checks it against pyfuse3.Operations'."""

    @functools.wraps(handler)
    async def wrapper(self: OperationsT, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await handler(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except DeviceTimeoutError:  # logged by the lanes
            raise fuse_error(errno.ETIMEDOUT) from None
        except ConnectionError:  # closed, reset, refused: the server is gone (logged by the lanes)
            raise fuse_error(errno.ENOTCONN) from None
        except OSError as exc:
            if handler.__name__ == "write":
                # The server's reason, which the writer sees only as an errno: logged as a
                # local mount logs its device's (rate-limited).
                REFUSED_WRITES.note_errno(exc.errno or errno.EIO, str(exc.strerror or exc))
            else:
                log.debug("%s: %s", handler.__name__, exc)
            raise fuse_error(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("unexpected error in %s%r", handler.__name__, args)
            raise fuse_error(errno.EIO) from None

    return wrapper


@dataclasses.dataclass
class LaneFile:
    """A file's server handles on one connection: one for reading, one for writing, as its
    open asked (handles belong to their connection)."""

    transport: RemoteTransport
    reading: int | None = None
    writing: int | None = None


@dataclasses.dataclass
class RemoteFile:
    """An open file of the tree: a text captured at open, or a tensor or NVM data file, opened
    on each lane the first time a request of it runs there (so the kernel's parallel requests
    of one file run on several connections), within the epoch of its open."""

    kind: RemoteKind
    path: str
    key: Key
    access: int = os.O_RDONLY
    epoch: int = 0
    lanes: dict[int, LaneFile] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    text: bytes = b""

    @property
    def grad(self) -> bool:
        return self.path.endswith("/grad")


class RemoteOperations(pyfuse3.Operations):
    """The tree of a storage server's device, mounted here. Network calls run on worker
    threads (a slow server never stalls the event loop); inodes are handed out on its thread."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, lanes: Lanes, worker_threads: int = 8) -> None:
        super().__init__()
        self.lanes = lanes
        self.inodes = InodeTable()
        self.limiter = trio.CapacityLimiter(worker_threads)
        self.started_ns = time.time_ns()
        self._handles: dict[int, AdminHandle | RemoteFile] = {}
        self._listings: dict[int, list[tuple[str, dict[str, Any]]]] = {}
        self._next_fh = 1

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(functools.partial(function, *args), limiter=self.limiter)

    def _new_fh(self) -> int:
        fh, self._next_fh = self._next_fh, self._next_fh + 1
        return fh

    # ------------------------------------------------------------------ the server's answers

    def _stat(self, path: str, entries: bool = False) -> dict[str, Any]:
        with self.lanes.use() as (_, lane):
            return lane.transport.stat(path, entries)

    def _admin(self, opcode: int, nsid: int = 0) -> Completion:
        with self.lanes.use() as (_, lane):
            return lane.transport.exchange(encode_submission(opcode, nsid=nsid))

    async def _node(self, inode: int) -> tuple[str, Key, dict[str, Any]]:
        """The path, key and current attributes of `inode`; ENOENT where the node it was
        handed out for is gone (deleted, or a namespace or tag re-created since)."""
        path, key = self.inodes.path(inode)
        answer = await self._run(self._stat, path)
        if inode not in (ROOT_INODE,) and key_of(answer) != key:
            raise fuse_error(errno.ENOENT)
        return path, key, answer

    # ------------------------------------------------------------------ attributes

    @_guarded
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if parent_inode == ADMIN_INODE:
            raise fuse_error(errno.ENOTDIR)
        if parent_inode == ROOT_INODE and name == ADMIN_NAME.encode():
            return attributes(ADMIN_INODE, admin_answer(self.started_ns))
        parent, _key = self.inodes.path(parent_inode)
        path = child_path(parent, name)
        answer = await self._run(self._stat, path)
        return attributes(self.inodes.inode(path, key_of(answer)), answer)

    @_guarded
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if inode == ADMIN_INODE:
            return attributes(ADMIN_INODE, admin_answer(self.started_ns))
        _path, _key, answer = await self._node(inode)
        return attributes(inode, answer)

    @_guarded
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        # A local mount's rules (fs/operations.py): sizes are the tensor table's, an O_TRUNC
        # open a no-op; owners, modes and times (which the device keeps) are refused.
        if inode == ADMIN_INODE:
            answer, path = admin_answer(self.started_ns), ADMIN_NAME
        else:
            path, _key, answer = await self._node(inode)
        if fields.update_mode or fields.update_uid or fields.update_gid:
            raise fuse_error(errno.EPERM)
        kind = kind_of(path, int(answer["mode"]))
        if fields.update_size and kind in (RemoteKind.SNAP_TEXT, RemoteKind.SNAP_ARRAY):
            raise fuse_error(errno.EROFS)
        if fields.update_size and attr.st_size not in (0, int(answer["size"])):
            raise fuse_error(errno.EINVAL)
        if (fields.update_mtime or fields.update_atime) and not fields.update_size:
            raise fuse_error(errno.EPERM)
        return attributes(inode, answer)

    @_guarded
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        completion = await self._run(self._admin, Opcode.VENDOR_IDENTIFY)
        described = json.loads(completion.data)
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = described["capacity_bytes"] // 4096
        data.f_bfree = data.f_bavail = max(0, described["capacity_bytes"] - described["allocated_bytes"]) // 4096
        data.f_namemax = 128
        return data

    # ------------------------------------------------------------------ directories

    @_guarded
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileHandleT:
        if inode == ADMIN_INODE:
            raise fuse_error(errno.ENOTDIR)
        path, key = self.inodes.path(inode)
        # The listing is taken once, at open, with every entry's attributes (one command).
        answer = await self._run(self._stat, path, True)
        if inode != ROOT_INODE and key_of(answer) != key:
            raise fuse_error(errno.ENOENT)
        if "entries" not in answer:
            raise fuse_error(errno.ENOTDIR)
        listing = [(name, child) for name, child in answer["entries"]]
        if inode == ROOT_INODE:
            listing.insert(0, (ADMIN_NAME, admin_answer(self.started_ns)))
        fh = self._new_fh()
        self._listings[fh] = [(f"{path}/{name}" if path else name, child) for name, child in listing]
        return pyfuse3.FileHandleT(fh)

    @_guarded
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        listing = self._listings.get(fh, [])
        for index in range(start_id, len(listing)):
            path, answer = listing[index]
            inode = ADMIN_INODE if path == ADMIN_NAME else self.inodes.inode(path, key_of(answer))
            name = pyfuse3.FileNameT(path.rpartition("/")[2].encode())
            if not pyfuse3.readdir_reply(token, name, attributes(inode, answer), index + 1):
                break

    async def releasedir(self, fh: int) -> None:
        self._listings.pop(fh, None)

    # ------------------------------------------------------------------ open / release

    @_guarded
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        access = flags & os.O_ACCMODE
        writes = access in (os.O_WRONLY, os.O_RDWR)
        if inode == ADMIN_INODE:  # each open() a queue pair, as on a local mount
            fh = self._new_fh()
            self._handles[fh] = AdminHandle()
            return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), direct_io=True, nonseekable=True)
        path, key, answer = await self._node(inode)
        kind = kind_of(path, int(answer["mode"]))
        if kind == RemoteKind.DIRECTORY:
            raise fuse_error(errno.EISDIR)
        if kind in (RemoteKind.SNAP_TEXT, RemoteKind.SNAP_ARRAY) and writes:
            raise fuse_error(errno.EROFS)
        if kind == RemoteKind.TEXT and writes:
            raise fuse_error(errno.EACCES)
        opened = RemoteFile(kind, path, key, access)
        if kind == RemoteKind.TEXT:  # the content as of the open, as a local mount gives it
            opened.text = await self._run(self._read_text, path)
        elif kind == RemoteKind.SNAP_TEXT:
            opened.text = await self._run(self._read_path, path, 0, 4096, key[1])
        elif kind == RemoteKind.ARRAY:
            if access == os.O_RDONLY and opened.grad:
                raise fuse_error(errno.EACCES)  # as a local mount: a grad's reads at open, O_RDWR's as they come
            await self._run(self._open_array, opened)
        fh = self._new_fh()
        self._handles[fh] = opened
        # direct_io: every read and write reaches the server; an O_DIRECT open goes without,
        # so the kernel sends a large call's requests at once, as on a local mount.
        return pyfuse3.FileInfo(fh=pyfuse3.FileHandleT(fh), direct_io=not flags & os.O_DIRECT)

    def _read_text(self, path: str) -> bytes:
        with self.lanes.use() as (_, lane):
            return lane.transport.read_text(path).encode()

    def _read_path(self, path: str, offset: int, length: int, snapshot_id: int) -> bytes:
        with self.lanes.use() as (_, lane):
            return lane.transport.read_path(path, offset, length, snapshot_id)

    def _open_array(self, opened: RemoteFile) -> None:
        """A tensor or NVM data file opened on one lane now, so that the server's refusals
        (ENOENT, EACCES, EROFS) come at open as on a local mount; other lanes open it later."""
        with self.lanes.use() as (index, lane):
            opened.epoch = lane.epoch
            self._on_lane(opened, index, lane.transport)

    @staticmethod
    def _on_lane(opened: RemoteFile, index: int, transport: RemoteTransport) -> LaneFile:
        """The file's handles on lane `index` (opened there first if need be). O_RDWR (how fio
        and mkfs open) takes both; a grad's reads are refused as they come (EACCES)."""
        with opened.lock:
            found = opened.lanes.get(index)
            if found is not None and found.transport is transport:
                return found
            handles = LaneFile(transport)
            try:
                if opened.access in (os.O_WRONLY, os.O_RDWR):
                    handles.writing = transport.open_file(opened.path, True, False)
                if opened.access == os.O_RDONLY or (opened.access == os.O_RDWR and not opened.grad):
                    handles.reading = transport.open_file(opened.path, False, False)
            except BaseException:
                RemoteOperations._close_lane(handles)
                raise
            opened.lanes[index] = handles
            return handles

    @staticmethod
    def _close_lane(handles: LaneFile) -> None:
        for handle in (handles.reading, handles.writing):
            if handle is not None and handles.transport.reachable():
                try:
                    handles.transport.close_file(handle)
                except (OSError, DeviceTimeoutError):
                    pass  # the server forgets a lost connection's handles itself

    async def release(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if isinstance(handle, AdminHandle):
            handle.close()
        elif isinstance(handle, RemoteFile) and handle.lanes:
            for handles in list(handle.lanes.values()):
                await self._run(self._close_lane, handles)

    @_guarded
    async def flush(self, fh: int) -> None:
        return None

    @_guarded
    async def fsync(self, fh: int, datasync: bool) -> None:
        """fsync on any file of a namespace makes its committed step durable (FLUSH)."""
        handle = self._handles.get(fh)
        if isinstance(handle, RemoteFile) and handle.kind in (RemoteKind.ARRAY, RemoteKind.TEXT):
            completion = await self._run(functools.partial(self._admin, Opcode.FLUSH, nsid=handle.key[0]))
            if completion.status != Status.SUCCESS:
                status = completion.status
                raise fuse_error((status.errno if isinstance(status, Status) else None) or errno.EIO)

    # ------------------------------------------------------------------ read / write

    def _handle(self, fh: int) -> AdminHandle | RemoteFile:
        handle = self._handles.get(fh)
        if handle is None:
            raise fuse_error(errno.EBADF)
        return handle

    @_guarded
    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handle(fh)
        if isinstance(handle, AdminHandle):
            return handle.read(size)  # completions already here: never waits for the server
        if handle.kind in (RemoteKind.TEXT, RemoteKind.SNAP_TEXT):
            return handle.text[off : off + size]
        if handle.kind == RemoteKind.SNAP_ARRAY:
            return await self._run(self._read_path, handle.path, off, size, handle.key[1])
        if handle.access == os.O_WRONLY or handle.grad:
            raise fuse_error(errno.EACCES if handle.grad else errno.EBADF)
        # pyfuse3 replies with any buffer (its stub says bytes): the view goes as it is.
        return cast(bytes, await self._run(self._read_array, handle, off, size))

    def _read_array(self, handle: RemoteFile, off: int, size: int) -> memoryview:
        buffer = bytearray(size)
        with self.lanes.use(handle.epoch) as (index, lane):
            handles = self._on_lane(handle, index, lane.transport)
            assert handles.reading is not None
            count = lane.transport.read_at(handles.reading, memoryview(buffer), off)
        return memoryview(buffer)[:count]

    def _write_array(self, handle: RemoteFile, off: int, buf: bytes) -> int:
        with self.lanes.use(handle.epoch) as (index, lane):
            handles = self._on_lane(handle, index, lane.transport)
            assert handles.writing is not None
            return lane.transport.write_at(handles.writing, memoryview(buf), off)

    @_guarded
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        handle = self._handle(fh)
        if isinstance(handle, AdminHandle):
            return await self._run(self._write_command, handle, buf)
        if handle.kind != RemoteKind.ARRAY or handle.access == os.O_RDONLY:
            raise fuse_error(errno.EBADF)
        # A write completing an implicit step returns once the server committed (or skipped) it.
        return await self._run(self._write_array, handle, off, buf)

    def _write_command(self, handle: AdminHandle, buf: bytes) -> int:
        """Submissions written to a queue pair, run on the server in order (one write of a
        handle at a time), their completions queued here for the client's reads."""
        with handle.lock:
            return handle.take(buf, self._submit)

    def _submit(self, raw: bytes) -> Completion:
        with self.lanes.use() as (_, lane):
            return lane.transport.exchange(raw)
