"""cossd's AdamW under DeepSpeed against torch's AdamW where DeepSpeed steps the optimizer through a torch.amp.GradScaler (torch_autocast FP16), and where engine.load_checkpoint loads the model without the optimizer's state (a warm start)."""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (the optional framework tier: `make frameworks`)")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cossd.emulator import Device  # noqa: E402
from cossd.trainer import AdamW  # noqa: E402

from conftest import Mount, force_unmount, is_mounted, start_mount, wait_for_exit  # noqa: E402
from helpers import free_port  # noqa: E402

pytestmark = pytest.mark.mount

KW = {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.0}


@pytest.fixture(scope="module", autouse=True)
def distributed() -> None:
    if not torch.distributed.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed("gloo")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def mounted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    root = tmp_path_factory.mktemp("dsreload")
    Device.format(root / "backing", capacity_bytes=1 << 30, serial="TESTSERIALDSRL")
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
def cossd(mounted: Mount) -> Iterator[Callable[..., Callable[[Any], AdamW]]]:
    made: list[AdamW] = []

    def make(namespace: str, **options: Any) -> Callable[[Any], AdamW]:
        def factory(params: Any) -> AdamW:
            made.append(AdamW(params, mount=mounted.mountpoint, namespace=namespace, **(KW | options)))
            return made[-1]
        return factory

    yield make
    for optimizer in made:
        optimizer.close()


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


_generator = torch.Generator().manual_seed(7)
X = torch.randn(8, 16, generator=_generator)
Y = (X @ torch.randn(16, 16, generator=_generator)).argmax(1)


def config(stage: int, precision: str, clipping: float = 0.0) -> dict[str, Any]:
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                           "steps_per_print": 10**9, "gradient_clipping": clipping}
    if precision == "autocast":
        cfg["torch_autocast"] = {"enabled": True, "dtype": "torch.float16"}
    else:
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine: Any, steps: int) -> list[float]:
    losses = []
    dtype = next(engine.module.parameters()).dtype
    for _ in range(steps):
        loss = F.cross_entropy(engine(X.to(dtype)).float(), Y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def params(engine: Any) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in engine.module.parameters()]


def largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("stage,clipping", [(1, 0.0), (3, 0.0), (2, 1.0)])
def test_torch_autocast_fp16_steps_as_torch_adamw(cossd: Any, stage: int, clipping: float) -> None:
    """DeepSpeed's torch_autocast FP16 steps the optimizer through its GradScaler, which leaves
    the gradients scaled (65536x) and sets grad_scale and found_inf on a cossd optimizer (it
    declares _step_supports_amp_scaling): the device divides by the scale, as torch's AdamW,
    which the scaler unscales for, steps. (Non-finite gradients never reach either: DeepSpeed's
    own overflow check skips the step before the scaler sees it.)"""
    runs = []
    for make in (lambda p: torch.optim.AdamW(p, **KW), cossd(f"autocast{stage}", grad_dtype="fp32")):
        torch.manual_seed(0)
        model = Tiny()
        optimizer = make(model.parameters())
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(stage, "autocast", clipping))
        runs.append((optimizer, train(engine, 4), params(engine)))
    (_, torch_losses, torch_params), (optimizer, losses, trained) = runs
    assert losses == pytest.approx(torch_losses, abs=1e-6)
    assert largest(trained, torch_params) < 1e-6
    assert optimizer.steps_skipped == 0 and optimizer.committed_step == 4


def test_fp8_params_out_under_a_wrapper_are_refused(cossd: Any) -> None:
    """param_wire_dtype under a DeepSpeed wrapper (here ZeRO-1 with BF16): DeepSpeed makes the
    model's params from the FP32 copies it reads back, so the option would be ignored:
    refused when DeepSpeed binds the optimizer, naming the option."""
    model = Tiny()
    optimizer = cossd("fp8wrapped", param_wire_dtype="fp8_e4m3")(model.parameters())
    with pytest.raises(ValueError, match="param_wire_dtype='fp8_e4m3' is not supported under DeepSpeed"):
        deepspeed.initialize(model=model, optimizer=optimizer, config=config(1, "bf16"))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, list[torch.Tensor]]]:
    """Per stage, a DeepSpeed checkpoint (tag "pre") of 5 steps of torch's AdamW from seed 0."""
    made: dict[int, tuple[Path, list[torch.Tensor]]] = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = Tiny()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                          config=config(stage, "bf16"))
        train(engine, 5)
        path = tmp_path_factory.mktemp(f"pre{stage}")
        engine.save_checkpoint(str(path), tag="pre")
        made[stage] = (path, params(engine))
    return made


@pytest.mark.parametrize("stage,how", [(1, "load_module_only"), (2, "no_optimizer_states"),
                                       (0, "load_module_only"), (3, "no_optimizer_states")])
def test_warm_start_trains_from_the_loaded_weights(cossd: Any, pretrained: Any, stage: int, how: str) -> None:
    """engine.load_checkpoint(..., load_module_only=True) or load_optimizer_states=False right
    after deepspeed.initialize: DeepSpeed refreshes its FP32 copies from the loaded model, and
    the device's masters follow, so the next step trains from the checkpoint's weights (not
    the random init) exactly as torch's AdamW does."""
    path, weights = pretrained[stage]
    kwargs = {"load_module_only": True} if how == "load_module_only" else {"load_optimizer_states": False}
    runs = []
    for make in (lambda p: torch.optim.AdamW(p, lr=1e-2), cossd(f"warm{stage}{how[:2]}", lr=1e-2, eps=1e-8, weight_decay=1e-2)):
        torch.manual_seed(1)
        model = Tiny()
        engine, *_ = deepspeed.initialize(model=model, optimizer=make(model.parameters()), config=config(stage, "bf16"))
        engine.load_checkpoint(str(path), "pre", **kwargs)
        assert largest(params(engine), weights) == 0
        train(engine, 1)
        runs.append(params(engine))
    torch_params, trained = runs
    assert largest(trained, torch_params) == 0
    assert largest(trained, weights) < 0.1  # one step from the checkpoint's weights, not from seed 1's


def test_new_weights_into_a_trained_zero_namespace_are_refused(cossd: Any, pretrained: Any,
                                                               tmp_path: Path) -> None:
    """A ZeRO namespace that has trained cannot take new masters: a load_module_only of other
    weights is refused naming how to warm-start, and the engine then refuses to step (never the
    device's old weights over the loaded ones); a module-only load of the weights it holds
    changes nothing; a full load of a cossd checkpoint makes the engine usable again."""
    torch.manual_seed(0)
    model = Tiny()
    engine, *_ = deepspeed.initialize(model=model, optimizer=cossd("trained1")(model.parameters()),
                                      config=config(1, "bf16"))
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path), tag="own")
    torch.manual_seed(0)
    model = Tiny()
    optimizer = cossd("trained1")(model.parameters())
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(1, "bf16"))
    assert optimizer.committed_step == 2
    masters = [m.clone() for m in optimizer.master_weights()]
    engine.load_checkpoint(str(tmp_path), "own", load_module_only=True)  # the weights it holds: no change
    assert all(torch.equal(a, b) for a, b in zip(optimizer.master_weights(), masters))
    with pytest.raises(RuntimeError, match="has trained .*load_module_only=True\\) right after deepspeed.initialize"):
        engine.load_checkpoint(str(pretrained[1][0]), "pre", load_module_only=True)
    with pytest.raises(RuntimeError, match="has trained"):
        train(engine, 1)
    assert optimizer.committed_step == 2
    assert all(torch.equal(a, b) for a, b in zip(optimizer.master_weights(), masters))
    engine.load_checkpoint(str(tmp_path), "own")
    train(engine, 1)
    assert optimizer.committed_step == 3
