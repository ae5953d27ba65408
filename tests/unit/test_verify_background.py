"""A reopened namespace verified in the background: params checked as first served, the rest before any step, a failure stopping the namespace and the remount recovering an older step."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from cossd.emulator import Device, DeviceConfig, DeviceError, Status
from cossd.emulator.namespace import verify as namespace_verify
from cossd.emulator.layout import BLOCK_ELEMS, Copy
from cossd.emulator.superblock import Superblock
from test_powerloss import NAME, grads, load, poisoned_steps, reference, spec, state_of

STEPS = 5
BACKGROUND = DeviceConfig(verify="background")


@pytest.fixture(scope="module")
def expected() -> dict[int, dict[str, bytes]]:
    return reference(STEPS)


@pytest.fixture
def device_at_step_5(tmp_path: Path) -> Path:
    """A device whose namespace committed steps 1..5 (the reference's gradients)."""
    path = tmp_path / "dev"
    Device.format(path, capacity_bytes=1 << 30)
    with Device.open(path) as device:
        ns = device.create_namespace(spec())
        load(ns)
        for step in range(1, STEPS + 1):
            for name, data in grads(step, step in poisoned_steps(STEPS)).items():
                ns.write_grad(name, 0, data)
    return path


@pytest.fixture
def held_verifier(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The background pass waits, before its first block, until the test sets the event."""
    release = threading.Event()
    original = namespace_verify.CopyVerifier._verify_params_first

    def wait_for_release(self: namespace_verify.CopyVerifier, chosen: Superblock) -> list[tuple[str, int]]:
        while not release.wait(0.01):
            if self._verify_stop:
                return []
        return original(self, chosen)

    monkeypatch.setattr(namespace_verify.CopyVerifier, "_verify_params_first", wait_for_release)
    yield release
    release.set()


def _flip_byte(path: Path, role: str, block: int, device_path: Path) -> None:
    """Change one byte of tensor w's `role` in block `block` of the committed copy."""
    with Device.open(device_path) as device:
        ns = device.namespace(NAME)
        tensor = ns.tensors["w"]
        copy = ns._sb.committed_copy
        start, _ = tensor.block_range(block)
        offset = ns._region_offset(tensor, role) + start * ns._role_dtype(role).itemsize + 5
    state = path / "ns" / NAME / f"state.{copy.name}"
    with open(state, "r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([(value + 1) & 0xFF]))


def _committed_step(device_path: Path) -> int:
    with Device.open(device_path) as device:
        return device.namespace(NAME).committed_step


def test_params_are_served_before_the_rest_is_verified(device_at_step_5: Path, held_verifier: threading.Event,
                                                       expected: dict[int, dict[str, bytes]]) -> None:
    step = _committed_step(device_at_step_5)
    with Device.open(device_at_step_5, BACKGROUND) as device:
        ns = device.namespace(NAME)
        assert ns.verifying and ns.committed_step == step
        for tensor in ns.layouts:
            assert ns.read(tensor.name, "param", 0, 1 << 40) == expected[step][f"{tensor.name}/param"]
        assert ns.verification_state()["param_blocks_checked"] == ns.total_blocks
        # Master and moments, a step, a snapshot: only once everything is verified.
        waiting = threading.Thread(target=lambda: ns.begin_step(step + 1))
        waiting.start()
        time.sleep(0.2)
        assert waiting.is_alive() and ns.step_open is None
        held_verifier.set()
        waiting.join(30)
        assert not waiting.is_alive() and ns.step_open == step + 1
        assert not ns.verifying and ns.verified_in_s is not None
        ns.abort_step()
        assert state_of(ns) == expected[step]


def test_a_corrupt_param_block_fails_its_first_read_and_the_remount_serves_the_step_before(
        device_at_step_5: Path, held_verifier: threading.Event, expected: dict[int, dict[str, bytes]]) -> None:
    step = _committed_step(device_at_step_5)
    _flip_byte(device_at_step_5, "param", 1, device_at_step_5)
    with Device.open(device_at_step_5, BACKGROUND) as device:
        ns = device.namespace(NAME)
        # Block 0 is intact and served; block 1 is refused before a byte of it goes out.
        assert ns.read("w", "param", 0, 2 * BLOCK_ELEMS) == expected[step]["w/param"][:2 * BLOCK_ELEMS]
        with pytest.raises(DeviceError) as failed:
            ns.read("w", "param", 2 * BLOCK_ELEMS, 64)
        assert failed.value.status == Status.UNRECOVERED_READ_ERROR
        assert f"step {step} fails" in failed.value.message and "w block 1" in failed.value.message
        # From then on nothing is served and nothing steps: never a switch under the reader.
        for call in (lambda: ns.read("w", "param", 0, 2), lambda: ns.read("b", "master", 0, 4),
                     lambda: ns.begin_step(step + 1)):
            with pytest.raises(DeviceError) as refused:
                call()
            assert refused.value.status == Status.UNRECOVERED_READ_ERROR
        assert ns.counters.checksum_failures >= 1
        assert any(entry.lba == ns.tensors["w"].first_block + 1 for entry in device.health.error_entries())
    with Device.open(device_at_step_5, BACKGROUND) as device:
        ns = device.namespace(NAME)
        held_verifier.set()
        assert ns.wait_verified(30) and ns.media_failure is None
        older = ns.committed_step
        assert older < step and state_of(ns) == expected[older]


def test_a_corrupt_moment_stops_the_namespace_once_found_and_the_remount_serves_the_step_before(
        device_at_step_5: Path, held_verifier: threading.Event, expected: dict[int, dict[str, bytes]]) -> None:
    step = _committed_step(device_at_step_5)
    _flip_byte(device_at_step_5, "exp_avg_sq", 0, device_at_step_5)
    with Device.open(device_at_step_5, BACKGROUND) as device:
        ns = device.namespace(NAME)
        # The params are intact: served as they are (their own checksums pass). The pass is held
        # until then: a pass that got to the moment first would rightly refuse the read (CI saw it).
        assert ns.read("w", "param", 0, 1 << 40) == expected[step]["w/param"]
        held_verifier.set()
        with pytest.raises(DeviceError) as refused:
            ns.begin_step(step + 1)  # waits for the pass, which fails step 5
        assert refused.value.status == Status.UNRECOVERED_READ_ERROR
        assert "remount" in refused.value.message
    with Device.open(device_at_step_5, BACKGROUND) as device:
        ns = device.namespace(NAME)
        assert ns.wait_verified(30) and ns.media_failure is None
        assert ns.committed_step < step and state_of(ns) == expected[ns.committed_step]
        # The job goes on from there.
        ns.begin_step(ns.committed_step + 1)
        ns.abort_step()


def test_a_slot_without_param_checksums_is_verified_whole_at_open(device_at_step_5: Path,
                                                                  expected: dict[int, dict[str, bytes]]) -> None:
    """Slots written before param checksums existed: the open checks everything first."""
    with Device.open(device_at_step_5) as device:
        ns = device.namespace(NAME)
        current = ns._sb
        legacy = Superblock(**{**current.__dict__, "param_crcs": None})
        ns._slots[legacy.slot].write(legacy.encode())
        ns._slots[legacy.slot].sync()
        step = ns.committed_step
    with Device.open(device_at_step_5, BACKGROUND) as device:
        ns = device.namespace(NAME)
        assert not ns.verifying and ns._sb.param_crcs is None
        assert state_of(ns) == expected[step]
        for name, data in grads(step + 1, False).items():
            ns.write_grad(name, 0, data)
        assert ns._sb.param_crcs is not None  # the next commit writes them


def test_close_while_verifying_stops_the_pass(device_at_step_5: Path, held_verifier: threading.Event) -> None:
    device = Device.open(device_at_step_5, BACKGROUND)
    ns = device.namespace(NAME)
    assert ns.verifying
    started = time.monotonic()
    device.close()
    assert time.monotonic() - started < 10
    assert ns._verify_thread is not None and not ns._verify_thread.is_alive()


def test_an_unknown_verify_mode_is_refused(device_at_step_5: Path) -> None:
    with pytest.raises(DeviceError) as refused:
        Device.open(device_at_step_5, DeviceConfig(verify="later"))
    assert refused.value.status == Status.INVALID_FIELD and "open, background" in refused.value.message


def test_new_block_checksums_never_keep_old_param_checksums() -> None:
    crcs = np.arange(3, dtype=np.uint32)
    superblock = Superblock(seq=1, committed_step=1, committed_copy=Copy.A, flags=0, lr=1e-3, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=0.0, mode="adamw", block_crcs=crcs,
                            param_crcs=crcs + 7)
    assert superblock.successor(block_crcs=crcs + 1).param_crcs is None
    kept = superblock.successor(committed_step=2)
    assert kept.param_crcs is not None and (kept.param_crcs == crcs + 7).all()
    decoded = Superblock.decode(superblock.encode(), 3)
    assert decoded is not None and (decoded.param_crcs == crcs + 7).all() and decoded.flags == 0


def test_a_reader_that_never_pauses_does_not_hold_a_waiting_step_off(
        device_at_step_5: Path, held_verifier: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass gives way to param reads, but not while a command waits for it."""
    monkeypatch.setattr(namespace_verify, "MAX_YIELD_PER_BLOCK_S", 3600.0)  # only the waiter rule is left
    step = _committed_step(device_at_step_5)
    with Device.open(device_at_step_5, BACKGROUND) as device:
        ns = device.namespace(NAME)
        stop = threading.Event()

        def keep_reading() -> None:
            while not stop.is_set():
                ns.read("b", "param", 0, 2)

        reader = threading.Thread(target=keep_reading)
        reader.start()
        threading.Timer(0.2, held_verifier.set).start()  # the pass starts once reads are going on
        try:
            started = time.monotonic()
            ns.begin_step(step + 1)
            assert time.monotonic() - started < 30 and not ns.verifying
            ns.abort_step()
        finally:
            stop.set()
            reader.join()


def test_a_pass_that_cannot_read_stops_the_namespace_and_the_remount_verifies_again(
        device_at_step_5: Path, monkeypatch: pytest.MonkeyPatch, expected: dict[int, dict[str, bytes]]) -> None:
    """An I/O error inside the background pass is never taken for a pass: the namespace stops
    loudly, nothing is wiped (no checksum failed), and the next open verifies the same step."""
    step = _committed_step(device_at_step_5)

    def unreadable(self: object, *args: object) -> bool:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(namespace_verify.CopyVerifier, "_block_fails", unreadable)
        with Device.open(device_at_step_5, BACKGROUND) as device:
            ns = device.namespace(NAME)
            with pytest.raises(DeviceError) as refused:
                ns.begin_step(step + 1)
            assert refused.value.status == Status.UNRECOVERED_READ_ERROR
            assert "Input/output error" in refused.value.message
    with Device.open(device_at_step_5, BACKGROUND) as device:
        ns = device.namespace(NAME)
        assert ns.wait_verified(30) and ns.media_failure is None
        assert ns.committed_step == step and state_of(ns) == expected[step]
