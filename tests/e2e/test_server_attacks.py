"""Clients and servers that die at the worst instant, on a real `cossd serve`: a client gone in the middle of a
WRITE (half a gradient sent) and of a COMMIT, and kill -9 of the server under a trainer on a remote mount."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from cossd.client import AdminClient, RemoteTransport
from cossd.client.remote import SEND_CHUNK, _shut
from cossd.protocol import wire
from cossd.protocol.entries import SUBMISSION, Opcode, encode_submission
from cossd.protocol.logpages import LogId, decode_server_log
from cossd.protocol.wire import FabricsType, PduType
from test_server import (KILL_MODEL, KILL_TENSORS, Served, _grads, _masters, _reference, _state, _step,  # noqa: F401
                         remote, serve, token_file)
from waiting import wait_until

pytestmark = pytest.mark.mount


def _held(client: AdminClient) -> int:
    """Bytes of receive buffers the server holds for all its connections now."""
    return decode_server_log(client.get_log_page(LogId.SERVER))["recv_held_bytes"]


def _step_state(client: AdminClient, nsid: int) -> tuple[int, int | None]:
    stats = client.statistics(nsid)
    return stats["committed_step"], stats["step_open"]


def _send_half_a_write(client: AdminClient, nsid: int, step: int, fraction: float = 0.5) -> None:
    """Begin `step`, announce every gradient in one WRITE, send `fraction` of its bytes, and vanish."""
    transport = client.transport
    assert isinstance(transport, RemoteTransport)
    client.begin_step(nsid, step)
    grads = _grads(step)
    handles = {t: transport.open_file(f"ns/k/tensors/{t}/grad", True, False) for t, _ in KILL_TENSORS}
    table = wire.encode_transfers([(handles[t], 0, len(raw)) for t, raw in grads.items()])
    whole = b"".join(grads.values())
    submission = encode_submission(wire.FABRICS_OPCODE, cid=77, nsid=FabricsType.WRITE)
    transport.writer.send(PduType.CAPSULE_CMD, submission[: SUBMISSION.itemsize], [table])
    transport.writer.send_data(PduType.H2C_DATA, 77, 0, [memoryview(whole)[: int(len(whole) * fraction)]],
                               SEND_CHUNK)
    _shut(transport.sock)


def _write_all_then_commit_and_vanish(client: AdminClient, nsid: int, step: int) -> None:
    """Every gradient of `step` sent, then the COMMIT's capsule, and gone before its answer."""
    transport = client.transport
    assert isinstance(transport, RemoteTransport)
    client.begin_step(nsid, step)
    for tensor, raw in _grads(step).items():
        handle = transport.open_file(f"ns/k/tensors/{tensor}/grad", True, False)
        transport.write_at(handle, memoryview(raw), 0)
    commit = encode_submission(Opcode.COMMIT_STEP, cid=78, nsid=nsid)
    transport.writer.send(PduType.CAPSULE_CMD, commit[: SUBMISSION.itemsize], [b""])
    _shut(transport.sock)


def test_a_client_gone_mid_write_or_mid_commit_leaves_no_half_step(serve: Callable[..., Served],  # noqa: F811
                                                                   token_file: Path, tmp_path: Path) -> None:
    """Half a gradient then a closed socket: the step is aborted (after the 1 s lease), its
    buffer given back, the state that of the step before; a new client trains on from it.
    A COMMIT sent then the socket closed: the step is whole or not at all. Every state file
    ends equal, bit for bit, to a replay that no one attacked."""
    references = _reference(tmp_path, 3)
    served = serve()
    with remote(served, token_file) as trainer:
        nsid = trainer.create_namespace(KILL_MODEL)
        for tensor, data in _masters().items():
            handle = trainer.transport.open_file(f"ns/k/tensors/{tensor}/master", True, False)
            trainer.transport.write_at(handle, memoryview(data), 0)
        _step(trainer, nsid, 1, [])
    # Only small commands and reads from here on: it holds no receive buffer of its own.
    with remote(served, token_file) as watcher:
        wait_until(lambda: _held(watcher) == 0, 20)
        assert _held(watcher) == 0

        _send_half_a_write(remote(served, token_file), nsid, 2)
        wait_until(lambda: _step_state(watcher, nsid) == (1, None), 20)
        assert _step_state(watcher, nsid) == (1, None)  # aborted after the lease, nothing committed
        wait_until(lambda: _held(watcher) == 0, 20)
        assert _held(watcher) == 0, "the half WRITE's buffer was kept"
        assert _state(watcher) == references[1]
        assert "step aborted" in served.log() or "aborting step" in served.log(), served.log()
        with remote(served, token_file) as successor:
            _step(successor, nsid, 2, [])
        assert _state(watcher) == references[2]

        _write_all_then_commit_and_vanish(remote(served, token_file), nsid, 3)
        wait_until(lambda: _step_state(watcher, nsid)[1] is None, 20)
        committed, still_open = _step_state(watcher, nsid)
        assert still_open is None and committed in (2, 3)
        assert _state(watcher) == references[committed]  # the step whole, or not at all
        if committed == 2:
            with remote(served, token_file) as successor:
                _step(successor, nsid, 3, [])
        assert _state(watcher) == references[3]
        wait_until(lambda: _held(watcher) == 0, 20)
        assert _held(watcher) == 0


@pytest.mark.slow
def test_clients_cut_at_random_points_of_steps_many(serve: Callable[..., Served], token_file: Path,  # noqa: F811
                                                    tmp_path: Path, figures: list[str]) -> None:
    """20 steps, each first attacked: a WRITE cut after a random share of its bytes, or a
    COMMIT sent and the socket closed; then a new client settles the step. Never a half
    step: after each, every state file equals the replay of the step the server says."""
    trials = 20
    references = _reference(tmp_path, trials + 1)
    served = serve()
    rng = np.random.default_rng(5)
    outcomes = {"aborted": 0, "committed": 0}
    with remote(served, token_file) as trainer:
        nsid = trainer.create_namespace(KILL_MODEL)
        for tensor, data in _masters().items():
            handle = trainer.transport.open_file(f"ns/k/tensors/{tensor}/master", True, False)
            trainer.transport.write_at(handle, memoryview(data), 0)
    with remote(served, token_file) as watcher:
        for step in range(1, trials + 1):
            if rng.random() < 0.7:
                _send_half_a_write(remote(served, token_file), nsid, step, float(rng.uniform(0.01, 0.99)))
            else:
                _write_all_then_commit_and_vanish(remote(served, token_file), nsid, step)
            wait_until(lambda: _step_state(watcher, nsid)[1] is None, 20)
            committed, still_open = _step_state(watcher, nsid)
            assert still_open is None and committed in (step - 1, step)
            assert _state(watcher) == references[committed]
            outcomes["committed" if committed == step else "aborted"] += 1
            if committed == step - 1:
                with remote(served, token_file) as successor:
                    _step(successor, nsid, step, [])
            assert _state(watcher) == references[step]
        wait_until(lambda: _held(watcher) == 0, 20)
        assert _held(watcher) == 0
    figures.append(f"clients cut mid-WRITE or mid-COMMIT: {trials} trials, 0 half steps "
                   f"({outcomes['aborted']} aborted, {outcomes['committed']} committed whole), 0 bytes held after")


# ---------------------------------------------------------------------- kill -9 under a trainer on a remote mount

TRAINER = r"""
import json, sys, torch
from cossd.trainer import AdamW, DeviceLostError
mount, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64)).to(torch.bfloat16)
optimizer = AdamW(model.parameters(), mount=mount, namespace="run", lr=1e-3, weight_decay=0.01, timeout_s=10)
start = optimizer.committed_step + 1
print(json.dumps({"resumed_at": start}), flush=True)
losses = {}
try:
    for step in range(start, steps + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
        optimizer.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        losses[step] = loss.item()
        print(json.dumps({"step": step}), flush=True)
except DeviceLostError as exc:
    print(json.dumps({"lost": str(exc)}), flush=True)
    sys.exit(3)
params = [p.detach().view(torch.int16).flatten().tolist() for p in model.parameters()]
masters = [m.view(torch.int32).flatten().tolist() for m in optimizer.master_weights()]
json.dump({"losses": losses, "params": params, "masters": masters, "step": optimizer.committed_step}, open(out, "w"))
optimizer.close()
"""

STEPS = 8


def _mount_remote(url: str, mountpoint: Path, token: Path) -> int:
    mountpoint.mkdir()
    done = subprocess.run([sys.executable, "-m", "cossd.tools.cli", "mount", url, str(mountpoint), "--token-file",
                           str(token), "--timeout", "10", "--log-file", str(mountpoint.with_suffix(".log")),
                           "-o", "json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(json.loads(done.stdout)["pid"])


def _unmount(mountpoint: Path, pid: int) -> None:
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    from conftest import wait_for_exit

    try:
        wait_for_exit(pid, 20)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)


def _train(mountpoint: Path, out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", TRAINER, str(mountpoint), str(STEPS), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_kill_9_of_the_server_under_a_remote_mount_resumes_bit_identical(
        serve: Callable[..., Served], token_file: Path, tmp_path: Path) -> None:  # noqa: F811
    """A trainer on `cossd mount cossd://...`; kill -9 of the server once 3 steps are
    committed; the server restarted on the same backing; the mount reconnects by itself and a
    restarted trainer resumes from the committed step and ends with every param, master and
    loss of an uninterrupted run's, bit for bit."""
    clean_server, killed_server = serve(name="clean"), serve(name="killed")
    clean_mount, killed_mount = tmp_path / "clean-mnt", tmp_path / "killed-mnt"
    clean_pid = _mount_remote(clean_server.url, clean_mount, token_file)
    killed_pid = _mount_remote(killed_server.url, killed_mount, token_file)
    try:
        clean = _train(clean_mount, tmp_path / "clean.json")
        assert clean.wait(300) == 0, clean.stderr.read() if clean.stderr else ""

        first = _train(killed_mount, tmp_path / "first.json")
        assert first.stdout is not None
        for line in first.stdout:  # kill once step 3 is committed, while step 4 is under way
            if json.loads(line).get("step") == 3:
                killed_server.kill()
                break
        first.wait(120)
        assert first.returncode == 3, (first.returncode, first.stderr.read() if first.stderr else "")  # lost
        killed_server.restart()
        resumed = _train(killed_mount, tmp_path / "resumed.json")
        assert resumed.wait(300) == 0, resumed.stderr.read() if resumed.stderr else ""
        assert resumed.stdout is not None
        resumed_at = json.loads(resumed.stdout.readline())["resumed_at"]
        assert 4 <= resumed_at <= 5  # step 3 was committed; step 4 perhaps (the kill raced it)
        expected = json.loads((tmp_path / "clean.json").read_text())
        got = json.loads((tmp_path / "resumed.json").read_text())
        assert got["step"] == expected["step"] == STEPS
        assert got["params"] == expected["params"] and got["masters"] == expected["masters"]
        assert {step: loss for step, loss in got["losses"].items()} == {
            step: loss for step, loss in expected["losses"].items() if int(step) >= resumed_at}
    finally:
        _unmount(clean_mount, clean_pid)
        _unmount(killed_mount, killed_pid)
