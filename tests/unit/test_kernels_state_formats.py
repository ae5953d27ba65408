"""Tests of the block-scaled moment formats (FP16 with a scale per block, INT8 with a dynamic map): every path bit-identical, a range test against FP32 moments, non-finite values, encode/decode, bad arguments."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import cossd.kernels as k
from cossd.kernels import AdamHyper, HalfFormat, KernelArgumentError, Moment, StateFormat
from kernel_paths import PATHS, kernel_path

SIZES = [1, 15, 17, 2**20 + 3]
BLOCK_FORMATS = (StateFormat.FP16, StateFormat.INT8)
CODE_DTYPE = {StateFormat.FP16: np.uint16, StateFormat.INT8: np.uint8}
HYPER_W = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, mode="adamw")
HYPER_L2 = AdamHyper(lr=2e-3, beta1=0.85, beta2=0.995, eps=1e-6, weight_decay=0.05, mode="adam")
HYPER_LOW_BETA1 = AdamHyper(lr=5e-3, beta1=0.3, beta2=0.9, eps=1e-7, weight_decay=0.1, mode="adamw")


def fresh_state(n: int, sfmt: StateFormat, seed: int) -> dict[str, np.ndarray]:
    """Random masters and zero-filled moments and scales (zero bytes are zero moments)."""
    rng = np.random.default_rng(seed)
    ns = k.state_scale_count(n)
    return {"master": rng.standard_normal(n).astype(np.float32), "m": np.zeros(n, CODE_DTYPE[sfmt]),
            "v": np.zeros(n, CODE_DTYPE[sfmt]), "ms": np.zeros(ns, np.float32), "vs": np.zeros(ns, np.float32),
            "param": np.zeros(n, np.uint16)}  # fmt: skip


def step(st: dict[str, np.ndarray], grad: np.ndarray, sfmt: StateFormat, scalars: k.AdamScalars,
         gfmt: HalfFormat = HalfFormat.FP16, pfmt: HalfFormat = HalfFormat.FP16) -> None:  # fmt: skip
    """One in-place step of st."""
    k.adam_step_q(grad, st["master"], st["m"], st["v"], st["master"], st["m"], st["v"], st["param"],
                  exp_avg_scale_in=st["ms"], exp_avg_sq_scale_in=st["vs"], exp_avg_scale_out=st["ms"],
                  exp_avg_sq_scale_out=st["vs"], grad_format=gfmt, param_format=pfmt, state_format=sfmt,
                  scalars=scalars)  # fmt: skip


def half_grad(g: np.ndarray, gfmt: HalfFormat) -> np.ndarray:
    if gfmt == HalfFormat.FP16:
        return g.astype(np.float16).view(np.uint16)
    return (g.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncation is fine for inputs


def grads(n: int, steps: int, seed: int, gfmt: HalfFormat = HalfFormat.FP16) -> list[np.ndarray]:
    """Gradients whose magnitudes span six decades, mixed within blocks."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-6, 0, n)
    return [half_grad(rng.standard_normal(n) * scale, gfmt) for _ in range(steps)]


def bits(st: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {key: a.view(np.uint8).copy() for key, a in st.items()}


def decoded(st: dict[str, np.ndarray], sfmt: StateFormat) -> tuple[np.ndarray, np.ndarray]:
    m = np.empty(st["master"].size, np.float32)
    v = np.empty_like(m)
    k.decode_state(st["m"], st["ms"], m, state_format=sfmt, moment=Moment.EXP_AVG)
    k.decode_state(st["v"], st["vs"], v, state_format=sfmt, moment=Moment.EXP_AVG_SQ)
    return m, v


# ---------------------------------------------------------------------------
# Every path gives the scalar path's bits
# ---------------------------------------------------------------------------

COMBOS = [(HalfFormat.FP16, HalfFormat.FP16, HYPER_W), (HalfFormat.BF16, HalfFormat.BF16, HYPER_L2),
          (HalfFormat.FP16, HalfFormat.BF16, HYPER_LOW_BETA1)]  # fmt: skip


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sfmt", BLOCK_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(("gfmt", "pfmt", "hyper"), COMBOS, ids=["fp16-adamw", "bf16-adamL2", "mixed-b1lo"])
def test_every_path_bit_identical(n: int, sfmt: StateFormat, gfmt: HalfFormat, pfmt: HalfFormat,
                                  hyper: AdamHyper) -> None:  # fmt: skip
    steps = 3 if n < 1000 else 2
    gs = grads(n, steps, seed=n, gfmt=gfmt)
    results = {}
    for path in PATHS:
        st = fresh_state(n, sfmt, seed=1)
        with kernel_path(path):
            for t, g in enumerate(gs, 1):
                step(st, g, sfmt, k.adam_scalars(hyper, t), gfmt, pfmt)
        results[path] = bits(st)
    for path in PATHS:
        for key, value in results[path].items():
            assert np.array_equal(value, results["scalar"][key]), f"{path} {key} differs from scalar"


@pytest.mark.parametrize("sfmt", BLOCK_FORMATS, ids=lambda f: f.name)
def test_in_place_equals_out_of_place(sfmt: StateFormat) -> None:
    n = 1000
    g = grads(n, 1, seed=5)[0]
    a = fresh_state(n, sfmt, seed=2)
    step(a, grads(n, 1, seed=6)[0], sfmt, k.adam_scalars(HYPER_W, 1))
    b = {key: v.copy() for key, v in a.items()}
    out = {key: np.empty_like(v) for key, v in a.items()}
    k.adam_step_q(g, b["master"], b["m"], b["v"], out["master"], out["m"], out["v"], out["param"],
                  exp_avg_scale_in=b["ms"], exp_avg_sq_scale_in=b["vs"], exp_avg_scale_out=out["ms"],
                  exp_avg_sq_scale_out=out["vs"], grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16,
                  state_format=sfmt, scalars=k.adam_scalars(HYPER_W, 2))  # fmt: skip
    step(a, g, sfmt, k.adam_scalars(HYPER_W, 2))
    for key in a:
        assert np.array_equal(a[key].view(np.uint8), out[key].view(np.uint8)), key


def test_elementwise_formats_through_adam_step_q_equal_adam_step() -> None:
    n = 300
    rng = np.random.default_rng(3)
    g = half_grad(rng.standard_normal(n) * 0.1, HalfFormat.FP16)
    master = rng.standard_normal(n).astype(np.float32)
    for sfmt, dt in ((StateFormat.FP32, np.float32), (StateFormat.BF16, np.uint16)):
        outs = []
        for fn in (k.adam_step, k.adam_step_q):
            mo, m, v, p = master.copy(), np.zeros(n, dt), np.zeros(n, dt), np.zeros(n, np.uint16)
            fn(g, mo, m, v, mo, m, v, p, grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16,
               state_format=sfmt, scalars=k.adam_scalars(HYPER_W, 1))
            outs.append((mo, m, v, p))
        for x, y in zip(*outs):
            assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


# ---------------------------------------------------------------------------
# Range test: error against FP32 moments (figures in docs/kernels.md)
# ---------------------------------------------------------------------------

RANGE_N = 1 << 16
RANGE_STEPS = 200
RANGE_HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, mode="adamw")


def range_run(sfmt: StateFormat, block_scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """RANGE_STEPS steps of N(0, 1) gradients times a per-block magnitude: (master, start, m, v)."""
    rng = np.random.default_rng(7)
    n = RANGE_N
    master = rng.standard_normal(n).astype(np.float32)
    start = master.copy()
    scale = np.repeat(block_scales, k.STATE_BLOCK)[:n]
    elementwise = sfmt in (StateFormat.FP32, StateFormat.BF16)
    dt = np.float32 if sfmt == StateFormat.FP32 else np.uint16 if sfmt == StateFormat.BF16 else CODE_DTYPE[sfmt]
    st = {"master": master, "m": np.zeros(n, dt), "v": np.zeros(n, dt), "param": np.zeros(n, np.uint16),
          "ms": np.zeros(k.state_scale_count(n), np.float32), "vs": np.zeros(k.state_scale_count(n), np.float32)}
    for t in range(1, RANGE_STEPS + 1):
        g = half_grad(rng.standard_normal(n) * scale, HalfFormat.FP16)
        step(st, g, sfmt, k.adam_scalars(RANGE_HYPER, t))
    if elementwise:
        to32 = (lambda a: a) if sfmt == StateFormat.FP32 else (lambda a: (a.astype(np.uint32) << 16).view(np.float32))
        return st["master"], start, to32(st["m"]), to32(st["v"])
    m, v = decoded(st, sfmt)
    return st["master"], start, m, v


def range_errors(sfmt: StateFormat) -> dict[str, float]:
    """Each format's error against FP32 moments on gradients whose blocks span six decades
    (1e-6..1 per block of 256, drawn log-uniformly)."""
    block_scales = 10.0 ** np.random.default_rng(3).uniform(-6, 0, RANGE_N // k.STATE_BLOCK)
    ref_master, start, ref_m, ref_v = range_run(StateFormat.FP32, block_scales)
    master, _, m, v = range_run(sfmt, block_scales)
    m_err = np.abs(m - ref_m) / np.sqrt(ref_v)  # exp_avg's error in units of the update's scale
    v_err = np.abs(v - ref_v) / ref_v
    return {"m_median": float(np.median(m_err)), "m_p99": float(np.quantile(m_err, 0.99)),
            "v_median": float(np.median(v_err)), "v_p99": float(np.quantile(v_err, 0.99)),
            "drift": float(np.linalg.norm(master - ref_master) / np.linalg.norm(ref_master - start)),
            "v_zero": int(np.count_nonzero(v == 0))}  # fmt: skip


# Bounds about twice what was measured (docs/kernels.md): BF16 for scale, then the new formats.
RANGE_BOUNDS = {StateFormat.BF16: {"m_p99": 1.5e-2, "v_p99": 7e-2, "drift": 1e-2},
                StateFormat.FP16: {"m_p99": 2e-3, "v_p99": 1e-2, "drift": 2e-3},
                StateFormat.INT8: {"m_p99": 8e-2, "v_p99": 0.12, "drift": 5e-2}}  # fmt: skip


@pytest.mark.parametrize("sfmt", [StateFormat.BF16, *BLOCK_FORMATS], ids=lambda f: f.name)
def test_range_error_against_fp32_moments(sfmt: StateFormat) -> None:
    errors = range_errors(sfmt)
    print(sfmt.name, errors)
    assert errors["v_zero"] == 0, "a positive second moment decoded to 0"
    for key, bound in RANGE_BOUNDS[sfmt].items():
        assert errors[key] < bound, f"{sfmt.name} {key} = {errors[key]:.3g}, bound {bound}"


def test_fp16_scale_keeps_small_second_moments() -> None:
    """Unscaled FP16 flushes exp_avg_sq to 0 for |g| below about 7.7e-3 at beta2 = 0.999 (its
    first step stores 1e-3 g^2): the block scale keeps it, within FP16's own rounding."""
    n = 512
    g = np.full(n, 1e-4, np.float32)
    assert np.float16((1 - 0.999) * 1e-4**2) == 0  # what unscaled FP16 would store
    st = fresh_state(n, StateFormat.FP16, seed=0)
    step(st, half_grad(g, HalfFormat.FP16), StateFormat.FP16, k.adam_scalars(HYPER_W, 1))
    _, v = decoded(st, StateFormat.FP16)
    want = np.float32(1 - 0.999) * np.float32(np.float16(1e-4)) ** 2
    assert np.all(np.abs(v - want) <= want * 2.0**-11)


def test_fp16_scale_is_the_largest_power_of_two_that_fits() -> None:
    for amax in (1e-30, 3e-8, 0.5, 1.0, 65504.0, 65505.0, 1e6, 3e38):
        x = np.array([amax, -amax / 3, 0.0], np.float32)
        codes, scales = np.empty(3, np.uint16), np.empty(1, np.float32)
        k.encode_state(x, codes, scales, state_format=StateFormat.FP16, moment=Moment.EXP_AVG)
        kexp = -int(np.log2(scales[0]))
        assert 2.0**kexp == 1 / float(scales[0])
        top = float(np.float32(amax)) * 2.0**kexp
        assert top <= 65504 and (top * 2 > 65504 or kexp == 126), (amax, kexp)
        out = np.empty(3, np.float32)
        k.decode_state(codes, scales, out, state_format=StateFormat.FP16, moment=Moment.EXP_AVG)
        # the largest element within FP16's own rounding (its 11 significant bits)
        assert abs(out[0] - np.float32(amax)) <= np.float32(amax) * 2.0**-11 or amax < 1e-29


# ---------------------------------------------------------------------------
# Non-finite values, zero state, encode/decode
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("sfmt", BLOCK_FORMATS, ids=lambda f: f.name)
def test_nonfinite_gradient(sfmt: StateFormat) -> None:
    """An inf gradient makes its master NaN, as the elementwise kernels do; in FP16 only its own
    moments are non-finite, in INT8 its block decodes to NaN. Other blocks are untouched; every
    path gives the same bits."""
    n = 3 * k.STATE_BLOCK + 5
    g = grads(n, 1, seed=9)[0]
    g[300] = 0x7C00  # +inf
    g[301] = 0x7E01  # NaN with a payload
    results = {}
    for path in PATHS:
        st = fresh_state(n, sfmt, seed=4)
        with kernel_path(path):
            step(st, g, sfmt, k.adam_scalars(HYPER_W, 1))
        results[path] = st
    for path in PATHS:
        for key in st:
            assert np.array_equal(results[path][key].view(np.uint8), results["scalar"][key].view(np.uint8))
    st = results["scalar"]
    assert np.isnan(st["master"][300]) and np.isnan(st["master"][301])
    assert st["master"][300].view(np.uint32) == 0x7FC00000
    m, v = decoded(st, sfmt)
    bad_block = slice(256, 512)
    others = np.r_[0:256, 512:n]
    assert np.all(np.isfinite(m[others])) and np.all(np.isfinite(v[others]))
    if sfmt == StateFormat.FP16:
        assert not np.isfinite(m[300]) and not np.isfinite(v[300]) and np.isnan(m[301])
        finite = np.setdiff1d(np.arange(256, 512), [300, 301])
        assert np.all(np.isfinite(m[finite]))
    else:
        assert np.isnan(st["ms"][1]) and np.isnan(st["vs"][1])
        assert np.all(np.isnan(m[bad_block]))


@pytest.mark.parametrize("sfmt", BLOCK_FORMATS, ids=lambda f: f.name)
def test_zero_bytes_are_zero_moments_and_encode_roundtrips(sfmt: StateFormat) -> None:
    n = 2 * k.STATE_BLOCK + 7
    st = fresh_state(n, sfmt, seed=0)
    m, v = decoded(st, sfmt)
    assert not m.any() and not v.any()
    for t, g in enumerate(grads(n, 4, seed=11), 1):
        step(st, g, sfmt, k.adam_scalars(HYPER_W, t))
    for moment, codes, scales in ((Moment.EXP_AVG, st["m"], st["ms"]), (Moment.EXP_AVG_SQ, st["v"], st["vs"])):
        x = np.empty(n, np.float32)
        k.decode_state(codes, scales, x, state_format=sfmt, moment=moment)
        again, again_scales = np.empty_like(codes), np.empty_like(scales)
        k.encode_state(x, again, again_scales, state_format=sfmt, moment=moment)
        assert np.array_equal(again, codes) and np.array_equal(again_scales, scales)


def test_int8_maps() -> None:
    signed, unsigned = k.state_map(Moment.EXP_AVG), k.state_map(Moment.EXP_AVG_SQ)
    for table in (signed, unsigned):
        assert table.size == 256 and np.all(np.diff(table) > 0) and table[-1] == 1.0
    assert signed[128] == 0 and signed[0] == -1.0 and unsigned[0] == 0 and unsigned[1] == np.float32(1e-7)
    # stored exp_avg bytes are int8 in the value's order: byte ^ 0x80 indexes the map
    x = np.array([-1.0, -0.5, 0.0, 0.5, 1.0], np.float32)
    codes, scales = np.empty(5, np.uint8), np.empty(1, np.float32)
    k.encode_state(x, codes, scales, state_format=StateFormat.INT8, moment=Moment.EXP_AVG)
    assert codes.view(np.int8)[2] == 0 and np.all(np.diff(codes.view(np.int8)) > 0)


def test_bytes_per_element() -> None:
    assert [k.state_bytes_per_element(f) for f in StateFormat] == [4, 2, 2 + 4 / 256, 1 + 4 / 256]


# ---------------------------------------------------------------------------
# Bad arguments: a clear error, nothing written
# ---------------------------------------------------------------------------


def test_bad_arguments_are_refused_and_change_nothing() -> None:
    n = 300
    sfmt = StateFormat.INT8
    st = fresh_state(n, sfmt, seed=0)
    before = bits(st)
    g = grads(n, 1, seed=1)[0]
    s = k.adam_scalars(HYPER_W, 1)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"exp_avg_scale_in": None}, "exp_avg_scale_in is required"),
        ({"exp_avg_sq_scale_out": np.zeros(1, np.float32)}, "has 1 scales; 300 elements need 2"),
        ({"exp_avg_scale_out": st["vs"]}, "same memory"),
    ]
    for override, message in cases:
        kwargs = {"exp_avg_scale_in": st["ms"], "exp_avg_sq_scale_in": st["vs"], "exp_avg_scale_out": st["ms"],
                  "exp_avg_sq_scale_out": st["vs"], **override}
        with pytest.raises(KernelArgumentError, match=message):
            k.adam_step_q(g, st["master"], st["m"], st["v"], st["master"], st["m"], st["v"], st["param"],
                          grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16, state_format=sfmt, scalars=s,
                          **kwargs)
    with pytest.raises(KernelArgumentError, match="dtype uint8"):
        k.adam_step_q(g, st["master"], st["m"].astype(np.uint16), st["v"], st["master"], st["m"], st["v"],
                      st["param"], exp_avg_scale_in=st["ms"], exp_avg_sq_scale_in=st["vs"],
                      exp_avg_scale_out=st["ms"], exp_avg_sq_scale_out=st["vs"], grad_format=HalfFormat.FP16,
                      param_format=HalfFormat.FP16, state_format=sfmt, scalars=s)
    with pytest.raises(KernelArgumentError, match="keeps a scale per 256-element block"):
        k.adam_step(g, st["master"], st["m"], st["v"], st["master"], st["m"], st["v"], st["param"],
                    grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16, state_format=sfmt, scalars=s)
    with pytest.raises(KernelArgumentError, match="keeps a scale"):
        k.BlockUpdate(st["master"], st["m"], st["v"], st["master"].copy(), st["m"].copy(), st["v"].copy(),
                      st["param"], grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16, state_format=sfmt)
    with pytest.raises(KernelArgumentError, match="moment must be a Moment"):
        k.decode_state(st["m"], st["ms"], np.empty(n, np.float32), state_format=sfmt, moment=2)
    after = bits(st)
    for key in before:
        assert np.array_equal(before[key], after[key]), f"{key} changed by a refused call"


@pytest.mark.parametrize("sfmt", [StateFormat.FP16, StateFormat.INT8])
def test_checksummed_block_update_steps_out_of_place_and_chains_codes_and_scales(sfmt: StateFormat) -> None:
    """adam_step_q_crcs, the device's block update for these formats: the in-place step's bits
    out of place, the block CRC over master, exp_avg codes, their scales, exp_avg_sq codes,
    their scales and param in that order, the param CRC alone, and the param copy."""
    n = 1000
    st = fresh_state(n, sfmt, seed=3)
    step(st, grads(n, 1, seed=4)[0], sfmt, k.adam_scalars(HYPER_W, 1))  # nonzero codes and scales
    grad = grads(n, 1, seed=5)[0]
    inputs = {key: value.copy() for key, value in st.items()}
    outs = {key: np.empty_like(value) for key, value in st.items()}
    copy = np.zeros(n, np.uint16)
    crc, param_crc = k.adam_step_q_crcs(
        grad, inputs["master"], inputs["m"], inputs["ms"], inputs["v"], inputs["vs"], outs["master"], outs["m"],
        outs["ms"], outs["v"], outs["vs"], outs["param"], grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16,
        state_format=sfmt, scalars=k.adam_scalars(HYPER_W, 2), param_copy=copy)
    step(st, grad, sfmt, k.adam_scalars(HYPER_W, 2))
    order = ("master", "m", "ms", "v", "vs", "param")
    for key in order:
        assert outs[key].tobytes() == st[key].tobytes(), key
    assert crc == bitwise_crc32c(b"".join(st[key].tobytes() for key in order))
    assert param_crc == bitwise_crc32c(st["param"].tobytes()) and copy.tobytes() == st["param"].tobytes()
    # Out of place only (the shadow is never the committed copy); FP32 and BF16 go elsewhere.
    with pytest.raises(KernelArgumentError, match="out of place"):
        k.adam_step_q_crcs(grad, st["master"], st["m"], st["ms"], st["v"], st["vs"], st["master"], outs["m"],
                           outs["ms"], outs["v"], outs["vs"], outs["param"], grad_format=HalfFormat.FP16,
                           param_format=HalfFormat.FP16, state_format=sfmt, scalars=k.adam_scalars(HYPER_W, 2))
    with pytest.raises(KernelArgumentError, match="block-scaled"):
        k.adam_step_q_crcs(grad, *(st[key] for key in order[:-1]), *(outs[key] for key in order),
                           grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16, state_format=StateFormat.FP32,
                           scalars=k.adam_scalars(HYPER_W, 2))


def bitwise_crc32c(data: bytes) -> int:
    """CRC-32C bit by bit: an independent check of kernels.crc32c's chaining."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF
