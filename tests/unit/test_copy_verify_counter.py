"""The namespace counts the time it spends verifying whole copies (copy_verify_ns), which the bench's restore reads instead of patching Namespace."""
from __future__ import annotations

from pathlib import Path

import pytest

from cossd.emulator import Device, DeviceConfig
from cossd.emulator.namespace import Namespace
from cossd.harness.bench import restore as bench_restore
from test_powerloss import NAME, grads, load, spec

STEPS = 2


@pytest.fixture
def stepped_device(tmp_path: Path) -> Path:
    """A closed device whose namespace committed two steps."""
    path = tmp_path / "dev"
    Device.format(path, capacity_bytes=1 << 30)
    with Device.open(path) as device:
        ns = device.create_namespace(spec())
        load(ns)
        for step in range(1, STEPS + 1):
            for name, data in grads(step, False).items():
                ns.write_grad(name, 0, data)
    return path


def test_an_open_that_verifies_the_copy_counts_its_time(stepped_device: Path) -> None:
    """verify="open" checks the committed copy at the open and counts it; the background mode
    defers the check to its own pass, which is not a whole-copy verification."""
    with Device.open(stepped_device) as device:
        namespace = device.namespace(NAME)
        assert isinstance(namespace, Namespace) and namespace.committed_step == STEPS
        assert namespace.counters.copy_verify_ns > 0
        assert namespace.statistics()["copy_verify_ns"] == namespace.counters.copy_verify_ns
    with Device.open(stepped_device, DeviceConfig(verify="background")) as device:
        assert device.namespace(NAME).counters.copy_verify_ns == 0


def test_the_bench_takes_the_open_apart_without_patching_the_class(stepped_device: Path) -> None:
    """The restore section's device open splits verification from the rest from the counters,
    and leaves Namespace's methods as they were."""
    method = Namespace._verify_copy
    verified = bench_restore._device_open(stepped_device, "open")
    assert verified["verify_seconds"] > 0
    assert verified["recovery_seconds"] == pytest.approx(verified["open_seconds"] - verified["verify_seconds"])
    assert bench_restore._device_open(stepped_device, "background")["verify_seconds"] == 0
    assert Namespace._verify_copy is method
