"""The storage server before authentication, attacked with real sockets: a peer trickling its
handshake is closed at the whole-handshake deadline; a CONNECT announcing a large capsule is
refused at its header with no memory given to it; unauthenticated peers cannot keep a token
holder out; a shared step's rank that joins without hyperparameters is refused."""
from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from cossd.client import AdminClient
from cossd.protocol import wire
from cossd.protocol.entries import encode_submission
from cossd.protocol.status import DeviceError, Status
from cossd.protocol.wire import FabricsType, PduType
from cossd.server import command
from helpers import run_cli
from waiting import wait_until
from test_server import Served, start_server, token_file  # noqa: F401  (the fixture)
# The same server fixture and log-page reader as the bounds tests: one copy of each.
from test_server_bounds import MIB, figures, serve  # noqa: F401  (serve: the fixture)


def status_kib(pid: int, key: str) -> int:
    """A /proc/PID/status figure (VmHWM, VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key}")


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (EOF or reset), reading whatever it sent first;
    False where it is still open after the socket's timeout."""
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def announce_connect(port: int, data_bytes: int) -> socket.socket:
    """A peer that completes the ICReq, then sends a CONNECT's header announcing
    `data_bytes` of data, and none of the data."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(wire.ic_req(wire.Digest.NONE))
    reader = wire.PduReader(sock.recv_into)
    assert reader.read_head().type == PduType.IC_RESP
    submission = encode_submission(wire.FABRICS_OPCODE, cid=1, nsid=FabricsType.CONNECT)
    sock.sendall(wire.header(PduType.CAPSULE_CMD, 0, submission[:64], data_bytes, wire.Digest.NONE))
    return sock


# ---------------------------------------------------------------------- the handshake's deadline


def test_a_trickling_handshake_is_closed_at_its_deadline(serve: Any, token_file: Path) -> None:
    """Before: each recv had 10 s, so one byte every 0.4 s held the connection forever.
    Now the whole handshake has --handshake-deadline-s from the accept."""
    served = serve("--handshake-deadline-s", "1.5")
    icreq = wire.ic_req(wire.Digest.NONE)
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as trickler:
        trickler.settimeout(0.4)
        sent = 0
        closed = False
        # 40 bytes at 0.4 s each would take 16 s: far past the deadline, still short of an ICReq.
        while sent < 40 and not closed:
            try:
                trickler.sendall(icreq[sent : sent + 1])
                sent += 1
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            closed = closed_by_peer(trickler)
        held_s = time.monotonic() - started
    assert closed, f"the server still held a connection that sent {sent} bytes of its ICReq in {held_s:.1f} s"
    assert sent < len(icreq)
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        seen = figures(admin)
    assert seen["refused_handshake"] == 1 and seen["refused_total"] == 1
    assert seen["connections_total"] == 1  # only the token holder was let in
    # The connection's thread logs the refusal once the sweep's shutdown wakes it.
    wait_until(lambda: "no CONNECT within 1.5 s of its accept (--handshake-deadline-s)" in served.log(),
               timeout_s=10)


def test_a_connect_that_stops_half_way_is_closed_at_its_deadline(serve: Any) -> None:
    """The deadline covers the CONNECT too: a whole ICReq, then part of a CONNECT's token."""
    served = serve("--handshake-deadline-s", "1")
    with announce_connect(served.port, 40) as peer:
        peer.sendall(b"x" * 10)  # 30 bytes of the token never come
        peer.settimeout(8)
        assert closed_by_peer(peer)
    # The connection's own thread logs the refusal once the sweep's shutdown wakes it, which
    # may be just after the peer saw the close.
    wait_until(lambda: "no CONNECT within 1 s" in served.log(), timeout_s=10)


def test_bad_deadline_and_limit_options_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    command.add_serve_arguments(parser)
    for option, value, why in (("--handshake-deadline-s", "0", "must be > 0"),
                               ("--handshake-deadline-s", "soon", "not a number"),
                               ("--max-preauth-connections", "0", "must be >= 1")):
        with pytest.raises(SystemExit):
            parser.parse_args([str(tmp_path), option, value])
        assert why in capsys.readouterr().err


# ---------------------------------------------------------------------- pre-auth memory

PEERS = 48
ANNOUNCED = 16 * MIB
# What the server may add to its peak RSS while 48 peers announce 16 MiB CONNECTs: threads,
# sockets, Python's allocations. One 16 MiB buffer given to one of them would pass it alone.
PREAUTH_SLACK = 12 * MIB


def test_a_large_preauth_announcement_is_refused_without_allocation(serve: Any, token_file: Path) -> None:
    """Before: each announcement got a zeroed 16 MiB buffer (48 peers: +770 MiB, kept after
    they closed). Now a CONNECT may carry 8 KiB; more is refused at its header."""
    served = serve("--recv-memory", "32M")
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        admin.describe()
        baseline = status_kib(served.pid, "VmHWM")
        peers = [announce_connect(served.port, ANNOUNCED) for _ in range(PEERS)]
        try:
            for peer in peers:
                peer.settimeout(5)
                assert closed_by_peer(peer), "an oversized pre-auth announcement was left open"
        finally:
            for peer in peers:
                peer.close()
        grown = status_kib(served.pid, "VmHWM") - baseline
        seen = figures(admin)
    assert grown < PREAUTH_SLACK, f"the server's peak RSS grew {grown / MIB:.1f} MiB for {PEERS} announcements"
    assert seen["refused_framing"] == PEERS
    assert seen["recv_peak_bytes"] == 0 and seen["recv_held_bytes"] == 0
    assert f"a capsule announcing {ANNOUNCED} bytes of data before authentication; at most 8192" in served.log()


def test_large_capsule_data_after_authentication_is_counted_and_given_back(serve: Any, token_file: Path) -> None:
    """In-capsule data over 64 KiB is received into a mapping under --recv-memory (its peak
    shows it) and given back once answered; the command is served as before."""
    served = serve("--recv-memory", "32M")
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        # A namespace whose spec (the CREATE's in-capsule JSON) is over 64 KiB: many tensors.
        tensors = [[f"t{index:05d}_{'x' * 40}", 8] for index in range(2000)]
        admin.create_namespace({"name": "wide", "tensors": tensors})
        seen = figures(admin)
        assert seen["recv_peak_bytes"] > 64 << 10 and seen["recv_held_bytes"] == 0
        assert len(admin.describe()["namespaces"]) == 1


# ---------------------------------------------------------------------- pre-auth places


def test_preauth_peers_cannot_starve_an_authenticated_one(serve: Any, token_file: Path) -> None:
    """Before: a connection took a --max-connections place from its accept, so 8 silent peers
    over a limit of 2 refused every token holder. Now they hold pre-auth places only, and
    when those are all held the longest waiting is closed for a new connection."""
    served = serve("--max-connections", "2", "--max-preauth-connections", "4")
    icreq = wire.ic_req(wire.Digest.NONE)
    silent = []
    for _ in range(8):
        peer = socket.create_connection(("127.0.0.1", served.port), timeout=10)
        peer.sendall(icreq[:60])  # half an ICReq, then nothing
        silent.append(peer)
    try:
        with AdminClient(served.url, 10, token_file=token_file) as first, \
                AdminClient(served.url, 10, token_file=token_file) as second:
            assert first.describe()["namespaces"] == [] and second.describe()["namespaces"] == []
            # The authenticated places are the token holders': a third is refused as before.
            with pytest.raises(PermissionError, match="2 connections open"):
                AdminClient(served.url, 10, token_file=token_file)
            seen = figures(first)
        for peer in silent:
            peer.settimeout(0.2)
        closed = sum(closed_by_peer(peer) for peer in silent)
    finally:
        for peer in silent:
            peer.close()
    # 8 silent peers over 4 places: the 4 oldest closed by the 4 after them; the first token
    # holder finds the 4 places held and closes the 5th; the others find a place free.
    assert closed == 5
    assert seen["connections_total"] == 2 and seen["refused_busy"] == 1  # the third token holder
    # Logged by the evicted connection's thread, once the shutdown wakes it.
    wait_until(lambda: "waiting to authenticate (--max-preauth-connections)" in served.log(), timeout_s=10)


# ---------------------------------------------------------------------- a join without hyperparameters

JOB = {"job": 77, "ranks": 2}


def test_a_join_without_hyperparameters_is_refused(serve: Any, token_file: Path) -> None:
    """Before: a rank that sent no groups joined a step begun with them, unchecked. Now it is
    INVALID_FIELD and the step stays as it was (one rank joined); with the groups it joins."""
    served = serve()
    groups = [{"lr": 2e-3, "weight_decay": 0.0}]
    with AdminClient(served.url, 10, token_file=token_file) as admin:
        nsid = admin.create_namespace({"name": "j", "tensors": [["w", 64]]})
        opened = admin.begin_shared_step(nsid, 1, 1.0, seq=1, rank=0, groups=groups, **JOB)
        assert opened["opened"] and opened["joined"] == 1
        before = admin.statistics(nsid)
        with pytest.raises(DeviceError, match="rank 1 sent no hyperparameters") as refused:
            admin.begin_shared_step(nsid, 1, 1.0, seq=1, rank=1, **JOB)
        assert refused.value.status == Status.INVALID_FIELD
        assert admin.statistics(nsid) == before
        joined = admin.begin_shared_step(nsid, 1, 1.0, seq=1, rank=1, groups=groups, **JOB)
        assert joined["joined"] == 2 and not joined["opened"]


# ---------------------------------------------------------------------- what id-ctrl says of a server


def test_id_ctrl_over_a_server_says_why_there_is_no_cmb(serve: Any, token_file: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    served = serve()
    code, out, err = run_cli(capsys, "id-ctrl", served.url, "--token-file", token_file)
    assert code == 0, err
    assert "cmb       : none (a storage server: a client across the network cannot map one)" in out
    assert "--cmb-size" not in out
