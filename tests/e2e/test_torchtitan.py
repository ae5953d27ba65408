"""torchtitan 0.3.0 with cossd's AdamW through its OptimizersContainer: the llama3 debug model trained by torchrun on gloo, checkpointed by torchtitan's CheckpointManager, the job (or the device daemon) killed (kill -9) between two checkpoints and resumed, bit-identical to the run that never stopped. Runs in the .venv-titan interpreter (`make torchtitan`)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from conftest import Mount
from ranks import bits_equal, mounted_device

REPO = Path(__file__).resolve().parents[2]
TITAN_PY = REPO / ".venv-titan" / "bin" / "python"
CONFIG = Path(__file__).with_name("titan_config.py")
JOB_TIMEOUT_S = 300
STEPS, KILL_AFTER = 7, 5  # checkpoints after steps 3 and 6 (interval 3) and the last; killed after 5


def _titan_missing() -> str | None:
    if not TITAN_PY.exists():
        return f"{TITAN_PY} is absent: `make torchtitan` makes the torchtitan virtualenv"
    probe = subprocess.run([str(TITAN_PY), "-c", "import torchtitan, cossd.trainer.torchtitan"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"torchtitan or cossd does not import in {TITAN_PY}: {probe.stderr.strip().splitlines()[-1:]}"
    return None


pytestmark = [pytest.mark.mount, pytest.mark.skipif(_titan_missing() is not None, reason=str(_titan_missing()))]


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    with mounted_device(tmp_path_factory.mktemp("titan"), "TITANTEST001") as mounted:
        yield mounted


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("titan-assets")
    subprocess.run([str(TITAN_PY), str(CONFIG), "assets", str(root)], check=True, timeout=120)
    return root


def _command(device: Mount, assets: Path, dump: Path, namespace: str, world: int, options: tuple[str, ...] = (),
             **variables: str) -> tuple[list[str], dict[str, str]]:
    """torchtitan's trainer under torchrun, as a user starts it (through the CPU launcher),
    with more of torchtitan's `options`, and its environment with `variables`
    (TITAN_KILL_AFTER, TITAN_STALL_AFTER, ...)."""
    env = os.environ | {"PYTHONPATH": str(CONFIG.parent), "TITAN_ASSETS": str(assets),
                        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for variable in ("TITAN_KILL_AFTER", "TITAN_STALL_AFTER", "TITAN_STALL_DIR", "TITAN_OPTIMIZER", "TITAN_STEPS",
                     "TITAN_KILL_RANK", "TITAN_KILL_STEP", "TITAN_KILL_NOTE"):
        env.pop(variable, None)
    env |= {"TITAN_STEPS": str(STEPS)} | variables
    command = [str(TITAN_PY), "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--standalone",
               "-m", "cossd.integrations.torchtitan_cpu", "--module", "titan_config", "--config", "tiny_llama",
               "--optimizer.mount", str(device.mountpoint), "--optimizer.namespace", namespace,
               "--dump_folder", str(dump), *options]
    return command, env


def torchrun(device: Mount, assets: Path, dump: Path, namespace: str, world: int,
             kill_after: int | None = None, options: tuple[str, ...] = (),
             **variables: str) -> subprocess.CompletedProcess[str]:
    """torchtitan's trainer under torchrun, run to its end (or its kill -9 after `kill_after` steps)."""
    if kill_after is not None:
        variables["TITAN_KILL_AFTER"] = str(kill_after)
    command, env = _command(device, assets, dump, namespace, world, options, **variables)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    dump.mkdir(parents=True, exist_ok=True)
    with open(dump / "logs.txt", "a") as log:
        log.write(f"--- {' '.join(command)} (exit {done.returncode})\n{done.stdout}{done.stderr}")
    return done


def losses(dump: Path) -> dict[str, float]:
    read = subprocess.run([str(TITAN_PY), str(CONFIG), "losses", str(dump)], capture_output=True, text=True,
                          check=True, timeout=120)
    return json.loads(read.stdout)


def checkpoint_of(checkpoint: Path, scratch: Path) -> dict[str, Any]:
    """A torchtitan (DCP) checkpoint, read whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, scratch)
    return torch.load(scratch, weights_only=False)


def model_of(checkpoint: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model's tensors in a torchtitan checkpoint (its top-level tensors)."""
    return {k: v for k, v in checkpoint_of(checkpoint, scratch).items() if isinstance(v, torch.Tensor)}


def device_state(device: Mount, namespace: str, scratch: Path) -> dict[str, torch.Tensor]:
    """The namespace's masters, moments and params, as the device exports them."""
    from safetensors.torch import load_file

    subprocess.run([str(REPO / ".venv" / "bin" / "cossd"), "export", str(device.mountpoint), namespace,
                    "--path", str(scratch), "--with-state", "-q", "--force"], check=True, timeout=120)
    return load_file(scratch)


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and bits_equal([a[k] for k in sorted(a)], [b[k] for k in sorted(b)])


@pytest.mark.slow  # three torchrun jobs of 2 ranks: about 90 s on 2 cores
def test_two_ranks_killed_between_two_checkpoints_resume_bit_identical(device: Mount, assets: Path,
                                                                       tmp_path: Path) -> None:
    """FSDP2 at 2 gloo ranks: the run that never stopped against one whose ranks were
    killed (-9) after step 5, between the checkpoints of steps 3 and 6, and resumed by the
    same command: torchtitan loads step 3 (the device rolls back from step 5), and every
    loss, every param of the last checkpoint and the device's masters and moments are
    bit for bit the uninterrupted run's. The checkpoint holds the model and a reference."""
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    done = torchrun(device, assets, whole, "titan-whole", 2)
    assert done.returncode == 0, (whole / "logs.txt").read_text()[-6000:]

    killed = torchrun(device, assets, broken, "titan-broken", 2, kill_after=KILL_AFTER)
    assert killed.returncode != 0 and "Signal 9 (SIGKILL) received" in killed.stdout + killed.stderr, \
        (broken / "logs.txt").read_text()[-6000:]
    checkpoints = broken / "checkpoint"
    assert (checkpoints / "step-3").is_dir() and not (checkpoints / "step-6").exists()

    resumed = torchrun(device, assets, broken, "titan-broken", 2)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, (broken / "logs.txt").read_text()[-6000:]
    assert "Training starts at step 4" in log

    whole_losses, resumed_losses = losses(whole), losses(broken)
    assert sorted(whole_losses, key=int) == [str(step) for step in range(1, STEPS + 1)]
    assert resumed_losses == whole_losses  # float32 values, compared exactly
    assert same_tensors(model_of(checkpoints / f"step-{STEPS}", tmp_path / "a.pt"),
                        model_of(whole / "checkpoint" / f"step-{STEPS}", tmp_path / "b.pt"))
    assert same_tensors(device_state(device, "titan-broken", tmp_path / "a.safetensors"),
                        device_state(device, "titan-whole", tmp_path / "b.safetensors"))

    # What the step-3 checkpoint holds: the model's FP32 params and, for the optimizer,
    # each param's step and one 512-byte reference (no moments: 8 more bytes a param).
    saved = checkpoint_of(whole / "checkpoint" / "step-3", tmp_path / "c.pt")
    params = sum(v.numel() for v in saved.values() if isinstance(v, torch.Tensor))
    optimizer = saved["optimizer"]
    assert [k for k in optimizer if k.endswith(".cossd_ref")] == ["state.tok_embeddings.weight.cossd_ref"]
    assert not any("exp_avg" in k for k in optimizer)
    written = sum(p.stat().st_size for p in (whole / "checkpoint" / "step-3").rglob("*") if p.is_file())
    assert params * 4 < written < params * 4 * 1.1, (params, written)


@pytest.mark.slow  # three torchrun jobs of 2 ranks and a daemon restart: about 2 minutes on 2 cores
def test_daemon_killed_between_two_checkpoints_resume_bit_identical(device: Mount, assets: Path,
                                                                    tmp_path: Path) -> None:
    """The device daemon killed (kill -9) while torchtitan's 2 ranks stand after step 5,
    between the CheckpointManager's checkpoints of steps 3 and 6, then the job; the daemon
    restarted (the device at step 5, the step-3 snapshot kept) and the same command run
    again: torchtitan loads step 3, the device rolls back to it, and every loss, the last
    checkpoint's params and the device's masters and moments are the uninterrupted run's."""
    whole, broken, marks = tmp_path / "whole", tmp_path / "broken", tmp_path / "marks"
    marks.mkdir()
    done = torchrun(device, assets, whole, "titan-d-whole", 2)
    assert done.returncode == 0, (whole / "logs.txt").read_text()[-6000:]

    command, env = _command(device, assets, broken, "titan-d-broken", 2, TITAN_STALL_AFTER=str(KILL_AFTER),
                            TITAN_STALL_DIR=str(marks))
    broken.mkdir()
    with open(broken / "logs.txt", "w") as log:
        job = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + JOB_TIMEOUT_S
            while not all((marks / f"stalled{rank}").exists() for rank in range(2)):
                assert job.poll() is None and time.monotonic() < deadline, \
                    (broken / "logs.txt").read_text()[-6000:]
                time.sleep(0.2)
            device.kill()  # kill -9 of the daemon, the job standing after step 5
        finally:
            # torchrun, then its ranks: each runs in a session of its own, killed by the pid it wrote.
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            for mark in marks.glob("stalled*"):
                try:
                    os.kill(int(mark.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    checkpoints = broken / "checkpoint"
    assert (checkpoints / "step-3").is_dir() and not (checkpoints / "step-6").exists()
    device.restart()

    resumed = torchrun(device, assets, broken, "titan-d-broken", 2)
    assert resumed.returncode == 0, (broken / "logs.txt").read_text()[-6000:]
    assert "Training starts at step 4" in resumed.stdout + resumed.stderr
    assert losses(broken) == losses(whole)  # float32 values, compared exactly
    assert same_tensors(model_of(checkpoints / f"step-{STEPS}", tmp_path / "a.pt"),
                        model_of(whole / "checkpoint" / f"step-{STEPS}", tmp_path / "b.pt"))
    assert same_tensors(device_state(device, "titan-d-broken", tmp_path / "a.safetensors"),
                        device_state(device, "titan-d-whole", tmp_path / "b.safetensors"))


@pytest.mark.slow  # a 7-step torchrun job: 30-60 s on 2 cores (test_fsdp2.py covers one member fast)
def test_one_rank_trains(device: Mount, assets: Path, tmp_path: Path) -> None:
    """torchtitan applies fully_shard at one rank too (a mesh of one, for its mixed
    precision): the cossd optimizer takes each DTensor's local shard, the whole tensor, and
    trains: every step's loss logged and finite, the device at the last step, and the device's
    FP32 masters equal to the last checkpoint's params bit for bit (it refused before)."""
    one = tmp_path / "one"
    done = torchrun(device, assets, one, "titan-one", 1)
    assert done.returncode == 0, (one / "logs.txt").read_text()[-6000:]
    logged = losses(one)
    assert sorted(logged, key=int) == [str(step) for step in range(1, STEPS + 1)]
    assert all(torch.isfinite(torch.tensor(value)) for value in logged.values()), logged
    from cossd.client import AdminClient

    with AdminClient(device.mountpoint) as admin:
        assert int(admin.statistics(admin.nsid("titan-one"))["committed_step"]) == STEPS
    params = model_of(one / "checkpoint" / f"step-{STEPS}", tmp_path / "a.pt")
    state = device_state(device, "titan-one", tmp_path / "a.safetensors")
    # The checkpoint names some tensors as torchtitan converts them (wq, wk, wv where the
    # model holds a fused wqkv): those named alike on both sides are compared.
    masters = {name: state[f"{name}.master"] for name in params if f"{name}.master" in state}
    assert "tok_embeddings.weight" in masters and len(masters) >= len(params) // 2, \
        (sorted(masters), sorted(params))
    assert all(bits_equal([masters[name].reshape(-1)], [params[name].reshape(-1)]) for name in masters)



@pytest.mark.slow  # three torchrun jobs: about 2 minutes on 2 cores
def test_two_ranks_start_from_a_model_only_checkpoint(device: Mount, assets: Path, tmp_path: Path) -> None:
    """torchtitan's initial load (checkpoint.initial_load_path, model only: a seed or
    fine-tuning start) at 2 ranks of FSDP2: it loads the weights into the model after the
    optimizer is made, so cossd takes them as its masters at the first step, every rank
    agreeing (it refused them before). The losses of every step are torch's AdamW's from the
    same checkpoint, within 1e-3."""
    seed = tmp_path / "seed"
    done = torchrun(device, assets, seed, "titan-seed", 1, TITAN_STEPS="4")
    assert done.returncode == 0, (seed / "logs.txt").read_text()[-6000:]
    start = seed / "checkpoint" / "step-4"  # the last save: the model only
    found = {}
    for kind in ("cossd", "torch"):
        dump = tmp_path / kind
        done = torchrun(device, assets, dump, "titan-from-seed", 2, options=("--checkpoint.initial_load_path", str(start)),
                        TITAN_STEPS="3", **({"TITAN_OPTIMIZER": "torch"} if kind == "torch" else {}))
        assert done.returncode == 0, (dump / "logs.txt").read_text()[-6000:]
        found[kind] = losses(dump)
    assert sorted(found["cossd"], key=int) == ["1", "2", "3"], found
    fresh = losses(seed)["2"]  # where a job that ignored the load would be after one step
    for step, loss in found["torch"].items():
        assert abs(found["cossd"][step] - loss) <= 1e-3 * abs(loss), (step, found)
    assert abs(found["cossd"]["2"] - fresh) > 1e-2 * abs(fresh), (found, fresh)


@pytest.mark.slow  # four torchrun jobs of 2 ranks: 2-4 minutes on 2 cores
def test_checkpoint_bytes_stall_and_restore_against_torch_adamw(device: Mount, assets: Path, tmp_path: Path,
                                                                figures: list[str]) -> None:
    """What torchtitan's CheckpointManager writes at step 3 (2 ranks) with torchtitan's own
    AdamW and with cossd's, its save time and a restarted job's load time as torchtitan
    logs them ("Finished saving/loading the checkpoint in S seconds", the slowest rank;
    cossd's load includes the device rollback). Each job is killed after step 4, before
    its last-step checkpoint (which holds the model only), so the restart loads step 3."""
    measured = {}
    for kind in ("torch", "cossd"):
        dump = tmp_path / kind
        first = torchrun(device, assets, dump, f"titan-fig-{kind}", 2, kill_after=4, TITAN_OPTIMIZER=kind,
                         TITAN_STEPS="5")
        assert first.returncode != 0 and (dump / "checkpoint" / "step-3").is_dir(), \
            (dump / "logs.txt").read_text()[-6000:]
        again = torchrun(device, assets, dump, f"titan-fig-{kind}", 2, TITAN_OPTIMIZER=kind, TITAN_STEPS="5")
        assert again.returncode == 0, (dump / "logs.txt").read_text()[-6000:]
        saved = re.findall(r"Finished saving the checkpoint in ([0-9.]+) seconds", first.stdout + first.stderr)
        loaded = re.findall(r"Finished loading the checkpoint in ([0-9.]+) seconds", again.stdout + again.stderr)
        assert saved and loaded, (dump / "logs.txt").read_text()[-6000:]
        step3 = dump / "checkpoint" / "step-3"
        written = sum(p.stat().st_size for p in step3.rglob("*") if p.is_file())
        params = sum(v.numel() for v in checkpoint_of(step3, tmp_path / f"{kind}.pt").values()
                     if isinstance(v, torch.Tensor))
        measured[kind] = (written, params, max(map(float, saved)), max(map(float, loaded)))
    # torch: the FP32 params and both moments; cossd: the params and a reference.
    assert measured["torch"][0] > 12 * measured["torch"][1] > 4 * measured["cossd"][1] > measured["cossd"][0] * 0.9
    for kind, (written, params, save_s, restore_s) in measured.items():
        figures.append(f"torchtitan llama3 debug FSDP2 2 ranks {params} params, {kind}: checkpoint {written} B, "
                       f"save {save_s:.2f} s, restore {restore_s:.2f} s")


def ranks_as_torchrun_starts_them(device: Mount, assets: Path, dump: Path, namespace: str, world: int,
                                  options: list[str], **variables: str) -> list[int]:
    """torchtitan's ranks as plain processes with the variables torchrun sets (RANK,
    LOCAL_RANK, WORLD_SIZE, ...), without torchrun: torchrun tears the other ranks down as soon
    as one dies, so only this way does a surviving rank show what it does itself. Their exit
    codes (each rank's output in dump/rank<N>.txt); `options` go to the trainer."""
    from helpers import free_port

    command, env = _command(device, assets, dump, namespace, world, **variables)
    start = command.index("cossd.integrations.torchtitan_cpu") - 1  # `-m` of the trainer, past torchrun's
    trainer = [command[0], *command[start:], *options]
    env |= {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port())}
    dump.mkdir(parents=True, exist_ok=True)
    ranks = []
    for rank in range(world):
        with open(dump / f"rank{rank}.txt", "w") as log:
            ranks.append(subprocess.Popen(trainer, env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=log, stderr=subprocess.STDOUT))
    try:
        return [process.wait(timeout=JOB_TIMEOUT_S) for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.slow  # four jobs of 2 ranks: 3-4 minutes on 2 cores
def test_rank_killed_between_its_partition_and_the_commit(device: Mount, assets: Path, tmp_path: Path) -> None:
    """Rank 1 of 2 killed (SIGKILL) in device step 5, once the first piece of its FSDP2 shard's
    gradients is on the device, the rest of its partition never sent and no commit: rank 0
    fails with StepAbortedError naming step 5 within its 10 s bound (not a hang); the device
    stays at step 4, every tensor's master, moments and param equal to those of the same job
    killed after step 4;
    the job restarted by torchrun loads torchtitan's step-3 checkpoint and ends bit for bit as
    the run that never stopped (every loss, the last checkpoint's params, the device's state)."""
    whole, four, broken = tmp_path / "whole", tmp_path / "four", tmp_path / "broken"
    done = torchrun(device, assets, whole, "titan-k-whole", 2)
    assert done.returncode == 0, (whole / "logs.txt").read_text()[-6000:]
    # The same 7-step job killed after step 4 (torchtitan's schedule depends on the step count).
    done = torchrun(device, assets, four, "titan-k-four", 2, kill_after=4)
    assert done.returncode != 0 and "Signal 9 (SIGKILL) received" in done.stdout + done.stderr, \
        (four / "logs.txt").read_text()[-6000:]

    note = tmp_path / "kill1.json"
    codes = ranks_as_torchrun_starts_them(device, assets, broken, "titan-k-broken", 2,
                                          ["--optimizer.step_timeout_s", "10"], TITAN_KILL_RANK="1",
                                          TITAN_KILL_STEP="5", TITAN_KILL_NOTE=str(note))
    logs = [(broken / f"rank{rank}.txt").read_text() for rank in range(2)]
    assert codes[1] == -signal.SIGKILL and codes[0] not in (0, -signal.SIGKILL), (codes, logs[0][-6000:])
    killed = json.loads(note.read_text())
    assert killed["committed_step"] == 4 and killed["pieces"] > 1, killed
    assert "StepAbortedError: cossd: step 5 of namespace 'titan-k-broken' was not committed" in logs[0], logs[0][-6000:]
    assert "waited 10 s for the other ranks" in logs[0] and "stays at step 4" in logs[0], logs[0][-6000:]
    from cossd.client import AdminClient

    with AdminClient(device.mountpoint) as admin:
        stats = admin.statistics(admin.nsid("titan-k-broken"))
    assert stats["committed_step"] == 4 and stats["step_open"] is None, stats
    assert same_tensors(device_state(device, "titan-k-broken", tmp_path / "a.safetensors"),
                        device_state(device, "titan-k-four", tmp_path / "b.safetensors"))
    checkpoints = broken / "checkpoint"
    assert (checkpoints / "step-3").is_dir() and not (checkpoints / "step-6").exists()

    resumed = torchrun(device, assets, broken, "titan-k-broken", 2)
    assert resumed.returncode == 0, (broken / "logs.txt").read_text()[-6000:]
    assert "Training starts at step 4" in resumed.stdout + resumed.stderr
    assert losses(broken) == losses(whole)  # float32 values, compared exactly
    assert same_tensors(model_of(checkpoints / f"step-{STEPS}", tmp_path / "c.pt"),
                        model_of(whole / "checkpoint" / f"step-{STEPS}", tmp_path / "d.pt"))
    assert same_tensors(device_state(device, "titan-k-broken", tmp_path / "c.safetensors"),
                        device_state(device, "titan-k-whole", tmp_path / "d.safetensors"))
