"""The usual mixed-precision recipe on the trainer: a stock torch optimizer on FP32 master copies."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MixedPrecisionOptimizer:
    """What cossd replaces: FP16/BF16 model params, FP32 masters and moments in host memory.

    Gradients of the half-precision model are upcast into the masters' .grad, the stock
    optimizer updates the masters, and the model params are refreshed from them (rounded to
    nearest even, as `.copy_` does). The param groups mirror the model's, so per-group
    options and LR schedulers work on `.optimizer` as usual.

    Pass fused=True for torch's fused CPU/CUDA kernel: on the CPU it is the one cossd's
    kernel matches bit for bit (docs/kernels.md).
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 **options: Any) -> None:
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.model_params: list[torch.Tensor] = []
        master_groups = []
        for group in groups:
            masters = []
            for param in group["params"]:
                self.model_params.append(param)
                masters.append(torch.nn.Parameter(param.detach().to(torch.float32).clone()))
            master_groups.append({**group, "params": masters})
        self.masters: list[torch.nn.Parameter] = [m for g in master_groups for m in g["params"]]
        self.optimizer = optimizer_class(master_groups, **options)
        self.last_step_skipped = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def load_masters(self, masters: Iterable[torch.Tensor]) -> None:
        """Start from given FP32 weights (e.g. the model's before it was cast to half)."""
        with torch.no_grad():
            for master, values, param in zip(self.masters, masters, self.model_params):
                master.copy_(values.reshape(master.shape))
                param.copy_(master)

    def zero_grad(self) -> None:
        for param in self.model_params:
            param.grad = None

    @torch.no_grad()
    def step(self, grad_scale: float = 1.0, max_grad_norm: float | None = None) -> bool:
        """Unscale, optionally clip, step and refresh the model. False if skipped (inf/NaN)."""
        unscaled = []
        for master, param in zip(self.masters, self.model_params):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            master.grad = grad.to(torch.float32) / grad_scale
            unscaled.append(master.grad)
        finite = all(bool(torch.isfinite(grad).all()) for grad in unscaled)
        self.last_step_skipped = not finite
        if not finite:
            return False
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, max_grad_norm)
        self.optimizer.step()
        for master, param in zip(self.masters, self.model_params):
            param.copy_(master)
        return True
