"""Adam/AdamW hyperparameters (AdamHyper) and the per-step scalars the C kernel takes (AdamScalars, adam_scalars), computed as torch.optim computes them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._cossd_kernels import ffi as _ffi
from ..protocol.hyperparameters import ADAMW, BETA_FIELDS, GROUP_FIELDS, MODES
from .validation import KernelArgumentError


def _check_real(name: str, value: Any) -> float:
    """Return value as float, rejecting bools, non-numbers and non-finite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise KernelArgumentError(f"{name} must be a real number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise KernelArgumentError(f"{name} must be finite, got {result!r}")
    return result


@dataclass(frozen=True)
class AdamHyper:
    """Adam/AdamW hyperparameters; mode "adamw" decays the weights apart from the gradient
    (AdamW), "adam" adds the L2 penalty to the gradient (protocol/hyperparameters.py)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    mode: str

    def __post_init__(self) -> None:
        for name in GROUP_FIELDS:
            object.__setattr__(self, name, _check_real(name, getattr(self, name)))
        if self.lr < 0:
            raise KernelArgumentError(f"lr must be >= 0, got {self.lr!r}")
        for name in BETA_FIELDS:
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise KernelArgumentError(f"{name} must satisfy 0 <= {name} < 1, got {value!r}")
        if not self.eps > 0:
            raise KernelArgumentError(f"eps must be > 0, got {self.eps!r}")
        if self.weight_decay < 0:
            raise KernelArgumentError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.mode not in MODES:
            raise KernelArgumentError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")


@dataclass(frozen=True)
class AdamScalars:
    """Per-step scalars for the C kernel, computed in float64; the C struct rounds them to float32."""

    grad_scale: float
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps: float
    step_size: float
    bias_correction2_sqrt: float
    decay: float
    weight_decay: float
    mode: str
    # Built once so repeated kernel calls do not re-create it; read-only, so
    # sharing it between threads is safe.
    _c: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        c = _ffi.new("cossd_adam_scalars *")
        for name in (
            "grad_scale",
            "beta1",
            "beta2",
            "one_minus_beta1",
            "one_minus_beta2",
            "eps",
            "step_size",
            "bias_correction2_sqrt",
            "decay",
            "weight_decay",
        ):
            setattr(c, name, getattr(self, name))
            # The C struct rounds to float32; a value that overflows (or an eps
            # that underflows to 0) would silently turn the step into inf/NaN.
            if not math.isfinite(getattr(c, name)):
                raise KernelArgumentError(f"{name}={getattr(self, name)!r} is not representable as a finite float32")
        if not c.eps > 0:
            raise KernelArgumentError(f"eps={self.eps!r} rounds to 0 in float32")
        c.decoupled = 1 if self.mode == ADAMW else 0  # the C form of the mode
        object.__setattr__(self, "_c", c)


def adam_scalars(hyper: AdamHyper, step: int, grad_scale: float = 1.0) -> AdamScalars:
    """Compute the scalars of Adam step `step` (1-based) exactly as torch.optim's single-tensor Adam/AdamW does."""
    if not isinstance(hyper, AdamHyper):
        raise KernelArgumentError(f"hyper must be an AdamHyper, got {type(hyper).__name__}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise KernelArgumentError(f"step must be an int, got {type(step).__name__}")
    step = int(step)
    if step < 1:
        raise KernelArgumentError(f"step must be >= 1, got {step}")
    grad_scale = _check_real("grad_scale", grad_scale)
    if not grad_scale > 0:
        raise KernelArgumentError(f"grad_scale must be > 0, got {grad_scale!r}")
    # Same float64 expressions as torch/optim/adam.py (_single_tensor_adam).
    bias_correction1 = 1 - hyper.beta1**step
    bias_correction2 = 1 - hyper.beta2**step
    step_size = hyper.lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    decay = 1 - hyper.lr * hyper.weight_decay if hyper.mode == ADAMW else 1.0
    # AdamScalars rejects values that do not fit float32 (e.g. a huge lr).
    return AdamScalars(
        grad_scale=grad_scale,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        one_minus_beta1=1 - hyper.beta1,
        one_minus_beta2=1 - hyper.beta2,
        eps=hyper.eps,
        step_size=step_size,
        bias_correction2_sqrt=bias_correction2_sqrt,
        decay=decay,
        weight_decay=hyper.weight_decay,
        mode=hyper.mode,
    )
