"""The step's gradients: in the wire dtype, which params lack one, the scale they carry, and global-norm clipping."""
from __future__ import annotations

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
