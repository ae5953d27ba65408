"""Wrappers of the block-scaled moment formats (FP16 with a power-of-two scale per block, INT8 with a dynamic map and an absmax per block): the step, encode/decode and the INT8 maps.

A moment in FP16 or INT8 is two arrays: its codes (uint16 or uint8, one per element) and its
scales (float32, one per STATE_BLOCK elements, ceil(n / STATE_BLOCK)). docs/kernels.md,
"Block-scaled moments", defines both formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._cossd_kernels import ffi as _ffi
from ._cossd_kernels import lib as _lib
from .hyper import AdamScalars
from .ops import _check_rc, crc32c, crc32c_combine
from .validation import (
    _F32,
    _F32_CTYPE,
    BLOCK_SCALED_FORMATS,
    STATE_BLOCK,
    GradFormat,
    HalfFormat,
    KernelArgumentError,
    Moment,
    StateFormat,
    _buf,
    _check_lengths,
    _check_overlap,
    _enum_arg,
    _grad_buf,
    _grad_format_arg,
    _half_dtypes,
    _state_buffers,
    _state_ctype,
    _state_dtypes,
)


def state_scale_count(n: int) -> int:
    """How many scales a block-scaled moment of n elements keeps: one per STATE_BLOCK."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise KernelArgumentError(f"n must be a non-negative int, got {n!r}")
    return -(-int(n) // STATE_BLOCK)


def state_bytes_per_element(state_format: StateFormat) -> float:
    """Bytes one moment element takes, its share of the block scale included (FP16 2.0156, INT8 1.0156)."""
    sfmt = StateFormat(_enum_arg("state_format", state_format, StateFormat))
    itemsize = _state_dtypes(sfmt)[0].itemsize
    return itemsize + (4 / STATE_BLOCK if sfmt in BLOCK_SCALED_FORMATS else 0.0)


@dataclass
class MomentCounts:
    """What the encoder of one moment saw over the elements of a step (or a sum of steps).

    underflow: nonzero new values whose code is zero (exp_avg_sq: whose code would be zero and
    was raised to the smallest positive one, keeping the sign but not the value). overflow:
    elements whose code decodes to inf or NaN (FP16: per element; INT8: every element of a block
    holding a non-finite value). scale_min/scale_max: the least and greatest block scale stored
    (FP16 the decode factor 2^-k, INT8 the absmax) over scaled_blocks blocks whose largest value
    is nonzero and finite (0 and 0 where there are none)."""

    underflow: int = 0
    overflow: int = 0
    scaled_blocks: int = 0
    scale_min: float = 0.0
    scale_max: float = 0.0

    def merge(self, other: "MomentCounts") -> None:
        """Adds other's counts and widens the scale range by other's (a range of no blocks is none)."""
        if other.scaled_blocks:
            if self.scaled_blocks:
                self.scale_min = min(self.scale_min, other.scale_min)
                self.scale_max = max(self.scale_max, other.scale_max)
            else:
                self.scale_min, self.scale_max = other.scale_min, other.scale_max
        self.underflow += other.underflow
        self.overflow += other.overflow
        self.scaled_blocks += other.scaled_blocks


@dataclass
class StateCounts:
    """The counters of both moments of a block-scaled step (kernels/qstate_counts.h)."""

    exp_avg: MomentCounts = field(default_factory=MomentCounts)
    exp_avg_sq: MomentCounts = field(default_factory=MomentCounts)

    def merge(self, other: "StateCounts") -> None:
        self.exp_avg.merge(other.exp_avg)
        self.exp_avg_sq.merge(other.exp_avg_sq)

    def _load(self, c: Any) -> None:
        """Overwrite from a filled cossd_qstate_counts."""
        for index, moment in enumerate((self.exp_avg, self.exp_avg_sq)):
            moment.underflow = int(c.underflow[index])
            moment.overflow = int(c.overflow[index])
            moment.scaled_blocks = int(c.scaled_blocks[index])
            moment.scale_min = float(c.scale_min[index])
            moment.scale_max = float(c.scale_max[index])


_SCALE_NAMES = ("exp_avg_scale_in", "exp_avg_sq_scale_in", "exp_avg_scale_out", "exp_avg_sq_scale_out")


def _scale_buffers(scales: tuple[Any, Any, Any, Any], n: int) -> list[Any]:
    """The four scale arrays of a step, each checked: float32, ceil(n / STATE_BLOCK) long."""
    want = state_scale_count(n)
    bufs = []
    for name, obj, output in zip(_SCALE_NAMES, scales, (False, False, True, True)):
        if obj is None:
            raise KernelArgumentError(f"{name} is required for a block-scaled state format")
        b = _buf(name, obj, (_F32,), _F32_CTYPE, output=output)
        if b.arr.size != want:
            raise KernelArgumentError(f"{name} has {b.arr.size} scales; {n} elements need {want}")
        bufs.append(b)
    return bufs


def adam_step_q(
    grad: Any,
    master_in: Any,
    exp_avg_in: Any,
    exp_avg_sq_in: Any,
    master_out: Any,
    exp_avg_out: Any,
    exp_avg_sq_out: Any,
    param_out: Any,
    *,
    exp_avg_scale_in: Any = None,
    exp_avg_sq_scale_in: Any = None,
    exp_avg_scale_out: Any = None,
    exp_avg_sq_scale_out: Any = None,
    grad_format: GradFormat | HalfFormat,
    param_format: HalfFormat,
    state_format: StateFormat,
    scalars: AdamScalars,
    counts: StateCounts | None = None,
) -> None:
    """One Adam/AdamW step over moments in any state format. For FP16 and INT8 the four scale
    arrays are required; each block's new scale is chosen from its new values. Outputs may be
    the very same buffers as their inputs (scales included); no other overlap is allowed.
    FP32 and BF16 ignore the scales and run adam_step's kernel. `counts`, where given, is
    overwritten with the encoders' counters of this call (all zero for FP32 and BF16)."""
    if counts is not None and not isinstance(counts, StateCounts):
        raise KernelArgumentError(f"counts must be a StateCounts, got {type(counts).__name__}")
    gfmt = _grad_format_arg(grad_format)
    pfmt = _enum_arg("param_format", param_format, HalfFormat)
    sfmt = _enum_arg("state_format", state_format, StateFormat)
    if not isinstance(scalars, AdamScalars):
        raise KernelArgumentError(f"scalars must come from adam_scalars(), got {type(scalars).__name__}")
    g = _grad_buf(grad, gfmt)
    state = _state_buffers(master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out, exp_avg_sq_out,
                           param_out, sfmt, _half_dtypes(pfmt))
    n = _check_lengths([g, *state])
    scales = (exp_avg_scale_in, exp_avg_sq_scale_in, exp_avg_scale_out, exp_avg_sq_scale_out)
    if sfmt in BLOCK_SCALED_FORMATS:
        sbufs = _scale_buffers(scales, n)
        scale_ptrs = [b.ptr for b in sbufs]
    else:
        sbufs, scale_ptrs = [], [_ffi.NULL] * 4
    pairs = frozenset({("master_in", "master_out"), ("exp_avg_in", "exp_avg_out"),
                       ("exp_avg_sq_in", "exp_avg_sq_out"), ("exp_avg_scale_in", "exp_avg_scale_out"),
                       ("exp_avg_sq_scale_in", "exp_avg_sq_scale_out")})
    _check_overlap([g, *state, *sbufs], pairs)
    c_counts = _ffi.new("cossd_qstate_counts *")  # zero-filled: what an empty call reports
    if n:
        mi, ai, vi, mo, ao, vo, po = (b.ptr for b in state)
        asi, vsi, aso, vso = scale_ptrs
        _check_rc(_lib.cossd_adam_step_q_counted(g.ptr, gfmt, mi, ai, asi, vi, vsi, mo, ao, aso, vo, vso, sfmt, po,
                                                 pfmt, n, scalars._c, c_counts), "adam_step_q")
    if counts is not None:
        counts._load(c_counts)


def adam_step_q_crcs(
    grad: Any,
    master_in: Any,
    exp_avg_in: Any,
    exp_avg_scale_in: Any,
    exp_avg_sq_in: Any,
    exp_avg_sq_scale_in: Any,
    master_out: Any,
    exp_avg_out: Any,
    exp_avg_scale_out: Any,
    exp_avg_sq_out: Any,
    exp_avg_sq_scale_out: Any,
    param_out: Any,
    *,
    grad_format: GradFormat | HalfFormat,
    param_format: HalfFormat,
    state_format: StateFormat,
    scalars: AdamScalars,
    param_copy: Any = None,
    counts: StateCounts | None = None,
) -> tuple[int, int]:
    """The device's block update for a block-scaled state format: adam_step_q out of place
    (the committed copy in, the shadow out), then (the block CRC32C, the params' CRC32C).

    The block CRC chains the six output arrays in media order: master, exp_avg codes, their
    scales, exp_avg_sq codes, their scales, param; so a torn scale fails the block as a torn
    moment does. `param_copy` (as many 16-bit elements) receives the new params too. The
    outputs may not overlap the inputs: the shadow copy is never the committed one. `counts`,
    where given, receives the encoders' counters (adam_step_q).
    """
    sfmt = _enum_arg("state_format", state_format, StateFormat)
    if sfmt not in BLOCK_SCALED_FORMATS:
        raise KernelArgumentError(f"adam_step_q_crcs runs the block-scaled formats (FP16, INT8); "
                                  f"{StateFormat(sfmt).name} runs through BlockUpdate or adam_step_crcs")
    outputs = (master_out, exp_avg_out, exp_avg_scale_out, exp_avg_sq_out, exp_avg_sq_scale_out, param_out)
    inputs = (master_in, exp_avg_in, exp_avg_scale_in, exp_avg_sq_in, exp_avg_sq_scale_in)
    for out in outputs:
        if any(np.shares_memory(np.asarray(out), np.asarray(inp)) for inp in inputs):
            raise KernelArgumentError("adam_step_q_crcs steps out of place: an output overlaps an input")
    adam_step_q(grad, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out, exp_avg_sq_out, param_out,
                exp_avg_scale_in=exp_avg_scale_in, exp_avg_sq_scale_in=exp_avg_sq_scale_in,
                exp_avg_scale_out=exp_avg_scale_out, exp_avg_sq_scale_out=exp_avg_sq_scale_out,
                grad_format=grad_format, param_format=param_format, state_format=StateFormat(sfmt), scalars=scalars,
                counts=counts)
    if param_copy is not None:
        copy = np.asarray(param_copy)
        if copy.size != np.asarray(param_out).size or copy.dtype.itemsize != 2:
            raise KernelArgumentError(f"param_copy must hold {np.asarray(param_out).size} 16-bit elements")
        copy[...] = np.asarray(param_out).view(copy.dtype)
    block = 0
    for out in outputs[:-1]:
        block = crc32c(out, block)
    param_crc = crc32c(param_out)
    return crc32c_combine(block, param_crc, np.asarray(param_out).nbytes), param_crc


def encode_state(x: Any, codes_out: Any, scales_out: Any = None, *, state_format: StateFormat,
                 moment: Moment) -> None:
    """FP32 moments into a state format's codes (and, for FP16/INT8, its per-block scales),
    exactly as the step encodes its new moments; blocks start at element 0 of x."""
    sfmt = _enum_arg("state_format", state_format, StateFormat)
    mom = _enum_arg("moment", moment, Moment)
    src = _buf("x", x, (_F32,), _F32_CTYPE)
    dst = _buf("codes_out", codes_out, _state_dtypes(sfmt), _state_ctype(sfmt), output=True)
    bufs = [src, dst]
    n = _check_lengths(bufs)
    sptr = _ffi.NULL
    if sfmt in BLOCK_SCALED_FORMATS:
        if scales_out is None:
            raise KernelArgumentError("scales_out is required for a block-scaled state format")
        s = _buf("scales_out", scales_out, (_F32,), _F32_CTYPE, output=True)
        if s.arr.size != state_scale_count(n):
            raise KernelArgumentError(f"scales_out has {s.arr.size} scales; {n} elements need {state_scale_count(n)}")
        bufs.append(s)
        sptr = s.ptr
    _check_overlap(bufs)
    if n:
        _check_rc(_lib.cossd_state_encode(src.ptr, n, sfmt, mom, dst.ptr, sptr), "encode_state")


def decode_state(codes: Any, scales: Any, out: Any, *, state_format: StateFormat, moment: Moment) -> None:
    """A moment's codes (and per-block scales) back to FP32: code times scale, exact."""
    sfmt = _enum_arg("state_format", state_format, StateFormat)
    mom = _enum_arg("moment", moment, Moment)
    src = _buf("codes", codes, _state_dtypes(sfmt), _state_ctype(sfmt))
    dst = _buf("out", out, (_F32,), _F32_CTYPE, output=True)
    bufs = [src, dst]
    n = _check_lengths(bufs)
    sptr = _ffi.NULL
    if sfmt in BLOCK_SCALED_FORMATS:
        if scales is None:
            raise KernelArgumentError("scales is required for a block-scaled state format")
        s = _buf("scales", scales, (_F32,), _F32_CTYPE)
        if s.arr.size != state_scale_count(n):
            raise KernelArgumentError(f"scales has {s.arr.size} scales; {n} elements need {state_scale_count(n)}")
        bufs.append(s)
        sptr = s.ptr
    _check_overlap(bufs)
    if n:
        _check_rc(_lib.cossd_state_decode(src.ptr, sptr, n, sfmt, mom, dst.ptr), "decode_state")


def state_map(moment: Moment) -> np.ndarray:
    """The INT8 map of a moment: 256 float32 values, ascending; an INT8 code indexes it."""
    mom = _enum_arg("moment", moment, Moment)
    out = np.empty(256, dtype=np.float32)
    _check_rc(_lib.cossd_state_map(mom, _ffi.cast("float *", out.ctypes.data)), "state_map")
    return out
