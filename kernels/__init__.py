"""cossd.kernels: stateless elementwise C kernels (Adam step, half<->FP32 conversion, non-finite count, CRC32C) behind a validating numpy wrapper.

The wrapper imports only numpy and cffi (plus the standard library). Every
function validates its buffers and raises KernelArgumentError instead of
copying: the kernels write into caller-owned memory, so a silent copy would
silently lose the result. Calls go through cffi's API mode, which releases the
GIL, so several threads may run kernels on disjoint buffers in parallel.
"""

from __future__ import annotations

import enum
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ._cossd_kernels import ffi as _ffi
from ._cossd_kernels import lib as _lib

__all__ = [
    "HalfFormat",
    "StateFormat",
    "KernelArgumentError",
    "AdamHyper",
    "AdamScalars",
    "adam_scalars",
    "adam_step",
    "adam_step_crc",
    "BlockUpdate",
    "count_nonfinite",
    "master_to_param",
    "param_to_master",
    "crc32c",
    "crc32c_combine",
    "stream_probe",
    "simd_level",
    "available_kernels",
    "use_kernel",
    "use_simd",
    "stream_threshold",
    "set_stream_threshold",
    "stream_plan",
]


class HalfFormat(enum.IntEnum):
    """Format of a 16-bit buffer (gradients, params); values match the C enum."""

    FP16 = 0
    BF16 = 1


class StateFormat(enum.IntEnum):
    """Storage format of the Adam moments; values match the C enum."""

    FP32 = 0
    BF16 = 1


class KernelArgumentError(ValueError):
    """An argument to a kernel was invalid; the message names the argument."""


_COUNT_ERROR = int(_ffi.cast("size_t", -1))
_RC_MESSAGES = {
    _lib.COSSD_ERR_NULL: "null buffer pointer",
    _lib.COSSD_ERR_FORMAT: "bad format enum",
    _lib.COSSD_ERR_UNSUPPORTED: "SIMD path not supported on this CPU",
}

# ---------------------------------------------------------------------------
# Hyperparameters and per-step scalars
# ---------------------------------------------------------------------------


def _check_real(name: str, value: Any) -> float:
    """Return value as float, rejecting bools, non-numbers and non-finite values."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise KernelArgumentError(f"{name} must be a real number, got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise KernelArgumentError(f"{name} must be finite, got {result!r}")
    return result


@dataclass(frozen=True)
class AdamHyper:
    """Adam/AdamW hyperparameters; decoupled=True is AdamW, False is Adam with L2 weight decay."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool

    def __post_init__(self) -> None:
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            object.__setattr__(self, name, _check_real(name, getattr(self, name)))
        if self.lr < 0:
            raise KernelArgumentError(f"lr must be >= 0, got {self.lr!r}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise KernelArgumentError(f"{name} must satisfy 0 <= {name} < 1, got {value!r}")
        if not self.eps > 0:
            raise KernelArgumentError(f"eps must be > 0, got {self.eps!r}")
        if self.weight_decay < 0:
            raise KernelArgumentError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if not isinstance(self.decoupled, (bool, np.bool_)):
            raise KernelArgumentError(f"decoupled must be a bool, got {type(self.decoupled).__name__}")
        object.__setattr__(self, "decoupled", bool(self.decoupled))


@dataclass(frozen=True)
class AdamScalars:
    """Per-step scalars for the C kernel, computed in float64; the C struct rounds them to float32."""

    grad_scale: float
    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    eps: float
    step_size: float
    bias_correction2_sqrt: float
    decay: float
    weight_decay: float
    decoupled: bool
    # Built once so repeated kernel calls do not re-create it; read-only, so
    # sharing it between threads is safe.
    _c: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        c = _ffi.new("cossd_adam_scalars *")
        for name in (
            "grad_scale",
            "beta1",
            "beta2",
            "one_minus_beta1",
            "one_minus_beta2",
            "eps",
            "step_size",
            "bias_correction2_sqrt",
            "decay",
            "weight_decay",
        ):
            setattr(c, name, getattr(self, name))
            # The C struct rounds to float32; a value that overflows (or an eps
            # that underflows to 0) would silently turn the step into inf/NaN.
            if not math.isfinite(getattr(c, name)):
                raise KernelArgumentError(f"{name}={getattr(self, name)!r} is not representable as a finite float32")
        if not c.eps > 0:
            raise KernelArgumentError(f"eps={self.eps!r} rounds to 0 in float32")
        c.decoupled = 1 if self.decoupled else 0
        object.__setattr__(self, "_c", c)


def adam_scalars(hyper: AdamHyper, step: int, grad_scale: float = 1.0) -> AdamScalars:
    """Compute the scalars of Adam step `step` (1-based) exactly as torch.optim's single-tensor Adam/AdamW does."""
    if not isinstance(hyper, AdamHyper):
        raise KernelArgumentError(f"hyper must be an AdamHyper, got {type(hyper).__name__}")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise KernelArgumentError(f"step must be an int, got {type(step).__name__}")
    step = int(step)
    if step < 1:
        raise KernelArgumentError(f"step must be >= 1, got {step}")
    grad_scale = _check_real("grad_scale", grad_scale)
    if not grad_scale > 0:
        raise KernelArgumentError(f"grad_scale must be > 0, got {grad_scale!r}")
    # Same float64 expressions as torch/optim/adam.py (_single_tensor_adam).
    bias_correction1 = 1 - hyper.beta1**step
    bias_correction2 = 1 - hyper.beta2**step
    step_size = hyper.lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    decay = 1 - hyper.lr * hyper.weight_decay if hyper.decoupled else 1.0
    # AdamScalars rejects values that do not fit float32 (e.g. a huge lr).
    return AdamScalars(
        grad_scale=grad_scale,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        one_minus_beta1=1 - hyper.beta1,
        one_minus_beta2=1 - hyper.beta2,
        eps=hyper.eps,
        step_size=step_size,
        bias_correction2_sqrt=bias_correction2_sqrt,
        decay=decay,
        weight_decay=hyper.weight_decay,
        decoupled=hyper.decoupled,
    )


# ---------------------------------------------------------------------------
# Buffer validation
# ---------------------------------------------------------------------------

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_U16 = np.dtype(np.uint16)
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


def _as_array(name: str, obj: Any, dtypes: tuple[np.dtype, ...], writable: bool) -> np.ndarray:
    """View obj as a C-contiguous ndarray of one of `dtypes` without copying, or raise."""
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
    if not arr.flags.aligned:
        raise KernelArgumentError(f"{name} is not aligned to its item size")
    if writable and not arr.flags.writeable:
        raise KernelArgumentError(f"{name} is an output and must be writeable")
    return arr


def _half_dtypes(fmt: int) -> tuple[np.dtype, ...]:
    """float16 arrays only make sense as FP16; bf16 bits travel as uint16."""
    return (_U16, _F16) if fmt == HalfFormat.FP16 else (_U16,)


def _state_dtypes(fmt: int) -> tuple[np.dtype, ...]:
    return (_F32,) if fmt == StateFormat.FP32 else (_U16,)


_HALF_CTYPE = "uint16_t[]"
_F32_CTYPE = "float[]"


def _state_ctype(fmt: int) -> str:
    return _F32_CTYPE if fmt == StateFormat.FP32 else _HALF_CTYPE


class _Buf(NamedTuple):
    """A validated buffer: its array, the cffi pointer handed to C and the byte range it covers."""

    name: str
    arr: np.ndarray
    ptr: Any
    start: int
    end: int
    output: bool


def _buf(name: str, obj: Any, dtypes: tuple[np.dtype, ...], ctype: str, output: bool = False) -> _Buf:
    arr = _as_array(name, obj, dtypes, output)
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


def _check_rc(rc: int, what: str) -> None:
    if rc != 0:
        # The wrapper validated everything, so reaching this is a wrapper bug.
        raise KernelArgumentError(f"{what}: C kernel rejected its arguments ({_RC_MESSAGES.get(rc, rc)})")


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------

_ADAM_IN_PLACE = frozenset(
    {("master_in", "master_out"), ("exp_avg_in", "exp_avg_out"), ("exp_avg_sq_in", "exp_avg_sq_out")}
)


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


def _adam_buffers(
    grad: Any, master_in: Any, exp_avg_in: Any, exp_avg_sq_in: Any, master_out: Any,
    exp_avg_out: Any, exp_avg_sq_out: Any, param_out: Any, grad_format: HalfFormat,
    param_format: HalfFormat, state_format: StateFormat, scalars: AdamScalars,
    in_place: frozenset[tuple[str, str]],
) -> tuple[list[Any], int]:
    """The C arguments of an Adam step after checking them all: (args, element count)."""
    gfmt = _enum_arg("grad_format", grad_format, HalfFormat)
    pfmt = _enum_arg("param_format", param_format, HalfFormat)
    sfmt = _enum_arg("state_format", state_format, StateFormat)
    if not isinstance(scalars, AdamScalars):
        raise KernelArgumentError(f"scalars must come from adam_scalars(), got {type(scalars).__name__}")
    g = _buf("grad", grad, _half_dtypes(gfmt), _HALF_CTYPE)
    state = _state_buffers(master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out, exp_avg_sq_out,
                           param_out, sfmt, _half_dtypes(pfmt))
    mi, ai, vi, mo, ao, vo, po = state
    bufs = [g, *state]
    n = _check_lengths(bufs)
    _check_overlap(bufs, in_place)
    args = [g.ptr, gfmt, mi.ptr, ai.ptr, vi.ptr, mo.ptr, ao.ptr, vo.ptr, sfmt, po.ptr, pfmt, n, scalars._c]
    return args, n


def adam_step(
    grad: Any,
    master_in: Any,
    exp_avg_in: Any,
    exp_avg_sq_in: Any,
    master_out: Any,
    exp_avg_out: Any,
    exp_avg_sq_out: Any,
    param_out: Any,
    *,
    grad_format: HalfFormat,
    param_format: HalfFormat,
    state_format: StateFormat,
    scalars: AdamScalars,
) -> None:
    """One Adam/AdamW step over all elements; outputs may be the very same buffers as the matching inputs."""
    args, n = _adam_buffers(grad, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                            exp_avg_sq_out, param_out, grad_format, param_format, state_format,
                            scalars, _ADAM_IN_PLACE)
    if n:
        _check_rc(_lib.cossd_adam_step(*args), "adam_step")


def adam_step_crc(
    grad: Any,
    master_in: Any,
    exp_avg_in: Any,
    exp_avg_sq_in: Any,
    master_out: Any,
    exp_avg_out: Any,
    exp_avg_sq_out: Any,
    param_out: Any,
    *,
    grad_format: HalfFormat,
    param_format: HalfFormat,
    state_format: StateFormat,
    scalars: AdamScalars,
) -> int:
    """adam_step out of place (no output may overlap an input) that also returns the CRC32C of
    master_out, exp_avg_out, exp_avg_sq_out and param_out in that order, as the device checksums
    a block. The same bits as adam_step followed by crc32c, in one pass over memory."""
    args, n = _adam_buffers(grad, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                            exp_avg_sq_out, param_out, grad_format, param_format, state_format,
                            scalars, frozenset())
    if n == 0:
        return 0
    crc = _ffi.new("uint32_t *")
    _check_rc(_lib.cossd_adam_step_crc(*args, crc), "adam_step_crc")
    return int(crc[0])


class BlockUpdate:
    """adam_step_crc on ranges of one set of state arrays, checked once here: what the device
    runs for each gradient block. A call then checks only the gradient and the range.

    Why: adam_step_crc's own checks (eight buffers, their overlaps) cost some 20 µs a call
    while they hold the GIL, against about 200 µs of arithmetic for a 256K-element block;
    on two worker threads the wait for the GIL doubles that, and the device's block update
    measured 15-25% faster in 1M-element calls than in 256K ones for that reason alone.
    """

    def __init__(self, master_in: Any, exp_avg_in: Any, exp_avg_sq_in: Any, master_out: Any,
                 exp_avg_out: Any, exp_avg_sq_out: Any, param_out: Any, *, grad_format: HalfFormat,
                 param_format: HalfFormat, state_format: StateFormat) -> None:
        self._gfmt = _enum_arg("grad_format", grad_format, HalfFormat)
        self._pfmt = _enum_arg("param_format", param_format, HalfFormat)
        self._sfmt = _enum_arg("state_format", state_format, StateFormat)
        bufs = _state_buffers(master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out, exp_avg_sq_out,
                              param_out, self._sfmt, _half_dtypes(self._pfmt))
        self.n = _check_lengths(bufs)
        _check_overlap(bufs)  # out of place: no output may be an input
        self._bufs = bufs  # keeps the arrays (and so the pointers) alive
        self._outputs = [(b.start, b.end) for b in bufs[3:]]
        self._half_dtypes = _half_dtypes(self._gfmt)

    def __call__(self, grad: Any, start: int, scalars: AdamScalars, param_copy: Any = None) -> tuple[int, int]:
        """Step elements start..start+len(grad)-1 with `grad`: (their CRC32C as adam_step_crc
        gives it, the gradient's inf/NaN elements). `param_copy` (as many 16-bit elements) also
        receives the new params, in the same pass. A gradient with non-finite elements still
        steps (into outputs the caller then discards)."""
        g = _buf("grad", grad, self._half_dtypes, _HALF_CTYPE)
        n = g.arr.size
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start + n > self.n:
            raise KernelArgumentError(f"elements {start}..{start + n} are outside the {self.n} of the state arrays")
        if not isinstance(scalars, AdamScalars):
            raise KernelArgumentError(f"scalars must come from adam_scalars(), got {type(scalars).__name__}")
        copy = _ffi.NULL
        if param_copy is not None:
            c = _buf("param_copy", param_copy, _half_dtypes(self._pfmt), _HALF_CTYPE, output=True)
            if c.arr.size != n:
                raise KernelArgumentError(f"param_copy has {c.arr.size} elements but grad has {n}")
            if n and (c.start < g.end and g.start < c.end
                      or any(c.start < b.end and b.start < c.end for b in self._bufs)):
                raise KernelArgumentError("param_copy overlaps the gradient or a state array")
            copy = c.ptr
        if n == 0:
            return 0, 0
        for low, high in self._outputs:
            if g.start < high and low < g.end:
                raise KernelArgumentError("grad overlaps an output")
        mi, ai, vi, mo, ao, vo, po = (b.ptr + start for b in self._bufs)
        crc = _ffi.new("uint32_t *")
        nonfinite = _ffi.new("size_t *")
        _check_rc(_lib.cossd_adam_step_crc_copy(g.ptr, self._gfmt, mi, ai, vi, mo, ao, vo, self._sfmt, po, copy,
                                                self._pfmt, n, scalars._c, crc, nonfinite), "BlockUpdate")
        return int(crc[0]), int(nonfinite[0])


def count_nonfinite(grad: Any, fmt: HalfFormat) -> int:
    """Number of inf/NaN elements in a 16-bit buffer."""
    f = _enum_arg("fmt", fmt, HalfFormat)
    g = _buf("grad", grad, _half_dtypes(f), _HALF_CTYPE)
    if g.arr.size == 0:
        return 0
    count = _lib.cossd_count_nonfinite(g.ptr, f, g.arr.size)
    if count == _COUNT_ERROR:
        raise KernelArgumentError("count_nonfinite: C kernel rejected its arguments")
    return int(count)


def master_to_param(master: Any, param_out: Any, fmt: HalfFormat) -> None:
    """Round FP32 master weights to 16-bit params (round to nearest even)."""
    f = _enum_arg("fmt", fmt, HalfFormat)
    src = _buf("master", master, (_F32,), _F32_CTYPE)
    dst = _buf("param_out", param_out, _half_dtypes(f), _HALF_CTYPE, output=True)
    n = _check_lengths([src, dst])
    _check_overlap([src, dst])
    if n:
        _check_rc(_lib.cossd_master_to_param(src.ptr, dst.ptr, f, n), "master_to_param")


def param_to_master(param: Any, master_out: Any, fmt: HalfFormat) -> None:
    """Widen 16-bit params to FP32 exactly (inverse of master_to_param for representable values)."""
    f = _enum_arg("fmt", fmt, HalfFormat)
    src = _buf("param", param, _half_dtypes(f), _HALF_CTYPE)
    dst = _buf("master_out", master_out, (_F32,), _F32_CTYPE, output=True)
    n = _check_lengths([src, dst])
    _check_overlap([src, dst])
    if n:
        _check_rc(_lib.cossd_param_to_master(src.ptr, f, dst.ptr, n), "param_to_master")


def stream_probe(grad_param: Any, master: Any, exp_avg: Any, exp_avg_sq: Any) -> None:
    """Move the bytes of an in-place Adam step with trivial arithmetic (a roofline probe)."""
    bufs = [
        _buf("grad_param", grad_param, (_U16,), "uint16_t[]", output=True),
        _buf("master", master, (_F32,), "float[]", output=True),
        _buf("exp_avg", exp_avg, (_F32,), "float[]", output=True),
        _buf("exp_avg_sq", exp_avg_sq, (_F32,), "float[]", output=True),
    ]
    n = _check_lengths(bufs)
    _lib.cossd_stream_probe(*(b.ptr for b in bufs), n)


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of A followed by B, from crc32c(A), crc32c(B) and B's length in bytes."""
    for name, value, limit in (("crc_a", crc_a, 1 << 32), ("crc_b", crc_b, 1 << 32), ("len_b", len_b, 1 << 64)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < limit:
            raise KernelArgumentError(f"{name} must be an int in [0, {limit}), got {value!r}")
    return int(_lib.cossd_crc32c_combine(int(crc_a), int(crc_b), int(len_b)))


def crc32c(buf: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of buf, continuing from `value` (the CRC of the preceding bytes)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= 0xFFFFFFFF:
        raise KernelArgumentError(f"value must be an int in [0, 2**32), got {value!r}")
    try:
        view = memoryview(buf)
    except TypeError:
        raise KernelArgumentError(f"buf must be a buffer object, got {type(buf).__name__}") from None
    if not view.c_contiguous:
        raise KernelArgumentError("buf must be C-contiguous")
    if view.nbytes == 0:
        return int(value)
    return int(_lib.cossd_crc32c(int(value), _ffi.from_buffer(view), view.nbytes))


# ---------------------------------------------------------------------------
# SIMD selection
# ---------------------------------------------------------------------------


_LEVEL_NAMES = {_lib.COSSD_SIMD_SCALAR: "scalar", _lib.COSSD_SIMD_AVX2: "avx2", _lib.COSSD_SIMD_AVX512: "avx512"}
_LEVELS = {name: level for level, name in _LEVEL_NAMES.items()}


def simd_level() -> str:
    """The path the dispatching kernels use right now: "avx512", "avx2" or "scalar"."""
    return _LEVEL_NAMES[_lib.cossd_simd_level()]


def available_kernels() -> tuple[str, ...]:
    """The paths this CPU can run, lowest first, e.g. ("scalar", "avx2", "avx512")."""
    best = _lib.cossd_simd_level_available()
    return tuple(name for level, name in sorted(_LEVEL_NAMES.items()) if level <= best)


def use_kernel(name: str) -> None:
    """Cap the dispatch path process-wide: "scalar", "avx2", "avx512" or "auto" (the best the CPU has).

    A cap above what the CPU supports runs the best supported path below it
    (simd_level() tells which). Results are bit-identical on every path.
    """
    if not isinstance(name, str) or name.strip().lower() not in (*_LEVELS, "auto", "simd"):
        raise KernelArgumentError(f"kernel must be one of 'auto', 'avx512', 'avx2', 'scalar', got {name!r}")
    key = name.strip().lower()
    _lib.cossd_set_simd_level(_LEVELS.get(key, _lib.COSSD_SIMD_AVX512))


def use_simd(enabled: bool) -> None:
    """Enable (the best path the CPU has) or disable the SIMD paths process-wide; results are identical either way."""
    _lib.cossd_set_simd(1 if enabled else 0)


_SIZE_MAX = int(_ffi.cast("size_t", -1))


def stream_threshold() -> int:
    """Footprint in bytes (elements x bytes read and written per element) from which adam_step
    writes its write-only outputs with streaming (non-temporal) stores; see docs/kernels.md."""
    return int(_lib.cossd_stream_threshold())


def set_stream_threshold(nbytes: int | None) -> None:
    """Set that threshold process-wide: 0 streams every call, None never. Results are the same
    bits either way; only the speed changes."""
    if nbytes is None:
        _lib.cossd_set_stream_threshold(_SIZE_MAX)
        return
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)) or not 0 <= int(nbytes) <= _SIZE_MAX:
        raise KernelArgumentError(f"nbytes must be an int in [0, 2**64) or None, got {nbytes!r}")
    _lib.cossd_set_stream_threshold(int(nbytes))


_STREAM_ROLES = (
    ("master_out", _lib.COSSD_STREAM_MASTER),
    ("exp_avg_out", _lib.COSSD_STREAM_EXP_AVG),
    ("exp_avg_sq_out", _lib.COSSD_STREAM_EXP_AVG_SQ),
    ("param_out", _lib.COSSD_STREAM_PARAM),
)


def stream_plan(
    master_in: Any,
    exp_avg_in: Any,
    exp_avg_sq_in: Any,
    master_out: Any,
    exp_avg_out: Any,
    exp_avg_sq_out: Any,
    param_out: Any,
    *,
    state_format: StateFormat,
    path: str | None = None,
) -> frozenset[str]:
    """The outputs ("master_out", "exp_avg_out", ...) that adam_step on `path` (default: the
    current one) would write with streaming stores for these buffers; empty for scalar."""
    sfmt = _enum_arg("state_format", state_format, StateFormat)
    name = simd_level() if path is None else path
    if name not in _LEVELS:
        raise KernelArgumentError(f"path must be one of 'avx512', 'avx2', 'scalar', got {path!r}")
    bufs = _state_buffers(master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out, exp_avg_sq_out,
                          param_out, sfmt, (_U16, _F16))
    n = _check_lengths(bufs)
    mi, ai, vi, mo, ao, vo, po = (b.ptr for b in bufs)
    bits = _lib.cossd_adam_stream_plan(_LEVELS[name], mi, ai, vi, mo, ao, vo, sfmt, po, n)
    return frozenset(role for role, bit in _STREAM_ROLES if bits & bit)


def _apply_env() -> None:
    choice = os.environ.get("COSSD_KERNEL", "").strip().lower()
    if choice in ("", "auto", "simd"):
        return
    if choice not in _LEVELS:
        warnings.warn(
            f"COSSD_KERNEL={choice!r} not understood (use 'scalar', 'avx2', 'avx512' or 'auto'); using auto",
            stacklevel=2,
        )
        return
    use_kernel(choice)
    if simd_level() != choice:
        warnings.warn(f"COSSD_KERNEL={choice!r}: this CPU lacks it; using {simd_level()!r}", stacklevel=2)


_apply_env()
