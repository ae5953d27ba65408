"""FP8 gradients' scales on the device: BEGIN_STEP's grad_scales checked (whole tensors or block-aligned slices, with the trainer's encoding counts), each slice's kernel scalars, and their addition to an open step."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from ... import kernels
from ...protocol.status import DeviceError, Status
from ..geometry import BLOCK_ELEMS
from ..spec import FP8_GRAD_DTYPES
from ..transaction import BlockState, StepTransaction
from .state import NamespaceCore

# float32's normal range: the kernel's gradient multiplier grad_scale / scale must lie in it.
_F32_MIN_NORMAL = 1.1754943508222875e-38
_F32_MAX = 3.4028234663852886e+38
# The keys of a slice's object ({"scale", "start"?, "stop"?, "underflow"?, "saturated"?}).
SLICE_KEYS = ("scale", "start", "stop", "underflow", "saturated")


@dataclasses.dataclass(frozen=True)
class ScaledSlice:
    """Elements start..stop-1 of one tensor, whose FP8 codes are the gradient times `scale`;
    their blocks step with `scalars` (grad_scale / scale folded in). `underflow` and
    `saturated`: what the trainer says its encoding of them flushed to zero and clamped."""

    tensor: str
    start: int
    stop: int
    scale: float
    scalars: kernels.AdamScalars
    underflow: int = 0
    saturated: int = 0

    @property
    def blocks(self) -> range:
        return range(self.start // BLOCK_ELEMS, -(-self.stop // BLOCK_ELEMS))


def _count(value: Any, what: str, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise DeviceError(Status.INVALID_FIELD, f"grad_scales: {what} must be an integer in 0..{most}, got {value!r}")
    return value


def parse(core: NamespaceCore, step: int, grad_scale: float, grad_scales: Any) -> list[ScaledSlice]:
    """The slices `grad_scales` names, checked (INVALID_FIELD, or INVALID_NAMESPACE for an
    unknown tensor), before anything changes. Each tensor's value is a scale (the whole
    tensor) or an object {"scale", "start"?, "stop"?, "underflow"?, "saturated"?}: a slice
    that starts at a block boundary and stops at one or at the tensor's end, so that no
    block is assembled from codes of two scales. A scale is a finite number > 0 whose
    quotient grad_scale / scale is a normal float32 (computed in float64, rounded once:
    exact for a power of two)."""
    if not grad_scales:
        return []
    if not isinstance(grad_scales, dict):
        raise DeviceError(Status.INVALID_FIELD, "grad_scales must be a JSON object {tensor: scale}")
    if core.spec.grad_dtype not in FP8_GRAD_DTYPES:
        raise DeviceError(Status.INVALID_FIELD, f"namespace {core.name!r} takes "
                          f"{core.spec.grad_dtype} gradients: per-tensor grad_scales go with FP8 ones")
    slices = []
    for name, value in grad_scales.items():
        tensor = core.tensor(name)  # INVALID_NAMESPACE names an unknown tensor
        fields = value if isinstance(value, dict) else {"scale": value}
        unknown = sorted(set(fields) - set(SLICE_KEYS))
        if unknown:
            raise DeviceError(Status.INVALID_FIELD, f"grad_scales: {name}: unknown key(s) "
                              f"{', '.join(map(repr, unknown))[:200]}; a slice takes {', '.join(SLICE_KEYS)}")
        scale = fields.get("scale")
        if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
                or not scale > 0):
            raise DeviceError(Status.INVALID_FIELD,
                              f"grad_scales: {name}'s scale must be a finite number > 0, got {scale!r}")
        start = _count(fields.get("start", 0), f"{name}'s start", tensor.numel - 1)
        stop = _count(fields.get("stop", tensor.numel), f"{name}'s stop", tensor.numel)
        if stop <= start or start % BLOCK_ELEMS or (stop % BLOCK_ELEMS and stop != tensor.numel):
            raise DeviceError(Status.INVALID_FIELD, f"grad_scales: {name}'s slice {start}..{stop} must be "
                              f"non-empty, start at a multiple of {BLOCK_ELEMS} elements and stop at one or at "
                              f"the tensor's end ({tensor.numel})")
        combined = grad_scale / float(scale)
        if not _F32_MIN_NORMAL <= combined <= _F32_MAX:
            raise DeviceError(Status.INVALID_FIELD, f"grad_scales: {name}'s scale {scale!r} makes the "
                              f"step's gradient multiplier {combined!r}, outside float32's normal range")
        hyper = core.hypers[core.group_of[tensor.name]]
        try:
            scalars = kernels.adam_scalars(hyper.kernel, step, combined)
        except kernels.KernelArgumentError as exc:
            raise DeviceError(Status.INVALID_FIELD, str(exc)) from None
        slices.append(ScaledSlice(name, start, stop, float(scale), scalars,
                                  _count(fields.get("underflow", 0), f"{name}'s underflow", stop - start),
                                  _count(fields.get("saturated", 0), f"{name}'s saturated", stop - start)))
    return slices


def add(tx: StepTransaction, slices: list[ScaledSlice], who: str) -> None:
    """Give the open step these slices' scalars: refused as a whole (INVALID_FIELD, nothing
    changed) where a slice overlaps one the step has already (another rank's, or a scale sent
    twice) or where some of its gradient elements arrived already (they stepped unscaled)."""
    for index, piece in enumerate(slices):
        taken = [(first, end) for first, end, _ in tx.tensor_scalars.get(piece.tensor, ())]
        taken += [(other.blocks.start, other.blocks.stop) for other in slices[:index] if other.tensor == piece.tensor]
        for first, end in taken:
            if first < piece.blocks.stop and piece.blocks.start < end:
                raise DeviceError(Status.INVALID_FIELD, f"grad_scales: {who} sends a scale for {piece.tensor} "
                                  f"elements {piece.start}..{piece.stop - 1}, whose blocks {first}..{end - 1} "
                                  f"have a scale in step {tx.step} already")
        states = tx.states.get(piece.tensor)
        if states is not None and any(states[block] != BlockState.EMPTY for block in piece.blocks):
            raise DeviceError(Status.INVALID_FIELD, f"grad_scales: {who} sends a scale for {piece.tensor} "
                              f"elements {piece.start}..{piece.stop - 1} after some of their gradients "
                              f"arrived in step {tx.step}; a scale goes before its gradients")
    for piece in slices:
        tx.tensor_scalars.setdefault(piece.tensor, []).append((piece.blocks.start, piece.blocks.stop, piece.scalars))
