"""Server tier: the storage server (`cossd serve`) on loopback, real processes and sockets:
every command's status as through a mount, the hidden-size end-to-end check bit for bit,
kill -9 mid-step, a client gone mid-step, refused credentials, DeviceLostError and timeouts."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from conftest import Mount
from waiting import wait_until
from cossd.client import AdminClient, DeviceTimeoutError, RemoteTransport
from cossd.emulator import Device
from cossd.emulator.kinds import spec_from_payload
from cossd.protocol import wire
from cossd.protocol.entries import NSID_ALL, Opcode, encode_submission
from cossd.protocol.status import DeviceError, Status
from cossd.server import command

pytestmark = pytest.mark.mount

TOKEN = "c0ssd-test-token-0123456789abcdef"


# ---------------------------------------------------------------------- fixtures


@dataclasses.dataclass
class Served:
    """A storage server process serving `backing` at `url`."""

    backing: Path
    url: str
    pid: int
    options: list[str]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def log(self) -> str:
        path = self.backing / "server.log"
        return path.read_text() if path.exists() else ""

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        _reap(self.pid)

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        if not _reap(self.pid, 30):
            os.kill(self.pid, signal.SIGKILL)
            _reap(self.pid)

    def restart(self) -> None:
        """Start again on the same port (a restarted server, as a client would find it)."""
        started = start_server(self.backing, [o if o != "127.0.0.1:0" else f"127.0.0.1:{self.port}"
                                              for o in self.options])
        self.pid, self.url = started.pid, started.url


def _reap(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            if not Path(f"/proc/{pid}").exists():
                return True
        time.sleep(0.01)
    return False


def start_server(backing: Path, options: list[str]) -> Served:
    parser = argparse.ArgumentParser()
    command.add_serve_arguments(parser)
    args = parser.parse_args([str(backing), *options])
    pid, url = command.start_background(args)
    return Served(backing, url, pid, options)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def serve(tmp_path: Path, token_file: Path) -> Iterator[Callable[..., Served]]:
    """Starts servers of fresh devices (token, lease 1 s), always stopped after the test."""
    started: list[Served] = []

    def start(*extra: str, name: str = "srv") -> Served:
        backing = tmp_path / name
        Device.format(backing, capacity_bytes=4 << 30, serial="TESTSERIAL0001")
        served = start_server(backing, ["--listen", "127.0.0.1:0", "--token-file", str(token_file),
                                        "--lease-s", "1", *extra])
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()


@pytest.fixture
def served(serve: Callable[..., Served]) -> Served:
    return serve()


def remote(served: Served, token_file: Path, timeout_s: float = 10.0) -> AdminClient:
    return AdminClient(served.url, timeout_s, token_file=token_file)


# ---------------------------------------------------------------------- every command, same status


def _log_page(lid: int) -> dict[str, int]:
    return {"cdw10": lid | 0xFFFF << 16, "cdw11": 0xFFFF}


# Commands whose completion data must match byte for byte too (the others carry times,
# paths or pids that differ between two devices).
SAME_DATA = ("identify bad cns", "create again", "create bad json", "identify active list", "begin again",
             "commit incomplete", "begin wrong step", "begin on nvm", "set unknown hyperparameter",
             "statistics injected", "invalid opcode", "delete again", "log page 0x01 after", "log page 0x5")


def admin_sequence(client: AdminClient) -> list[tuple[str, int, int, bytes]]:
    """The same commands in the same order: (what, status, result, data) of each."""
    out: list[tuple[str, int, int, bytes]] = []

    def run(label: str, opcode: int, payload: Any = b"", **fields: int) -> None:
        if not isinstance(payload, bytes):
            payload = json.dumps(payload).encode()
        completion = client.submit(opcode, payload=payload, **fields)
        out.append((label, int(completion.status), completion.result,
                    completion.data if label in SAME_DATA else b""))

    model = {"name": "t", "tensors": [["x", 1000], ["y", 10]]}
    run("identify controller", Opcode.IDENTIFY, cdw10=1)
    run("identify bad cns", Opcode.IDENTIFY, cdw10=0x55)
    run("vendor identify", Opcode.VENDOR_IDENTIFY)
    run("create", Opcode.CREATE_NAMESPACE, model)
    run("create again", Opcode.CREATE_NAMESPACE, model)
    run("create bad name", Opcode.CREATE_NAMESPACE, {"name": "../x", "tensors": [["x", 8]]})
    run("create bad json", Opcode.CREATE_NAMESPACE, b"{")
    run("create nvm", Opcode.CREATE_NAMESPACE, {"name": "v", "kind": "nvm", "capacity_bytes": 1 << 20})
    run("identify ns", Opcode.IDENTIFY, nsid=1, cdw10=0)
    run("identify missing ns", Opcode.IDENTIFY, nsid=77, cdw10=0)
    run("identify active list", Opcode.IDENTIFY, cdw10=2)
    for lid in (0x01, 0x02, 0x05, 0xC0, 0x77):
        run(f"log page {lid:#x}", Opcode.GET_LOG_PAGE, nsid=NSID_ALL, **_log_page(lid))
    run("smart of a namespace", Opcode.GET_LOG_PAGE, nsid=1, **_log_page(0x02))
    run("begin", Opcode.BEGIN_STEP, nsid=1, cdw10=1)
    run("begin again", Opcode.BEGIN_STEP, nsid=1)
    run("commit incomplete", Opcode.COMMIT_STEP, nsid=1)
    run("abort", Opcode.ABORT_STEP, nsid=1)
    run("commit none open", Opcode.COMMIT_STEP, nsid=1)
    run("abort none open", Opcode.ABORT_STEP, nsid=1)
    run("begin wrong step", Opcode.BEGIN_STEP, nsid=1, cdw10=5)
    run("begin on nvm", Opcode.BEGIN_STEP, nsid=2)
    run("set hyperparameters", Opcode.SET_HYPERPARAMETERS, {"lr": 0.01}, nsid=1)
    run("set unknown hyperparameter", Opcode.SET_HYPERPARAMETERS, {"zz": 1}, nsid=1)
    run("statistics", Opcode.NAMESPACE_STATISTICS, nsid=1)
    run("statistics missing", Opcode.NAMESPACE_STATISTICS, nsid=9)
    run("flush", Opcode.FLUSH, nsid=1)
    run("flush all", Opcode.FLUSH, nsid=NSID_ALL)
    run("scrub", Opcode.SCRUB, nsid=NSID_ALL)
    run("scrub nvm", Opcode.SCRUB, nsid=2)
    run("snapshot create", Opcode.SNAPSHOT_CREATE, {"tag": "s1"}, nsid=1)
    run("snapshot create again", Opcode.SNAPSHOT_CREATE, {"tag": "s1"}, nsid=1)
    run("snapshot delete missing", Opcode.SNAPSHOT_DELETE, {"tag": "nope"}, nsid=1)
    run("snapshot delete", Opcode.SNAPSHOT_DELETE, {"tag": "s1"}, nsid=1)
    for fid in (0x04, 0x07, 0xC0, 0xC1, 0x55):
        run(f"get features {fid:#x}", Opcode.GET_FEATURES, cdw10=fid)
    run("inject arm", Opcode.INJECT_ERROR, {"opcode": int(Opcode.NAMESPACE_STATISTICS), "status": "WRITE_FAULT"})
    run("statistics injected", Opcode.NAMESPACE_STATISTICS, nsid=1)
    run("invalid opcode", 0x7E)
    run("delete", Opcode.DELETE_NAMESPACE, nsid=1)
    run("delete again", Opcode.DELETE_NAMESPACE, nsid=1)
    run("log page 0x01 after", Opcode.GET_LOG_PAGE, nsid=NSID_ALL, **_log_page(0x01))
    return out


def file_sequence(client: AdminClient) -> list[tuple[str, int]]:
    """File operations as a trainer makes them, each one's errno (0: it worked)."""
    transport = client.transport
    client.create_namespace({"name": "f", "tensors": [["x", 1000]]})
    out: list[tuple[str, int]] = []

    def run(label: str, action: Callable[[], object]) -> None:
        try:
            action()
            out.append((label, 0))
        except OSError as exc:
            out.append((label, exc.errno or -1))

    root = "ns/f/tensors/x"
    run("open missing namespace", lambda: transport.open_file("ns/nope/tensors/x/grad", True, False))
    run("open missing tensor", lambda: transport.open_file("ns/f/tensors/nope/grad", True, False))
    run("open grad for reading", lambda: transport.open_file(f"{root}/grad", False, False))
    run("open param for writing", lambda: transport.open_file(f"{root}/param", True, False))
    master = transport.open_file(f"{root}/master", True, False)
    run("misaligned master", lambda: transport.write_at(master, memoryview(b"\0" * 6), 0))
    run("master", lambda: transport.write_at(master, memoryview(np.ones(1000, np.float32).tobytes()), 0))
    grad = transport.open_file(f"{root}/grad", True, False)
    half = np.full(500, 0.5, np.float16).tobytes()
    run("misaligned grad", lambda: transport.write_at(grad, memoryview(b"\0" * 3), 0))
    run("grad past end", lambda: transport.write_at(grad, memoryview(b"\0" * 4), 1998))
    run("grad half", lambda: transport.write_at(grad, memoryview(half), 0))
    run("grad duplicate", lambda: transport.write_at(grad, memoryview(half), 0))
    run("grad rest (commits)", lambda: transport.write_at(grad, memoryview(half), 1000))
    run("open master after seal", lambda: transport.open_file(f"{root}/master", True, False))
    run("write master after seal", lambda: transport.write_at(master, memoryview(b"\0" * 4), 0))
    param = transport.open_file(f"{root}/param", False, False)
    buffer = memoryview(bytearray(4096))
    run("read param", lambda: transport.read_at(param, buffer, 0))
    out.append(("read past end", transport.read_at(param, buffer, 1998)))
    client.call(Opcode.INJECT_ERROR, payload=json.dumps(
        {"opcode": 2, "queue": "io", "status": "WRITE_FAULT"}).encode())
    run("read injected", lambda: transport.read_at(param, buffer, 0))
    run("text step", lambda: transport.read_text("ns/f/step"))
    out.append(("step text", int(transport.read_text("ns/f/step"))))
    run("text missing", lambda: transport.read_text("ns/f/nope.json"))
    out.append(("config", transport.read_text("ns/f/config.json") == json.dumps(
        json.loads(transport.read_text("ns/f/config.json")), indent=2) + "\n"))
    for handle in (master, grad, param):  # an open file would hold a mount past its unmount
        transport.close_file(handle)
    return out


def test_every_command_and_file_operation_as_through_a_mount(mount: Mount, served: Served,
                                                               token_file: Path) -> None:
    with AdminClient(mount.mountpoint) as local, remote(served, token_file) as far:
        assert admin_sequence(far) == admin_sequence(local)
        assert file_sequence(far) == file_sequence(local)
    assert "Traceback" not in served.log()


# ---------------------------------------------------------------------- hidden sizes, bit for bit

# "big": a batch of more than one 8 MiB PDU, so the server stages it as it arrives.
HIDDEN = [("scalar", 1), ("odd", 1_000_003), ("block_plus", 262_145), ("tiny", 17), ("big", 3_000_001)]
ROLES = ("master", "exp_avg", "exp_avg_sq", "param")


def train_hidden(client: AdminClient) -> dict[str, bytes]:
    """Masters, then implicit steps of shuffled odd-sized chunks (one with an overflow, so
    skipped), then explicit steps with all gradients in one batch where the transport has
    one; every state file's bytes."""
    transport = client.transport
    nsid = client.create_namespace({"name": "hid", "tensors": [[t, n] for t, n in HIDDEN],
                                    "hyperparameters": {"lr": 1e-3, "weight_decay": 0.01}})
    rng = np.random.default_rng(5)
    for tensor, numel in HIDDEN:
        handle = transport.open_file(f"ns/hid/tensors/{tensor}/master", True, False)
        transport.write_at(handle, memoryview(rng.standard_normal(numel, dtype=np.float32).tobytes()), 0)
        transport.close_file(handle)
    grads = {t: transport.open_file(f"ns/hid/tensors/{t}/grad", True, False) for t, _ in HIDDEN}
    for step in range(1, 6):
        pieces = []
        for tensor, numel in HIDDEN:
            values = (rng.standard_normal(numel) * 0.01).astype(np.float16)
            if step == 3 and tensor == "odd":
                values[123_457] = np.inf
            raw = values.tobytes()
            pieces += [(grads[tensor], memoryview(raw)[at : at + 65538], at) for at in range(0, len(raw), 65538)]
        random.Random(step).shuffle(pieces)
        if step <= 3:  # implicit: the write of the last piece commits (or skips)
            for handle, data, at in pieces:
                assert transport.write_at(handle, data, at) == len(data)
        else:
            client.begin_step(nsid, step - 1)
            many = getattr(transport, "write_many", None)
            if many is not None:
                many(pieces)
            else:
                for handle, data, at in pieces:
                    transport.write_at(handle, data, at)
            client.commit_step(nsid)
    stats = client.statistics(nsid)
    assert stats["committed_step"] == 4 and stats["steps_skipped"] == 1, stats
    state = {}
    for tensor, numel in HIDDEN:
        for role in ROLES:
            handle = transport.open_file(f"ns/hid/tensors/{tensor}/{role}", False, False)
            buffer = bytearray(numel * 4)
            count = transport.read_at(handle, memoryview(buffer), 0)
            state[f"{tensor}/{role}"] = bytes(buffer[:count])
            transport.close_file(handle)
    for handle in grads.values():
        transport.close_file(handle)
    return state


def test_hidden_sizes_bit_for_bit_as_through_a_mount(mount: Mount, served: Served, token_file: Path) -> None:
    with AdminClient(mount.mountpoint) as local, remote(served, token_file) as far:
        expected = train_hidden(local)
        assert train_hidden(far) == expected
    assert all(len(expected[f"{t}/master"]) == 4 * n for t, n in HIDDEN)


# ---------------------------------------------------------------------- kill -9 mid-step

# More than STREAM_MIN_BYTES of gradients: a step sent in one WRITE is staged as it arrives.
KILL_TENSORS = [("a", 2_100_001), ("b", 262_144), ("c", 33)]


def _grads(step: int) -> dict[str, bytes]:
    rng = np.random.default_rng(1000 + step)
    return {t: (rng.standard_normal(n) * 0.01).astype(np.float16).tobytes() for t, n in KILL_TENSORS}


def _masters() -> dict[str, bytes]:
    rng = np.random.default_rng(9)
    return {t: rng.standard_normal(n, dtype=np.float32).tobytes() for t, n in KILL_TENSORS}


KILL_MODEL = {"name": "k", "tensors": [[t, n] for t, n in KILL_TENSORS]}


def _reference(tmp_path: Path, steps: int) -> list[dict[str, bytes]]:
    """The state after 0..steps steps, computed by the emulator in this process."""
    Device.format(tmp_path / "ref", capacity_bytes=1 << 30, serial="REF")
    states = []
    with Device.open(tmp_path / "ref") as device:
        namespace = device.create_namespace(spec_from_payload(KILL_MODEL))
        for tensor, data in _masters().items():
            namespace.write_state(tensor, "master", 0, data)
        for step in range(steps + 1):
            if step:
                namespace.begin_step(step, 1.0)
                for tensor, data in _grads(step).items():
                    namespace.write_grad(tensor, 0, data)
                namespace.commit_step()
            states.append({f"{t}/{r}": namespace.read(t, r, 0, n * 4) for t, n in KILL_TENSORS for r in ROLES})
    return states


def _state(client: AdminClient) -> dict[str, bytes]:
    transport = client.transport
    state = {}
    for tensor, numel in KILL_TENSORS:
        for role in ROLES:
            handle = transport.open_file(f"ns/k/tensors/{tensor}/{role}", False, False)
            buffer = bytearray(numel * 4)
            state[f"{tensor}/{role}"] = bytes(buffer[: transport.read_at(handle, memoryview(buffer), 0)])
            transport.close_file(handle)
    return state


def _step(client: AdminClient, nsid: int, step: int, acknowledged: list[int], batched: bool = False) -> None:
    transport = client.transport
    handles = {t: transport.open_file(f"ns/k/tensors/{t}/grad", True, False) for t, _ in KILL_TENSORS}
    client.begin_step(nsid, step)
    pieces = [(handles[t], memoryview(raw)[at : at + 262144], at)
              for t, raw in _grads(step).items() for at in range(0, len(raw), 262144)]
    random.Random(step).shuffle(pieces)
    if batched:  # one WRITE of every piece, staged as its PDUs arrive
        transport.write_many(pieces)
    else:
        for piece in pieces:  # many commands: the kill lands between or inside them
            transport.write_many([piece])
    client.commit_step(nsid)
    acknowledged.append(step)


def run_kill_trials(serve: Callable[..., Served], token_file: Path, tmp_path: Path, figures: list[str],
                    trials: int) -> None:
    """kill -9 of the server at a random instant of a step (gradients in flight, or the
    commit), then a restart: the step recovered is N or N+1, never torn (every state file
    as a reference replay has it), never an acknowledged one lost."""
    references = _reference(tmp_path, trials + 1)
    served = serve()
    with remote(served, token_file) as client:
        nsid = client.create_namespace(KILL_MODEL)
        for tensor, data in _masters().items():
            handle = client.transport.open_file(f"ns/k/tensors/{tensor}/master", True, False)
            client.transport.write_at(handle, memoryview(data), 0)
        started = time.monotonic()
        _step(client, nsid, 1, [])  # one step untouched: how long a step takes
        duration = time.monotonic() - started
    rng = random.Random(4)
    outcomes = {"N": 0, "N+1": 0}
    lost_errors = 0
    for trial in range(trials):
        client = remote(served, token_file, timeout_s=5.0)
        before = client.statistics(nsid)["committed_step"]
        acknowledged: list[int] = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                _step(client, nsid, before + 1, acknowledged, batched=trial % 2 == 1)
            except BaseException as exc:  # noqa: BLE001 - examined below
                failure.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(rng.uniform(0.0, 1.2 * duration))
        killed_at = time.monotonic()
        served.kill()
        thread.join(10)
        assert not thread.is_alive(), "the client hung after the server was killed"
        if failure:
            assert isinstance(failure[0], ConnectionAbortedError), failure[0]
            assert failure[0].errno == errno.ECONNABORTED
            assert time.monotonic() - killed_at < 5.0
            lost_errors += 1
        client.close()
        served.restart()
        with remote(served, token_file) as after:
            committed = after.statistics(nsid)["committed_step"]
            assert committed in (before, before + 1), (before, committed)  # 0 torn
            assert not acknowledged or committed == before + 1  # 0 lost
            assert _state(after) == references[committed], committed
        outcomes["N" if committed == before else "N+1"] += 1
    figures.append(f"server kill -9 mid-step: {trials} trials, 0 torn, 0 lost; recovered N: {outcomes['N']}, "
                   f"N+1: {outcomes['N+1']}; {lost_errors} clients got ECONNABORTED (DeviceLostError)")


@pytest.mark.torture
def test_kill_9_mid_step(serve: Callable[..., Served], token_file: Path, tmp_path: Path,
                         figures: list[str]) -> None:
    run_kill_trials(serve, token_file, tmp_path, figures, trials=8)


@pytest.mark.slow
def test_kill_9_mid_step_many(serve: Callable[..., Served], token_file: Path, tmp_path: Path,
                              figures: list[str]) -> None:
    run_kill_trials(serve, token_file, tmp_path, figures, trials=60)


# ---------------------------------------------------------------------- a client gone mid-step


# A lease long enough that a loaded machine's stalls cannot end it before the test looks.
LEASE_S = 3.0


def test_client_gone_mid_step_is_aborted_after_the_lease(serve: Callable[..., Served], token_file: Path) -> None:
    served = serve("--lease-s", str(LEASE_S))
    with remote(served, token_file) as watcher:
        gone = remote(served, token_file)
        nsid = gone.create_namespace({"name": "g", "tensors": [["x", 1000]]})
        gone.begin_step(nsid, 1)
        handle = gone.transport.open_file("ns/g/tensors/x/grad", True, False)
        gone.transport.write_at(handle, memoryview(np.ones(500, np.float16).tobytes()), 0)
        gone.close()  # the socket closes with the step open
        time.sleep(0.3)
        assert watcher.statistics(nsid)["step_open"] == 1  # held for the lease
        wait_until(lambda: watcher.statistics(nsid)["step_open"] is None, LEASE_S + 15)
        stats = watcher.statistics(nsid)
        assert stats["step_open"] is None and stats["committed_step"] == 0
        # The step is gone: a new one starts clean, at the same number.
        assert watcher.begin_step(nsid, 1) == 1
    assert wait_until(lambda: "step aborted" in served.log(), 10), served.log()  # logged after the abort


def test_a_client_that_comes_back_within_the_lease_keeps_its_step(serve: Callable[..., Served],
                                                                  token_file: Path) -> None:
    served = serve("--lease-s", str(LEASE_S))
    first = remote(served, token_file)
    nsid = first.create_namespace({"name": "r", "tensors": [["x", 1000]]})
    first.begin_step(nsid, 1)
    first.transport.write_at(first.transport.open_file("ns/r/tensors/x/grad", True, False),
                             memoryview(np.ones(500, np.float16).tobytes()), 0)
    first.close()
    with remote(served, token_file) as second:
        handle = second.transport.open_file("ns/r/tensors/x/grad", True, False)
        second.transport.write_at(handle, memoryview(np.ones(500, np.float16).tobytes()), 1000)
        time.sleep(LEASE_S + 0.5)  # past the lease: continued by the second client, not aborted
        assert second.commit_step(nsid)["committed_step"] == 1
    assert "step 1, left open by a client that went away, goes on with a new connection's gradients" in served.log()


def test_a_leased_step_aborted_by_a_new_client_is_logged_as_aborted(serve: Callable[..., Served],
                                                                    token_file: Path) -> None:
    """The trainer, reopening a namespace with a step left open, aborts it and says so; the
    server's log says the same word (before: "taken over" once the new step's gradients came)."""
    served = serve("--lease-s", "30")
    first = remote(served, token_file)
    nsid = first.create_namespace({"name": "a", "tensors": [["x", 1000]]})
    first.begin_step(nsid, 1)
    first.close()
    with remote(served, token_file) as second:
        wait_until(lambda: "went away with step 1" in served.log(), 10)
        second.abort_step(nsid)
        assert second.begin_step(nsid, 1) == 1  # a new step of the same number
        handle = second.transport.open_file("ns/a/tensors/x/grad", True, False)
        second.transport.write_at(handle, memoryview(np.ones(1000, np.float16).tobytes()), 0)
        assert second.commit_step(nsid)["committed_step"] == 1
    log = served.log()
    assert "step 1, left open by a client that went away, aborted by a new connection" in log
    assert "taken over" not in log and "goes on with" not in log


# ---------------------------------------------------------------------- refused, nothing changed


def _device_state(client: AdminClient) -> tuple[Any, ...]:
    return (client.optimizer_log(), client.error_log(), client.describe()["namespaces"])


def _refusals(served: Served) -> int:
    return served.log().count(" refused ")


def _wait_refusals(served: Served, count: int) -> None:
    wait_until(lambda: _refusals(served) >= count, 5)
    assert _refusals(served) == count, served.log()


def test_wrong_missing_token_and_garbage_are_refused_and_change_nothing(
        served: Served, token_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COSSD_TOKEN_FILE", raising=False)
    with remote(served, token_file) as client:
        client.create_namespace({"name": "keep", "tensors": [["x", 100]]})
        before = _device_state(client)
        wrong = tmp_path / "wrong"
        wrong.write_text("not-the-token-at-all-0000")
        with pytest.raises(PermissionError, match="wrong token"):
            AdminClient(served.url, 5, token_file=wrong)
        with pytest.raises(PermissionError, match="no token"):
            AdminClient(served.url, 5)
        monkeypatch.setenv("COSSD_TOKEN_FILE", str(token_file))  # the environment's token works
        AdminClient(served.url, 5).close()
        # Garbage instead of an ICReq: a C2HTermReq, then the connection closes.
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as raw:
            raw.sendall(os.urandom(300))
            answer = raw.recv(64)
            assert answer[:1] == bytes([wire.PduType.C2H_TERM_REQ])
            try:  # closed; with the garbage unread, the kernel resets rather than ends it
                assert raw.recv(64) == b""
            except ConnectionResetError:
                pass
        # A well-framed delete before the connect: refused, the namespace stays.
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as raw:
            raw.sendall(wire.ic_req(wire.Digest.NONE))
            reader = wire.PduReader(raw.recv_into)
            assert reader.read_head().type == wire.PduType.IC_RESP
            submission = encode_submission(Opcode.DELETE_NAMESPACE, cid=1, nsid=1)
            raw.sendall(wire.header(wire.PduType.CAPSULE_CMD, 0, submission, 0, wire.Digest.NONE))
            head = reader.read_head()
            while head.type == wire.PduType.C2H_DATA:
                reader.read_data()
                head = reader.read_head()
            status_field = struct.unpack_from("<H", head.header, 14)[0]
            assert Status.from_field((status_field >> 9) & 7, (status_field >> 1) & 0xFF) == \
                Status.CONNECT_INVALID_HOST
        _wait_refusals(served, 4)
        assert _device_state(client) == before


def _certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by it."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=cossd test CA")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=cossd {name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "1", *(["-extfile", "san.ext"] if name == "server" else []))
    return {name: directory / name for name in
            ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_tls_and_mutual_tls(serve: Callable[..., Served], token_file: Path, tmp_path: Path) -> None:
    (tmp_path / "pki").mkdir()
    pki = _certificates(tmp_path / "pki")
    served = serve("--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"]),
                   "--client-ca", str(pki["ca.pem"]), name="tls")
    ca, cert, key = pki["ca.pem"], pki["client.pem"], pki["client.key"]
    transport = RemoteTransport(served.url, 5, token_file=token_file, ca=ca, cert=cert, key=key)
    with AdminClient(transport) as client:
        client.create_namespace({"name": "tls", "tensors": [["x", 100]]})
        before = _device_state(client)
        with pytest.raises(ConnectionRefusedError):  # plain TCP to a TLS server
            AdminClient(served.url, 5, token_file=token_file)
        with pytest.raises(PermissionError, match="TLS"):  # TLS without a client certificate
            AdminClient(served.url, 5, token_file=token_file, ca=ca)
        _wait_refusals(served, 2)
        assert _device_state(client) == before


def test_the_optimizer_takes_its_credentials_as_arguments(serve: Callable[..., Served], token_file: Path,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AdamW(token_file=, ca=, cert=, key=) reaches a mutual-TLS server with no environment
    variable set, and keeps them for the namespaces it opens later (rebind); without the
    token it is refused at connect."""
    import torch

    from cossd.trainer import AdamW

    for variable in ("COSSD_TOKEN_FILE", "COSSD_CA", "COSSD_CLIENT_CERT", "COSSD_CLIENT_KEY"):
        monkeypatch.delenv(variable, raising=False)
    (tmp_path / "pki").mkdir()
    pki = _certificates(tmp_path / "pki")
    served = serve("--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"]),
                   "--client-ca", str(pki["ca.pem"]), name="creds")
    credentials = {"ca": pki["ca.pem"], "cert": pki["client.pem"], "key": pki["client.key"]}
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    with pytest.raises(PermissionError):
        AdamW(model.parameters(), mount=served.url, namespace="creds", timeout_s=5, **credentials)
    optimizer = AdamW(model.parameters(), mount=served.url, namespace="creds", timeout_s=5,
                      token_file=token_file, **credentials)
    try:
        model(torch.ones(2, 5, dtype=torch.bfloat16)).float().sum().backward()
        optimizer.step()
        assert optimizer.committed_step == 1
        assert optimizer.files.credentials is not None and optimizer.files.credentials.token_file == token_file
    finally:
        optimizer.close()

def test_serve_refuses_unsafe_configurations(tmp_path: Path, token_file: Path) -> None:
    Device.format(tmp_path / "b", capacity_bytes=1 << 30)
    run = lambda *options: subprocess.run(  # noqa: E731
        [os.sys.executable, "-m", "cossd.server.command", str(tmp_path / "b"), *options],
        capture_output=True, text=True, timeout=60)
    result = run("--listen", "0.0.0.0:0", "--token-file", str(token_file))
    assert result.returncode != 0 and "without TLS" in result.stderr
    result = run("--listen", "127.0.0.1:0")
    assert result.returncode != 0 and "--insecure" in result.stderr
    token_file.chmod(0o644)
    result = run("--listen", "127.0.0.1:0", "--token-file", str(token_file))
    assert result.returncode != 0 and "readable by every user" in result.stderr


# ---------------------------------------------------------------------- a server gone, a server stopped


def test_kill_9_gives_device_lost_error_within_the_timeout(served: Served, token_file: Path) -> None:
    from cossd.trainer import DeviceLostError
    from cossd.trainer.namespace.files import NamespaceFiles

    os.environ["COSSD_TOKEN_FILE"] = str(token_file)
    try:
        files = NamespaceFiles(served.url, "lost", timeout_s=5.0)
    finally:
        del os.environ["COSSD_TOKEN_FILE"]
    files.create({"name": "lost", "tensors": [["x", 100]]})
    served.kill()
    started = time.monotonic()
    with pytest.raises(DeviceLostError):
        files.statistics()
    assert time.monotonic() - started < 5.0
    files.close()


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of `pid` is stopped (state T in /proc), as SIGSTOP leaves them."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, IndexError):
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"server {pid} not stopped: {states}"
        time.sleep(0.01)


def test_a_stopped_server_is_a_timeout(served: Served, token_file: Path) -> None:
    with remote(served, token_file, timeout_s=1.0) as client:
        client.describe()
        os.kill(served.pid, signal.SIGSTOP)
        try:
            _wait_stopped(served.pid)  # every thread: a reply under way could still go out
            started = time.monotonic()
            with pytest.raises(DeviceTimeoutError):
                client.describe()
            assert 0.9 < time.monotonic() - started < 10.0  # its bound, not a hang (slack for a loaded machine)
            with pytest.raises(DeviceTimeoutError):  # the stream's place is lost: at once
                client.describe()
        finally:
            os.kill(served.pid, signal.SIGCONT)


# ---------------------------------------------------------------------- digests


def test_data_digests_catch_a_corrupted_pdu_and_the_connection_goes_on(served: Served, token_file: Path) -> None:
    transport = RemoteTransport(f"{served.url}?digest=both", 10, token_file=token_file)
    assert transport.digests == wire.Digest.HEADER | wire.Digest.DATA
    with AdminClient(transport) as client:
        nsid = client.create_namespace({"name": "d", "tensors": [["x", 1000]]})
        grad = transport.open_file("ns/d/tensors/x/grad", True, False)
        data = np.ones(1000, np.float16).tobytes()
        # A WRITE whose H2CData digest is wrong: refused as a whole, nothing staged.
        submission = encode_submission(wire.FABRICS_OPCODE, cid=900, nsid=wire.FabricsType.WRITE)
        transport.writer.send(wire.PduType.CAPSULE_CMD, submission, [wire.encode_transfers([(grad, 0, len(data))])])
        head = wire.header(wire.PduType.H2C_DATA, wire.PduFlags.LAST_PDU, wire.data_specific(900, 0, 0, len(data)),
                           len(data), transport.digests)
        transport.writer.send_raw(head + data + struct.pack("<I", wire.crc32c(data) ^ 1))
        completion = transport._answer(900, [])
        assert completion.status == Status.DATA_TRANSFER_ERROR
        assert client.statistics(nsid)["step_open"] is None  # nothing reached the device
        assert transport.write_at(grad, memoryview(data), 0) == len(data)  # the same connection goes on
        assert client.statistics(nsid)["committed_step"] == 1
        param = transport.open_file("ns/d/tensors/x/param", False, False)
        buffer = bytearray(2000)
        assert transport.read_at(param, memoryview(buffer), 0) == 2000


# ---------------------------------------------------------------------- the optimizer through a server


def _train_adamw(mount: str | Path, monkeypatch: pytest.MonkeyPatch, token_file: Path) -> tuple[list, list, int]:
    """Odd-sized layers, five iterations under GradScaler with an overflow at the third
    (skipped on the device): the params' bits, the masters' bits and the committed step."""
    import torch

    from cossd.trainer import AdamW

    monkeypatch.setenv("COSSD_TOKEN_FILE", str(token_file))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(61, 333), torch.nn.Tanh(), torch.nn.Linear(333, 7)).to(torch.float16)
    optimizer = AdamW(model.parameters(), mount=mount, namespace="net", lr=1e-3, weight_decay=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    try:
        for iteration in range(1, 6):
            optimizer.zero_grad()
            x = torch.randn(32, 61, generator=torch.Generator().manual_seed(iteration)).to(torch.float16)
            scaler.scale(model(x).float().pow(2).mean()).backward()
            if iteration == 3:
                model[0].weight.grad[0, 0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
        return ([p.detach().clone().view(torch.int16) for p in model.parameters()],
                [m.view(torch.int32).clone() for m in optimizer.master_weights()], optimizer.committed_step)
    finally:
        optimizer.close()


def test_adamw_through_a_server_bit_for_bit_as_through_a_mount(mount: Mount, served: Served, token_file: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    local_params, local_masters, local_step = _train_adamw(mount.mountpoint, monkeypatch, token_file)
    params, masters, step = _train_adamw(served.url, monkeypatch, token_file)
    assert step == local_step == 4
    assert all(torch.equal(a, b) for a, b in zip(params, local_params))
    assert all(torch.equal(a, b) for a, b in zip(masters, local_masters))


def test_eight_clients_on_eight_namespaces_are_all_served(served: Served, token_file: Path) -> None:
    """A thread per connection: eight trainers stepping their own namespaces at once all get
    through, none starved (the slowest takes at most a few times the fastest's time)."""
    elapsed: dict[int, float] = {}
    errors: list[BaseException] = []
    # Every trainer's clock starts together, once all are connected and set up: otherwise the
    # first ones time their steps alone while the others are still connecting.
    ready = threading.Barrier(8)

    def trainer(index: int) -> None:
        try:
            with remote(served, token_file) as client:
                name = f"c{index}"
                nsid = client.create_namespace({"name": name, "tensors": [["w", 200_001], ["b", 31]]})
                transport = client.transport
                grads = [transport.open_file(f"ns/{name}/tensors/{t}/grad", True, False) for t in ("w", "b")]
                params = [transport.open_file(f"ns/{name}/tensors/{t}/param", False, False) for t in ("w", "b")]
                values = [np.full(200_001, 0.01, np.float16).tobytes(), np.full(31, 0.01, np.float16).tobytes()]
                out = [bytearray(len(v)) for v in values]
                ready.wait(60)
                started = time.monotonic()
                for step in range(1, 6):
                    client.begin_step(nsid, step)
                    transport.write_many([(h, memoryview(v), 0) for h, v in zip(grads, values)])
                    client.commit_step(nsid)
                    transport.read_many([(h, memoryview(o), 0) for h, o in zip(params, out)])
                elapsed[index] = time.monotonic() - started
                assert client.statistics(nsid)["committed_step"] == 5
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            ready.abort()  # the others stop waiting for this one

    threads = [threading.Thread(target=trainer, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(elapsed) == 8
    # Starved would be many times slower; threads sharing one interpreter on 2 cores with the
    # server are not equal, so the bound is loose.
    assert max(elapsed.values()) <= 4 * min(elapsed.values()) + 2.0, elapsed


def test_a_large_write_that_repeats_gradients_is_refused(served: Served, token_file: Path) -> None:
    """A WRITE large enough to be staged as it arrives: gradients the open step already has
    are GRADIENT_DUPLICATE (EEXIST), the connection and the step go on, the abort cleans up."""
    with remote(served, token_file) as client:
        nsid = client.create_namespace({"name": "dup", "tensors": [["x", 3_000_000]]})
        transport = client.transport
        grad = transport.open_file("ns/dup/tensors/x/grad", True, False)
        data = np.ones(3_000_000, np.float16).tobytes()
        client.begin_step(nsid, 1)
        transport.write_at(grad, memoryview(data)[4 << 20 :], 4 << 20)  # the tail first
        with pytest.raises(OSError) as refused:
            transport.write_many([(grad, memoryview(data), 0)])  # 6 MB: staged as it arrives
        assert refused.value.errno == errno.EEXIST
        assert client.statistics(nsid)["step_open"] == 1
        assert client.abort_step(nsid) == 1
        assert transport.write_many([(grad, memoryview(data), 0)]) == len(data)  # implicit step 1
        assert client.statistics(nsid)["committed_step"] == 1


# ---------------------------------------------------------------------- the framing itself


def _reader_of(raw: bytes) -> wire.PduReader:
    left, right = socket.socketpair()
    left.sendall(raw)
    left.close()
    return wire.PduReader(right.recv_into)


def test_pdu_framing_round_trip_and_refusals() -> None:
    digests = wire.Digest.HEADER | wire.Digest.DATA
    data = os.urandom(1000)
    pdu = wire.header(wire.PduType.C2H_DATA, wire.PduFlags.LAST_PDU, wire.data_specific(7, 1, 0, 1000), 1000,
                      digests) + data + struct.pack("<I", wire.crc32c(data))
    reader = _reader_of(pdu)
    head = reader.read_head(digests)
    assert (head.type, head.data_len, head.data_header()) == (wire.PduType.C2H_DATA, 1000, (7, 1, 0, 1000))
    assert bytes(reader.read_data()) == data
    assert wire.crc32c(b"123456789") == 0xE3069283  # CRC32C's check value

    def refusal(raw: bytes, expected: wire.FatalError, negotiated: wire.Digest = digests) -> None:
        with pytest.raises(wire.WireError) as caught:
            _reader_of(raw).read_head(negotiated)
        assert caught.value.fes == expected

    damaged = bytearray(pdu)
    damaged[10] ^= 1  # inside the header: its digest no longer matches
    refusal(bytes(damaged), wire.FatalError.HEADER_DIGEST_ERROR)
    refusal(b"\x55" + pdu[1:], wire.FatalError.INVALID_HEADER_FIELD)  # no such PDU type
    refusal(pdu[:2] + b"\x30" + pdu[3:], wire.FatalError.INVALID_HEADER_FIELD)  # HLEN
    refusal(pdu, wire.FatalError.INVALID_HEADER_FIELD, wire.Digest.NONE)  # digests not negotiated
    huge = wire.header(wire.PduType.H2C_DATA, 0, wire.data_specific(1, 0, 0, 0), wire.MAX_DATA_BYTES + 2,
                       wire.Digest.NONE)
    refusal(huge, wire.FatalError.DATA_TRANSFER_LIMIT_EXCEEDED, wire.Digest.NONE)
    # A data digest that fails fails the command, not the framing: the PDU is read whole.
    bad = pdu[:-4] + struct.pack("<I", wire.crc32c(data) ^ 1)
    reader = _reader_of(bad + pdu)
    reader.read_head(digests)
    with pytest.raises(DeviceError) as caught:
        reader.read_data()
    assert caught.value.status == Status.DATA_TRANSFER_ERROR
    assert reader.read_head(digests).data_len == 1000  # the next PDU reads as ever


def test_server_urls() -> None:
    from cossd.client import parse_url

    assert str(parse_url("cossd://10.0.0.5")) == "cossd://10.0.0.5:4420"
    assert str(parse_url(Path("cossd://10.0.0.5:7000"))) == "cossd://10.0.0.5:7000"  # a Path folds the //
    assert parse_url("cossd://[::1]:9?digest=both").digests == wire.Digest.HEADER | wire.Digest.DATA
    for bad in ("http://x:1", "cossd://", "cossd://h:99999", "cossd://h:1/path", "cossd://h:1?x=1"):
        with pytest.raises(ValueError):
            parse_url(bad)


def test_the_link_counts_what_each_command_moved(tmp_path: Path) -> None:
    """The server's LinkTiming (docs/timing-model.md): every request's payload bytes and PDUs,
    by command (an in-process server, to read its accounting)."""
    from cossd.server.server import Server

    Device.format(tmp_path / "l", capacity_bytes=1 << 30)
    with Device.open(tmp_path / "l") as device:
        server = Server(device, "127.0.0.1", 0, link="100g-rdma")
        thread = threading.Thread(target=server.serve_forever)
        thread.start()
        try:
            with AdminClient(f"cossd://127.0.0.1:{server.address[1]}") as client:
                client.create_namespace({"name": "n", "tensors": [["x", 100_000]]})
                transport = client.transport
                transport.write_at(transport.open_file("ns/n/tensors/x/grad", True, False),
                                   memoryview(np.ones(100_000, np.float16).tobytes()), 0)
                buffer = bytearray(200_000)
                transport.read_at(transport.open_file("ns/n/tensors/x/param", False, False), memoryview(buffer), 0)
        finally:
            server.stop()
            thread.join(30)
    link = server.snapshot()["link"]
    assert link["link"] == "100g-rdma"
    assert link["by_command"]["write"]["commands"] == 1 and link["by_command"]["read"]["commands"] == 1
    assert link["net_in_bytes"] >= 200_000 + 24 and link["net_out_bytes"] >= 200_000
    assert link["messages_in"] >= 6 and link["wire_ns"] > 0


# ---------------------------------------------------------------------- the CLI, by URL


def test_cli_verbs_take_a_server_url(served: Served, token_file: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every CLI verb that names a device takes cossd://HOST:PORT as it takes a mountpoint (the
    token from $COSSD_TOKEN_FILE), with the same outputs; `serve` lists under `cossd --help`."""
    from helpers import run_cli

    monkeypatch.setenv("COSSD_TOKEN_FILE", str(token_file))
    url = served.url
    code, out, err = run_cli(capsys, "create-ns", url, "m", "--tensor", "w:5000", "--tensor", "b:7")
    assert code == 0, err
    code, out, _ = run_cli(capsys, "id-ctrl", url, "-o", "json")
    assert code == 0 and json.loads(out)["sn"].strip() == "TESTSERIAL0001"
    code, out, _ = run_cli(capsys, "smart-log", url)
    assert code == 0 and f"device:{url}" in out  # the URL as given, not folded as a path
    code, out, _ = run_cli(capsys, "id-ns", url, "-n", "1", "-o", "json")
    assert code == 0 and json.loads(out)["nsze"] > 0
    code, out, _ = run_cli(capsys, "get-log", url, "-i", "0xc0", "-l", "4096", "-o", "json")
    assert code == 0
    code, out, _ = run_cli(capsys, "get-feature", url, "-f", "0xc1", "-o", "json")
    assert code == 0
    code, out, err = run_cli(capsys, "flush", url)
    assert code == 0, err
    code, out, err = run_cli(capsys, "delete-ns", url, "m")
    assert code == 0, err
    with remote(served, token_file) as client:
        assert client.describe()["namespaces"] == []
    # A wrong token: a clear refusal from the verb, not a traceback.
    bad = token_file.with_name("bad-token")
    bad.write_text("x" * 32 + "\n")
    bad.chmod(0o600)
    monkeypatch.setenv("COSSD_TOKEN_FILE", str(bad))
    code, out, err = run_cli(capsys, "id-ctrl", url)
    assert code != 0 and "refused" in err and "Traceback" not in err
    # --token-file on the command line is taken before the environment's.
    code, out, err = run_cli(capsys, "id-ctrl", url, "--token-file", str(token_file), "-o", "json")
    assert code == 0 and json.loads(out)["sn"].strip() == "TESTSERIAL0001", err
    code, out, _ = run_cli(capsys, "--help")
    assert "serve" in out


# ---------------------------------------------------------------------- the parameter cache

CACHE_TENSORS = [("w", 300_001), ("b", 77)]


@contextlib.contextmanager
def in_process_server(backing: Path, **options: Any) -> Iterator[Any]:
    """A Server in this process (to read its counters), stopped on the way out."""
    from cossd.server.server import Server

    Device.format(backing, capacity_bytes=1 << 30)
    with Device.open(backing) as device:
        server = Server(device, "127.0.0.1", 0, **options)
        thread = threading.Thread(target=server.serve_forever)
        thread.start()
        try:
            yield server
        finally:
            server.stop()
            thread.join(30)


def _cache_params(client: AdminClient, name: str = "c") -> dict[str, bytes]:
    """Every param file of namespace `name`, in one READ (one batch, as the optimizer reads)."""
    transport = client.transport
    handles = [transport.open_file(f"ns/{name}/tensors/{t}/param", False, False) for t, _ in CACHE_TENSORS]
    buffers = [bytearray(n * 2) for _, n in CACHE_TENSORS]
    counts = transport.read_many([(h, memoryview(b), 0) for h, b in zip(handles, buffers)])
    for handle in handles:
        transport.close_file(handle)
    return {t: bytes(b[:c]) for (t, _), b, c in zip(CACHE_TENSORS, buffers, counts)}


def _cache_media(server: Any, name: str = "c") -> dict[str, bytes]:
    namespace = server.device.namespaces[name]
    return {t: namespace.read(t, "param", 0, n * 2) for t, n in CACHE_TENSORS}


def _cache_step(client: AdminClient, nsid: int, step: int, grads: dict[str, np.ndarray], commit: bool = True) -> None:
    transport = client.transport
    handles = {t: transport.open_file(f"ns/c/tensors/{t}/grad", True, False) for t, _ in CACHE_TENSORS}
    client.begin_step(nsid, step)
    transport.write_many([(handles[t], memoryview(g.tobytes()), 0) for t, g in grads.items()])
    if commit:
        client.commit_step(nsid)
    for handle in handles.values():
        transport.close_file(handle)


def _cache_namespace(client: AdminClient, masters: float | None = None) -> int:
    nsid = client.create_namespace({"name": "c", "tensors": [[t, n] for t, n in CACHE_TENSORS],
                                    "hyperparameters": {"lr": 0.05, "weight_decay": 0.0}})
    rng = np.random.default_rng(3)
    for tensor, numel in CACHE_TENSORS:
        values = (np.full(numel, masters, np.float32) if masters is not None
                  else rng.standard_normal(numel, dtype=np.float32))
        handle = client.transport.open_file(f"ns/c/tensors/{tensor}/master", True, False)
        client.transport.write_at(handle, memoryview(values.tobytes()), 0)
        client.transport.close_file(handle)
    return nsid


def test_param_cache_reads_equal_media_reads(tmp_path: Path) -> None:
    """With --param-cache-size, param reads equal the media's bit for bit across commits, a
    skipped step, an aborted step (with grads in) and a rollback; hits and misses counted."""
    from cossd.client import snapshots

    with in_process_server(tmp_path / "pc", param_cache_size=64 << 20) as server:
        cache = server.param_cache
        with AdminClient(f"cossd://127.0.0.1:{server.address[1]}") as client:
            nsid = _cache_namespace(client)
            assert _cache_params(client) == _cache_media(server)  # loading: never cached
            assert cache.snapshot()["namespaces"] == 0
            rng = np.random.default_rng(4)

            def grads(bad: bool = False) -> dict[str, np.ndarray]:
                out = {t: (rng.standard_normal(n) * 0.01).astype(np.float16) for t, n in CACHE_TENSORS}
                if bad:
                    out["w"][1234] = np.inf
                return out

            seen = []
            for kind in ["commit", "commit", "skip", "abort", "snapshot", "commit", "commit", "rollback", "commit"]:
                if kind in ("commit", "skip"):
                    _cache_step(client, nsid, 0, grads(bad=kind == "skip"))
                elif kind == "abort":
                    _cache_step(client, nsid, 0, grads(), commit=False)
                    client.abort_step(nsid)
                elif kind == "snapshot":
                    snapshots.create_snapshot(client, nsid, "s")
                else:
                    snapshots.rollback(client, nsid, "s")
                before = cache.snapshot()
                first, second = _cache_params(client), _cache_params(client)
                media = _cache_media(server)
                assert first == second == media, kind
                after = cache.snapshot()
                assert after["hits"] >= before["hits"] + 1, (kind, before, after)
                seen.append(first)
            assert seen[2] == seen[1] and seen[3] == seen[2]  # a skip and an abort change nothing
            assert seen[7] == seen[4] and seen[5] != seen[4]  # the rollback's params, not the cached ones
            figures = cache.snapshot()
            assert figures["misses"] >= 6 and figures["fills"] >= 6 and figures["too_large"] == 0, figures
            assert figures["hit_bytes"] > 0 and figures["bytes"] == sum(n * 2 for _, n in CACHE_TENSORS)
            client.delete_namespace(nsid)
            assert cache.snapshot()["namespaces"] == 0 and cache.snapshot()["bytes"] == 0  # memory back
    assert server.snapshot()["param_cache"]["capacity"] == 64 << 20


def test_param_cache_smaller_than_the_params_reads_the_media(tmp_path: Path) -> None:
    with in_process_server(tmp_path / "ps", param_cache_size=100_000) as server:
        with AdminClient(f"cossd://127.0.0.1:{server.address[1]}") as client:
            nsid = _cache_namespace(client)
            _cache_step(client, nsid, 0, {t: np.full(n, 0.01, np.float16) for t, n in CACHE_TENSORS})
            assert _cache_params(client) == _cache_media(server)
            assert _cache_params(client) == _cache_media(server)
        figures = server.param_cache.snapshot()
        assert figures["hits"] == 0 and figures["misses"] == 2 and figures["too_large"] == 2, figures
        assert figures["bytes"] == 0


def test_param_cache_readers_never_see_a_mixed_step(tmp_path: Path) -> None:
    """Readers in a loop while steps commit: every element of both tensors of each read has
    one value (each step's grads are one value, so are its params), one of a committed step."""
    with in_process_server(tmp_path / "pm", param_cache_size=64 << 20) as server:
        url = f"cossd://127.0.0.1:{server.address[1]}"
        with AdminClient(url) as client:
            nsid = _cache_namespace(client, masters=0.0)
            _cache_step(client, nsid, 0, {t: np.full(n, 0.5, np.float16) for t, n in CACHE_TENSORS})
            committed = {_cache_media(server)["w"][:2]}  # each committed step's one value, from the media
            stop = threading.Event()
            problems: list[str] = []
            reads = [0]
            seen: set[bytes] = set()

            def reader() -> None:
                with AdminClient(url) as mine:
                    while not stop.is_set():
                        params = _cache_params(mine)
                        values = set(np.frombuffer(params["w"] + params["b"], np.uint16).tolist())
                        if len(values) != 1:
                            problems.append(f"a mixed read: {sorted(values)[:4]}")
                        seen.add(params["b"][:2])
                        reads[0] += 1

            threads = [threading.Thread(target=reader) for _ in range(2)]
            for thread in threads:
                thread.start()
            try:
                for step in range(12):
                    value = 0.5 if step % 2 else -0.25
                    _cache_step(client, nsid, 0, {t: np.full(n, value, np.float16) for t, n in CACHE_TENSORS})
                    committed.add(_cache_media(server)["w"][:2])
            finally:
                stop.set()
                for thread in threads:
                    thread.join(30)
        assert not problems, problems[:3]
        assert reads[0] >= 4 and len(committed) >= 10 and seen <= committed, (seen - committed, committed)
        assert server.param_cache.snapshot()["hits"] > 0


def test_param_cache_read_rate(tmp_path: Path) -> None:
    """Param read GB/s through the server, from the cache against from the media (a figure,
    printed; asserted only to be positive)."""
    figures = {}
    for size in (0, 256 << 20):
        with in_process_server(tmp_path / f"rate{size}", param_cache_size=size) as server:
            with AdminClient(f"cossd://127.0.0.1:{server.address[1]}") as client:
                client.create_namespace({"name": "r", "tensors": [["x", 16 << 20]]})
                transport = client.transport
                grad = transport.open_file("ns/r/tensors/x/grad", True, False)
                transport.write_at(grad, memoryview(np.full(16 << 20, 0.01, np.float16).tobytes()), 0)
                handle = transport.open_file("ns/r/tensors/x/param", False, False)
                buffer = memoryview(bytearray(32 << 20))
                transport.read_at(handle, buffer, 0)  # a fill where the cache is on
                started = time.perf_counter()
                for _ in range(8):
                    transport.read_at(handle, buffer, 0)
                figures[size] = 8 * len(buffer) / (time.perf_counter() - started) / 1e9
    print(f"param reads through the server: cache {figures[256 << 20]:.2f} GB/s, media {figures[0]:.2f} GB/s")
    assert all(rate > 0 for rate in figures.values())


def test_serve_param_cache_size_option(serve: Callable[..., Served], token_file: Path) -> None:
    """`cossd serve --param-cache-size 16M`: reads served from the cache, its figures in the
    server's statistics (logged at stop, beside the link's); a bad size refused."""
    served = serve("--param-cache-size", "16M")
    with remote(served, token_file) as client:
        nsid = _cache_namespace(client)
        _cache_step(client, nsid, 0, {t: np.full(n, 0.01, np.float16) for t, n in CACHE_TENSORS})
        assert _cache_params(client) == _cache_params(client)
    served.stop()
    stopped = [line for line in served.log().splitlines() if "stopped:" in line][-1]
    assert "'param_cache': {'hits': 1, 'misses': 1" in stopped and f"'capacity': {16 << 20}" in stopped, stopped
    parser = argparse.ArgumentParser()
    command.add_serve_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([str(served.backing), "--param-cache-size", "lots"])


def test_an_interrupt_while_the_server_starts_kills_it(tmp_path: Path, token_file: Path) -> None:
    """Ctrl-C (or a bench's signal handler) while start_background waits for "ready": the caller
    never gets the pid, so the start must not leave the server running. It would hold the
    device's lock: the next start is the check."""
    backing = tmp_path / "srv"
    Device.format(backing, capacity_bytes=4 << 30, serial="TESTSERIAL0001")
    options = ["--listen", "127.0.0.1:0", "--token-file", str(token_file)]

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # well before a new interpreter can import the server
        with pytest.raises(KeyboardInterrupt):
            start_server(backing, options)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    served = start_server(backing, options)  # the device's lock is free again
    served.stop()
