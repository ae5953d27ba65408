"""The network client refuses a READ answered with bytes missing, out of order or twice, where
it would otherwise leave part of the caller's buffers stale and count them as read. A
socketpair plays a server that answers wrongly (a real one never does, so no test could make
it)."""
from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from cossd.client.remote import RemoteTransport
from cossd.protocol import wire
from cossd.protocol.entries import Completion
from cossd.protocol.status import Status
from cossd.protocol.wire import PduType

CID = 7


@pytest.fixture
def pair() -> Iterator[tuple[RemoteTransport, wire.PduWriter]]:
    """A transport wired to one end of a socketpair (no handshake: the digests are off), and a
    writer on the other end that plays the server."""
    ours, theirs = socket.socketpair()
    transport = object.__new__(RemoteTransport)
    transport.sock, transport.digests, transport.location = ours, wire.Digest.NONE, "socketpair"
    transport.reader = wire.PduReader(ours.recv_into)
    server = wire.PduWriter(theirs)
    yield transport, server
    ours.close()
    theirs.close()


def answer(server: wire.PduWriter, pieces: list[tuple[int, bytes]], result: int) -> None:
    """C2HData at each (offset, bytes), then a successful completion with `result`."""
    for offset, data in pieces:
        server.send(PduType.C2H_DATA, wire.data_specific(CID, wire.TTAG_READ_DATA, offset, len(data)), [data])
    server.send(PduType.CAPSULE_RESP, Completion(CID, Status.SUCCESS, result=result).encode()[:16])


def read(transport: RemoteTransport, server: wire.PduWriter, pieces: list[tuple[int, bytes]],
         result: int) -> bytearray:
    buffer = bytearray(b"." * 8)
    writer = threading.Thread(target=answer, args=(server, pieces, result))
    writer.start()
    try:
        transport._answer(CID, [memoryview(buffer)[:4], memoryview(buffer)[4:]])
    finally:
        writer.join()
    return buffer


def test_a_whole_answer_fills_the_buffers(pair: tuple[RemoteTransport, wire.PduWriter]) -> None:
    assert read(*pair, [(0, b"abcd"), (4, b"efgh")], 8) == b"abcdefgh"


@pytest.mark.parametrize("pieces, result", [
    ([(0, b"abcd")], 8),                    # the second range never sent, the result claims all
    ([(0, b"abcd")], 4),                    # ... and the result admits it
    ([(4, b"efgh"), (0, b"abcd")], 8),      # out of order
    ([(0, b"abcd"), (0, b"abcd")], 8),      # the first range twice, the second never
    ([(0, b"abcd"), (4, b"efgh")], 9),      # every byte, but a result that disagrees
], ids=["short", "short-result", "out-of-order", "twice", "result"])
def test_a_wrong_answer_is_refused(pair: tuple[RemoteTransport, wire.PduWriter],
                                   pieces: list[tuple[int, bytes]], result: int) -> None:
    with pytest.raises(wire.WireError, match="READ|C2HData"):
        read(*pair, pieces, result)
