"""Block-scaled moments (state_dtype fp16, int8) through a real mount: create-ns, steps, remount, kill -9, snapshots, rollback and export (moments as FP32)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from conftest import Mount
from cossd.client import AdminClient
from cossd.client import snapshots as snapshot_calls
from cossd.emulator.layout import BLOCK_ELEMS
from helpers import pread_all, pwrite_all, run_cli, tensor_dir

pytestmark = pytest.mark.mount

TENSORS = (("w", BLOCK_ELEMS + 300), ("b", 7))  # w spans two checksum blocks and a part scale block
ROLES = ("param", "master", "exp_avg", "exp_avg_sq")


def gradient(step: int, numel: int) -> bytes:
    rng = np.random.default_rng([step, numel])
    decades = 10.0 ** rng.integers(-6, 0, numel)
    return (rng.standard_normal(numel) * decades).astype(np.float16).tobytes()


def train(mp: Path, step: int) -> None:
    for tensor, numel in TENSORS:
        pwrite_all(tensor_dir(mp, "q", tensor) / "grad", gradient(step, numel))


def live_state(mp: Path) -> dict[str, bytes]:
    return {f"{t}/{r}": pread_all(tensor_dir(mp, "q", t) / r) for t, _ in TENSORS for r in ROLES}


def wait(admin: AdminClient, job: dict[str, Any]) -> dict[str, Any]:
    done = snapshot_calls.wait_for_job(admin, job)
    assert done["state"] == "done", done
    return done


@pytest.mark.parametrize("state_dtype", ["fp16", "int8"])
def test_scaled_moments_through_the_mount(mount: Mount, capsys: pytest.CaptureFixture[str],
                                          state_dtype: str) -> None:
    mp = mount.mountpoint
    code, _, err = run_cli(capsys, "create-ns", str(mp), "q", *[a for t, n in TENSORS for a in ("--tensor", f"{t}:{n}")],
                           "--state-dtype", state_dtype)
    assert code == 0, err
    config = json.loads((mp / "ns" / "q" / "config.json").read_text())
    assert config["state_dtype"] == state_dtype
    for tensor, numel in TENSORS:
        pwrite_all(tensor_dir(mp, "q", tensor) / "master",
                   np.random.default_rng(numel).standard_normal(numel, dtype=np.float32).tobytes())
        assert os.path.getsize(tensor_dir(mp, "q", tensor) / "exp_avg") == 4 * numel  # read as FP32
    for step in (1, 2):
        train(mp, step)
    at_2 = live_state(mp)
    w_avg = np.frombuffer(at_2["w/exp_avg"], dtype=np.float32)
    assert np.isfinite(w_avg).all() and np.count_nonzero(w_avg) > 0.9 * w_avg.size
    nsid = int(config["nsid"])

    with AdminClient(mp) as admin:
        snapshot_calls.create_snapshot(admin, nsid, "s2")
        train(mp, 3)
        at_3 = live_state(mp)
        assert at_3 != at_2
        snap_root = mp / "ns" / "q" / "snapshots" / "s2" / "tensors"
        assert {f"{t}/{r}": pread_all(snap_root / t / r) for t, _ in TENSORS for r in ROLES} == at_2
        # Export: every array in the file as the mount reads it, moments as FP32.
        job = wait(admin, snapshot_calls.export(admin, nsid, optimizer_state=True))
        tensors = safetensors.numpy.load_file(job["path"])
        for tensor, _ in TENSORS:
            assert tensors[f"{tensor}.exp_avg"].dtype == np.float32
            for role in ROLES:
                name = tensor if role == "param" else f"{tensor}.{role}"
                assert tensors[name].tobytes() == at_3[f"{tensor}/{role}"], name
        with safetensors.safe_open(job["path"], "np") as opened:
            assert opened.metadata()["cossd.state_dtype"] == state_dtype
        job = wait(admin, snapshot_calls.export(admin, nsid, tag="s2", optimizer_state=True))
        from_snapshot = safetensors.numpy.load_file(job["path"])
        assert from_snapshot["w.exp_avg_sq"].tobytes() == at_2["w/exp_avg_sq"]

    # A kill -9 and a remount keep step 3; a rollback brings step 2's state back whole.
    mount.kill()
    mount.restart(verify="open")
    assert live_state(mp) == at_3
    with AdminClient(mp) as admin:
        snapshot_calls.rollback(admin, nsid, "s2")
    assert live_state(mp) == at_2
    train(mp, 3)
    assert live_state(mp) == at_3  # the same step from the same state: bit for bit
