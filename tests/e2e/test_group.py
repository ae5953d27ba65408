"""Several devices, one optimizer (mount=[...]): whole tensors spread over a namespace per device, each step a group commit; crashes between the devices' commits, a device daemon killed mid-step, refusals."""
from __future__ import annotations

import contextlib
import copy
import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from cossd.client import AdminClient
from cossd.client.snapshots import create_snapshot, rollback
from cossd.protocol.group_commit import GroupDisagreementError
from cossd.trainer import AdamW, StepAbortedError

from conftest import Mount, force_unmount, start_mount, stop_mount

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("group_job.py")
sys.path.insert(0, str(JOB.parent))
import multirank_job as job  # noqa: E402  (the model, its groups and schedule)
from ranks import bits_equal, finished, mounted_device, spawn_ranks  # noqa: E402
from test_multirank import single_process  # noqa: E402

JOB_TIMEOUT_S = 240
DEVICES = 3


@pytest.fixture(scope="module")
def mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Mount]]:
    """Three devices, each its own daemon and backing; a test that kills one remounts it."""
    root = tmp_path_factory.mktemp("group")
    with contextlib.ExitStack() as stack:
        mounted = [stack.enter_context(mounted_device(root / f"device{index}", f"GROUP000{index}", 4 << 30))
                   for index in range(DEVICES)]
        yield mounted
        # A remounted device is a new Mount in the list (the stack stops the one it started).
        for device in mounted:
            stop_mount(device)


def remount(mounts: list[Mount], index: int) -> None:
    """Device `index` back after its daemon was killed: the dead mount away, a new daemon."""
    dead = mounts[index]
    force_unmount(dead.mountpoint)
    mounts[index] = start_mount(dead.backing, dead.mountpoint)


def run_job(devices: list[Mount], out: Path, namespace: str, world: int, last: int, **options: Any) -> list[int]:
    """`world` ranks of tests/e2e/group_job.py over `devices`; their exit codes."""
    config = {"mounts": [str(device.mountpoint) for device in devices], "namespace": namespace, "last": last,
              "out": str(out)} | options
    return spawn_ranks(JOB, config, world, out, JOB_TIMEOUT_S)


def committed_steps(devices: list[Mount], namespace: str) -> list[int]:
    steps = []
    for device in devices:
        with AdminClient(device.mountpoint) as admin:
            steps.append(int(admin.statistics(admin.nsid(namespace))["committed_step"]))
    return steps


def statistics(device: Mount, namespace: str) -> dict[str, Any]:
    with AdminClient(device.mountpoint) as admin:
        return admin.statistics(admin.nsid(namespace))


def all_grads(ranks: list[dict[str, Any]]) -> dict[int, list[torch.Tensor]]:
    """The gradients each step was taken with, over every run of a job (a restart's too)."""
    grads: dict[int, list[torch.Tensor]] = {}
    for saved in ranks:
        grads.update(saved["grads"])
    return grads


# ---------------------------------------------------------------------------------------------


# The placement rule on the test net (fc1.weight 327,680 elements, fc2.weight 163,840,
# fc1.bias 2,560, fc2.bias 64; blocks of 262,144): fc1.weight is split at its first block's end.
PLACED = {  # the optimizer's names for them: g0.p0, g0.p1, g1.p2, g1.p3
    2: [[("g0.p0", 262144)], [("g0.p0", 65536), ("g0.p1", 163840), ("g1.p2", 2560), ("g1.p3", 64)]],
    3: [[("g0.p0", 262144)], [("g0.p0", 65536)], [("g0.p1", 163840), ("g1.p2", 2560), ("g1.p3", 64)]],
}


@pytest.mark.parametrize("world, devices", [(1, 2), (2, 2), (2, 3), (3, 3)])
def test_a_group_equals_one_device_bit_for_bit(mounts: list[Mount], tmp_path: Path, world: int,
                                               devices: int) -> None:
    """One process, two or three ranks (DDP) over two or three devices, fc1.weight split
    across devices 0 and 1 by the placement rule: the params and masters equal a
    single-process, single-device run on the same gradients, bit for bit (two groups,
    warmup-cosine), and each device's namespace holds its pieces."""
    namespace = f"eq{world}x{devices}"
    codes = run_job(mounts[:devices], tmp_path / "job", namespace, world, 12)
    ranks = finished(tmp_path / "job", world, codes)
    for other in ranks[1:]:
        assert bits_equal(other["params"], ranks[0]["params"])
    layout = [[tuple(piece) for piece in pieces] for pieces in ranks[0]["devices"]]
    assert layout == PLACED[devices], layout
    for device, pieces in zip(mounts[:devices], layout):
        stats = statistics(device, namespace)
        assert stats["committed_step"] == 12 and stats["steps_committed"] == 12
        config = json.loads((Path(device.mountpoint) / "ns" / namespace / "config.json").read_text())
        assert [(tensor["name"], tensor["numel"]) for tensor in config["tensors"]] == pieces
    params, masters, _ = single_process(mounts[0], f"ref-{namespace}", ranks[0]["grads"], 12)
    assert bits_equal(ranks[0]["params"], params)
    assert bits_equal(ranks[0]["masters"], masters)


def test_clipping_by_the_global_norm_across_devices(mounts: list[Mount], tmp_path: Path) -> None:
    """The norm is taken over every device's tensors (one gather): within 1e-6 x max|param|
    of single-device cossd with the same clip (the sums' order differs)."""
    codes = run_job(mounts[:2], tmp_path / "job", "clip", 2, 10, clip=0.05)
    ranks = finished(tmp_path / "job", 2, codes)
    _, masters, _ = single_process(mounts[0], "ref-clip", ranks[0]["grads"], 10, clip=0.05)
    for ours, theirs in zip(ranks[0]["masters"], masters):
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-6 * float(theirs.abs().max()))
    unclipped, _, _ = single_process(mounts[0], "ref-noclip", ranks[0]["grads"], 10)
    assert not bits_equal(ranks[0]["params"], unclipped), "the clip never bit: the test proves nothing"


def test_an_overflow_skips_the_step_on_every_device_counted_once(mounts: list[Mount], tmp_path: Path) -> None:
    codes = run_job(mounts[:2], tmp_path / "job", "overflow", 2, 8, overflow={"rank": 1, "step": 3})
    ranks = finished(tmp_path / "job", 2, codes)
    for saved in ranks:
        assert saved["result"]["steps_skipped"] == 1 and saved["result"]["committed_step"] == 7
    assert committed_steps(mounts[:2], "overflow") == [7, 7]
    # The step was decided before any device saw it: no device began it.
    assert all(statistics(device, "overflow")["steps_aborted"] == 0 for device in mounts[:2])


def uninterrupted(mounts: list[Mount], tmp_path: Path, namespace: str, world: int, last: int) -> dict[str, Any]:
    codes = run_job(mounts, tmp_path / f"ref-{namespace}", f"ref-{namespace}", world, last, synthetic=True)
    return finished(tmp_path / f"ref-{namespace}", world, codes)[0]


@pytest.mark.parametrize("devices", [2, 3])
def test_a_crash_between_the_devices_commits_resumes_from_one_common_step(
        mounts: list[Mount], tmp_path: Path, devices: int) -> None:
    """kill -9 of the job after device 0 committed step 5 and before device 1 did: device 0
    at 5, the others at 4. The restarted job reverts device 0 (it still holds step 4 in its
    other copy), says so, and finishes equal to a run nobody interrupted."""
    namespace = f"between{devices}"
    codes = run_job(mounts[:devices], tmp_path / "a", namespace, 1, 9, synthetic=True,
                    kill={"stage": "between_devices", "step": 5})
    assert codes == [-signal.SIGKILL], (tmp_path / "a" / "logs.txt").read_text()[-3000:]
    assert committed_steps(mounts[:devices], namespace) == [5] + [4] * (devices - 1)
    codes = run_job(mounts[:devices], tmp_path / "b", namespace, 1, 9, synthetic=True)
    resumed = finished(tmp_path / "b", 1, codes)[0]
    assert resumed["result"]["first"] == 5
    assert any("reverted to step 4" in text for text in resumed["result"]["warnings"]), resumed["result"]["warnings"]
    assert statistics(mounts[0], namespace)["steps_reverted"] == 1
    assert committed_steps(mounts[:devices], namespace) == [9] * devices
    reference = uninterrupted(mounts[:devices], tmp_path, namespace, 1, 9)
    assert bits_equal(resumed["params"], reference["params"])
    assert bits_equal(resumed["masters"], reference["masters"])


def test_a_device_daemon_killed_mid_step(mounts: list[Mount], tmp_path: Path) -> None:
    """kill -9 of the last device's daemon once both ranks' gradients of step 4 are sent:
    the ranks fail with a clear error; with the device remounted the job resumes from one
    common step and finishes equal to an uninterrupted run."""
    devices = mounts[:2]
    namespace = "daemonkill"
    codes = run_job(devices, tmp_path / "a", namespace, 2, 8, synthetic=True,
                    kill={"stage": "daemon", "step": 4, "pid": devices[1].pid, "rank": 0})
    assert all(code == 3 for code in codes), (codes, (tmp_path / "a" / "logs.txt").read_text()[-4000:])
    errors = [(tmp_path / "a" / f"aborted{rank}.txt").read_text() for rank in range(2)]
    assert all(errors), errors
    remount(mounts, 1)
    devices = mounts[:2]
    # The daemon may die before device 1 commits step 4, or, the kill being asynchronous, just
    # after rank 1's poll committed it; each device commits once both ranks' gradients are in,
    # the two devices polled at once: any of the four.
    steps = committed_steps(devices, namespace)
    assert steps in ([3, 3], [4, 3], [3, 4], [4, 4]), steps
    codes = run_job(devices, tmp_path / "b", namespace, 2, 8, synthetic=True)
    resumed = finished(tmp_path / "b", 2, codes)
    assert resumed[0]["result"]["first"] == min(steps) + 1
    assert committed_steps(devices, namespace) == [8, 8]
    reference = uninterrupted(devices, tmp_path, namespace, 2, 8)
    for saved in resumed:
        assert bits_equal(saved["params"], reference["params"])
        assert bits_equal(saved["masters"], reference["masters"])


@pytest.mark.parametrize("stage, device", [("daemon_between", 1),
                                           pytest.param("daemon_between", 2, marks=pytest.mark.slow),
                                           pytest.param("daemon_after_commit", 0, marks=pytest.mark.slow)])
def test_a_daemon_killed_between_two_devices_commits(mounts: list[Mount], tmp_path: Path, stage: str,
                                                     device: int) -> None:
    """Three devices, fc1.weight split across devices 0 and 1: kill -9 of device 1's (or 2's)
    daemon once the device before it committed step 4 and before its own commit was asked
    for (the devices commit at once: every other device commits step 4), or of device 0's
    once it committed step 4 itself (the others then commit it, and device 0's flush fails).
    The job fails with one error naming the device and the devices ahead; with the device
    remounted, the restart brings every device to one step (reverting those one ahead) and
    finishes bit for bit as an uninterrupted run."""
    devices = mounts[:3]
    namespace = f"{stage}-{device}"
    codes = run_job(devices, tmp_path / "a", namespace, 1, 8, synthetic=True,
                    kill={"stage": stage, "step": 4, "device": device, "pid": devices[device].pid})
    assert codes == [3], (codes, (tmp_path / "a" / "logs.txt").read_text()[-4000:])
    error = (tmp_path / "a" / "aborted0.txt").read_text()
    assert error.startswith(f"DeviceLostError: on {devices[device].mountpoint}: "), error
    others = [str(other.mountpoint) for index, other in enumerate(devices) if index != device]
    if stage == "daemon_between":
        assert f"{', '.join(others)} committed step 4; restarting the job reverts them" in error, error
    else:
        assert "every device committed step 4; making it durable failed" in error, error
    remount(mounts, device)
    devices = mounts[:3]
    steps = committed_steps(devices, namespace)
    assert steps == ([3 if index == device else 4 for index in range(3)] if stage == "daemon_between"
                     else [4, 4, 4]), steps
    codes = run_job(devices, tmp_path / "b", namespace, 1, 8, synthetic=True)
    resumed = finished(tmp_path / "b", 1, codes)[0]
    assert resumed["result"]["first"] == min(steps) + 1
    if len(set(steps)) > 1:
        assert any("reverted to step 3" in text for text in resumed["result"]["warnings"])
    assert committed_steps(devices, namespace) == [8, 8, 8]
    reference = uninterrupted(devices, tmp_path, namespace, 1, 8)
    assert bits_equal(resumed["params"], reference["params"])
    assert bits_equal(resumed["masters"], reference["masters"])


def test_the_devices_of_a_step_work_at_once(mounts: list[Mount]) -> None:
    """Each phase of a group step (begin and gradients, commit, params back) runs on the
    three devices at once: every device's call waits at a barrier of three before it goes
    on, which called one device after another would break (BrokenBarrierError after its
    timeout). The steps then equal one device's, and one device's failure in a phase
    surfaces once, naming it, after the others' calls of that phase ended."""
    torch.manual_seed(0)
    model = job.Net()
    devices = [str(device.mountpoint) for device in mounts[:3]]
    optimizer = AdamW(job.groups_of(model), lr=job.BASE_LR, betas=(0.9, 0.95), mount=devices, namespace="atonce")
    model.to(torch.bfloat16)
    children = optimizer._group
    assert children is not None and len(children) == 3
    together = threading.Barrier(3, timeout=30)
    for child in children:
        for name in ("_begin_shared", "_wait_for_commit", "_read_params"):
            original = getattr(child, name)

            def met(*args: Any, original: Any = original) -> Any:
                together.wait()
                return original(*args)

            setattr(child, name, met)
    params = job.optimizer_params(optimizer)
    grads: dict[int, list[torch.Tensor]] = {}
    try:
        for step in range(1, 4):
            for group, base in zip(optimizer.param_groups, (job.BASE_LR, 2 * job.BASE_LR)):
                group["lr"] = base * job.schedule(step)
            grads[step] = job.synthetic_grads(step, params)
            for param, grad in zip(params, grads[step]):
                param.grad = grad
            optimizer.step()
        assert [child.committed_step for child in children] == [3, 3, 3]
        ours = [param.detach().clone() for param in params]
        # Device 1's commit of step 4 refused before it is asked for: one StepAbortedError
        # naming it and the two devices that committed step 4 meanwhile (a restart reverts
        # them), and device 1's step aborted.
        def refuse(step: int) -> Any:
            together.wait()
            raise StepAbortedError("the test refused this commit")

        children[1]._wait_for_commit = refuse
        for param, grad in zip(params, job.synthetic_grads(4, params)):
            param.grad = grad
        with pytest.raises(StepAbortedError) as caught:
            optimizer.step()
        text = str(caught.value)
        assert text.startswith(f"on {devices[1]}: the test refused this commit."), text
        assert f"{devices[0]}, {devices[2]} committed step 4; restarting the job reverts them" in text, text
        assert all(torch.equal(param, before) for param, before in zip(params, ours)), "params of a failed step"
        assert committed_steps(mounts[:3], "atonce") == [4, 3, 4]
    finally:
        optimizer.close()
    reference, _, _ = single_process(mounts[0], "ref-atonce", grads, 3)
    assert bits_equal(ours, reference)


def test_a_job_placed_by_whole_tensors_resumes_on_its_placement(mounts: list[Mount], tmp_path: Path) -> None:
    """A job made before tensors were split (each device a namespace of whole tensors: the
    old rule put fc1.weight alone on device 0, fc2.weight and fc1.bias on device 1, fc2.bias
    on device 2) resumes on the placement its devices record, not the new rule's, and ends
    bit for bit equal to one device trained on the same gradients throughout."""
    devices = [str(device.mountpoint) for device in mounts[:3]]
    namespace = "oldplacement"
    torch.manual_seed(0)
    model = job.Net()
    params = [param for group in job.groups_of(model) for param in group["params"]]
    names = ["g0.p0", "g0.p1", "g1.p2", "g1.p3"]
    old = [[0], [1, 2], [3]]
    # The old job: one namespace per device of its whole tensors, stepped on the same
    # gradients for 3 steps (what its group commits left on each device).
    children = []
    for mount, indices in zip(devices, old):
        groups = []
        for group in job.groups_of(model):
            mine = [index for index in indices if any(params[index] is p for p in group["params"])]
            if mine:
                options = {k: v for k, v in group.items() if k != "params"}
                groups.append(options | {"params": [params[i] for i in mine], "param_names": [names[i] for i in mine]})
        children.append(AdamW(groups, lr=job.BASE_LR, betas=(0.9, 0.95), mount=mount, namespace=namespace,
                              dtype=torch.bfloat16))
    model.to(torch.bfloat16)  # as group_job.py and single_process do, after the optimizer
    grads = {step: job.synthetic_grads(step, params) for step in range(1, 7)}
    for step in range(1, 4):
        for child, indices in zip(children, old):
            for group in child.param_groups:
                group["lr"] = (job.BASE_LR if group["weight_decay"] else 2 * job.BASE_LR) * job.schedule(step)
            for index in indices:
                params[index].grad = grads[step][index].clone()
            child.step()
    for child in children:
        child.close()
    torch.manual_seed(0)
    model = job.Net()
    optimizer = AdamW(job.groups_of(model), lr=job.BASE_LR, betas=(0.9, 0.95), mount=devices, namespace=namespace)
    model.to(torch.bfloat16)
    try:
        assert optimizer.committed_step == 3 and optimizer.restored
        assert [[(e.name, e.numel) for e in child.entries] for child in optimizer._group] == [
            [("g0.p0", 327680)], [("g0.p1", 163840), ("g1.p2", 2560)], [("g1.p3", 64)]]
        resumed = job.optimizer_params(optimizer)
        for step in range(4, 7):
            for group, base in zip(optimizer.param_groups, (job.BASE_LR, 2 * job.BASE_LR)):
                group["lr"] = base * job.schedule(step)
            for param, grad in zip(resumed, grads[step]):
                param.grad = grad.clone()
            optimizer.step()
        ours, masters = [p.detach().clone() for p in resumed], optimizer.master_weights()
    finally:
        optimizer.close()
    assert committed_steps(mounts[:3], namespace) == [6, 6, 6]
    params, reference_masters, _ = single_process(mounts[0], f"ref-{namespace}", grads, 6)
    assert bits_equal(ours, params) and bits_equal(masters, reference_masters)


def test_what_a_group_refuses(mounts: list[Mount], tmp_path: Path) -> None:
    """Refused with a clear error and nothing changed: a device named twice; more devices
    than a split by whole tensors can fill; a device that does not hold the trained
    namespace (replaced); devices two steps apart (one rolled back by a snapshot)."""
    torch.manual_seed(0)
    model = job.Net()
    first, second = str(mounts[0].mountpoint), str(mounts[1].mountpoint)
    with pytest.raises(ValueError, match="more than once"):
        AdamW(job.groups_of(model), mount=[first, first], namespace="refused")
    with pytest.raises(ValueError, match="would hold nothing"):
        AdamW([torch.nn.Parameter(torch.zeros(10))], mount=[first, second], namespace="refused")
    assert not (Path(first) / "ns" / "refused").exists()
    # Trained on two devices, then opened with another second device.
    optimizer = AdamW(job.groups_of(model), mount=[first, second], namespace="moved")
    for _ in range(2):
        for param in job.optimizer_params(optimizer):
            param.grad = torch.full_like(param, 0.01)
        optimizer.step()
    optimizer.close()
    with pytest.raises(RuntimeError, match="not the ones it was trained on"):
        AdamW(job.groups_of(model), mount=[first, str(mounts[2].mountpoint)], namespace="moved")
    assert not (Path(mounts[2].mountpoint) / "ns" / "moved").exists()
    # Two steps apart: device 1 rolled back to a snapshot of step 2 while device 0 is at 4.
    optimizer = AdamW(job.groups_of(model), mount=[first, second], namespace="moved")
    with AdminClient(second) as admin:
        create_snapshot(admin, admin.nsid("moved"), "at2")
    for _ in range(2):
        for param in job.optimizer_params(optimizer):
            param.grad = torch.full_like(param, 0.01)
        optimizer.step()
    optimizer.close()
    with AdminClient(second) as admin:
        rollback(admin, admin.nsid("moved"), "at2")
    with pytest.raises(GroupDisagreementError, match="more than one step apart"):
        AdamW(job.groups_of(model), mount=[first, second], namespace="moved")
    assert committed_steps(mounts[:2], "moved") == [4, 2]


def test_state_dict_over_several_devices(mounts: list[Mount]) -> None:
    """state_dict() reads every tensor's state from the devices that hold it (a split
    tensor's pieces joined), in torch's format (it loads into torch.optim.AdamW); loading it
    back is a no-op; another state is loaded on both devices; a bad one is refused with
    nothing changed."""
    torch.manual_seed(0)
    model = job.Net()
    devices = [str(mounts[0].mountpoint), str(mounts[1].mountpoint)]
    optimizer = AdamW(job.groups_of(model), mount=devices, namespace="statedict")
    try:
        params = job.optimizer_params(optimizer)
        for _ in range(3):
            for param in params:
                param.grad = torch.full_like(param, 0.01)
            optimizer.step()
        saved = optimizer.state_dict()
        assert sorted(saved["state"]) == list(range(len(params)))
        assert all(float(entry["step"]) == 3 for entry in saved["state"].values())
        masters = optimizer.master_weights()
        assert [tuple(m.shape) for m in masters] == [tuple(p.shape) for p in params]
        copies = [torch.nn.Parameter(m.clone()) for m in masters]
        stock = torch.optim.AdamW([{"params": copies[:2]}, {"params": copies[2:]}])
        stock.load_state_dict({k: v for k, v in saved.items() if not k.startswith("cossd")})
        assert torch.equal(stock.state[copies[3]]["exp_avg"], saved["state"][3]["exp_avg"])
        optimizer.load_state_dict(saved)  # its own state: a no-op
        other = copy.deepcopy(saved)
        other["state"][0]["exp_avg"].add_(1.0)  # fc1.weight's, split across the two devices
        optimizer.load_state_dict(other)  # another state: replaced on both devices (test_group_load.py)
        assert committed_steps(mounts[:2], "statedict") == [3, 3]
        assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], other["state"][0]["exp_avg"])
        bad = copy.deepcopy(saved)
        bad["state"][3]["exp_avg_sq"].fill_(-1.0)
        with pytest.raises(ValueError, match="negative"):
            optimizer.load_state_dict(bad)
        assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], other["state"][0]["exp_avg"])
    finally:
        optimizer.close()
