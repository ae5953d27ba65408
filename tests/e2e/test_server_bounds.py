"""The storage server's bounds, on real servers and sockets: --max-connections refuses extra
connections at their CONNECT (CONNECT_CONTROLLER_BUSY, logged, counted); --recv-memory keeps
many clients' large WRITEs within one budget (the server's peak RSS, /proc/PID/status VmHWM,
stays under a stated bound), refuses what cannot fit with a clear status and changes nothing
on the device; idle connections give their buffers back; gradients streamed in bounded pieces
land bit for bit as the same gradients written in small WRITEs, whatever the PDU sizes."""
from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from cossd.client import AdminClient
from cossd.emulator import Device
from cossd.protocol import wire
from cossd.protocol.entries import encode_submission
from cossd.protocol.logpages import LogId, decode_server_log
from cossd.protocol.status import Status
from cossd.protocol.wire import FabricsType, PduType
from waiting import wait_until
from test_server import TOKEN, Served, in_process_server, start_server, token_file  # noqa: F401  (the fixture)

MIB = 1 << 20


@pytest.fixture
def serve(tmp_path: Path, token_file: Path) -> Iterator[Any]:
    started: list[Served] = []

    def start(*extra: str) -> Served:
        backing = tmp_path / f"srv{len(started)}"
        Device.format(backing, capacity_bytes=4 << 30)
        served = start_server(backing, ["--listen", "127.0.0.1:0", "--token-file", str(token_file), *extra])
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()


def figures(client: AdminClient) -> dict[str, int]:
    return decode_server_log(client.get_log_page(LogId.SERVER))


def vm_hwm(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def pattern(seed: int, nbytes: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def read_all(client: AdminClient, path: str, nbytes: int) -> bytes:
    handle = client.transport.open_file(path, False, False)
    out = bytearray(nbytes)
    count = client.transport.read_many([(handle, memoryview(out), 0)])[0]
    client.transport.close_file(handle)
    return bytes(out[:count])


# ---------------------------------------------------------------------- --max-connections


def _raw_connect(port: int) -> Status | int:
    """A CONNECT by hand: its completion's status."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        raw.sendall(wire.ic_req(wire.Digest.NONE))
        reader = wire.PduReader(raw.recv_into)
        assert reader.read_head().type == PduType.IC_RESP
        submission = encode_submission(wire.FABRICS_OPCODE, cid=1, nsid=FabricsType.CONNECT)
        raw.sendall(wire.header(PduType.CAPSULE_CMD, 0, submission[:64], len(TOKEN), wire.Digest.NONE) + TOKEN.encode())
        head = reader.read_head()
        while head.type == PduType.C2H_DATA:
            reader.read_data()
            head = reader.read_head()
        field = struct.unpack_from("<H", head.header, 14)[0]
        return Status.from_field((field >> 9) & 7, (field >> 1) & 0xFF)


def test_connections_over_the_limit_are_refused_at_connect(serve: Any, token_file: Path) -> None:
    served = serve("--max-connections", "2")
    first = AdminClient(served.url, 10, token_file=token_file)
    second = AdminClient(served.url, 10, token_file=token_file)
    try:
        with pytest.raises(PermissionError, match=r"2 connections open.*--max-connections"):
            AdminClient(served.url, 10, token_file=token_file)
        assert _raw_connect(served.port) == Status.CONNECT_CONTROLLER_BUSY
        seen = figures(first)
        assert seen["refused_busy"] == 2 and seen["refused_total"] == 2
        assert seen["connections_open"] == 2 and seen["max_connections"] == 2
        assert "(--max-connections); try again later" in served.log()
        second.close()
        wait_until(lambda: figures(first)["connections_open"] <= 1, 10)  # the server sees the close first
        with AdminClient(served.url, 10, token_file=token_file) as third:
            assert third.describe()["namespaces"] == []
        assert figures(first)["connections_total"] == 3
    finally:
        first.close()
        second.close()


# ---------------------------------------------------------------------- --recv-memory

NVM_BYTES = 24 * MIB  # each NVM client's WRITE (received whole: the atomic way)
GRAD_ELEMS = 3_000_000  # the gradient client's tensor: 6 MB a WRITE, streamed
BUDGET = 32 * MIB
# What the server may add to its peak RSS beyond the receive budget while the clients write:
# Python's own allocations, thread stacks, the kernels' per-thread block buffers, a few
# capsule buffers. Without the budget, seven connections would each keep a 24 MiB buffer
# (168 MiB), far above this.
SLACK = 40 * MIB
CLIENTS = 8
ROUNDS = 3


def test_many_large_writes_stay_within_the_receive_memory(serve: Any, token_file: Path) -> None:
    served = serve("--recv-memory", "32M", "--recv-wait-s", "60", "--max-connections", "16")
    with AdminClient(served.url, 120, token_file=token_file) as admin:
        for index in range(1, CLIENTS):
            admin.create_namespace({"name": f"v{index}", "kind": "nvm", "capacity_bytes": NVM_BYTES})
        nsid = admin.create_namespace({"name": "g", "tensors": [["w", GRAD_ELEMS]]})
        grads = np.full(GRAD_ELEMS, 0.01, np.float16).tobytes()
        # Warm up: a step and a write of each namespace, so their media is mapped and touched
        # before the baseline (the state copies count in RSS as they are mapped).
        handle = admin.transport.open_file("ns/g/tensors/w/grad", True, False)
        for _ in range(2):  # steps 1 and 2, implicit
            admin.transport.write_many([(handle, memoryview(grads), 0)])
        for index in range(1, CLIENTS):
            nvm = admin.transport.open_file(f"ns/v{index}/data", True, False)
            admin.transport.write_at(nvm, memoryview(bytes(4096)), 0)
            admin.transport.close_file(nvm)
        baseline = vm_hwm(served.pid)
        errors: list[BaseException] = []
        barrier = threading.Barrier(CLIENTS)
        clients = [AdminClient(served.url, 120, token_file=token_file) for _ in range(CLIENTS)]

        def writer(index: int) -> None:
            try:
                transport = clients[index].transport
                barrier.wait(30)
                if index == 0:  # gradients, streamed in bounded pieces
                    grad = transport.open_file("ns/g/tensors/w/grad", True, False)
                    for _ in range(ROUNDS):
                        transport.write_many([(grad, memoryview(grads), 0)])  # an implicit step each
                    return
                data = transport.open_file(f"ns/v{index}/data", True, False)
                for round_ in range(ROUNDS):
                    transport.write_many([(data, memoryview(pattern(100 * index + round_, NVM_BYTES)), 0)])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(index,)) for index in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not errors, errors
        peak = vm_hwm(served.pid)
        seen = figures(admin)
        # Every writer idle past IDLE_RELEASE_S, still connected: each connection lets its
        # buffers go at its next idle poll (a second or so; a loaded machine may take longer).
        def released() -> dict[str, int] | None:
            now = figures(admin)
            return now if now["recv_held_bytes"] == 0 and now["recv_idle_releases"] >= CLIENTS else None

        idle = wait_until(released) or figures(admin)
        try:
            assert peak - baseline <= BUDGET + SLACK, (peak - baseline) / MIB
            assert seen["recv_peak_bytes"] <= BUDGET
            assert seen["recv_waits"] >= 1  # seven 24 MiB WRITEs cannot all fit at once
            assert seen["recv_streamed_writes"] >= ROUNDS + 2
            assert seen["recv_refused_timeout"] == seen["recv_refused_too_large"] == 0
            assert idle["recv_held_bytes"] == 0 and idle["recv_idle_releases"] >= CLIENTS
            assert idle["connections_open"] == CLIENTS + 1
            for index in range(1, CLIENTS):  # every WRITE landed whole
                assert read_all(admin, f"ns/v{index}/data", NVM_BYTES) == pattern(100 * index + ROUNDS - 1, NVM_BYTES)
            assert admin.statistics(nsid)["committed_step"] == 2 + ROUNDS
        finally:
            for client in clients:
                client.close()
    print(f"\nserver VmHWM: {baseline / MIB:.0f} MiB before, {peak / MIB:.0f} MiB after {CLIENTS} clients x "
          f"{ROUNDS} WRITEs (7 x 24 MiB NVM, 1 x 6 MB gradients) with --recv-memory 32M "
          f"(+{(peak - baseline) / MIB:.0f} MiB; bound +{(BUDGET + SLACK) / MIB:.0f})")


def _stall(client: AdminClient, path: str, nbytes: int, sent: int) -> None:
    """Send a WRITE of `nbytes` to `path` but only `sent` bytes of its data, then nothing: the
    server holds receive memory for it until the socket closes."""
    transport = client.transport
    handle = transport.open_file(path, True, False)
    cid = 0x7777
    submission = encode_submission(wire.FABRICS_OPCODE, cid=cid, nsid=FabricsType.WRITE)
    transport.writer.send(PduType.CAPSULE_CMD, submission[:64], [wire.encode_transfers([(handle, 0, nbytes)])])
    transport.writer.send(PduType.H2C_DATA, wire.data_specific(cid, 0, 0, sent), [bytes(sent)])


def test_writes_that_do_not_fit_are_refused_and_change_nothing(serve: Any, token_file: Path) -> None:
    served = serve("--recv-memory", "32M", "--recv-wait-s", "0.5")
    with AdminClient(served.url, 60, token_file=token_file) as client:
        client.create_namespace({"name": "v", "kind": "nvm", "capacity_bytes": 48 * MIB})
        nsid = client.create_namespace({"name": "g", "tensors": [["w", GRAD_ELEMS]]})
        data = client.transport.open_file("ns/v/data", True, False)
        grad = client.transport.open_file("ns/g/tensors/w/grad", True, False)
        kept = pattern(1, 24 * MIB)
        client.transport.write_many([(data, memoryview(kept), 0)])
        expected = kept + bytes(24 * MIB)

        # Larger than the whole budget: refused at once (E2BIG), the connection goes on.
        with pytest.raises(OSError) as too_large:
            client.transport.write_many([(data, memoryview(pattern(2, 40 * MIB)), 0)])
        assert too_large.value.errno == errno.E2BIG and "--recv-memory" in str(too_large.value)
        assert "LIMIT_EXCEEDED" in str(too_large.value)
        assert read_all(client, "ns/v/data", 48 * MIB) == expected

        # Another connection holds 30 MiB (a WRITE it never finishes): a WRITE that fits the
        # budget but not what is left waits 0.5 s, then is refused (EAGAIN), nothing written;
        # so is a streamed gradient WRITE, and the open step has none of its gradients.
        client.begin_step(nsid, 1)
        staller = AdminClient(served.url, 60, token_file=token_file)
        try:
            _stall(staller, "ns/v/data", 30 * MIB, MIB)
            wait_until(lambda: figures(client)["recv_held_bytes"] >= 30 * MIB, 10)
            with pytest.raises(OSError) as timed_out:
                client.transport.write_many([(data, memoryview(pattern(3, 8 * MIB)), 0)])
            assert timed_out.value.errno == errno.EAGAIN, timed_out.value
            assert "COMMAND_INTERRUPTED" in str(timed_out.value) and "retry" in str(timed_out.value)
            with pytest.raises(OSError) as streamed:
                client.transport.write_many([(grad, memoryview(np.ones(GRAD_ELEMS, np.float16).tobytes()), 0)])
            assert streamed.value.errno == errno.EAGAIN
            statistics = client.statistics(nsid)
            assert statistics["grad_bytes_in"] == 0 and statistics["step_open"] == 1
        finally:
            staller.transport.sock.close()  # the stalled WRITE ends with its connection
            staller.close()
        assert read_all(client, "ns/v/data", 48 * MIB) == expected
        seen = figures(client)
        assert seen["recv_refused_too_large"] == 1 and seen["recv_refused_timeout"] == 2
        assert seen["recv_waits"] == 2
        # With the memory back, the same WRITEs go through.
        wait_until(lambda: figures(client)["recv_held_bytes"] < 30 * MIB, 10)
        client.transport.write_many([(data, memoryview(pattern(3, 8 * MIB)), 0)])
        client.transport.write_many([(grad, memoryview(np.ones(GRAD_ELEMS, np.float16).tobytes()), 0)])
        client.commit_step(nsid)  # the step begun above: all its gradients came in one WRITE
        assert client.statistics(nsid)["committed_step"] == 1
        assert read_all(client, "ns/v/data", 8 * MIB) == pattern(3, 8 * MIB)


# ---------------------------------------------------------------------- streamed pieces, bit for bit

TENSORS = [("w", 5_000_003), ("b", 5)]


def _odd_write(client: AdminClient, name: str, grads: dict[str, bytes], chunk: int) -> None:
    """One WRITE of every tensor's gradients, its data in H2CData PDUs of `chunk` bytes (odd:
    PDUs cut elements in two), as RemoteTransport would send it with another chunk size."""
    transport = client.transport
    handles = [transport.open_file(f"ns/{name}/tensors/{t}/grad", True, False) for t, _ in TENSORS]
    table = wire.encode_transfers([(h, 0, len(grads[t])) for h, (t, _) in zip(handles, TENSORS)])
    cid = 0x4242
    submission = encode_submission(wire.FABRICS_OPCODE, cid=cid, nsid=FabricsType.WRITE)
    transport.writer.send(PduType.CAPSULE_CMD, submission[:64], [table])
    transport.writer.send_data(PduType.H2C_DATA, cid, 0, [grads[t] for t, _ in TENSORS], chunk)
    completion = transport._answer(cid, [])
    assert completion.status == Status.SUCCESS, completion.data


@pytest.mark.parametrize("recv_memory", [32 * MIB, 1 << 30], ids=["one-slot", "two-slots"])
def test_streamed_pieces_land_bit_for_bit(tmp_path: Path, recv_memory: int) -> None:
    rng = np.random.default_rng(5)
    steps = [{t: rng.standard_normal(n).astype(np.float16).tobytes() for t, n in TENSORS} for _ in range(2)]
    with in_process_server(tmp_path / "b", recv_memory=recv_memory) as server:
        with AdminClient(f"cossd://127.0.0.1:{server.address[1]}?digest=both") as client:
            for name in ("s", "r"):
                client.create_namespace({"name": name, "tensors": [[t, n] for t, n in TENSORS],
                                         "hyperparameters": {"lr": 0.01, "weight_decay": 0.0}})
            for step, grads in enumerate(steps, 1):
                # "s": one WRITE in odd PDUs, streamed; "r": the same bytes in WRITEs under
                # 4 MiB, each received whole and taken at once (no streaming).
                _odd_write(client, "s", grads, 1_000_001 if step == 1 else 7_777_777)
                transport = client.transport
                for tensor, _ in TENSORS:
                    handle = transport.open_file(f"ns/r/tensors/{tensor}/grad", True, False)
                    data = memoryview(grads[tensor])
                    for start in range(0, len(data), 3 * MIB):
                        transport.write_at(handle, data[start : start + 3 * MIB], start)
                    transport.close_file(handle)
            assert client.statistics(client.nsid("s"))["committed_step"] == 2
            assert client.statistics(client.nsid("r"))["committed_step"] == 2
        memory = server.recv_memory.snapshot()
        assert memory["streamed_writes"] == 2 and memory["peak"] <= recv_memory
        for tensor, numel in TENSORS:
            for role in ("master", "exp_avg", "exp_avg_sq", "param"):
                size = numel * (2 if role == "param" else 4)
                ours = server.device.namespaces["s"].read(tensor, role, 0, size)
                assert ours == server.device.namespaces["r"].read(tensor, role, 0, size), (tensor, role)


def test_recv_memory_option_is_checked(tmp_path: Path, token_file: Path) -> None:
    """Bad sizes are refused by the option parser with one line; nothing starts."""
    import subprocess
    import sys

    Device.format(tmp_path / "d", capacity_bytes=1 << 30)
    for option, value, said in (("--recv-memory", "1M", "at least 32M"), ("--recv-memory", "lots", "not a size"),
                                ("--max-connections", "-1", "must be >= 0"), ("--recv-wait-s", "0", "must be > 0")):
        result = subprocess.run([sys.executable, "-m", "cossd.server.command", str(tmp_path / "d"),
                                 "--token-file", str(token_file), option, value],
                                capture_output=True, text=True, timeout=60, env=os.environ | {"PYTHONPATH": ""})
        assert result.returncode == 2 and said in result.stderr, (option, value, result.stderr)
    assert not (tmp_path / "d" / "server.log").exists()
