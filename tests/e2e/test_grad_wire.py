"""The gradients' wire format end to end: grad_dtype="fp32" equals torch's AdamW bit for bit, FP8 with a per-tensor scale."""
from __future__ import annotations

import pytest
import torch

from cossd.trainer import AdamW

from conftest import Mount
from test_trainer import bits, loss_of, make_model, opened  # noqa: F401 - opened is a fixture

pytestmark = pytest.mark.mount


def _train_fp32_pair(opened, mount: Mount, namespace: str, steps: int, **options) -> tuple[list[float], list[float],
                                                                                           torch.nn.Module,
                                                                                           torch.nn.Module]:
    """An FP32 model stepped by cossd's AdamW (FP32 gradients on the wire) and a copy stepped by
    torch.optim.AdamW(fused=True), the kernel the device's matches bit for bit."""
    device_model, stock_model = make_model(torch.float32), make_model(torch.float32)
    optimizer = opened(AdamW, device_model.parameters(), mount=mount.mountpoint, namespace=namespace,
                       lr=3e-3, weight_decay=0.05, grad_dtype="fp32", **options)
    stock = torch.optim.AdamW(stock_model.parameters(), lr=3e-3, weight_decay=0.05, fused=True)
    device_losses, stock_losses = [], []
    for step in range(1, steps + 1):
        for model, opt, losses in ((device_model, optimizer, device_losses), (stock_model, stock, stock_losses)):
            opt.zero_grad()
            loss = loss_of(model, step, torch.float32)
            loss.backward()
            losses.append(loss.item())
            opt.step()
    assert optimizer.committed_step == steps
    return device_losses, stock_losses, device_model, stock_model


@pytest.mark.parametrize("use_cmb", [True, False], ids=["cmb", "files"])
def test_fp32_gradients_equal_torch_adamw_bit_for_bit(opened, mount: Mount, use_cmb: bool) -> None:
    """FP32 gradients cross unrounded (4 B in, and the FP32 masters back for FP32 params): every
    loss and every param equals torch.optim.AdamW's over 8 steps, through the CMB and the files."""
    device_losses, stock_losses, device_model, stock_model = _train_fp32_pair(
        opened, mount, f"fp32-{use_cmb}", 8, use_cmb=use_cmb)
    assert device_losses == stock_losses
    for mine, theirs in zip(device_model.parameters(), stock_model.parameters()):
        assert torch.equal(mine.detach().view(torch.int32), theirs.detach().view(torch.int32))


def test_fp32_namespace_takes_four_bytes_an_element(opened, mount: Mount) -> None:
    """The namespace records grad_dtype fp32, its grad files are 4 bytes an element, and the
    controller's features list the formats."""
    model = make_model(torch.float32)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="fp32size", grad_dtype="fp32")
    config = optimizer.files.config()
    assert config["grad_dtype"] == "fp32" and config["param_dtype"] == "bf16"
    for entry in optimizer.entries:
        grad_file = mount.mountpoint / "ns" / "fp32size" / "tensors" / entry.name / "grad"
        assert grad_file.stat().st_size == 4 * entry.numel


def test_bad_grad_dtype_is_refused_and_creates_nothing(opened, mount: Mount) -> None:
    model = make_model(torch.float32)
    with pytest.raises(ValueError, match="grad_dtype must be None .* or one of fp16, bf16, fp32"):
        AdamW(model.parameters(), mount=mount.mountpoint, namespace="badgrad", grad_dtype="fp64")
    assert not (mount.mountpoint / "ns" / "badgrad").exists()


def test_reattach_with_another_grad_dtype_is_refused(opened, mount: Mount) -> None:
    model = make_model(torch.float32)
    first = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="regrad", grad_dtype="fp32")
    first.close()
    with pytest.raises(ValueError, match="takes fp32 gradients, this optimizer sends bf16: pass grad_dtype='fp32'"):
        opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="regrad")


@pytest.mark.parametrize("use_cmb", [True, False], ids=["cmb", "files"])
def test_bf16_params_with_fp32_gradients_come_back_as_bf16(opened, mount: Mount, use_cmb: bool) -> None:
    """6 B/param: FP32 gradients in, BF16 params back (through the CMB, the device writes 2 bytes of
    params for each 4 of gradient). A BF16 model's gradients widen to FP32 exactly, so the run
    equals the one with BF16 gradients bit for bit."""
    runs = []
    for grad_dtype in ("fp32", None):
        model = make_model(torch.bfloat16)
        optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace=f"w{grad_dtype}{use_cmb}",
                           lr=3e-3, grad_dtype=grad_dtype, use_cmb=use_cmb)
        losses = []
        for step in range(1, 6):
            optimizer.zero_grad()
            loss = loss_of(model, step, torch.bfloat16)
            loss.backward()
            losses.append(loss.item())
            optimizer.step()
        assert optimizer.files.config()["grad_dtype"] == (grad_dtype or "bf16")
        assert (optimizer.files.stream_slots() is not None) == use_cmb  # params back through the CMB
        runs.append((losses, bits(model)))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
