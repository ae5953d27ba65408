"""The numpy reference of the kernels' Adam step and conversions, in the kernel contract's exact
operation order (docs/kernels.md), independent of the C code: shared by the kernel tests and
the stateful mount test."""
from __future__ import annotations

import numpy as np

import cossd.kernels as k
from cossd.kernels import HalfFormat, StateFormat


def ref_bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def ref_f32_to_bf16(x: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def ref_half_to_f32(bits: np.ndarray, fmt: HalfFormat) -> np.ndarray:
    return bits.view(np.float16).astype(np.float32) if fmt == HalfFormat.FP16 else ref_bf16_to_f32(bits)


def ref_f32_to_half(x: np.ndarray, fmt: HalfFormat) -> np.ndarray:
    if fmt == HalfFormat.FP16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    return ref_f32_to_bf16(x)


def fma(a: np.ndarray | np.float32, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fmaf() in numpy: a float32 product is exact in long double (64-bit mantissa), so the
    only rounding that matters is the one back to float32."""
    wide = np.longdouble
    return (np.asarray(a).astype(wide) * b.astype(wide) + c.astype(wide)).astype(np.float32)


def ref_adam(
    inp: dict[str, np.ndarray], gfmt: HalfFormat, pfmt: HalfFormat, sfmt: StateFormat, s: k.AdamScalars
) -> dict[str, np.ndarray]:
    """numpy float32 re-implementation in the contract's exact operation order."""
    f32 = np.float32
    g = ref_half_to_f32(inp["grad"], gfmt) * f32(s.grad_scale)
    p = inp["master"].copy()
    m_in = inp["m"] if sfmt == StateFormat.FP32 else ref_bf16_to_f32(inp["m"])
    v_in = inp["v"] if sfmt == StateFormat.FP32 else ref_bf16_to_f32(inp["v"])
    if s.mode == "adamw":
        p = p * f32(s.decay)
    else:
        g = fma(f32(s.weight_decay), p, g)
    w = f32(s.one_minus_beta1)
    if abs(w) < 0.5:
        m = fma(w, g - m_in, m_in)
    else:
        m = fma(w - f32(1), g - m_in, g)
    v = fma(f32(s.one_minus_beta2) * g, g, v_in * f32(s.beta2))
    denom = np.sqrt(v) / f32(s.bias_correction2_sqrt) + f32(s.eps)
    p = p + (-f32(s.step_size) * m) / denom
    if sfmt == StateFormat.BF16:
        m, v = ref_f32_to_bf16(m), ref_f32_to_bf16(v)
    return {"master": p, "m": m, "v": v, "param": ref_f32_to_half(p, pfmt)}
