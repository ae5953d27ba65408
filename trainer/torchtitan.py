"""cossd's AdamW in torchtitan (0.3.0): an OptimizersContainer whose optimizer is on the device, whose checkpoints (torchtitan's CheckpointManager, DCP) hold a reference to a device snapshot instead of the moments, and a debug-model config that uses it.

torchtitan builds its optimizers from `Trainer.Config.optimizer`, an
`OptimizersContainer.Config` whose `build()` makes the container class that defines it: a
subclass with its own `Config` is torchtitan's extension point. Point torchtitan at a config
function of this module (its `--module` takes a module path):

    torchrun --nproc-per-node 2 -m torchtitan.train --module cossd.trainer.torchtitan \\
        --config llama3_debugmodel_cossd --optimizer.mount /mnt/cossd --optimizer.namespace run1

or use `cossd_adamw(...)` as the `optimizer` of a config of one's own. (Without a GPU, run
`-m cossd.integrations.torchtitan_cpu` in place of `-m torchtitan.train`.) It is optimizer
logic beside torchtitan, as deepspeed/zero.py is beside DeepSpeed, so it lives in the
trainer layer; importing it needs torchtitan installed.

The container's `state_dict()` gives torchtitan's flat, FQN-keyed form with, for a cossd
optimizer, only each param's `step` and the 512-byte reference (cossd.trainer.dcp.reference): the
masters and moments stay on the device, in the snapshot the reference names. Its
`load_state_dict()` rolls the namespace back to that snapshot. torchtitan's own helpers
would take a zero-gradient step on the device to "materialize" the state first
(`init_optim_state`), and save the moments read back from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn

from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, init_optim_state, load_flat_optim_state_dict

from .dcp.reference import REF_KEY, load_reference, reference_state_dict
from .optim import AdamW, _DeviceAdam

# The name a ParamGroupConfig gives to have its params stepped by cossd's AdamW.
COSSD_ADAMW = "CossdAdamW"
# torchtitan's implementation switches, which it puts in every param group: the device
# runs its own fused kernel, so they mean nothing there.
_IMPLEMENTATION_KEYS = ("fused", "foreach")


def _make_cossd_adamw(param_groups: list[dict[str, Any]], *, mount: str, namespace: str,
                      step_timeout_s: float, **options: Any) -> AdamW:
    groups = [{k: v for k, v in group.items() if k not in _IMPLEMENTATION_KEYS} for group in param_groups]
    return AdamW(groups, mount=mount, namespace=namespace, step_timeout_s=step_timeout_s, **options)


class CossdOptimizersContainer(OptimizersContainer):
    """torchtitan's OptimizersContainer, where param groups named COSSD_ADAMW are stepped by
    cossd.trainer.AdamW on the device at `mount` (namespace `namespace`, or
    `namespace-<k>` for the k-th such optimizer past the first, as with several model parts)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        mount: str = ""
        """The cossd device's mount point (`cossd mount`), or a storage server's cossd:// URL."""

        namespace: str = "torchtitan"
        """The namespace on the device that holds this job's masters and moments."""

        step_timeout_s: float = 300.0
        """How long a rank waits for the other ranks' gradients to reach the device."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if not config.mount:
            raise ValueError("CossdOptimizersContainer needs the cossd device's mount point: set "
                             "optimizer.mount (--optimizer.mount /mnt/cossd)")
        self._cossd_config = config
        self._cossd_made = 0
        super().__init__(config, model_parts=model_parts)

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., torch.optim.Optimizer]:
        if name != COSSD_ADAMW:
            return OptimizersContainer._resolve_optimizer_factory(name)
        namespace = self._cossd_config.namespace
        if self._cossd_made:
            namespace = f"{namespace}-{self._cossd_made}"
        self._cossd_made += 1
        return partial(_make_cossd_adamw, mount=self._cossd_config.mount, namespace=namespace,
                       step_timeout_s=self._cossd_config.step_timeout_s)

    def state_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for optimizer in self.optimizers:
            if isinstance(optimizer, _DeviceAdam):
                # torchtitan's flattening reads only state_dict() of what it is given.
                reference = SimpleNamespace(state_dict=partial(reference_state_dict, optimizer))
                result.update(get_flat_optim_state_dict(reference))
            else:
                init_optim_state(optimizer)
                result.update(get_flat_optim_state_dict(optimizer))
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer in self.optimizers:
            if isinstance(optimizer, _DeviceAdam):
                load_reference(optimizer, unflatten_reference(optimizer, state_dict))
            else:
                init_optim_state(optimizer)
                load_flat_optim_state_dict(optimizer, state_dict)


def unflatten_reference(optimizer: _DeviceAdam, flat: dict[str, Any]) -> dict[str, Any]:
    """The integer-keyed reference form (what cossd.trainer.dcp.reference.load_reference takes) of
    `optimizer`'s part of a flat, FQN-keyed dict: `state.<fqn>.step`, `state.<fqn>.cossd_ref`
    and `param_groups.<fqn>.<key>`. A key the optimizer's groups have and the checkpoint
    lacks is a KeyError naming it."""
    state: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group in optimizer.param_groups:
        names = group.get("param_names")
        if not names:
            raise ValueError("the cossd optimizer's param groups carry no param_names: torchtitan's "
                             "checkpoints key the state by them")
        ids = []
        for name in names:
            found = {key: flat[f"state.{name}.{key}"] for key in ("step", REF_KEY) if f"state.{name}.{key}" in flat}
            if found:
                state[index] = found
            ids.append(index)
            index += 1
        loaded: dict[str, Any] = {"params": ids}
        for key in group:
            if key in ("params", "param_names"):
                continue
            flat_key = f"param_groups.{names[0]}.{key}"
            if flat_key not in flat:
                raise KeyError(f"the checkpoint has no {flat_key!r} (param group option {key!r} of param {names[0]})")
            loaded[key] = flat[flat_key]
        groups.append(loaded)
    if not any(REF_KEY in entry for entry in state.values()):
        raise ValueError(f"the checkpoint's optimizer state has no {REF_KEY}: it was not saved by a cossd "
                         "optimizer's CossdOptimizersContainer")
    return {"state": state, "param_groups": groups}


def cossd_adamw(lr: float = 8e-4, *, mount: str = "", namespace: str = "torchtitan",
                **kwargs: Any) -> CossdOptimizersContainer.Config:
    """torchtitan's `default_adamw` with cossd's AdamW: one catch-all param group, torchtitan's
    default betas, eps and weight decay, stepped on the device."""
    return CossdOptimizersContainer.Config(
        mount=mount, namespace=namespace,
        param_groups=[ParamGroupConfig(
            pattern=r".*", optimizer_name=COSSD_ADAMW,
            optimizer_kwargs={"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, **kwargs})])


def llama3_debugmodel_cossd() -> Any:
    """torchtitan's llama3 debug model (`llama3_debugmodel`) with cossd's AdamW; the mount
    is given as --optimizer.mount."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.optimizer = cossd_adamw(lr=8e-4)
    return config
