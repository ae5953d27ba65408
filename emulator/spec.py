"""What a namespace is made of: its tensor table, hyperparameters and dtypes, validated."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from .. import kernels

from ..protocol.hyperparameters import BETA_FIELDS, GROUP_FIELDS, MODES
# FP8 params out (a namespace's param_wire_dtype): each step's params also as FP8 codes with a
# per-tensor scale, in the read-only param_fp8 files (emulator/namespace/param_fp8.py).
from ..protocol.param_fp8 import PARAM_WIRE_DTYPES
from ..protocol.status import DeviceError, Status
from .geometry import SCALED_STATE_DTYPES, STATE_ITEMSIZE, TensorLayout, plan_spec_layout
from .names import MAX_GROUPS, MAX_SHAPE_DIMS, MAX_TENSOR_ELEMENTS, MAX_TENSORS_PER_NAMESPACE, check_name

HALF_FORMATS = {"fp16": kernels.HalfFormat.FP16, "bf16": kernels.HalfFormat.BF16}
# The gradients a namespace takes: the 16-bit formats, FP32 (exact parity with an FP32 trainer
# at 6 B/param on the wire), and OCP FP8 codes whose per-tensor scale comes with each step
# (docs/command-set.md, "FP8 gradients and their scales").
GRAD_FORMATS = {"fp16": kernels.GradFormat.FP16, "bf16": kernels.GradFormat.BF16,
                "fp32": kernels.GradFormat.FP32, "fp8_e4m3": kernels.GradFormat.FP8_E4M3,
                "fp8_e5m2": kernels.GradFormat.FP8_E5M2}
FP8_GRAD_DTYPES = ("fp8_e4m3", "fp8_e5m2")
# fp16 and int8 moments are block-scaled: codes plus a float32 scale per 256 elements
# (docs/kernels.md, "Block-scaled moments"; docs/media-format.md, the regions).
STATE_FORMATS = {"fp32": kernels.StateFormat.FP32, "bf16": kernels.StateFormat.BF16,
                 "fp16": kernels.StateFormat.FP16, "int8": kernels.StateFormat.INT8}
# Step numbers travel in two dwords and kernels take them as float exponents; this bound
# keeps both comfortably exact.
MAX_INITIAL_STEP = 1 << 53


def _invalid(message: str) -> DeviceError:
    return DeviceError(Status.INVALID_FIELD, message)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    numel: int
    # Index into NamespaceSpec.groups: which hyperparameters update this tensor (a
    # torch param group).
    group: int = 0
    # The tensor's shape as the model holds it (its product is numel), where the creator gave
    # one: the device keeps the elements flat and uses the shape only to describe them (the
    # export writes it). None: not recorded (an older client, or create-ns --tensor NAME:NUMEL).
    shape: tuple[int, ...] | None = None

    def _shown_shape(self) -> str:
        return repr(list(self.shape) if isinstance(self.shape, tuple) else self.shape)[:80]

    def check_shape(self) -> None:
        """Refuse a recorded shape that is not a tuple of positive ints whose product is numel."""
        if self.shape is None:
            return
        if (not isinstance(self.shape, tuple) or len(self.shape) > MAX_SHAPE_DIMS
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in self.shape)):
            raise _invalid(f"tensor {self.name!r}: a shape is a list of at most {MAX_SHAPE_DIMS} "
                           f"positive integers, got {self._shown_shape()}")
        if math.prod(self.shape) != self.numel:
            raise _invalid(f"tensor {self.name!r}: shape {list(self.shape)} holds {math.prod(self.shape)} "
                           f"elements, not its {self.numel}")


@dataclasses.dataclass(frozen=True)
class Hyperparameters:
    """The Adam hyperparameters of a namespace; changeable between steps."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01
    mode: str = "adamw"

    def validate(self) -> "Hyperparameters":
        for field in GROUP_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise _invalid(f"{field} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise _invalid(f"{field} must be finite, got {value!r}")
        if self.lr < 0:
            raise _invalid(f"lr must be >= 0, got {self.lr}")
        for field in BETA_FIELDS:
            if not 0.0 <= getattr(self, field) < 1.0:
                raise _invalid(f"{field} must be in [0, 1), got {getattr(self, field)}")
        if self.eps <= 0:
            raise _invalid(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0:
            raise _invalid(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.mode not in MODES:
            raise _invalid(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        try:
            # The kernel computes in float32: values that do not survive that are refused here.
            kernels.adam_scalars(self.kernel, 1)
        except kernels.KernelArgumentError as exc:
            raise _invalid(str(exc)) from None
        return self

    @property
    def kernel(self) -> kernels.AdamHyper:
        return kernels.AdamHyper(
            lr=float(self.lr),
            beta1=float(self.beta1),
            beta2=float(self.beta2),
            eps=float(self.eps),
            weight_decay=float(self.weight_decay),
            mode=self.mode,
        )

    def replace(self, **changes: Any) -> "Hyperparameters":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise _invalid(f"unknown hyperparameter(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes).validate()


@dataclasses.dataclass(frozen=True)
class NamespaceSpec:
    """Everything needed to create an optimizer namespace."""

    name: str
    tensors: tuple[TensorSpec, ...]
    hyper: Hyperparameters = Hyperparameters()
    grad_dtype: str = "fp16"
    param_dtype: str = "fp16"
    state_dtype: str = "fp32"
    # Hyperparameters of each group (torch's param groups); empty means one group, `hyper`.
    groups: tuple[Hyperparameters, ...] = ()
    # The step the loaded state belongs to: a namespace created to import an optimizer's
    # state at step k starts at committed step k, so bias correction continues from there.
    initial_step: int = 0
    # None: params out in param_dtype only; "fp8_e4m3" or "fp8_e5m2": also as FP8 (param_fp8).
    param_wire_dtype: str | None = None

    @property
    def group_hypers(self) -> tuple[Hyperparameters, ...]:
        return self.groups or (self.hyper,)

    def validate(self) -> "NamespaceSpec":
        check_name(self.name, "namespace")
        if not self.tensors:
            raise _invalid("a namespace needs at least one tensor")
        if len(self.tensors) > MAX_TENSORS_PER_NAMESPACE:
            raise DeviceError(
                Status.LIMIT_EXCEEDED,
                f"{len(self.tensors)} tensors exceed the limit of {MAX_TENSORS_PER_NAMESPACE}",
            )
        seen: set[str] = set()
        for tensor in self.tensors:
            check_name(tensor.name, "tensor")
            if tensor.name in seen:
                raise _invalid(f"tensor {tensor.name!r} listed twice")
            seen.add(tensor.name)
            if not isinstance(tensor.numel, int) or isinstance(tensor.numel, bool):
                raise _invalid(f"tensor {tensor.name!r}: element count must be an integer")
            if (not isinstance(tensor.group, int) or isinstance(tensor.group, bool)
                    or not 0 <= tensor.group < len(self.group_hypers)):
                raise _invalid(
                    f"tensor {tensor.name!r}: group {tensor.group!r} outside "
                    f"0..{len(self.group_hypers) - 1}"
                )
            if not 1 <= tensor.numel <= MAX_TENSOR_ELEMENTS:
                raise DeviceError(
                    Status.LIMIT_EXCEEDED,
                    f"tensor {tensor.name!r}: element count {tensor.numel} outside "
                    f"1..{MAX_TENSOR_ELEMENTS}",
                )
            tensor.check_shape()
        if self.grad_dtype not in GRAD_FORMATS:
            raise _invalid(f"grad_dtype must be one of {', '.join(GRAD_FORMATS)}, got {self.grad_dtype!r}")
        if self.param_dtype not in HALF_FORMATS:
            raise _invalid(f"param_dtype must be fp16 or bf16, got {self.param_dtype!r}")
        if self.state_dtype not in STATE_FORMATS:
            raise _invalid(f"state_dtype must be one of {', '.join(STATE_FORMATS)}, got {self.state_dtype!r}")
        if self.param_wire_dtype is not None and self.param_wire_dtype not in PARAM_WIRE_DTYPES:
            raise _invalid(f"param_wire_dtype must be null or one of {', '.join(PARAM_WIRE_DTYPES)}, "
                           f"got {self.param_wire_dtype!r}")
        self.hyper.validate()
        if (not isinstance(self.initial_step, int) or isinstance(self.initial_step, bool)
                or not 0 <= self.initial_step < MAX_INITIAL_STEP):
            raise _invalid(f"initial_step must be an integer in 0..{MAX_INITIAL_STEP - 1}")
        if len(self.group_hypers) > MAX_GROUPS:
            raise DeviceError(
                Status.LIMIT_EXCEEDED, f"{len(self.groups)} groups exceed the limit of {MAX_GROUPS}"
            )
        for hyper in self.group_hypers:
            hyper.validate()
            if hyper.mode != self.hyper.mode:
                raise _invalid("every group must use the namespace's mode")
        return self

    @property
    def state_itemsize(self) -> int:
        """Bytes of one moment code on the media (its block scale aside)."""
        return STATE_ITEMSIZE[self.state_dtype]

    @property
    def grad_itemsize(self) -> int:
        """Bytes of one gradient element on the wire."""
        return kernels.GRAD_ITEMSIZE[GRAD_FORMATS[self.grad_dtype]]

    @property
    def scaled_state(self) -> bool:
        """Whether the moments keep a float32 scale per 256 elements beside their codes."""
        return self.state_dtype in SCALED_STATE_DTYPES

    def layout(self) -> tuple[list[TensorLayout], int]:
        """Where every tensor's arrays lie in a state copy, and the bytes of one copy."""
        return plan_spec_layout([(t.name, t.numel) for t in self.tensors], self.state_dtype)

    def to_json(self) -> dict[str, Any]:
        # "shapes" only where some tensor has one: a namespace without shapes is stored as
        # before, so a build older than the shapes still opens it (media-format.md).
        shapes = {t.name: list(t.shape) for t in self.tensors if t.shape is not None}
        return {
            "name": self.name,
            "tensors": [
                [t.name, t.numel] if t.group == 0 else [t.name, t.numel, t.group]
                for t in self.tensors
            ],
            "hyperparameters": dataclasses.asdict(self.hyper),
            "groups": [dataclasses.asdict(h) for h in self.groups],
            "initial_step": self.initial_step,
            "grad_dtype": self.grad_dtype,
            "param_dtype": self.param_dtype,
            "state_dtype": self.state_dtype,
        } | ({"shapes": shapes} if shapes else {}) | (
            # Only where set: a namespace without it is stored as before (media-format.md).
            {"param_wire_dtype": self.param_wire_dtype} if self.param_wire_dtype else {})

    @classmethod
    def from_json(cls, value: Any) -> "NamespaceSpec":
        """Parse a create-namespace payload; any malformed field is INVALID_FIELD."""
        if not isinstance(value, dict):
            raise _invalid("namespace description must be a JSON object")
        known = {
            "name", "tensors", "hyperparameters", "groups", "grad_dtype", "param_dtype",
            "state_dtype", "initial_step", "shapes", "param_wire_dtype",
        }
        unknown = set(value) - known
        if unknown:
            raise _invalid(f"unknown field(s): {', '.join(sorted(unknown))}")
        tensors = value.get("tensors")
        if not isinstance(tensors, list):
            raise _invalid("tensors must be a list of [name, numel] or [name, numel, group]")
        if len(tensors) > MAX_TENSORS_PER_NAMESPACE:
            raise DeviceError(
                Status.LIMIT_EXCEEDED,
                f"{len(tensors)} tensors exceed the limit of {MAX_TENSORS_PER_NAMESPACE}",
            )
        specs = []
        for entry in tensors:
            if not (isinstance(entry, list) and len(entry) in (2, 3)):
                raise _invalid(f"tensor entry {repr(entry)[:80]} must be [name, numel(, group)]")
            specs.append(TensorSpec(*entry))
        specs = _with_shapes(specs, value.get("shapes", {}))
        hyper_json = value.get("hyperparameters", {})
        if not isinstance(hyper_json, dict):
            raise _invalid("hyperparameters must be a JSON object")
        hyper = Hyperparameters().replace(**hyper_json)
        groups_json = value.get("groups", [])
        if not isinstance(groups_json, list) or not all(isinstance(g, dict) for g in groups_json):
            raise _invalid("groups must be a list of JSON objects (hyperparameter overrides)")
        if len(groups_json) > MAX_GROUPS:
            raise DeviceError(
                Status.LIMIT_EXCEEDED, f"{len(groups_json)} groups exceed the limit of {MAX_GROUPS}"
            )
        # Each group is the namespace's hyperparameters with that group's overrides.
        groups = tuple(hyper.replace(**overrides) for overrides in groups_json)
        return cls(
            name=value.get("name"),  # type: ignore[arg-type]
            tensors=tuple(specs),
            hyper=hyper,
            grad_dtype=value.get("grad_dtype", "fp16"),
            param_dtype=value.get("param_dtype", "fp16"),
            state_dtype=value.get("state_dtype", "fp32"),
            groups=groups,
            initial_step=value.get("initial_step", 0),
            param_wire_dtype=value.get("param_wire_dtype"),
        ).validate()


def _with_shapes(specs: list[TensorSpec], shapes: Any) -> list[TensorSpec]:
    """The tensors with the shapes a description's "shapes" ({tensor: [dims]}) gives them;
    tensors it does not name keep no shape (they export flat)."""
    if not isinstance(shapes, dict):
        raise _invalid("shapes must be a JSON object: {tensor name: [dims]}")
    names = {spec.name for spec in specs if isinstance(spec.name, str)}
    unknown = [name for name in shapes if name not in names]
    if unknown:
        raise _invalid(f"shapes: {len(unknown)} name(s) not among the namespace's tensors, "
                       f"e.g. {unknown[0][:128]!r}")
    for name, shape in shapes.items():
        if not isinstance(shape, list):
            raise _invalid(f"tensor {name!r}: shape must be a list of integers, got {repr(shape)[:80]}")
    return [dataclasses.replace(spec, shape=tuple(shapes[spec.name]))
            if isinstance(spec.name, str) and spec.name in shapes else spec for spec in specs]
