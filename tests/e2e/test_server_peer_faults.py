"""The storage server against peers that misbehave, on real `cossd serve` processes and sockets:
data digests that fail (before and after login), a WRITE refused part way, a client that stops
reading its answers, descriptors run out by unauthenticated peers, stalled and reset metrics
connections, and EXPORT over the wire."""
from __future__ import annotations

import json
import os
import resource
import socket
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from cossd.client import AdminClient
from cossd.protocol import wire
from cossd.protocol.entries import Opcode, decode_completion, encode_submission
from cossd.protocol.logpages import LogId, decode_server_log
from cossd.protocol.status import Status
from cossd.protocol.wire import Digest, FabricsType, PduType
from helpers import free_port
from waiting import wait_until
from test_server import TOKEN, Served, serve, served, token_file  # noqa: F401  (the fixtures)

BAD_DIGEST = b"\0\0\0\0"  # CRC32C of none of the payloads below


def server_figures(served: Served, token_file: Path) -> dict[str, int]:
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        return decode_server_log(admin.get_log_page(LogId.SERVER))


def raw_peer(port: int, digests: Digest, timeout_s: float = 10.0) -> tuple[socket.socket, wire.PduReader]:
    """A socket past the ICReq/ICResp, with `digests` granted."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    sock.sendall(wire.ic_req(digests))
    reader = wire.PduReader(sock.recv_into)
    assert reader.read_head().type == PduType.IC_RESP
    return sock, reader


def fabrics(fctype: int, cid: int) -> bytes:
    return encode_submission(wire.FABRICS_OPCODE, cid=cid, nsid=fctype)[:64]


def send_capsule(sock: socket.socket, submission: bytes, data: bytes, digests: Digest, *, bad: bool = False) -> None:
    """A CapsuleCmd with in-capsule `data`; `bad`: its data digest does not match."""
    if not bad:
        wire.PduWriter(sock, digests).send(PduType.CAPSULE_CMD, submission, [data])
        return
    sock.sendall(wire.header(PduType.CAPSULE_CMD, 0, submission, len(data), digests) + data + BAD_DIGEST)


def answer(reader: wire.PduReader, digests: Digest) -> tuple[int, int, bytes]:
    """The next completion: (status, result, its data)."""
    data = bytearray()
    while True:
        head = reader.read_head(digests)
        if head.type == PduType.C2H_DATA:
            data += reader.read_data()
            continue
        assert head.type == PduType.CAPSULE_RESP, head.type
        completion, _ = decode_completion(head.header)
        return int(completion.status), completion.result, bytes(data)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# ---------------------------------------------------------------------- data digests


def test_a_connect_whose_data_digest_fails_is_a_counted_refusal(served: Served, token_file: Path) -> None:
    """Before: read_data's DeviceError reached the catch-all, a traceback per connection, not
    counted, no answer. Now a refusal like the others: answered, counted under framing."""
    for _ in range(3):
        sock, reader = raw_peer(served.port, Digest.DATA)
        with sock:
            send_capsule(sock, fabrics(FabricsType.CONNECT, 1), TOKEN.encode(), Digest.DATA, bad=True)
            status, _, message = answer(reader, Digest.DATA)
        assert status == Status.DATA_TRANSFER_ERROR and b"digest" in message, (status, message)
    seen = server_figures(served, token_file)
    assert seen["refused_framing"] == 3 and seen["refused_total"] == 3
    assert seen["connections_total"] == 1  # only the figures' own client was let in
    log = wait_until(lambda: served.log() if served.log().count("data digest mismatch") == 3 else "", timeout_s=10)
    assert "Traceback" not in log and "connection failed" not in log, log


def test_a_command_whose_data_digest_fails_fails_alone(served: Served, token_file: Path) -> None:
    """Before: a bad digest on in-capsule data dropped the connection with a traceback. Now
    that command is DATA_TRANSFER_ERROR and the next one on the same connection is served; a
    WRITE whose table failed runs nothing and its bulk leaves the stream."""
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        admin.create_namespace({"name": "v", "kind": "nvm", "capacity_bytes": 1 << 20})
    digests = Digest.DATA | Digest.HEADER
    sock, reader = raw_peer(served.port, digests)
    with sock:
        send_capsule(sock, fabrics(FabricsType.CONNECT, 1), TOKEN.encode(), digests)
        assert answer(reader, digests)[0] == Status.SUCCESS
        send_capsule(sock, fabrics(FabricsType.READ_TEXT, 2), b"ns/v/config.json", digests, bad=True)
        assert answer(reader, digests)[0] == Status.DATA_TRANSFER_ERROR
        send_capsule(sock, fabrics(FabricsType.OPEN, 3), b"ns/v/data", digests)
        status, handle, _ = answer(reader, digests)
        assert status == Status.SUCCESS
        bulk = b"\xab" * 8192
        send_capsule(sock, fabrics(FabricsType.WRITE, 4), wire.encode_transfers([(handle, 0, len(bulk))]), digests,
                     bad=True)
        wire.PduWriter(sock, digests).send_data(PduType.H2C_DATA, 4, 0, [bulk], 4096)  # two PDUs
        assert answer(reader, digests)[0] == Status.DATA_TRANSFER_ERROR
        send_capsule(sock, fabrics(FabricsType.READ_TEXT, 5), b"ns/v/config.json", digests)
        status, _, text = answer(reader, digests)
        assert status == Status.SUCCESS and json.loads(text)["name"] == "v"
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        data = admin.transport.open_file("ns/v/data", False, False)
        back = bytearray(8192)
        admin.transport.read_at(data, memoryview(back), 0)
    assert bytes(back) == bytes(8192), "a WRITE whose table failed its digest wrote"
    assert "Traceback" not in served.log(), served.log()


# ---------------------------------------------------------------------- a refused WRITE changes nothing


def test_a_refused_write_changes_nothing(served: Served, token_file: Path) -> None:
    """Before: ranges were taken one by one, then each namespace's gradients, so a WRITE
    refused at its 2nd range or 2nd namespace had written the 1st (a committed step a client
    told "failed" would feed again). Now every range is checked before any is taken."""
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        transport = admin.transport
        admin.create_namespace({"name": "v", "kind": "nvm", "capacity_bytes": 1 << 20})
        a = admin.create_namespace({"name": "a", "tensors": [["w", 1024]]})
        b = admin.create_namespace({"name": "b", "tensors": [["w", 1024]]})
        data = transport.open_file("ns/v/data", True, False)
        with pytest.raises(OSError, match="LBA_OUT_OF_RANGE"):
            transport.write_many([(data, memoryview(b"\xaa" * 4096), 0), (data, memoryview(b"\xbb" * 4096), 1 << 20)])
        reader = transport.open_file("ns/v/data", False, False)
        back = bytearray(4096)
        transport.read_at(reader, memoryview(back), 0)
        assert bytes(back) == bytes(4096), "the refused WRITE's first range was written"

        grad_a = transport.open_file("ns/a/tensors/w/grad", True, False)
        grad_b = transport.open_file("ns/b/tensors/w/grad", True, False)
        grads = np.full(1024, 0.01, np.float16).tobytes()
        refused: list[tuple[str, list[tuple[int, memoryview, int]]]] = [
            ("LBA_OUT_OF_RANGE", [(grad_a, memoryview(grads), 0), (grad_b, memoryview(grads), 2048)]),
            ("MISALIGNED_ACCESS", [(grad_a, memoryview(grads), 0), (grad_b, memoryview(grads[:3]), 1)]),
            ("GRADIENT_DUPLICATE", [(grad_a, memoryview(grads), 0), (grad_b, memoryview(grads[:512]), 0),
                                    (grad_b, memoryview(grads[:512]), 256)]),
            # State of a namespace that has begun a step, then gradients: sealed, nothing fed.
            ("LBA_OUT_OF_RANGE", [(data, memoryview(b"\xcc" * 16), 0), (grad_a, memoryview(grads), 0),
                                  (data, memoryview(b"\xcc" * 16), 1 << 20)]),
        ]
        for status, ranges in refused:
            with pytest.raises(OSError, match=status):
                transport.write_many(ranges)
            for nsid in (a, b):
                stats = admin.statistics(nsid)
                assert stats["committed_step"] == 0 and stats["grad_bytes_in"] == 0, (status, stats)
        transport.read_at(reader, memoryview(back), 0)
        assert bytes(back) == bytes(4096)
        # The same gradients, whole: one step each, as a client's retry would have them.
        transport.write_many([(grad_a, memoryview(grads), 0), (grad_b, memoryview(grads), 0)])
        assert admin.statistics(a)["committed_step"] == 1 and admin.statistics(b)["committed_step"] == 1


def test_a_write_of_impossible_state_changes_nothing(served: Served, token_file: Path) -> None:
    """A WRITE of a loading namespace's state whose 2nd range holds a negative exp_avg_sq (no
    step can start from it) is refused, and its 1st range (the masters) was not taken: the
    values are checked with the ranges, before any is written."""
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        transport = admin.transport
        admin.create_namespace({"name": "s", "tensors": [["w", 1024]]})
        master = transport.open_file("ns/s/tensors/w/master", True, False)
        moment = transport.open_file("ns/s/tensors/w/exp_avg_sq", True, False)
        ones = np.ones(1024, np.float32).tobytes()
        negative = np.full(1024, -1.0, np.float32).tobytes()
        with pytest.raises(OSError, match="INVALID_FIELD"):
            transport.write_many([(master, memoryview(ones), 0), (moment, memoryview(negative), 0)])
        reader = transport.open_file("ns/s/tensors/w/master", False, False)
        back = bytearray(4096)
        transport.read_at(reader, memoryview(back), 0)
        assert bytes(back) != ones, "the refused WRITE's masters were written"


# ---------------------------------------------------------------------- a client that stops reading


def test_a_client_that_stops_reading_is_dropped_and_lets_go(serve: Callable[..., Served], token_file: Path) -> None:
    """Before: after login the socket had no timeout, so a param READ's send to a peer that
    stopped reading blocked for ever holding its pin on the committed copy, and the next
    commit of that namespace waited for it: every other client hung. Now the send gives up
    after --send-timeout-s, the connection ends and the pin is let go."""
    served = serve("--send-timeout-s", "1")
    elements = 4 << 20  # 8 MiB of FP16 params: far more than the socket buffers hold
    with AdminClient(served.url, 60, token_file=token_file) as admin:
        transport = admin.transport
        nsid = admin.create_namespace({"name": "g", "tensors": [["w", elements]]})
        grad = transport.open_file("ns/g/tensors/w/grad", True, False)
        grads = memoryview(np.full(elements, 1e-3, np.float16).tobytes())
        transport.write_at(grad, grads, 0)  # step 1, committed
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.settimeout(10)
        with stalled:
            stalled.connect(("127.0.0.1", served.port))
            stalled.sendall(wire.ic_req(Digest.NONE))
            reader = wire.PduReader(stalled.recv_into)
            assert reader.read_head().type == PduType.IC_RESP
            send_capsule(stalled, fabrics(FabricsType.CONNECT, 1), TOKEN.encode(), Digest.NONE)
            assert answer(reader, Digest.NONE)[0] == Status.SUCCESS
            send_capsule(stalled, fabrics(FabricsType.OPEN, 2), b"ns/g/tensors/w/param", Digest.NONE)
            status, handle, _ = answer(reader, Digest.NONE)
            assert status == Status.SUCCESS
            send_capsule(stalled, fabrics(FabricsType.READ, 3), wire.encode_transfers([(handle, 0, 2 * elements)]),
                         Digest.NONE)
            # ... and never reads again. Each step's commit needs the copy the READ pins
            # within two steps; the client's 60 s timeout bounds the wait.
            for step in (2, 3, 4):
                transport.write_at(grad, grads, 0)
                assert admin.statistics(nsid)["committed_step"] == step
    assert wait_until(lambda: "read nothing of an answer for 1 s" in served.log(), timeout_s=10), served.log()
    served.stop()
    assert "'send_timeouts': 1" in served.log(), served.log()  # the stopped line's figures


# ---------------------------------------------------------------------- descriptors


def test_descriptors_run_out_by_peers_do_not_end_the_server(served: Served, token_file: Path) -> None:
    """Before: accept()'s EMFILE ended serve_forever and the process. Now it is counted,
    logged (rate-limited) and accepts go on after a pause."""
    hard = resource.prlimit(served.pid, resource.RLIMIT_NOFILE)[1]
    resource.prlimit(served.pid, resource.RLIMIT_NOFILE, (descriptors(served.pid) + 16, hard))
    peers = []
    try:
        for _ in range(48):  # silent and unauthenticated: each a descriptor of the server's
            peers.append(socket.create_connection(("127.0.0.1", served.port), timeout=10))
        assert wait_until(lambda: "accepting a connection failed: Too many open files" in served.log(),
                          timeout_s=10), served.log()
        assert alive(served.pid), served.log()
    finally:
        for peer in peers:
            peer.close()

    def connects() -> bool:
        try:
            with AdminClient(served.url, 10, token_file=token_file) as admin:
                return bool(admin.describe())
        except OSError:
            return False

    assert wait_until(connects, timeout_s=30)
    assert alive(served.pid)


def test_serve_raises_its_descriptor_limit(serve: Callable[..., Served]) -> None:
    """Before: `cossd serve` kept the soft limit it was started with (often 1,024), which a
    device's namespaces (two descriptors each) and peers exhaust together. Now it raises it
    to the hard limit, as the mount daemon does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 512
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip(f"the hard descriptor limit is {hard}: nothing to raise to")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    try:
        served = serve()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    now = resource.prlimit(served.pid, resource.RLIMIT_NOFILE)
    expected = hard if hard != resource.RLIM_INFINITY else int(Path("/proc/sys/fs/nr_open").read_text())
    assert now[0] == expected, (now, hard)


# ---------------------------------------------------------------------- the metrics endpoint


def test_metrics_connections_that_stall_or_fail_are_bounded(serve: Callable[..., Served], tmp_path: Path) -> None:
    """Before: each failed metrics connection wrote a ~1 KB traceback into the log, without
    limit, and each held a thread. Now a failure is one rate-limited line and at most 16
    connections are served at once (more are closed at their accept)."""
    metrics_token = tmp_path / "metrics-token"
    metrics_token.write_text("metrics-token-0123456789\n")
    metrics_token.chmod(0o600)
    port = free_port()
    served = serve("--metrics-port", str(port), "--metrics-token-file", str(metrics_token))
    # Half a request line, then a reset: the handler's read fails.
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
            peer.sendall(b"GET /metr")
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert wait_until(lambda: "metrics endpoint: 127.0.0.1" in served.log(), timeout_s=10), served.log()
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(16)]
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            try:
                closed = extra.recv(1024) == b""
            except ConnectionResetError:
                closed = True
        assert closed, "a 17th connection was served while 16 stalled ones were open"
    finally:
        for peer in stalled:
            peer.close()

    def scraped() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
                peer.sendall(b"GET /metrics HTTP/1.0\r\nAuthorization: Bearer metrics-token-0123456789\r\n\r\n")
                reply = b""
                while chunk := peer.recv(1 << 16):
                    reply += chunk
                return reply.startswith(b"HTTP/1.0 200") and b"cossd_server_connections_open" in reply
        except OSError:
            return False

    assert wait_until(scraped, timeout_s=15)
    assert "Traceback" not in served.log(), served.log()


# ---------------------------------------------------------------------- EXPORT over the wire


def test_export_over_the_wire_is_refused(served: Served, token_file: Path, tmp_path: Path) -> None:
    """Before: EXPORT passed through, so a token holder could replace any file the server's
    user may write. Now the server answers it ACCESS_DENIED itself, whatever the payload."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        nsid = admin.create_namespace({"name": "o", "tensors": [["w", 100]]})
        grad = admin.transport.open_file("ns/o/tensors/w/grad", True, False)
        admin.transport.write_at(grad, memoryview(np.full(100, 0.5, np.float16).tobytes()), 0)
        for payload in (json.dumps({"path": str(victim), "overwrite": True}).encode(), b""):
            completion = admin.submit(Opcode.EXPORT, nsid=nsid, payload=payload)
            assert completion.status == Status.ACCESS_DENIED, completion
            assert b"on the server's host" in bytes(completion.data)
        assert admin.statistics(nsid)["committed_step"] == 1  # the connection goes on
        jobs: Any = json.loads(admin.get_log_page(LogId.JOBS))
    assert jobs == {"jobs": []}
    assert victim.read_text() == "precious\n"
    assert not (served.backing / "exports").exists()


def test_an_archive_endpoint_over_the_wire_is_refused(served: Served, token_file: Path) -> None:
    """ARCHIVE and ARCHIVE_LIST naming an endpoint_url (at the top or in a policy) would have
    the server's host connect, with its own credentials, wherever the client says: refused,
    and nothing is connected to (a listener on that address sees no connection)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with AdminClient(served.url, 10, token_file=token_file) as admin:
            nsid = admin.create_namespace({"name": "o", "tensors": [["w", 100]]})
            for opcode, at, payload in (
                    (Opcode.ARCHIVE, nsid, {"url": "s3://bucket/p", "endpoint_url": endpoint}),
                    (Opcode.ARCHIVE, nsid, {"policy": {"url": "s3://bucket/p", "every": 1, "endpoint_url": endpoint}}),
                    (Opcode.ARCHIVE_LIST, 0, {"url": "s3://bucket/p", "endpoint_url": endpoint})):
                completion = admin.submit(opcode, nsid=at, payload=json.dumps(payload).encode())
                assert completion.status == Status.ACCESS_DENIED, completion
                assert b"endpoint_url is not taken over the network" in bytes(completion.data)
            assert json.loads(admin.get_log_page(LogId.JOBS)) == {"jobs": []}
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
