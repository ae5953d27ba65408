"""Tests of cossd.kernels: AVX-512/AVX2 vs scalar bit-identity, numpy/torch references, conversions, validation, CRC32C, threads."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import cossd.kernels as k
from cossd.kernels import AdamHyper, HalfFormat, KernelArgumentError, StateFormat
from reference_adam import ref_adam, ref_f32_to_bf16, ref_f32_to_half

# The moment formats adam_step takes; the block-scaled ones (FP16, INT8) have their own tests
# (test_kernels_state_formats.py).
ELEMENTWISE_STATE = (StateFormat.FP32, StateFormat.BF16)

ALL_PATHS = ("scalar", "avx2", "avx512")
PATHS = k.available_kernels()  # what this CPU runs, e.g. ("scalar", "avx2", "avx512")
SIMD_PATHS = tuple(p for p in PATHS if p != "scalar")
SIMD = bool(SIMD_PATHS)
SIZES = [1, 15, 17, 2**20 + 3]
needs_simd = pytest.mark.skipif(not SIMD, reason="CPU lacks AVX2/F16C; only the scalar path exists")


def path_params(paths: tuple[str, ...] = ALL_PATHS) -> list[Any]:
    """One pytest param per kernel path; a path this CPU lacks is skipped, not silently run as another."""
    return [
        pytest.param(p, id=p, marks=pytest.mark.skipif(p not in PATHS, reason=f"CPU lacks the {p} path"))
        for p in paths
    ]


@contextlib.contextmanager
def kernel_path(path: str | bool) -> Iterator[None]:
    """Select the path ("scalar", "avx2", "avx512"; True = best) for the block, then restore the previous one."""
    name = path if isinstance(path, str) else ("auto" if path else "scalar")
    before = k.simd_level()
    k.use_kernel(name)
    try:
        if name in ALL_PATHS:
            assert k.simd_level() == name, f"asked for {name}, dispatch uses {k.simd_level()}"
        yield
    finally:
        k.use_kernel(before)


# ---------------------------------------------------------------------------
# Reference conversions (numpy), independent of the C code
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# Adam helpers
# ---------------------------------------------------------------------------

HYPER_W = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, mode="adamw")
HYPER_L2 = AdamHyper(lr=2e-3, beta1=0.85, beta2=0.995, eps=1e-6, weight_decay=0.05, mode="adam")
# beta1 < 0.5: the lerp takes its other form, fma(w - 1, g - m, g).
HYPER_LOW_BETA1 = AdamHyper(lr=5e-3, beta1=0.3, beta2=0.9, eps=1e-7, weight_decay=0.1, mode="adamw")


def make_inputs(n: int, gfmt: HalfFormat, sfmt: StateFormat, seed: int) -> dict[str, np.ndarray]:
    """Random but realistic optimizer state: grads in half format, fp32 master, moments in sfmt."""
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * 0.1).astype(np.float32)
    grad = g.astype(np.float16).view(np.uint16) if gfmt == HalfFormat.FP16 else ref_f32_to_bf16(g)
    master = rng.standard_normal(n).astype(np.float32)
    m = (rng.standard_normal(n) * 0.01).astype(np.float32)
    v = (np.abs(rng.standard_normal(n)) * 1e-3).astype(np.float32)
    if sfmt == StateFormat.BF16:
        m, v = ref_f32_to_bf16(m), ref_f32_to_bf16(v)
    return {"grad": grad, "master": master, "m": m, "v": v}


def run_adam(
    inp: dict[str, np.ndarray],
    gfmt: HalfFormat,
    pfmt: HalfFormat,
    sfmt: StateFormat,
    scalars: k.AdamScalars,
    shift: int = 0,
) -> dict[str, np.ndarray]:
    """One out-of-place step; `shift` places each output `shift` elements past a fresh allocation's start."""
    n = inp["master"].size

    def empty(dtype: np.dtype) -> np.ndarray:
        return np.empty(n + shift, dtype)[shift:]

    out = {"master": empty(inp["master"].dtype), "m": empty(inp["m"].dtype), "v": empty(inp["v"].dtype),
           "param": empty(np.dtype(np.uint16))}  # fmt: skip
    k.adam_step(
        inp["grad"], inp["master"], inp["m"], inp["v"], out["master"], out["m"], out["v"], out["param"],
        grad_format=gfmt, param_format=pfmt, state_format=sfmt, scalars=scalars,
    )  # fmt: skip
    return out


def assert_bits_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str = "") -> None:
    for key in a:
        x, y = a[key], b[key]
        xb = x.view(np.uint32) if x.dtype == np.float32 else x
        yb = y.view(np.uint32) if y.dtype == np.float32 else y
        bad = np.flatnonzero(xb != yb)
        assert bad.size == 0, (
            f"{what} {key}: {bad.size} elements differ, first at {bad[0]}: {xb[bad[0]]:#x} vs {yb[bad[0]]:#x}"
        )


ADAM_COMBOS = [
    (gfmt, pfmt, sfmt, hyper)
    for gfmt in HalfFormat
    for pfmt in HalfFormat
    for sfmt in ELEMENTWISE_STATE
    for hyper in (HYPER_W, HYPER_L2, HYPER_LOW_BETA1)
]
HYPER_IDS = {HYPER_W: "adamw", HYPER_L2: "adamL2", HYPER_LOW_BETA1: "adamw-b1lo"}
ADAM_IDS = [f"g{g.name}-p{p.name}-s{s.name}-{HYPER_IDS[h]}" for g, p, s, h in ADAM_COMBOS]


# ---------------------------------------------------------------------------
# Adam: SIMD vs scalar, numpy reference, specials, in-place, grad_scale
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize(("gfmt", "pfmt", "sfmt", "hyper"), ADAM_COMBOS, ids=ADAM_IDS)
def test_adam_simd_scalar_and_reference_bit_identical(
    n: int, gfmt: HalfFormat, pfmt: HalfFormat, sfmt: StateFormat, hyper: AdamHyper
) -> None:
    inp = make_inputs(n, gfmt, sfmt, seed=n)
    s = k.adam_scalars(hyper, step=7, grad_scale=0.75)
    with kernel_path("scalar"):
        scalar = run_adam(inp, gfmt, pfmt, sfmt, s)
    assert_bits_equal(scalar, ref_adam(inp, gfmt, pfmt, sfmt, s))
    for path in SIMD_PATHS:
        with kernel_path(path):
            simd = run_adam(inp, gfmt, pfmt, sfmt, s)
        assert_bits_equal(simd, scalar, path)


@needs_simd
@pytest.mark.parametrize(("gfmt", "pfmt", "sfmt", "hyper"), ADAM_COMBOS, ids=ADAM_IDS)
def test_adam_every_tail_and_misaligned_start_simd_equals_scalar(
    gfmt: HalfFormat, pfmt: HalfFormat, sfmt: StateFormat, hyper: AdamHyper
) -> None:
    """Every tail length (0..31 past a multiple of 8/16 lanes) and every start offset.

    The SIMD paths peel elements until master_out is aligned (for n >= 128), so
    starts 0..16 elements past an aligned address, and arrays whose roles are
    misaligned differently from each other, exercise every peel length.
    """
    s = k.adam_scalars(hyper, step=5, grad_scale=1.5)
    big = special_inputs(2048, gfmt, sfmt)  # specials too, so NaN handling is covered in peels and tails
    cases = [(0, n, 0) for n in range(1, 72)]
    cases += [(off, n, 0) for off in range(17) for n in (128, 129, 143, 160, 301)]
    cases += [(off, 200 + off, 3) for off in range(0, 17, 3)]  # outputs shifted against inputs
    for off, n, shift in cases:
        inp = {key: arr[off : off + n] for key, arr in big.items()}
        expected: dict[str, np.ndarray] | None = None
        for path in ("scalar", *SIMD_PATHS):
            with kernel_path(path):
                out = run_adam(inp, gfmt, pfmt, sfmt, s, shift=shift)
            if expected is None:
                expected = out
            else:
                assert_bits_equal(out, expected, f"{path} off={off} n={n} shift={shift}")


def special_inputs(n: int, gfmt: HalfFormat, sfmt: StateFormat) -> dict[str, np.ndarray]:
    """Inputs sprinkled with inf/NaN/zero/-0/huge/subnormal values in every role."""
    inp = make_inputs(n, gfmt, sfmt, seed=99)
    rng = np.random.default_rng(5)
    half_specials = (
        [0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE37, 0x0000, 0x8000, 0x0001, 0x7BFF]
        if gfmt == HalfFormat.FP16
        else [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC5, 0x0000, 0x8000, 0x0001, 0x7F7F]
    )
    f32_specials = np.array([np.inf, -np.inf, np.nan, -np.nan, 0.0, -0.0, 3e38, 1e-40, -1e-45], np.float32)
    f32_specials = np.concatenate([f32_specials, np.array([0x7F800123, 0xFFC00042], np.uint32).view(np.float32)])
    for key in ("grad", "master", "m", "v"):
        idx = rng.choice(n, size=n // 4, replace=False)
        if inp[key].dtype == np.uint16:
            pool = half_specials if key == "grad" else ref_f32_to_bf16(f32_specials)
            inp[key][idx] = rng.choice(np.asarray(pool, np.uint16), size=idx.size)
        else:
            inp[key][idx] = rng.choice(f32_specials, size=idx.size)
    return inp


@needs_simd
@pytest.mark.parametrize(("gfmt", "pfmt", "sfmt", "hyper"), ADAM_COMBOS, ids=ADAM_IDS)
def test_adam_special_values_simd_equals_scalar(
    gfmt: HalfFormat, pfmt: HalfFormat, sfmt: StateFormat, hyper: AdamHyper
) -> None:
    inp = special_inputs(1003, gfmt, sfmt)
    s = k.adam_scalars(hyper, step=1)
    with kernel_path("scalar"):
        scalar = run_adam(inp, gfmt, pfmt, sfmt, s)
    for path in SIMD_PATHS:
        with kernel_path(path):
            simd = run_adam(inp, gfmt, pfmt, sfmt, s)
        assert_bits_equal(simd, scalar, path)
    # NaN outputs are canonical, which is what makes the paths agree on them.
    nan = np.isnan(scalar["master"])
    assert nan.any()
    assert np.all(scalar["master"][nan].view(np.uint32) == 0x7FC00000)


@pytest.mark.parametrize("path", path_params())
def test_adam_in_place_equals_out_of_place(path: str) -> None:
    n = 4099
    for sfmt in ELEMENTWISE_STATE:
        inp = make_inputs(n, HalfFormat.FP16, sfmt, seed=3)
        s = k.adam_scalars(HYPER_W, step=3)
        with kernel_path(path):
            expected = run_adam(inp, HalfFormat.FP16, HalfFormat.BF16, sfmt, s)
            master, m, v = inp["master"].copy(), inp["m"].copy(), inp["v"].copy()
            param = np.empty(n, np.uint16)
            k.adam_step(
                inp["grad"], master, m, v, master, m, v, param,
                grad_format=HalfFormat.FP16, param_format=HalfFormat.BF16, state_format=sfmt, scalars=s,
            )  # fmt: skip
        assert_bits_equal({"master": master, "m": m, "v": v, "param": param}, expected)


def test_grad_scale_equals_prescaled_grads() -> None:
    n = 5000
    rng = np.random.default_rng(11)
    # Magnitudes keep halving exact in fp16 (no subnormal results).
    mags = np.exp2(rng.uniform(-10, 4, n)) * rng.choice([-1.0, 1.0], n)
    g = mags.astype(np.float16)
    inp = make_inputs(n, HalfFormat.FP16, StateFormat.FP32, seed=4)
    inp_scaled = dict(inp, grad=g.view(np.uint16))
    inp_halved = dict(inp, grad=(g * np.float16(0.5)).view(np.uint16))
    scaled = run_adam(inp_scaled, HalfFormat.FP16, HalfFormat.FP16, StateFormat.FP32, k.adam_scalars(HYPER_W, 2, 0.5))
    halved = run_adam(inp_halved, HalfFormat.FP16, HalfFormat.FP16, StateFormat.FP32, k.adam_scalars(HYPER_W, 2))
    assert_bits_equal(scaled, halved)


@pytest.mark.parametrize("hyper", [HYPER_W, HYPER_L2], ids=["AdamW", "Adam-L2"])
def test_adam_tracks_torch(hyper: AdamHyper) -> None:
    torch = pytest.importorskip("torch")
    n, steps = 10_000, 20
    rng = np.random.default_rng(2024)
    master = rng.standard_normal(n).astype(np.float32)
    m = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    param = np.empty(n, np.uint16)
    tparam = torch.nn.Parameter(torch.from_numpy(master.copy()))
    cls = torch.optim.AdamW if hyper.mode == "adamw" else torch.optim.Adam
    opt = cls(
        [tparam], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
        weight_decay=hyper.weight_decay, foreach=False,
    )  # fmt: skip
    for step in range(1, steps + 1):
        g16 = (rng.standard_normal(n) * 0.05).astype(np.float16)
        tparam.grad = torch.from_numpy(g16.astype(np.float32))
        opt.step()
        k.adam_step(
            g16, master, m, v, master, m, v, param,
            grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16, state_format=StateFormat.FP32,
            scalars=k.adam_scalars(hyper, step),
        )  # fmt: skip
    expected = tparam.detach().numpy()
    diff = np.max(np.abs(master.astype(np.float64) - expected))
    assert diff <= 1e-6 * np.max(np.abs(expected)), diff
    assert np.array_equal(param, master.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("hyper", [HYPER_W, HYPER_L2], ids=["AdamW", "Adam-L2"])
@pytest.mark.parametrize("gfmt", [HalfFormat.FP16, HalfFormat.BF16], ids=["fp16", "bf16"])
def test_adam_is_bit_identical_to_torch_fused(hyper: AdamHyper, gfmt: HalfFormat, path: str) -> None:
    """Same operation order and fusing as torch.optim.AdamW/Adam(fused=True) on the CPU.

    A length that is a multiple of ATen's vector width keeps torch's scalar tail loop
    (computed without FMA) out of the comparison.
    """
    torch = pytest.importorskip("torch")
    n, steps = 1 << 16, 20
    rng = np.random.default_rng(7)
    master = rng.standard_normal(n).astype(np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    param = np.empty(n, np.uint16)
    tparam = torch.nn.Parameter(torch.from_numpy(master.copy()))
    cls = torch.optim.AdamW if hyper.mode == "adamw" else torch.optim.Adam
    opt = cls([tparam], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
              weight_decay=hyper.weight_decay, fused=True)
    half = torch.float16 if gfmt == HalfFormat.FP16 else torch.bfloat16
    for step in range(1, steps + 1):
        grad = torch.from_numpy((rng.standard_normal(n) * 0.05).astype(np.float32)).to(half)
        tparam.grad = grad.to(torch.float32)
        opt.step()
        with kernel_path(path):
            k.adam_step(
                grad.view(torch.int16).numpy().view(np.uint16), master, m, v, master, m, v, param,
                grad_format=gfmt, param_format=HalfFormat.FP16, state_format=StateFormat.FP32,
                scalars=k.adam_scalars(hyper, step),
            )  # fmt: skip
    state = opt.state[tparam]
    for name, mine, theirs in (("master", master, tparam.detach().numpy()),
                               ("exp_avg", m, state["exp_avg"].numpy()),
                               ("exp_avg_sq", v, state["exp_avg_sq"].numpy())):
        differ = int(np.count_nonzero(mine.view(np.uint32) != theirs.view(np.uint32)))
        assert differ == 0, f"{name}: {differ} of {n} elements differ from torch fused"


def test_threads_on_disjoint_halves_match_one_call() -> None:
    n = 2**21 + 5
    half = n // 2
    inp = make_inputs(n, HalfFormat.BF16, StateFormat.FP32, seed=8)
    s = k.adam_scalars(HYPER_L2, step=4)
    expected = run_adam(inp, HalfFormat.BF16, HalfFormat.FP16, StateFormat.FP32, s)
    out = {key: np.empty_like(expected[key]) for key in expected}
    errors: list[BaseException] = []

    def work(sl: slice) -> None:
        try:
            k.adam_step(
                inp["grad"][sl], inp["master"][sl], inp["m"][sl], inp["v"][sl],
                out["master"][sl], out["m"][sl], out["v"][sl], out["param"][sl],
                grad_format=HalfFormat.BF16, param_format=HalfFormat.FP16, state_format=StateFormat.FP32,
                scalars=s,
            )  # fmt: skip
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(sl,)) for sl in (slice(0, half), slice(half, n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert_bits_equal(out, expected)


# ---------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------

ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize("path", path_params())
def test_every_fp16_pattern_roundtrips(path: str) -> None:
    with kernel_path(path):
        widened = np.empty(65536, np.float32)
        k.param_to_master(ALL16, widened, HalfFormat.FP16)
        back = np.empty(65536, np.uint16)
        k.master_to_param(widened, back, HalfFormat.FP16)
    ref = ALL16.view(np.float16).astype(np.float32)
    is_nan = (ALL16 & 0x7C00) == 0x7C00
    is_nan &= (ALL16 & 0x3FF) != 0
    # Exact widening (incl. subnormals, +-0, +-inf); NaNs keep payload and become quiet.
    assert np.array_equal(widened.view(np.uint32)[~is_nan], ref.view(np.uint32)[~is_nan])
    assert np.all(np.isnan(widened[is_nan]))
    assert np.all(widened.view(np.uint32)[is_nan] & 0x00400000)
    assert np.array_equal(back[~is_nan], ALL16[~is_nan])
    assert np.array_equal(back[is_nan], ALL16[is_nan] | 0x0200)


@pytest.mark.parametrize("path", path_params())
def test_every_bf16_pattern_roundtrips(path: str) -> None:
    with kernel_path(path):
        widened = np.empty(65536, np.float32)
        k.param_to_master(ALL16, widened, HalfFormat.BF16)
        back = np.empty(65536, np.uint16)
        k.master_to_param(widened, back, HalfFormat.BF16)
    assert np.array_equal(widened.view(np.uint32), ALL16.astype(np.uint32) << 16)
    is_nan = np.isnan(widened)
    assert np.array_equal(back[~is_nan], ALL16[~is_nan])
    assert np.array_equal(back[is_nan], ALL16[is_nan] | 0x0040)


def edge_f32() -> np.ndarray:
    """Values that exercise every rounding branch of F32->FP16/BF16."""
    vals = [
        0.0, -0.0, 1.0, -1.0, 65504.0, 65519.996, 65520.0, 65536.0, -65520.0, 1e38, 3.4028235e38,
        np.inf, -np.inf, np.nan, 2.0**-14, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-26, 1.5 * 2.0**-24,
        2.5 * 2.0**-24, 2.0**-14 - 2.0**-25, 2.0**-14 - 2.0**-26, 1 + 2.0**-11, 1 + 3 * 2.0**-11,
        1 + 2.0**-8, 1 + 3 * 2.0**-8, 1e-40, 1e-45, 0.1, 1 / 3,
    ]  # fmt: skip
    bits = [0x7F800001, 0x7FC00000, 0xFFFFFFFF, 0x7FBFFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x477FF000,
            0x477FEFFF, 0x7F7FFFFF, 0x387FE000, 0x387FF000, 0x00000001]  # fmt: skip
    edge = np.concatenate([np.array(vals, np.float32), np.array(bits, np.uint32).view(np.float32)])
    return np.concatenate([edge, -edge])


def random_f32(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    scaled = (rng.standard_normal(n) * np.exp2(rng.uniform(-30, 20, n))).astype(np.float32)
    return np.concatenate([raw, scaled, edge_f32()])


@pytest.mark.parametrize("path", path_params())
def test_f32_to_fp16_matches_numpy(path: str) -> None:
    x = random_f32(300_000, seed=1)
    out = np.empty(x.size, np.uint16)
    with kernel_path(path):
        k.master_to_param(x, out, HalfFormat.FP16)
    nan = np.isnan(x)
    assert np.array_equal(out[~nan], ref_f32_to_half(x, HalfFormat.FP16)[~nan])
    # NaN stays a quiet NaN (numpy does not promise a payload, so only the class is compared).
    assert np.all((out[nan] & 0x7E00) == 0x7E00)


@pytest.mark.parametrize("path", path_params())
def test_f32_to_bf16_matches_torch(path: str) -> None:
    torch = pytest.importorskip("torch")
    x = random_f32(300_000, seed=2)
    out = np.empty(x.size, np.uint16)
    with kernel_path(path):
        k.master_to_param(x, out, HalfFormat.BF16)
    expected = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)
    assert np.array_equal(out[~nan], expected[~nan])
    # torch canonicalises NaN differently in its scalar and vector paths; we keep sign+payload, quiet.
    assert np.all((out[nan] & 0x7FC0) == 0x7FC0)
    assert np.array_equal(out[nan], ((x[nan].view(np.uint32) >> 16) | 0x40).astype(np.uint16))


@needs_simd
@pytest.mark.parametrize("fmt", list(HalfFormat))
@pytest.mark.parametrize("n", [*SIZES, 16, 31, 32, 33, 1000])
def test_master_to_param_simd_equals_scalar(n: int, fmt: HalfFormat) -> None:
    x = random_f32(n, seed=n)[:n]
    outs = []
    for path in ("scalar", *SIMD_PATHS):
        out = np.empty(n, np.uint16)
        widened = np.empty(n, np.float32)
        with kernel_path(path):
            k.master_to_param(x, out, fmt)
            k.param_to_master(out, widened, fmt)
        outs.append((path, out, widened))
    for path, out, widened in outs[1:]:
        assert np.array_equal(out, outs[0][1]), path
        assert np.array_equal(widened.view(np.uint32), outs[0][2].view(np.uint32)), path


# ---------------------------------------------------------------------------
# count_nonfinite
# ---------------------------------------------------------------------------

NONFINITE = {
    HalfFormat.FP16: ([0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFFFF], [0x7BFF, 0xFBFF, 0x3C00, 0x0001]),
    HalfFormat.BF16: ([0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF], [0x7F7F, 0xFF7F, 0x3F80, 0x0001]),
}


@pytest.mark.parametrize("fmt", list(HalfFormat))
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 2**20 + 3])
@pytest.mark.parametrize("path", path_params())
def test_count_nonfinite(path: str, n: int, fmt: HalfFormat) -> None:
    bad, near_misses = NONFINITE[fmt]
    rng = np.random.default_rng(n)
    data = rng.choice(np.array(near_misses, np.uint16), size=n)
    positions = {0, n - 1, n // 2, max(0, n - 3)} | set(rng.integers(0, n, 5).tolist())
    positions |= set(range(max(0, n - n % 32), n))  # the whole SIMD tail (16 lanes AVX2, 32 AVX-512)
    for i in positions:
        data[i] = bad[i % len(bad)]
    with kernel_path(path):
        assert k.count_nonfinite(data, fmt) == len(positions)
        assert k.count_nonfinite(data[:0], fmt) == 0


@pytest.mark.parametrize("path", path_params())
def test_count_nonfinite_all_bad_exceeds_16bit_lane_counters(path: str) -> None:
    n = 32 * 32768 * 2 + 21  # more hits per lane than a uint16 counter holds (16 lanes AVX2, 32 AVX-512)
    data = np.full(n, 0x7C00, np.uint16)
    with kernel_path(path):
        assert k.count_nonfinite(data, HalfFormat.FP16) == n
        assert k.count_nonfinite(data.view(np.float16), HalfFormat.FP16) == n


# ---------------------------------------------------------------------------
# CRC32C
# ---------------------------------------------------------------------------


def test_crc32c_known_vectors() -> None:
    assert k.crc32c(b"123456789") == 0xE3069283
    assert k.crc32c(b"") == 0
    # RFC 3720 (iSCSI) appendix B.4 vectors.
    assert k.crc32c(bytes(32)) == 0x8A9136AA
    assert k.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert k.crc32c(bytes(range(32))) == 0x46DD794E
    assert k.crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283
    assert k.crc32c(memoryview(b"xx123456789")[2:]) == 0xE3069283
    assert k.crc32c(np.arange(4, dtype=np.uint32)) == k.crc32c(np.arange(4, dtype=np.uint32).tobytes())


def test_crc32c_chaining() -> None:
    data = np.random.default_rng(0).integers(0, 256, 200, dtype=np.uint8).tobytes()
    whole = k.crc32c(data)
    for split in range(len(data) + 1):
        assert k.crc32c(data[split:], k.crc32c(data[:split])) == whole


@pytest.mark.parametrize("length, block", [(0, 4), (1, 4), (4, 4), (4097, 4096), ((1 << 20) + 3, 1 << 18)])
def test_crc32c_blocks_is_each_pieces_own_crc(length: int, block: int) -> None:
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
    expected = [k.crc32c(data[at : at + block]) for at in range(0, length, block)]
    crcs = k.crc32c_blocks(data, block)
    assert crcs.dtype == np.uint32 and crcs.tolist() == expected


def test_crc32c_blocks_refuses_bad_arguments() -> None:
    with pytest.raises(k.KernelArgumentError):
        k.crc32c_blocks(b"abc", 0)
    with pytest.raises(k.KernelArgumentError):
        k.crc32c_blocks(np.zeros((4, 4), np.uint8)[:, ::2], 2)
    with pytest.raises(k.KernelArgumentError):
        k.crc32c_blocks(object(), 2)


def test_crc32c_simd_equals_table() -> None:
    rng = np.random.default_rng(1)
    blob = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    # 12288 = 3 x 4096: the interleaved three-stream path starts there.
    lengths = [0, 1, 7, 8, 9, 63, 64, 65, 12287, 12288, 12289, 3 * 12288 + 5, 1 << 20] + \
        rng.integers(0, 5000, 50).tolist() + rng.integers(12288, 100_000, 20).tolist()
    for length in lengths:
        offset = int(rng.integers(0, 16)) if length < (1 << 20) else 0  # unaligned starts too
        chunk = blob[offset : offset + length]
        buf = k._ffi.from_buffer(chunk)
        seed = int(rng.integers(0, 2**32))
        table = k._lib.cossd_crc32c_scalar(seed, buf, chunk.size)
        assert k._lib.cossd_crc32c_sse42(seed, buf, chunk.size) == table
    with kernel_path("scalar"):
        scalar = k.crc32c(blob)
    for path in SIMD_PATHS:
        with kernel_path(path):
            assert k.crc32c(blob) == scalar


def test_crc32c_every_path_equals_table_at_fold_boundaries() -> None:
    """The carry-less-multiply path (AVX-512 level with VPCLMULQDQ) folds 256 bytes a round,
    then 64; the crc32 path interleaves 3 x 4096 bytes: every boundary of both, every start."""
    rng = np.random.default_rng(2)
    blob = rng.integers(0, 256, 1 << 18, dtype=np.uint8)
    lengths = [255, 256, 257, 263, 319, 320, 321, 383, 384, 448, 511, 512, 513, 575, 1023, 1024,
               4095, 4096, 12288, 65536 + 17] + rng.integers(256, 20_000, 60).tolist()
    for path in PATHS:
        with kernel_path(path):
            for length in lengths:
                offset = int(rng.integers(0, 64))
                chunk = blob[offset : offset + length]
                seed = int(rng.integers(0, 2**32))
                table = k._lib.cossd_crc32c_scalar(seed, k._ffi.from_buffer(chunk), chunk.size)
                assert k.crc32c(chunk, seed) == table, (path, length, offset)


def test_crc32c_fold_path_is_used_where_the_cpu_has_it() -> None:
    assert k._lib.cossd_crc_fold_available() in (0, 1)
    if "avx512" in PATHS and k._lib.cossd_crc_fold_available():
        with kernel_path("avx512"):
            assert k.crc32c(bytes(range(256)) * 4) == k._lib.cossd_crc32c_scalar(0, bytes(range(256)) * 4, 1024)


def test_crc32c_combine() -> None:
    rng = np.random.default_rng(3)
    for _ in range(200):
        a = rng.bytes(int(rng.integers(0, 3000)))
        b = rng.bytes(int(rng.integers(0, 3000)))
        assert k.crc32c_combine(k.crc32c(a), k.crc32c(b), len(b)) == k.crc32c(a + b)
    big = 3 << 40  # lengths past 32 bits: the shift is computed, not looped
    assert 0 <= k.crc32c_combine(0x12345678, 0, big) < 2**32
    for bad in ((-1, 0, 0), (0, 2**32, 0), (0, 0, -5), (0, 0, 2**64), (True, 0, 0), (0.5, 0, 0)):
        with pytest.raises(KernelArgumentError):
            k.crc32c_combine(*bad)


def _aligned_empty(n: int, dtype: np.dtype, shift: int) -> np.ndarray:
    """n items of dtype starting `shift` items past a 64-byte boundary."""
    raw = np.empty(n * dtype.itemsize + 64 + shift * dtype.itemsize + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + shift * dtype.itemsize
    return raw[start : start + n * dtype.itemsize].view(dtype)


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize(("gfmt", "pfmt", "sfmt", "hyper"), ADAM_COMBOS, ids=ADAM_IDS)
@pytest.mark.parametrize("n", [1, 9, 16, 31, 1023, 1024, 1025, 3 * 1024 + 77, 2**18 + 3])
def test_adam_step_crc_equals_step_then_checksum(
    path: str, gfmt: HalfFormat, pfmt: HalfFormat, sfmt: StateFormat, hyper: AdamHyper, n: int
) -> None:
    """The device's one-pass block update: the same bits as adam_step, and the checksum the
    device stores (master, exp_avg, exp_avg_sq, param in that order), outputs aligned or not."""
    inp = make_inputs(n, gfmt, sfmt, seed=n)
    scalars = k.adam_scalars(hyper, step=5, grad_scale=0.5)
    kw = dict(grad_format=gfmt, param_format=pfmt, state_format=sfmt, scalars=scalars)
    with kernel_path(path):
        expected = run_adam(inp, gfmt, pfmt, sfmt, scalars)
        # Outputs `shift` elements past a 64-byte boundary (all alike: a peel, then streaming
        # stores), or scattered (no streaming); numpy's own placement once more.
        # "master off": only master_out off its boundary, which a call too short to peel
        # (under 128 elements) must not write with streaming stores (they fault unaligned).
        placements = [("aligned", shift) for shift in (0, 1, 7, 15)] + [("scattered", 0), ("numpy", 0),
                                                                         ("master off", 1), ("master off", 3)]
        for placement, shift in placements:
            if placement == "aligned":
                out = {name: _aligned_empty(n, array.dtype, shift) for name, array in expected.items()}
            elif placement == "master off":
                out = {name: _aligned_empty(n, array.dtype, shift if name == "master" else 0)
                       for name, array in expected.items()}
            elif placement == "scattered":
                out = {name: _aligned_empty(n, array.dtype, index * 3 + 1)
                       for index, (name, array) in enumerate(expected.items())}
            else:
                out = {name: np.empty(n, array.dtype) for name, array in expected.items()}
            crc = k.adam_step_crc(inp["grad"], inp["master"], inp["m"], inp["v"],
                                  out["master"], out["m"], out["v"], out["param"], **kw)
            assert_bits_equal(expected, out, f"{placement} {shift}")
            chained = 0
            for name in ("master", "m", "v", "param"):
                chained = k.crc32c(expected[name], chained)
            assert crc == chained


def test_adam_step_crc_refuses_overlap_and_bad_arguments() -> None:
    inp = make_inputs(64, HalfFormat.FP16, StateFormat.FP32, seed=1)
    scalars = k.adam_scalars(HYPER_W, step=1)
    kw = dict(grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16, state_format=StateFormat.FP32,
              scalars=scalars)
    out = [np.empty(64, np.float32), np.empty(64, np.float32), np.empty(64, np.float32), np.empty(64, np.uint16)]
    before = {name: array.copy() for name, array in inp.items()}
    with pytest.raises(KernelArgumentError):  # in place: the outputs are written while read
        k.adam_step_crc(inp["grad"], inp["master"], inp["m"], inp["v"], inp["master"], *out[1:], **kw)
    with pytest.raises(KernelArgumentError):
        k.adam_step_crc(inp["grad"], inp["master"], inp["m"], inp["v"], *out[:3], out[3][:10], **kw)
    with pytest.raises(KernelArgumentError):
        k.adam_step_crc(inp["grad"], inp["master"], inp["m"], inp["v"], *out, **{**kw, "scalars": None})
    for name, array in inp.items():
        assert np.array_equal(array.view(np.uint8), before[name].view(np.uint8)), name
    empty = [np.empty(0, a.dtype) for a in out]
    assert k.adam_step_crc(np.empty(0, np.uint16), np.empty(0, np.float32), np.empty(0, np.float32),
                           np.empty(0, np.float32), *empty, **kw) == 0


@pytest.mark.parametrize("kernel", ["__call__", "lent"])
@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize(("gfmt", "pfmt", "sfmt", "hyper"), ADAM_COMBOS, ids=ADAM_IDS)
def test_block_update_equals_adam_step_crc_on_each_range(
    path: str, gfmt: HalfFormat, pfmt: HalfFormat, sfmt: StateFormat, hyper: AdamHyper, kernel: str
) -> None:
    """The device's checked-once call, and its call for lent memory: ranges at any start and
    length (a block, a tail, one element) give adam_step_crc's bits and checksum, and only
    their own elements change; a param copy, aligned or not, receives exactly the params."""
    n = 3 * 4096 + 77
    inp = make_inputs(n, gfmt, sfmt, seed=3)
    scalars = k.adam_scalars(hyper, step=4, grad_scale=2.0)
    kw = dict(grad_format=gfmt, param_format=pfmt, state_format=sfmt)
    with kernel_path(path):
        expected = {name: np.zeros(n, a.dtype) for name, a in run_adam(inp, gfmt, pfmt, sfmt, scalars).items()}
        out = {name: np.zeros(n, array.dtype) for name, array in expected.items()}
        update = k.BlockUpdate(inp["master"], inp["m"], inp["v"], out["master"], out["m"], out["v"], out["param"],
                               **kw)
        assert update.n == n
        for shift, (start, stop) in enumerate(((0, 4096), (4096, 4097), (5000, 3 * 4096 + 77), (4097, 5000))):
            s = slice(start, stop)
            copy = _aligned_empty(stop - start + 2, np.dtype(np.uint16), 3 * shift)
            copy[:] = 0xABCD
            result = getattr(update, kernel)(inp["grad"][s], start, scalars,
                                             param_copy=copy[1:-1] if shift % 2 else None)
            crc, nonfinite, param_crc = result[:3]
            if kernel == "lent" and not nonfinite:  # and how many elements it stepped
                assert result[3] == stop - start
            assert nonfinite == k.count_nonfinite(inp["grad"][s], gfmt)
            wanted = k.adam_step_crcs(inp["grad"][s], inp["master"][s], inp["m"][s], inp["v"][s],
                                      expected["master"][s], expected["m"][s], expected["v"][s],
                                      expected["param"][s], scalars=scalars, **kw)
            assert (crc, param_crc) == wanted
            assert param_crc == k.crc32c(out["param"][s])  # the params' bytes alone
            assert_bits_equal(expected, out, f"{start}..{stop}")
            if shift % 2:  # the copy, and not a byte around it
                assert np.array_equal(copy[1:-1], expected["param"][s]) and copy[0] == copy[-1] == 0xABCD
            else:
                assert (copy == 0xABCD).all()
        assert update(np.empty(0, np.uint16), n, scalars) == (0, 0, 0)


@pytest.mark.parametrize("kernel", ["__call__", "lent"])
@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("n", [1, 15, 16, 200, 4096, 2**18 + 3])
def test_block_update_param_copy_at_every_alignment(path: str, n: int, kernel: str) -> None:
    """Peel, vector body and tail all reach the copy, streamed where it is aligned or not."""
    inp = make_inputs(n, HalfFormat.FP16, StateFormat.FP32, seed=n)
    scalars = k.adam_scalars(HYPER_W, step=2)
    kw = dict(grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16, state_format=StateFormat.FP32)
    with kernel_path(path):
        for shift in (0, 1, 9, 16):
            out = [_aligned_empty(n, np.dtype(np.float32), shift), np.empty(n, np.float32), np.empty(n, np.float32),
                   _aligned_empty(n, np.dtype(np.uint16), shift)]
            update = k.BlockUpdate(inp["master"], inp["m"], inp["v"], *out, **kw)
            copy = _aligned_empty(n, np.dtype(np.uint16), (shift * 7) % 32)
            getattr(update, kernel)(inp["grad"], 0, scalars, param_copy=copy)
            assert np.array_equal(copy, out[3]), (shift, n)


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("gfmt", [HalfFormat.FP16, HalfFormat.BF16])
@pytest.mark.parametrize("n", [1, 15, 17, 1000, 4096 + 5])
def test_block_update_counts_nonfinite_gradient_elements(path: str, gfmt: HalfFormat, n: int) -> None:
    """Every inf and NaN pattern, in the peel, the vector body and the tail, at any alignment."""
    rng = np.random.default_rng(n)
    specials = (special_inputs(64, gfmt, StateFormat.FP32)["grad"])
    exp = 0x7F80 if gfmt == HalfFormat.BF16 else 0x7C00
    kw = dict(grad_format=gfmt, param_format=HalfFormat.FP16, state_format=StateFormat.FP32)
    with kernel_path(path):
        for shift in (0, 3):
            inp = make_inputs(n + shift, gfmt, StateFormat.FP32, seed=n)
            grad = inp["grad"][shift:].copy()
            spots = rng.choice(n, size=min(n, 9), replace=False)
            grad[spots] = rng.choice(specials, size=len(spots))
            grad[spots[:1]] = exp | 1  # a NaN for certain
            out = [np.empty(n, np.float32) for _ in range(3)] + [np.empty(n, np.uint16)]
            update = k.BlockUpdate(inp["master"][shift:], inp["m"][shift:], inp["v"][shift:], *out, **kw)
            _, counted, _ = update(grad, 0, k.adam_scalars(HYPER_W, 1))
            assert counted == k.count_nonfinite(grad, gfmt) == int(((grad & exp) == exp).sum()) >= 1


def test_block_update_refuses_bad_ranges_and_overlap() -> None:
    n = 256
    inp = make_inputs(n, HalfFormat.FP16, StateFormat.FP32, seed=2)
    out = [np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.uint16)]
    kw = dict(grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16, state_format=StateFormat.FP32)
    scalars = k.adam_scalars(HYPER_W, step=1)
    with pytest.raises(KernelArgumentError):  # in place is not out of place
        k.BlockUpdate(inp["master"], inp["m"], inp["v"], inp["master"], *out[1:], **kw)
    with pytest.raises(KernelArgumentError):  # lengths differ
        k.BlockUpdate(inp["master"], inp["m"], inp["v"], *out[:3], out[3][:10], **kw)
    update = k.BlockUpdate(inp["master"], inp["m"], inp["v"], *out, **kw)
    before = [array.copy() for array in out]
    for grad, start in ((inp["grad"][:16], n - 15), (inp["grad"][:16], -1), (inp["grad"][:16], True),
                        (inp["grad"][:16], 2.0), (np.zeros(16, np.float32), 0), (inp["grad"][::2], 0),
                        (out[3][:16], 0)):  # the last: the gradient is an output's memory
        with pytest.raises(KernelArgumentError):
            update(grad, start, scalars)
    with pytest.raises(KernelArgumentError):
        update(inp["grad"][:16], 0, None)
    for copy in (np.zeros(15, np.uint16), out[3][:16], inp["grad"][:16], np.zeros(16, np.float32)):
        with pytest.raises(KernelArgumentError):  # short, a state array, the gradient, not 16-bit
            update(inp["grad"][:16], 0, scalars, param_copy=copy)
    assert all(np.array_equal(a, b) for a, b in zip(out, before))


# ---------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------


def adam_args(n: int = 64) -> dict[str, Any]:
    return {
        "grad": np.zeros(n, np.float16),
        "master_in": np.zeros(n, np.float32),
        "exp_avg_in": np.zeros(n, np.float32),
        "exp_avg_sq_in": np.zeros(n, np.float32),
        "master_out": np.zeros(n, np.float32),
        "exp_avg_out": np.zeros(n, np.float32),
        "exp_avg_sq_out": np.zeros(n, np.float32),
        "param_out": np.zeros(n, np.uint16),
        "grad_format": HalfFormat.FP16,
        "param_format": HalfFormat.FP16,
        "state_format": StateFormat.FP32,
        "scalars": k.adam_scalars(HYPER_W, 1),
    }


def call_adam(**overrides: Any) -> None:
    args = adam_args()
    args.update(overrides)
    pos = [args.pop(name) for name in ("grad", "master_in", "exp_avg_in", "exp_avg_sq_in", "master_out",
                                       "exp_avg_out", "exp_avg_sq_out", "param_out")]  # fmt: skip
    k.adam_step(*pos, **args)


def read_only(arr: np.ndarray) -> np.ndarray:
    arr = arr.copy()
    arr.flags.writeable = False
    return arr


_shared = np.zeros(100, np.float32)

BAD_ADAM_CASES = [
    ("wrong dtype", {"master_in": np.zeros(64, np.float64)}, "master_in"),
    ("wrong dtype grad", {"grad": np.zeros(64, np.int16)}, "grad"),
    ("float16 for bf16", {"grad": np.zeros(64, np.float16), "grad_format": HalfFormat.BF16}, "grad"),
    ("bf16 state needs 2 bytes", {"state_format": StateFormat.BF16}, "exp_avg_in"),
    ("non-contiguous", {"exp_avg_in": np.zeros(128, np.float32)[::2]}, "exp_avg_in"),
    ("read-only output", {"param_out": read_only(np.zeros(64, np.uint16))}, "param_out"),
    ("length mismatch", {"exp_avg_sq_out": np.zeros(63, np.float32)}, "exp_avg_sq_out"),
    ("partial overlap in/out", {"master_in": _shared[:64], "master_out": _shared[1:65]}, "master_out"),
    ("two outputs identical", {"exp_avg_out": _shared[:64], "exp_avg_sq_out": _shared[:64]}, "exp_avg_sq_out"),
    ("output overlaps other input", {"exp_avg_in": _shared[:64], "master_out": _shared[32:96]}, "master_out"),
    ("bad grad enum", {"grad_format": 5}, "grad_format"),
    ("bad state enum", {"state_format": "fp32"}, "state_format"),
    ("wrong enum class", {"param_format": StateFormat.BF16}, "param_format"),
    ("bad scalars", {"scalars": (1.0, 2.0)}, "scalars"),
    ("not a buffer", {"master_in": [0.0] * 64}, "master_in"),
]


@pytest.mark.parametrize(("overrides", "name"), [c[1:] for c in BAD_ADAM_CASES], ids=[c[0] for c in BAD_ADAM_CASES])
def test_adam_rejects_bad_arguments(overrides: dict[str, Any], name: str) -> None:
    with pytest.raises(KernelArgumentError, match=name):
        call_adam(**overrides)


def test_adam_accepts_readonly_inputs_buffers_and_empty() -> None:
    n = 64
    grad = np.frombuffer(np.ones(n, np.float16).tobytes(), np.uint16)  # read-only
    master = memoryview(np.ones(n, np.float32).tobytes())  # read-only buffer, itemsize 1 -> raw bytes
    call_adam(grad=grad, master_in=master, exp_avg_in=bytearray(4 * n))
    call_adam(**{key: np.zeros(0, value.dtype) for key, value in adam_args(0).items() if isinstance(value, np.ndarray)})
    # Identical in/out pairs are the in-place mode and are allowed.
    buf = np.zeros(n, np.float32)
    call_adam(master_in=buf, master_out=buf)
    assert np.all(buf == 0)


def test_other_kernels_reject_bad_arguments() -> None:
    x = np.zeros(32, np.float32)
    p = np.zeros(32, np.uint16)
    with pytest.raises(KernelArgumentError, match="fmt"):
        k.count_nonfinite(p, 7)
    with pytest.raises(KernelArgumentError, match="grad"):
        k.count_nonfinite(np.zeros(32, np.float32), HalfFormat.FP16)
    with pytest.raises(KernelArgumentError, match="param_out"):
        k.master_to_param(x, read_only(p), HalfFormat.FP16)
    with pytest.raises(KernelArgumentError, match="param_out"):
        k.master_to_param(x, np.zeros(31, np.uint16), HalfFormat.FP16)
    with pytest.raises(KernelArgumentError, match="param_out"):
        k.master_to_param(x, x.view(np.uint16)[:32], HalfFormat.FP16)
    with pytest.raises(KernelArgumentError, match="master"):
        k.master_to_param(np.zeros((8, 8), np.float32)[:, :4], p, HalfFormat.FP16)
    with pytest.raises(KernelArgumentError, match="buf"):
        k.crc32c(np.zeros(8, np.uint8)[::2])
    with pytest.raises(KernelArgumentError, match="value"):
        k.crc32c(b"x", 2**32)


@pytest.mark.parametrize(
    ("field", "value"),
    [("lr", float("nan")), ("lr", -1.0), ("beta1", 1.0), ("beta2", float("inf")), ("beta2", -0.1),
     ("eps", 0.0), ("eps", float("nan")), ("weight_decay", -0.1), ("weight_decay", float("inf")),
     ("mode", 1), ("mode", "sgd")],
)  # fmt: skip
def test_hyper_rejects_bad_values(field: str, value: Any) -> None:
    args = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "mode": "adamw"}
    args[field] = value
    with pytest.raises(KernelArgumentError, match=field):
        AdamHyper(**args)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"step": 0}, "step"), ({"step": -3}, "step"), ({"step": 1.0}, "step"), ({"step": True}, "step"),
     ({"step": 1, "grad_scale": 0.0}, "grad_scale"), ({"step": 1, "grad_scale": float("inf")}, "grad_scale")],
)  # fmt: skip
def test_adam_scalars_rejects_bad_values(kwargs: dict[str, Any], name: str) -> None:
    with pytest.raises(KernelArgumentError, match=name):
        k.adam_scalars(HYPER_W, **kwargs)


def test_adam_scalars_reject_values_outside_float32() -> None:
    with pytest.raises(KernelArgumentError, match="step_size"):
        k.adam_scalars(AdamHyper(lr=1e39, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, mode="adamw"), 1)
    with pytest.raises(KernelArgumentError, match="eps"):
        k.adam_scalars(AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-50, weight_decay=0.0, mode="adamw"), 1)


def test_adam_scalars_match_torch_formulas() -> None:
    s = k.adam_scalars(HYPER_W, step=10, grad_scale=2.0)
    assert s.step_size == HYPER_W.lr / (1 - HYPER_W.beta1**10)
    assert s.bias_correction2_sqrt == (1 - HYPER_W.beta2**10) ** 0.5
    assert s.decay == 1 - HYPER_W.lr * HYPER_W.weight_decay
    assert s._c.step_size == float(np.float32(s.step_size))  # rounded to float32 by the C struct


# ---------------------------------------------------------------------------
# SIMD selection
# ---------------------------------------------------------------------------


def best_path() -> str:
    return PATHS[-1]


def test_simd_switch() -> None:
    assert PATHS[0] == "scalar" and set(PATHS) <= set(ALL_PATHS)
    assert ("avx2" in PATHS) == (k._lib.cossd_simd_available() != 0)
    assert ("avx512" in PATHS) == (k._lib.cossd_avx512_available() != 0)
    with kernel_path(False):
        assert k.simd_level() == "scalar"
        assert not k._lib.cossd_simd_active()
    with kernel_path(True):
        assert k.simd_level() == best_path()
    for path in PATHS:
        with kernel_path(path):
            assert k.simd_level() == path
    # A cap above what the CPU has runs the best path below it.
    k_before = k.simd_level()
    try:
        k.use_kernel("avx512")
        assert k.simd_level() == best_path()
        k.use_kernel("avx2")
        assert k.simd_level() == ("avx2" if SIMD else "scalar")
        k.use_simd(False)
        assert k.simd_level() == "scalar"
        k.use_simd(True)
        assert k.simd_level() == best_path()
    finally:
        k.use_kernel(k_before)
    with pytest.raises(KernelArgumentError, match="kernel"):
        k.use_kernel("sse9")


def _level_in_subprocess(env_value: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import cossd.kernels as k; print(k.simd_level())"],
        env=dict(os.environ, COSSD_KERNEL=env_value), capture_output=True, text=True, check=True,
    )  # fmt: skip


@pytest.mark.parametrize("value", ["scalar", "SCALAR", "avx2", "avx512", "auto", "simd", ""])
def test_kernel_env_var(value: str) -> None:
    """COSSD_KERNEL caps the path at import; a path the CPU lacks falls back to the best below it, with a warning."""
    requested = value.strip().lower()
    if requested in ("", "auto", "simd"):
        want = best_path()
    else:  # the best path the CPU has at or below the requested one
        want = [p for p in PATHS if ALL_PATHS.index(p) <= ALL_PATHS.index(requested)][-1]
    out = _level_in_subprocess(value)
    assert out.stdout.strip() == want
    assert ("lacks" in out.stderr) == (requested in ALL_PATHS and requested not in PATHS)


def test_kernel_env_var_unknown_warns() -> None:
    out = _level_in_subprocess("sse9")
    assert "not understood" in out.stderr
    assert out.stdout.strip() == best_path()


def test_explicit_avx512_entry_points_refuse_without_cpu_support() -> None:
    """The explicit _avx512 functions return COSSD_ERR_UNSUPPORTED (never SIGILL) where the CPU lacks AVX-512."""
    n = 40
    grad = np.zeros(n, np.uint16)
    f = np.zeros(n, np.float32)
    out16 = np.zeros(n, np.uint16)
    fb, gb, ob = (k._ffi.from_buffer(t, a) for t, a in (("float[]", f), ("uint16_t[]", grad), ("uint16_t[]", out16)))
    s = k.adam_scalars(HYPER_W, 1)._c
    rc = k._lib.cossd_adam_step_avx512(gb, 0, fb, fb, fb, fb, fb, fb, 0, ob, 0, n, s)
    m2p = k._lib.cossd_master_to_param_avx512(fb, ob, 0, n)
    p2m = k._lib.cossd_param_to_master_avx512(gb, 0, fb, n)
    count = k._lib.cossd_count_nonfinite_avx512(gb, 0, n)
    if "avx512" in PATHS:
        assert (rc, m2p, p2m, count) == (k._lib.COSSD_OK, k._lib.COSSD_OK, k._lib.COSSD_OK, 0)
    else:
        assert rc == m2p == p2m == k._lib.COSSD_ERR_UNSUPPORTED
        assert count == int(k._ffi.cast("size_t", -1))


@pytest.mark.parametrize("path", ["scalar", *SIMD_PATHS])
def test_stream_probe_moves_every_stream(path: str) -> None:
    """The roofline probe touches each of the step's streams (so its timing means something)."""
    n = 1000  # 15 runs of 64 elements, then a tail
    grad_param = np.zeros(n, np.uint16)
    master, m, v = np.zeros(n, np.float32), np.ones(n, np.float32), np.full(n, 2, np.float32)
    with kernel_path(path):
        k.stream_probe(grad_param, master, m, v)
    assert (grad_param == 1).all() and (master == 1).all() and (m == 2).all() and (v == 3).all()
    with pytest.raises(KernelArgumentError):
        k.stream_probe(grad_param[:10], master, m, v)


@pytest.mark.parametrize("path", ["scalar", *SIMD_PATHS])
def test_stream_probe_out_of_place_moves_every_stream(path: str) -> None:
    """The out-of-place probe writes every output from its input, whatever the outputs'
    alignment (streaming where aligned, one by one where not), and leaves the inputs alone."""
    n = 1000
    for start in range(0, 18):  # every alignment of the outputs, in elements
        grad = np.arange(n, dtype=np.uint16)
        master, m, v = (np.full(n, value, np.float32) for value in (0, 1, 2))
        master_out, m_out, v_out = (np.zeros(n + start, np.float32)[start:] for _ in range(3))
        param_out = np.zeros(n + start, np.uint16)[start:]
        with kernel_path(path):
            k.stream_probe_out_of_place(grad, master, m, v, master_out, m_out, v_out, param_out)
        assert (master_out == 1).all() and (m_out == 2).all() and (v_out == 3).all()
        assert (param_out == (grad ^ 1)).all() and (master == 0).all() and (m == 1).all()
    with pytest.raises(KernelArgumentError, match="same memory"):
        k.stream_probe_out_of_place(grad, master, m, v, master, m_out, v_out, param_out)
    with pytest.raises(KernelArgumentError):
        k.stream_probe_out_of_place(grad[:10], master, m, v, master_out, m_out, v_out, param_out)


def test_bench_shadow_arrays_start_on_a_page() -> None:
    """The kernel bench's out-of-place contenders write page-aligned arrays, as the device's
    mapped state regions are: streaming stores need aligned outputs."""
    from cossd.harness.bench.kernel import KernelBuffers

    buffers = KernelBuffers(4096 + 3, seed=0)
    assert all(array.ctypes.data % 4096 == 0 and array.size == 4096 + 3 for array in buffers.shadow)


# ---------------------------------------------------------------------------
# Streaming (non-temporal) stores: used on large calls, same bits as ever
# ---------------------------------------------------------------------------

STREAM_ROLE_NAMES = {"master_out": "master", "exp_avg_out": "m", "exp_avg_sq_out": "v", "param_out": "param"}


@contextlib.contextmanager
def stream_threshold(nbytes: int | None) -> Iterator[None]:
    """Set the streaming-store threshold for the block, then restore it."""
    before = k.stream_threshold()
    k.set_stream_threshold(nbytes)
    try:
        yield
    finally:
        k.set_stream_threshold(before)


def at_offset(n: int, dtype: np.dtype, lead: int) -> np.ndarray:
    """An n-element array whose data starts `lead` bytes past a 64-byte boundary."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + 128 + lead, np.uint8)
    start = (-raw.ctypes.data) % 64 + lead
    return raw[start : start + n * dtype.itemsize].view(dtype)


def stream_plan(path: str, ins: dict[str, np.ndarray], outs: dict[str, np.ndarray], sfmt: StateFormat) -> set[str]:
    """The outputs ("master", "m", "v", "param") the `path` kernel streams for these buffers."""
    plan = k.stream_plan(ins["master"], ins["m"], ins["v"], outs["master"], outs["m"], outs["v"], outs["param"],
                         state_format=sfmt, path=path)  # fmt: skip
    return {STREAM_ROLE_NAMES[role] for role in plan}


def step_into(inp: dict[str, np.ndarray], out: dict[str, np.ndarray], gfmt: HalfFormat, pfmt: HalfFormat,
              sfmt: StateFormat, s: k.AdamScalars) -> None:  # fmt: skip
    k.adam_step(
        inp["grad"], inp["master"], inp["m"], inp["v"], out["master"], out["m"], out["v"], out["param"],
        grad_format=gfmt, param_format=pfmt, state_format=sfmt, scalars=s,
    )  # fmt: skip


def placed_outputs(inp: dict[str, np.ndarray], leads: dict[str, int]) -> dict[str, np.ndarray]:
    """Fresh outputs shaped like the inputs, each `leads[role]` bytes past a 64-byte boundary."""
    n = inp["master"].size
    dtypes = {"master": np.float32, "m": inp["m"].dtype, "v": inp["v"].dtype, "param": np.uint16}
    return {role: at_offset(n, dtype, leads[role]) for role, dtype in dtypes.items()}


def test_stream_threshold_default_set_and_bad_values() -> None:
    assert k.stream_threshold() == 32 << 20
    with stream_threshold(0):
        assert k.stream_threshold() == 0
        with stream_threshold(None):
            assert k.stream_threshold() == 2**64 - 1
        assert k.stream_threshold() == 0
    for bad in (-1, 2**64, 1.5, True, "big"):
        with pytest.raises(KernelArgumentError, match="nbytes"):
            k.set_stream_threshold(bad)  # type: ignore[arg-type]
        assert k.stream_threshold() == 32 << 20


def test_stream_plan_rejects_bad_arguments() -> None:
    n = 64
    f, h = np.zeros(n, np.float32), np.zeros(n, np.uint16)
    with pytest.raises(KernelArgumentError, match="path"):
        k.stream_plan(f, f, f, f, f, f, h, state_format=StateFormat.FP32, path="sse")
    with pytest.raises(KernelArgumentError, match="param_out"):
        k.stream_plan(f, f, f, f, f, f, h[:10], state_format=StateFormat.FP32)
    with pytest.raises(KernelArgumentError, match="exp_avg_in"):
        k.stream_plan(f, h, h, f, h, h, h, state_format=StateFormat.FP32)
    with pytest.raises(KernelArgumentError, match="state_format"):
        k.stream_plan(f, f, f, f, f, f, h, state_format=7)


@pytest.mark.parametrize("path", path_params())
def test_stream_plan_follows_the_policy(path: str) -> None:
    """Only write-only outputs are streamed, only when aligned, only past the threshold; never by scalar code."""
    simd = path != "scalar"
    for sfmt in ELEMENTWISE_STATE:
        n = 4096
        inp = make_inputs(n, HalfFormat.FP16, sfmt, seed=12)
        inp = {role: placed_outputs(inp, dict.fromkeys(("master", "m", "v", "param"), 0))[role]
               if role != "grad" else arr for role, arr in inp.items()}  # fmt: skip
        aligned = placed_outputs(inp, dict.fromkeys(("master", "m", "v", "param"), 0))
        in_place = dict(inp, param=aligned["param"])
        assert stream_plan(path, inp, aligned, sfmt) == set(), "a 4096-element call is below 32 MiB"
        with stream_threshold(0):
            assert stream_plan(path, inp, aligned, sfmt) == ({"master", "m", "v", "param"} if simd else set())
            assert stream_plan(path, inp, in_place, sfmt) == ({"param"} if simd else set())
            # A lead that is not a multiple of the vector width: that output's vector stores are
            # never aligned, so it is not streamed, and
            # the kernel falls back to the largest mask it has a loop for: all, param only, none.
            odd_m = placed_outputs(inp, {"master": 0, "m": 4 if sfmt == StateFormat.FP32 else 2, "v": 0, "param": 0})
            assert stream_plan(path, inp, odd_m, sfmt) == ({"param"} if simd else set())
            odd_param = placed_outputs(inp, {"master": 0, "m": 0, "v": 0, "param": 2})
            assert stream_plan(path, inp, odd_param, sfmt) == set()
            master_in_place = dict(aligned, master=inp["master"])
            assert stream_plan(path, inp, master_in_place, sfmt) == ({"param"} if simd else set())
        with stream_threshold(n * (12 + 4 * (4 if sfmt == StateFormat.FP32 else 2))):  # exactly this footprint
            assert stream_plan(path, inp, in_place, sfmt) == ({"param"} if simd else set())
        with stream_threshold(None):
            assert stream_plan(path, inp, aligned, sfmt) == set()


@needs_simd
@pytest.mark.parametrize(("gfmt", "pfmt", "sfmt", "hyper"), ADAM_COMBOS, ids=ADAM_IDS)
def test_streaming_stores_are_bit_identical_to_scalar(
    gfmt: HalfFormat, pfmt: HalfFormat, sfmt: StateFormat, hyper: AdamHyper
) -> None:
    """Forced streaming (threshold 0) on every SIMD path: out of place, in place and mixed, with
    every alignment of the outputs against each other, peels and tails, specials included."""
    s = k.adam_scalars(hyper, step=6, grad_scale=0.5)
    big = special_inputs(4200, gfmt, sfmt)
    streamed: dict[str, set[str]] = {path: set() for path in SIMD_PATHS}
    lead_sets = [
        {"master": 0, "m": 0, "v": 0, "param": 0},
        {"master": 4, "m": 8, "v": 36, "param": 30},  # the peel of master_out lines the others up, or not
        {"master": 60, "m": 4, "v": 2 if sfmt == StateFormat.BF16 else 12, "param": 2},
    ]
    for n in (128, 165, 1007, 4111):
        inp = {key: arr[:n] for key, arr in big.items()}
        with kernel_path("scalar"):
            expected = run_adam(inp, gfmt, pfmt, sfmt, s)
        for path in SIMD_PATHS:
            with kernel_path(path), stream_threshold(0):
                for leads in lead_sets:
                    out = placed_outputs(inp, leads)
                    streamed[path] |= stream_plan(path, inp, out, sfmt)
                    step_into(inp, out, gfmt, pfmt, sfmt, s)
                    assert_bits_equal(out, expected, f"{path} n={n} leads={leads}")
                    # In place (param streamed) and mixed (master in place, moments streamed).
                    state = {role: placed_outputs(inp, leads)[role] for role in ("master", "m", "v")}
                    for role in state:
                        state[role][...] = inp[role]
                    in_place = dict(inp, **state)
                    out = dict(state, param=placed_outputs(inp, leads)["param"])
                    streamed[path] |= stream_plan(path, in_place, out, sfmt)
                    step_into(in_place, out, gfmt, pfmt, sfmt, s)
                    assert_bits_equal(out, expected, f"{path} in place n={n} leads={leads}")
                    mixed_in = dict(inp, master=out["master"])  # reuse: any master works as input
                    mixed_in["master"][...] = inp["master"]
                    mixed = placed_outputs(inp, leads)
                    mixed["master"] = mixed_in["master"]
                    step_into(mixed_in, mixed, gfmt, pfmt, sfmt, s)
                    assert_bits_equal(mixed, expected, f"{path} mixed n={n} leads={leads}")
    for path, roles in streamed.items():
        assert roles == {"master", "m", "v", "param"}, f"{path} streamed only {roles}"


@needs_simd
def test_large_call_streams_by_default_and_matches_scalar() -> None:
    """Past 32 MiB of footprint the default settings stream, in place and out of place alike."""
    n = (32 << 20) // 28 + 4099  # FP32 state: 28 bytes per element
    inp = make_inputs(n, HalfFormat.FP16, StateFormat.FP32, seed=21)
    s = k.adam_scalars(HYPER_W, step=9)
    with kernel_path("scalar"):
        expected = run_adam(inp, HalfFormat.FP16, HalfFormat.FP16, StateFormat.FP32, s)
    best = SIMD_PATHS[-1]
    with kernel_path(best):
        out = placed_outputs(inp, dict.fromkeys(("master", "m", "v", "param"), 0))
        assert stream_plan(best, inp, out, StateFormat.FP32) == {"master", "m", "v", "param"}
        step_into(inp, out, HalfFormat.FP16, HalfFormat.FP16, StateFormat.FP32, s)
        assert_bits_equal(out, expected, "out of place")
        # Streaming param_out needs it aligned to a vector of halves (16 bytes on AVX2, 32 on
        # AVX-512) where master_out is aligned: true of torch's (64-byte aligned) arrays, not
        # always of numpy's large ones. 8 bytes past is misaligned on either path (16 was
        # aligned on an AVX2-only host, which this test first met on an AMD machine).
        state = {role: at_offset(n, np.float32, 0) for role in ("master", "m", "v")}
        for role in state:
            state[role][...] = inp[role]
        in_place = dict(inp, **state)
        out = dict(state, param=at_offset(n, np.uint16, 0))
        assert stream_plan(best, in_place, out, StateFormat.FP32) == {"param"}
        assert stream_plan(best, in_place, dict(out, param=at_offset(n, np.uint16, 8)), StateFormat.FP32) == set()
        step_into(in_place, out, HalfFormat.FP16, HalfFormat.FP16, StateFormat.FP32, s)
        assert_bits_equal(out, expected, "in place")


def test_bench_kernel_buffers_are_shared_and_never_subnormal() -> None:
    """`cossd bench` runs every kernel contender on the same memory, with values that keep torch
    off the subnormal slow path even after cossd has written its params into torch's grad."""
    torch = pytest.importorskip("torch")
    from cossd.harness import bench

    n = 4096
    buffers = bench.KernelBuffers(n, seed=1)
    grad_bytes = buffers.grad.numpy()
    assert np.shares_memory(buffers.grad16, grad_bytes) and np.shares_memory(buffers.param16, grad_bytes)
    assert buffers.param16.ctypes.data == buffers.grad16.ctypes.data + 2 * n
    steps = [bench.cossd_kernel(buffers, 1), bench.torch_adamw(buffers, 1, fused=True),
             bench.roofline_probe(buffers, 1)]  # fmt: skip
    for _ in range(3):
        for step in steps:
            step()
    steps[0]()  # cossd last: the second half of torch's grad now holds the params of the masters
    assert (buffers.param16 == buffers.master.to(torch.float16).view(torch.int16).numpy().view(np.uint16)).all()
    g = buffers.grad.numpy()
    assert np.isfinite(g).all() and (np.abs(g) >= 2.0**-15).all()
    assert (buffers.master.numpy() >= 0.5).all()


def test_bench_kernel_section_alone(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """`cossd bench --sections kernel` measures only the kernels, and says what each moved."""
    pytest.importorskip("torch")
    import json

    from cossd.tools.cli import main

    out_dir = tmp_path / "b"
    code = main(["bench", "--sections", "kernel", "--elements", "65536", "--repeat", "1", "--rounds", "2",
                 "--threads", "1", "--output", str(out_dir)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    report = json.loads((out_dir / "bench.json").read_text())
    assert "file_path" not in report and report["rounds"] == 2
    row = report["kernel"][0]
    assert row["cossd_gels"] > 0 and row["torch_fused_gels"] > 0 and row["cossd_vs_fused"] > 0
    assert row["streaming_stores"] == []  # 64K elements: far below the 32 MiB threshold
    assert row["bytes_per_element"]["cossd"] == {"read": 16, "written": 14}
    assert row["bytes_per_element"]["torch_fused"] == {"read": 16, "written": 12}
    assert "through the mount" not in (out_dir / "bench.md").read_text()
    for bad in (["--sections", "kernel,disk"], ["--rounds", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["bench", *bad, "--output", str(out_dir)])
        assert exc.value.code != 0
        assert ("sections are devices, formats, frameworks, kernel, mount" if "--sections" in bad else "must be at least 1") in capsys.readouterr().err
