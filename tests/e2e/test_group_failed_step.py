"""A step() that fails past its begin: a group commit that one device refused (the devices a step
apart), a read-back of the committed params that failed. Nothing records, loads or trains on a
state mixing steps: the optimizer refuses (InconsistentStateError) until a restart reconciles the
devices, or re-reads the params where every device is at its step; a DCP snapshot mixing steps
is refused. Each run is compared with torch.optim.AdamW."""
from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from conftest import Mount, stop_mount
from cossd.client import AdminClient
from cossd.client.snapshots import create_snapshot
from cossd.protocol.entries import Opcode
from cossd.tools.verbs.inject import arm_injection, clear_injections
from cossd.trainer import AdamW, InconsistentStateError
from cossd.trainer.dcp import group as dcp_group
from cossd.trainer.dcp.reference import REF_KEY, _encode

pytestmark = pytest.mark.mount

sys.path.insert(0, str(Path(__file__).parent))
from ranks import mounted_device  # noqa: E402

READ = 2  # the I/O queue's READ opcode: a tensor file's read (the params back)


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Mount]]:
    root = tmp_path_factory.mktemp("failedstep")
    with contextlib.ExitStack() as stack:
        mounted = [stack.enter_context(mounted_device(root / f"device{index}", f"FAILSTEP{index}", 1 << 30))
                   for index in range(2)]
        yield mounted
        for device in mounted:
            stop_mount(device)


def model_() -> torch.nn.Module:
    torch.manual_seed(0)
    # 64 + 8 + 32 + 4 elements: fc0.weight on device 0, the rest on device 1.
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def grads(model: torch.nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(step)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def open_(devices: list[Mount], namespace: str, model: torch.nn.Module, count: int = 2) -> AdamW:
    mounts = [str(device.mountpoint) for device in devices[:count]]
    return AdamW(model.parameters(), lr=1e-2, mount=mounts if count > 1 else mounts[0], namespace=namespace,
                 use_cmb=False, grad_dtype="fp32")


def torch_run(steps: range) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    model = model_()
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in steps:
        grads(model, step)
        reference.step()
    return model, reference


def device_steps(devices: list[Mount], namespace: str, count: int = 2) -> list[int]:
    steps = []
    for device in devices[:count]:
        with AdminClient(device.mountpoint) as admin:
            steps.append(int(admin.statistics(admin.nsid(namespace))["committed_step"]))
    return steps


def close_to(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> bool:
    return all(torch.allclose(a.detach(), b.detach(), rtol=0, atol=1e-6) for a, b in zip(ours, theirs))


@contextlib.contextmanager
def armed(device: Mount, namespace: str, opcode: int, status: str, **options: object) -> Iterator[None]:
    with AdminClient(device.mountpoint) as admin:
        arm_injection(admin, opcode, status, nsid=admin.nsid(namespace), **options)
    try:
        yield
    finally:
        with AdminClient(device.mountpoint) as admin:
            clear_injections(admin)


def partial_commit(devices: list[Mount], namespace: str) -> tuple[torch.nn.Module, AdamW, dict]:
    """Steps 1-3, then step 4 committed by device 0 only (device 1's COMMIT_STEP refused)."""
    model = model_()
    optimizer = open_(devices, namespace, model)
    for step in (1, 2, 3):
        grads(model, step)
        optimizer.step()
    at3 = optimizer.state_dict()
    grads(model, 4)
    with armed(devices[1], namespace, Opcode.COMMIT_STEP, "INTERNAL_ERROR", count=50):
        with pytest.raises(Exception, match="committed step 4; restarting the job reverts it"):
            optimizer.step()
    assert device_steps(devices, namespace) == [4, 3] and optimizer.committed_step == 3
    return model, optimizer, at3


def test_a_partial_group_commit_refuses_what_would_mix_steps_until_a_restart(devices: list[Mount]) -> None:
    """state_dict(), master_weights(), a DCP save, a no-op load and step() all refuse, saying
    what happened and that a restart reconciles; nothing moves; the restart reverts device 0 and
    the job goes on equal to torch.optim.AdamW."""
    namespace = "partial"
    model, optimizer, at3 = partial_commit(devices, namespace)
    try:
        for call in (optimizer.state_dict, optimizer.master_weights, lambda: get_optimizer_state_dict(model, optimizer)):
            with pytest.raises(InconsistentStateError) as caught:
                call()
            text = str(caught.value)
            assert "refused" in text and "4 (" in text and "3 (" in text, text
            assert "restart the job" in text and "one committed step" in text, text
        with pytest.raises(InconsistentStateError, match="a DCP save or load template"):
            get_optimizer_state_dict(model, optimizer)
        grads(model, 5)
        with pytest.raises(InconsistentStateError, match=r"step\(\) refused"):
            optimizer.step()
        # The members' own snapshot refuses the mix too (a save that skipped the optimizer's check).
        with pytest.raises(RuntimeError, match="would mix steps under one label"):
            dcp_group.take([child.files for child in optimizer._group], 3, "dcp-", None)
        assert device_steps(devices, namespace) == [4, 3]
    finally:
        optimizer.close()
    # The restart: device 0 reverted to step 3, then steps 4 and 5 as torch takes them.
    model = model_()
    with pytest.warns(RuntimeWarning, match="reverted to step 3"):
        optimizer = open_(devices, namespace, model)
    try:
        assert optimizer.committed_step == 3 and device_steps(devices, namespace) == [3, 3]
        for step in (4, 5):
            grads(model, step)
            optimizer.step()
        reference, _ = torch_run(range(1, 6))
        assert close_to(optimizer.master_weights(), list(reference.parameters()))
        assert close_to(list(model.parameters()), list(reference.parameters()))
    finally:
        optimizer.close()


def test_a_full_load_after_a_partial_group_commit_replaces_every_device(devices: list[Mount]) -> None:
    """In the same process, load_state_dict of a whole torch-format state (the step-3 one taken
    before) replaces every device's state: the job goes on equal to torch.optim.AdamW."""
    namespace = "partialload"
    model, optimizer, at3 = partial_commit(devices, namespace)
    try:
        optimizer.load_state_dict(at3)
        assert optimizer.committed_step == 3 and device_steps(devices, namespace) == [3, 3]
        for step in (4, 5):
            grads(model, step)
            optimizer.step()
        reference, _ = torch_run(range(1, 6))
        assert close_to(optimizer.master_weights(), list(reference.parameters()))
        assert close_to(list(model.parameters()), list(reference.parameters()))
    finally:
        optimizer.close()


def test_a_dcp_snapshot_mixing_steps_is_refused(devices: list[Mount]) -> None:
    """A snapshot tag taken on both devices while they were a step apart (what a save after the
    partial commit would have made) is refused by the load, naming the steps; nothing changes."""
    namespace = "mixedsnap"
    model, optimizer, _ = partial_commit(devices, namespace)
    serials = []
    for device in devices:
        with AdminClient(device.mountpoint) as admin:
            create_snapshot(admin, admin.nsid(namespace), "dcp-3-mixed")
            serials.append(str(admin.describe()["identity"]["serial"]))
    optimizer.close()
    model = model_()
    with pytest.warns(RuntimeWarning, match="reverted to step 3"):
        optimizer = open_(devices, namespace, model)
    try:
        for step in (4, 5):
            grads(model, step)
            optimizer.step()
        template = get_optimizer_state_dict(model, optimizer)
        first = next(index for index, entry in template["state"].items() if REF_KEY in entry)
        template["state"][first][REF_KEY] = _encode({"cossd": 1, "namespace": namespace, "snapshot": "dcp-3-mixed",
                                                     "step": 3, "devices": serials})
        for entry in template["state"].values():
            entry["step"] = torch.tensor(3.0)
        with pytest.raises(RuntimeError, match="mixes steps across the devices"):
            optimizer.load_state_dict(template)
        assert device_steps(devices, namespace) == [5, 5] and optimizer.committed_step == 5
        reference, _ = torch_run(range(1, 6))
        assert close_to(optimizer.master_weights(), list(reference.parameters()))
    finally:
        optimizer.close()


@pytest.mark.parametrize("count", [2, 1])
def test_a_failed_read_back_records_the_committed_step_and_reads_again(devices: list[Mount], count: int) -> None:
    """Step 4 committed and durable on every device, then reading a param back fails: the
    optimizer records step 4; state_dict() reads the params again and is step 4's (label,
    moments, the model), equal to torch; training on in the process, and a restart that loads
    the state_dict saved then, both stay equal to torch."""
    namespace = f"readfail{count}"
    model = model_()
    optimizer = open_(devices, namespace, model, count)
    try:
        for step in (1, 2, 3):
            grads(model, step)
            optimizer.step()
        grads(model, 4)
        with armed(devices[count - 1], namespace, READ, "UNRECOVERED_READ_ERROR", queue="io", count=1):
            with pytest.raises(OSError):
                optimizer.step()
        assert device_steps(devices, namespace, count) == [4] * count
        assert optimizer.committed_step == 4
        saved = optimizer.state_dict()
        reference, stock = torch_run(range(1, 5))
        assert all(float(entry["step"]) == 4 for entry in saved["state"].values())
        for index, param in enumerate(reference.parameters()):
            assert torch.allclose(saved["state"][index]["exp_avg"], stock.state[param]["exp_avg"], rtol=0, atol=1e-7)
            assert torch.allclose(saved["cossd_master"][index], param.detach(), rtol=0, atol=1e-6)
        assert close_to(list(model.parameters()), list(reference.parameters())), "the params were not read again"
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        for step in (5, 6):
            grads(model, step)
            optimizer.step()
        reference, _ = torch_run(range(1, 7))
        assert close_to(optimizer.master_weights(), list(reference.parameters()))
    finally:
        optimizer.close()
    # A restart that loads the state saved after the failure: steps 5 and 6 again, as torch.
    model = model_()
    optimizer = open_(devices, namespace, model, count)
    try:
        buffer.seek(0)
        optimizer.load_state_dict(torch.load(buffer))
        assert optimizer.committed_step == 4
        for step in (5, 6):
            grads(model, step)
            optimizer.step()
        assert close_to(optimizer.master_weights(), list(reference.parameters()))
        assert close_to(list(model.parameters()), list(reference.parameters()))
    finally:
        optimizer.close()


def test_a_failed_read_back_retried_at_the_next_step(devices: list[Mount]) -> None:
    """The params' read fails after step 4 committed on both devices; the next step() reads
    them again and refuses the gradients computed before (on partly old params); the next
    forward and backward step on, and the run stays equal to torch."""
    namespace = "readretry"
    model = model_()
    optimizer = open_(devices, namespace, model)
    try:
        for step in (1, 2, 3):
            grads(model, step)
            optimizer.step()
        grads(model, 4)
        with armed(devices[1], namespace, READ, "UNRECOVERED_READ_ERROR", queue="io", count=1):
            with pytest.raises(OSError):
                optimizer.step()
        assert optimizer.committed_step == 4
        grads(model, 5)  # a forward and backward on the params as the failed read left them
        with pytest.raises(InconsistentStateError, match="Run forward and backward again"):
            optimizer.step()
        assert device_steps(devices, namespace) == [4, 4]
        for step in (5, 6):
            grads(model, step)
            optimizer.step()
        assert device_steps(devices, namespace) == [6, 6]
        reference, _ = torch_run(range(1, 7))
        assert close_to(list(model.parameters()), list(reference.parameters()))
        assert close_to(optimizer.master_weights(), list(reference.parameters()))
    finally:
        optimizer.close()


def test_a_read_back_that_keeps_failing_refuses(devices: list[Mount]) -> None:
    """Where reading the params again fails too, state_dict() and step() refuse, saying so."""
    namespace = "readagain"
    model = model_()
    optimizer = open_(devices, namespace, model)
    try:
        for step in (1, 2):
            grads(model, step)
            optimizer.step()
        grads(model, 3)
        with armed(devices[1], namespace, READ, "UNRECOVERED_READ_ERROR", queue="io", count=50):
            with pytest.raises(OSError):
                optimizer.step()
            with pytest.raises(InconsistentStateError, match="failed again"):
                optimizer.state_dict()
            with pytest.raises(InconsistentStateError, match=r"step\(\) refused"):
                optimizer.step()
        assert device_steps(devices, namespace) == [3, 3]
        grads(model, 4)
        with pytest.raises(InconsistentStateError, match="Run forward and backward again"):
            optimizer.step()  # the injection cleared: the params read again, these gradients refused
        grads(model, 4)
        optimizer.step()
        reference, _ = torch_run(range(1, 5))
        assert close_to(list(model.parameters()), list(reference.parameters()))
    finally:
        optimizer.close()
