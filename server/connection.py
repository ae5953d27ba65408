"""One client connection of a storage server: the NVMe/TCP handshake, the connect that
authenticates it, then its capsules one at a time: admin submissions to the controller, the
wire's file commands (open, read, write, text) to the device's I/O entry (emulator/io.py)."""
from __future__ import annotations

import json
import logging
import select
import socket
import ssl
import struct
from typing import NoReturn, Protocol

import numpy as np

from ..emulator import Device, DeviceError, Status
from ..emulator.accounting import LinkTiming
from ..emulator.io import DeviceIO
from ..emulator.kinds import AnyNamespace
from ..emulator.namespace import Namespace
from ..protocol import wire
from ..protocol.entries import Completion, IoOpcode, Opcode, SubmissionError
from ..protocol.wire import Digest, FabricsType, FatalError, PduType, WireError

from .param_cache import ParamCache
from .paths import OpenFile, read_text, resolve_open
from .recv_memory import RecvMemory
from .writes import Writes
from . import tree_commands
log = logging.getLogger(__name__)

# Open files one connection may hold (a handle is a few dozen bytes of server memory).
MAX_HANDLES = 1 << 16
# How long a client has for the handshake and the connect before it is dropped (no thread
# waits forever on a peer that connected and said nothing).
HANDSHAKE_TIMEOUT_S = 10.0
# A connection that sends no command for this long gives its receive buffer back to the
# server's budget (a trainer between steps keeps it; an idle client holds little).
IDLE_RELEASE_S = 1.0


class Refused(Exception):
    """A client turned away before it was served: the reason is logged and counted under
    `reason` (one of protocol/logpages.py's SERVER_REFUSALS) before the client is told."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason


def _cqe(completion: Completion) -> bytes:
    return completion.encode()[: 16]


class Host(Protocol):
    """What a connection needs of the server that accepted it (server/server.py's Server),
    declared here so that this module does not import that one."""

    device: Device
    io: DeviceIO
    link: LinkTiming
    param_cache: ParamCache
    recv_memory: RecvMemory

    def check_token(self, offered: memoryview) -> tuple[str, str] | None: ...

    def refused(self, peer: str, reason: str, why: str) -> None: ...

    def device_namespace(self, nsid: int) -> AnyNamespace | None: ...

    def adopt(self, nsid: int) -> None: ...

    def after_command(self) -> None: ...

    def disconnected(self, connection: "Connection") -> None: ...


class Connection:
    """Serves one socket until the peer goes; never raises (each failure closes it)."""

    def __init__(self, server: Host, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.reader = wire.PduReader(sock.recv_into)
        self.writer = wire.PduWriter(sock)
        self.digests = Digest.NONE
        self.handles: dict[int, OpenFile] = {}
        self._next_handle = 1
        # Optimizer namespaces with a step this connection opened or fed: nsid -> that step.
        # At a disconnect, each still open is held for the server's lease, then aborted.
        self.steps: dict[int, int] = {}
        # WRITEs and their receive buffer, under the server's shared budget (server/writes.py).
        self.writes = Writes(self, server.recv_memory)

    # ------------------------------------------------------------------ lifecycle

    def run(self, busy: str | None = None) -> None:
        """Serve until the peer goes. `busy`: the server takes no more connections; the peer
        is told so at its CONNECT (CONNECT_CONTROLLER_BUSY, this text) and closed."""
        authenticated = False
        try:
            self.sock.settimeout(HANDSHAKE_TIMEOUT_S)
            self._handshake()
            self._connect(busy)
            authenticated = True
            self.sock.settimeout(None)  # keepalive finds a vanished peer; a client may idle
            while True:
                self._serve_one()
        except Refused:
            pass  # counted and logged by _refuse before the peer was told
        except WireError as exc:
            if not authenticated:
                self.server.refused(self.peer, "framing", f"framing: {exc}")
            else:
                log.warning("%s: %s; closing the connection", self.peer, exc)
            self._terminate(exc.fes)
        except (ConnectionError, TimeoutError, OSError) as exc:
            if not authenticated:
                self.server.refused(self.peer, "handshake", f"{type(exc).__name__}: {exc}")
            else:
                log.info("%s: connection closed (%s)", self.peer, exc or type(exc).__name__)
        except Exception:  # a bug must not take the server down
            log.exception("%s: connection failed", self.peer)
        finally:
            self.writes.release()
            self.server.disconnected(self)
            try:
                self.sock.close()
            except OSError:
                pass

    def _terminate(self, fes: FatalError) -> None:
        try:
            self.writer.send_raw(wire.term_req(PduType.C2H_TERM_REQ, fes))
        except OSError:
            pass

    def _handshake(self) -> None:
        head = self.reader.read_head(Digest.NONE)
        if head.type != PduType.IC_REQ:
            raise WireError(FatalError.PDU_SEQUENCE_ERROR, f"expected ICReq first, got {head.type.name}")
        pfv, _hpda, dgst, _maxr2t = struct.unpack_from("<HBBI", head.header)
        if pfv != wire.PFV:
            raise WireError(FatalError.UNSUPPORTED_PARAMETER, f"ICReq PFV {pfv}, this server speaks {wire.PFV}")
        # Whatever digests the host asks for, it gets: both are supported.
        self.digests = Digest(dgst & (Digest.HEADER | Digest.DATA))
        self.writer.send_raw(wire.ic_resp(self.digests))
        self.writer.digests = self.digests

    def _capsule(self) -> tuple[memoryview, memoryview]:
        """The next CapsuleCmd: its 64-byte submission and its in-capsule data (views of the
        reader's buffers, valid until the next read)."""
        head = self.reader.read_head(self.digests)
        if head.type != PduType.CAPSULE_CMD:
            raise WireError(FatalError.PDU_SEQUENCE_ERROR, f"expected a CapsuleCmd, got {head.type.name}")
        data = self.reader.read_data()
        return memoryview(head.header), data

    def _connect(self, busy: str | None) -> None:
        submission, data = self._capsule()
        cid = struct.unpack_from("<H", submission, 2)[0]
        if submission[0] != wire.FABRICS_OPCODE or submission[wire.FCTYPE_AT] != FabricsType.CONNECT:
            self._refuse(cid, Status.CONNECT_INVALID_HOST, "before_connect", "a command before CONNECT",
                         "the first command must be a fabrics CONNECT")
        if busy is not None:
            self._refuse(cid, Status.CONNECT_CONTROLLER_BUSY, "busy", busy)
        refusal = self.server.check_token(data)
        if refusal is not None:
            reason, why = refusal
            self._refuse(cid, Status.CONNECT_INVALID_HOST, reason, why)
        self._reply(Completion(cid, Status.SUCCESS, data=json.dumps(
            {"maxh2cdata": wire.MAX_DATA_BYTES, "max_batch_bytes": wire.MAX_BATCH_BYTES}).encode()))
        log.info("%s: connected", self.peer)

    def _refuse(self, cid: int, status: Status, reason: str, why: str, told: str | None = None) -> NoReturn:
        """Turn the peer away at its CONNECT. Counted and logged first, then told: a client
        that reads the server's figures or log right after its refusal finds it there."""
        self.server.refused(self.peer, reason, why)
        try:
            self._reply(Completion(cid, status, data=(told or why).encode()))
        except OSError:
            pass  # the peer went before hearing it: the refusal stands, counted once
        raise Refused(reason, why)

    # ------------------------------------------------------------------ replies

    def _reply(self, completion: Completion) -> None:
        """A completion: its data in C2HData PDUs, then the CapsuleResp."""
        if completion.data:
            self.writer.send_data(PduType.C2H_DATA, completion.cid, wire.TTAG_COMPLETION_DATA, [completion.data])
        self.writer.send(PduType.CAPSULE_RESP, _cqe(completion))

    # ------------------------------------------------------------------ commands

    def _idle(self) -> None:
        """Before the next command: where none comes within IDLE_RELEASE_S, the receive
        buffers go back (the budget's to others, the reader's to the system), then wait."""
        self.reader.trim(1 << 20)  # a large capsule's buffer (a long transfer table)
        if not self.writes.held:
            return
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return  # decrypted bytes wait in the TLS layer: a command is here
        waiting = select.poll()  # not select(): descriptors past 1024 are fine
        waiting.register(self.sock, select.POLLIN)
        if not waiting.poll(IDLE_RELEASE_S * 1000) and self.writes.release():
            self.server.recv_memory.count("idle_releases")

    def _serve_one(self) -> None:
        self._idle()
        submission, data = self._capsule()
        opcode = submission[0]
        cid = struct.unpack_from("<H", submission, 2)[0]
        name = (_FABRICS_NAMES.get(submission[wire.FCTYPE_AT], "fabrics") if opcode == wire.FABRICS_OPCODE
                else "admin")
        link = self.server.link
        # The request counts from its capsule (read just now) to the completion; in timed
        # mode the completion leaves only once the link's model says it would have.
        pdus_in, data_in = self.reader.pdus - 1, self.reader.data_bytes - len(data)
        pdus_out, data_out = self.writer.pdus, self.writer.data_bytes
        with link.command(name):
            if opcode == wire.FABRICS_OPCODE:
                completion = self._fabrics(submission, cid, data)
            else:
                completion = self._admin(submission, cid, data)
            reply_pdus = 1 + -(-len(completion.data) // wire.MAX_DATA_BYTES)
            link.add(net_in=self.reader.data_bytes - data_in, messages_in=self.reader.pdus - pdus_in,
                     net_out=self.writer.data_bytes - data_out + len(completion.data),
                     messages_out=self.writer.pdus - pdus_out + reply_pdus)
        self._reply(completion)
        self.server.after_command()

    def _admin(self, submission: memoryview, cid: int, data: memoryview) -> Completion:
        raw = bytes(submission) + bytes(data)
        nsid = struct.unpack_from("<I", submission, 4)[0]
        try:
            completion = self.server.io.submit(raw)
        except SubmissionError as exc:  # a local mount's EINVAL on the write: nothing ran
            return Completion(cid, Status.INVALID_FIELD, data=f"malformed submission: {exc}".encode())
        if completion.status == Status.SUCCESS and opcode_of(submission) == Opcode.BEGIN_STEP:
            self.steps[nsid] = int(json.loads(completion.data)["step"])
        elif opcode_of(submission) in (Opcode.COMMIT_STEP, Opcode.ABORT_STEP):
            self.forget_step(nsid)
        if self.server.param_cache.enabled:
            # A delete, rollback or commit gives the cached params' memory back now (a stale
            # entry is never served either way: the cache checks the superblock seq).
            self.server.param_cache.drop_stale(
                {ns.nsid: ns for ns in list(self.server.device.namespaces.values())})
        return completion

    def forget_step(self, nsid: int) -> None:
        namespace = self.server.device_namespace(nsid)
        if not isinstance(namespace, Namespace) or namespace.step_open != self.steps.get(nsid):
            self.steps.pop(nsid, None)

    def _fabrics(self, submission: memoryview, cid: int, data: memoryview) -> Completion:
        fctype = submission[wire.FCTYPE_AT]
        cdw10 = struct.unpack_from("<I", submission, 40)[0]
        try:
            if fctype == FabricsType.OPEN:
                return self._open(cid, data, bool(cdw10 & wire.OPEN_FOR_WRITING))
            if fctype == FabricsType.CLOSE:
                if self.handles.pop(cdw10, None) is None:
                    raise DeviceError(Status.INVALID_FIELD, f"no open file {cdw10}")
                return Completion(cid, Status.SUCCESS)
            if fctype == FabricsType.WRITE:
                return self.writes.write(cid, data)
            if fctype == FabricsType.READ:
                return self._read(cid, data)
            if fctype == FabricsType.READ_TEXT:
                return Completion(cid, Status.SUCCESS, data=read_text(self.server.device, _text(data)))
            if fctype in tree_commands.FCTYPES:  # a remote mount's STAT and READ_PATH
                return tree_commands.serve(self.server.device, fctype, cid, submission, data)
            if fctype == FabricsType.CONNECT:
                raise DeviceError(Status.INVALID_FIELD, "already connected")
            raise DeviceError(Status.INVALID_FIELD, f"fabrics command type {fctype:#04x} is not supported")
        except DeviceError as exc:
            return Completion(cid, exc.status, data=exc.message.encode())

    def _open(self, cid: int, data: memoryview, writing: bool) -> Completion:
        if len(self.handles) >= MAX_HANDLES:
            raise DeviceError(Status.LIMIT_EXCEEDED, f"{MAX_HANDLES} files open on this connection")
        opened = resolve_open(self.server.device, _text(data), writing)
        handle = self._next_handle
        self._next_handle = (self._next_handle % 0xFFFF_FFFE) + 1
        self.handles[handle] = opened
        return Completion(cid, Status.SUCCESS, result=handle, data=json.dumps({"size": opened.size}).encode())

    def files(self, table: np.ndarray, writing: bool) -> list[tuple[OpenFile, AnyNamespace]]:
        files = []
        for index, handle in enumerate(table["handle"]):
            opened = self.handles.get(int(handle))
            if opened is None:
                raise DeviceError(Status.INVALID_FIELD, f"transfer {index}: no open file {int(handle)}")
            if opened.writing != writing:
                raise DeviceError(Status.ACCESS_DENIED, f"transfer {index}: {opened.path} is open for "
                                                        f"{'writing' if opened.writing else 'reading'}")
            namespace = self.server.device_namespace(opened.nsid)
            if namespace is None:
                raise DeviceError(Status.INVALID_NAMESPACE, f"{opened.path}: the namespace was deleted")
            files.append((opened, namespace))
        return files

    # ------------------------------------------------------------------ what a WRITE needs (server/writes.py)

    def write_one(self, opened: OpenFile, namespace: AnyNamespace, offset: int, view: memoryview) -> None:
        """A range that is not gradients (state while loading, NVM data): the I/O entry's write."""
        self.server.io.write(namespace, opened.tensor, opened.role, offset, view)

    def adopt(self, namespace: Namespace) -> None:
        """Gradients for `namespace` arrive: the data path's injections first (INJECT_ERROR
        fails the WRITE here), then a lease held on its step is taken over."""
        self.server.io.controller.injector.check_io(IoOpcode.WRITE, namespace.nsid)
        self.server.adopt(namespace.nsid)

    # ------------------------------------------------------------------ READ

    def _read(self, cid: int, data: memoryview) -> Completion:
        table = wire.decode_transfers(data)
        files = self.files(table, writing=False)
        lengths = wire.clamped_lengths(table, [opened.size for opened, _ in files])
        total = sum(lengths)
        if total > wire.MAX_BATCH_BYTES:
            raise DeviceError(Status.LIMIT_EXCEEDED, f"a READ of {total} bytes; at most {wire.MAX_BATCH_BYTES}")
        namespaces = {opened.nsid for opened, _ in files}
        namespace = files[0][1]
        reads = [(opened.tensor, opened.role, int(offset), length)
                 for (opened, _), offset, length in zip(files, table["offset"], lengths)]
        if len(namespaces) == 1 and isinstance(namespace, Namespace):
            # One pin for the batch: every range is of the same committed step, sent from the
            # committed copy itself (no copy into a reply buffer).
            self.server.io.controller.injector.check_io(IoOpcode.READ, namespace.nsid)
            # The parameter cache first: the committed step's params from server memory (all
            # of one step, as the pin gives them); None where off, too small or not params.
            cached = self.server.param_cache.read(namespace, reads)
            if cached is not None:
                self._send_ranges(cid, cached)
            else:
                with namespace.read_pinned_many(reads) as views:
                    self._send_ranges(cid, views)
        else:
            views = []
            for (opened, namespace), (tensor, role, offset, length) in zip(files, reads):
                views.append(self.server.io.read(namespace, tensor, role, offset, length) if length else b"")
            self._send_ranges(cid, views)
        return Completion(cid, Status.SUCCESS, result=total & 0xFFFF_FFFF)

    def _send_ranges(self, cid: int, views: list[bytes | memoryview]) -> None:
        """Each range's bytes in C2HData PDUs of its own (none spans two ranges, so the host
        receives each straight into that range's buffer)."""
        offset = 0
        for view in views:
            length = len(view)
            position = 0
            while position < length:
                size = min(wire.MAX_DATA_BYTES, length - position)
                last = position + size == length and view is views[-1]
                self.writer.send(PduType.C2H_DATA, wire.data_specific(cid, wire.TTAG_READ_DATA, offset + position, size),
                                 [memoryview(view)[position : position + size]],
                                 wire.PduFlags.LAST_PDU if last else 0)
                position += size
            offset += length


# The link's command names (LinkTiming.by_command) of the wire's own commands.
_FABRICS_NAMES = {FabricsType.OPEN: "open", FabricsType.CLOSE: "close", FabricsType.WRITE: "write",
                  FabricsType.READ: "read", FabricsType.READ_TEXT: "read_text", FabricsType.CONNECT: "connect"}


def opcode_of(submission: memoryview) -> int:
    return submission[0]


def _text(data: memoryview) -> str:
    try:
        return bytes(data).decode()
    except UnicodeDecodeError:
        raise DeviceError(Status.INVALID_FIELD, "a path must be UTF-8") from None

