"""Per-tensor counters of a namespace's block-scaled moments (fp16, int8: underflows, overflows and block scales, from the kernel's counts, folded in at each commit), of its FP8 gradients (the scales each step brought, the trainer's encoding counts, the non-finite codes the device found) and of its FP8 params out (each step's scale and encoding counts)."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterable

from ..kernels.state_formats import MomentCounts, StateCounts
from .spec import FP8_GRAD_DTYPES

MOMENTS = ("exp_avg", "exp_avg_sq")


class StateCounters:
    """One namespace's counters (its core's: emulator/namespace/state.py). The step's blocks report their counts as the kernel runs them;
    a commit folds the step's into the totals, so a skipped or aborted step adds nothing.

    A block run again (an aborted step begun anew) replaces its earlier report: pending counts
    are keyed by (tensor, first element), and every committed step runs every block, so a stale
    report of a skipped step is always replaced before the next commit reads it. Totals count
    since the namespace was opened (the daemon's life), as the namespace's other counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], StateCounts] = {}
        self._totals: dict[str, StateCounts] = {}
        self._last: dict[str, StateCounts] = {}
        self._last_step = 0
        self._fp8: dict[str, GradScaleCounts] = {}
        self._param_fp8: dict[str, ParamFp8Counts] = {}

    def record_block(self, tensor: str, start: int, counts: StateCounts) -> None:
        """A block's counts from the kernel (kernel worker threads call this)."""
        with self._lock:
            self._pending[(tensor, start)] = counts

    def step_committed(self, step: int) -> None:
        """Fold the committed step's block counts: its own per tensor, added to the totals."""
        with self._lock:
            if not self._pending:
                return
            last: dict[str, StateCounts] = {}
            for (tensor, _), counts in sorted(self._pending.items()):
                last.setdefault(tensor, StateCounts()).merge(counts)
            self._pending.clear()
            for tensor, counts in last.items():
                total = self._totals.setdefault(tensor, StateCounts())
                for moment in MOMENTS:
                    # The totals sum the counts; the scale range is the last step's (below).
                    got, into = getattr(counts, moment), getattr(total, moment)
                    into.underflow += got.underflow
                    into.overflow += got.overflow
            self._last = last
            self._last_step = step

    def fp8_scales_taken(self, step: int, slices: Iterable[Any]) -> None:
        """A step's FP8 scales as its begin (or a rank's join, or a streamed tensor's) took them
        (namespace/grad_scales.ScaledSlice: tensor, start, stop, scale, underflow, saturated).
        Counted whether or not the step then commits: a step skipped for an overflow is the one
        whose encoding counts matter most."""
        with self._lock:
            for piece in slices:
                counts = self._fp8.setdefault(piece.tensor, GradScaleCounts())
                if counts.step != step:  # the tensor's first slice of this step: its last step's figures restart
                    counts.step, counts.scale_min, counts.scale_max, counts.slices = step, piece.scale, piece.scale, 0
                    counts.last_underflow = counts.last_saturated = 0
                counts.scale_min = min(counts.scale_min, piece.scale)
                counts.scale_max = max(counts.scale_max, piece.scale)
                counts.slices += 1
                counts.last_underflow += piece.underflow
                counts.last_saturated += piece.saturated
                counts.underflow += piece.underflow
                counts.saturated += piece.saturated

    def grad_nonfinite(self, tensor: str, elements: int) -> None:
        """A gradient block of `tensor` held `elements` inf or NaN elements (as the device's check
        before the kernel counts them: FP8 codes that decode to NaN, E5M2's infinities)."""
        with self._lock:
            self._fp8.setdefault(tensor, GradScaleCounts()).nonfinite += elements

    def fp8_figures(self) -> dict[str, Any]:
        """The FP8 gradients' counters as log page C6h carries them, per tensor."""
        with self._lock:
            return {tensor: dataclasses.asdict(self._fp8[tensor]) for tensor in sorted(self._fp8)}

    def param_fp8_encoded(self, tensor: str, step: int, scale: float, overflow: int, underflow: int) -> None:
        """The device encoded `tensor`'s params of `step` as FP8 (namespace/param_fp8.py: for a
        param_fp8 file read or a CMB step's place) with `scale`, counting `overflow` saturated and
        `underflow` flushed elements. Each step counts once in the totals, by its latest encoding:
        the same step encoded again (a place made before the commit, then the file; an aborted
        step run anew; initial masters loaded again) replaces its own counts. An older step
        encoded again (the committed step's file read after a later step's place) adds nothing."""
        with self._lock:
            counts = self._param_fp8.setdefault(tensor, ParamFp8Counts())
            if counts.encoded and step < counts.step:
                return
            if counts.encoded and step == counts.step:
                counts.overflow -= counts.last_overflow
                counts.underflow -= counts.last_underflow
            counts.encoded = True
            counts.step, counts.scale = step, scale
            counts.last_overflow, counts.last_underflow = overflow, underflow
            counts.overflow += overflow
            counts.underflow += underflow

    def param_fp8_figures(self) -> dict[str, Any]:
        """The FP8 params' counters as log page C6h carries them, per tensor encoded so far."""
        with self._lock:
            return {tensor: {key: value for key, value in dataclasses.asdict(self._param_fp8[tensor]).items()
                             if key != "encoded"}
                    for tensor in sorted(self._param_fp8)}

    def figures(self) -> dict[str, Any]:
        """The counters as log page C0h carries them: per tensor and moment, the totals since the
        namespace opened and the last committed step's own counts and block scales."""
        with self._lock:
            tensors = {}
            for tensor in sorted(self._totals):
                last = self._last.get(tensor, StateCounts())
                tensors[tensor] = {moment: _moment_figures(getattr(self._totals[tensor], moment), getattr(last, moment))
                                   for moment in MOMENTS}
            return {"last_step": self._last_step, "tensors": tensors}


@dataclasses.dataclass
class GradScaleCounts:
    """One tensor's FP8 gradient figures: the last step that brought its scales, their range
    over its slices (scale_min is the whole tensor's current-scaling scale: the largest slice
    amax sets it), and the counts, those of that step and totals since the namespace opened."""

    step: int = 0
    scale_min: float = 0.0
    scale_max: float = 0.0
    slices: int = 0  # the scaled slices of the tensor in that step (one per rank or piece that sent it)
    last_underflow: int = 0
    last_saturated: int = 0
    underflow: int = 0  # nonzero gradient elements the trainer's encoding flushed to zero
    saturated: int = 0  # finite gradient elements the trainer clamped to the format's largest value
    nonfinite: int = 0  # inf/NaN gradient elements the device found in this tensor's blocks


@dataclasses.dataclass
class ParamFp8Counts:
    """One tensor's FP8 params-out figures: the last step whose params the device encoded, the
    scale it used (code = param * scale) and that encoding's counts, and the totals over steps
    since the namespace opened."""

    encoded: bool = False  # any step encoded yet (step 0, the initial masters, is one)
    step: int = 0
    scale: float = 0.0
    last_overflow: int = 0
    last_underflow: int = 0
    overflow: int = 0  # finite masters beyond the format's largest value times the scale (saturated), and infs
    underflow: int = 0  # nonzero masters whose code is zero


def _moment_figures(total: MomentCounts, last: MomentCounts) -> dict[str, Any]:
    return {
        "underflow_total": total.underflow,
        "overflow_total": total.overflow,
        "last_step_underflow": last.underflow,
        "last_step_overflow": last.overflow,
        # FP16: the decode factor 2^-k (the exponent follows from it); INT8: the absmax.
        "scale_min": last.scale_min,
        "scale_max": last.scale_max,
        "scaled_blocks": last.scaled_blocks,
    }


# ---------------------------------------------------------------------------- log page C6h


def page(device: Any, nsid: int | None) -> dict[str, Any]:
    """Log page C6h's JSON: per optimizer namespace with block-scaled moments (fp16, int8), FP8
    gradients or FP8 params out, its state_dtype and counters (the moments' under "last_step" and
    "tensors", the FP8 gradients' under "grad_fp8" with the namespace's grad_dtype, the FP8
    params' under "param_fp8" with its param_wire_dtype); nsid None for every namespace."""
    optimizers = (ns.as_optimizer() for ns in list(device.namespaces.values()))  # list: one atomic copy
    namespaces = sorted((ns for ns in optimizers
                         if ns is not None and (ns.spec.scaled_state or ns.spec.grad_dtype in FP8_GRAD_DTYPES
                                                or ns.spec.param_wire_dtype)
                         and (nsid is None or ns.nsid == nsid)),
                        key=lambda ns: ns.nsid)  # fmt: skip
    out: dict[str, Any] = {}
    for ns in namespaces:
        figures: dict[str, Any] = {"state_dtype": ns.spec.state_dtype}
        if ns.spec.scaled_state:
            figures.update(ns.state_counter_figures())
        if ns.spec.grad_dtype in FP8_GRAD_DTYPES:
            figures["grad_dtype"] = ns.spec.grad_dtype
            figures["grad_fp8"] = ns.core.state_counters.fp8_figures()
        if ns.spec.param_wire_dtype:
            figures["param_wire_dtype"] = ns.spec.param_wire_dtype
            figures["param_fp8"] = ns.core.state_counters.param_fp8_figures()
        out[ns.name] = figures
    return out


def handlers(controller: Any) -> dict[int, Any]:
    """A command module (controller.COMMAND_MODULES): adds log page C6h, no commands."""
    import json

    from ..protocol.entries import NSID_ALL
    from ..protocol.logpages import LogId

    def state_counters_page(command: Any) -> bytes:
        nsid = None if command.nsid in (0, NSID_ALL) else controller.device.namespace_by_id(command.nsid).nsid
        return json.dumps(page(controller.device, nsid), sort_keys=True).encode()

    controller.log_pages[LogId.STATE_COUNTERS] = state_counters_page
    return {}
