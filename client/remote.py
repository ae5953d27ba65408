"""RemoteTransport: a device behind a storage server (`cossd serve`), reached at cossd://HOST:PORT
over NVMe/TCP framing (protocol/wire.py), with a token and TLS; and the URL form itself."""
from __future__ import annotations

import bisect
import dataclasses
import errno
import json
import os
import select
import socket
import ssl
import struct
import threading
import weakref
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import parse_qs, urlsplit

from .. import settings
from ..protocol import wire
from ..protocol.entries import MAX_PAYLOAD_BYTES, SUBMISSION, Completion, decode_completion, encode_submission
from ..protocol.status import Status
from ..protocol.wire import Digest, FabricsType, PduType
from .cmb import CmbMapping
from .watchdog import DEFAULT_TIMEOUT_S, DeviceTimeoutError

SCHEME = "cossd"
# What a Path makes of "cossd://h:p" (it folds the double slash): accepted as the same URL.
_PREFIXES = (f"{SCHEME}://", f"{SCHEME}:/")
DEFAULT_PORT = 4420  # NVMe/TCP's registered port
# Bytes of gradients or params per H2CData PDU the client sends (the server states its own
# bound, MAXH2CDATA, which is larger).
SEND_CHUNK = 8 << 20
_DIGESTS = {"none": Digest.NONE, "header": Digest.HEADER, "data": Digest.DATA,
            "both": Digest.HEADER | Digest.DATA}
# Every connected transport of this process, for abort_all(): weak, so that a forgotten one
# still goes; a set of refs (not a WeakSet), as a signal handler copies it in one C call.
_CONNECTED: set["weakref.ref[RemoteTransport]"] = set()


def is_remote(where: object) -> bool:
    """Whether `where` (a str or a Path) names a server: cossd://HOST:PORT."""
    return isinstance(where, (str, os.PathLike)) and os.fspath(where).startswith(_PREFIXES)


@dataclasses.dataclass(frozen=True)
class ServerUrl:
    """cossd://HOST[:PORT][?digest=none|header|data|both]; IPv6 hosts in brackets."""

    host: str
    port: int
    digests: Digest

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{SCHEME}://{host}:{self.port}"


def parse_url(where: str | os.PathLike[str]) -> ServerUrl:
    text = os.fspath(where)
    if text.startswith(f"{SCHEME}:/") and not text.startswith(f"{SCHEME}://"):
        text = f"{SCHEME}://" + text[len(SCHEME) + 2 :]
    parts = urlsplit(text)
    if parts.scheme != SCHEME or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"not a server URL: {os.fspath(where)!r} (cossd://HOST:PORT)")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError:
        raise ValueError(f"not a server URL: {os.fspath(where)!r} (bad port)") from None
    query = parse_qs(parts.query)
    digest = query.pop("digest", ["header"])[-1]
    if query or digest not in _DIGESTS:
        raise ValueError(f"{os.fspath(where)!r}: the only option is digest=none|header|data|both")
    return ServerUrl(parts.hostname, port, _DIGESTS[digest])


def read_token(token_file: str | os.PathLike[str] | None) -> bytes:
    """The token from `token_file`, else from $COSSD_TOKEN_FILE's file; b"" where neither."""
    path = token_file if token_file is not None else settings.TOKEN_FILE.read()
    if not path:
        return b""
    return Path(path).read_bytes().strip()


def client_tls_context(ca: str | os.PathLike[str] | None, cert: str | os.PathLike[str] | None = None,
                       key: str | os.PathLike[str] | None = None) -> ssl.SSLContext | None:
    """TLS trusting `ca` (else $COSSD_CA), presenting `cert`/`key` (else $COSSD_CLIENT_CERT/
    KEY) where given; None (plain TCP) where no CA is named."""
    ca = ca if ca is not None else settings.CA.read()
    if not ca:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_verify_locations(cafile=os.fspath(ca))
    cert = cert if cert is not None else settings.CLIENT_CERT.read()
    key = key if key is not None else settings.CLIENT_KEY.read()
    if cert:
        context.load_cert_chain(os.fspath(cert), os.fspath(key) if key else None)
    return context


@dataclasses.dataclass(frozen=True)
class Credentials:
    """What a client shows a storage server, each part optional: where one is None the
    client looks in its environment variable ($COSSD_TOKEN_FILE, $COSSD_CA,
    $COSSD_CLIENT_CERT, $COSSD_CLIENT_KEY), so a script that names none still finds them."""

    token_file: str | os.PathLike[str] | None = None
    ca: str | os.PathLike[str] | None = None  # trusting a server CA turns TLS on
    cert: str | os.PathLike[str] | None = None  # a client certificate, for mutual TLS
    key: str | os.PathLike[str] | None = None


@dataclasses.dataclass
class _Open:
    size: int
    writing: bool


class RemoteTransport:
    """One connection to a storage server: the queue pair for commands and the file commands,
    over one socket. Every socket operation has the client's timeout: no answer in time is
    DeviceTimeoutError; a server gone (killed, connection reset) is ConnectionAbortedError
    (ECONNABORTED, which the trainer reports as DeviceLostError). After either, every call
    fails at once the same way: the stream's place is lost. Thread-safe (one exchange at a
    time), though one per thread serves better."""

    def __init__(self, url: str | os.PathLike[str], timeout_s: float | None = DEFAULT_TIMEOUT_S, *,
                 token_file: str | os.PathLike[str] | None = None, ca: str | os.PathLike[str] | None = None,
                 cert: str | os.PathLike[str] | None = None, key: str | os.PathLike[str] | None = None,
                 credentials: Credentials | None = None) -> None:
        if credentials is not None:
            # Explicit arguments win over the bundle; the bundle's None parts fall back to
            # the environment as the arguments' do.
            token_file = token_file if token_file is not None else credentials.token_file
            ca = ca if ca is not None else credentials.ca
            cert = cert if cert is not None else credentials.cert
            key = key if key is not None else credentials.key
        self.url = parse_url(url)
        self.location = str(self.url)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._broken: OSError | None = None
        self._cid = 0
        self._files: dict[int, _Open] = {}
        token = read_token(token_file)
        tls = client_tls_context(ca, cert, key)
        try:
            sock = socket.create_connection((self.url.host, self.url.port), timeout=timeout_s)
        except TimeoutError:
            raise DeviceTimeoutError(f"{self.location}: no connection within {timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectionRefusedError(exc.errno or errno.ECONNREFUSED,
                                         f"{self.location}: cannot connect ({exc.strerror or exc})") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        presented = bool(cert if cert is not None else settings.CLIENT_CERT.read())
        try:
            if tls is not None:
                try:
                    sock = tls.wrap_socket(sock, server_hostname=self.url.host)
                except (ssl.SSLError, ConnectionError) as exc:
                    raise _TlsRefused(_tls_handshake_failure(exc)) from None
            self.sock = sock
            self.reader = wire.PduReader(sock.recv_into)
            self.writer = wire.PduWriter(sock)
            self._handshake(token, tls is not None, presented)
            _CONNECTED.add(weakref.ref(self, _CONNECTED.discard))
        except _TlsRefused as refused:
            _shut(sock)
            raise PermissionError(errno.EACCES, f"{self.location}: TLS refused: {refused}") from None
        except ssl.SSLError as exc:
            _shut(sock)
            raise PermissionError(errno.EACCES, f"{self.location}: TLS refused ({exc.reason or exc})") from None
        except BaseException:
            _shut(sock)
            raise

    # ------------------------------------------------------------------ the connection

    def _handshake(self, token: bytes, tls: bool = False, presented: bool = False) -> None:
        try:
            self.writer.send_raw(wire.ic_req(self.url.digests))
            head = self.reader.read_head(Digest.NONE)
        except TimeoutError:
            raise DeviceTimeoutError(f"{self.location}: no ICResp within {self.timeout_s:g} s") from None
        except (ConnectionError, ssl.SSLError) as exc:
            if not tls:
                if isinstance(exc, ssl.SSLError):
                    raise
                raise ConnectionRefusedError(errno.ECONNREFUSED, f"{self.location}: the server refused the "
                                                                 f"handshake ({exc}){_TLS_HINT}") from None
            # TLS 1.3 checks the client's certificate after the client's side of the handshake
            # is done: a refusal shows as an alert or a closed connection at the first read.
            raise _TlsRefused(_client_certificate_refused(exc, presented)) from None
        except wire.WireError as exc:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"{self.location}: the server refused the "
                                                             f"handshake ({exc}){_TLS_HINT}") from None
        if head.type != PduType.IC_RESP:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"{self.location}: answered {head.type.name}, "
                                                             "not ICResp")
        _pfv, _cpda, dgst, _maxh2cdata = struct.unpack_from("<HBBI", head.header)
        self.digests = Digest(dgst)
        self.writer.digests = self.digests
        try:
            completion = self._command(encode_submission(wire.FABRICS_OPCODE, nsid=FabricsType.CONNECT,
                                                         cid=self._next_cid()), token)
        except ConnectionAbortedError as exc:
            raise PermissionError(errno.EACCES, f"{self.location}: connection closed at connect ({exc})") from None
        if completion.status != Status.SUCCESS:
            self._broken = PermissionError(errno.EACCES, f"{self.location}: refused at connect: "
                                                         f"{completion.data.decode(errors='replace')}")
            self.sock.close()
            raise self._broken

    def _next_cid(self) -> int:
        self._cid = (self._cid + 1) & 0xFFFF
        return self._cid

    def _lost(self, exc: BaseException) -> OSError:
        if self._broken is not None:  # aborted (abort()) while waiting: that is the reason
            _shut(self.sock)
            return self._broken
        if isinstance(exc, TimeoutError):
            self._broken = DeviceTimeoutError(
                f"the cossd server at {self.location} did not answer within {self.timeout_s:g} s (stopped, hung, "
                "overloaded or cut off?)")
        else:
            self._broken = ConnectionAbortedError(
                errno.ECONNABORTED, f"the cossd server at {self.location} closed the connection ({exc}); "
                                    "killed or restarted?")
        _shut(self.sock)
        return self._broken

    def _command(self, submission: bytes, capsule_data: bytes | memoryview = b"",
                 bulk: Sequence[memoryview] = (), into: Sequence[memoryview] = ()) -> Completion:
        """One capsule and its answer. `bulk`: a WRITE's ranges, sent as H2CData; `into`:
        a READ's buffers (each of the length its range returns), filled from C2HData."""
        if self._broken is not None:
            raise self._broken
        try:
            self.sock.settimeout(self.timeout_s)
            cid = struct.unpack_from("<H", submission, 2)[0]
            self.writer.send(PduType.CAPSULE_CMD, submission[: SUBMISSION.itemsize], [capsule_data])
            if bulk:
                self.writer.send_data(PduType.H2C_DATA, cid, 0, bulk, SEND_CHUNK)
            return self._answer(cid, into)
        except (TimeoutError, ConnectionError, wire.WireError, ssl.SSLError) as exc:
            raise self._lost(exc) from None
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.ECONNRESET, errno.EBADF, errno.ENOTCONN):
                raise self._lost(exc) from None
            raise
        except BaseException as exc:
            # Interrupted (KeyboardInterrupt from Ctrl-C or a handler's SIGTERM) mid-command:
            # part of the command or of its answer may still be on the wire, so a later
            # command would read the rest of this one's answer as its own, or wait out the
            # timeout for an answer the server, still reading this one's data, never sends.
            # The connection is given up instead: later calls fail at once.
            self.abort(f"a command was cut short ({type(exc).__name__}) before its answer was read whole; "
                       "the connection's place in the stream is lost")
            raise

    def abort(self, why: str) -> None:
        """Give the connection up now: shut it (a thread waiting in its receive or send wakes at
        once and raises), and every call from here on raises ConnectionAbortedError(`why`).
        Safe from a signal handler and from any thread (it takes no lock); safe to repeat."""
        if self._broken is None:
            self._broken = ConnectionAbortedError(errno.ECONNABORTED, f"{self.location}: {why}")
        _shut(self.sock)

    def _answer(self, cid: int, into: Sequence[memoryview]) -> Completion:
        starts = []
        position = 0
        for target in into:
            starts.append(position)
            position += len(target)
        message = bytearray()
        received = 0  # the READ's bytes so far: they come in order, each once (server/connection.py)
        while True:
            head = self.reader.read_head(self.digests)
            if head.type == PduType.CAPSULE_RESP:
                completion, data_len = decode_completion(head.header)
                if completion.cid != cid or data_len != len(message):
                    raise wire.WireError(wire.FatalError.PDU_SEQUENCE_ERROR,
                                         f"completion of command {completion.cid} with {data_len} bytes; expected "
                                         f"{cid} with {len(message)}")
                if into and completion.status == Status.SUCCESS and (received != position
                                                         or completion.result != position & 0xFFFF_FFFF):
                    # A READ that succeeded with bytes missing would leave part of the
                    # caller's buffers as they were, and be counted as read: never silently.
                    raise wire.WireError(wire.FatalError.DATA_OUT_OF_RANGE,
                                         f"a READ of {position} bytes completed after {received} "
                                         f"(result {completion.result})")
                return dataclasses.replace(completion, data=bytes(message))
            if head.type == PduType.C2H_TERM_REQ:
                raise ConnectionResetError(f"the server ended the connection (fatal error "
                                           f"{struct.unpack_from('<H', head.header)[0]:#x})")
            if head.type != PduType.C2H_DATA:
                raise wire.WireError(wire.FatalError.PDU_SEQUENCE_ERROR, f"unexpected {head.type.name}")
            cccid, ttag, datao, datal = head.data_header()
            if cccid != cid or datal != head.data_len:
                raise wire.WireError(wire.FatalError.PDU_SEQUENCE_ERROR, f"C2HData of command {cccid}")
            if ttag == wire.TTAG_COMPLETION_DATA:
                message += self.reader.read_data()
                continue
            index = bisect.bisect_right(starts, datao) - 1
            if datao != received or index < 0 or datao + datal > starts[index] + len(into[index]):
                raise wire.WireError(wire.FatalError.DATA_OUT_OF_RANGE,
                                     f"C2HData at {datao}+{datal}; expected the bytes from {received}")
            at = datao - starts[index]
            self.reader.read_data(into[index][at : at + datal])
            received += datal

    # ------------------------------------------------------------------ Transport

    def exchange(self, submission: bytes) -> Completion:
        if len(submission) < SUBMISSION.itemsize or len(submission) - SUBMISSION.itemsize > MAX_PAYLOAD_BYTES:
            raise OSError(errno.EINVAL, f"a submission of {len(submission)} bytes")  # as a local mount's write
        with self._lock:
            return self._command(submission, memoryview(submission)[SUBMISSION.itemsize :])

    def _fabrics(self, fctype: int, capsule_data: bytes = b"", *, cdw10: int = 0, cdw11: int = 0, cdw12: int = 0,
                 cdw14: int = 0, cdw15: int = 0,
                 bulk: Sequence[memoryview] = (), into: Sequence[memoryview] = ()) -> Completion:
        with self._lock:
            submission = encode_submission(wire.FABRICS_OPCODE, cid=self._next_cid(), nsid=fctype, cdw10=cdw10,
                                           cdw11=cdw11, cdw12=cdw12, cdw14=cdw14, cdw15=cdw15)
            return self._command(submission, capsule_data, bulk, into)

    @staticmethod
    def _errno_channel(completion: Completion, what: str) -> Completion:
        """File operations fail as a local mount's do: OSError with the status's errno."""
        if completion.status in (Status.SUCCESS, Status.STEP_SKIPPED_NONFINITE):
            return completion
        status = completion.status
        code = status.errno if isinstance(status, Status) else errno.EIO
        name = status.name if isinstance(status, Status) else f"status {status:#x}"
        raise OSError(code or errno.EIO, f"{completion.data.decode(errors='replace') or what} [{name}]")

    def close(self) -> None:
        if self._broken is None:
            self._broken = ConnectionAbortedError(errno.ECONNABORTED, f"{self.location}: transport closed")
            _shut(self.sock)
        _CONNECTED.discard(weakref.ref(self))

    def reachable(self) -> bool:
        return self._broken is None

    def alive(self) -> bool:
        """reachable(), and for an idle plain-TCP connection also not closed by the server
        (polled without waiting): a client that keeps connections (a remote mount) finds a
        stale one, of a server killed or restarted since, before it sends a command into it.
        A connection with a command in flight, or a TLS one, is taken as it is."""
        if self._broken is not None:
            return False
        if isinstance(self.sock, ssl.SSLSocket) or not self._lock.acquire(blocking=False):
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if readable and not self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                self._lost(ConnectionResetError("closed while idle"))
                return False
            return True
        except OSError as exc:
            self._lost(exc)
            return False
        finally:
            self._lock.release()

    def open_file(self, path: str, writing: bool, direct: bool) -> int:
        completion = self._errno_channel(
            self._fabrics(FabricsType.OPEN, path.encode(), cdw10=wire.OPEN_FOR_WRITING if writing else 0), path)
        self._files[completion.result] = _Open(int(json.loads(completion.data)["size"]), writing)
        return completion.result

    def close_file(self, handle: int) -> None:
        self._files.pop(handle, None)
        if self._broken is None:
            self._errno_channel(self._fabrics(FabricsType.CLOSE, cdw10=handle), f"close {handle}")

    def write_at(self, handle: int, data: memoryview, offset: int) -> int:
        return self.write_many([(handle, data, offset)])

    def read_at(self, handle: int, buffer: memoryview, offset: int) -> int:
        return self.read_many([(handle, buffer, offset)])[0]

    def read_text(self, path: str) -> str:
        return self._errno_channel(self._fabrics(FabricsType.READ_TEXT, path.encode()), path).data.decode()

    def stat(self, path: str, entries: bool = False) -> dict[str, Any]:
        """STAT (a remote mount's lookup, getattr and readdir): the node at `path` of the
        tree ("" the root) as {"mode", "size", "time_ns", "key"}, with a directory's
        [name, attributes] under "entries" where asked; OSError(ENOENT) where there is none."""
        completion = self._fabrics(FabricsType.STAT, path.encode(), cdw10=wire.STAT_ENTRIES if entries else 0)
        answer: dict[str, Any] = json.loads(self._errno_channel(completion, path).data)
        return answer

    def read_path(self, path: str, offset: int, length: int, snapshot_id: int) -> bytes:
        """READ_PATH: `length` bytes at `offset` of a snapshot's file (`snapshot_id`, as STAT
        keyed it: one deleted or taken again since is ENOENT)."""
        completion = self._fabrics(FabricsType.READ_PATH, path.encode(), cdw10=offset & 0xFFFF_FFFF,
                                   cdw11=offset >> 32, cdw12=length, cdw14=snapshot_id & 0xFFFF_FFFF,
                                   cdw15=snapshot_id >> 32)
        return self._errno_channel(completion, path).data

    def map_cmb(self, path: str, size: int) -> CmbMapping:
        raise OSError(errno.ENODEV, f"{self.location}: a controller memory buffer cannot be mapped across "
                                    "the network (the server serves none)")

    # ------------------------------------------------------------------ batched transfers

    def write_many(self, items: Sequence[tuple[int, memoryview, int]]) -> int:
        """Write several (handle, data, offset) ranges in as few WRITE commands as the wire's
        batch bound allows (one per step's gradients below 2 GiB): the data goes from the
        callers' buffers to the socket, joined nowhere. Returns the bytes written."""
        written = 0
        for batch in _batches([(handle, memoryview(data).cast("B"), offset) for handle, data, offset in items]):
            table = wire.encode_transfers([(handle, offset, len(data)) for handle, data, offset in batch])
            completion = self._fabrics(FabricsType.WRITE, table, bulk=[data for _, data, _ in batch])
            self._errno_channel(completion, "write")
            written += sum(len(data) for _, data, _ in batch)
        return written

    def read_many(self, items: Sequence[tuple[int, memoryview, int]]) -> list[int]:
        """Read several (handle, buffer, offset) ranges, each straight into its buffer, in as
        few READ commands as the batch bound allows; each range's byte count (short past
        the file's end, as a read is)."""
        counts: list[int] = []
        views = [(handle, memoryview(buffer).cast("B"), offset) for handle, buffer, offset in items]
        for batch in _batches(views):
            lengths = []
            for handle, buffer, offset in batch:
                opened = self._files.get(handle)
                size = opened.size if opened is not None else 0
                lengths.append(max(0, min(len(buffer), size - offset)))
            table = wire.encode_transfers([(handle, offset, len(buffer)) for handle, buffer, offset in batch])
            completion = self._fabrics(FabricsType.READ, table,
                                       into=[buffer[:length] for (_, buffer, _), length in zip(batch, lengths)])
            self._errno_channel(completion, "read")
            counts += lengths
        return counts


def abort_all(why: str) -> int:
    """abort(`why`) every connected transport of this process; how many. For a process that
    is ending on a signal: its threads waiting on servers' answers (a group's devices, each on
    a thread) raise at once instead of waiting out their timeout, so the cleanup can run."""
    aborted = 0
    for ref in _CONNECTED.copy():
        transport = ref()
        if transport is not None and transport._broken is None:
            transport.abort(why)
            aborted += 1
    return aborted


# What a plain client told "no" at its first PDU most likely met: a server that wants TLS.
_TLS_HINT = ": a TLS server? give its CA (ca=, --ca or $COSSD_CA)"


class _TlsRefused(Exception):
    """A TLS handshake that failed, with the reason as a user reads it."""


def _tls_handshake_failure(exc: BaseException) -> str:
    """Why the TLS handshake itself failed, in words: the server's certificate refused (expired,
    made out to another host, signed by a CA not trusted), or a server that speaks no TLS."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"the server's certificate is not trusted: {exc.verify_message} (checked against the CA given)"
    reason = getattr(exc, "reason", None) or ""
    plain = ("nothing was sent in clear; if it is meant to be a plain TCP server, connect without a CA "
             "(no ca=, no $COSSD_CA)")
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST",
                  "UNKNOWN_PROTOCOL"):
        return f"the server does not speak TLS ({reason}): {plain}"
    if isinstance(exc, (ConnectionError, ssl.SSLEOFError)):
        return (f"the server closed the connection during the TLS handshake ({reason or type(exc).__name__}): "
                f"a server that does not speak TLS, or one refusing connections (see its log); {plain}")
    return f"{reason or exc}"


def _client_certificate_refused(exc: BaseException, presented: bool) -> str:
    """The server ended the connection right after the TLS handshake: it requires a client
    certificate (--client-ca) and was given none, or one its CA did not sign."""
    reason = getattr(exc, "reason", None) or type(exc).__name__
    if presented:
        return (f"the server refused the client certificate ({reason}): it must be signed by the CA the "
                "server trusts (its --client-ca)")
    return (f"the server requires a client certificate ({reason}) and none was given (cert=/key=, or "
            "$COSSD_CLIENT_CERT and $COSSD_CLIENT_KEY)")


def _shut(sock: socket.socket) -> None:
    """Shut the connection down, then close it. The shutdown wakes a thread blocked in a
    receive on it at once (a close alone does not: it would wait out its timeout, and could
    then read from a new connection given the same descriptor). The socket layer's shutdown
    even for TLS: SSLSocket's own drops its TLS state under a thread that may be reading."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # never connected, or already reset
    try:
        sock.close()
    except OSError:
        pass


def _batches(items: list[tuple[int, memoryview, int]]) -> list[list[tuple[int, memoryview, int]]]:
    """Items split into runs of at most MAX_BATCH_BYTES and MAX_TRANSFERS (a range larger
    than the bound is cut into pieces of it)."""
    batches: list[list[tuple[int, memoryview, int]]] = []
    current: list[tuple[int, memoryview, int]] = []
    size = 0
    for handle, data, offset in items:
        position = 0
        while True:
            if len(current) >= wire.MAX_TRANSFERS or size >= wire.MAX_BATCH_BYTES:
                batches.append(current)
                current, size = [], 0
            piece = data[position : position + wire.MAX_BATCH_BYTES - size]
            current.append((handle, piece, offset + position))
            size += len(piece)
            position += len(piece)
            if position >= len(data):
                break
    if current:
        batches.append(current)
    return batches
