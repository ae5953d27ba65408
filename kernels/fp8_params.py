"""FP8 params out: the per-tensor power-of-two scale of current scaling, and the C absmax and saturating encode behind a validating wrapper."""
from __future__ import annotations

import math

import numpy as np

from ._cossd_kernels import ffi as _ffi
from ._cossd_kernels import lib as _lib
from .validation import GradFormat, KernelArgumentError

# The largest finite value of each OCP FP8 format (E4M3FN 448, E5M2 57344).
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8_FORMATS = {"fp8_e4m3": GradFormat.FP8_E4M3, "fp8_e5m2": GradFormat.FP8_E5M2}
# The scale's exponent is kept within +-64, the bound the gradients' scales keep (trainer/grads.py).
FP8_SCALE_EXPONENT = 64


def fp8_scale(amax: float, dtype: str) -> float:
    """Current scaling's per-tensor scale 2^floor(log2(fp8_max / amax)), its exponent within
    +-FP8_SCALE_EXPONENT: the largest |value| times it lands in [fp8_max / 2, fp8_max]. A power
    of two, so multiplying by it and by its inverse is exact. 1.0 where amax is 0 or not finite."""
    if dtype not in FP8_MAX:
        raise KernelArgumentError(f"FP8 format must be one of {', '.join(FP8_MAX)}, got {dtype!r}")
    if not (amax > 0 and math.isfinite(amax)):
        return 1.0
    exponent = math.floor(math.log2(FP8_MAX[dtype] / amax))
    return math.ldexp(1.0, max(-FP8_SCALE_EXPONENT, min(FP8_SCALE_EXPONENT, exponent)))


def _f32(name: str, x: np.ndarray) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 1 or not x.flags.c_contiguous:
        raise KernelArgumentError(f"{name} must be a contiguous 1-D float32 numpy array")
    return x


def absmax(x: np.ndarray) -> float:
    """The largest |x[i]| of a float32 array (NaNs passed over; inf where any is inf; 0.0 if empty)."""
    x = _f32("x", x)
    return float(_lib.cossd_absmax_f32(_ffi.from_buffer("float[]", x), x.size))


def fp8_encode(x: np.ndarray, scale: float, dtype: str, out: np.ndarray) -> tuple[int, int]:
    """x * scale as FP8 codes of `dtype` into `out` (uint8, one per element): round to nearest
    even, saturating at the format's largest finite value. Returns (overflows: values beyond it,
    inf included; underflows: nonzero values whose code is zero)."""
    x = _f32("x", x)
    if dtype not in FP8_FORMATS:
        raise KernelArgumentError(f"FP8 format must be one of {', '.join(FP8_FORMATS)}, got {dtype!r}")
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != x.shape \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise KernelArgumentError(f"out must be a writable contiguous uint8 array of {x.size} elements")
    if not (isinstance(scale, float) and math.isfinite(scale) and scale > 0):
        raise KernelArgumentError(f"scale must be a finite float > 0, got {scale!r}")
    counts = np.zeros(2, dtype=np.uint64)
    rc = _lib.cossd_fp8_encode(_ffi.from_buffer("float[]", x), x.size, scale, int(FP8_FORMATS[dtype]),
                               _ffi.from_buffer("uint8_t[]", out, require_writable=True),
                               _ffi.from_buffer("uint64_t[]", counts, require_writable=True))
    if rc != 0:
        raise KernelArgumentError(f"fp8_encode: C kernel rejected its arguments ({rc})")
    return int(counts[0]), int(counts[1])
