"""load_state_dict of another state in a job of torch.distributed ranks (FSDP2 or DDP's sharded optimizer), on one device and over several: it equals the same load in one process on one device, bit for bit."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from conftest import Mount
from cossd.trainer import AdamW

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("sharded_load_job.py")
sys.path.insert(0, str(JOB.parent))
import fsdp_job as job  # noqa: E402
import sharded_load_job as load_job  # noqa: E402
from ranks import bits_equal, finished, mounted_device, spawn_ranks  # noqa: E402

LOADED_STEP = 7
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Mount]]:
    root = tmp_path_factory.mktemp("shardedload")
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(mounted_device(root / f"device{index}", f"SLOAD000{index}", 2 << 30))
               for index in range(2)]


def synthetic_grads(step: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) * 1e-2 for p in params]


def other_state(mount: Mount, tmp_path: Path, namespace: str) -> Path:
    """Another run's state: the same model trained 7 steps on other gradients with another
    lr, in one process, as state_dict() gives it (moments, masters, step 7), in a file."""
    torch.manual_seed(1)
    model = job.Net()
    optimizer = AdamW(job.groups_of(model), lr=0.5 * job.BASE_LR, betas=(0.9, 0.95), mount=mount.mountpoint,
                      namespace=namespace)
    try:
        params = job.params_of(optimizer)
        for step in range(1, LOADED_STEP + 1):
            for param, grad in zip(params, synthetic_grads(step, params)):
                param.grad = grad
            optimizer.step()
        path = tmp_path / "state.pt"
        torch.save(optimizer.state_dict(), path)
        return path
    finally:
        optimizer.close()


def one_process(mount: Mount, namespace: str, state: Path,
                grads: dict[int, list[torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One process on one device: the same state loaded, the same 3 steps after it."""
    torch.manual_seed(0)
    model = job.Net()
    optimizer = AdamW(job.groups_of(model), lr=job.BASE_LR, betas=(0.9, 0.95), mount=mount.mountpoint,
                      namespace=namespace)
    try:
        optimizer.load_state_dict(torch.load(state))
        params = job.params_of(optimizer)
        for step in range(LOADED_STEP + 1, LOADED_STEP + 4):
            for group, base in zip(optimizer.param_groups, (job.BASE_LR, 2 * job.BASE_LR)):
                group["lr"] = base * job.schedule(step)
            for param, grad in zip(params, grads[step]):
                param.grad = grad.clone()
            optimizer.step()
        return [p.detach().clone() for p in params], optimizer.master_weights()
    finally:
        optimizer.close()


@pytest.mark.parametrize("mode,world,count", [("fsdp", 2, 2), ("fsdp", 1, 1), ("ddp", 2, 1)])
def test_a_sharded_job_loads_another_state_as_one_process_does(devices: list[Mount], tmp_path: Path, mode: str,
                                                               world: int, count: int) -> None:
    """FSDP2 at 2 ranks over 2 devices (fc1.weight split across them) and at 1 rank on one
    device (fully_shard over a group of one), and DDP's sharded optimizer at 2 ranks on one
    device: 3 steps, then another run's state (step 7, other masters, moments and lr) loaded,
    then 3 more steps: every rank's params, and the masters, equal one process on one device
    that loaded the same state and took the same steps, bit for bit; every device at step 10."""
    namespace = f"sload-{mode}{world}x{count}"
    state = other_state(devices[0], tmp_path, f"{namespace}-source")
    mounts = str(devices[0].mountpoint) if count == 1 else [str(device.mountpoint) for device in devices[:count]]
    out = tmp_path / "job"
    ranks = finished(out, world, spawn_ranks(JOB, {"mounts": mounts, "namespace": namespace, "mode": mode,
                                                   "state": str(state), "out": str(out)}, world, out, JOB_TIMEOUT_S))
    assert all(r["committed_step"] == LOADED_STEP + 3 for r in ranks)
    assert sorted(ranks[0]["grads"]) == [*range(1, load_job.BEFORE_LOAD + 1), 8, 9, 10]
    params, masters = one_process(devices[0], f"{namespace}-ref", state, ranks[0]["grads"])
    for r in ranks:
        assert bits_equal(r["params"], params)
        assert bits_equal(r["masters"], masters)
    for device in devices[:count]:
        assert (device.mountpoint / "ns" / namespace / "step").read_text().strip() == str(LOADED_STEP + 3)
        assert not (device.mountpoint / "ns" / f"{namespace}.cossd-load").exists()
