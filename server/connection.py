"""One client connection of a storage server: the NVMe/TCP handshake, the connect that
authenticates it, then its capsules one at a time: admin submissions to the controller, the
wire's file commands (open, read, write, text) to the device's I/O entry (emulator/io.py)."""
from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
from typing import Any, Callable, Protocol

import numpy as np

from ..emulator import Device, DeviceError, Status
from ..emulator.accounting import LinkTiming
from ..emulator.io import DeviceIO
from ..emulator.kinds import AnyNamespace
from ..emulator.namespace import CommitResult, Namespace
from ..protocol import wire
from ..protocol.entries import Completion, IoOpcode, Opcode, SubmissionError
from ..protocol.wire import Digest, FabricsType, FatalError, PduType, WireError

from .param_cache import ParamCache
from .paths import OpenFile, read_text, resolve_open
from . import tree_commands
log = logging.getLogger(__name__)

# Open files one connection may hold (a handle is a few dozen bytes of server memory).
MAX_HANDLES = 1 << 16
# How long a client has for the handshake and the connect before it is dropped (no thread
# waits forever on a peer that connected and said nothing).
HANDSHAKE_TIMEOUT_S = 10.0
# A WRITE of gradients at least this large goes to the device as its PDUs arrive (smaller
# ones are received whole first: nothing to overlap).
STREAM_MIN_BYTES = 4 << 20


class Refused(Exception):
    """A client turned away before it was served: the reason is logged and counted."""


def _cqe(completion: Completion) -> bytes:
    return completion.encode()[: 16]


class Host(Protocol):
    """What a connection needs of the server that accepted it (server/server.py's Server),
    declared here so that this module does not import that one."""

    device: Device
    io: DeviceIO
    link: LinkTiming
    param_cache: ParamCache

    def check_token(self, offered: memoryview) -> str | None: ...

    def refused(self, peer: str, why: str) -> None: ...

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
        self._bulk = bytearray(0)

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        authenticated = False
        try:
            self.sock.settimeout(HANDSHAKE_TIMEOUT_S)
            self._handshake()
            self._connect()
            authenticated = True
            self.sock.settimeout(None)  # keepalive finds a vanished peer; a client may idle
            while True:
                self._serve_one()
        except Refused as exc:
            self.server.refused(self.peer, str(exc))
        except WireError as exc:
            if not authenticated:
                self.server.refused(self.peer, f"framing: {exc}")
            else:
                log.warning("%s: %s; closing the connection", self.peer, exc)
            self._terminate(exc.fes)
        except (ConnectionError, TimeoutError, OSError) as exc:
            if not authenticated:
                self.server.refused(self.peer, f"{type(exc).__name__}: {exc}")
            else:
                log.info("%s: connection closed (%s)", self.peer, exc or type(exc).__name__)
        except Exception:  # a bug must not take the server down
            log.exception("%s: connection failed", self.peer)
        finally:
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

    def _connect(self) -> None:
        submission, data = self._capsule()
        cid = struct.unpack_from("<H", submission, 2)[0]
        if submission[0] != wire.FABRICS_OPCODE or submission[wire.FCTYPE_AT] != FabricsType.CONNECT:
            self._reply(Completion(cid, Status.CONNECT_INVALID_HOST,
                                   data=b"the first command must be a fabrics CONNECT"))
            raise Refused("a command before CONNECT")
        why = self.server.check_token(data)
        if why is not None:
            self._reply(Completion(cid, Status.CONNECT_INVALID_HOST, data=why.encode()))
            raise Refused(why)
        self._reply(Completion(cid, Status.SUCCESS, data=json.dumps(
            {"maxh2cdata": wire.MAX_DATA_BYTES, "max_batch_bytes": wire.MAX_BATCH_BYTES}).encode()))
        log.info("%s: connected", self.peer)

    # ------------------------------------------------------------------ replies

    def _reply(self, completion: Completion) -> None:
        """A completion: its data in C2HData PDUs, then the CapsuleResp."""
        if completion.data:
            self.writer.send_data(PduType.C2H_DATA, completion.cid, wire.TTAG_COMPLETION_DATA, [completion.data])
        self.writer.send(PduType.CAPSULE_RESP, _cqe(completion))

    # ------------------------------------------------------------------ commands

    def _serve_one(self) -> None:
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
            self._forget_step(nsid)
        if self.server.param_cache.enabled:
            # A delete, rollback or commit gives the cached params' memory back now (a stale
            # entry is never served either way: the cache checks the superblock seq).
            self.server.param_cache.drop_stale(
                {ns.nsid: ns for ns in list(self.server.device.namespaces.values())})
        return completion

    def _forget_step(self, nsid: int) -> None:
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
                return self._write(cid, data)
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

    def _files(self, table: np.ndarray, writing: bool) -> list[tuple[OpenFile, AnyNamespace]]:
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

    # ------------------------------------------------------------------ WRITE

    def _receive_bulk(self, cid: int, total: int, arrived: Callable[[memoryview, int], None] | None = None,
                      ) -> tuple[memoryview, DeviceError | None]:
        """The H2CData PDUs of a WRITE, received in order straight into this connection's
        bulk buffer; a data digest that failed is reported once the whole transfer is in.
        `arrived(bulk, end)`: called after each PDU whose data checked, while all before
        `end` did (never again after one that failed)."""
        if len(self._bulk) < total:
            self._bulk = bytearray(total)
        bulk = memoryview(self._bulk)[:total]
        received, failed = 0, None
        while received < total:
            head = self.reader.read_head(self.digests)
            if head.type != PduType.H2C_DATA:
                raise WireError(FatalError.PDU_SEQUENCE_ERROR, f"expected H2CData, got {head.type.name}")
            cccid, _ttag, datao, datal = head.data_header()
            if cccid != cid or datao != received or datal != head.data_len or received + datal > total:
                raise WireError(FatalError.DATA_OUT_OF_RANGE,
                                f"H2CData of command {cccid} at {datao}+{datal}; expected {cid} at {received}, "
                                f"{total - received} bytes left")
            try:
                self.reader.read_data(bulk[datao : datao + datal])
            except DeviceError as exc:
                failed = failed or exc
            received += datal
            if arrived is not None and failed is None:
                arrived(bulk, received)
        return bulk, failed

    def _write(self, cid: int, data: memoryview) -> Completion:
        table = wire.decode_transfers(data)
        lengths = [int(length) for length in table["length"]]
        total = sum(lengths)
        if total > wire.MAX_BATCH_BYTES:
            raise WireError(FatalError.DATA_TRANSFER_LIMIT_EXCEEDED,
                            f"a WRITE of {total} bytes, more than {wire.MAX_BATCH_BYTES}")
        streamed = self._streamable(table, lengths, total)
        if streamed is not None:
            return self._write_streamed(cid, table, lengths, total, *streamed)
        bulk, failed = self._receive_bulk(cid, total)
        if failed is not None:
            raise failed
        files = self._files(table, writing=True)
        pieces: dict[int, list[tuple[str, int, memoryview, None]]] = {}
        position = 0
        singles = []
        for (opened, namespace), offset, length in zip(files, table["offset"], lengths):
            view = bulk[position : position + length]
            position += length
            if isinstance(namespace, Namespace) and opened.role == "grad":
                pieces.setdefault(opened.nsid, []).append((opened.tensor, int(offset), view, None))
            else:
                singles.append((opened, namespace, int(offset), view))
        report: dict[str, Any] = {"bytes": total, "transfers": len(lengths)}
        status = Status.SUCCESS
        for opened, namespace, offset, view in singles:
            self.server.io.write(namespace, opened.tensor, opened.role, offset, view)
        for nsid, batch in pieces.items():
            namespace = self.server.device_namespace(nsid)
            assert isinstance(namespace, Namespace)
            # The device's gradient path for memory lent until the call returns (as CMB_WRITE
            # lends the CMB): the receive buffer itself, no copy by this front-end.
            self.server.io.controller.injector.check_io(IoOpcode.WRITE, nsid)
            self.server.adopt(nsid)
            result = namespace.write_grads_lent(batch)
            if namespace.step_open is not None:
                self.steps[nsid] = namespace.step_open
            if result is not None:
                report["commit"] = {"step": result.step, "committed_step": result.committed_step,
                                    "skipped": result.skipped}
                self._forget_step(nsid)
                if result.skipped:
                    status = Status.STEP_SKIPPED_NONFINITE
        return Completion(cid, status, result=total & 0xFFFF_FFFF, data=json.dumps(report).encode())

    def _streamable(self, table: np.ndarray, lengths: list[int], total: int,
                    ) -> tuple[Namespace, list[OpenFile]] | None:
        """Where a WRITE's gradients may go to the device as they arrive: at least
        STREAM_MIN_BYTES, every range a whole-element range of one optimizer namespace's grad
        files, inside them and apart from each other (what write_grads_lent checks first).
        None sends the WRITE the atomic way (received whole, then checked and taken)."""
        if total < STREAM_MIN_BYTES:
            return None
        try:
            files = self._files(table, writing=True)
        except DeviceError:
            return None
        namespace = files[0][1]
        if not isinstance(namespace, Namespace) or any(
                opened.role != "grad" or opened.nsid != namespace.nsid for opened, _ in files):
            return None
        spans: dict[str | None, list[tuple[int, int]]] = {}
        for (opened, _), offset, length in zip(files, table["offset"], lengths):
            start = int(offset)
            if start % 2 or length % 2 or start + length > opened.size:
                return None
            spans.setdefault(opened.tensor, []).append((start, start + length))
        for ranges in spans.values():
            ranges.sort()
            if any(end > start for (_, end), (start, _) in zip(ranges, ranges[1:])):
                return None
        return namespace, [opened for opened, _ in files]

    def _write_streamed(self, cid: int, table: np.ndarray, lengths: list[int], total: int,
                        namespace: Namespace, files: list[OpenFile]) -> Completion:
        """A WRITE of gradients staged as its PDUs arrive: a thread hands each PDU's whole
        elements to write_grads_lent while the next PDU is received, so the kernels run
        under the transfer. The ranges were checked against each other first; what the open
        step already has is checked per piece, so a duplicate refuses the WRITE from that
        piece on (GRADIENT_DUPLICATE), the pieces before it taken, as file writes are."""
        self.server.io.controller.injector.check_io(IoOpcode.WRITE, namespace.nsid)
        self.server.adopt(namespace.nsid)
        ranges, position = [], 0
        for opened, offset, length in zip(files, table["offset"], lengths):
            ranges.append((opened.tensor, int(offset), position, length))
            position += length
        pending: queue.SimpleQueue[list[tuple[str, int, memoryview, None]] | None] = queue.SimpleQueue()
        errors: list[BaseException] = []
        results: list[CommitResult] = []

        def stage() -> None:
            while (batch := pending.get()) is not None:
                if errors:
                    continue  # refused already: the rest is received and dropped
                try:
                    result = namespace.write_grads_lent(batch)
                    if result is not None:
                        results.append(result)
                except BaseException as exc:  # noqa: BLE001 - reported in the completion
                    errors.append(exc)

        cursor = {"range": 0, "handed": 0}

        def arrived(bulk: memoryview, end: int) -> None:
            batch = []
            while cursor["range"] < len(ranges):
                tensor, offset, start, length = ranges[cursor["range"]]
                stop = min(start + length, end)
                stop -= (stop - start) % 2  # whole elements only
                if stop > cursor["handed"]:
                    batch.append((tensor, offset + cursor["handed"] - start, bulk[cursor["handed"] : stop], None))
                    cursor["handed"] = stop
                if cursor["handed"] < start + length:
                    break
                cursor["range"] += 1
                if cursor["range"] < len(ranges):
                    cursor["handed"] = ranges[cursor["range"]][2]
            if batch:
                pending.put(batch)

        stager = threading.Thread(target=stage, name="cossd-stage", daemon=True)
        stager.start()
        try:
            _, failed = self._receive_bulk(cid, total, arrived)
        finally:
            pending.put(None)
            stager.join()
        if namespace.step_open is not None:
            self.steps[namespace.nsid] = namespace.step_open
        if errors:
            if isinstance(errors[0], DeviceError):
                raise errors[0]
            log.error("%s: staging gradients failed", self.peer, exc_info=errors[0])
            raise DeviceError(Status.INTERNAL_ERROR, f"internal error: {errors[0]}")
        if failed is not None:
            raise failed
        report: dict[str, Any] = {"bytes": total, "transfers": len(lengths)}
        status = Status.SUCCESS
        for result in results:
            report["commit"] = {"step": result.step, "committed_step": result.committed_step,
                                "skipped": result.skipped}
            self._forget_step(namespace.nsid)
            if result.skipped:
                status = Status.STEP_SKIPPED_NONFINITE
        return Completion(cid, status, result=total & 0xFFFF_FFFF, data=json.dumps(report).encode())

    # ------------------------------------------------------------------ READ

    def _read(self, cid: int, data: memoryview) -> Completion:
        table = wire.decode_transfers(data)
        files = self._files(table, writing=False)
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

