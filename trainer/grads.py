"""The step's gradients: in the wire dtype, which params lack one, the scale they carry, and global-norm clipping."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .plan import Entry


def wire_grad(entry: Entry, dtype: torch.dtype, on_host: bool = True) -> torch.Tensor:
    """The gradient in the wire dtype, flat: on the host, or (on_host=False, for the memory
    buffer, which takes it straight from the GPU) wherever it is."""
    grad = entry.param.grad
    if grad is None:  # the optimizer refuses such a step (missing) before anything is sent
        raise RuntimeError(f"{entry.name} has no gradient")
    if grad.is_sparse:
        raise RuntimeError("cossd optimizers do not support sparse gradients")
    return grad.detach().to("cpu" if on_host else grad.device, dtype).reshape(-1)


# The largest finite value of each FP8 gradient format (OCP: E4M3 448, E5M2 57344).
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# The FP8 scale's exponent is kept within +-64: the device's multiplier (grad_scale / scale)
# then stays a normal float32 for any loss scale and clip coefficient in use.
FP8_SCALE_EXPONENT = 64


def fp8_scale(amax: float, grad_dtype: str) -> float:
    """The per-tensor scale of current scaling: the power of two 2^floor(log2(fp8_max / amax)),
    so the largest |gradient| times it lands in [fp8_max / 2, fp8_max]. A power of two because
    multiplying by it, and the device's multiplying by its inverse, are exact: the only
    rounding FP8 adds is the encoding's (as MS-AMP's scales). 1.0 where amax is 0 or not finite
    (a non-finite gradient skips the step on the device anyway)."""
    if not (amax > 0 and math.isfinite(amax)):
        return 1.0
    exponent = math.floor(math.log2(FP8_MAX[grad_dtype] / amax))
    return math.ldexp(1.0, max(-FP8_SCALE_EXPONENT, min(FP8_SCALE_EXPONENT, exponent)))


@dataclasses.dataclass(frozen=True)
class Fp8Codes:
    """A flat gradient (or a slice of one) as FP8 codes, with the scale they carry and what
    the encoding lost: nonzero elements that became zero, finite ones clamped to the largest."""

    codes: torch.Tensor  # uint8, one a element
    scale: float
    underflow: int
    saturated: int

    def wire(self, start: int | None = None, stop: int | None = None) -> dict[str, Any]:
        """Its entry in BEGIN_STEP's grad_scales (docs/command-set.md): the scale, the encoding's
        counts (log page C6h), and for a slice of a tensor the elements it covers."""
        entry: dict[str, Any] = {"scale": self.scale, "underflow": self.underflow, "saturated": self.saturated}
        if start is not None and stop is not None:
            entry |= {"start": start, "stop": stop}
        return entry


def fp8_encode_counted(grad: torch.Tensor, grad_dtype: str, fp8_dtype: torch.dtype) -> Fp8Codes:
    """A flat gradient as FP8 codes (uint8, round to nearest even) of the gradient times its
    scale (current scaling: from the amax of exactly these elements). Finite values beyond the
    format's range (only where the scale's exponent bound stops it short) saturate to +-max
    and are counted; inf and NaN become NaN codes, so that the device skips the step as for
    any format (torch's cast alone turns an inf into E4M3's finite 448)."""
    amax = 0.0
    if grad.numel():
        # One pass and no |grad| copy; NaN where any element is (Python's max would drop it).
        low, high = (float(value) for value in torch.aminmax(grad.detach()))
        amax = math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)
    scale = fp8_scale(amax, grad_dtype)
    scaled = grad.detach().to(torch.float32) * scale
    largest = FP8_MAX[grad_dtype]
    saturated = 0
    if not math.isfinite(amax):  # amax is inf or NaN exactly where some element is
        scaled = torch.where(torch.isfinite(scaled), scaled, torch.nan)
    elif amax * scale > largest:  # only where the scale's exponent bound stopped it short
        over = scaled.abs() > largest
        saturated = int(over.sum())
        scaled = torch.where(over, scaled.clamp(-largest, largest), scaled)
    codes = scaled.to(fp8_dtype).view(torch.uint8)
    # A zero value always makes a zero code (either sign): the other zero codes are underflows.
    # (count_nonzero: a bool tensor's sum is several times slower.)
    underflow = int(torch.count_nonzero(scaled)) - int(torch.count_nonzero(codes & 0x7F))
    return Fp8Codes(codes, scale, underflow, saturated)


def fp8_encode(grad: torch.Tensor, grad_dtype: str, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, float]:
    """A flat gradient as FP8 codes (uint8) times its scale, and the scale (fp8_encode_counted)."""
    encoded = fp8_encode_counted(grad, grad_dtype, fp8_dtype)
    return encoded.codes, encoded.scale


def missing(entries: list[Entry]) -> list[Entry]:
    """The entries whose param has no gradient this step."""
    return [entry for entry in entries if entry.param.grad is None]


def partial_grads_error(absent: list[Entry], total: int) -> RuntimeError:
    """Why a step where only some params have a gradient is refused."""
    names = ", ".join(entry.name for entry in absent[:4]) + (", ..." if len(absent) > 4 else "")
    return RuntimeError(
        f"{len(absent)} of {total} params have no gradient this step ({names}): "
        "the device steps every tensor of a namespace, and a zero gradient would still move "
        "their moments and decay their weights, where torch leaves them alone. Leave frozen "
        "or unused params out of the optimizer, or set p.grad = torch.zeros_like(p) for "
        "them to step them with a zero gradient")


def loss_scale(optimizer: Any) -> float:
    """The scale the gradients carry: GradScaler's, where it is stepping this optimizer (it
    sets grad_scale on the optimizer, as for any optimizer with _step_supports_amp_scaling)."""
    scale = getattr(optimizer, "grad_scale", None)
    if scale is None:
        return 1.0
    return float(scale)


def scaler_found_inf(optimizer: Any) -> bool:
    """Whether GradScaler found non-finite gradients for this step (its found_inf)."""
    found = getattr(optimizer, "found_inf", None)
    return bool(found is not None and float(found) > 0)


def global_norm(grads: list[torch.Tensor], grad_scale: float) -> float:
    """The L2 norm over every gradient, unscaled, as torch.nn.utils.clip_grad_norm_ takes it."""
    # Sharded across ranks (issue 17), each rank's part of this sum meets the others' in one
    # all-reduce of squared norms before the coefficient below.
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    return float(torch.linalg.vector_norm(norms)) / grad_scale


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """clip_grad_norm_'s coefficient (<= 1) for a step whose gradients have `total_norm`."""
    if not torch.isfinite(torch.tensor(total_norm)):
        return 1.0  # the device skips a step with non-finite gradients anyway
    return min(1.0, max_norm / (total_norm + 1e-6))
