"""Tier 20: the last look before a commit: a shadow copy cut short while its blocks were being
written (pwrite extends it again, leaving holes that read as zeros) or after they ran fails the
step loudly, the step before it stays served, and a remount recovers it bit for bit."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.emulator.layout import BLOCK_ELEMS

NUMEL = 2 * BLOCK_ELEMS


def _grad(step: int) -> bytes:
    return (np.random.default_rng(step).standard_normal(NUMEL) * 0.01).astype(np.float16).tobytes()


def _wait_for_blocks(namespace) -> None:  # type: ignore[no-untyped-def]
    with namespace._cond:
        while namespace._tx is not None and namespace._tx.inflight:
            namespace._cond.wait()


def _master(namespace) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.frombuffer(namespace.read("w", "master", 0, 4 * NUMEL), dtype=np.float32).copy()


@pytest.mark.parametrize("when", ["between its blocks", "after its blocks"])
def test_a_shadow_cut_short_during_a_step_fails_that_step(tmp_path: Path, when: str) -> None:
    backing = tmp_path / "backing"
    Device.format(backing)
    with Device.open(backing) as device:
        namespace = device.create_namespace(NamespaceSpec("net", (TensorSpec("w", NUMEL),)))
        namespace.write_grad("w", 0, _grad(1))
        step_1 = _master(namespace)
        gradient = _grad(2)
        namespace.begin_step()
        shadow = namespace._copies[namespace._sb.committed_copy.other]
        if when == "between its blocks":
            namespace.write_grad("w", 0, gradient[: 2 * BLOCK_ELEMS])  # block 0
            _wait_for_blocks(namespace)
            os.truncate(shadow.path, 0)
            namespace.write_grad("w", 2 * BLOCK_ELEMS, gradient[2 * BLOCK_ELEMS:])  # extends it again
        else:
            namespace.write_grad("w", 0, gradient)
            _wait_for_blocks(namespace)
            os.truncate(shadow.path, 0)
        _wait_for_blocks(namespace)
        with pytest.raises(DeviceError) as refused:
            namespace.commit_step()
        assert refused.value.status == Status.UNRECOVERED_READ_ERROR
        assert namespace.committed_step == 1
        with pytest.raises(DeviceError):  # steps stay refused until the device is reopened
            namespace.begin_step()
    with Device.open(backing) as device:
        namespace = device.namespaces["net"]
        assert namespace.committed_step == 1
        assert np.array_equal(_master(namespace), step_1)
        namespace.write_grad("w", 0, _grad(2))  # the damaged copy was re-created: training goes on
        assert namespace.committed_step == 2


def test_a_read_after_the_committed_copy_is_cut_short_is_refused(tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    Device.format(backing)
    with Device.open(backing) as device:
        namespace = device.create_namespace(NamespaceSpec("net", (TensorSpec("w", NUMEL),)))
        namespace.write_grad("w", 0, _grad(1))
        committed = namespace._copies[namespace._sb.committed_copy]
        # Not on a page boundary: the tail of the last page reads as zeros without a fault.
        os.truncate(committed.path, committed.size_bytes - 100)
        with pytest.raises(DeviceError) as refused:
            namespace.read("w", "master", 0, 4 * NUMEL)
        assert refused.value.status == Status.UNRECOVERED_READ_ERROR
