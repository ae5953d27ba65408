"""Per-tensor counters of a namespace's block-scaled moments (fp16, int8): underflows, overflows and block scales, from the kernel's counts, folded in at each commit."""
from __future__ import annotations

import threading
from typing import Any

from ..kernels.state_formats import MomentCounts, StateCounts

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
    """Log page C6h's JSON: per optimizer namespace with block-scaled moments (fp16, int8), its
    state_dtype and counters; nsid None for every namespace."""
    optimizers = (ns.as_optimizer() for ns in list(device.namespaces.values()))  # list: one atomic copy
    namespaces = sorted((ns for ns in optimizers
                         if ns is not None and ns.spec.scaled_state and (nsid is None or ns.nsid == nsid)),
                        key=lambda ns: ns.nsid)  # fmt: skip
    return {ns.name: {"state_dtype": ns.spec.state_dtype, **ns.state_counter_figures()} for ns in namespaces}


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
