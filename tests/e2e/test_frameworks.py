"""load_state_dict that loses nothing (no-op on its own state, atomic under kill -9), HF Trainer and Lightning."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import random
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cossd.trainer import AdamW, DeviceLostError
from cossd.trainer.namespace import swap as namespace_swap

from conftest import Mount

pytestmark = pytest.mark.mount

WIDTH = 512  # about 0.8M parameters: a load takes long enough to be killed at random inside


class Net(torch.nn.Module):
    """Three layers with biases, every tensor a multiple of 16 elements."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, width)
        self.fc2 = torch.nn.Linear(width, width)
        self.fc3 = torch.nn.Linear(width, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return Net().to(torch.bfloat16)


def train(model: torch.nn.Module, optimizer: AdamW, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=generator).to(torch.bfloat16)
        optimizer.zero_grad()
        F.mse_loss(model(x).float(), torch.zeros(32, 64)).backward()
        optimizer.step()


def snapshot_of(optimizer: AdamW) -> dict[str, Any]:
    """Everything a resume gets: step, params, masters and both moments, as exact bits."""
    state = optimizer.state_dict()
    return {
        "step": optimizer.committed_step,
        "params": [e.param.detach().clone() for e in optimizer.entries],
        "masters": list(state["cossd_master"].values()),
        "moments": [(s["exp_avg"], s["exp_avg_sq"]) for s in state["state"].values()],
    }


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["step"] != b["step"] or len(a["moments"]) != len(b["moments"]):
        return False
    pairs = list(zip(a["params"], b["params"])) + list(zip(a["masters"], b["masters"]))
    pairs += [(x, y) for m, n in zip(a["moments"], b["moments"]) for x, y in zip(m, n)]
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in pairs)


def namespaces(mount: Mount, optimizer: AdamW) -> dict[str, int]:
    return {e["name"]: e["nsid"] for e in optimizer.files.command(optimizer.files.admin.describe)["namespaces"]}


def test_loading_its_own_state_is_a_no_op(mount: Mount, figures: list[str]) -> None:
    model = make_model(0)
    optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace="own", lr=1e-3)
    train(model, optimizer, range(1, 4))
    state = optimizer.state_dict()
    before, listed = optimizer.files.statistics(), namespaces(mount, optimizer)
    started = time.perf_counter()
    optimizer.load_state_dict(state)
    noop_s = time.perf_counter() - started
    after = optimizer.files.statistics()
    # The same namespace (nsid), nothing created, nothing written.
    assert namespaces(mount, optimizer) == listed and after["nsid"] == before["nsid"]
    assert after["write_commands"] == before["write_commands"]
    assert after["state_bytes_loaded"] == before["state_bytes_loaded"] and optimizer.committed_step == 3

    # The dict changed in place since state_dict() returned it: a real load of what it holds.
    state["state"][0]["exp_avg"].zero_()
    started = time.perf_counter()
    optimizer.load_state_dict(state)
    real_s = time.perf_counter() - started
    assert optimizer.files.nsid != before["nsid"] and optimizer.committed_step == 3
    assert namespace_swap.staging_name("own") not in namespaces(mount, optimizer)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], torch.zeros_like(state["state"][0]["exp_avg"]))

    # An older state: loaded bit for bit, and the run continues from it as the original did.
    old = snapshot_of(optimizer)
    old_state = optimizer.state_dict()
    train(model, optimizer, range(4, 6))
    optimizer.load_state_dict(old_state)
    assert same(snapshot_of(optimizer), old)
    train(model, optimizer, range(4, 5))
    assert optimizer.committed_step == 4
    params = sum(e.numel for e in optimizer.entries)
    optimizer.close()
    figures.append(f"T23 load_state_dict at {params / 1e6:.2f}M params: its own state {noop_s * 1e3:.1f} ms "
                   f"(no-op), other state {real_s * 1e3:.0f} ms (staged and switched)")


def test_a_replaced_or_copied_state_is_loaded_for_real(mount: Mount) -> None:
    import copy

    model = make_model(0)
    optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace="edited", lr=1e-3)
    train(model, optimizer, range(1, 3))
    for edit in ("replaced", "deep copy", "earlier call"):
        state = optimizer.state_dict()
        if edit == "replaced":
            state["state"][0]["exp_avg"] = torch.zeros_like(state["state"][0]["exp_avg"])
        elif edit == "deep copy":
            state = copy.deepcopy(state)
            state["state"][0]["exp_avg"].zero_()
        else:
            state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].clone().zero_()
            optimizer.state_dict()  # a later call: the first dict is no longer the one handed out
        nsid = optimizer.files.nsid
        optimizer.load_state_dict(state)
        assert optimizer.files.nsid != nsid, edit  # a real load, not a no-op
        loaded = optimizer.state_dict()["state"][0]["exp_avg"]
        assert torch.equal(loaded, torch.zeros_like(loaded)), edit
    optimizer.close()


def test_a_state_dict_that_does_not_fit_changes_nothing(mount: Mount) -> None:
    model = make_model(0)
    optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace="fit", lr=1e-3)
    train(model, optimizer, range(1, 3))
    before, nsid = snapshot_of(optimizer), optimizer.files.nsid
    state = optimizer.state_dict()
    state.pop("cossd_namespace", None)
    state["state"][3]["exp_avg_sq"] = state["state"][3]["exp_avg_sq"][:-1]
    with pytest.raises(ValueError, match="exp_avg_sq for param 3"):
        optimizer.load_state_dict(state)
    del state["state"][2]
    with pytest.raises(ValueError, match="state for param 2"):
        optimizer.load_state_dict(state)
    assert optimizer.files.nsid == nsid and same(snapshot_of(optimizer), before)
    assert set(namespaces(mount, optimizer)) == {"fit"}
    optimizer.close()


def test_a_namespace_still_importing_is_not_taken_for_a_start(mount: Mount) -> None:
    """What an older load_state_dict left when killed: a namespace loading at step k > 0."""
    model = make_model(0)
    probe = AdamW(model.parameters(), mount=mount.mountpoint, namespace="probe")
    description = probe._description(initial_step=7) | {"name": "half"}
    probe.files.command(probe.files.admin.create_namespace, description)
    probe.close()
    with pytest.raises(RuntimeError, match="still loading state for step 7.*incomplete"):
        AdamW(make_model(1).parameters(), mount=mount.mountpoint, namespace="half")


# ---------------------------------------------------------------------- kill -9 inside a load

def _load_in_child(mountpoint: str, namespace: str, source: str, stage: str | None, pipe: Any) -> None:
    """Attach to `namespace`, then load_state_dict the dict saved at `source`; tell the parent
    just before the load begins ("L") and when it ended ("D" and its seconds). With `stage`,
    kill -9 this process at that point of the replace."""
    torch.set_num_threads(1)
    optimizer = AdamW(make_model(99).parameters(), mount=mountpoint, namespace=namespace, lr=1e-3)
    state = torch.load(source, weights_only=True)
    if stage is not None:
        optimizer.load_hook = lambda at: os.kill(os.getpid(), signal.SIGKILL) if at == stage else None
    pipe.send("L")
    started = time.perf_counter()
    optimizer.load_state_dict(state)
    pipe.send(("D", time.perf_counter() - started))
    pipe.recv()  # alive until the parent kills it: a kill after the load is a trial too


def _resumed(mount: Mount, namespace: str) -> tuple[dict[str, Any], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer = AdamW(make_model(7).parameters(), mount=mount.mountpoint, namespace=namespace, lr=1e-3)
    try:
        assert optimizer.restored, "the resume found no committed run"
        assert namespace_swap.staging_name(namespace) not in namespaces(mount, optimizer)
        return snapshot_of(optimizer), [str(w.message) for w in caught]
    finally:
        optimizer.close()


def test_load_state_dict_killed_at_any_instant_keeps_the_old_run_or_the_new(
        mount: Mount, tmp_path: Path, figures: list[str]) -> None:
    load_kills(mount, tmp_path, figures, trials_random=int(os.environ.get("COSSD_T23_TRIALS", "16")))


@pytest.mark.slow
def test_load_state_dict_killed_200_times(mount: Mount, tmp_path: Path, figures: list[str]) -> None:
    load_kills(mount, tmp_path, figures, trials_random=200)


def load_kills(mount: Mount, tmp_path: Path, figures: list[str], trials_random: int) -> None:
    """Each trial: a run at step 2 (the old), a child process that attaches to it and loads
    another run's state dict (the new, at step 5), kill -9 of the child at a stage of the
    replace or at a random instant of the load, then a resume here."""
    # The new state: another run, 5 steps from another init.
    model = make_model(1)
    source = AdamW(model.parameters(), mount=mount.mountpoint, namespace="src", lr=1e-3)
    train(model, source, range(1, 6))
    new = snapshot_of(source)
    torch.save(source.state_dict(), tmp_path / "new.pt")
    source.close()

    context = multiprocessing.get_context("forkserver")
    # torch's first optimizer imports dynamo (2 s here): done once, in the server.
    context.set_forkserver_preload(["torch", "torch._dynamo", "cossd.trainer", "test_frameworks"])

    olds: list[dict[str, Any]] = []

    def run(index: int, stage: str | None, delay: float | None) -> tuple[str, float | None]:
        name = f"run{index}"
        model = make_model(0)
        optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace=name, lr=1e-3)
        train(model, optimizer, range(1, 3))
        if not olds:  # every trial's old run is the same (same init, same steps)
            olds.append(snapshot_of(optimizer))
        old = olds[0]
        optimizer.close()
        parent, child = context.Pipe()
        process = context.Process(target=_load_in_child,
                                  args=(str(mount.mountpoint), name, str(tmp_path / "new.pt"), stage, child))
        process.start()
        assert parent.poll(60) and parent.recv() == "L"
        took = None
        if delay is not None:
            time.sleep(delay)
        else:  # until the load ends, or the child kills itself at its stage
            multiprocessing.connection.wait([parent, process.sentinel], 60)
        process.kill()  # SIGKILL, where it is still alive
        process.join(60)
        if parent.poll():
            message = parent.recv()
            took = message[1] if isinstance(message, tuple) else None
        resumed, notes = _resumed(mount, name)
        assert same(resumed, old) or same(resumed, new), (
            f"trial {index} (stage {stage}, delay {delay}): the resume holds neither run (step "
            f"{resumed['step']}): {notes}")
        return ("new" if same(resumed, new) else "old"), took

    # How long a whole load takes, so the random instants cover it.
    outcome, load_s = run(0, None, None)
    assert outcome == "new" and load_s is not None
    results = {"old": 0, "new": 0, "inside": 0}
    index = 1
    for stage in namespace_swap.STAGES:  # every point of the replace at least once
        outcome, _ = run(index, stage, None)
        results[outcome] += 1
        index += 1
        # Before the old run is deleted the resume keeps it; once it is, the switch ends.
        assert outcome == ("old" if namespace_swap.STAGES.index(stage) < namespace_swap.STAGES.index("old_deleted") else "new")
    rng = random.Random(23)
    for _ in range(trials_random):
        outcome, took = run(index, None, rng.uniform(0.0, 1.1 * load_s))
        results[outcome] += 1
        results["inside"] += took is None  # killed before the load returned
        index += 1
    trials = len(namespace_swap.STAGES) + trials_random
    figures.append(f"T23 kill -9 inside load_state_dict: {trials} trials ({len(namespace_swap.STAGES)} "
                   f"at each stage of the replace, {trials_random} at random instants of a "
                   f"{load_s * 1e3:.0f} ms load, {results['inside']} of them before it returned), "
                   f"0 failures: resumed the old run {results['old']}, "
                   f"the new {results['new']}, each bit-identical; never fresh weights")


def test_daemon_killed_inside_a_load_keeps_the_old_run_or_the_new(mount: Mount, figures: list[str]) -> None:
    """The daemon dies (kill -9) before the seal, right after the old run is deleted, and
    after the clone; each remount (recovery) resumes the old run or the new one."""
    daemon_kills(mount, figures, ("filled", "old_deleted", "cloned"))


@pytest.mark.slow
def test_daemon_killed_at_each_stage_of_a_load(mount: Mount, figures: list[str]) -> None:
    daemon_kills(mount, figures, namespace_swap.STAGES)


def daemon_kills(mount: Mount, figures: list[str], stages: tuple[str, ...]) -> None:
    model = make_model(1)
    source = AdamW(model.parameters(), mount=mount.mountpoint, namespace="src", lr=1e-3)
    train(model, source, range(1, 6))
    new, state = snapshot_of(source), source.state_dict()
    source.close()
    results = {"old": 0, "new": 0}
    for stage in stages:
        name = f"d-{stage}"
        model = make_model(0)
        optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace=name, lr=1e-3)
        train(model, optimizer, range(1, 3))
        old = snapshot_of(optimizer)
        killed: list[str] = []

        def kill_at(at: str, stage: str = stage) -> None:
            if at == stage:
                killed.append(at)
                mount.kill()

        optimizer.load_hook = kill_at
        try:
            optimizer.load_state_dict(state)
        except (DeviceLostError, RuntimeError):
            pass  # the device vanished mid-load, as it would
        optimizer.close()
        assert killed == [stage]
        mount.restart()
        resumed, notes = _resumed(mount, name)
        assert same(resumed, old) or same(resumed, new), f"stage {stage}: neither run: {notes}"
        results["new" if same(resumed, new) else "old"] += 1
    figures.append(f"T23 daemon kill -9 at {len(stages)} stages of a load ({', '.join(stages)}), "
                   f"remount: 0 failures, resumed the old run {results['old']}, the new {results['new']}")


# ---------------------------------------------------------------------- frameworks

def _tiny_gpt2() -> Any:
    transformers = pytest.importorskip("transformers", reason="HF Trainer tier: transformers is not installed")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def _hf_run(mount: Mount, out: Path, namespace: str, max_steps: int, resume: str | None = None) -> Any:
    transformers = pytest.importorskip("transformers")
    model = _tiny_gpt2()
    optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace=namespace, lr=3e-3,
                      weight_decay=0.1, dtype=torch.bfloat16)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 20)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4,
        gradient_accumulation_steps=2, max_grad_norm=0.5, save_strategy="steps", save_steps=3,
        logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True)
    try:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens(),
                                       optimizers=(optimizer, scheduler))
        trainer.train(resume_from_checkpoint=resume)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
                "step": optimizer.committed_step, "lr": scheduler.get_last_lr()}
    finally:
        optimizer.close()


def test_hf_trainer_save_and_resume_is_bit_identical(mount: Mount, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="HF Trainer tier: transformers is not installed")
    straight = _hf_run(mount, tmp_path / "straight", "hf", max_steps=6)
    assert straight["step"] == 6 and (tmp_path / "straight" / "checkpoint-3").is_dir()
    # A new job resumes from step 3's checkpoint: the namespace (at step 6) is replaced by
    # that checkpoint's state, and steps 4-6 come out bit for bit the same.
    resumed = _hf_run(mount, tmp_path / "straight", "hf", max_steps=6,
                      resume=str(tmp_path / "straight" / "checkpoint-3"))
    assert resumed["step"] == 6 and resumed["lr"] == straight["lr"]
    assert resumed["losses"][-3:] == straight["losses"][-3:] and len(straight["losses"]) == 6
    assert all(torch.equal(a, b) for a, b in zip(straight["params"], resumed["params"]))


def test_lightning_trains_20_steps(mount: Mount, tmp_path: Path) -> None:
    lightning = pytest.importorskip("lightning", reason="Lightning tier: lightning is not installed")
    mountpoint = mount.mountpoint

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
            self.cossd: AdamW | None = None

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            self.cossd = AdamW(self.parameters(), mount=mountpoint, namespace="lit", lr=1e-2)
            return self.cossd

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(160, 16, generator=generator)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    module = Module()
    first = module.net[0].weight.detach().clone()
    trainer = lightning.Trainer(max_steps=20, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
    trainer.fit(module, data)
    assert module.cossd is not None
    assert module.cossd.committed_step == 20 and trainer.global_step == 20
    # The model holds what the device computed, which moved: an FP32 model gets the FP32
    # masters themselves (a BF16 one would get their rounding).
    masters = module.cossd.master_weights()
    assert not torch.equal(first, module.net[0].weight)
    assert all(torch.equal(p.detach(), m) for p, m in zip(module.parameters(), masters))
    module.cossd.close()
