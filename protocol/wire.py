"""The network wire: NVMe/TCP's PDU framing (ICReq/ICResp, CapsuleCmd/CapsuleResp, H2CData/
C2HData, C2HTermReq), declared once, carrying the device's own 64-byte submissions and
16-byte completions, and the fabrics commands of the wire itself (connect, and the file
commands of the data path). Digests are NVMe/TCP's: CRC32C of the header (HDGST) and of the
data (DDGST), each negotiated in the ICReq/ICResp exchange.

Layouts follow NVMe over TCP (NVM Express TCP Transport Specification 1.0, section 3.6): an
8-byte common header (type, flags, HLEN, PDO, PLEN), the PDU-specific header, the optional
header digest, the data (no padding: neither side asks for data alignment), the optional data
digest. Everything little-endian. docs/command-set.md ("Network wire") is the prose.
"""
from __future__ import annotations

import enum
import socket
import ssl
import struct
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .status import DeviceError, Status

# PDU format version of NVMe/TCP 1.0; an ICReq with another is refused.
PFV = 0
# The most data one PDU carries (MAXH2CDATA, stated in the ICResp; C2HData likewise): large
# enough that a PDU's header and system call cost nothing next to its data, small enough that
# a receiver never buffers much beyond what it received into its target.
MAX_DATA_BYTES = 16 << 20
# The in-capsule data one CapsuleCmd may carry: a submission's payload (MAX_PAYLOAD_BYTES, 16
# MiB) or a transfer table (MAX_TRANSFERS entries).
MAX_IN_CAPSULE_BYTES = 16 << 20
# A READ's or WRITE's bulk data at most: H2CData/C2HData offsets (DATAO) are 32 bits.
MAX_BATCH_BYTES = 1 << 31
DIGEST_BYTES = 4


class PduType(enum.IntEnum):
    IC_REQ = 0x00
    IC_RESP = 0x01
    H2C_TERM_REQ = 0x02
    C2H_TERM_REQ = 0x03
    CAPSULE_CMD = 0x04
    CAPSULE_RESP = 0x05
    H2C_DATA = 0x06
    C2H_DATA = 0x07
    R2T = 0x09


class PduFlags(enum.IntFlag):
    HDGST = 0x01  # a header digest follows the header
    DDGST = 0x02  # a data digest follows the data
    LAST_PDU = 0x04  # (data PDUs) the last of a transfer
    SUCCESS = 0x08  # (C2HData) NVMe/TCP's "no CapsuleResp follows": never set here


class Digest(enum.IntFlag):
    """ICReq/ICResp DGST: which digests the connection uses."""

    NONE = 0
    HEADER = 0x01
    DATA = 0x02


COMMON_HEADER = np.dtype([("type", "u1"), ("flags", "u1"), ("hlen", "u1"), ("pdo", "u1"), ("plen", "<u4")])
# ICReq and ICResp: 128 bytes each (HPDA / CPDA: data alignment; 0 = none).
IC_REQ = np.dtype([("ch", COMMON_HEADER), ("pfv", "<u2"), ("hpda", "u1"), ("dgst", "u1"),
                   ("maxr2t", "<u4"), ("reserved", "V112")])
IC_RESP = np.dtype([("ch", COMMON_HEADER), ("pfv", "<u2"), ("cpda", "u1"), ("dgst", "u1"),
                    ("maxh2cdata", "<u4"), ("reserved", "V112")])
# H2CData and C2HData: command id, transfer tag, offset and length of this PDU's data.
DATA_HEADER = np.dtype([("ch", COMMON_HEADER), ("cccid", "<u2"), ("ttag", "<u2"), ("datao", "<u4"),
                        ("datal", "<u4"), ("reserved", "V4")])
# C2HTermReq / H2CTermReq: a fatal error; the connection closes after it.
TERM_REQ = np.dtype([("ch", COMMON_HEADER), ("fes", "<u2"), ("fei", "<u4"), ("reserved", "V10")])
for _layout, _size in ((COMMON_HEADER, 8), (IC_REQ, 128), (IC_RESP, 128), (DATA_HEADER, 24), (TERM_REQ, 24)):
    assert _layout.itemsize == _size, (_layout, _size)
# CapsuleCmd: the common header and one 64-byte submission; CapsuleResp: one 16-byte completion.
CAPSULE_CMD_HLEN = 8 + 64
CAPSULE_RESP_HLEN = 8 + 16
HEADER_LENGTHS = {PduType.IC_REQ: 128, PduType.IC_RESP: 128, PduType.CAPSULE_CMD: CAPSULE_CMD_HLEN,
                  PduType.CAPSULE_RESP: CAPSULE_RESP_HLEN, PduType.H2C_DATA: 24, PduType.C2H_DATA: 24,
                  PduType.H2C_TERM_REQ: 24, PduType.C2H_TERM_REQ: 24}
# PDUs that never carry a header digest (NVMe/TCP: the IC exchange comes before the choice).
_NO_DIGEST = (PduType.IC_REQ, PduType.IC_RESP)

# C2HData's transfer tag says which stream its data belongs to: a READ's file bytes (placed
# straight into the host's buffers) or the completion's own data (JSON, a log page, the text
# of a refusal), whose length the completion's data_len gives.
TTAG_READ_DATA = 0x0000
TTAG_COMPLETION_DATA = 0x0001


class FatalError(enum.IntEnum):
    """C2HTermReq's fatal error status (FES)."""

    INVALID_HEADER_FIELD = 0x01
    PDU_SEQUENCE_ERROR = 0x02
    HEADER_DIGEST_ERROR = 0x03
    DATA_OUT_OF_RANGE = 0x04
    DATA_TRANSFER_LIMIT_EXCEEDED = 0x05
    UNSUPPORTED_PARAMETER = 0x06


# ---------------------------------------------------------------------- the wire's own commands

# NVMe-oF's Fabrics opcode: a capsule with it is the wire's own command, never the device's
# (no admin opcode of the command set is 7Fh). Its type (FCTYPE) is byte 4 of the submission,
# where NVMe-oF puts it (the nsid field of the other commands).
FABRICS_OPCODE = 0x7F
FCTYPE_AT = 4


class FabricsType(enum.IntEnum):
    """FCTYPE: 01h is NVMe-oF's Connect; C0h-FFh are vendor specific in NVMe-oF, here the
    file commands of the data path (docs/command-set.md, "Network wire")."""

    CONNECT = 0x01  # in-capsule data: the token (may be empty); must be the first capsule
    OPEN = 0xC0  # in-capsule data: a path in the device's tree; cdw10 bit 0: for writing
    CLOSE = 0xC1  # cdw10: the handle
    WRITE = 0xC2  # in-capsule data: a transfer table; the bytes follow in H2CData PDUs
    READ = 0xC3  # in-capsule data: a transfer table; the bytes come back in C2HData PDUs
    READ_TEXT = 0xC4  # in-capsule data: a path of a text file; its text is the completion data
    # The tree commands a remote mount needs (server/tree_commands.py):
    STAT = 0xC5  # in-capsule data: a path ("" is the root); cdw10 bit 0: a directory's entries too
    READ_PATH = 0xC6  # a snapshot's file: the path; cdw10-11 offset, cdw12 length, cdw14-15 snapshot id


OPEN_FOR_WRITING = 0x1
STAT_ENTRIES = 0x1

# One range of an open file in a READ's or WRITE's table: 24 bytes. The bulk data is the
# ranges' bytes in table order. A READ range past the file's end comes back short, as a file
# read does: each range returns min(length, size - offset) bytes (none past the end), the
# size being the one OPEN reported, so both sides know the layout before any data moves.
TRANSFER = np.dtype([("handle", "<u4"), ("reserved", "<u4"), ("offset", "<u8"), ("length", "<u8")])
assert TRANSFER.itemsize == 24
MAX_TRANSFERS = 65536


def clamped_lengths(table: np.ndarray, sizes: Sequence[int]) -> list[int]:
    """The bytes each READ range returns (see TRANSFER), given each range's file size."""
    return [max(0, min(int(length), size - int(offset)))
            for (offset, length), size in zip(zip(table["offset"], table["length"]), sizes)]


def encode_transfers(ranges: Sequence[tuple[int, int, int]]) -> bytes:
    """A transfer table of (handle, offset, length)."""
    table = np.zeros(len(ranges), TRANSFER)
    for index, (handle, offset, length) in enumerate(ranges):
        table[index] = (handle, 0, offset, length)
    return table.tobytes()


def decode_transfers(data: bytes | memoryview) -> np.ndarray:
    """A transfer table; INVALID_FIELD for a length that is not whole entries or is empty."""
    if not len(data) or len(data) % TRANSFER.itemsize:
        raise DeviceError(Status.INVALID_FIELD, f"a transfer table of {len(data)} bytes: whole 24-byte entries, "
                                                "at least one")
    if len(data) // TRANSFER.itemsize > MAX_TRANSFERS:
        raise DeviceError(Status.LIMIT_EXCEEDED, f"{len(data) // TRANSFER.itemsize} transfers in one command; "
                                                 f"at most {MAX_TRANSFERS}")
    return np.frombuffer(bytes(data), TRANSFER)


# ---------------------------------------------------------------------- PDUs


class WireError(Exception):
    """A PDU that breaks the framing: the connection cannot go on (a C2HTermReq, then close)."""

    def __init__(self, fes: FatalError, message: str) -> None:
        super().__init__(message)
        self.fes = fes


@dataclass(frozen=True)
class PduHead:
    """A PDU's headers as read off the wire, its data not yet: type, flags, the specific
    header (the bytes after the common header, digest excluded), and how much data follows."""

    type: PduType
    flags: int
    header: bytes
    data_len: int

    def data_header(self) -> tuple[int, int, int, int]:
        """(cccid, ttag, datao, datal) of an H2CData or C2HData PDU."""
        return struct.unpack_from("<HHII", self.header)


def header(pdu_type: PduType, flags: int, specific: bytes, data_len: int, digests: Digest) -> bytes:
    """A PDU's common header, specific header and header digest, for `data_len` data bytes
    to follow (and their digest where the connection uses data digests)."""
    hlen = 8 + len(specific)
    if hlen != HEADER_LENGTHS[pdu_type]:
        raise ValueError(f"{pdu_type.name}: a {hlen}-byte header, expected {HEADER_LENGTHS[pdu_type]}")
    hdgst = DIGEST_BYTES if digests & Digest.HEADER and pdu_type not in _NO_DIGEST else 0
    ddgst = DIGEST_BYTES if digests & Digest.DATA and data_len else 0
    if hdgst:
        flags |= PduFlags.HDGST
    if ddgst:
        flags |= PduFlags.DDGST
    pdo = hlen + hdgst if data_len else 0
    plen = hlen + hdgst + data_len + ddgst
    head = struct.pack("<BBBBI", pdu_type, flags, hlen, pdo, plen) + specific
    if hdgst:
        head += struct.pack("<I", crc32c(head))
    return head


def ic_req(digests: Digest) -> bytes:
    return header(PduType.IC_REQ, 0, struct.pack("<HBBI", PFV, 0, digests, 0) + bytes(112), 0, Digest.NONE)


def ic_resp(digests: Digest, maxh2cdata: int = MAX_DATA_BYTES) -> bytes:
    return header(PduType.IC_RESP, 0, struct.pack("<HBBI", PFV, 0, digests, maxh2cdata) + bytes(112), 0,
                  Digest.NONE)


def term_req(pdu_type: PduType, fes: FatalError) -> bytes:
    return header(pdu_type, 0, struct.pack("<HI", fes, 0) + bytes(10), 0, Digest.NONE)


def data_specific(cid: int, ttag: int, datao: int, datal: int) -> bytes:
    return struct.pack("<HHII", cid, ttag, datao, datal) + bytes(4)


class PduReader:
    """Reads PDUs from a stream (`recv_into`: a socket's, or an SSL socket's): headers into a
    small buffer, data either into a buffer that grows to the largest PDU seen, or straight
    into a target the caller names (so bulk data is received once, in place)."""

    def __init__(self, recv_into: Callable[[memoryview], int], max_data: int = MAX_DATA_BYTES) -> None:
        self._recv_into = recv_into
        self.max_data = max_data
        self._head = bytearray(MAX_HEADER_READ)
        self._buffer = bytearray(1 << 16)
        self._digest = bytearray(DIGEST_BYTES)
        self._pending: tuple[PduHead, bool] | None = None  # a head whose data is unread
        self.bytes_read = 0
        self.pdus = 0  # PDUs and their data bytes read (a server's link accounting)
        self.data_bytes = 0

    def _fill(self, view: memoryview) -> None:
        while view:
            count = self._recv_into(view)
            if count == 0:
                raise ConnectionResetError("the peer closed the connection")
            self.bytes_read += count
            view = view[count:]

    def read_head(self, digests: Digest = Digest.NONE) -> PduHead:
        """The next PDU's headers (then read_data, unless it has none); WireError for one
        that breaks the framing (nothing of it is used)."""
        assert self._pending is None, "the previous PDU's data was not read"
        view = memoryview(self._head)
        self._fill(view[:8])
        pdu_type, flags, hlen, pdo, plen = struct.unpack_from("<BBBBI", view)
        try:
            kind = PduType(pdu_type)
        except ValueError:
            raise WireError(FatalError.INVALID_HEADER_FIELD, f"unknown PDU type {pdu_type:#04x}") from None
        if hlen != HEADER_LENGTHS.get(kind):
            raise WireError(FatalError.INVALID_HEADER_FIELD, f"{kind.name} with HLEN {hlen}")
        expects_hdgst = bool(digests & Digest.HEADER) and kind not in _NO_DIGEST
        hdgst = DIGEST_BYTES if flags & PduFlags.HDGST else 0
        if bool(hdgst) != expects_hdgst:
            raise WireError(FatalError.INVALID_HEADER_FIELD, f"{kind.name}: header digest flag not as negotiated")
        ddgst = DIGEST_BYTES if flags & PduFlags.DDGST else 0
        data_len = plen - hlen - hdgst
        if data_len < 0:
            raise WireError(FatalError.INVALID_HEADER_FIELD, f"{kind.name}: PLEN {plen} shorter than its header")
        if data_len:
            if pdo != hlen + hdgst:  # no padding: neither side asks for data alignment
                raise WireError(FatalError.INVALID_HEADER_FIELD, f"{kind.name}: PDO {pdo}, expected {hlen + hdgst}")
            if bool(ddgst) != bool(digests & Digest.DATA):
                raise WireError(FatalError.INVALID_HEADER_FIELD, f"{kind.name}: data digest flag not as negotiated")
            data_len -= ddgst
            if data_len <= 0:
                raise WireError(FatalError.INVALID_HEADER_FIELD, f"{kind.name}: PLEN {plen} leaves no data")
        elif ddgst:
            raise WireError(FatalError.INVALID_HEADER_FIELD, f"{kind.name}: a data digest without data")
        limit = MAX_IN_CAPSULE_BYTES if kind == PduType.CAPSULE_CMD else self.max_data
        if data_len > limit:
            raise WireError(FatalError.DATA_TRANSFER_LIMIT_EXCEEDED,
                            f"{kind.name}: {data_len} bytes of data, more than {limit}")
        self._fill(view[8 : hlen + hdgst])
        if hdgst:
            (expected,) = struct.unpack_from("<I", view, hlen)
            if crc32c(view[:hlen]) != expected:
                raise WireError(FatalError.HEADER_DIGEST_ERROR, f"{kind.name}: header digest mismatch")
        head = PduHead(kind, flags, bytes(view[8:hlen]), data_len)
        self.pdus += 1
        self.data_bytes += data_len
        if data_len:
            self._pending = (head, bool(ddgst))
        return head

    def read_data(self, into: memoryview | None = None) -> memoryview:
        """The data of the PDU whose head was just read: received into `into` (exactly its
        length) or into the reader's buffer (a view valid until the next read). A data digest
        that does not match raises DeviceError(DATA_TRANSFER_ERROR) once the PDU is wholly
        read: the framing holds, the command it belongs to fails."""
        if self._pending is None:
            return memoryview(b"")
        head, ddgst = self._pending
        self._pending = None
        if into is None:
            if len(self._buffer) < head.data_len:
                self._buffer = bytearray(max(head.data_len, 2 * len(self._buffer)))
            into = memoryview(self._buffer)[: head.data_len]
        elif len(into) != head.data_len:
            raise ValueError(f"a {len(into)}-byte target for {head.data_len} bytes of data")
        self._fill(into)
        if ddgst:
            self._fill(memoryview(self._digest))
            (expected,) = struct.unpack("<I", self._digest)
            if crc32c(into) != expected:
                raise DeviceError(Status.DATA_TRANSFER_ERROR, f"{head.type.name}: data digest mismatch")
        return into

    def skip_data(self, scratch: memoryview) -> None:
        """Read and drop the data (and its digest) of the PDU whose head was just read, piece
        by piece through `scratch`: a refused transfer's bytes leave the stream, and the
        framing holds, without a buffer of their size."""
        if self._pending is None:
            return
        head, ddgst = self._pending
        self._pending = None
        left = head.data_len + (DIGEST_BYTES if ddgst else 0)
        while left:
            piece = scratch[: min(left, len(scratch))]
            self._fill(piece)
            left -= len(piece)

    def trim(self, keep: int = 1 << 16) -> int:
        """Give back the data buffer grown by a large PDU (an idle connection then holds
        `keep` bytes); the bytes given back."""
        freed = len(self._buffer) - keep
        if freed <= 0:
            return 0
        self._buffer = bytearray(keep)
        return freed


# The largest header with its digest that read_head ever takes in.
MAX_HEADER_READ = max(HEADER_LENGTHS.values()) + DIGEST_BYTES


class PduWriter:
    """Writes PDUs to a socket: each PDU's header and data views in one gathered send where
    the socket has sendmsg (plain TCP), so bulk data is never joined into a new buffer."""

    def __init__(self, sock: socket.socket, digests: Digest = Digest.NONE) -> None:
        self.sock = sock
        self.digests = digests
        self._gather = not isinstance(sock, ssl.SSLSocket)  # SSLSocket has no sendmsg
        self.bytes_written = 0
        self.pdus = 0  # PDUs and their data bytes written (a server's link accounting)
        self.data_bytes = 0

    def send(self, pdu_type: PduType, specific: bytes, data: Sequence[bytes | memoryview] = (),
             flags: int = 0) -> None:
        views = [memoryview(piece).cast("B") for piece in data if len(piece)]
        data_len = sum(len(view) for view in views)
        pieces = [memoryview(header(pdu_type, flags, specific, data_len, self.digests)), *views]
        self.pdus += 1
        self.data_bytes += data_len
        if data_len and self.digests & Digest.DATA:
            value = 0
            for view in views:
                value = crc32c(view, value)
            pieces.append(memoryview(struct.pack("<I", value)))
        self._send_all(pieces)

    def send_raw(self, raw: bytes) -> None:
        self._send_all([memoryview(raw)])

    def _send_all(self, pieces: list[memoryview]) -> None:
        total = sum(len(piece) for piece in pieces)
        if not self._gather:
            for piece in pieces:
                self.sock.sendall(piece)
            self.bytes_written += total
            return
        while pieces:
            sent = self.sock.sendmsg(pieces)
            self.bytes_written += sent
            while pieces and sent >= len(pieces[0]):
                sent -= len(pieces[0])
                pieces.pop(0)
            if sent:
                pieces[0] = pieces[0][sent:]

    def send_data(self, pdu_type: PduType, cid: int, ttag: int, views: Sequence[bytes | memoryview],
                  chunk: int = MAX_DATA_BYTES) -> None:
        """Data PDUs (H2CData or C2HData) carrying the concatenation of `views`, each PDU at
        most `chunk` bytes, the last flagged LAST_PDU; nothing for no data."""
        pending = [memoryview(view).cast("B") for view in views if len(view)]
        total = sum(len(view) for view in pending)
        offset = 0
        while pending:
            batch: list[memoryview] = []
            room = chunk
            while pending and room:
                view = pending[0]
                if len(view) <= room:
                    batch.append(view)
                    pending.pop(0)
                    room -= len(view)
                else:
                    batch.append(view[:room])
                    pending[0] = view[room:]
                    room = 0
            length = chunk - room
            last = offset + length == total
            self.send(pdu_type, data_specific(cid, ttag, offset, length), batch,
                      PduFlags.LAST_PDU if last else 0)
            offset += length


def _crc32c_function() -> Callable[..., int]:
    """CRC32C for the digests: the crc32c package (SSE4.2 / ARMv8 instructions), which a
    client node has without the device's own compiled kernels. crc32c(data, value) goes on
    from `value`, so a digest over several views needs no joined copy."""
    import crc32c as _crc32c_module

    return lambda data, value=0: int(_crc32c_module.crc32c(data, value))


crc32c = _crc32c_function()
