"""Crash tier: kill -9 of the daemon in the middle of a step leaves step N or N+1, bit for bit."""
from __future__ import annotations

import hashlib
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import is_mounted, start_mount
from cossd.emulator import Device, NamespaceSpec, TensorSpec
from cossd.protocol.status import DeviceError
from cossd.client import AdminClient
from helpers import pread_all, pwrite_all, tensor_dir

pytestmark = pytest.mark.mount

TENSORS = (TensorSpec("emb", 600_000), TensorSpec("w", 1_000_003), TensorSpec("b", 33))
ROLES = ("master", "exp_avg", "exp_avg_sq", "param")
STEPS = 4


def initial(tensor: TensorSpec) -> bytes:
    return np.random.default_rng(len(tensor.name)).standard_normal(tensor.numel, dtype=np.float32).tobytes()


def gradient(step: int, tensor: TensorSpec) -> bytes:
    rng = np.random.default_rng([step, tensor.numel])
    return (rng.standard_normal(tensor.numel) * 0.01).astype(np.float16).tobytes()


def digest(read: "callable") -> str:  # type: ignore[valid-type]
    h = hashlib.sha256()
    for tensor in TENSORS:
        for role in ROLES:
            h.update(read(tensor.name, role))
    return h.hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """State digests after steps 0..STEPS of an uninterrupted run (in-process device)."""
    path = tmp_path_factory.mktemp("reference")
    Device.format(path, capacity_bytes=1 << 30)
    digests = []
    with Device.open(path) as device:
        ns = device.create_namespace(NamespaceSpec("crash", TENSORS))
        for tensor in TENSORS:
            ns.write_state(tensor.name, "master", 0, initial(tensor))
        digests.append(digest(lambda t, r: ns.read(t, r, 0, 1 << 40)))
        for step in range(1, STEPS + 1):
            for tensor in TENSORS:
                ns.write_grad(tensor.name, 0, gradient(step, tensor))
            digests.append(digest(lambda t, r: ns.read(t, r, 0, 1 << 40)))
    return digests


def mount_digest(mp: Path) -> str:
    return digest(lambda t, r: pread_all(tensor_dir(mp, "crash", t) / r))


def run_step(mp: Path, step: int, transport: str = "files") -> None:
    if transport == "files":
        for tensor in TENSORS:
            pwrite_all(tensor_dir(mp, "crash", tensor.name) / "grad", gradient(step, tensor), chunk=1 << 18)
        return
    # Through the controller memory buffer: one CMB_WRITE per tensor, in 256 KiB transfers,
    # the params coming back into the CMB behind the gradients.
    with AdminClient(mp) as admin:
        nsid, cmb = admin.nsid("crash"), admin.cmb()
        assert cmb is not None
        try:
            at = 0
            for tensor in TENSORS:
                data = gradient(step, tensor)
                cmb.array[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)
                admin.cmb_write(nsid, [
                    {"tensor": tensor.name, "offset": off, "length": min(1 << 18, len(data) - off),
                     "cmb_offset": at + off, "param_cmb_offset": (64 << 20) + at + off}
                    for off in range(0, len(data), 1 << 18)])
                at += len(data)
        finally:
            cmb.close()


def crash_trial(reference: list[str], backing: Path, mountpoint: Path, trial: int,
                transport: str = "files") -> tuple[int, int]:
    """One trial: train, kill -9 during a step, remount, verify, finish. Returns (crash, recovered).
    `transport`: the gradients go through the tensor files, or the CMB (CMB_WRITE)."""
    chance = random.Random(trial)
    crash_step = chance.randint(1, STEPS - 1)
    Device.format(backing, capacity_bytes=1 << 30, force=True)
    with Device.open(backing) as device:
        ns = device.create_namespace(NamespaceSpec("crash", TENSORS))
        for tensor in TENSORS:
            ns.write_state(tensor.name, "master", 0, initial(tensor))
    mount = start_mount(backing, mountpoint)
    try:
        mp = mount.mountpoint
        for step in range(1, crash_step):
            run_step(mp, step, transport)

        def writer() -> None:
            try:
                run_step(mp, crash_step, transport)
            except (OSError, DeviceError):
                pass  # the daemon died under the writer: expected

        thread = threading.Thread(target=writer)
        thread.start()
        # Where the kill lands (a step through the CMB also maps the CMB and opens a queue
        # pair): mostly mid-step, sometimes after it committed.
        time.sleep(chance.uniform(0.0, 0.06 if transport == "files" else 0.1))
        mount.kill()
        thread.join()
        mount.restart()
        recovered = int((mp / "ns/crash/step").read_text())
        assert recovered in (crash_step - 1, crash_step), (trial, crash_step, recovered)
        assert mount_digest(mp) == reference[recovered], f"trial {trial}: torn state at step {recovered}"
        # Finish the run: the final state equals the uninterrupted one.
        for step in range(recovered + 1, STEPS + 1):
            run_step(mp, step, transport)
        assert mount_digest(mp) == reference[STEPS], f"trial {trial}: final state differs"
        return crash_step, recovered
    finally:
        if is_mounted(mount.mountpoint):
            mount.unmount()


def run_trials(reference: list[str], tmp_path: Path, trials: int, figures: list[str],
               transport: str = "files") -> None:
    # Any torn, wrong or lost state fails its trial's assertion, so reaching the end means 0.
    outcomes = [crash_trial(reference, tmp_path / "backing", tmp_path / "mnt", trial, transport)
                for trial in range(trials)]
    interrupted = sum(recovered == crash - 1 for crash, recovered in outcomes)
    what = "mid-step" if transport == "files" else "mid-step through the CMB"
    figures.append(f"C1 kill -9 {what}: {trials} trials, 0 failures (0 torn, 0 committed steps lost); "
                   f"recovered N: {interrupted}, N+1: {trials - interrupted}, each bit-identical to a "
                   "reference replay, and each finished run identical (R1)")
    # The instants are spread so that most kills land inside the step.
    assert interrupted >= trials // 3


def test_kill_9_mid_step(reference: list[str], tmp_path: Path, figures: list[str]) -> None:
    run_trials(reference, tmp_path, trials=8, figures=figures)


@pytest.mark.slow
def test_kill_9_mid_step_many(reference: list[str], tmp_path: Path, figures: list[str]) -> None:
    run_trials(reference, tmp_path, trials=200, figures=figures)


@pytest.mark.torture
def test_kill_9_mid_cmb_step(reference: list[str], tmp_path: Path, figures: list[str]) -> None:
    run_trials(reference, tmp_path, trials=8, figures=figures, transport="cmb")


@pytest.mark.slow
def test_kill_9_mid_cmb_step_many(reference: list[str], tmp_path: Path, figures: list[str]) -> None:
    run_trials(reference, tmp_path, trials=100, figures=figures, transport="cmb")
