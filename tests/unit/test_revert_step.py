"""REVERT_STEP in process: the last committed step undone from the copy that still holds the one before, refused once that copy was written, idempotent, durable across a reopen."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cossd.client import AdminClient
from cossd.emulator import Device
from cossd.emulator.controller import Controller
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.protocol.entries import Opcode
from cossd.protocol.status import DeviceError, Status

from helpers import InProcessTransport

ROLES = ("master", "exp_avg", "exp_avg_sq", "param")


def make(device: Device) -> tuple[AdminClient, int]:
    admin = AdminClient(InProcessTransport(Controller(device)))  # type: ignore[arg-type]
    nsid = admin.create_namespace({"name": "net", "tensors": [["w", BLOCK_ELEMS + 64], ["b", 64]],
                                   "grad_dtype": "fp16", "param_dtype": "fp16"})
    ns = device.namespace_by_id(nsid)
    rng = np.random.default_rng(0)
    for tensor in ns.layouts:
        ns.write_state(tensor.name, "master", 0, rng.standard_normal(tensor.numel, dtype=np.float32).tobytes())
    return admin, nsid


def step(device: Device, nsid: int, number: int, poisoned: bool = False) -> None:
    ns = device.namespace_by_id(nsid)
    rng = np.random.default_rng(100 + number)
    for tensor in ns.layouts:
        values = (rng.standard_normal(tensor.numel) * 0.01).astype(np.float16)
        if poisoned and tensor.name == "b":  # written last: w's blocks ran into the other copy first
            values[3] = np.inf
        ns.write_grad(tensor.name, 0, values.tobytes())


def state(device: Device, nsid: int) -> dict[str, bytes]:
    ns = device.namespace_by_id(nsid)
    return {f"{t.name}/{r}": ns.read(t.name, r, 0, 1 << 40) for t in ns.layouts for r in ROLES}


def test_revert_brings_back_the_step_before_bit_for_bit_and_survives_a_reopen(tmp_path: Path) -> None:
    Device.format(tmp_path / "dev", capacity_bytes=1 << 30)
    with Device.open(tmp_path / "dev") as device:
        admin, nsid = make(device)
        step(device, nsid, 1)
        step(device, nsid, 2)
        at_two = state(device, nsid)
        step(device, nsid, 3)
        assert device.namespace_by_id(nsid).committed_step == 3
        assert state(device, nsid) != at_two
        assert admin.revert_step(nsid, 3) == {"committed_step": 2, "reverted": True}
        assert state(device, nsid) == at_two
        # Asked again (another rank, a rerun of recovery): already there, nothing changes.
        assert admin.revert_step(nsid, 3) == {"committed_step": 2, "reverted": False}
        assert device.namespace_by_id(nsid).statistics()["steps_reverted"] == 1
        # Step 3 taken again from step 2 is the same step 3.
        step(device, nsid, 3)
        again = state(device, nsid)
        admin.revert_step(nsid, 3)
    with Device.open(tmp_path / "dev") as device:
        assert device.namespace("net").committed_step == 2
        assert state(device, device.namespace("net").nsid) == at_two
        step(device, device.namespace("net").nsid, 3)
        assert state(device, device.namespace("net").nsid) == again


def test_revert_is_refused_once_the_copy_of_the_step_before_was_written(tmp_path: Path) -> None:
    Device.format(tmp_path / "dev", capacity_bytes=1 << 30)
    with Device.open(tmp_path / "dev") as device:
        admin, nsid = make(device)
        step(device, nsid, 1)
        step(device, nsid, 2)
        step(device, nsid, 3, poisoned=True)  # skipped, but its kernel wrote the other copy
        ns = device.namespace_by_id(nsid)
        assert ns.committed_step == 2
        kept = state(device, nsid)
        with pytest.raises(DeviceError) as refused:
            admin.revert_step(nsid, 2)
        assert refused.value.status == Status.STEP_NUMBER_MISMATCH
        assert "has been written since" in refused.value.message
        assert state(device, nsid) == kept and ns.committed_step == 2
        # Two steps back: never.
        with pytest.raises(DeviceError) as refused:
            admin.revert_step(nsid, 5)
        assert refused.value.status == Status.STEP_NUMBER_MISMATCH
        # With a step open: refused, the step stays open.
        admin.begin_step(nsid, 3, 1.0)
        with pytest.raises(DeviceError) as refused:
            admin.revert_step(nsid, 2)
        assert refused.value.status == Status.STEP_ALREADY_OPEN
        admin.abort_step(nsid)
        # No step named: a field error.
        with pytest.raises(DeviceError) as refused:
            admin.call(Opcode.REVERT_STEP, nsid=nsid)
        assert refused.value.status == Status.INVALID_FIELD
        assert state(device, nsid) == kept


def test_revert_of_a_namespace_still_loading_or_of_the_first_step(tmp_path: Path) -> None:
    Device.format(tmp_path / "dev", capacity_bytes=1 << 30)
    with Device.open(tmp_path / "dev") as device:
        admin, nsid = make(device)
        with pytest.raises(DeviceError) as refused:
            admin.revert_step(nsid, 1)
        assert refused.value.status == Status.NAMESPACE_NOT_READY
        step(device, nsid, 1)  # seals the loaded state (a superblock), then commits step 1
        at_one = state(device, nsid)
        outcome = admin.revert_step(nsid, 1)
        assert outcome == {"committed_step": 0, "reverted": True}
        assert device.namespace_by_id(nsid).committed_step == 0
        step(device, nsid, 1)
        assert state(device, nsid) == at_one
