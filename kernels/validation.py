"""Argument checks of the kernel wrappers: the formats, the error they raise, and buffers viewed without copying (dtype, contiguity, alignment, writability, lengths, overlaps).

The kernels write into caller-owned memory, so a silent copy would silently lose the
result: every check here raises KernelArgumentError instead of copying.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import numpy as np

from ._cossd_kernels import ffi as _ffi


class HalfFormat(enum.IntEnum):
    """Format of a 16-bit buffer (gradients, params); values match the C enum."""

    FP16 = 0
    BF16 = 1


class GradFormat(enum.IntEnum):
    """Format of a gradient buffer; values match the C enum (COSSD_HALF_*, COSSD_GRAD_*). FP16 and
    BF16 are HalfFormat's values; FP32 takes 4 bytes an element, the OCP FP8 formats one (their
    per-tensor scale is folded into the step's grad_scale by the caller)."""

    FP16 = 0
    BF16 = 1
    FP32 = 2
    FP8_E4M3 = 3
    FP8_E5M2 = 4


# Bytes of one gradient element per format.
GRAD_ITEMSIZE = {GradFormat.FP16: 2, GradFormat.BF16: 2, GradFormat.FP32: 4, GradFormat.FP8_E4M3: 1,
                 GradFormat.FP8_E5M2: 1}


class StateFormat(enum.IntEnum):
    """Storage format of the Adam moments; values match the C enum. FP32 and BF16 are
    elementwise; FP16 (scaled) and INT8 (block-wise, dynamic map) keep one FP32 scale per
    STATE_BLOCK elements beside their codes and step through adam_step_q."""

    FP32 = 0
    BF16 = 1
    FP16 = 2
    INT8 = 3


# The formats whose moments need a scale per block (docs/kernels.md, "Block-scaled moments").
BLOCK_SCALED_FORMATS = frozenset({StateFormat.FP16, StateFormat.INT8})
STATE_BLOCK = 256  # elements per scale: COSSD_STATE_BLOCK


class Moment(enum.IntEnum):
    """Which Adam moment a buffer holds: INT8 maps exp_avg (signed) and exp_avg_sq (unsigned) differently."""

    EXP_AVG = 0
    EXP_AVG_SQ = 1


class KernelArgumentError(ValueError):
    """An argument to a kernel was invalid; the message names the argument."""


_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_U16 = np.dtype(np.uint16)
_U8 = np.dtype(np.uint8)
_RAW_BYTE_FORMATS = ("B", "b", "c")


def _enum_arg(name: str, value: Any, kind: type[enum.IntEnum]) -> int:
    """Accept an instance of `kind` or a plain int naming one of its values."""
    if isinstance(value, kind):
        return int(value)
    if isinstance(value, (bool, enum.Enum)) or not isinstance(value, (int, np.integer)):
        raise KernelArgumentError(f"{name} must be a {kind.__name__}, got {value!r}")
    try:
        return int(kind(int(value)))
    except ValueError:
        raise KernelArgumentError(
            f"{name} must be a {kind.__name__} ({', '.join(m.name for m in kind)}), got {value!r}"
        ) from None


def _as_array(name: str, obj: Any, dtypes: tuple[np.dtype, ...], writable: bool, aligned: bool = True) -> np.ndarray:
    """View obj as a C-contiguous ndarray of one of `dtypes` without copying, or raise.
    aligned=False: it may start at any byte, for a buffer the C side only copies with memcpy
    or loads with unaligned vector loads (a lent gradient, which a network receive buffer may
    hold at an odd offset)."""
    if isinstance(obj, np.ndarray):
        arr = obj
    else:
        try:
            view = memoryview(obj)
        except TypeError:
            raise KernelArgumentError(
                f"{name} must be a numpy array or a buffer object, got {type(obj).__name__}"
            ) from None
        if not view.c_contiguous:
            raise KernelArgumentError(f"{name} must be C-contiguous")
        if view.format not in _RAW_BYTE_FORMATS and view.itemsize != dtypes[0].itemsize:
            raise KernelArgumentError(
                f"{name} has item size {view.itemsize}, expected {dtypes[0].itemsize} (dtype {dtypes[0]})"
            )
        if view.nbytes % dtypes[0].itemsize:
            raise KernelArgumentError(f"{name} has {view.nbytes} bytes, not a multiple of {dtypes[0].itemsize}")
        arr = np.frombuffer(view, dtype=dtypes[0])  # zero-copy; read-only if the buffer is
    if arr.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise KernelArgumentError(f"{name} must have dtype {expected}, got {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise KernelArgumentError(f"{name} must be C-contiguous (got a strided view); pass a contiguous array")
    if aligned and not arr.flags.aligned:
        raise KernelArgumentError(f"{name} is not aligned to its item size")
    if writable and not arr.flags.writeable:
        raise KernelArgumentError(f"{name} is an output and must be writeable")
    return arr


def _grad_format_arg(value: Any, name: str = "grad_format") -> int:
    """A gradient format: a GradFormat, a HalfFormat (the same values) or an int naming one."""
    if isinstance(value, HalfFormat):
        return int(value)
    return _enum_arg(name, value, GradFormat)


def _grad_buf(obj: Any, gfmt: int, name: str = "grad", output: bool = False, aligned: bool = True) -> "_Buf":
    """The gradient buffer of format gfmt: float32 for FP32, uint8 codes for FP8, else 16-bit
    (aligned=False: see _as_array)."""
    if gfmt == GradFormat.FP32:
        return _buf(name, obj, (_F32,), _F32_CTYPE, output, aligned)
    if gfmt in (GradFormat.FP8_E4M3, GradFormat.FP8_E5M2):
        return _buf(name, obj, (_U8,), "uint8_t[]", output, aligned)
    return _buf(name, obj, _half_dtypes(gfmt), _HALF_CTYPE, output, aligned)


def _half_dtypes(fmt: int) -> tuple[np.dtype, ...]:
    """float16 arrays only make sense as FP16; bf16 bits travel as uint16."""
    return (_U16, _F16) if fmt == HalfFormat.FP16 else (_U16,)


def _state_dtypes(fmt: int) -> tuple[np.dtype, ...]:
    """The dtypes a moment buffer of format fmt may have (FP16 codes: raw bits or float16)."""
    accepted: dict[StateFormat, tuple[np.dtype, ...]] = {
        StateFormat.FP32: (_F32,), StateFormat.BF16: (_U16,), StateFormat.FP16: (_U16, _F16), StateFormat.INT8: (_U8,)}
    return accepted[StateFormat(fmt)]


_HALF_CTYPE = "uint16_t[]"
_F32_CTYPE = "float[]"


def _state_ctype(fmt: int) -> str:
    return {StateFormat.FP32: _F32_CTYPE, StateFormat.INT8: "uint8_t[]"}.get(StateFormat(fmt), _HALF_CTYPE)


def _elementwise_state(sfmt: int, what: str) -> None:
    """Refuse a block-scaled format where a call has no room for its scales."""
    if sfmt in BLOCK_SCALED_FORMATS:
        raise KernelArgumentError(
            f"{what}: state_format {StateFormat(sfmt).name} keeps a scale per {STATE_BLOCK}-element block; "
            "use adam_step_q (or BlockUpdateQ), which take the scale arrays"
        )


class _Buf(NamedTuple):
    """A validated buffer: its array, the cffi pointer handed to C and the byte range it covers."""

    name: str
    arr: np.ndarray
    ptr: Any
    start: int
    end: int
    output: bool


def _buf(name: str, obj: Any, dtypes: tuple[np.dtype, ...], ctype: str, output: bool = False,
         aligned: bool = True) -> _Buf:
    arr = _as_array(name, obj, dtypes, output, aligned)
    ptr = _ffi.from_buffer(ctype, arr, require_writable=output)
    # The address comes from the cffi pointer: cheaper than __array_interface__.
    start = int(_ffi.cast("uintptr_t", ptr))
    return _Buf(name, arr, ptr, start, start + arr.nbytes, output)


def _check_lengths(bufs: list[_Buf]) -> int:
    first = bufs[0]
    for b in bufs[1:]:
        if b.arr.size != first.arr.size:
            raise KernelArgumentError(f"{b.name} has {b.arr.size} elements but {first.name} has {first.arr.size}")
    return int(first.arr.size)


def _check_overlap(bufs: list[_Buf], in_place_pairs: frozenset[tuple[str, str]] = frozenset()) -> None:
    """Reject any overlap that involves an output, except an identical (input, output) pair.

    Inputs may overlap each other (they are only read). Buffers are
    C-contiguous, so [start, end) is exactly the memory a kernel touches.
    """
    live = [b for b in bufs if b.end > b.start]
    for i, a in enumerate(live):
        for b in live[i + 1 :]:
            if not (a.output or b.output) or a.end <= b.start or b.end <= a.start:
                continue
            if (a.start, a.end) != (b.start, b.end):
                raise KernelArgumentError(f"{a.name} and {b.name} partially overlap")
            if (a.name, b.name) not in in_place_pairs:
                raise KernelArgumentError(f"{a.name} and {b.name} are the same memory; only in/out pairs may be")


def _state_buffers(master_in: Any, exp_avg_in: Any, exp_avg_sq_in: Any, master_out: Any, exp_avg_out: Any,
                   exp_avg_sq_out: Any, param_out: Any, sfmt: int,
                   param_dtypes: tuple[np.dtype, ...]) -> list[_Buf]:
    """The seven state buffers of an Adam step, each checked (lengths and overlaps are the
    caller's): master, exp_avg, exp_avg_sq in and out, param out."""
    sdt, sct = _state_dtypes(sfmt), _state_ctype(sfmt)
    return [
        _buf("master_in", master_in, (_F32,), _F32_CTYPE),
        _buf("exp_avg_in", exp_avg_in, sdt, sct),
        _buf("exp_avg_sq_in", exp_avg_sq_in, sdt, sct),
        _buf("master_out", master_out, (_F32,), _F32_CTYPE, output=True),
        _buf("exp_avg_out", exp_avg_out, sdt, sct, output=True),
        _buf("exp_avg_sq_out", exp_avg_sq_out, sdt, sct, output=True),
        _buf("param_out", param_out, param_dtypes, _HALF_CTYPE, output=True),
    ]
