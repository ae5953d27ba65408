"""The optimizer's plan: the tensors (entries) a namespace holds, their param groups and hyperparameters."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from ..protocol.hyperparameters import GROUP_FIELDS
from .namespace.files import WIRE_DTYPES

# The constructor options of torch's Adam family that the device's kernel implements
# only at their default value.
UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")
HYPER_FIELDS = GROUP_FIELDS
# The per-param-group options of torch's Adam family that change the math and that the device
# implements only at their default value (a group's options are read at each step: one given
# in a group, or set on it after construction, must be refused, not ignored). foreach, fused,
# capturable and differentiable choose how torch computes the same step: ignored in a group.
UNSUPPORTED_IN_GROUPS = ("amsgrad", "maximize")
# The moments' formats a namespace can keep (emulator/spec.py STATE_FORMATS): fp16 and int8
# are block-scaled, and read and load as FP32 (docs/media-format.md).
STATE_DTYPES = ("fp32", "bf16", "fp16", "int8")
# The gradients' formats a namespace can take (emulator/spec.py GRAD_FORMATS); the params come
# back in the 16-bit wire dtype whichever it is.
GRAD_DTYPES = ("fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2")
# The FP8 ones: their codes carry a per-tensor scale sent with BEGIN_STEP.
FP8_GRAD_DTYPES = ("fp8_e4m3", "fp8_e5m2")
TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter as the device knows it."""

    index: int  # position in param-group order, as torch's state_dict numbers params
    name: str
    group: int
    param: torch.Tensor

    @property
    def numel(self) -> int:
        return self.param.numel()


def group_hyper(group: dict[str, Any]) -> dict[str, float]:
    """A torch param group's options as the device's hyperparameters."""
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2),
        "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
    }


def check_group_options(param_groups: list[dict[str, Any]], mode: str, when: str = "") -> None:
    """A ValueError naming the group and the option where a param group asks for what the
    device's kernel does not compute: amsgrad or maximize set, or a weight decay other than
    the namespace's `mode` ("adamw": decoupled, "adam": L2), which the device applies to every
    group alike. `when` adds where it was found (at step(): set after construction)."""
    for index, group in enumerate(param_groups):
        for option in UNSUPPORTED_IN_GROUPS:
            if group.get(option):
                raise ValueError(f"param group {index}: {option}={group[option]!r} is not supported by the cossd "
                                 f"device (its kernel computes {option}=False){when}")
        # With no weight decay the two modes compute the same step (a stock Adam's state dict
        # carries decoupled_weight_decay=False into an AdamW): only a decay that applies differs.
        if ("decoupled_weight_decay" in group and bool(group["decoupled_weight_decay"]) != (mode == "adamw")
                and float(group.get("weight_decay", 0.0)) != 0.0):
            kind = "decoupled (AdamW)" if mode == "adamw" else "L2 (Adam)"
            raise ValueError(f"param group {index}: decoupled_weight_decay={group['decoupled_weight_decay']!r}, but "
                             f"this optimizer's namespace applies {kind} weight decay to every group; use AdamW "
                             "(or Adam(decoupled_weight_decay=True)) for decoupled decay and Adam for L2, one "
                             f"mode per optimizer{when}")


def plan(param_groups: list[dict[str, Any]]) -> list[Entry]:
    """One entry per param, in param-group order, named by the group's param_names where
    they are valid tensor names and unique, else g<group>.p<index>."""
    # A sharded optimizer (issue 17) plans the same entries on every rank and then takes
    # its rank's share of them: the names and indices here are the job's, not a rank's.
    entries: list[Entry] = []
    names: set[str] = set()
    for group_index, group in enumerate(param_groups):
        given = group.get("param_names") or [None] * len(group["params"])
        for param, given_name in zip(group["params"], given):
            index = len(entries)
            name = given_name if isinstance(given_name, str) else ""
            if not TENSOR_NAME.fullmatch(name) or name in names:
                name = f"g{group_index}.p{index}"
            names.add(name)
            entries.append(Entry(index, name, group_index, param))
    return entries


def infer_dtype(entries: list[Entry]) -> torch.dtype:
    """The wire dtype for these params: theirs where they all share a 16-bit one."""
    dtypes = {entry.param.dtype for entry in entries}
    if len(dtypes) == 1 and next(iter(dtypes)) in WIRE_DTYPES:
        return next(iter(dtypes))
    # FP32 (or mixed) models: BF16 keeps FP32's range, so gradients cannot overflow.
    return torch.bfloat16


def description(name: str, entries: list[Entry], param_groups: list[dict[str, Any]], mode: str,
                dtype: torch.dtype, state_dtype: str, initial_step: int,
                grad_dtype: str | None = None, param_wire_dtype: str | None = None) -> dict[str, Any]:
    """What CREATE_NAMESPACE is given for this plan: params in `dtype`, gradients in
    `grad_dtype` (None: the same), and where param_wire_dtype is an FP8 format, the params
    also out as FP8 (the namespace's param_fp8 files)."""
    hypers = [group_hyper(group) for group in param_groups]
    wire = WIRE_DTYPES[dtype]
    return {
        "name": name,
        "tensors": [[e.name, e.numel, e.group] for e in entries],
        "hyperparameters": hypers[0] | {"mode": mode},
        "groups": hypers,
        "grad_dtype": grad_dtype or wire,
        "param_dtype": wire,
        "state_dtype": state_dtype,
        "initial_step": initial_step,
        # Each param's shape, kept by the device so that `cossd export` writes the tensors as
        # the model holds them (a 0-d param has shape []).
        "shapes": {e.name: list(e.param.shape) for e in entries},
    } | ({"param_wire_dtype": param_wire_dtype} if param_wire_dtype else {})


def master_loads(entries: list[Entry], masters: list[torch.Tensor] | None) -> list[tuple[str, str, torch.Tensor]]:
    """The FP32 masters to write (from `masters` by entry index, else the params), checked."""
    loads = []
    for entry in entries:
        source = masters[entry.index] if masters is not None else entry.param
        master = source.detach().to("cpu", torch.float32).reshape(-1)
        if master.numel() != entry.numel:
            raise ValueError(f"master weights for {entry.name} have {master.numel()} elements, "
                             f"not {entry.numel}")
        loads.append((entry.name, "master", master))
    return loads
