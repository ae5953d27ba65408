"""The network-namespace helper (tests/netns.py) the server's tests run on: a real TCP link
between two namespaces, a tbf rate limit that binds, a cut link that times out, and teardown
that leaves nothing behind (after a failure, and after a run killed before its teardown)."""
from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import netns
import pytest
from netns import NetnsPair, joined_namespaces, namespaces, unavailable

netns_pair = netns.netns_pair  # the fixture, from the helper

TESTS = Path(__file__).resolve().parents[1]
PORT_ANY = 0


def serve_sink(pair: NetnsPair) -> tuple[socket.socket, int, dict[str, object]]:
    """A listener in namespace a that reads whatever one client sends and records its length
    and digest."""
    with pair.a.entered():
        listener = socket.create_server((pair.a.address, PORT_ANY))
    listener.settimeout(20)
    received: dict[str, object] = {}

    def sink() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            digest, total = hashlib.sha256(), 0
            while chunk := conn.recv(1 << 20):
                digest.update(chunk)
                total += len(chunk)
            received["bytes"], received["sha256"] = total, digest.hexdigest()
            conn.sendall(b"done")

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    received["thread"] = thread
    return listener, listener.getsockname()[1], received


def send_all(address: str, port: int, data: bytes) -> float:
    """Connect, send `data`, wait for the receiver's answer; seconds it took."""
    started = time.monotonic()
    with socket.create_connection((address, port), timeout=20) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(16) == b"done"
    return time.monotonic() - started


def transfer(pair: NetnsPair, data: bytes) -> float:
    listener, port, received = serve_sink(pair)
    try:
        elapsed = pair.b.call(send_all, pair.a.address, port, data, timeout=30)
        received["thread"].join(10)  # type: ignore[attr-defined]
    finally:
        listener.close()
    assert received["bytes"] == len(data) and received["sha256"] == hashlib.sha256(data).hexdigest()
    return elapsed


def test_tcp_crosses_the_veth_between_the_namespaces(netns_pair: NetnsPair) -> None:
    pair = netns_pair
    data = os.urandom(4 << 20)
    transfer(pair, data)  # from a thread of this process entered into b
    # From a process started inside b, as a trainer process would be.
    listener, port, received = serve_sink(pair)
    client = ("import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=20); "
              "s.sendall(b'x' * 1000000); s.shutdown(socket.SHUT_WR); assert s.recv(16) == b'done'")
    try:
        pair.b.run([sys.executable, "-c", client, pair.a.address, str(port)], timeout=30)
        received["thread"].join(10)  # type: ignore[attr-defined]
    finally:
        listener.close()
    assert received["bytes"] == 1_000_000
    # The two sides are apart: a's address is local in a only; this test's own namespace
    # cannot reach it.
    assert pair.a.address in pair.a.run(["ip", "-4", "addr", "show"]).stdout
    assert pair.a.address not in pair.b.run(["ip", "-4", "addr", "show"]).stdout
    with pytest.raises(OSError):
        socket.create_connection((pair.a.address, port), timeout=0.5).close()


def test_tbf_bounds_the_rate_and_can_be_changed(netns_pair: NetnsPair) -> None:
    data = os.urandom(8 << 20)  # 67 Mbit: 0.67 s at 100 Mbit/s
    netns_pair.rate_limit(netns_pair.b, mbit=100)
    assert "tbf" in netns_pair.qdisc(netns_pair.b) and "100Mbit" in netns_pair.qdisc(netns_pair.b)
    slow = transfer(netns_pair, data)
    assert slow > 0.2, f"8 MB crossed a 100 Mbit/s link in {slow:.3f} s"
    netns_pair.rate_limit(netns_pair.b, mbit=4000)  # changed in place: 0.017 s by the rate
    assert "4Gbit" in netns_pair.qdisc(netns_pair.b)
    fast = transfer(netns_pair, data)
    assert fast < slow * 0.75, (slow, fast)
    netns_pair.clear_rate_limit(netns_pair.b)
    assert "tbf" not in netns_pair.qdisc(netns_pair.b)


def wait_recv(sock: socket.socket) -> bytes:
    return sock.recv(16)


def test_a_cut_link_times_out_and_comes_back(netns_pair: NetnsPair) -> None:
    pair = netns_pair
    with pair.a.entered():
        listener = socket.create_server((pair.a.address, PORT_ANY))
    port = listener.getsockname()[1]
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    with pair.b.entered():
        client = socket.create_connection((pair.a.address, port), timeout=5)
    try:
        deadline = time.monotonic() + 5
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert accepted
        pair.link_down(pair.a)
        accepted[0].sendall(b"lost")  # queued in a, never delivered while the link is down
        client.settimeout(1.0)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            client.recv(16)
        assert 0.8 < time.monotonic() - started < 5
        # A new connection across the cut link is not refused: it times out.
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            pair.b.call(socket.create_connection, (pair.a.address, port), 1.0, timeout=10)
        assert time.monotonic() - started < 5
        pair.link_up(pair.a)
        # Back up: the queued bytes arrive (TCP retransmits them) and new connections work.
        client.settimeout(10)
        assert client.recv(16) == b"lost"
    finally:
        client.close()
        for conn in accepted:
            conn.close()
        listener.close()


def test_teardown_leaves_nothing_even_after_a_failure() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with pytest.raises(RuntimeError, match="the test failed"):
        with joined_namespaces() as pair:
            inside = pair.popen(pair.a, ["sleep", "60"])
            names = (pair.a.name, pair.b.name)
            assert set(names) <= set(namespaces())
            raise RuntimeError("the test failed")
    assert inside.poll() is not None, "a process started inside was left running"
    assert not set(names) & set(namespaces())
    assert not pair.exists()
    # No end of the veth is left in the host's namespace either.
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert "veth-a" not in links and "veth-b" not in links
    pair.destroy()  # twice is harmless


def test_leftovers_of_a_killed_run_are_cleaned() -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    # A run killed between create and teardown: its namespaces stay behind, named by its pid.
    script = ("import os, signal, sys; sys.path.insert(0, sys.argv[1]); import netns; "
              "p = netns.NetnsPair.create(); print(p.a.name, p.b.name, flush=True); "
              "os.kill(os.getpid(), signal.SIGKILL)")
    killed = subprocess.run([sys.executable, "-c", script, str(TESTS)], capture_output=True, text=True, timeout=60)
    assert killed.returncode == -9, killed.stderr
    left = killed.stdout.split()
    assert len(left) == 2 and set(left) <= set(namespaces())
    with joined_namespaces() as pair:  # cleans leftovers of dead runs first, never live ones
        assert not set(left) & set(namespaces())
        assert pair.exists()
    assert not pair.exists()
