"""One client connection of a storage server: the NVMe/TCP handshake, the connect that
authenticates it, then its capsules one at a time: admin submissions to the controller, the
wire's file commands (open, read, write, text) to the device's I/O entry (emulator/io.py)."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import mmap
import select
import socket
import ssl
import struct
from collections.abc import Iterator, Sequence
from typing import NoReturn, Protocol, cast

import numpy as np

from ..emulator.face import AnyNamespace, Device, DeviceError, DeviceIO, LinkTiming, Status
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
# The most data a CONNECT may carry: before authentication a peer is owed no more memory
# than a token needs. A larger announcement is refused at its header, before any of its
# data is received or a byte allocated for it.
PREAUTH_MAX_DATA = 8 << 10
# In-capsule data up to this size is received into the connection's reader buffer; larger
# (a long transfer table, a large admin payload) into a mapping of its own, taken from the
# server's receive memory and unmapped once the command is answered.
CAPSULE_INLINE_BYTES = 1 << 16
# A connection that sends no command for this long gives its receive buffer back to the
# server's budget (a trainer between steps keeps it; an idle client holds little).
IDLE_RELEASE_S = 1.0
# EXPORT (CFh) writes a file on the host the device runs on, at a path its payload may name:
# a network client would write the server's host's files, so the server answers it itself.
EXPORT_REFUSED = ("EXPORT writes a file on the server's host and is not served over the network; on that "
                  "host, stop `cossd serve`, `cossd mount` the device and `cossd export` from the mount")

# ARCHIVE (D4h) and ARCHIVE_LIST (D5h) may name the object store's endpoint: from a network
# client that would have the server's host connect, with its own credentials, wherever the
# client says (an internal address included). Over the wire the server's own endpoint
# (its environment's AWS_ENDPOINT_URL, or boto3's default) is the only one.
ENDPOINT_REFUSED = ("endpoint_url is not taken over the network: the server's host uses its own object-store "
                    "endpoint (AWS_ENDPOINT_URL in `cossd serve`'s environment); send the command without it")


def names_an_endpoint(data: memoryview) -> bool:
    """Whether an ARCHIVE or ARCHIVE_LIST payload names an endpoint (at its top level or in
    its policy); a payload that is not a JSON object is the device's to refuse."""
    try:
        payload = json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError):
        return False
    if not isinstance(payload, dict):
        return False
    policy = payload.get("policy")
    return "endpoint_url" in payload or (isinstance(policy, dict) and "endpoint_url" in policy)


class CapsuleRefused(Exception):
    """A command whose in-capsule data could not be given receive memory: its data was
    dropped, and it is answered with `error` (nothing ran)."""

    def __init__(self, cid: int, error: DeviceError) -> None:
        super().__init__(error.message)
        self.cid = cid
        self.error = error


class SendTimedOut(Exception):
    """A send to an authenticated peer made no progress within the server's send timeout: the
    peer stopped reading. The connection ends (counted and logged once by the server)."""


class Refused(Exception):
    """A client turned away before it was served: the reason is logged and counted under
    `reason` (one of protocol/logpages.py's SERVER_REFUSALS) before the client is told."""

    def __init__(self, reason: str, why: str) -> None:
        super().__init__(why)
        self.reason = reason


@dataclasses.dataclass(eq=False)
class PreAuth:
    """A connection from its accept until its CONNECT is answered: the place it holds among
    the unauthenticated, its deadline, and why the server closed it (set before the close, so
    the connection's thread reports that rather than the bare end of its stream)."""

    peer: str
    fd: int
    deadline: float  # time.monotonic()
    closed_for: str | None = None



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
    send_timeout_s: float

    def check_token(self, offered: memoryview) -> tuple[str, str] | None: ...

    def authenticated(self, record: PreAuth, connection: "Connection") -> str | None: ...

    def count_preauth(self, counter: str) -> None: ...

    def refused(self, peer: str, reason: str, why: str) -> None: ...

    def send_timed_out(self, peer: str, why: str) -> None: ...

    def step_ended(self, nsid: int, how: str) -> None: ...

    def device_namespace(self, nsid: int) -> AnyNamespace | None: ...

    def adopt(self, nsid: int) -> None: ...

    def after_command(self) -> None: ...

    def disconnected(self, connection: "Connection") -> None: ...


class Connection:
    """Serves one socket until the peer goes; never raises (each failure closes it)."""

    def __init__(self, server: Host, sock: socket.socket, peer: str, preauth: PreAuth) -> None:
        self.server = server
        self.io = server.io  # the device's one I/O entry (emulator/io.py)
        self.sock = sock
        self.peer = peer
        self.preauth = preauth
        self.placed = False  # holds an authenticated place (--max-connections) until it closes
        self.authenticated = False  # its CONNECT was answered SUCCESS: sends are timed (_sending)
        # A large capsule's own buffer and the receive memory it holds, until it is answered.
        self._capsule_buffer: tuple[mmap.mmap, int] | None = None
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

    def run(self) -> None:
        """Serve until the peer goes. The handshake and CONNECT run under the server's
        deadline (it shuts the socket down at the deadline, setting preauth.closed_for)."""
        authenticated = False
        try:
            self._handshake()
            self._connect()
            authenticated = self.authenticated = True
            # Receives wait as long as the client likes (keepalive finds a vanished peer; a
            # client may idle); sends are bounded apart (_sending).
            self.sock.settimeout(None)
            while True:
                self._serve_one()
        except Refused:
            pass  # counted and logged by _refuse before the peer was told
        except SendTimedOut as exc:
            self.server.send_timed_out(self.peer, str(exc))
        except WireError as exc:
            if not authenticated and self.preauth.closed_for is not None:
                self.server.refused(self.peer, "handshake", self.preauth.closed_for)
            elif not authenticated:
                self.server.refused(self.peer, "framing", f"framing: {exc}")
                self._terminate(exc.fes)
            else:
                log.warning("%s: %s; closing the connection", self.peer, exc)
                self._terminate(exc.fes)
        except (ConnectionError, TimeoutError, OSError) as exc:
            if not authenticated:
                self.server.refused(self.peer, "handshake",
                                    self.preauth.closed_for or f"{type(exc).__name__}: {exc}")
            else:
                log.info("%s: connection closed (%s)", self.peer, exc or type(exc).__name__)
        except Exception:  # a bug must not take the server down
            log.exception("%s: connection failed", self.peer)
        finally:
            self._drop_capsule_buffer()
            self.writes.release()
            self.server.disconnected(self)

    def _terminate(self, fes: FatalError) -> None:
        try:
            with self._sending():
                self.writer.send_raw(wire.term_req(PduType.C2H_TERM_REQ, fes))
        except (OSError, SendTimedOut):
            pass

    @contextlib.contextmanager
    def _sending(self) -> Iterator[None]:
        """Sends to an authenticated peer wait at most the server's send timeout for room in
        the socket (each send call: a slow reader that takes bytes goes on, one that takes
        none for that long does not); SendTimedOut past it. Before authentication the
        handshake's timeout and deadline bound them already."""
        if not self.authenticated:
            yield
            return
        self.sock.settimeout(self.server.send_timeout_s)
        try:
            yield
        except TimeoutError:
            raise SendTimedOut(f"the peer read nothing of an answer for {self.server.send_timeout_s:g} s") from None
        finally:
            try:
                self.sock.settimeout(None)
            except OSError:
                pass  # closed under it (the server stopping): the connection ends anyway

    def _handshake(self) -> None:
        head = self.reader.read_head(Digest.NONE)
        if head.type != PduType.IC_REQ:
            raise WireError(FatalError.PDU_SEQUENCE_ERROR, f"expected ICReq first, got {head.type.name}")
        if head.data_len:  # an ICReq has none: do not read (or hold memory for) what it announces
            raise WireError(FatalError.INVALID_HEADER_FIELD, f"an ICReq announcing {head.data_len} bytes of data")
        pfv, _hpda, dgst, _maxr2t = struct.unpack_from("<HBBI", head.header)
        if pfv != wire.PFV:
            raise WireError(FatalError.UNSUPPORTED_PARAMETER, f"ICReq PFV {pfv}, this server speaks {wire.PFV}")
        # Whatever digests the host asks for, it gets: both are supported.
        self.digests = Digest(dgst & (Digest.HEADER | Digest.DATA))
        self.writer.send_raw(wire.ic_resp(self.digests))
        self.writer.digests = self.digests

    def _capsule_head(self) -> tuple[memoryview, int, int]:
        """The next CapsuleCmd's head: its 64-byte submission, its cid and how many bytes of
        in-capsule data follow (not read yet)."""
        head = self.reader.read_head(self.digests)
        if head.type != PduType.CAPSULE_CMD:
            raise WireError(FatalError.PDU_SEQUENCE_ERROR, f"expected a CapsuleCmd, got {head.type.name}")
        submission = memoryview(head.header)
        return submission, struct.unpack_from("<H", submission, 2)[0], head.data_len

    def _capsule(self) -> tuple[memoryview, memoryview]:
        """The next CapsuleCmd of an authenticated connection: its 64-byte submission and its
        in-capsule data (views valid until the next read). Data beyond CAPSULE_INLINE_BYTES
        is received into a mapping of its own under the server's receive memory, given back
        once the command is answered; where that memory cannot be had, the data is dropped
        and the command answered with the refusal (CapsuleRefused)."""
        submission, cid, size = self._capsule_head()
        writing = (submission[0] == wire.FABRICS_OPCODE and submission[wire.FCTYPE_AT] == FabricsType.WRITE)
        into: memoryview | None = None
        if size > CAPSULE_INLINE_BYTES:
            # Hold nothing else while waiting for it: two waiting connections never wait on each other.
            self.writes.release()
            memory = self.server.recv_memory
            try:
                memory.acquire(size, f"a command's {size} bytes of in-capsule data")
                buffer = self._map(size)
            except DeviceError as exc:
                self.reader.skip_data(memoryview(bytearray(1 << 16)))
                raise CapsuleRefused(cid, exc) from None
            self._capsule_buffer = (buffer, size)
            into = memoryview(buffer)
        elif writing:
            # A WRITE's table in a buffer of its own: where its digest fails, the table still
            # says how much bulk follows, to drop (the reader's buffer is not ours to keep).
            into = memoryview(bytearray(size))
        try:
            return submission, self.reader.read_data(into)
        except DeviceError as exc:
            # The data digest failed. read_data took the whole PDU, so the stream is in step:
            # the command does not run, it is answered DATA_TRANSFER_ERROR and the connection
            # goes on (a WRITE's bulk, sent after its capsule, leaves the stream first).
            if writing and into is not None:
                self.writes.drop_bulk(cid, into)
            raise CapsuleRefused(cid, exc) from None

    def _map(self, size: int) -> mmap.mmap:
        """An anonymous mapping of `size` bytes whose `size` the caller took from the receive
        memory (given back here where the mapping fails). Its pages are touched only as data
        is received, and it goes back to the system when closed (malloc would keep a freed
        block of this size in the thread's arena)."""
        try:
            return mmap.mmap(-1, size)
        except OSError as exc:
            self.server.recv_memory.release(size)
            raise DeviceError(Status.COMMAND_INTERRUPTED, f"the server cannot map {size} bytes "
                                                          f"({exc.strerror})") from None

    def _drop_capsule_buffer(self) -> None:
        if self._capsule_buffer is None:
            return
        buffer, size = self._capsule_buffer
        self._capsule_buffer = None
        try:
            buffer.close()
        except BufferError:
            pass  # a view of it lives on (an exception's frame): unmapped when that goes
        self.server.recv_memory.release(size)

    def _connect(self) -> None:
        submission, cid, size = self._capsule_head()
        if size > PREAUTH_MAX_DATA:
            # Refused on the header's word alone: nothing of it is read, nothing allocated.
            self.server.count_preauth("too_large")
            self._refuse(cid, Status.CONNECT_INVALID_HOST, "framing",
                         f"a capsule announcing {size} bytes of data before authentication; at most "
                         f"{PREAUTH_MAX_DATA} (a token)")
        try:
            data = self.reader.read_data()
        except DeviceError as exc:  # the data digest failed: whatever token it holds is not read
            self._refuse(cid, exc.status, "framing", f"CONNECT: {exc.message}")
        if submission[0] != wire.FABRICS_OPCODE or submission[wire.FCTYPE_AT] != FabricsType.CONNECT:
            self._refuse(cid, Status.CONNECT_INVALID_HOST, "before_connect", "a command before CONNECT",
                         "the first command must be a fabrics CONNECT")
        refusal = self.server.check_token(data)
        if refusal is not None:
            reason, why = refusal
            self._refuse(cid, Status.CONNECT_INVALID_HOST, reason, why)
        # Authenticated: an authenticated place now, or CONNECT_CONTROLLER_BUSY (a peer without
        # the token never learns how busy the server is).
        busy = self.server.authenticated(self.preauth, self)
        if busy is not None:  # counted as the handshake's where its deadline came meanwhile
            self._refuse(cid, Status.CONNECT_CONTROLLER_BUSY,
                         "busy" if self.preauth.closed_for is None else "handshake", busy)
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
        with self._sending():
            if completion.data:
                self.writer.send_data(PduType.C2H_DATA, completion.cid, wire.TTAG_COMPLETION_DATA,
                                      [completion.data])
            self.writer.send(PduType.CAPSULE_RESP, _cqe(completion))

    # ------------------------------------------------------------------ commands

    def _idle(self) -> None:
        """Before the next command: where none comes within IDLE_RELEASE_S, the WRITE buffer
        goes back (to the budget and the system), then wait. (The reader's own buffer stays at
        CAPSULE_INLINE_BYTES: larger capsule data has a mapping of its own, unmapped at once.)"""
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
        try:
            self._serve_capsule()
        except CapsuleRefused as refused:
            self._reply(Completion(refused.cid, refused.error.status, data=refused.error.message.encode()))
        finally:
            self._drop_capsule_buffer()

    def _serve_capsule(self) -> None:
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
        if opcode_of(submission) == Opcode.EXPORT:
            return Completion(cid, Status.ACCESS_DENIED, data=EXPORT_REFUSED.encode())
        if opcode_of(submission) in (Opcode.ARCHIVE, Opcode.ARCHIVE_LIST) and names_an_endpoint(data):
            return Completion(cid, Status.ACCESS_DENIED, data=ENDPOINT_REFUSED.encode())
        raw = bytes(submission) + bytes(data)
        nsid = struct.unpack_from("<I", submission, 4)[0]
        try:
            completion = self.io.submit(raw)
        except SubmissionError as exc:  # a local mount's EINVAL on the write: nothing ran
            return Completion(cid, Status.INVALID_FIELD, data=f"malformed submission: {exc}".encode())
        if completion.status == Status.SUCCESS and opcode_of(submission) == Opcode.BEGIN_STEP:
            self.steps[nsid] = int(json.loads(completion.data)["step"])
        elif opcode_of(submission) in (Opcode.COMMIT_STEP, Opcode.ABORT_STEP):
            self.forget_step(nsid)
            if completion.status in (Status.SUCCESS, Status.STEP_SKIPPED_NONFINITE):
                self.server.step_ended(nsid, "committed" if opcode_of(submission) == Opcode.COMMIT_STEP
                                       else "aborted")
        if self.server.param_cache.enabled:
            # A delete, rollback or commit gives the cached params' memory back now (a stale
            # entry is never served either way: the cache checks the superblock seq).
            self.server.param_cache.drop_stale(
                {ns.nsid: ns for ns in list(self.server.device.namespaces.values())})
        return completion

    def forget_step(self, nsid: int) -> None:
        namespace = self.server.device_namespace(nsid)
        if namespace is None or namespace.as_optimizer() is None or namespace.step_open != self.steps.get(nsid):
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
        """A range that is not gradients (state while loading, NVM data): the I/O entry's write
        (admit consulted the injections for the WRITE before its first range)."""
        self.io.write(namespace, opened.tensor, opened.role, offset, view, checked=True)

    def admit(self, namespace: AnyNamespace) -> None:
        """A WRITE has data for `namespace`: the data path's injections, once (INJECT_ERROR fails
        the WRITE here; the device's calls that follow pass checked=True)."""
        self.io.admit(IoOpcode.WRITE, namespace)

    def adopt(self, namespace: AnyNamespace) -> None:
        """Gradients for `namespace` are taken (admit was called first): a lease held on its
        step ends, and the step goes on."""
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
        optimizer = files[0][1].as_optimizer() if len(namespaces) == 1 else None
        reads = [(opened.tensor, opened.role, int(offset), length)
                 for (opened, _), offset, length in zip(files, table["offset"], lengths)]
        if optimizer is not None:
            # One pin for the batch: every range is of the same committed step, sent from the
            # committed copy itself (no copy into a reply buffer).
            self.io.admit(IoOpcode.READ, optimizer)
            # Every file of an optimizer namespace is a tensor's (only NVM data has none).
            tensor_reads = cast(list[tuple[str, str, int, int]], reads)
            # The parameter cache first: the committed step's params from server memory (all
            # of one step, as the pin gives them); None where off, too small or not params.
            cached = self.server.param_cache.read(optimizer, tensor_reads)
            if cached is not None:
                self._send_ranges(cid, cached)
            else:
                with self.io.read_many(optimizer, reads, checked=True) as views:
                    self._send_ranges(cid, views)
        else:
            views = []
            for (_opened, namespace), (tensor, role, offset, length) in zip(files, reads):
                views.append(self.io.read(namespace, tensor, role, offset, length) if length else b"")
            self._send_ranges(cid, views)
        return Completion(cid, Status.SUCCESS, result=total & 0xFFFF_FFFF)

    def _send_ranges(self, cid: int, views: Sequence[bytes | memoryview]) -> None:
        """Each range's bytes in C2HData PDUs of its own (none spans two ranges, so the host
        receives each straight into that range's buffer)."""
        offset = 0
        with self._sending():  # a peer that stops reading must not hold the READ's pin for ever
            for view in views:
                length = len(view)
                position = 0
                while position < length:
                    size = min(wire.MAX_DATA_BYTES, length - position)
                    last = position + size == length and view is views[-1]
                    self.writer.send(PduType.C2H_DATA,
                                     wire.data_specific(cid, wire.TTAG_READ_DATA, offset + position, size),
                                     [memoryview(view)[position : position + size]],
                                     wire.PduFlags.LAST_PDU if last else 0)
                    position += size
                offset += length


# The link's command names (LinkTiming.by_command) of the wire's own commands.
_FABRICS_NAMES: dict[int, str] = {FabricsType.OPEN: "open", FabricsType.CLOSE: "close", FabricsType.WRITE: "write",
                  FabricsType.READ: "read", FabricsType.READ_TEXT: "read_text", FabricsType.CONNECT: "connect"}


def opcode_of(submission: memoryview) -> int:
    return submission[0]


def _text(data: memoryview) -> str:
    try:
        return bytes(data).decode()
    except UnicodeDecodeError:
        raise DeviceError(Status.INVALID_FIELD, "a path must be UTF-8") from None

