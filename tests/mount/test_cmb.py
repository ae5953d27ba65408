"""Mount tier: the controller memory buffer. CMB_WRITE / CMB_READ step bit for bit like the files,
refuse bad transfers changing nothing, and the trainer's transport over it agrees with the files."""
from __future__ import annotations

import json
import os
import threading
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.emulator import Device
from cossd.emulator.commands.cmb import Transfer, check_param_copies
from cossd.protocol.status import DeviceError, Status
from cossd.protocol.entries import Opcode
from cossd.fs import daemon
from cossd.client import AdminClient
from cossd.trainer import AdamW
from cossd.client import claim_region, plan_cmb_batches
from cossd.trainer.namespace.files import NamespaceFiles
from helpers import create_namespace, pread_all, pwrite_all, random_half, tensor_dir

TENSORS = [("odd", 300_007), ("big", 600_000)]
PARAMS = 64 << 20  # where the tests put param copies in the CMB


@pytest.fixture
def mounted(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Mount]:
    """A mount whose CMB size the test's `cmb_bytes` marker sets (default: the daemon's)."""
    marker = request.node.get_closest_marker("cmb_bytes")
    callspec = getattr(request.node, "callspec", None)
    size = callspec.params.get("cmb_bytes") if callspec else (marker.args[0] if marker else None)
    backing, mountpoint = tmp_path / "backing", tmp_path / "mnt"
    Device.format(backing)
    mountpoint.mkdir()
    pid = daemon.start_background(backing, mountpoint, cmb_bytes=size)
    mount = Mount(backing, mountpoint, pid)
    try:
        yield mount
    finally:
        if is_mounted(mountpoint):
            subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
            if not wait_for_exit(pid, 30):
                force_unmount(mountpoint)


def _masters(mountpoint: Path, namespace: str, seed: int = 3) -> None:
    rng = np.random.default_rng(seed)
    for name, numel in TENSORS:
        pwrite_all(tensor_dir(mountpoint, namespace, name) / "master",
                   rng.standard_normal(numel, dtype=np.float32).tobytes())


def _files(mountpoint: Path, namespace: str, role: str) -> dict[str, bytes]:
    return {name: pread_all(tensor_dir(mountpoint, namespace, name) / role) for name, _ in TENSORS}


@pytest.mark.mount
def test_cmb_steps_match_file_steps_bit_for_bit(mounted: Mount) -> None:
    """Two namespaces from the same start: one steps through the files, the other through the
    CMB (a tensor's gradient cut into several transfers, in any order, in one command); params,
    masters and moments agree byte for byte after every step."""
    mp = mounted.mountpoint
    for name in ("files", "cmb"):
        create_namespace(mp, name, TENSORS)
        _masters(mp, name)
    rng = np.random.default_rng(11)
    with AdminClient(mp) as client:
        nsid = client.nsid("cmb")
        cmb = client.cmb()
        assert cmb is not None and cmb.size == 1 << 30 and cmb.path.startswith("/proc/")
        try:
            for step in range(1, 4):
                grads = {name: random_half(rng, numel, "fp16")[0] for name, numel in TENSORS}
                for name, _ in TENSORS:
                    pwrite_all(tensor_dir(mp, "files", name) / "grad", grads[name], chunk=1 << 20)
                # odd's gradient in three pieces at odd element boundaries, big's whole; laid out
                # in the CMB out of order.
                cuts = [0, 2 * 77_777, 2 * 250_001, 2 * 300_007]
                transfers, at = [], 4096
                # Every other step the params come back with the command (param_cmb_offset):
                # odd's at PARAMS + its offset (an unaligned start), big's after them.
                with_params = step % 2 == 1
                for lo, hi in reversed(list(zip(cuts, cuts[1:]))):
                    cmb.array[at : at + hi - lo] = np.frombuffer(grads["odd"][lo:hi], dtype=np.uint8)
                    transfers.append({"tensor": "odd", "offset": lo, "length": hi - lo, "cmb_offset": at}
                                     | ({"param_cmb_offset": PARAMS + lo} if with_params else {}))
                    at += hi - lo + 2  # unaligned CMB offsets are fine
                cmb.array[at : at + len(grads["big"])] = np.frombuffer(grads["big"], dtype=np.uint8)
                transfers.append({"tensor": "big", "length": len(grads["big"]), "cmb_offset": at}
                                 | ({"param_cmb_offset": PARAMS + (1 << 20)} if with_params else {}))
                cmb.array[PARAMS : PARAMS + (4 << 20)] = 0xEE
                report = client.cmb_write(nsid, transfers)
                assert report["bytes"] == sum(len(g) for g in grads.values())
                assert report["commit"] == {"committed_step": step, "nonfinite_elements": 0,
                                            "skipped": False, "step": step}
                if with_params:  # the kernel's copies (big) and the commit's (odd's pieced blocks)
                    expected = _files(mp, "files", "param")
                    assert cmb.array[PARAMS : PARAMS + 600_014].tobytes() == expected["odd"]
                    assert cmb.array[PARAMS + (1 << 20) : PARAMS + (1 << 20) + 1_200_000].tobytes() == expected["big"]
                    assert (cmb.array[PARAMS + 600_014 : PARAMS + (1 << 20)] == 0xEE).all()
                for role in ("param", "master", "exp_avg_sq"):
                    expected = _files(mp, "files", role)
                    reads, at = [], 0
                    for name, _ in TENSORS:
                        reads.append({"tensor": name, "role": role, "cmb_offset": at})
                        at += len(expected[name]) + 64
                    answer = client.cmb_read(nsid, reads)
                    assert answer["committed_step"] == step
                    for entry in reads:
                        data = expected[entry["tensor"]]
                        got = cmb.array[entry["cmb_offset"] : entry["cmb_offset"] + len(data)].tobytes()
                        assert got == data, (step, role, entry["tensor"])
                # A read of a range, as a file read at an offset would give.
                client.cmb_read(nsid, [{"tensor": "big", "offset": 1000, "length": 5000, "cmb_offset": 0}])
                assert cmb.array[:5000].tobytes() == _files(mp, "files", "param")["big"][1000:6000]
        finally:
            cmb.close()
        assert client.statistics(nsid)["committed_step"] == 3


def _loaded_namespace(mp: Path) -> None:
    """Namespace "m" of TENSORS, its master weights loaded."""
    create_namespace(mp, "m", TENSORS)
    _masters(mp, "m")


def _expect(client: AdminClient, opcode: Opcode, nsid: int, payload: Any, status: Status, text: str = "") -> None:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    completion = client.submit(opcode, nsid=nsid, payload=raw)
    assert completion.status == status, (payload, completion.status, completion.data)
    assert text in completion.data.decode(), completion.data


@pytest.mark.mount
def test_refused_transfers_change_nothing(mounted: Mount) -> None:
    mp = mounted.mountpoint
    _loaded_namespace(mp)
    with AdminClient(mp) as client:
        nsid = client.nsid("m")
        nvm = client.create_namespace({"name": "raw", "kind": "nvm", "capacity_bytes": 1 << 20})
        cmb = client.cmb()
        assert cmb is not None
        rng = np.random.default_rng(1)
        grad = np.frombuffer(random_half(rng, 300_007, "fp16")[0], dtype=np.uint8)
        cmb.array[: len(grad)] = grad
        # One good step first, so that state is sealed and there are params to compare.
        client.cmb_write(nsid, [{"tensor": "odd", "length": len(grad), "cmb_offset": 0},
                                {"tensor": "big", "length": 1_200_000, "cmb_offset": 0}])
        before = {role: _files(mp, "m", role) for role in ("param", "master", "exp_avg")}
        stats = client.statistics(nsid)
        end = cmb.size
        good = {"tensor": "odd", "offset": 0, "length": 1000, "cmb_offset": 0}
        W, R = Opcode.CMB_WRITE, Opcode.CMB_READ
        cases = [
            (W, b"not json", Status.INVALID_FIELD, "not valid JSON"),
            (W, [], Status.INVALID_FIELD, "non-empty"),
            (W, {"tensor": "odd"}, Status.INVALID_FIELD, "array"),
            (W, [good, 7], Status.INVALID_FIELD, "transfer 1 is not"),
            (W, [good, {**good, "colour": 1}], Status.INVALID_FIELD, "unknown fields"),
            (W, [good, {**good, "offset": 2000, "cmb_offset": -1}], Status.INVALID_FIELD, ">= 0"),
            (W, [good, {**good, "offset": 2000, "cmb_offset": "0"}], Status.INVALID_FIELD, "integer"),
            (W, [good, {**good, "offset": 2000, "cmb_offset": end - 10}], Status.LBA_OUT_OF_RANGE, "outside"),
            (W, [good, {**good, "offset": 600_000}], Status.LBA_OUT_OF_RANGE, "passes the end"),
            (W, [good, {**good, "offset": 2001}], Status.MISALIGNED_ACCESS, "element boundaries"),
            (W, [good, {**good, "offset": 998}], Status.GRADIENT_DUPLICATE, "twice in one batch"),
            (W, [good, {**good, "tensor": "nope"}], Status.INVALID_NAMESPACE, "nope"),
            (W, [good, {**good, "role": "colour"}], Status.INVALID_FIELD, "no file"),
            (W, [good, {**good, "role": "master"}], Status.INVALID_FIELD, "not both"),
            (W, [{**good, "role": "master"}], Status.STATE_SEALED, "before the first step"),
            (W, [{**good, "role": "param"}], Status.ACCESS_DENIED, "not writable"),
            (R, [{"tensor": "odd", "role": "grad", "cmb_offset": 0}], Status.ACCESS_DENIED, "write-only"),
            (R, [{"tensor": "odd", "offset": 600_000, "length": 100, "cmb_offset": 0}],
             Status.LBA_OUT_OF_RANGE, "passes the end"),
            (R, [{"tensor": "odd", "length": 100, "cmb_offset": 0},
                 {"tensor": "big", "length": 100, "cmb_offset": 50}], Status.INVALID_FIELD, "overlap in the CMB"),
            (R, [{"tensor": "odd", "cmb_offset": end - 100}], Status.LBA_OUT_OF_RANGE, "outside"),
            (R, [{**good, "param_cmb_offset": 5000}], Status.INVALID_FIELD, "goes with a CMB_WRITE of gradients"),
            (W, [{**good, "role": "master", "param_cmb_offset": 5000}], Status.INVALID_FIELD, "goes with"),
            (W, [good, {**good, "offset": 2000, "param_cmb_offset": 500}], Status.INVALID_FIELD,
             "a param copy may overlap nothing else"),
            (W, [{**good, "param_cmb_offset": 5000}, {**good, "offset": 2000, "param_cmb_offset": 5500}],
             Status.INVALID_FIELD, "overlap"),
            (W, [good, {**good, "offset": 2000, "param_cmb_offset": end - 500}], Status.LBA_OUT_OF_RANGE, "params"),
            (W, [good] * 65537, Status.LIMIT_EXCEEDED, "at most 65536"),
        ]
        for opcode, payload, status, text in cases:
            _expect(client, opcode, nsid, payload, status, text)
        _expect(client, W, nvm, [good], Status.NAMESPACE_KIND_MISMATCH, "plain nvm namespace")
        _expect(client, W, 99, [good], Status.INVALID_NAMESPACE)
        # None of those opened a step, staged a gradient or moved a byte.
        after = client.statistics(nsid)
        assert after["step_open"] is None and after["committed_step"] == 1
        assert after["grad_bytes_in"] == stats["grad_bytes_in"]
        # A transfer the open step already has (from a file write) is refused, and so is the
        # whole batch with it: the first, good transfer is not taken either.
        pwrite_all(tensor_dir(mp, "m", "big") / "grad", bytes(4000))
        _expect(client, W, nsid, [{"tensor": "odd", "length": 1000, "cmb_offset": 0},
                                  {"tensor": "big", "offset": 2000, "length": 4000, "cmb_offset": 0}],
                Status.GRADIENT_DUPLICATE, "already received")
        assert client.statistics(nsid)["grad_bytes_in"] == stats["grad_bytes_in"] + 4000
        client.abort_step(nsid)
        assert {role: _files(mp, "m", role) for role in before} == before
        cmb.close()


@pytest.mark.mount
def test_param_copies_hold_the_committed_params_however_the_step_ends(mounted: Mount) -> None:
    """Explicit steps: the copies are filled when the step commits (COMMIT_STEP), is skipped
    or is aborted, never with the params of a step that did not commit."""
    mp = mounted.mountpoint
    _loaded_namespace(mp)
    rng = np.random.default_rng(4)
    with AdminClient(mp) as client:
        nsid, cmb = client.nsid("m"), client.cmb()
        assert cmb is not None
        transfers = [{"tensor": "odd", "length": 600_014, "cmb_offset": 0, "param_cmb_offset": PARAMS},
                     {"tensor": "big", "length": 1_200_000, "cmb_offset": 600_014,
                      "param_cmb_offset": PARAMS + 600_014}]

        def copies() -> bytes:
            return cmb.array[PARAMS : PARAMS + 1_800_014].tobytes()

        def committed() -> bytes:
            params = _files(mp, "m", "param")
            return params["odd"] + params["big"]

        for ending in ("commit", "nan", "abort", "commit"):
            grads = random_half(rng, 900_007, "fp16")[0]
            if ending == "nan":
                grads = grads[:1000] + np.float16(np.inf).tobytes() + grads[1002:]
            cmb.array[: len(grads)] = np.frombuffer(grads, dtype=np.uint8)
            cmb.array[PARAMS : PARAMS + 1_800_014] = 0xEE
            client.begin_step(nsid)
            if ending == "abort":  # half the gradients, then the step is dropped
                client.cmb_write(nsid, transfers[1:])
                client.abort_step(nsid)
            else:
                client.cmb_write(nsid, transfers)
                assert client.commit_step(nsid)["skipped"] == (ending == "nan")
            if ending == "abort":  # only what was sent has a copy
                assert copies()[600_014:] == committed()[600_014:] and set(copies()[:600_014]) == {0xEE}
            else:
                assert copies() == committed(), ending
        assert client.statistics(nsid)["committed_step"] == 2
        cmb.close()


@pytest.mark.mount
def test_nonfinite_gradients_in_the_cmb_skip_the_step(mounted: Mount) -> None:
    mp = mounted.mountpoint
    _loaded_namespace(mp)
    with AdminClient(mp) as client:
        nsid, cmb = client.nsid("m"), client.cmb()
        assert cmb is not None
        before = _files(mp, "m", "param")
        grads = np.zeros(900_007, dtype=np.float16)
        grads[600_123] = np.nan
        cmb.array[: grads.nbytes] = grads.view(np.uint8)
        report = client.cmb_write(nsid, [{"tensor": "odd", "length": 600_014, "cmb_offset": 0},
                                         {"tensor": "big", "cmb_offset": 600_014}])
        assert report["commit"]["skipped"] and report["commit"]["nonfinite_elements"] == 1
        assert report["committed_step"] == 0
        assert _files(mp, "m", "param") == before
        cmb.close()


@pytest.mark.mount
@pytest.mark.cmb_bytes(0)
def test_a_mount_without_a_cmb(mounted: Mount) -> None:
    mp = mounted.mountpoint
    create_namespace(mp, "m", TENSORS)
    with AdminClient(mp) as client:
        assert client.cmb() is None and client.describe()["cmb"] is None
        _expect(client, Opcode.CMB_WRITE, client.nsid("m"), [{"tensor": "odd", "cmb_offset": 0}],
                Status.INVALID_FIELD, "--cmb-size 0")
    files = NamespaceFiles(mp, "m")
    try:
        assert files.exists() and files.cmb() is None
        values = torch.arange(300_007, dtype=torch.float32)
        files.write_many([("odd", "master", values)])  # the files serve instead
        out = torch.empty(300_007, dtype=torch.float32)
        files.read_many_into([("odd", "master", out)])
        assert torch.equal(out, values)
    finally:
        files.close()


@pytest.mark.mount
def test_a_cmb_this_process_may_not_open_leaves_the_files(mounted: Mount, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user's daemon: its /proc/PID/fd cannot be opened. The trainer's client then
    uses the files, with a warning, instead of failing."""
    create_namespace(mounted.mountpoint, "m", TENSORS)
    denied = lambda *args, **kwargs: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))  # noqa: E731
    monkeypatch.setattr("cossd.client.transport.CmbMapping", denied)
    files = NamespaceFiles(mounted.mountpoint, "m")
    try:
        assert files.exists() and files.cmb() is None
        values = torch.arange(300_007, dtype=torch.float32)
        files.write_many([("odd", "master", values)])
        out = torch.empty(300_007, dtype=torch.float32)
        files.read_many_into([("odd", "master", out)])
        assert torch.equal(out, values)
    finally:
        files.close()


def test_cmb_size_option_is_checked(tmp_path: Path) -> None:
    for bad in ("5000", "2T", "-1"):
        result = subprocess.run([sys.executable, "-m", "cossd.tools.cli", "mount", str(tmp_path),
                                 str(tmp_path), "--cmb-size", bad], capture_output=True, text=True)
        assert result.returncode == 2 and "--cmb-size" in result.stderr, result.stderr


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.GELU(), torch.nn.Linear(700, 33)).to(torch.bfloat16)


@pytest.mark.mount
@pytest.mark.parametrize("cmb_bytes", [64 << 10, None], ids=["64K", "default"])
def test_trainers_share_the_cmb_or_use_the_files(mounted: Mount, cmb_bytes: int | None) -> None:
    """Two optimizers on one mount, stepping at the same time on two threads. With the default
    1 GiB CMB each locks a part of its own (a step's gradients and params), and each step's
    CMB_WRITE brings the params back: no reads. With 64 KiB the first holds all of it, cuts
    its tensors into many batches and reads the params back with CMB_READ; the second finds
    nothing free and uses the files. Either way the two train bit for bit alike."""
    models = [_model(0), _model(0)]
    optimizers = [AdamW(m.parameters(), mount=mounted.mountpoint, namespace=f"n{i}", lr=1e-3)
                  for i, m in enumerate(models)]
    try:
        regions = [o.files.cmb() for o in optimizers]
        assert regions[0] is not None
        if cmb_bytes is None:  # both hold a part, side by side, each a whole step's worth
            assert regions[1] is not None
            wanted = 4 * sum(p.numel() for p in models[0].parameters())
            assert regions[0].size >= wanted and regions[1].size >= wanted
            assert regions[0].base + regions[0].size <= regions[1].base
        else:
            assert regions[0].size == 64 << 10 and regions[1] is None
        data = torch.randn(64, 300, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
        reads_before = optimizers[0].files.statistics()["read_commands"]

        def train(model: torch.nn.Module, optimizer: AdamW) -> None:
            for _ in range(6):
                optimizer.zero_grad()
                model(data).float().square().mean().backward()
                optimizer.step()

        threads = [threading.Thread(target=train, args=pair) for pair in zip(models, optimizers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # With the default CMB the params came back with each step's CMB_WRITE: no reads.
        reads = optimizers[0].files.statistics()["read_commands"] - reads_before
        assert (reads == 0) == (cmb_bytes is None), reads
        for a, b in zip(models[0].parameters(), models[1].parameters()):
            assert torch.equal(a, b)
        state = [o.state_dict()["state"][0]["exp_avg_sq"] for o in optimizers]
        assert torch.equal(state[0], state[1]) and state[0].abs().sum() > 0
        assert all(o.files.statistics()["committed_step"] == 6 for o in optimizers)
    finally:
        for optimizer in optimizers:
            optimizer.close()
    # Closed, the first releases its part: the next client gets one.
    files = NamespaceFiles(mounted.mountpoint, "n1")
    try:
        assert files.exists() and files.cmb() is not None
    finally:
        files.close()


def _train_alike(models: list[torch.nn.Module], optimizers: list[AdamW], batch: int, seed: int) -> None:
    """Three steps of each model on the same data, one after the other; then they must be
    bit for bit alike."""
    data = torch.randn(batch, 300, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    for _ in range(3):
        for model, optimizer in zip(models, optimizers):
            optimizer.zero_grad()
            model(data).float().square().mean().backward()
            optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))


@pytest.mark.mount
def test_the_claimed_part_holds_a_step_with_each_tensor_padded_to_a_cache_line(mounted: Mount) -> None:
    """Each tensor's gradients and params sit at 64-byte boundaries in the CMB part, so the
    part claimed is what that takes, not 4 bytes a parameter: with 262143 + 1 parameters
    (4 B/param is exactly 1 MiB, the padding 128 bytes more) a step still goes in one
    CMB_WRITE that brings the params back (no reads), streamed or not."""
    for streaming in (False, True):
        params = [torch.nn.Parameter(torch.randn(262143).to(torch.bfloat16)),
                  torch.nn.Parameter(torch.randn(1).to(torch.bfloat16))]
        optimizer = AdamW(params, mount=mounted.mountpoint, namespace=f"pad{int(streaming)}", lr=1e-3,
                          streaming=streaming)
        try:
            assert optimizer.files.cmb().size >= 2 * (524288 + 64)
            assert optimizer.files.stream_slots() is not None
            before = optimizer.files.statistics()["read_commands"]
            for _ in range(2):
                for param in params:
                    param.grad = torch.full_like(param, 0.01)
                optimizer.step()
            assert optimizer.files.statistics()["read_commands"] == before
        finally:
            optimizer.close()


@pytest.mark.mount
@pytest.mark.cmb_bytes(64 << 10)
def test_streaming_takes_the_files_where_the_cmb_part_cannot_hold_a_step(mounted: Mount) -> None:
    """Streaming gives each tensor a fixed place in the CMB part for its gradients and params;
    where the part (64 KiB here) cannot hold them all, streamed gradients go through the files
    and the params come back with CMB_READ, bit for bit as a step sent whole."""
    models = [_model(2), _model(2)]
    optimizers = [AdamW(models[0].parameters(), mount=mounted.mountpoint, namespace="s", lr=1e-3, streaming=True),
                  AdamW(models[1].parameters(), mount=mounted.mountpoint, namespace="p", lr=1e-3, use_cmb=False)]
    try:
        assert optimizers[0].files.cmb() is not None and optimizers[0].files.stream_slots() is None
        _train_alike(models, optimizers, batch=16, seed=3)
    finally:
        for optimizer in optimizers:
            optimizer.close()


@pytest.mark.mount
def test_use_cmb_false_keeps_to_the_files(mounted: Mount) -> None:
    """The opt-out: the same training through the files, bit for bit, the CMB left free."""
    models = [_model(1), _model(1)]
    optimizers = [AdamW(m.parameters(), mount=mounted.mountpoint, namespace=f"u{i}", lr=1e-3, use_cmb=i == 0)
                  for i, m in enumerate(models)]
    try:
        assert optimizers[0].files.cmb() is not None and optimizers[1].files.cmb() is None
        _train_alike(models, optimizers, batch=32, seed=2)
    finally:
        for optimizer in optimizers:
            optimizer.close()


def test_cmb_regions_are_claimed_first_fit_and_shrink_to_what_is_free(tmp_path: Path) -> None:
    path = tmp_path / "cmb"
    size = 16 << 20
    path.write_bytes(b"")
    os.truncate(path, size)
    fds = [os.open(path, os.O_RDWR) for _ in range(5)]
    try:
        assert claim_region(fds[0], size, 5 << 20) == (0, 5 << 20)
        assert claim_region(fds[1], size, (3 << 20) + 1) == (5 << 20, (3 << 20) + 4096)  # page rounded
        assert claim_region(fds[2], size, 12 << 20) == ((8 << 20) + 4096, 6 << 20)  # 12 -> 6 MiB free
        left = size - ((14 << 20) + 4096)
        assert claim_region(fds[3], size, 8 << 20) == ((14 << 20) + 4096, 1 << 20)  # 8 -> 4 -> 2 -> 1
        assert left < (2 << 20) and claim_region(fds[4], size, 8 << 20) is None  # under 1 MiB left
        os.close(fds[1])  # its lock goes with it: the hole is found again
        fds[1] = os.open(path, os.O_RDWR)
        assert claim_region(fds[1], size, 2 << 20) == (5 << 20, 2 << 20)
        assert claim_region(fds[4], size, 100) == ((7 << 20), 1 << 20)  # asks for 1 MiB at least
    finally:
        for fd in fds:
            os.close(fd)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000).map(lambda n: 2 * n), max_size=12),
       capacity=st.integers(1, 64).map(lambda n: 64 * n))
def test_cmb_batches_cover_every_byte_once_and_fit(sizes: list[int], capacity: int) -> None:
    batches = plan_cmb_batches(sizes, capacity)
    covered: dict[int, int] = {}
    for batch in batches:
        assert batch
        regions = sorted((at, at + length) for _, _, length, at in batch)
        assert all(at % 64 == 0 for at, _ in regions) and regions[-1][1] <= capacity
        assert all(end <= start for (_, end), (start, _) in zip(regions, regions[1:]))
        for item, offset, length, _ in batch:
            assert length > 0 and offset == covered.get(item, 0)
            covered[item] = offset + length
    assert covered == {item: size for item, size in enumerate(sizes) if size}


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20), st.one_of(st.none(), st.integers(0, 60))),
                      min_size=1, max_size=6))
def test_param_copy_overlap_check_matches_brute_force(spans: list[tuple[int, int, int | None]]) -> None:
    transfers = [Transfer("t", "grad", 0, length, at, params) for at, length, params in spans]
    grads = [(t.cmb_offset, t.cmb_offset + t.length) for t in transfers if t.length]
    params = [(t.param_cmb_offset, t.param_cmb_offset + t.length) for t in transfers
              if t.param_cmb_offset is not None and t.length]
    overlap = lambda a, b: a[0] < b[1] and b[0] < a[1]  # noqa: E731
    bad = any(overlap(p, q) for i, p in enumerate(params) for q in params[i + 1:]) or any(
        overlap(p, g) for p in params for g in grads)
    try:
        check_param_copies(transfers)
    except DeviceError as exc:
        assert bad and exc.status == Status.INVALID_FIELD
    else:
        assert not bad
