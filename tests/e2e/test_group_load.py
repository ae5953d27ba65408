"""load_state_dict of another state over several devices (mount=[...], fc1.weight split across two): it equals the same load on one device, and a kill -9 at any stage of the group's replace leaves the old state on every device or the new one on every device."""
from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from conftest import Mount, stop_mount
from cossd.trainer import AdamW

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("group_load_job.py")
sys.path.insert(0, str(JOB.parent))
import group_load_job as load_job  # noqa: E402
import multirank_job as job  # noqa: E402
from ranks import bits_equal, mounted_device, spawn_ranks  # noqa: E402

# The stages of replace_group over two devices, in order: the new state prepared on device 0
# then device 1 (the old run still whole everywhere), then each device switched.
PREPARE = [f"{stage}@{device}" for device in (0, 1) for stage in ("created", "filled", "began", "sealed", "snapshotted")]
SWITCH = [f"{stage}@{device}" for device in (0, 1) for stage in ("old_deleted", "cloned", "switched")] + ["done"]
FAST = ["snapshotted@1", "old_deleted@0"]  # the last stage that keeps the old state, the first that gives the new


@pytest.fixture(scope="module")
def mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Mount]]:
    root = tmp_path_factory.mktemp("groupload")
    with contextlib.ExitStack() as stack:
        mounted = [stack.enter_context(mounted_device(root / f"device{index}", f"GLOAD000{index}", 2 << 30))
                   for index in range(2)]
        yield mounted
        for device in mounted:
            stop_mount(device)


def paths(mounts: list[Mount]) -> list[str]:
    return [str(device.mountpoint) for device in mounts]


def state_of(saved: dict[str, Any]) -> tuple[list[torch.Tensor], list[float]]:
    """A state dict's masters and moments in param order, and its steps."""
    order = sorted(saved["cossd_master"])
    tensors = [saved["cossd_master"][index].reshape(-1) for index in order]
    tensors += [saved["state"][index][role].reshape(-1) for index in order for role in ("exp_avg", "exp_avg_sq")]
    return tensors, [float(saved["state"][index]["step"]) for index in order]


def leftovers(mounts: list[Mount]) -> list[str]:
    return [name.name for device in mounts for name in (Path(device.mountpoint) / "ns").iterdir()
            if name.name.endswith(".cossd-load")]


def train(optimizer: AdamW, steps: range) -> None:
    params = job.optimizer_params(optimizer)
    for step in steps:
        for param, grad in zip(params, job.synthetic_grads(step, params)):
            param.grad = grad
        optimizer.step()


def test_a_load_over_two_devices_equals_the_same_load_on_one(mounts: list[Mount]) -> None:
    """Another run's state (other masters, moments, step 7, another lr) loaded over two
    devices, then 3 steps: params, masters and moments equal one device that loaded the same
    state and took the same steps, bit for bit; each device is at step 10; nothing staged is left."""
    group = load_job.open_group({"mounts": paths(mounts), "namespace": "load-eq"})
    single = load_job.open_group({"mounts": str(mounts[0].mountpoint), "namespace": "load-eq-ref"})
    try:
        train(group, range(1, 4))
        other = load_job.other_state(group.state_dict())
        for optimizer in (group, single):
            optimizer.load_state_dict(other)
            assert optimizer.committed_step == load_job.LOADED_STEP
            assert optimizer.param_groups[0]["lr"] == 0.5 * job.BASE_LR
            assert bits_equal(state_of(optimizer.state_dict())[0], state_of(other)[0])
            train(optimizer, range(8, 11))
        ours, theirs = group.state_dict(), single.state_dict()
        assert bits_equal(state_of(ours)[0], state_of(theirs)[0]) and state_of(ours)[1] == [10.0] * 4
        assert bits_equal([p.detach() for p in job.optimizer_params(group)],
                          [p.detach() for p in job.optimizer_params(single)])
        assert [child.committed_step for child in group._group] == [10, 10]
        assert [len(child.entries) for child in group._group] == [1, 4]  # fc1.weight split
        assert leftovers(mounts) == []
    finally:
        group.close()
        single.close()


def test_two_ranks_load_over_two_devices(mounts: list[Mount], tmp_path: Path) -> None:
    """Two ranks (gloo) load another state over two devices (rank 0 replaces it on both,
    each rank reads its params), then take 3 steps: both ranks' params and the devices' state
    equal one process that loads the same state on one device and takes the same steps."""
    out = tmp_path / "job"
    codes = spawn_ranks(JOB, {"mounts": paths(mounts), "namespace": "load-ranks", "stage": "never",
                              "out": str(out), "then": 3}, 2, out, 240)
    assert codes == [0, 0], (out / "logs.txt").read_text()[-4000:]
    ranks = [torch.load(out / f"rank{rank}.pt") for rank in range(2)]
    other = torch.load(out / "states.pt")["b"]
    single = load_job.open_group({"mounts": str(mounts[0].mountpoint), "namespace": "load-ranks-ref"})
    try:
        single.load_state_dict(other)
        train(single, range(load_job.LOADED_STEP + 1, load_job.LOADED_STEP + 4))
        params, theirs = [p.detach().clone() for p in job.optimizer_params(single)], single.state_dict()
    finally:
        single.close()
    for saved in ranks:
        assert bits_equal(saved["params"], params)
        assert bits_equal(state_of(saved["state"])[0], state_of(theirs)[0])
    assert leftovers(mounts) == []


def killed_at(mounts: list[Mount], tmp_path: Path, stage: str) -> None:
    namespace = f"load-kill-{stage.replace('@', '-')}"
    out = tmp_path / "job"
    codes = spawn_ranks(JOB, {"mounts": paths(mounts), "namespace": namespace, "stage": stage, "out": str(out)},
                        1, out, 240)
    log = (out / "logs.txt").read_text()[-4000:]
    if stage == "never":
        assert codes == [0], log
    else:
        assert codes == [-9], log
    states = torch.load(out / "states.pt")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        optimizer = load_job.open_group({"mounts": paths(mounts), "namespace": namespace})
    try:
        found, steps = state_of(optimizer.state_dict())
        new = stage == "never" or stage in SWITCH
        expected = states["b" if new else "a"]
        assert bits_equal(found, state_of(expected)[0]), f"{stage}: neither whole state"
        assert steps == state_of(expected)[1]
        step = load_job.LOADED_STEP if new else load_job.TRAINED_STEPS
        assert optimizer.committed_step == step and [c.committed_step for c in optimizer._group] == [step, step]
        assert leftovers(mounts) == []
        texts = [str(w.message) for w in seen]
        if stage in PREPARE:
            assert any("every device keeps the old run" in text for text in texts), texts
        elif stage in SWITCH[:-2]:  # at switched@1 and done nothing was left to finish
            assert any("every device holds the new run" in text for text in texts), texts
        train(optimizer, range(step + 1, step + 3))  # and the job goes on from there
        assert optimizer.committed_step == step + 2
    finally:
        optimizer.close()


@pytest.mark.parametrize("stage", FAST)
def test_a_kill_during_the_group_load_leaves_one_whole_state(mounts: list[Mount], tmp_path: Path, stage: str) -> None:
    """kill -9 of the job at a stage of the load: at the last stage before any switch (every
    device still holds the old state) and at the first stage of the switch (device 0's old run
    deleted: the new state everywhere; the other stages are slow). The next open leaves every
    device on one whole state (the old one, or the new one) and says which."""
    killed_at(mounts, tmp_path, stage)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [stage for stage in PREPARE + SWITCH if stage not in FAST])
def test_a_kill_at_every_other_stage_of_the_group_load(mounts: list[Mount], tmp_path: Path, stage: str) -> None:
    killed_at(mounts, tmp_path, stage)
