"""cossd's AdamW under deepspeed.initialize (FP32, BF16, FP16; ZeRO 0/1/2) against torch's AdamW."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Iterator

import pytest

# DeepSpeed picks its accelerator at import: the CPU one here (gloo, no CUDA needed).
os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (the optional framework tier: `make frameworks` "
    "installs ninja, then deepspeed==0.19.8 with --no-build-isolation)")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cossd.emulator import Device  # noqa: E402
from cossd.trainer import AdamW  # noqa: E402

from conftest import Mount, force_unmount, is_mounted, start_mount, wait_for_exit  # noqa: E402
from helpers import free_port  # noqa: E402

pytestmark = pytest.mark.mount

STEPS = 30
MICRO_BATCH = 16
ACCUMULATION = 2
LR = 1e-2



@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    """DeepSpeed needs a process group even for one process: gloo, world size 1."""
    if not torch.distributed.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed("gloo")


@pytest.fixture(scope="module")
def mounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One device for the module (each case uses its own namespaces)."""
    root = tmp_path_factory.mktemp("t22")
    Device.format(root / "backing", capacity_bytes=1 << 30, serial="TESTSERIAL0022")
    mount = start_mount(root / "backing", root / "mnt")
    try:
        yield mount
    finally:
        if is_mounted(mount.mountpoint):
            force_unmount(mount.mountpoint)
        try:
            wait_for_exit(mount.pid, 30)
        except TimeoutError:
            os.kill(mount.pid, signal.SIGKILL)


@pytest.fixture
def cossd_adamw(mounted: Mount) -> Iterator[Any]:
    """Makes cossd AdamWs on the module's mount, closing them after the test (even on failure)."""
    made: list[AdamW] = []

    def make(namespace: str, lr: float = LR):
        def factory(param_groups: list[dict[str, Any]]) -> AdamW:
            made.append(AdamW(param_groups, lr=lr, mount=mounted.mountpoint, namespace=namespace))
            return made[-1]
        return factory

    yield make
    for optimizer in made:
        optimizer.close()


@pytest.fixture
def fp16_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's CPU accelerator refuses FP16 unless oneDNN has FP16 kernels; torch runs
    FP16 on any CPU, and the loss scaler under test does not depend on the device."""
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: True)


class Tiny(torch.nn.Module):
    """2,128 params: 16 -> 64 -> 16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed, learnable task: the labels of a random linear teacher."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(MICRO_BATCH * ACCUMULATION, 16, generator=generator)
    teacher = torch.randn(16, 16, generator=generator)
    return x, (x @ teacher).argmax(dim=1)


def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The usual decay / no-decay split, so ZeRO steps two groups one at a time."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]


def config(precision: str, stage: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        # DeepSpeed's switch for any optimizer outside its own list (cossd's included).
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    if precision == "bf16-fp32accum":  # ZeRO-1 then runs DeepSpeed's BF16_Optimizer
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    elif precision == "fp16":
        # Under ZeRO a scale of 2^24 overflows the FP16 gradients at first: DeepSpeed's dynamic
        # loss scaler skips those steps and halves the scale until they fit. (The stage-0
        # wrapper then learns slowly; 2^8 there.)
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 24 if stage else 8}
    return cfg


def one_group(model: torch.nn.Module) -> list[dict[str, Any]]:
    return [{"params": list(model.parameters()), "weight_decay": 0.1}]


def train(make_optimizer, precision: str, stage: int, cfg: dict[str, Any] | None = None, split=groups,
          steps: int = STEPS):
    torch.manual_seed(0)
    model = Tiny()
    optimizer = make_optimizer(split(model))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=cfg or config(precision, stage))
    x, y = data()
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for _ in range(steps):
        total = 0.0
        for micro in range(ACCUMULATION):
            rows = slice(micro * MICRO_BATCH, (micro + 1) * MICRO_BATCH)
            loss = F.cross_entropy(engine(x[rows].to(dtype)).float(), y[rows])
            engine.backward(loss)
            engine.step()
            total += loss.item() / ACCUMULATION
        losses.append(total)
    return engine, optimizer, losses


CASES = [("fp32", 0), ("bf16", 0), ("bf16", 1), ("bf16", 2), ("bf16", 3), ("bf16-fp32accum", 1), ("fp16", 0),
         ("fp16", 1), ("fp16", 2), ("fp16", 3)]


@pytest.mark.parametrize(("precision", "stage"), CASES, ids=[f"{p}-zero{s}" for p, s in CASES])
def test_learns_like_torch_adamw(cossd_adamw, request: pytest.FixtureRequest, precision: str, stage: int) -> None:
    if precision == "fp16":
        request.getfixturevalue("fp16_on_cpu")
    _, torch_optimizer, expected = train(lambda g: torch.optim.AdamW(g, lr=LR), precision, stage)
    engine, optimizer, losses = train(cossd_adamw(f"ds-{precision}-{stage}"), precision, stage)
    assert losses[-1] < 0.7 * losses[0], f"did not learn: {losses[0]:.4f} -> {losses[-1]:.4f}"
    assert abs(losses[-1] - expected[-1]) < 1e-3, (losses[-1], expected[-1])
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-3
    # The device took as many steps as torch's AdamW did (FP16/BF16 at stage 0 step the
    # masters once at initialize; the loss scaler skips overflowing steps for both).
    torch_steps = int(next(iter(torch_optimizer.state.values()))["step"])
    assert optimizer.committed_step == torch_steps
    if precision == "fp16" and stage > 0:
        assert torch_steps < STEPS  # the loss scaler skipped some
    assert optimizer.steps_skipped_no_grads == 0
    namespace = f"ds-{precision}-{stage}"
    if precision == "bf16-fp32accum":
        # BF16_Optimizer steps every group's flat FP32 partition in one call: one namespace.
        assert [entry.numel for entry in optimizer.entries] == [2048, 80]
    elif stage > 0:
        # ZeRO steps one flat FP32 partition per group, a group per call: all on one
        # namespace, one commit per engine step (the device's step count is torch's).
        assert [(entry.name, entry.numel) for entry in optimizer.entries] == [("zero.g0", 2048), ("zero.g1", 80)]
        assert optimizer.files.name == namespace
    else:
        # FP32: the model's own params; FP16/BF16: DeepSpeed's FP32 copies of them.
        assert [entry.numel for entry in optimizer.entries] == [1024, 1024, 64, 16]
        assert all(entry.param.dtype == torch.float32 for entry in optimizer.entries)
        assert (precision == "fp32") == all(
            any(entry.param is p for p in engine.module.parameters()) for entry in optimizer.entries)
    print(f"{precision} ZeRO-{stage}: final loss {losses[-1]:.6f}, torch AdamW {expected[-1]:.6f}, "
          f"difference {losses[-1] - expected[-1]:+.2e}, largest {max(abs(a - b) for a, b in zip(losses, expected)):.2e}, "
          f"{torch_steps} steps")


def test_zero_groups_checkpoint_through_deepspeed(cossd_adamw, tmp_path: Path) -> None:
    """ZeRO-1 with a decay and a no-decay group: one namespace holds both flat partitions,
    and DeepSpeed's save_checkpoint / load_checkpoint run (they used to fail with several
    groups), writing no optimizer state of cossd's, and training goes on after."""
    engine, optimizer, _ = train(cossd_adamw("ds-groups-ckpt"), "bf16", 1)
    assert [entry.numel for entry in optimizer.entries] == [2048, 80] and optimizer.committed_step == STEPS
    masters = [m.clone() for m in optimizer.master_weights()]
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(optimizer.master_weights(), masters))
    assert optimizer.committed_step == STEPS
    x, y = data()
    for micro in range(ACCUMULATION):
        rows = slice(micro * MICRO_BATCH, (micro + 1) * MICRO_BATCH)
        engine.backward(F.cross_entropy(engine(x[rows].to(torch.bfloat16)).float(), y[rows]))
        engine.step()
    assert optimizer.committed_step == STEPS + 1


def _more_steps(engine: Any, steps: int) -> list[float]:
    x, y = data()
    losses = []
    for _ in range(steps):
        total = 0.0
        for micro in range(ACCUMULATION):
            rows = slice(micro * MICRO_BATCH, (micro + 1) * MICRO_BATCH)
            loss = F.cross_entropy(engine(x[rows].to(torch.bfloat16)).float(), y[rows])
            engine.backward(loss)
            engine.step()
            total += loss.item() / ACCUMULATION
        losses.append(total)
    return losses


def test_zero_checkpoint_tags_roll_the_device_back(cossd_adamw, mounted: Mount, tmp_path: Path) -> None:
    """BF16 ZeRO-1, two groups: save_checkpoint(tag "a") at step 2 and "b" at step 4 each
    record a device snapshot and write no moments; load_checkpoint("a") brings the device back
    to step 2 and the next 2 steps repeat "a"->"b" bit for bit; once "a"'s snapshot is deleted,
    loading "a" fails naming the tag, and nothing changes."""
    from cossd.client import AdminClient
    from cossd.client import snapshots as snapshot_calls
    from cossd.trainer.deepspeed.zero import REFERENCE

    engine, optimizer, _ = train(cossd_adamw("ds-tags"), "bf16", 1, steps=2)
    at_a = [m.clone() for m in optimizer.master_weights()]
    engine.save_checkpoint(str(tmp_path), tag="a")
    first = _more_steps(engine, 2)
    at_b = [m.clone() for m in optimizer.master_weights()]
    engine.save_checkpoint(str(tmp_path), tag="b")
    [optim_file] = (tmp_path / "a").glob("*optim_states.pt")
    saved = torch.load(optim_file, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
    assert saved["state"] == {} and saved[REFERENCE]["tag"] == "a" and saved[REFERENCE]["step"] == 2

    engine.load_checkpoint(str(tmp_path), tag="a")
    assert optimizer.committed_step == 2 and optimizer.restored
    assert all(torch.equal(a, b) for a, b in zip(optimizer.master_weights(), at_a))
    again = _more_steps(engine, 2)
    assert again == first and optimizer.committed_step == 4
    assert all(torch.equal(a, b) for a, b in zip(optimizer.master_weights(), at_b))

    with AdminClient(mounted.mountpoint) as admin:
        snapshot_calls.delete_snapshot(admin, admin.nsid("ds-tags"), saved[REFERENCE]["snapshot"])
    with pytest.raises(RuntimeError, match="DeepSpeed checkpoint tag 'a': .* is gone"):
        engine.load_checkpoint(str(tmp_path), tag="a")
    assert optimizer.committed_step == 4
    assert all(torch.equal(a, b) for a, b in zip(optimizer.master_weights(), at_b))


def test_zero_checkpoint_of_torch_adamw_is_refused(cossd_adamw, tmp_path: Path) -> None:
    """A DeepSpeed checkpoint saved with torch.optim.AdamW holds moments, not a reference:
    load_checkpoint into a cossd job is refused with ValueError, and the device keeps its step."""
    engine, _, _ = train(lambda g: torch.optim.AdamW(g, lr=LR), "bf16", 1, steps=1)
    engine.save_checkpoint(str(tmp_path), tag="torch")
    engine, optimizer, _ = train(cossd_adamw("ds-foreign"), "bf16", 1, steps=2)
    with pytest.raises(ValueError, match="optimizer state of another optimizer"):
        engine.load_checkpoint(str(tmp_path), tag="torch")
    assert optimizer.committed_step == 2


def test_zero_restart_resumes_from_the_device(cossd_adamw) -> None:
    """A BF16 ZeRO-2 job with two param groups, stopped after 3 steps and started again on the
    same namespace with no DeepSpeed checkpoint: deepspeed.initialize finds the flat
    partitions on the device (params only cross), and the job ends bit for bit as one that
    ran all 6 steps."""
    _, whole, expected = train(cossd_adamw("ds-restart-whole"), "bf16", 2, steps=6)
    _, first, _ = train(cossd_adamw("ds-restart-zero"), "bf16", 2, steps=3)
    first.close()
    engine, again, losses = train(cossd_adamw("ds-restart-zero"), "bf16", 2, steps=3)
    assert again.restored and again.committed_step == 6
    assert losses == expected[3:]
    assert all(torch.equal(a, b) for a, b in zip(again.master_weights(), whole.master_weights()))


def test_stage0_restart_on_the_same_namespace_is_refused(cossd_adamw) -> None:
    """At stage 0 the quick restore under DeepSpeed is not there yet: a restarted job is told
    so, and the device keeps the trained namespace as it was."""
    _, optimizer, _ = train(cossd_adamw("ds-restart-0"), "bf16", 0, split=one_group, steps=2)
    committed = optimizer.committed_step
    masters = [m.clone() for m in optimizer.master_weights()]
    optimizer.close()
    with pytest.raises(RuntimeError, match="not supported yet"):
        train(cossd_adamw("ds-restart-0"), "bf16", 0, split=one_group, steps=1)
    again = cossd_adamw("ds-restart-0")(
        [{"params": [torch.nn.Parameter(m.clone()) for m in masters], "weight_decay": 0.1}])
    assert again.committed_step == committed
    assert all(torch.equal(a, b) for a, b in zip(again.master_weights(), masters))


def test_deepspeed_offload_is_refused(cossd_adamw) -> None:
    cfg = config("bf16", 2)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg["zero_force_ds_cpu_optimizer"] = False  # else DeepSpeed itself refuses a client optimizer
    with pytest.raises(NotImplementedError, match="offload_optimizer"):
        train(cossd_adamw("ds-offload"), "bf16", 2, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("size", ["tiny", "small"])
def test_gpt_bf16_zero2_parity_with_clipping(cossd_adamw, size: str, figures: list[str]) -> None:
    """The parity issue 32 measured: the byte-level GPT of harness/gpt.py, BF16 ZeRO-2, clipping
    at 1.0, decay / no-decay groups, 30 steps, cossd against torch.optim.AdamW under the same
    DeepSpeed config. DeepSpeed's FP32 gradients go to the device rounded to BF16; the losses
    differ by what that rounding allows (the bound asserted is 1e-2; the figure is printed)."""
    from cossd.harness.gpt import GPTConfig, StdlibCorpus, build_model

    gpt = GPTConfig.named(size)
    corpus = StdlibCorpus(max_bytes=1 << 20)
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**9}

    def run(make_optimizer) -> list[float]:
        model = build_model(gpt, seed=0, dtype=torch.float32, device="cpu")
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        optimizer = make_optimizer([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        losses = []
        for step in range(30):
            x, y = corpus.batch(step, 8, gpt.context)
            loss = engine.module.loss(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    expected = run(lambda g: torch.optim.AdamW(g, lr=1e-3))
    losses = run(cossd_adamw(f"ds-gpt-{size}", lr=1e-3))
    largest = max(abs(a - b) for a, b in zip(losses, expected))
    params = sum(p.numel() for p in build_model(gpt, 0, torch.float32, "cpu").parameters())
    figures.append(f"GPT {size} ({params} params) BF16 ZeRO-2 clip 1.0, 30 steps: loss {expected[0]:.4f} -> "
                   f"{expected[-1]:.4f} (torch AdamW) vs {losses[-1]:.4f} (cossd), final difference "
                   f"{losses[-1] - expected[-1]:+.2e}, largest {largest:.2e}")
    assert losses[-1] < losses[0] and largest < 1e-2


# ---------------------------------------------------------------------- deepspeed imported, no engine

def _plain_steps(model: torch.nn.Module, optimizer: Any, steps: int) -> None:
    """`steps` steps of a plain torch loop (no DeepSpeed engine) on the module's task."""
    x, y = data()
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


def test_plain_loop_beside_deepspeed_reads_the_truth(cossd_adamw) -> None:
    """A plain loop in a process where deepspeed is imported (as `cossd bench` is): the
    optimizer opens its new namespace at construction, so master_weights() and the files
    work before the first step; a restart on the trained namespace reads committed_step 3
    and restored True before any step, with the trained params back in the model. (Every
    read used to fail or read 0 before the first step.)"""
    torch.manual_seed(0)
    model = Tiny()
    optimizer = cossd_adamw("ds-plain")(groups(model))
    assert optimizer.committed_step == 0 and not optimizer.restored and optimizer.steps_skipped == 0
    before = [p.detach().clone() for group in groups(model) for p in group["params"]]
    assert all(torch.equal(m, p) for m, p in zip(optimizer.master_weights(), before))
    assert [t["numel"] for t in optimizer.files.config()["tensors"]] == [1024, 1024, 64, 16]
    optimizer.files.cmb()  # the bench's probe: raised FileNotFoundError (no namespace yet)
    _plain_steps(model, optimizer, 3)
    trained = [p.detach().clone() for group in groups(model) for p in group["params"]]
    masters = [m.clone() for m in optimizer.master_weights()]
    optimizer.close()

    torch.manual_seed(1)  # other initial weights: the restore must replace them
    again_model = Tiny()
    again = cossd_adamw("ds-plain")(groups(again_model))
    assert again.committed_step == 3 and again.restored  # the restart recipe's start: step 4
    assert all(torch.equal(p, q) for p, q in zip((p for g in groups(again_model) for p in g["params"]), trained))
    assert all(torch.equal(a, b) for a, b in zip(again.master_weights(), masters))


def test_zero_namespace_read_before_initialize_is_the_devices(cossd_adamw) -> None:
    """A namespace of ZeRO's flat groups waits for deepspeed.initialize; before it,
    committed_step reads the device's step (it read 0: a restart computed from it began at
    step 1, silently), restored and master_weights() refuse saying why, and a plain step()
    is refused without touching the device. deepspeed.initialize then restores as ever."""
    _, first, _ = train(cossd_adamw("ds-early"), "bf16", 2, steps=3)
    first.close()
    torch.manual_seed(0)
    model = Tiny()
    waiting = cossd_adamw("ds-early")(groups(model))
    assert waiting.committed_step == 3 and waiting.steps_skipped == 0
    with pytest.raises(RuntimeError, match=r"restored is not known yet: .*\(committed step 3\)"):
        _ = waiting.restored
    with pytest.raises(RuntimeError, match="only deepspeed.initialize with ZeRO stage 1, 2 or 3 opens it"):
        waiting.master_weights()
    model(data()[0]).sum().backward()
    with pytest.raises(ValueError, match="holds DeepSpeed ZeRO's flat param groups"):
        waiting.step()
    assert waiting.committed_step == 3

    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=waiting, config=config("bf16", 2))
    assert waiting.restored and waiting.committed_step == 3
    _more_steps(engine, 1)
    assert waiting.committed_step == 4
    # A second engine cannot take the bound optimizer over (it would convert or rebind the namespace).
    with pytest.raises(RuntimeError, match="steps under a DeepSpeed engine already"):
        deepspeed.initialize(model=Tiny(), optimizer=waiting, config=config("bf16", 2))
    assert waiting.committed_step == 4 and waiting.files.config()["tensors"][0]["name"] == "zero.g0"


def test_zero_converts_the_namespace_made_at_construction(cossd_adamw) -> None:
    """One process: the optimizer opens its new namespace at construction (the model's own
    params, reads true at once); deepspeed.initialize with ZeRO-2 replaces it, never stepped,
    with the flat groups' on one namespace, and the run follows torch's AdamW."""
    _, _, expected = train(lambda g: torch.optim.AdamW(g, lr=LR), "bf16", 2, steps=3)

    def read_first(param_groups: list[dict[str, Any]]) -> AdamW:
        optimizer = cossd_adamw("ds-convert")(param_groups)
        assert optimizer.committed_step == 0 and not optimizer.restored
        assert len(optimizer.master_weights()) == 4  # the model's params, on the device
        return optimizer

    _, optimizer, losses = train(read_first, "bf16", 2, steps=3)
    assert [(entry.name, entry.numel) for entry in optimizer.entries] == [("zero.g0", 2048), ("zero.g1", 80)]
    assert [t["name"] for t in optimizer.files.config()["tensors"]] == ["zero.g0", "zero.g1"]
    assert optimizer.committed_step == 3 and not optimizer.restored
    assert max(abs(a - b) for a, b in zip(losses, expected)) < 1e-3


def test_zero_on_a_trained_plain_namespace_is_refused_at_initialize(cossd_adamw) -> None:
    """A namespace a plain loop trained cannot become ZeRO's: refused inside
    deepspeed.initialize, naming the namespace and its step, and the device keeps it."""
    torch.manual_seed(0)
    model = Tiny()
    optimizer = cossd_adamw("ds-plain-trained")(groups(model))
    _plain_steps(model, optimizer, 2)
    masters = [m.clone() for m in optimizer.master_weights()]
    optimizer.close()
    with pytest.raises(RuntimeError, match="'ds-plain-trained' holds this model's own params at committed step 2"):
        train(cossd_adamw("ds-plain-trained"), "bf16", 2, steps=1)
    again = cossd_adamw("ds-plain-trained")(groups(Tiny()))
    assert again.committed_step == 2 and again.restored
    assert all(torch.equal(a, b) for a, b in zip(again.master_weights(), masters))
