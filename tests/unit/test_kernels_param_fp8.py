"""The FP8 params-out kernels (kernels/fp8_param.c): absmax and the saturating encode against torch's FP8 casts, and the per-tensor scale."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cossd import kernels
from cossd.kernels import fp8_params

TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FORMATS = tuple(TORCH_FP8)


def reference(x: np.ndarray, scale: float, dtype: str) -> np.ndarray:
    """torch's cast (round to nearest even) of x * scale clamped to the format's range: the
    saturating encode (torch's own cast makes NaN or inf of what is beyond the range)."""
    largest = fp8_params.FP8_MAX[dtype]
    scaled = torch.from_numpy(x) * scale
    return scaled.clamp(-largest, largest).to(TORCH_FP8[dtype]).view(torch.uint8).numpy()


def encode(x: np.ndarray, scale: float, dtype: str) -> tuple[np.ndarray, int, int]:
    out = np.empty(x.size, dtype=np.uint8)
    overflows, underflows = fp8_params.fp8_encode(x, scale, dtype, out)
    return out, overflows, underflows


@pytest.mark.parametrize("dtype", FORMATS)
def test_every_finite_code_and_the_midpoints_round_as_torch(dtype: str) -> None:
    # Each code's value, and the values halfway between neighbours (ties to even) and just off them.
    values = torch.arange(256, dtype=torch.uint8).view(TORCH_FP8[dtype]).float().numpy()
    finite = np.unique(np.abs(values[np.isfinite(values)]))
    mids = (finite[:-1] + finite[1:]) / 2
    x = np.concatenate([finite, mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf)]).astype(np.float32)
    x = np.concatenate([x, -x])
    codes, overflows, underflows = encode(x, 1.0, dtype)
    np.testing.assert_array_equal(codes, reference(x, 1.0, dtype))
    assert overflows == 0
    # Only the values below half the smallest subnormal (the midpoint 0..smallest, a tie to 0) vanish.
    assert underflows == int(np.count_nonzero((x != 0) & (np.abs(x) <= finite[1] / 2)))


@pytest.mark.parametrize("dtype", FORMATS)
def test_random_masters_over_many_decades_match_torch(dtype: str) -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-12, 6, 200_000)).astype(np.float32)
    amax = fp8_params.absmax(x)
    assert amax == float(np.abs(x).max())
    scale = fp8_params.fp8_scale(amax, dtype)
    codes, overflows, underflows = encode(x, scale, dtype)
    np.testing.assert_array_equal(codes, reference(x, scale, dtype))
    assert overflows == 0  # the scale keeps amax * scale within the format
    decoded = torch.from_numpy(codes).view(TORCH_FP8[dtype]).float().numpy()
    assert underflows == int(np.count_nonzero((x != 0) & (decoded == 0)))
    assert underflows > 0  # this range reaches below the format's smallest subnormal


@pytest.mark.parametrize("dtype", FORMATS)
def test_saturation_nan_inf_and_signed_zero(dtype: str) -> None:
    largest = fp8_params.FP8_MAX[dtype]
    x = np.array([largest * 1.01, -largest * 4, np.inf, -np.inf, np.nan, -0.0, 0.0, 1e-30, -1e-30],
                 dtype=np.float32)
    codes, overflows, underflows = encode(x, 1.0, dtype)
    largest_code = 0x7E if dtype == "fp8_e4m3" else 0x7B
    assert list(codes[:4]) == [largest_code, 0x80 | largest_code, largest_code, 0x80 | largest_code]
    assert overflows == 4
    decoded = torch.from_numpy(codes).view(TORCH_FP8[dtype]).float()
    assert math.isnan(decoded[4])
    assert list(codes[5:]) == [0x80, 0x00, 0x00, 0x80]  # signed zeros; the two tiny ones underflow
    assert underflows == 2


def test_absmax_passes_nan_over_and_sees_inf() -> None:
    assert fp8_params.absmax(np.array([], dtype=np.float32)) == 0.0
    assert fp8_params.absmax(np.array([np.nan, -3.0, 2.0], dtype=np.float32)) == 3.0
    assert fp8_params.absmax(np.array([1.0, -np.inf], dtype=np.float32)) == math.inf


@pytest.mark.parametrize("dtype", FORMATS)
def test_scale_is_current_scalings_power_of_two_within_bounds(dtype: str) -> None:
    largest = fp8_params.FP8_MAX[dtype]
    for amax in (1e-3, 0.37, 1.0, 5.0, 300.0, 7e4):
        scale = fp8_params.fp8_scale(amax, dtype)
        assert math.frexp(scale)[0] == 0.5  # a power of two
        assert largest / 2 < amax * scale <= largest
    assert fp8_params.fp8_scale(0.0, dtype) == 1.0
    assert fp8_params.fp8_scale(math.inf, dtype) == 1.0
    assert fp8_params.fp8_scale(1e-40, dtype) == 2.0 ** 64
    assert fp8_params.fp8_scale(1e38, dtype) == 2.0 ** -64


def test_bad_arguments_are_refused() -> None:
    out = np.empty(3, dtype=np.uint8)
    with pytest.raises(kernels.KernelArgumentError, match="float32"):
        fp8_params.fp8_encode(np.zeros(3, dtype=np.float64), 1.0, "fp8_e4m3", out)  # type: ignore[arg-type]
    with pytest.raises(kernels.KernelArgumentError, match="FP8 format"):
        fp8_params.fp8_encode(np.zeros(3, dtype=np.float32), 1.0, "fp16", out)
    with pytest.raises(kernels.KernelArgumentError, match="out must"):
        fp8_params.fp8_encode(np.zeros(4, dtype=np.float32), 1.0, "fp8_e4m3", out)
    with pytest.raises(kernels.KernelArgumentError, match="scale"):
        fp8_params.fp8_encode(np.zeros(3, dtype=np.float32), 0.0, "fp8_e4m3", out)
