"""The trainer's FP8 gradient encoder: codes and scales against torch's own cast, the underflow and saturation counts on crafted values, inf and NaN as NaN codes."""
from __future__ import annotations

import math

import pytest
import torch

from cossd.trainer.grads import FP8_MAX, fp8_encode_counted

FORMATS = [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
NAN_CODES = {0x7F, 0xFF}  # both formats: all-ones exponent and mantissa, either sign (E4M3's only NaN)


@pytest.mark.parametrize("grad_dtype, fp8", FORMATS)
def test_codes_are_torchs_cast_of_the_scaled_gradient(grad_dtype: str, fp8: torch.dtype) -> None:
    grad = torch.randn(10_000, generator=torch.Generator().manual_seed(1)) * 3e-3
    encoded = fp8_encode_counted(grad.to(torch.bfloat16), grad_dtype, fp8)
    amax = float(grad.to(torch.bfloat16).abs().max())
    assert encoded.scale == 2.0 ** math.floor(math.log2(FP8_MAX[grad_dtype] / amax))
    expected = (grad.to(torch.bfloat16).float() * encoded.scale).to(fp8).view(torch.uint8)
    assert torch.equal(encoded.codes, expected)
    assert encoded.saturated == 0


@pytest.mark.parametrize("grad_dtype, fp8", FORMATS)
def test_underflow_counts_nonzero_values_that_became_zero_codes(grad_dtype: str, fp8: torch.dtype) -> None:
    # amax 1.0: E4M3's scale 256, E5M2's 32768; 1e-12 is below either's smallest code there,
    # the zeros (either sign) are no underflow.
    grad = torch.tensor([1.0, 1e-12, -1e-12, 0.0, -0.0, 0.5])
    encoded = fp8_encode_counted(grad, grad_dtype, fp8)
    assert encoded.underflow == 2 and encoded.saturated == 0
    assert encoded.codes[1:5].tolist() == [0x00, 0x80, 0x00, 0x80]


@pytest.mark.parametrize("grad_dtype, fp8", FORMATS)
def test_values_past_the_scale_bound_saturate_and_are_counted(grad_dtype: str, fp8: torch.dtype) -> None:
    # 1e30 needs a scale below 2^-64 (the bound): it saturates to the largest code, counted.
    encoded = fp8_encode_counted(torch.tensor([1e30, -1e30, 1.0]), grad_dtype, fp8)
    assert encoded.scale == 2.0 ** -64 and encoded.saturated == 2
    decoded = encoded.codes.view(fp8).float()
    assert decoded[:2].tolist() == [FP8_MAX[grad_dtype], -FP8_MAX[grad_dtype]]
    assert encoded.underflow == 1  # 1.0 * 2^-64 is below the smallest code


@pytest.mark.parametrize("grad_dtype, fp8", FORMATS)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_inf_and_nan_become_nan_codes(grad_dtype: str, fp8: torch.dtype, bad: float) -> None:
    """torch's cast makes E4M3's finite 448 of an inf: the device would step it, not skip."""
    encoded = fp8_encode_counted(torch.tensor([0.25, bad, -1.0]), grad_dtype, fp8)
    assert encoded.scale == 1.0 and encoded.codes[1].item() in NAN_CODES
    assert encoded.saturated == 0 and encoded.underflow == 0
    assert math.isnan(encoded.codes.view(fp8).float()[1].item())


def test_wire_entry_names_a_slice_only_where_asked() -> None:
    encoded = fp8_encode_counted(torch.tensor([1.0, 1e-12]), "fp8_e4m3", torch.float8_e4m3fn)
    assert encoded.wire() == {"scale": 256.0, "underflow": 1, "saturated": 0}
    assert encoded.wire(262144, 262146) == {"scale": 256.0, "underflow": 1, "saturated": 0,
                                            "start": 262144, "stop": 262146}
