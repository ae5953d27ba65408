"""Mount tier: the standard face on a real mount. A trainer through Execute Program
(AdamW(transport="cp")) trains bit for bit like the vendor CMB_WRITE path; a memory
namespace's data file is its bytes; kill -9 of the daemon in the middle of an Execute
recovers like a vendor step."""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from conftest import Mount, start_mount, stop_mount
from cossd.client import AdminClient
from cossd.client.computational import TRAINER_COMPUTE_NAMESPACE, ComputationalClient
from cossd.emulator import Device
from cossd.trainer import AdamW
from helpers import pread_all, run_cli, tensor_dir


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Mount]:
    backing = tmp_path / "backing"
    Device.format(backing)
    mounted = start_mount(backing, tmp_path / "mnt")
    try:
        yield mounted
    finally:
        stop_mount(mounted)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(200, 500), torch.nn.GELU(), torch.nn.Linear(500, 17)).to(torch.bfloat16)


@pytest.mark.mount
def test_training_through_execute_program_is_bit_identical_to_the_vendor_path(mounted: Mount) -> None:
    models = [_model(0), _model(0)]
    optimizers = [AdamW(models[0].parameters(), mount=mounted.mountpoint, namespace="vendor", lr=1e-3,
                        weight_decay=0.1),
                  AdamW(models[1].parameters(), mount=mounted.mountpoint, namespace="cp", lr=1e-3,
                        weight_decay=0.1, transport="cp")]
    try:
        data = torch.randn(8, 200, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        for step in range(1, 6):
            for optimizer in optimizers:
                optimizer.param_groups[0]["lr"] = 1e-3 * step  # a schedule: the hyperparameters travel too
            losses = []
            for model, optimizer in zip(models, optimizers):
                optimizer.zero_grad()
                loss = model(data).float().square().mean()
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
            assert losses[0] == losses[1], step
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
        with AdminClient(mounted.mountpoint) as admin:
            namespaces = {ns["name"]: ns for ns in admin.describe()["namespaces"]}
            assert namespaces["cp"]["committed_step"] == namespaces["vendor"]["committed_step"] == 5
            assert namespaces[TRAINER_COMPUTE_NAMESPACE]["kind"] == "compute"
        names = sorted(os.listdir(mounted.mountpoint / "ns" / "cp" / "tensors"))
        assert names and names == sorted(os.listdir(mounted.mountpoint / "ns" / "vendor" / "tensors"))
        for name in names:
            for role in ("master", "exp_avg", "exp_avg_sq", "param"):
                assert pread_all(tensor_dir(mounted.mountpoint, "vendor", name) / role) == \
                    pread_all(tensor_dir(mounted.mountpoint, "cp", name) / role), (name, role)
    finally:
        for optimizer in optimizers:
            optimizer.close()


@pytest.mark.mount
def test_memory_namespace_data_file_is_its_bytes(mounted: Mount) -> None:
    with AdminClient(mounted.mountpoint) as admin:
        cp = ComputationalClient(admin)
        slm = cp.ensure_namespace("slm", "memory", capacity_bytes=1 << 16)
        cp.write(slm, 4096, b"0123456789abcdef")
        data = mounted.mountpoint / "ns" / "slm" / "data"
        assert data.stat().st_size == 1 << 16
        with open(data, "rb") as file:
            file.seek(4096)
            assert file.read(16) == b"0123456789abcdef"
        config = json.loads((mounted.mountpoint / "ns" / "slm" / "config.json").read_text())
        assert config["kind"] == "memory" and config["capacity_bytes"] == 1 << 16


@pytest.mark.mount
@pytest.mark.slow
def test_kill_9_mid_execute_recovers_like_a_vendor_step(mounted: Mount) -> None:
    """Execute Program steps of a 16M-element namespace, the daemon killed -9 while one runs:
    the remount serves the step before or the step itself, whole (master and params agree
    with a replay of that many steps through the vendor CMB_WRITE on a second device)."""
    numel = 16 << 20
    rng = np.random.default_rng(0)
    master = rng.standard_normal(numel, dtype=np.float32)
    grads = [(rng.standard_normal(numel) * 0.01).astype(np.float16) for _ in range(3)]

    def prepare(admin: AdminClient, name: str) -> int:
        nsid = admin.create_namespace({"name": name, "tensors": [["w", numel]], "hyperparameters": {"lr": 1e-2}})
        with open(tensor_dir(mounted.mountpoint, name, "w") / "master", "r+b") as file:
            file.write(master.tobytes())
        return nsid

    admin = AdminClient(mounted.mountpoint)
    try:
        nsid = prepare(admin, "k")
        cp = ComputationalClient(admin)
        compute = cp.ensure_namespace("c", "compute")
        window = cp.ensure_namespace("w", "memory", cmb=True)
        cp.activate(compute)
        mapping = admin.cmb()
        assert mapping is not None
        ranges = [(window, 0, 2 * numel), (nsid, 0, 4 * numel), (nsid, 0, 4 * numel), (nsid, 0, 4 * numel),
                  (window, 2 * numel, 2 * numel)]
        for step in (1, 2):
            mapping.array[: 2 * numel] = grads[step - 1].view(np.uint8)
            cp.execute(compute, ranges=ranges, step=step)
        mapping.array[: 2 * numel] = grads[2].view(np.uint8)
        killer = threading.Timer(0.05, os.kill, (mounted.pid, signal.SIGKILL))
        killer.start()
        try:
            cp.execute(compute, ranges=ranges, step=3)
        except OSError:  # the daemon died under the command
            pass
        killer.join()
        mapping.close()
    finally:
        try:
            admin.close()
        except OSError:  # the daemon is gone
            pass
    stop_mount(mounted)
    mounted.restart()
    with AdminClient(mounted.mountpoint) as admin:
        step = {ns["name"]: ns for ns in admin.describe()["namespaces"]}["k"]["committed_step"]
        assert step in (2, 3)
        got = pread_all(tensor_dir(mounted.mountpoint, "k", "w") / "master")
        # The same steps through the vendor path on a fresh namespace of this device.
        ref = prepare(admin, "ref")
        mapping = admin.cmb()
        for index in range(step):
            mapping.array[: 2 * numel] = grads[index].view(np.uint8)
            admin.cmb_write(ref, [{"tensor": "w", "length": 2 * numel, "cmb_offset": 0}])
        mapping.close()
        assert pread_all(tensor_dir(mounted.mountpoint, "ref", "w") / "master") == got
        assert pread_all(tensor_dir(mounted.mountpoint, "ref", "w") / "param") == \
            pread_all(tensor_dir(mounted.mountpoint, "k", "w") / "param")
        # The compute namespace came back, its program not active (controller state).
        assert ComputationalClient(admin).identify(compute)["programs"][0]["activated"] is False


@pytest.mark.mount
def test_cli_verbs(mounted: Mount, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with AdminClient(mounted.mountpoint) as admin:
        cp = ComputationalClient(admin)
        cp.ensure_namespace("c", "compute")
        cp.ensure_namespace("slm", "memory", capacity_bytes=8192)
    code, out, _ = run_cli(capsys, "cp-activate", mounted.mountpoint, "c")
    assert code == 0 and "activated" in out
    code, out, _ = run_cli(capsys, "cp-list-programs", mounted.mountpoint, "c", "-o", "json")
    listing = json.loads(out)
    assert code == 0 and listing["programs"][0]["activated"] and listing["fields"]["maxpb"] == 0
    source = tmp_path / "bytes"
    source.write_bytes(b"cossd-cp" * 4)
    code, out, _ = run_cli(capsys, "slm-write", mounted.mountpoint, "slm", "--offset", "0x100", "--input-file", source)
    assert code == 0 and json.loads(run_cli(capsys, "slm-read", mounted.mountpoint, "slm", "--offset", "0x100",
                                            "--length", 32, "-o", "json")[1])["data"] == (b"cossd-cp" * 4).hex()
    # The memory namespace's SLM Identify (CNS 05h, CSI 03h): JSON and nvme-cli style lines.
    code, out, _ = run_cli(capsys, "slm-id-ns", mounted.mountpoint, "slm", "-o", "json")
    ident = json.loads(out)
    assert code == 0 and ident["fields"]["msz"] == 8192 and ident["copy_formats"] == [2, 3, 4]
    assert ident["volatile"] is True and ident["cmb_window"] is False
    code, out, _ = run_cli(capsys, "slm-id-ns", mounted.mountpoint, "slm")
    assert code == 0 and "msz   : 8192" in out and "mgran : 4" in out and "copy formats: 2h, 3h, 4h" in out
    code, _, err = run_cli(capsys, "slm-id-ns", mounted.mountpoint, "c")
    assert code == 1 and "NAMESPACE_KIND_MISMATCH" in err
    # Every verb of the face has its --help.
    for verb in ("cp-list-programs", "cp-activate", "cp-exec", "slm-id-ns", "slm-read", "slm-write"):
        code, out, _ = run_cli(capsys, verb, "--help")
        assert code == 0 and f"cossd {verb}" in out and "--output-format" in out, verb
    # A refusal: one line naming the status, exit 1, as every verb.
    code, _, err = run_cli(capsys, "slm-read", mounted.mountpoint, "slm", "--offset", 2, "--length", 4)
    assert code == 1 and "INVALID_FIELD" in err
    code, _, err = run_cli(capsys, "cp-exec", mounted.mountpoint, "c", "--range", "99:0:4", "--range", "99:0:4",
                           "--range", "99:0:4", "--range", "99:0:4", "--range", "99:0:4")
    assert code == 1 and "INVALID_MEMORY_NAMESPACE" in err
