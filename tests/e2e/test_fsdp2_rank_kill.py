"""FSDP2 at 2 gloo ranks with one rank killed (kill -9) between its partition's write and the shared step's commit: the survivor's clear error, the device's state left at a whole step, and the restarted job bit for bit the uninterrupted one (tests/e2e/fsdp_job.py's kill hook)."""
from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from conftest import Mount
from ranks import bits_equal, finished, mounted_device
from test_fsdp2 import run_job, single_process, statistics

pytestmark = pytest.mark.mount

REPO = Path(__file__).resolve().parents[2]
STEPS, KILL_STEP = 8, 4
# The survivor's bound on its wait for the other rank (every step's): short for the test,
# long enough that a healthy rank starved for a moment on a loaded machine is not aborted.
STEP_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    with mounted_device(tmp_path_factory.mktemp("fsdp2-kill"), "FSDP2KILL0001") as mounted:
        yield mounted


_uninterrupted: list[list[dict[str, Any]]] = []


def uninterrupted(mount: Mount, root: Path) -> list[dict[str, Any]]:
    """The same FSDP2 job (FP32 params, BF16 compute) never stopped: run once for the module."""
    if not _uninterrupted:
        out = root / "whole"
        _uninterrupted.append(finished(out, 2, run_job(mount, out, "fsdp-kill-whole", 2, STEPS)))
    return _uninterrupted[0]


def device_state(mount: Mount, namespace: str, path: Path) -> dict[str, torch.Tensor]:
    """Every tensor's master, moments and param as the device holds them (`cossd export --with-state`)."""
    from safetensors.torch import load_file

    subprocess.run([str(REPO / ".venv" / "bin" / "cossd"), "export", str(mount.mountpoint), namespace,
                    "--path", str(path), "--with-state", "-q", "--force"], check=True, timeout=120)
    return load_file(path)


@pytest.mark.parametrize("stage", ["mid_partition", pytest.param("before_commit", marks=pytest.mark.slow)])
def test_fsdp2_rank_killed_between_its_partition_and_the_commit(mount: Mount, tmp_path: Path, stage: str) -> None:
    """Rank 1 of 2 killed (SIGKILL) in step 4 of 8, its gradient shards on the device and no
    commit yet. "mid_partition": its rows of fc1.weight are on the device, the rest of its
    partition never sent: rank 0 gets StepAbortedError within its 5 s bound naming step 4, and
    the device stays at step 3, every tensor's master, moments and param equal to a run of 3
    steps. "before_commit" (slow): all of its shards are on the device, killed before its first
    poll for the commit: the step is whole, so rank 0's poll commits step 4 (never a half
    step) and rank 0 fails at the job's next collective with the dead rank; every tensor equals
    a run of 4 steps. Either way the job restarted on the namespace resumes at the next step
    and ends bit for bit as the uninterrupted run: params, masters, and each step's gradients."""
    whole = uninterrupted(mount, tmp_path)
    namespace, killed = f"fsdp-kill-{stage}", tmp_path / "killed"
    codes = run_job(mount, killed, namespace, 2, STEPS, step_timeout_s=STEP_TIMEOUT_S,
                    kill={"rank": 1, "step": KILL_STEP, "stage": stage})
    logs = (killed / "logs.txt").read_text()[-4000:]
    assert codes[1] == -signal.SIGKILL, (codes, logs)
    note = json.loads((killed / "kill1.json").read_text())
    assert note == {"stage": stage, "step": KILL_STEP, "committed_step": KILL_STEP - 1}
    error = (killed / "error0.txt").read_text()
    if stage == "mid_partition":
        assert codes[0] == 3, (codes, logs)
        assert error.startswith("StepAbortedError: ")
        assert f"step {KILL_STEP} of namespace {namespace!r} was not committed" in error, error
        assert f"waited {STEP_TIMEOUT_S:g} s for the other ranks" in error, error
        assert f"stays at step {KILL_STEP - 1}" in error, error
        kept = KILL_STEP - 1
    else:
        assert codes[0] == 6, (codes, logs)  # gloo: the dead peer closed the connection
        assert (killed / "committed0.txt").read_text() == str(KILL_STEP)
        kept = KILL_STEP
    stats = statistics(mount, namespace)
    assert stats["committed_step"] == kept and stats["step_open"] is None, stats
    # Every tensor on the device at step `kept`: one process stepping the uninterrupted run's
    # (averaged) gradients for `kept` steps holds the same masters, moments and params.
    reference = f"{namespace}-ref"
    single_process(mount, reference, whole[0]["grads"], kept)
    left, expected = device_state(mount, namespace, tmp_path / "a.st"), device_state(mount, reference, tmp_path / "b.st")
    assert sorted(left) == sorted(expected) and any(name.endswith(".exp_avg_sq") for name in left), sorted(left)
    assert all(bits_equal([left[name]], [expected[name]]) for name in left), \
        [name for name in left if not bits_equal([left[name]], [expected[name]])]

    again = tmp_path / "again"
    ranks = finished(again, 2, run_job(mount, again, namespace, 2, STEPS))
    for rank, r in enumerate(ranks):
        assert r["result"]["first"] == kept + 1 and r["result"]["restored"], r["result"]
        assert r["result"]["committed_step"] == STEPS
        assert bits_equal(r["params"], whole[rank]["params"]), rank
    assert bits_equal(ranks[0]["masters"], whole[0]["masters"])
    for step in range(kept + 1, STEPS + 1):
        assert bits_equal(ranks[0]["grads"][step], whole[0]["grads"][step]), step
