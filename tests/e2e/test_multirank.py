"""Multi-rank training on one shared namespace: ranks as real processes on gloo (tests/e2e/multirank_job.py) through a real mount, against single-process cossd and torch."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from cossd.client import AdminClient
from cossd.harness.reference import MixedPrecisionOptimizer
from cossd.trainer import AdamW

from conftest import Mount
from helpers import free_port
from ranks import bits_equal, finished, mounted_device, spawn_ranks  # noqa: F401  (re-exported)

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("multirank_job.py")
sys.path.insert(0, str(JOB.parent))
import multirank_job as job  # noqa: E402  (the model, its groups and schedule, shared with the ranks)

JOB_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One device for the module's jobs (each on namespaces of its own), always unmounted."""
    with mounted_device(tmp_path_factory.mktemp("multirank"), "MULTIRANK0001") as mounted:
        yield mounted


def run_job(mount: Any, out: Path, namespace: str, world: int, last: int, **options: Any) -> list[int]:
    """Start `world` ranks as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
    wait for them; their exit codes. `mount.mountpoint` is a mount or a server's URL. Options
    go to multirank_job.py (ddp, clip, overflow, kill, synthetic, step_timeout_s, use_cmb)."""
    config = {"mount": str(mount.mountpoint), "namespace": namespace, "last": last, "out": str(out),
              "ddp": True} | options
    return spawn_ranks(JOB, config, world, out, JOB_TIMEOUT_S)


def single_process(mount: Mount, namespace: str, grads: dict[int, list[torch.Tensor]], last: int,
                   clip: float | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], AdamW]:
    """The same model, groups and schedule in this process (no torch.distributed: one
    namespace, one writer), stepped on the given gradients: its params and masters."""
    torch.manual_seed(0)
    model = job.Net()
    optimizer = AdamW(job.groups_of(model), lr=job.BASE_LR, betas=(0.9, 0.95), mount=mount.mountpoint,
                      namespace=namespace, max_grad_norm=clip)
    model.to(torch.bfloat16)
    params = job.optimizer_params(optimizer)
    try:
        for step in range(1, last + 1):
            for group, base in zip(optimizer.param_groups, (job.BASE_LR, 2 * job.BASE_LR)):
                group["lr"] = base * job.schedule(step)
            for param, grad in zip(params, grads[step]):
                param.grad = grad.clone()
            optimizer.step()
        return [p.detach().clone() for p in params], optimizer.master_weights(), optimizer
    finally:
        optimizer.close()


def torch_fused(grads: dict[int, list[torch.Tensor]], last: int, clip: float) -> list[torch.Tensor]:
    """torch.optim.AdamW(fused=True) on FP32 masters, clipped by clip_grad_norm_: its masters."""
    torch.manual_seed(0)
    model = job.Net()
    reference = MixedPrecisionOptimizer(job.groups_of(model), torch.optim.AdamW, fused=True, lr=job.BASE_LR,
                                        betas=(0.9, 0.95))
    model.to(torch.bfloat16)
    for step in range(1, last + 1):
        for group, base in zip(reference.param_groups, (job.BASE_LR, 2 * job.BASE_LR)):
            group["lr"] = base * job.schedule(step)
        for param, grad in zip(reference.model_params, grads[step]):
            param.grad = grad.clone()
        reference.step(max_grad_norm=clip)
    return [master.detach() for master in reference.masters]


def statistics(mount: Mount, namespace: str) -> dict[str, Any]:
    with AdminClient(mount.mountpoint) as admin:
        return admin.statistics(admin.nsid(namespace))


# ---------------------------------------------------------------------------------------------


def equal_to_single_process(mount: Mount, tmp_path: Path, world: int, steps: int) -> None:
    namespace = f"eq{world}-{steps}"
    codes = run_job(mount, tmp_path / "job", namespace, world, steps)
    ranks = finished(tmp_path / "job", world, codes)
    assert all(r["result"]["committed_step"] == steps for r in ranks)
    # DDP was found: the optimizer took its averages as they are, and said nothing of averaging.
    assert not any("averages the gradients" in w for r in ranks for w in r["result"]["warnings"])
    for other in ranks[1:]:
        assert bits_equal(other["params"], ranks[0]["params"]), "ranks hold different params"
    stats = statistics(mount, namespace)
    assert stats["steps_committed"] == steps and stats["committed_step"] == steps
    params, masters, _ = single_process(mount, f"ref{world}-{steps}", ranks[0]["grads"], steps)
    assert bits_equal(ranks[0]["params"], params)
    assert bits_equal(ranks[0]["masters"], masters)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_run_equals_single_process_bit_for_bit(mount: Mount, tmp_path: Path, world: int) -> None:
    """DDP's averaged gradients, two param groups, warmup-cosine: every rank ends with the
    params a single-process run on the same gradients gets, bit for bit, masters too."""
    equal_to_single_process(mount, tmp_path, world, 20)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_run_equals_single_process_long(mount: Mount, tmp_path: Path, world: int) -> None:
    equal_to_single_process(mount, tmp_path, world, 60)


def test_global_norm_clipping_across_shards(mount: Mount, tmp_path: Path) -> None:
    """Clipping by the norm over every rank's shard (one gather of squared sums): within
    1e-6 x max|param| of single-process cossd and of torch's fused AdamW with clip_grad_norm_."""
    world, steps, clip = 3, 20, 0.05
    codes = run_job(mount, tmp_path / "job", "clip3", world, steps, clip=clip)
    ranks = finished(tmp_path / "job", world, codes)
    grads = ranks[0]["grads"]
    _, cossd_masters, optimizer = single_process(mount, "clip3-ref", grads, steps, clip=clip)
    assert optimizer.last_grad_norm is not None and optimizer.last_grad_norm > clip  # it clipped
    torch_masters = torch_fused(grads, steps, clip)
    mine = ranks[0]["masters"]
    scale = max(float(m.abs().max()) for m in mine)
    for name, theirs in (("single-process cossd", cossd_masters), ("torch fused AdamW", torch_masters)):
        worst = max(float((a - b).abs().max()) for a, b in zip(mine, theirs))
        assert worst <= 1e-6 * scale, f"{name}: {worst} > 1e-6 x {scale}"


def test_overflow_on_one_rank_skips_the_step_on_all(mount: Mount, tmp_path: Path) -> None:
    """No DDP: the optimizer averages (and says so); an inf in one rank's gradients reaches
    one shard, and the device skips the step for every rank, counted once."""
    world, steps = 2, 8
    codes = run_job(mount, tmp_path / "job", "overflow2", world, steps, ddp=False,
                    overflow={"rank": 1, "step": 4})
    ranks = finished(tmp_path / "job", world, codes)
    for r in ranks:
        assert r["result"]["committed_step"] == steps - 1
        assert r["result"]["steps_skipped"] == 1
    assert any("averages the gradients of the 2 ranks itself" in w for w in ranks[0]["result"]["warnings"])
    stats = statistics(mount, "overflow2")
    assert stats["steps_skipped"] == 1 and stats["last_skipped_step"] == 4
    assert stats["steps_committed"] == steps - 1
    assert bits_equal(ranks[0]["params"], ranks[1]["params"])
    # The same averaged gradients in one process: the same skip, the same params.
    averaged = {}
    for step in ranks[0]["grads"]:
        total = [a.float() + b.float() for a, b in zip(ranks[0]["grads"][step], ranks[1]["grads"][step])]
        averaged[step] = [(t / world).to(torch.bfloat16) for t in total]  # the wire dtype, as the ranks send it
    params, masters, optimizer = single_process(mount, "overflow2-ref", averaged, steps)
    assert optimizer.steps_skipped == 1
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)


def test_resume_on_other_world_sizes(mount: Mount, tmp_path: Path) -> None:
    """A job saved at 4 ranks resumes at 2, 3 and 1 on the namespace (nothing moves) and
    ends bit for bit where an uninterrupted 4-rank job on the same gradients ends."""
    steps = 20
    codes = run_job(mount, tmp_path / "whole", "whole4", 4, steps, synthetic=True)
    whole = finished(tmp_path / "whole", 4, codes)
    last = 0
    for index, (world, until) in enumerate(((4, 5), (2, 10), (3, 15), (1, 20))):
        out = tmp_path / f"phase{index}"
        ranks = finished(out, world, run_job(mount, out, "resumed", world, until, synthetic=True))
        for r in ranks:
            assert r["result"]["first"] == last + 1 and r["result"]["committed_step"] == until
            assert r["result"]["restored"] == (last > 0)
        last = until
    assert bits_equal(ranks[0]["params"], whole[0]["params"])
    assert bits_equal(ranks[0]["masters"], whole[0]["masters"])


def test_a_rank_that_cannot_open_fails_every_rank(mount: Mount, tmp_path: Path) -> None:
    """One rank given a path that is no mount: every rank fails at construction with its
    reason (none waits for it), nothing is created on the device, and the rank whose mount
    opened holds nothing of it open."""
    out = tmp_path / "job"
    codes = run_job(mount, out, "nomount", 2, 2, mount_of_rank={"1": str(tmp_path / "missing")})
    assert codes == [4, 4], (codes, (out / "logs.txt").read_text()[-4000:])
    assert "is not a mounted cossd device" in (out / "error1.txt").read_text()
    assert "could not open the optimizer: rank 1: FileNotFoundError" in (out / "error0.txt").read_text()
    assert (out / "held0.txt").read_text() == ""  # rank 0 opened its mount, and closed it again
    with AdminClient(mount.mountpoint) as admin:
        assert "nomount" not in [entry["name"] for entry in admin.describe()["namespaces"]]


def killed_mid_step(mount: Mount, tmp_path: Path, trial: int, world: int, rank: int, stage: str, at: int = 4) -> None:
    namespace, steps = f"kill{trial}", 8
    out = tmp_path / f"kill{trial}"
    # The bound applies to every step: short enough for a quick test, long enough that a healthy
    # rank starved for a moment on a loaded 2-core machine does not abort an earlier step.
    codes = run_job(mount, out, namespace, world, steps, synthetic=True, step_timeout_s=5.0,
                    kill={"rank": rank, "step": at, "stage": stage})
    assert codes[rank] == -signal.SIGKILL, (codes, (out / "logs.txt").read_text()[-4000:])
    survivors = [r for r in range(world) if r != rank]
    assert [codes[r] for r in survivors] == [3] * len(survivors), (codes, (out / "logs.txt").read_text()[-4000:])
    stats = statistics(mount, namespace)
    # A rank with an empty shard killed after joining leaves nothing missing: its step commits
    # and the next one, which it never joins, is the one aborted.
    stuck = stats["committed_step"] + 1
    assert stuck in (at, at + 1) and stats["step_open"] is None
    for r in survivors:
        message = (out / f"error{r}.txt").read_text()
        assert f"step {stuck} of namespace {namespace!r} was not committed" in message
        assert f"stays at step {stuck - 1}" in message
    # The restarted job resumes every rank from the one committed step and finishes as a
    # run that never stopped.
    again = tmp_path / f"again{trial}"
    ranks = finished(again, world, run_job(mount, again, namespace, world, steps, synthetic=True))
    assert all(r["result"]["first"] == stuck for r in ranks)
    grads = {step: job.synthetic_grads(step, ranks[0]["params"]) for step in range(1, steps + 1)}
    params, masters, _ = single_process(mount, f"kill{trial}-ref", grads, steps)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)


def test_ranks_through_a_storage_server(mount: Mount, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks of a node without a mount: the shared step through `cossd serve` (each rank
    a connection), bit for bit as one process stepping the same gradients on a mount."""
    import dataclasses

    from cossd.emulator import Device
    from test_server import start_server

    token = tmp_path / "token"
    token.write_text("multirank-test-token-0123456789abcdef\n")
    token.chmod(0o600)
    Device.format(tmp_path / "srv", capacity_bytes=4 << 30, serial="MULTIRANKSRV1")
    served = start_server(tmp_path / "srv", ["--listen", "127.0.0.1:0", "--token-file", str(token)])
    monkeypatch.setenv("COSSD_TOKEN_FILE", str(token))

    @dataclasses.dataclass
    class At:
        mountpoint: str

    try:
        world, steps = 2, 8
        ranks = finished(tmp_path / "job", world, run_job(At(served.url), tmp_path / "job", "remote2", world,
                                                          steps, synthetic=True))
    finally:
        served.stop()
    assert all(r["result"]["committed_step"] == steps for r in ranks)
    grads = {step: job.synthetic_grads(step, ranks[0]["params"]) for step in range(1, steps + 1)}
    params, masters, _ = single_process(mount, "remote2-ref", grads, steps)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[1]["params"], params)
    assert bits_equal(ranks[0]["masters"], masters)


@pytest.mark.parametrize("trial,world,rank,stage", [(0, 2, 1, "mid_grads"), (2, 3, 0, "after_join")])
def test_rank_killed_mid_step(mount: Mount, tmp_path: Path, trial: int, world: int, rank: int, stage: str) -> None:
    """kill -9 of one rank in a step (halfway through its gradients, or after it joined the
    step; the slow tier adds ranks killed before they begin it): the others get a clear error
    within their bound, the device stays at step N, and the job restarted resumes from step N
    on every rank."""
    killed_mid_step(mount, tmp_path, trial, world, rank, stage)


def rank_kill_plan() -> list[tuple[int, int, int, str, int]]:
    """(trial, world, rank, stage, step): every rank of 2, 3 and 4 at every stage, then the
    first combinations again, the step struck at spread over 2..6."""
    stages = ("after_join", "before_step", "mid_grads")
    combos = [(world, rank, stage) for world in (2, 3, 4) for rank in range(world) for stage in stages]
    combos += combos[:6]
    return [(10 + index, world, rank, stage, 2 + index % 5) for index, (world, rank, stage) in enumerate(combos)]


@pytest.mark.slow
def test_rank_killed_mid_step_trials(mount: Mount, tmp_path: Path, figures: list[str]) -> None:
    """33 trials of kill -9 of one rank (each rank of 2, 3 and 4 at each stage), each checked
    as test_rank_killed_mid_step; a failure does not stop the others."""
    plan = rank_kill_plan()
    failures = []
    for trial, world, rank, stage, at in plan:
        try:
            killed_mid_step(mount, tmp_path, trial, world, rank, stage, at)
        except Exception as exc:  # noqa: BLE001  (an assertion or a timeout: this trial failed)
            failures.append(f"trial {trial} (world {world}, rank {rank}, {stage}, step {at}): "
                            f"{type(exc).__name__}: {str(exc)[:1500]}")
    figures.append(f"T17 kill -9 of one rank mid-step (2/3/4 ranks, every rank, 3 stages): {len(plan)} trials, "
                   f"{len(failures)} failures (the others aborted within their bound, resumed from one step, "
                   "bit for bit as uninterrupted)")
    assert not failures, "\n".join(failures)


def test_what_a_sharded_optimizer_does_not_support_is_refused_loudly(mount: Mount, tmp_path: Path) -> None:
    """With two ranks: streaming=True and a wrapper's swapped params each raise on every rank
    with a clear message, and change nothing (the device at the step it had); load_state_dict
    of another run's state (a stock optimizer's at step 1) is no longer refused: it loads on
    every rank (tests/e2e/test_sharded_load.py checks what it loads)."""
    script = JOB.with_name("multirank_refusals.py")
    env = os.environ | {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                        "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script), str(mount.mountpoint)], env=env | {"RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    found = []
    for process in ranks:
        out, err = process.communicate(timeout=JOB_TIMEOUT_S)
        assert process.returncode == 0, err[-2000:]
        found.append(json.loads(out.strip().splitlines()[-1]))
    for answer in found:
        assert answer["streaming"].startswith("ValueError: streaming=True is not supported by a sharded optimizer")
        assert answer["load_state_dict"] == "accepted"
        assert answer["groups_unchanged"] is True
        assert answer["swapped_params"].startswith("NotImplementedError: the param groups hold other tensors")
        assert answer["committed_step"] == 1
    assert (mount.mountpoint / "ns/refused/step").read_text().strip() == "1"
    assert not (mount.mountpoint / "ns/refused-stream").exists()  # refused before it made anything



@pytest.mark.parametrize("world,dtype", [(2, "mixed"), (3, "bf16")])
def test_param_gather_allgather_equals_reading_every_param(mount: Mount, tmp_path: Path, world: int,
                                                           dtype: str) -> None:
    """param_gather="allgather" (each rank reads its shard from the device, one all-gather
    gives every rank the rest) against "device" (every rank reads every param), under DDP,
    FP32 params (their masters come back) at 2 ranks and BF16 ones at 3: every rank of both
    jobs holds the same params bit for bit, and the device sent the params of each step
    once instead of once per rank."""
    from test_fsdp2 import finished as finished_fsdp_job
    from test_fsdp2 import run_job as run_fsdp_job

    steps, held, sent = 8, {}, {}
    for gather in ("device", "allgather"):
        namespace, out = f"gather-{gather}{world}", tmp_path / gather
        ranks = finished_fsdp_job(out, world, run_fsdp_job(mount, out, namespace, world, steps, mode="ddp",
                                                           dtype=dtype, param_gather=gather))
        assert all(r["result"]["committed_step"] == steps for r in ranks)
        for other in ranks[1:]:
            assert bits_equal(other["params"], ranks[0]["params"]), f"{gather}: ranks hold different params"
        held[gather] = ranks[0]["params"]
        sent[gather] = statistics(mount, namespace)["bytes_read"]
    assert bits_equal(held["allgather"], held["device"])
    param_bytes = sum(p.numel() * p.element_size() for p in held["device"])
    # One read more than the steps: DDP, wrapped after the optimizer was made, broadcasts the
    # params (written outside the optimizer, with the device's values), so the first step's
    # check reads the device's params on every rank (step_guards.py), the same way.
    assert sent["device"] - sent["allgather"] == (world - 1) * (steps + 1) * param_bytes


# ------------------------------------------------------------------ params written outside the optimizer


def _refused(out: Path, rank: int) -> str:
    text = (out / f"error{rank}.txt").read_text()
    assert f"rank {rank}:" in text and "written outside the optimizer" in text, text
    assert "load the weights before making the optimizer" in text, text
    return text


def test_weights_loaded_before_the_first_step_become_the_masters(mount: Mount, tmp_path: Path) -> None:
    """DDP, 2 ranks: other weights loaded into the model (model.load_state_dict) after the
    optimizer was made, before the first step (a Hugging Face or seed checkpoint), become the
    masters on every rank's agreement: the job ends bit for bit where one that loaded them
    before making the optimizer ends (params and masters)."""
    held = {}
    for name, options in (("adopted", {"load": {"step": 1, "ranks": [0, 1]}}), ("preloaded", {"preload": 0.01})):
        out = tmp_path / name
        ranks = finished(out, 2, run_job(mount, out, f"first-{name}", 2, 3, **options))
        assert all(r["result"]["committed_step"] == 3 for r in ranks)
        assert bits_equal(ranks[1]["params"], ranks[0]["params"])
        held[name] = ranks[0]
    assert bits_equal(held["adopted"]["params"], held["preloaded"]["params"])
    assert bits_equal(held["adopted"]["masters"], held["preloaded"]["masters"])


def test_a_failed_write_of_loaded_weights_as_the_masters_fails_every_rank_until_written_again(
        mount: Mount, tmp_path: Path) -> None:
    """DDP, 2 ranks load other weights before the first step; rank 1's write of its shard of
    them as the masters fails (rank 0's went in: the device's masters are half the loaded
    ones). Every rank's step() raises, naming rank 1's error, and nothing is committed;
    state_dict() then refuses on every rank (it would record the half-loaded masters); the
    next step() writes them all again, and the job ends bit for bit where one that loaded
    the weights before making the optimizer ends."""
    out = tmp_path / "job"
    ranks = finished(out, 2, run_job(mount, out, "first-write-fails", 2, 3, load={"step": 1, "ranks": [0, 1]},
                                     fail_masters_once=1))
    for rank in range(2):
        seen = json.loads((out / f"retried{rank}.json").read_text())
        assert "writing them as the masters failed, nothing was sent: rank 1: OSError" in seen["error"], seen
        assert "injected" in seen["error"] and seen["committed_step"] == 0, seen
        assert seen["state_dict"].startswith("InconsistentStateError") and "failed part way" in seen["state_dict"], seen
    assert all(r["result"]["committed_step"] == 3 for r in ranks)
    reference = tmp_path / "preloaded"
    preloaded = finished(reference, 2, run_job(mount, reference, "first-write-ref", 2, 3, preload=0.01))
    assert bits_equal(ranks[0]["params"], preloaded[0]["params"])
    assert bits_equal(ranks[0]["masters"], preloaded[0]["masters"])


def test_weights_loaded_on_one_rank_before_the_first_step_are_refused_on_every_rank(mount: Mount,
                                                                                   tmp_path: Path) -> None:
    """DDP, 2 ranks, only rank 1 loads other weights before the first step: the replicas
    disagree, so every rank's step() refuses, saying so, and nothing is committed."""
    out, namespace = tmp_path / "job", "first-one-rank"
    codes = run_job(mount, out, namespace, 2, 3, load={"step": 1, "ranks": [1]})
    assert codes == [6, 6], (codes, (out / "logs.txt").read_text()[-3000:])
    for rank in range(2):
        text = (out / f"error{rank}.txt").read_text()
        assert "rank(s) 1 " in text and "hold different values (ranks 0, 1)" in text, text
        assert "Load the same weights on every rank" in text, text
        assert json.loads((out / f"refused{rank}.json").read_text())["committed_step"] == 0
    assert statistics(mount, namespace)["committed_step"] == 0


def test_weights_loaded_after_a_skipped_first_step_are_refused_on_every_rank(mount: Mount, tmp_path: Path) -> None:
    """The first step skipped (an overflow: the device began it, so the namespace no longer
    loads), then other weights loaded on every rank: they cannot become the masters in
    place, so every rank's step() refuses, naming load_state_dict, and nothing is committed."""
    out, namespace = tmp_path / "job", "first-skipped"
    codes = run_job(mount, out, namespace, 2, 3, overflow={"rank": 0, "step": 1}, load={"step": 2, "ranks": [0, 1]})
    assert codes == [6, 6], (codes, (out / "logs.txt").read_text()[-3000:])
    for rank in range(2):
        text = (out / f"error{rank}.txt").read_text()
        assert "a step began on the device already" in text and "optimizer.load_state_dict" in text, text
    found = statistics(mount, namespace)
    assert (found["committed_step"], found["steps_skipped"]) == (0, 1)


def test_weights_loaded_after_the_first_step_are_refused_on_every_rank(mount: Mount, tmp_path: Path) -> None:
    """DDP, 2 ranks: other weights loaded into the model (model.load_state_dict) after two
    steps: each rank's step() refuses, saying why and what to do, and nothing is committed
    (the device writing its own values over them was the silent outcome before)."""
    step = 3
    namespace, out = f"loaded-after-{step}", tmp_path / "job"
    codes = run_job(mount, out, namespace, 2, 4, load={"step": step, "ranks": [0, 1]})
    assert codes == [6, 6], (codes, (out / "logs.txt").read_text()[-3000:])
    for rank in range(2):
        _refused(out, rank)
        assert json.loads((out / f"refused{rank}.json").read_text())["committed_step"] == step - 1
    assert statistics(mount, namespace)["committed_step"] == step - 1


@pytest.mark.parametrize("options", [{}, {"clip": 1.0}, {"ddp": False}], ids=["ddp", "clipped", "averaged"])
def test_weights_loaded_on_one_rank_fail_the_step_on_every_rank(mount: Mount, tmp_path: Path,
                                                                options: dict[str, Any]) -> None:
    """Only rank 1 loads other weights before step 2: it refuses after the step's collectives
    (the norm's gather where it clips, the gradients' average where no DDP averaged them), so
    rank 0 waits in none of them; rank 0, whose gradients are in, is told the step was not
    committed once its bound passes; the device keeps step 1."""
    out, namespace = tmp_path / "job", "loaded-one-" + "-".join(sorted(options) or ["ddp"])
    codes = run_job(mount, out, namespace, 2, 3, load={"step": 2, "ranks": [1]}, step_timeout_s=5.0, **options)
    assert codes == [3, 6], (codes, (out / "logs.txt").read_text()[-3000:])
    _refused(out, 1)
    assert f"step 2 of namespace {namespace!r} was not committed" in (out / "error0.txt").read_text()
    assert statistics(mount, namespace)["committed_step"] == 1


def test_the_same_weights_loaded_again_change_nothing(mount: Mount, tmp_path: Path) -> None:
    """Every rank loads the weights it holds (a reload of the same checkpoint) before step 2:
    the values are the device's, so the job trains on, bit for bit as one that did not."""
    held = {}
    for name, options in (("reload-same", {"load": {"step": 2, "ranks": [0, 1], "same": True}}), ("reload-none", {})):
        out = tmp_path / name
        ranks = finished(out, 2, run_job(mount, out, name, 2, 3, **options))
        assert all(r["result"]["committed_step"] == 3 for r in ranks)
        held[name] = ranks[0]["params"]
    assert bits_equal(held["reload-same"], held["reload-none"])


@pytest.mark.parametrize("mode,gather", [("fsdp", "device"), ("ddp", "allgather")])
def test_params_written_outside_the_optimizer_are_refused_under_fsdp2_and_allgather(
        mount: Mount, tmp_path: Path, mode: str, gather: str) -> None:
    """FSDP2 over 2 ranks (each rank's local shard written) and DDP with
    param_gather="allgather" (the device's values read by each rank alone, no collective):
    other values refused on every rank, nothing committed; the same values train on."""
    from test_fsdp2 import finished as finished_fsdp_job
    from test_fsdp2 import run_job as run_fsdp_job

    namespace, out = f"written-{mode}-{gather}", tmp_path / "other"
    codes = run_fsdp_job(mount, out, namespace, 2, 3, mode=mode, param_gather=gather,
                         load={"step": 2, "ranks": [0, 1]})
    assert codes == [7, 7], (codes, (out / "logs.txt").read_text()[-3000:])
    for rank in range(2):
        _refused(out, rank)
        assert (out / f"committed{rank}.txt").read_text() == "1"
    assert statistics(mount, namespace)["committed_step"] == 1
    out = tmp_path / "same"
    ranks = finished_fsdp_job(out, 2, run_fsdp_job(mount, out, f"same-{mode}-{gather}", 2, 3, mode=mode,
                                                   param_gather=gather,
                                                   load={"step": 2, "ranks": [0, 1], "same": True}))
    assert all(r["result"]["committed_step"] == 3 for r in ranks)

