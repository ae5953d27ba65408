"""cossd.trainer through a real mount: stock-AdamW agreement, GradScaler, schedules, state_dict, restore."""
from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cossd.trainer import Adam, AdamW, DeviceLostError
from cossd.harness.reference import MixedPrecisionOptimizer

from conftest import Mount

pytestmark = pytest.mark.mount


class TinyNet(torch.nn.Module):
    """Two layers with biases.

    Every tensor is a multiple of 16 elements: torch's fused CPU AdamW handles the last
    numel % 16 elements in a scalar loop whose rounding differs, and these tests compare
    bit for bit.
    """

    def __init__(self, width: int = 32, inputs: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(inputs, width)
        self.fc2 = torch.nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


CLASSES = 16


def make_model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return TinyNet().to(dtype)


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(64, 16, generator=generator).to(dtype)
    y = torch.randint(0, CLASSES, (64,), generator=generator)
    return x, y


def loss_of(model: torch.nn.Module, step: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    x, y = batch(step, dtype)
    return F.cross_entropy(model(x).float(), y) * scale


def bits(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone().view(torch.int16) for p in model.parameters()]


@pytest.fixture
def opened(mount: Mount):
    """Opens optimizers, closing them before the mount is torn down (even on failure)."""
    optimizers: list = []

    def open_optimizer(cls, *args, **kwargs):
        optimizer = cls(*args, **kwargs)
        optimizers.append(optimizer)
        return optimizer

    yield open_optimizer
    for optimizer in optimizers:
        try:
            optimizer.close()
        except Exception:
            pass


def run_pair(opened, mount: Mount, steps: int, dtype: torch.dtype, *, namespace: str = "net",
             groups=None, scheduler=None, max_grad_norm=None, cls=AdamW, stock=torch.optim.AdamW,
             **options) -> tuple[list[float], list[float], object, torch.nn.Module]:
    """Train the same model with cossd and with the stock mixed-precision recipe."""
    device_model, stock_model = make_model(dtype), make_model(dtype)
    device_groups = groups(device_model) if groups else device_model.parameters()
    stock_groups = groups(stock_model) if groups else stock_model.parameters()
    optimizer = opened(cls, device_groups, mount=mount.mountpoint, namespace=namespace,
                    max_grad_norm=max_grad_norm, **options)
    # fused=True: torch's CPU kernel that the device's kernel matches bit for bit.
    reference = MixedPrecisionOptimizer(stock_groups, stock, fused=True, **options)
    schedulers = [scheduler(optimizer), scheduler(reference.optimizer)] if scheduler else []
    device_losses, stock_losses = [], []
    for step in range(1, steps + 1):
        for model, opt, losses in ((device_model, optimizer, device_losses),
                                   (stock_model, reference, stock_losses)):
            opt.zero_grad()
            loss = loss_of(model, step, dtype)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        reference.step(max_grad_norm=max_grad_norm)
        for sched in schedulers:
            sched.step()
    return device_losses, stock_losses, (optimizer, reference), device_model


def assert_close_losses(device: list[float], stock: list[float], rel: float = 1e-4) -> None:
    for step, (a, b) in enumerate(zip(device, stock), start=1):
        assert math.isclose(a, b, rel_tol=rel), f"step {step}: cossd {a} vs stock {b}"


def assert_same_masters(optimizer, reference) -> None:
    for index, (mine, theirs) in enumerate(zip(optimizer.master_weights(), reference.masters)):
        differ = int((mine.view(torch.int32) != theirs.detach().view(torch.int32)).sum())
        assert differ == 0, f"master {index}: {differ} elements differ from stock AdamW"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_adamw_tracks_stock_mixed_precision(opened, mount: Mount, dtype: torch.dtype) -> None:
    device_losses, stock_losses, (optimizer, reference), _ = run_pair(
        opened, mount, 30, dtype, lr=3e-3, weight_decay=0.05)
    assert device_losses == stock_losses
    assert optimizer.committed_step == 30
    assert_same_masters(optimizer, reference)
    optimizer.close()


def test_adam_l2_tracks_stock(opened, mount: Mount) -> None:
    device_losses, stock_losses, (optimizer, reference), _ = run_pair(
        opened, mount, 20, torch.bfloat16, cls=Adam, stock=torch.optim.Adam, lr=2e-3, weight_decay=0.1)
    assert device_losses == stock_losses
    assert_same_masters(optimizer, reference)
    optimizer.close()


def test_per_group_schedule_and_zero_weight_decay(opened, mount: Mount) -> None:
    def groups(model: torch.nn.Module) -> list[dict]:
        return [
            {"params": [model.fc1.weight, model.fc2.weight], "weight_decay": 0.1},
            {"params": [model.fc1.bias, model.fc2.bias], "weight_decay": 0.0, "lr": 5e-3},
        ]

    def scheduler(opt) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 0.2 * step))

    device_losses, stock_losses, (optimizer, reference), _ = run_pair(
        opened, mount, 25, torch.bfloat16, groups=groups, scheduler=scheduler, lr=1e-2)
    assert device_losses == stock_losses
    assert_same_masters(optimizer, reference)
    config = optimizer.files.config()
    assert [g["weight_decay"] for g in config["groups"]] == [0.1, 0.0]
    assert config["groups"][1]["lr"] == pytest.approx(5e-3 / (1 + 0.2 * 24))  # sent with step 25
    optimizer.close()


def test_clipping_by_global_norm_matches_stock(opened, mount: Mount) -> None:
    device_losses, stock_losses, (optimizer, _), _ = run_pair(
        opened, mount, 15, torch.bfloat16, max_grad_norm=0.05, lr=1e-2)
    assert_close_losses(device_losses, stock_losses)
    assert optimizer.last_grad_norm is not None and optimizer.last_grad_norm > 0.05
    optimizer.close()


def test_gradscaler_overflow_is_skipped_on_device(opened, mount: Mount) -> None:
    model = make_model(torch.float16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="amp", lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)
    overflow_steps = {3, 4, 7}
    for iteration in range(1, 10):
        optimizer.zero_grad()
        loss = loss_of(model, iteration, torch.float16)
        scaler.scale(loss).backward()
        if iteration in overflow_steps:
            model.fc1.weight.grad[0, 0] = float("inf")
        before_params = bits(model)
        before_master = [m.clone() for m in optimizer.master_weights()]
        before_step = optimizer.committed_step
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        if iteration in overflow_steps:
            assert optimizer.last_step_skipped
            assert optimizer.committed_step == before_step
            assert scaler.get_scale() == scale_before / 2
            assert all(torch.equal(a, b) for a, b in zip(before_params, bits(model)))
            assert all(torch.equal(a, b) for a, b in zip(before_master, optimizer.master_weights()))
        else:
            assert not optimizer.last_step_skipped
            assert optimizer.committed_step == before_step + 1
            assert scaler.get_scale() == scale_before
    stats = optimizer.files.statistics()
    assert stats["steps_skipped"] == 3 and stats["last_skipped_step"] == 5  # device step of iteration 7
    assert optimizer.committed_step == 6
    optimizer.close()


def test_gradscaler_scaled_steps_match_unscaled(opened, mount: Mount) -> None:
    """The device divides by the scaler's scale: same masters as the unscaled stock recipe."""
    model, stock_model = make_model(torch.float16), make_model(torch.float16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="amp2", lr=1e-3)
    reference = MixedPrecisionOptimizer(stock_model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for iteration in range(1, 8):
        optimizer.zero_grad()
        reference.zero_grad()
        scaler.scale(loss_of(model, iteration, torch.float16)).backward()
        (loss_of(stock_model, iteration, torch.float16) * 256.0).backward()
        scaler.step(optimizer)
        scaler.update()
        reference.step(grad_scale=256.0)
    # Dividing by a power of two is exact, so the scaled run is the unscaled one, bit for bit.
    assert_same_masters(optimizer, reference)
    optimizer.close()


@pytest.mark.parametrize("use_cmb", [True, False])
def test_streaming_equals_step_time_transfer(opened, mount: Mount, use_cmb: bool) -> None:
    """Gradients sent one tensor at a time as backward produces them (through the CMB, each
    tensor's place fixed there, or through the files) step exactly as those sent at step()."""
    models = [make_model(torch.bfloat16) for _ in range(2)]
    streaming = opened(AdamW, models[0].parameters(), mount=mount.mountpoint, namespace="stream",
                      streaming=True, use_cmb=use_cmb)
    assert (streaming.files.stream_slots() is not None) == use_cmb
    plain = opened(AdamW, models[1].parameters(), mount=mount.mountpoint, namespace="plain")
    before = streaming.files.statistics()
    for step in range(1, 6):
        for model, opt in zip(models, (streaming, plain)):
            opt.zero_grad()
            loss_of(model, step, torch.bfloat16).backward()
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(bits(models[0]), bits(models[1])))
    after = streaming.files.statistics()
    # One write per tensor and step either way; through the CMB the params come back with
    # those writes (no reads), through the files each tensor's params are read.
    tensors = len(streaming.entries)
    assert after["write_commands"] - before["write_commands"] == 5 * tensors
    assert after["read_commands"] - before["read_commands"] == (0 if use_cmb else 5 * tensors)
    streaming.close()
    plain.close()


def test_state_dict_moves_between_cossd_and_stock(opened, mount: Mount) -> None:
    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="sd", lr=2e-3)
    for step in range(1, 6):
        optimizer.zero_grad()
        loss_of(model, step, torch.bfloat16).backward()
        optimizer.step()
    exported = optimizer.state_dict()
    assert set(exported["state"]) == set(range(4)) and float(exported["state"][0]["step"]) == 5.0

    # Into stock PyTorch: the usual mixed-precision recipe continues from the export.
    stock_model = copy.deepcopy(model)
    reference = MixedPrecisionOptimizer(stock_model.parameters(), lr=2e-3, fused=True)
    reference.load_masters(exported["cossd_master"].values())
    reference.optimizer.load_state_dict(exported)
    for group in reference.param_groups:  # the export carries cossd's group options (fused=None)
        group["fused"] = True
    # And back into a fresh cossd namespace (created at step 5 from the stock state).
    imported_model = copy.deepcopy(model)
    imported = opened(AdamW, imported_model.parameters(), mount=mount.mountpoint, namespace="sd2", lr=2e-3)
    imported.load_state_dict(reference.optimizer.state_dict(), master=reference.masters)
    assert imported.committed_step == 5
    for step in range(6, 10):
        for m, opt in ((model, optimizer), (stock_model, reference), (imported_model, imported)):
            opt.zero_grad()
            loss_of(m, step, torch.bfloat16).backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(bits(model), bits(imported_model)))
    assert_same_masters(optimizer, reference)
    optimizer.close()
    imported.close()


@pytest.mark.parametrize("streaming", [False, True])
def test_quick_restore_after_daemon_killed_mid_step(opened, mount: Mount, streaming: bool) -> None:
    """kill -9 while gradients are in flight (sent at step(), or streamed through the CMB from
    the writer thread while backward runs); a new job reattaches and continues bit for bit."""
    straight = make_model(torch.bfloat16)
    straight_opt = opened(AdamW, straight.parameters(), mount=mount.mountpoint, namespace="straight")
    for step in range(1, 11):
        straight_opt.zero_grad()
        loss_of(straight, step, torch.bfloat16).backward()
        straight_opt.step()
    straight_opt.close()

    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="crashy",
                       streaming=streaming)
    assert not streaming or optimizer.files.stream_slots() is not None  # through the CMB
    for step in range(1, 6):
        optimizer.zero_grad()
        if step == 5:  # before backward: streamed gradients leave during it
            optimizer.before_grad_write = lambda index: mount.kill() if index == 2 else None
        loss_of(model, step, torch.bfloat16).backward()
        if step == 5:
            with pytest.raises(DeviceLostError, match="remount"):
                optimizer.step()
        else:
            optimizer.step()
    optimizer.close()
    mount.restart()

    restarted = make_model(torch.bfloat16, seed=99)  # a new job: its own random init
    resumed = opened(AdamW, restarted.parameters(), mount=mount.mountpoint, namespace="crashy")
    assert resumed.restored and resumed.committed_step == 4
    for step in range(resumed.committed_step + 1, 11):
        resumed.zero_grad()
        loss_of(restarted, step, torch.bfloat16).backward()
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(bits(straight), bits(restarted)))
    assert resumed.state_dict()["state"][0]["exp_avg"].equal(
        opened(AdamW, make_model(torch.bfloat16).parameters(), mount=mount.mountpoint,
              namespace="straight").state_dict()["state"][0]["exp_avg"])
    resumed.close()


def test_reattach_refuses_a_different_model(opened, mount: Mount) -> None:
    opened(AdamW, make_model(torch.bfloat16).parameters(), mount=mount.mountpoint, namespace="m").close()
    other = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(ValueError, match="different set of tensors"):
        AdamW(other.parameters(), mount=mount.mountpoint, namespace="m")


def test_unsupported_options_are_refused(opened, mount: Mount, tmp_path: Path) -> None:
    params = make_model(torch.bfloat16).parameters()
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW(params, mount=mount.mountpoint, namespace="x", amsgrad=True)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opened(AdamW, make_model(torch.bfloat16).parameters(), mount=mount.mountpoint, namespace="x", lr=-1)
    with pytest.raises(FileNotFoundError, match="not a mounted cossd device"):
        AdamW(make_model(torch.bfloat16).parameters(), mount=tmp_path, namespace="x")


def test_stopped_daemon_times_out_with_a_clear_error(opened, mount: Mount) -> None:
    """SIGSTOP the daemon mid-training: the trainer gets a timeout error instead of hanging."""
    import os
    import signal
    import time

    from cossd.client import AdminClient, DeviceTimeoutError

    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="hang", timeout_s=1.5)
    optimizer.zero_grad()
    loss_of(model, 1, torch.bfloat16).backward()
    optimizer.step()
    os.kill(mount.pid, signal.SIGSTOP)
    try:
        optimizer.zero_grad()
        loss_of(model, 2, torch.bfloat16).backward()
        started = time.monotonic()
        with pytest.raises(DeviceTimeoutError, match="did not answer within 1.5 s"):
            optimizer.step()
        assert time.monotonic() - started < 10
        started = time.monotonic()
        with pytest.raises(DeviceTimeoutError):
            AdminClient(mount.mountpoint, timeout_s=1.0).describe()
        assert time.monotonic() - started < 5
    finally:
        os.kill(mount.pid, signal.SIGCONT)
    # Resumed, the device serves again; the abandoned step never committed.
    with AdminClient(mount.mountpoint) as admin:
        assert admin.statistics(admin.nsid("hang"))["committed_step"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
@pytest.mark.parametrize("use_cmb", [True, False])
def test_cuda_model_steps_like_a_cpu_model(opened, mount: Mount, use_cmb: bool) -> None:
    """A model on a GPU (its gradients and params crossing between the GPU and the page-locked
    CMB, or the files) steps bit for bit as the same model on the CPU: the device does the
    arithmetic either way."""
    cpu_model = make_model(torch.bfloat16)
    gpu_model = copy.deepcopy(cpu_model).cuda()
    on_cpu = opened(AdamW, cpu_model.parameters(), mount=mount.mountpoint, namespace="on-cpu")
    on_gpu = opened(AdamW, gpu_model.parameters(), mount=mount.mountpoint, namespace="on-gpu", use_cmb=use_cmb)
    assert on_gpu.cmb_pinned == use_cmb  # CUDA page-locked the optimizer's part of the CMB
    for step in range(1, 6):
        for model, optimizer in ((cpu_model, on_cpu), (gpu_model, on_gpu)):
            optimizer.zero_grad()
            x, y = batch(step, torch.bfloat16)
            device = next(model.parameters()).device
            F.cross_entropy(model(x.to(device)).float(), y.to(device)).backward()
        for p, q in zip(cpu_model.parameters(), gpu_model.parameters()):
            q.grad.copy_(p.grad)  # the GPU's matmuls round differently: step the same gradients
        on_cpu.step()
        on_gpu.step()
        assert all(torch.equal(a, b.cpu()) for a, b in zip(bits(cpu_model), bits(gpu_model)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")
def test_cuda_streaming_on_a_side_stream_steps_like_the_cpu(opened, mount: Mount) -> None:
    """Streaming from a GPU whose backward runs on a side stream: the writer thread waits for
    each gradient (an event on that stream) before copying it into the CMB, so the steps
    are the CPU model's, bit for bit, with each CPU gradient given to the GPU model first."""
    cpu_model = make_model(torch.bfloat16)
    gpu_model = copy.deepcopy(cpu_model).cuda()
    on_cpu = opened(AdamW, cpu_model.parameters(), mount=mount.mountpoint, namespace="s-cpu")
    on_gpu = opened(AdamW, gpu_model.parameters(), mount=mount.mountpoint, namespace="s-gpu", streaming=True)
    assert on_gpu.files.stream_slots() is not None
    side = torch.cuda.Stream()
    for step in range(1, 6):
        on_cpu.zero_grad()
        x, y = batch(step, torch.bfloat16)
        F.cross_entropy(cpu_model(x).float(), y).backward()
        on_gpu.zero_grad()
        with torch.cuda.stream(side):
            # A loss whose gradient is exactly the CPU one, made on the side stream by backward.
            targets = [p.grad.cuda(non_blocking=False) for p in cpu_model.parameters()]
            sum((q * t).sum() for q, t in zip(gpu_model.parameters(), targets)).backward()
        on_cpu.step()
        on_gpu.step()
        assert all(torch.equal(a, b.cpu()) for a, b in zip(bits(cpu_model), bits(gpu_model)))


def test_step_without_gradients_is_skipped_with_a_warning(opened, mount: Mount) -> None:
    """step() with every .grad None sends nothing and commits nothing, and says so."""
    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="nograd", lr=1e-2)
    loss_of(model, 1, torch.bfloat16).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    before = bits(model)
    with pytest.warns(RuntimeWarning, match="no gradients"):
        optimizer.step()
    assert (optimizer.committed_step, optimizer.steps_skipped_no_grads, optimizer.last_step_skipped) == (1, 1, True)
    assert optimizer.files.statistics()["committed_step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, bits(model)))
    loss_of(model, 2, torch.bfloat16).backward()
    optimizer.step()
    assert (optimizer.committed_step, optimizer.last_step_skipped) == (2, False)


@pytest.mark.parametrize("streaming", [False, True], ids=["at-step", "streamed"])
def test_step_with_some_gradients_missing_is_refused(opened, mount: Mount, streaming: bool) -> None:
    """A zero gradient is not torch's "no gradient" (moments and weight decay move): such a
    step is refused before anything commits, and goes through once the gradient is explicit."""
    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace=f"partial{int(streaming)}",
                       lr=1e-2, streaming=streaming)
    model.fc1.bias.requires_grad_(False)  # no gradient this step
    before = bits(model)
    loss_of(model, 1, torch.bfloat16).backward()
    with pytest.raises(RuntimeError, match="1 of 4 params have no gradient"):
        optimizer.step()
    assert optimizer.committed_step == 0 and optimizer.files.statistics()["committed_step"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, bits(model)))
    model.fc1.bias.requires_grad_(True)
    optimizer.zero_grad(set_to_none=True)
    loss_of(model, 1, torch.bfloat16).backward()
    optimizer.step()
    assert optimizer.committed_step == 1


def test_fp32_params_get_the_fp32_masters(opened, mount: Mount) -> None:
    """An FP32 param is given the device's FP32 master, not its BF16 rounding."""
    model = make_model(torch.float32)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="fp32", lr=1e-2)
    for step in range(1, 3):
        loss_of(model, step, torch.float32).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert all(torch.equal(p.detach(), m) for p, m in zip(model.parameters(), optimizer.master_weights()))
    assert any(not torch.equal(p.detach(), p.detach().to(torch.bfloat16).float()) for p in model.parameters())


def test_bench_report_without_matplotlib_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`cossd bench` without the trainer extra's matplotlib: the figures are written, the
    chart is not, and the output says what to install (it used to crash at its very end)."""
    from cossd.harness import bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when absent
    report = {"created": "now", "elements": 1, "repeat": 1,
              "machine": {"cpu": "x", "cores": 1, "torch": torch.__version__, "simd": "scalar", "python": "3"}}
    bench._write_report(report, tmp_path / "out")
    assert json.loads((tmp_path / "out/bench.json").read_text())["created"] == "now"
    assert (tmp_path / "out/bench.md").exists() and not (tmp_path / "out/bench.png").exists()
    assert "pip install 'cossd[trainer]'" in capsys.readouterr().out
