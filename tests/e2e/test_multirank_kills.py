"""kill -9 in a multi-rank job: the device's daemon killed mid-step, and torchrun's elastic restart after a rank killed itself; each run resumes from one committed step and ends bit for bit as an uninterrupted one."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Collection, Iterator

import pytest
import torch

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from ranks import mounted_device
from test_multirank import JOB, JOB_TIMEOUT_S, bits_equal, finished, run_job, single_process, statistics

pytestmark = pytest.mark.mount

import multirank_job as job  # noqa: E402  (on sys.path through test_multirank: the synthetic gradients)

# Where a rank strikes in step `at` (multirank_job.py's kill stages), and the steps the device
# may hold committed afterwards, relative to `at` (the step in flight). A rank with an empty
# shard that joined adds nothing the step waits for, and a rank whose gradients are all in
# may be beaten to the commit by another rank's poll: those stages allow both.
STAGES = ("before_step", "after_join", "mid_grads", "before_commit", "after_commit", "timer")


def expected_committed(note: dict[str, Any]) -> Collection[int]:
    """The committed steps a kill at `note` (the striking rank's note) may leave."""
    at, stage = note["step"], note["stage"]
    if stage in ("before_step", "mid_grads"):
        return {at - 1}  # the striker's gradients of step `at` never (all) arrive
    if stage == "after_join":
        return {at - 1, at} if note["shard_empty"] else {at - 1}
    if stage == "before_commit":
        return {at - 1, at}
    if stage == "after_commit":
        return {at}  # the commit answered: it must survive
    return range(at - 1, 1 << 30)  # timer: any instant; the ranks' own bounds decide


_REFERENCES: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}


def reference(mount: Mount, last: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Params and masters of an uninterrupted single-process run of `last` steps on the
    synthetic (already averaged) gradients, which depend on the step alone: one run serves
    every trial of that length."""
    if last not in _REFERENCES:
        model = job.Net().to(torch.bfloat16)  # the params the ranks step, in the optimizer's order
        shapes = [p.detach() for group in job.groups_of(model) for p in group["params"]]
        grads = {step: job.synthetic_grads(step, shapes) for step in range(1, last + 1)}
        params, masters, _ = single_process(mount, f"reference{last}-{os.getpid()}", grads, last)
        _REFERENCES[last] = (params, masters)
    return _REFERENCES[last]


@pytest.fixture(scope="module")
def killable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One device whose daemon the trials kill and remount (each trial on a namespace of its
    own); always unmounted at the end."""
    with mounted_device(tmp_path_factory.mktemp("multirank-kills"), "MULTIRANKKILL1") as mounted:
        yield mounted  # the trials' remounts update this Mount in place: the stop finds the live daemon


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def ensure_mounted(mount: Mount) -> None:
    """A trial that failed may leave the daemon dead: the next one starts on a live mount."""
    if alive(mount.pid) and is_mounted(mount.mountpoint):
        return
    if alive(mount.pid):
        os.kill(mount.pid, signal.SIGKILL)
        wait_for_exit(mount.pid, 30)
    force_unmount(mount.mountpoint)
    mount.restart()
    assert is_mounted(mount.mountpoint)


def log_of(out: Path) -> str:
    return (out / "logs.txt").read_text()[-6000:] if (out / "logs.txt").exists() else ""


# ------------------------------------------------------------------ the daemon killed


def daemon_killed(mount: Mount, tmp_path: Path, trial: int, world: int, rank: int, stage: str) -> dict[str, Any]:
    """One trial: rank `rank` of a `world`-rank job kills the device's daemon at `stage` of
    a step; every rank fails with DeviceLostError (none hangs, none exits quietly), the dead
    mount is detached and the same backing mounted again, and the restarted job resumes from
    the device's committed step on every rank and ends as an uninterrupted run."""
    ensure_mounted(mount)
    chance = random.Random(trial)
    namespace, at = f"dk{trial}", chance.randint(2, 5)
    last = at + (40 if stage == "timer" else 3)  # a step takes tens of ms: the timer fires well before the end
    kill: dict[str, Any] = {"rank": rank, "step": at, "stage": stage, "target": "daemon", "pid": mount.pid}
    if stage == "timer":
        kill["delay_s"] = chance.uniform(0.0, 0.15)  # from the start of step `at`: mostly inside a step
    out = tmp_path / f"dk{trial}"
    dead = mount.pid
    codes = run_job(mount, out, namespace, world, last, synthetic=True, kill=kill)
    note_path = out / f"kill{rank}.json"
    assert note_path.exists(), ("the daemon was never killed", codes, log_of(out))
    note = json.loads(note_path.read_text())
    # Every rank says the device is lost, and what it last saw committed.
    assert codes == [5] * world, (codes, log_of(out))
    seen = []
    for r in range(world):
        message = (out / f"error{r}.txt").read_text()
        assert message.startswith("DeviceLostError: cossd device at ") and "stopped answering" in message, message
        seen.append(json.loads((out / f"lost{r}.json").read_text())["committed_step"])
    # The dead mount is detached and the same backing mounted again.
    wait_for_exit(dead, 30)
    force_unmount(mount.mountpoint)
    mount.restart()
    assert is_mounted(mount.mountpoint)
    stats = statistics(mount, namespace)
    committed = stats["committed_step"]
    assert stats["step_open"] is None
    assert committed in expected_committed(note), (note, committed, seen)
    # No step a rank saw committed is lost, and no step went past one that some rank had not
    # seen committed (it could not have joined the step after it).
    assert max(seen) <= committed <= min(seen) + 1, (seen, committed)
    again = tmp_path / f"dk{trial}-again"
    ranks = finished(again, world, run_job(mount, again, namespace, world, last, synthetic=True))
    for r in ranks:
        assert r["result"]["first"] == committed + 1 and r["result"]["committed_step"] == last
        assert r["result"]["restored"] is True
    for other in ranks[1:]:
        assert bits_equal(other["params"], ranks[0]["params"]), "ranks hold different params"
    params, masters = reference(mount, last)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)
    return note


@pytest.mark.torture
@pytest.mark.parametrize("trial,world,rank,stage", [(0, 2, 1, "mid_grads"), (1, 3, 0, "after_commit"),
                                                     (2, 3, 2, "before_commit")])
def test_daemon_killed_mid_step(killable: Mount, tmp_path: Path, trial: int, world: int, rank: int,
                                stage: str) -> None:
    """kill -9 of the device's daemon by one rank inside a step (amid its gradients, once the
    commit answered, before its commit poll): every rank fails with DeviceLostError, and the
    job restarted on the remounted device resumes from one step and ends bit for bit."""
    daemon_killed(killable, tmp_path, trial, world, rank, stage)


def trial_plan(count: int) -> list[tuple[int, int, int, str]]:
    """(trial, world, rank, stage): every stage at 2 and 3 ranks, the striking rank spread."""
    plan = []
    for index in range(count):
        trial = 100 + index
        world = 2 + index % 2
        stage = STAGES[(index // 2) % len(STAGES)]
        plan.append((trial, world, (index // 3) % world, stage))
    return plan


def run_all(trials: list[tuple[int, int, int, str]], one: Any) -> list[str]:
    """Run every trial (a failure does not stop the others); the failures, described."""
    failures = []
    for trial, world, rank, stage in trials:
        try:
            one(trial, world, rank, stage)
        except Exception as exc:  # noqa: BLE001  (an assertion or a timeout: the trial failed)
            failures.append(f"trial {trial} (world {world}, rank {rank}, {stage}): {type(exc).__name__}: "
                            f"{str(exc)[:1500]}")
    return failures


@pytest.mark.slow
def test_daemon_killed_mid_step_trials(killable: Mount, tmp_path: Path, figures: list[str]) -> None:
    """36 trials: kill -9 of the daemon at each stage of a step (and at random instants) at
    2 and 3 ranks."""
    plan = trial_plan(36)
    failures = run_all(plan, lambda t, w, r, s: daemon_killed(killable, tmp_path, t, w, r, s))
    figures.append(f"T17d kill -9 of the device's daemon mid-step in a 2/3-rank job (every stage of a step, "
                   f"random instants): {len(plan)} trials, {len(failures)} failures (each rank failed with "
                   "DeviceLostError, resumed from one committed step, bit for bit as uninterrupted)")
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ torchrun's elastic restart


def torchrun_job(mount: Mount, out: Path, namespace: str, world: int, last: int, kill: dict[str, Any]) -> int:
    """The job under the real torchrun (a standalone rendezvous, one restart allowed); its
    exit code, its output in out/logs.txt."""
    out.mkdir(parents=True, exist_ok=True)
    config = {"mount": str(mount.mountpoint), "namespace": namespace, "last": last, "out": str(out),
              "ddp": True, "synthetic": True, "kill": kill}
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    # torchrun's agent shares its rendezvous TCPStore with the workers by default, keyed the
    # same on every attempt: a restarted gloo rank can read a dead worker's address from the
    # first attempt and fail with "Gloo connectFullMesh failed ... Connection refused"
    # (pytorch/pytorch#135712, seen here with torch 2.13). A fresh store per round is torch's
    # own workaround for restarts.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    process = subprocess.run([str(torchrun), "--nproc-per-node", str(world), "--max-restarts", "1", "--standalone",
                              str(JOB), json.dumps(config)], env=env | {"OMP_NUM_THREADS": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=JOB_TIMEOUT_S)
    (out / "logs.txt").write_text(process.stdout)
    return process.returncode


def elastic_restart(mount: Mount, tmp_path: Path, trial: int, world: int, rank: int, stage: str) -> None:
    """Rank `rank` kills itself (SIGKILL) at `stage` of step `at` on torchrun's first attempt;
    torchrun restarts every worker, which resume from the device's committed step (rank 0
    aborting the step the dead attempt left open) and finish bit for bit as uninterrupted."""
    ensure_mounted(mount)
    namespace, at, last = f"tr{trial}", 2 + trial % 4, 8
    out = tmp_path / f"tr{trial}"
    code = torchrun_job(mount, out, namespace, world, last, {"rank": rank, "step": at, "stage": stage, "attempt": 0})
    assert code == 0, (code, log_of(out))
    note = json.loads((out / f"kill{rank}.json").read_text())  # the first attempt's rank did strike
    ranks = finished(out, world, [0] * world)
    firsts = {r["result"]["first"] for r in ranks}
    assert len(firsts) == 1, firsts  # one common step for every rank
    first = firsts.pop()
    assert first - 1 in expected_committed(note), (note, first)
    for r in ranks:
        assert r["result"]["attempt"] == 1 and r["result"]["restored"] is True
        assert r["result"]["committed_step"] == last
    # The striking rank had joined the step in flight (all stages but before_step and
    # after_commit): the dead attempt left it open, and the restart's rank 0 aborted it.
    if stage in ("after_join", "mid_grads", "before_commit") and first == at:
        assert any(f"had step {at} open, left by an earlier job" in w for w in ranks[0]["result"]["warnings"]), \
            ranks[0]["result"]["warnings"]
    stats = statistics(mount, namespace)
    assert stats["committed_step"] == last and stats["step_open"] is None
    for other in ranks[1:]:
        assert bits_equal(other["params"], ranks[0]["params"]), "ranks hold different params"
    params, masters = reference(mount, last)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)


def test_torchrun_restarts_after_a_rank_killed_mid_step(killable: Mount, tmp_path: Path) -> None:
    """torchrun --max-restarts 1: rank 1 SIGKILLs itself halfway through its gradients on the
    first attempt; the restarted workers resume from the device's step and end bit for bit."""
    elastic_restart(killable, tmp_path, 0, 2, 1, "mid_grads")


@pytest.mark.slow
def test_torchrun_restarts_trials(killable: Mount, tmp_path: Path, figures: list[str]) -> None:
    """10 trials under torchrun at 2 and 3 workers, every rank-kill stage."""
    stages = ("before_step", "after_join", "mid_grads", "before_commit", "after_commit")
    plan = [(200 + i, 2 + i % 2, (i // 2) % (2 + i % 2), stages[i % len(stages)]) for i in range(10)]
    failures = run_all(plan, lambda t, w, r, s: elastic_restart(killable, tmp_path, t, w, r, s))
    figures.append(f"T17e torchrun elastic restart after kill -9 of a rank mid-step (2/3 workers, every stage): "
                   f"{len(plan)} trials, {len(failures)} failures (resumed from the device's step, bit for bit)")
    assert not failures, "\n".join(failures)
