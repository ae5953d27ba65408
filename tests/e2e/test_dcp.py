"""torch.distributed.checkpoint with the cossd optimizer: get_state_dict/set_state_dict under FSDP2 and in one process, a checkpoint that references a device snapshot, bit-identical resumes after kill -9 of the job or the daemon between two saves."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, set_optimizer_state_dict)

from cossd.client import AdminClient
from cossd.client import snapshots as snapshot_calls
from cossd.trainer import AdamW
from cossd.trainer.dcp.reference import REF_KEY

from conftest import Mount
from helpers import free_port
from ranks import bits_equal, mounted_device, spawn_ranks

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("dcp_job.py")
sys.path.insert(0, str(JOB.parent))
import fsdp_job  # noqa: E402
from multirank_job import CLASSES, INPUTS  # noqa: E402

JOB_TIMEOUT_S = 300
LAST, SAVE_EVERY, KILL_AT = 7, 3, 5  # saves after steps 3 and 6; killed after 5, between them


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    with mounted_device(tmp_path_factory.mktemp("dcp"), "DCPTEST00001") as mounted:
        yield mounted


def run(device: Mount, root: Path, name: str, world: int, **options: Any) -> list[int]:
    config = {"mount": str(device.mountpoint), "namespace": name, "last": LAST, "out": str(root / name),
              "checkpoints": str(root / f"{name}-ckpt"), "save_every": SAVE_EVERY} | options
    return spawn_ranks(JOB, config, world, root / name, JOB_TIMEOUT_S)


def result(root: Path, name: str, codes: list[int]) -> dict[str, Any]:
    assert set(codes) == {0}, (codes, (root / name / "logs.txt").read_text()[-6000:])
    return torch.load(root / name / "rank0.pt")


def same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bits_equal(a["params"], b["params"]) and bits_equal(a["masters"], b["masters"])


_uninterrupted: dict[int, dict[str, Any]] = {}


def uninterrupted(device: Mount, root: Path, world: int) -> dict[str, Any]:
    """The run that never stopped, once per world size (the tests of a module share it)."""
    if world not in _uninterrupted:
        name = f"whole{world}"
        _uninterrupted[world] = result(root, name, run(device, root, name, world))
    return _uninterrupted[world]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp-runs")


def killed_and_resumed(device: Mount, root: Path, name: str, world: int) -> dict[str, Any]:
    codes = run(device, root, name, world, kill_at=KILL_AT)
    assert codes == [-signal.SIGKILL] * world, (codes, (root / name / "logs.txt").read_text()[-3000:])
    resumed = result(root, name, run(device, root, name, world, resume=True))
    assert resumed["first"] == SAVE_EVERY + 1  # from the checkpoint of step 3, not the device's step 5
    return resumed


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_job_killed_between_two_saves_resumes_bit_identical(device: Mount, root: Path, world: int) -> None:
    resumed = killed_and_resumed(device, root, f"kill{world}", world)
    assert same_run(resumed, uninterrupted(device, root, world))


@pytest.mark.slow
def test_daemon_killed_between_two_saves_resumes_bit_identical(device: Mount, root: Path) -> None:
    name, world = "daemon2", 2
    config = {"mount": str(device.mountpoint), "namespace": name, "last": LAST, "out": str(root / name),
              "checkpoints": str(root / f"{name}-ckpt"), "save_every": SAVE_EVERY, "stall_at": KILL_AT}
    (root / name).mkdir(parents=True, exist_ok=True)
    env = os.environ | {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(JOB), json.dumps(config)], env=env | {"RANK": str(r)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(world)]
    try:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not all((root / name / f"stalled{r}").exists() for r in range(world)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), "the job did not reach step 5"
            time.sleep(0.2)
        device.kill()  # kill -9 of the daemon, the job's device state at step 5 with a snapshot of step 3
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    device.restart()
    resumed = result(root, name, run(device, root, name, world, resume=True))
    assert resumed["first"] == SAVE_EVERY + 1
    assert same_run(resumed, uninterrupted(device, root, world))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(8, INPUTS, generator=generator)
        optimizer.zero_grad()
        F.mse_loss(model(x), torch.zeros(8, CLASSES)).backward()
        optimizer.step()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return fsdp_job.Net()


def test_dcp_state_is_a_reference_and_a_lost_snapshot_fails_loudly(device: Mount, tmp_path: Path) -> None:
    """In one process without a process group: get_optimizer_state_dict's dict names a device
    snapshot (no moments); loading it rolls the namespace back; a checkpoint whose snapshot
    was deleted fails naming it, and the run is left as it was."""
    model = _model()
    optimizer = AdamW(fsdp_job.groups_of(model), lr=1e-3, mount=device.mountpoint, namespace="inproc")
    try:
        _train(model, optimizer, range(1, 3))
        saved = get_optimizer_state_dict(model, optimizer)
        tensors = [t for s in saved["state"].values() for t in s.values()]
        assert sum(t.numel() * t.element_size() for t in tensors) < 1024  # a reference, not 12 B/param
        assert not any("exp_avg" in s for s in saved["state"].values())
        assert optimizer.committed_step == 2  # DCP's _init_optim_state took no step
        dcp.save({"optim": saved}, checkpoint_id=str(tmp_path / "ck"))
        at_save = [m.clone() for m in optimizer.master_weights()]
        _train(model, optimizer, range(3, 5))
        template = get_optimizer_state_dict(model, optimizer)
        dcp.load({"optim": template}, checkpoint_id=str(tmp_path / "ck"))
        set_optimizer_state_dict(model, optimizer, template)
        assert optimizer.committed_step == 2 and bits_equal(optimizer.master_weights(), at_save)
        # The snapshot the checkpoint names, deleted: the load fails naming it, nothing changes.
        [reference] = [s[REF_KEY] for s in saved["state"].values() if REF_KEY in s]
        name = json.loads(bytes(reference.numpy()).rstrip(b"\0"))["snapshot"]
        with AdminClient(device.mountpoint) as admin:
            snapshot_calls.delete_snapshot(admin, admin.nsid("inproc"), name)
        _train(model, optimizer, range(3, 4))
        before = [m.clone() for m in optimizer.master_weights()]
        template = get_optimizer_state_dict(model, optimizer)
        dcp.load({"optim": template}, checkpoint_id=str(tmp_path / "ck"))
        with pytest.raises(RuntimeError, match=f"snapshot '{name}' of namespace 'inproc' \\(step 2\\), is gone"):
            set_optimizer_state_dict(model, optimizer, template)
        assert optimizer.committed_step == 3 and bits_equal(optimizer.master_weights(), before)
        # A direct state_dict() is still torch's full format, for accelerate and stock PyTorch.
        assert "exp_avg" in optimizer.state_dict()["state"][0]
    finally:
        optimizer.close()


@pytest.mark.slow
def test_checkpoint_bytes_stall_and_restore_against_torch_adamw(device: Mount, root: Path, figures: list[str]) -> None:
    """What a DCP checkpoint of the FSDP2 job writes with torch.optim.AdamW and with cossd."""
    measured = {}
    for kind in ("torch", "cossd"):
        name = f"bytes-{kind}"
        options = {"optimizer": "torch"} if kind == "torch" else {}
        saved = result(root, name, run(device, root, name, 2, **options))
        step3 = root / f"{name}-ckpt" / "step3"
        size = sum(p.stat().st_size for p in step3.rglob("*") if p.is_file())
        resumed = result(root, name, run(device, root, name, 2, resume=True, last=SAVE_EVERY + 1, **options))
        measured[kind] = (size, saved["timings"]["save_s"], resumed["timings"]["restore_s"])
    params = sum(p.numel() for p in _model().parameters())
    torch_bytes, cossd_bytes = measured["torch"][0], measured["cossd"][0]
    # cossd: the model's FP32 params and DCP's metadata; torch: the params and both moments.
    assert cossd_bytes < params * 4 + 128 * 1024 and torch_bytes > params * 12
    for kind, (size, save_s, restore_s) in measured.items():
        figures.append(f"DCP FSDP2 2 ranks {params} params, {kind}: checkpoint {size} B, save {save_s:.2f} s, "
                       f"restore {restore_s:.2f} s")


def test_the_flattened_form_torchtitan_uses_round_trips(device: Mount, tmp_path: Path) -> None:
    """flatten_optimizer_state_dict=True (torchtitan's OptimizersContainer): the flat dict
    carries the reference, and loading it rolls back to the saved step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    model = _model()
    optimizer = AdamW(fsdp_job.groups_of(model), lr=1e-3, mount=device.mountpoint, namespace="flat")
    try:
        _train(model, optimizer, range(1, 3))
        saved = get_optimizer_state_dict(model, optimizer, options=flat)
        assert f"state.fc1.weight.{REF_KEY}" in saved and not any("exp_avg" in key for key in saved)
        dcp.save({"optim": saved}, checkpoint_id=str(tmp_path / "ck"))
        at_save = [m.clone() for m in optimizer.master_weights()]
        _train(model, optimizer, range(3, 5))
        template = get_optimizer_state_dict(model, optimizer, options=flat)
        dcp.load({"optim": template}, checkpoint_id=str(tmp_path / "ck"))
        set_optimizer_state_dict(model, optimizer, template, options=flat)
        assert optimizer.committed_step == 2 and bits_equal(optimizer.master_weights(), at_save)
    finally:
        optimizer.close()


def _dcp_snapshots(device: Mount, namespace: str) -> list[str]:
    with AdminClient(device.mountpoint) as admin:
        listed = snapshot_calls.snapshots(admin, admin.nsid(namespace)).get(namespace, [])
    return sorted(s["tag"] for s in listed if s["tag"].startswith("dcp-"))


def test_dcp_keep_1_never_drops_the_snapshot_a_resume_loads(device: Mount, tmp_path: Path) -> None:
    """optimizer.dcp_keep = 1 through the documented crash and resume, twice: the load template
    (get_state_dict, which takes a snapshot too) does not push out the snapshot the checkpoint
    names; the next save after the resume prunes the old save and the templates."""

    def make() -> tuple[torch.nn.Module, AdamW]:
        model = _model()
        optimizer = AdamW(fsdp_job.groups_of(model), lr=1e-3, mount=device.mountpoint, namespace="keep1")
        optimizer.dcp_keep = 1
        return model, optimizer

    def resume(model: torch.nn.Module, optimizer: AdamW, checkpoint: Path) -> None:
        template = get_optimizer_state_dict(model, optimizer)
        dcp.load({"optim": template}, checkpoint_id=str(checkpoint))
        set_optimizer_state_dict(model, optimizer, template)

    model, optimizer = make()
    try:
        _train(model, optimizer, range(1, 3))
        dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(tmp_path / "s2"))
        at_save = [m.clone() for m in optimizer.master_weights()]
        [saved] = _dcp_snapshots(device, "keep1")
        _train(model, optimizer, range(3, 4))  # then the job dies
    finally:
        optimizer.close()
    for _crash in (1, 2):  # resumed from the step-2 save, killed again after step 3
        model, optimizer = make()
        try:
            assert optimizer.committed_step == 3
            resume(model, optimizer, tmp_path / "s2")
            assert optimizer.committed_step == 2 and bits_equal(optimizer.master_weights(), at_save)
            assert saved in _dcp_snapshots(device, "keep1")
            _train(model, optimizer, range(3, 4))
        finally:
            optimizer.close()
    model, optimizer = make()
    try:
        resume(model, optimizer, tmp_path / "s2")
        _train(model, optimizer, range(3, 6))
        dcp.save({"optim": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(tmp_path / "s5"))
        at_five = [m.clone() for m in optimizer.master_weights()]
        # The earlier saves and templates: only the newest one of an earlier step stays.
        left = _dcp_snapshots(device, "keep1")
        assert len(left) == 2 and any(tag.startswith("dcp-5-") for tag in left), left
        _train(model, optimizer, range(6, 8))
    finally:
        optimizer.close()
    model, optimizer = make()
    try:
        resume(model, optimizer, tmp_path / "s5")
        assert optimizer.committed_step == 5 and bits_equal(optimizer.master_weights(), at_five)
    finally:
        optimizer.close()
