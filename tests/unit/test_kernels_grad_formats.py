"""Gradient formats beyond FP16/BF16 in the kernels: FP32 and OCP FP8 (E4M3, E5M2) gradients, every path bit-identical, against torch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import cossd.kernels as k
from cossd.kernels import AdamHyper, GradFormat, HalfFormat, KernelArgumentError, StateFormat
from kernel_paths import PATHS, kernel_path

FP8 = {GradFormat.FP8_E4M3: torch.float8_e4m3fn, GradFormat.FP8_E5M2: torch.float8_e5m2}
HYPER_W = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, mode="adamw")
HYPER_L2 = AdamHyper(lr=2e-3, beta1=0.85, beta2=0.995, eps=1e-6, weight_decay=0.05, mode="adam")
# beta1 = 0 makes exp_avg = fma(0, g - m, g) = g exactly: the step then reports its decoded gradient.
HYPER_ECHO = AdamHyper(lr=1e-3, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0, mode="adamw")


def grads_of(gfmt: GradFormat, n: int, seed: int) -> np.ndarray:
    """Gradients spanning several decades, in gfmt's buffer dtype (FP8: torch's own rounding)."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 1, n)).astype(np.float32)
    if gfmt == GradFormat.FP32:
        return values
    return torch.from_numpy(values).to(FP8[gfmt]).view(torch.uint8).numpy().copy()


def step(grad: np.ndarray, gfmt: GradFormat, sfmt: StateFormat, scalars: Any, seed: int = 3) -> dict[str, np.ndarray]:
    """One out-of-place step on fresh state from `seed`: its outputs."""
    n = grad.size
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(n).astype(np.float32)
    out = {"master": np.empty(n, np.float32), "param": np.empty(n, np.uint16)}
    if sfmt in k.BLOCK_SCALED_FORMATS:
        blocks = k.state_scale_count(n)
        dtype = np.uint8 if sfmt == StateFormat.INT8 else np.uint16
        m, v = np.zeros(n, dtype), np.zeros(n, dtype)
        scales = {name: np.ones(blocks, np.float32) for name in ("as", "vs")}
        out |= {"m": np.empty(n, dtype), "v": np.empty(n, dtype), "as": np.empty(blocks, np.float32),
                "vs": np.empty(blocks, np.float32)}
        k.adam_step_q(grad, master, m, v, out["master"], out["m"], out["v"], out["param"],
                      exp_avg_scale_in=scales["as"], exp_avg_sq_scale_in=scales["vs"],
                      exp_avg_scale_out=out["as"], exp_avg_sq_scale_out=out["vs"], grad_format=gfmt,
                      param_format=HalfFormat.BF16, state_format=sfmt, scalars=scalars)
        return out
    m = rng.standard_normal(n).astype(np.float32) * 1e-3
    v = np.abs(rng.standard_normal(n).astype(np.float32)) * 1e-6
    if sfmt == StateFormat.BF16:
        m, v = (torch.from_numpy(x).bfloat16().view(torch.uint16).numpy().copy() for x in (m, v))
    out |= {"m": np.empty(n, m.dtype), "v": np.empty(n, v.dtype)}
    k.adam_step(grad, master, m, v, out["master"], out["m"], out["v"], out["param"], grad_format=gfmt,
                param_format=HalfFormat.BF16, state_format=sfmt, scalars=scalars)
    return out


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32) if a.dtype == np.float32 else a


@pytest.mark.parametrize("gfmt", list(FP8), ids=["e4m3", "e5m2"])
def test_fp8_decode_of_every_code_matches_torch(gfmt: GradFormat) -> None:
    """All 256 codes through the step on every path: exp_avg (beta1 = 0) is the decoded value,
    equal to torch's float8 -> float32 for every finite code; the non-finite count equals
    torch's (E4M3: its two NaNs; E5M2: 2 infs and 6 NaNs)."""
    codes = np.arange(256, dtype=np.uint8)
    theirs = torch.from_numpy(codes.copy()).view(FP8[gfmt]).to(torch.float32).numpy()
    finite = np.isfinite(theirs)
    assert k.count_nonfinite(codes, gfmt) == int((~finite).sum()) == (2 if gfmt == GradFormat.FP8_E4M3 else 8)
    for path in PATHS:
        with kernel_path(path):
            out = step(codes, gfmt, StateFormat.FP32, k.adam_scalars(HYPER_ECHO, 1))
        assert np.array_equal(bits(out["m"][finite]), bits(theirs[finite])), path
        assert np.isnan(out["m"][~finite]).all(), path
    # The extremes the docs state: E4M3 max 448, E5M2 max 57344.
    assert theirs[finite].max() == (448.0 if gfmt == GradFormat.FP8_E4M3 else 57344.0)


@pytest.mark.parametrize("sfmt", list(StateFormat), ids=lambda s: s.name.lower())
@pytest.mark.parametrize("gfmt", [GradFormat.FP32, *FP8], ids=["fp32", "e4m3", "e5m2"])
@pytest.mark.parametrize("n", [1, 15, 17, 257, 4099])
def test_every_path_gives_the_same_bits(gfmt: GradFormat, sfmt: StateFormat, n: int) -> None:
    grad = grads_of(gfmt, n, seed=n)
    for hyper in (HYPER_W, HYPER_L2):
        scalars = k.adam_scalars(hyper, 5, grad_scale=0.5)
        results = {}
        for path in PATHS:
            with kernel_path(path):
                results[path] = step(grad, gfmt, sfmt, scalars)
        first = results[PATHS[0]]
        for path, out in results.items():
            for key in first:
                assert np.array_equal(bits(out[key]), bits(first[key])), f"{path} {key} differs from {PATHS[0]}"


@pytest.mark.parametrize("gfmt", [GradFormat.FP32, *FP8], ids=["fp32", "e4m3", "e5m2"])
def test_block_update_equals_adam_step(gfmt: GradFormat) -> None:
    """The device's block update (step + CRC, the scratch path for these formats) steps the
    same bits as adam_step, counts the gradient's non-finite elements and checksums its outputs."""
    n = 5000
    grad = grads_of(gfmt, n, seed=11)
    if gfmt == GradFormat.FP32:
        grad[[3, 4000]] = [np.inf, np.nan]
    else:
        grad[[3, 4000]] = 0x7F  # NaN in both FP8 formats
    rng = np.random.default_rng(5)
    master, m, v = rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    outs = [np.empty(n, np.float32) for _ in range(3)] + [np.empty(n, np.uint16)]
    scalars = k.adam_scalars(HYPER_W, 1)
    for path in PATHS:
        with kernel_path(path):
            update = k.BlockUpdate(master, m, v, *outs, grad_format=gfmt, param_format=HalfFormat.BF16,
                                   state_format=StateFormat.FP32)
            crc, nonfinite, _ = update(grad, 0, scalars)
            expected = [np.empty_like(o) for o in outs]
            k.adam_step(grad, master, m, v, *expected, grad_format=gfmt, param_format=HalfFormat.BF16,
                        state_format=StateFormat.FP32, scalars=scalars)
        assert nonfinite == 2, path
        for mine, theirs in zip(outs, expected):
            assert np.array_equal(bits(mine), bits(theirs)), path
        assert crc == k.crc32c(b"".join(o.tobytes() for o in expected)), path


def test_fp32_grads_step_as_torch_fused_adamw() -> None:
    """FP32 gradients (not representable in BF16) give torch.optim.AdamW(fused=True)'s master
    and exp_avg bit for bit over 10 steps on every path: nothing is rounded on the way in."""
    n = 1 << 14
    rng = np.random.default_rng(9)
    start = rng.standard_normal(n).astype(np.float32)
    grads = [(rng.standard_normal(n) * 0.05).astype(np.float32) for _ in range(10)]
    assert any(not np.array_equal(g, torch.from_numpy(g).bfloat16().float().numpy()) for g in grads)
    tparam = torch.nn.Parameter(torch.from_numpy(start.copy()))
    opt = torch.optim.AdamW([tparam], lr=HYPER_W.lr, betas=(HYPER_W.beta1, HYPER_W.beta2), eps=HYPER_W.eps,
                            weight_decay=HYPER_W.weight_decay, fused=True)
    for g in grads:
        tparam.grad = torch.from_numpy(g.copy())
        opt.step()
    for path in PATHS:
        master, m, v, param = start.copy(), np.zeros(n, np.float32), np.zeros(n, np.float32), np.empty(n, np.uint16)
        with kernel_path(path):
            for number, g in enumerate(grads, 1):
                k.adam_step(g, master, m, v, master, m, v, param, grad_format=GradFormat.FP32,
                            param_format=HalfFormat.BF16, state_format=StateFormat.FP32,
                            scalars=k.adam_scalars(HYPER_W, number))
        assert np.array_equal(bits(master), bits(tparam.detach().numpy())), path
        assert np.array_equal(bits(m), bits(opt.state[tparam]["exp_avg"].numpy())), path


def test_a_gradient_of_the_wrong_width_is_refused() -> None:
    n = 64
    args = [np.zeros(n, np.float32) for _ in range(6)] + [np.empty(n, np.uint16)]
    scalars = k.adam_scalars(HYPER_W, 1)
    for gfmt, wrong in ((GradFormat.FP32, np.zeros(n, np.uint16)), (GradFormat.FP8_E4M3, np.zeros(n, np.uint16)),
                        (GradFormat.BF16, np.zeros(n, np.float32))):
        with pytest.raises(KernelArgumentError, match="grad must have dtype"):
            k.adam_step(wrong, *args, grad_format=gfmt, param_format=HalfFormat.BF16,
                        state_format=StateFormat.FP32, scalars=scalars)
    with pytest.raises(KernelArgumentError, match="fmt must be a GradFormat"):
        k.count_nonfinite(np.zeros(n, np.uint8), 7)
