"""FP8 params out: each tensor's new params as OCP FP8 codes with a per-tensor power-of-two scale, made from the FP32 masters, for the param_fp8 files and the CMB step.

A namespace created with param_wire_dtype ("fp8_e4m3" or "fp8_e5m2") keeps its params on the
media as before (param_dtype, 2 bytes an element, in the block checksums; a restart's quick
restore reads those). What it adds is a form of them for the host link at 1 byte an element:
after a step, each tensor's FP32 masters times the scale of current scaling,
2^floor(log2(fp8_max / amax)) of their largest magnitude (kernels.fp8_params), encoded by the C
kernel (saturating; overflows and underflows counted).

Its bytes, the param_fp8 file of a tensor (and the CMB step's param place; protocol/param_fp8.py):
    bytes 0-7    the step these params belong to (uint64, little-endian)
    bytes 8-11   the scale (float32): code value = param * scale, so param = code / scale
    bytes 12-15  zero
    bytes 16-    one FP8 code per element
The scale and the step travel in the same bytes as the codes, so a reader has all three of
one step, or sees from the step which one it got.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...kernels import fp8_params
from ...protocol.param_fp8 import HEADER_BYTES, ROLE, header, out_bytes, parse_header
from ...protocol.status import DeviceError, Status
from ..geometry import Copy
from ..layout import TensorLayout

if TYPE_CHECKING:
    from .state import NamespaceCore

__all__ = ["HEADER_BYTES", "ROLE", "ParamFp8", "header", "out_bytes", "parse_header"]


class ParamFp8:
    """The committed step's FP8 params of each tensor, encoded on first use and kept until
    the committed copy changes (a commit, revert or rollback: the superblock's seq moves; while
    loading, any write of initial state).

    Caller holds the namespace lock for every method. The encoded arrays are never written
    after they are made, so a view of one stays valid after the lock is released.
    """

    def __init__(self, core: NamespaceCore, dtype: str) -> None:
        self.core = core
        self.dtype = dtype
        self._cached_for: tuple[int, Copy, int] | None = None  # (superblock seq, committed copy, loads)
        self._encoded: dict[str, np.ndarray] = {}
        # Each tensor's last step whose overflows and underflows are in the counters: a step
        # encoded twice (for the CMB before its commit, then for a file read) counts once.
        self._counted_step: dict[str, int] = {}
        self.overflows = 0
        self.underflows = 0

    def committed(self, tensor: TensorLayout, source: Copy | None = None) -> np.ndarray:
        """The param_fp8 bytes (header and codes) of `tensor` in the committed step. `source`:
        the copy a reader pinned; if a commit has moved past it meanwhile, refused."""
        sb = self.core.sb
        if source is not None and source != sb.committed_copy:
            raise DeviceError(Status.STEP_NUMBER_MISMATCH,
                              f"{tensor.name}/{ROLE}: a step committed during this read; read it again")
        # While loading, every write of initial state moves state_bytes_loaded: the masters changed.
        key = (sb.seq, sb.committed_copy, self.core.counters.state_bytes_loaded if self.core.loading else -1)
        if key != self._cached_for:
            self._cached_for = key
            self._encoded = {}
        encoded = self._encoded.get(tensor.name)
        if encoded is None:
            encoded = self._encoded[tensor.name] = self.encode(sb.committed_copy, tensor, sb.committed_step)
        return encoded

    def encode(self, copy: Copy, tensor: TensorLayout, step: int) -> np.ndarray:
        """Header and codes of `tensor`'s masters in `copy`, labelled `step`."""
        master = self.core.view(copy, tensor, "master")
        scale = fp8_params.fp8_scale(fp8_params.absmax(master), self.dtype)
        out = np.empty(out_bytes(tensor.numel), dtype=np.uint8)
        out[:HEADER_BYTES] = np.frombuffer(header(step, scale), dtype=np.uint8)
        overflows, underflows = fp8_params.fp8_encode(master, scale, self.dtype, out[HEADER_BYTES:])
        # Per tensor, for log page C6h and /metrics (emulator/state_counters.py).
        self.core.state_counters.param_fp8_encoded(tensor.name, step, scale, overflows, underflows)
        if self._counted_step.get(tensor.name, -1) < step:
            self._counted_step[tensor.name] = step
            self.overflows += overflows
            self.underflows += underflows
        return out

    def fill_step_places(self, places: list[tuple[TensorLayout, np.ndarray]]) -> None:
        """Put each tensor's FP8 params in its CMB place after a CMB_WRITE of its whole gradient
        (Namespace.fill_param_fp8_places): the open step's new masters where it has
        run every block of them and met no error and no non-finite gradient, labelled with its
        step; else the committed step's. A step that ends otherwise than its label says (skipped
        later, or aborted) leaves places whose step is not the committed one: the reader checks
        the label against the step it committed and reads the param_fp8 file instead."""
        tx = self.core.tx
        for tensor, place in places:
            if tx is not None and tx.error is None and not tx.nonfinite and not tx.missing([tensor], 1):
                place[:] = self.encode(self.core.sb.committed_copy.other, tensor, tx.step)
            else:
                place[:] = self.committed(tensor)
        # Param bytes to the host, as a read of the param_fp8 files would count them.
        moved = sum(len(place) for _, place in places)
        self.core.counters.bytes_read += moved
        self.core.counters.param_bytes_out += moved
        self.core.timing.add(host_out=moved)
