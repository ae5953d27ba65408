"""The kernel wrappers: each validates its arguments (validation.py), then calls the C kernel once (Adam step, block update, conversions, non-finite count, CRC32C, roofline probe).

Calls go through cffi's API mode, which releases the GIL, so several threads may run
kernels on disjoint buffers in parallel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._cossd_kernels import ffi as _ffi
from ._cossd_kernels import lib as _lib
from .hyper import AdamScalars
from .validation import (
    _F32,
    _F32_CTYPE,
    _HALF_CTYPE,
    _U16,
    GradFormat,
    HalfFormat,
    KernelArgumentError,
    StateFormat,
    _buf,
    _check_lengths,
    _check_overlap,
    _elementwise_state,
    _enum_arg,
    _grad_buf,
    _grad_format_arg,
    _half_dtypes,
    _state_buffers,
)

_COUNT_ERROR = int(_ffi.cast("size_t", -1))
_RC_MESSAGES = {
    _lib.COSSD_ERR_NULL: "null buffer pointer",
    _lib.COSSD_ERR_FORMAT: "bad format enum",
    _lib.COSSD_ERR_UNSUPPORTED: "SIMD path not supported on this CPU",
}


def _check_rc(rc: int, what: str) -> None:
    if rc != 0:
        # The wrapper validated everything, so reaching this is a wrapper bug.
        raise KernelArgumentError(f"{what}: C kernel rejected its arguments ({_RC_MESSAGES.get(rc, rc)})")


_ADAM_IN_PLACE = frozenset(
    {("master_in", "master_out"), ("exp_avg_in", "exp_avg_out"), ("exp_avg_sq_in", "exp_avg_sq_out")}
)


def _adam_buffers(
    grad: Any, master_in: Any, exp_avg_in: Any, exp_avg_sq_in: Any, master_out: Any,
    exp_avg_out: Any, exp_avg_sq_out: Any, param_out: Any, grad_format: GradFormat | HalfFormat,
    param_format: HalfFormat, state_format: StateFormat, scalars: AdamScalars,
    in_place: frozenset[tuple[str, str]],
) -> tuple[list[Any], int]:
    """The C arguments of an Adam step after checking them all: (args, element count)."""
    gfmt = _grad_format_arg(grad_format)
    pfmt = _enum_arg("param_format", param_format, HalfFormat)
    sfmt = _enum_arg("state_format", state_format, StateFormat)
    _elementwise_state(sfmt, "adam_step")
    if not isinstance(scalars, AdamScalars):
        raise KernelArgumentError(f"scalars must come from adam_scalars(), got {type(scalars).__name__}")
    g = _grad_buf(grad, gfmt)
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
    grad_format: GradFormat | HalfFormat,
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
    grad_format: GradFormat | HalfFormat,
    param_format: HalfFormat,
    state_format: StateFormat,
    scalars: AdamScalars,
) -> int:
    """adam_step out of place (no output may overlap an input) that also returns the CRC32C of
    master_out, exp_avg_out, exp_avg_sq_out and param_out in that order, as the device checksums
    a block. The same bits as adam_step followed by crc32c, in one pass over memory."""
    return adam_step_crcs(grad, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                          exp_avg_sq_out, param_out, grad_format=grad_format, param_format=param_format,
                          state_format=state_format, scalars=scalars)[0]


def adam_step_crcs(
    grad: Any,
    master_in: Any,
    exp_avg_in: Any,
    exp_avg_sq_in: Any,
    master_out: Any,
    exp_avg_out: Any,
    exp_avg_sq_out: Any,
    param_out: Any,
    *,
    grad_format: GradFormat | HalfFormat,
    param_format: HalfFormat,
    state_format: StateFormat,
    scalars: AdamScalars,
) -> tuple[int, int]:
    """adam_step_crc that also returns the CRC32C of param_out alone: (block CRC, param CRC),
    from the same pass."""
    args, n = _adam_buffers(grad, master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out,
                            exp_avg_sq_out, param_out, grad_format, param_format, state_format,
                            scalars, frozenset())
    if n == 0:
        return 0, 0
    crc = _ffi.new("uint32_t *")
    param_crc = _ffi.new("uint32_t *")
    # The step with no second param buffer: NULL after param_out, as cossd_adam_step_crc does.
    args.insert(10, _ffi.NULL)
    _check_rc(_lib.cossd_adam_step_crc_copy(*args, crc, param_crc, _ffi.NULL), "adam_step_crcs")
    return int(crc[0]), int(param_crc[0])


class BlockUpdate:
    """adam_step_crc on ranges of one set of state arrays, checked once here: what the device
    runs for each gradient block. A call then checks only the gradient and the range.

    Why: adam_step_crc's own checks (eight buffers, their overlaps) cost some 20 µs a call
    while they hold the GIL, against about 200 µs of arithmetic for a 256K-element block;
    on two worker threads the wait for the GIL doubles that, and the device's block update
    measured 15-25% faster in 1M-element calls than in 256K ones for that reason alone.
    """

    def __init__(self, master_in: Any, exp_avg_in: Any, exp_avg_sq_in: Any, master_out: Any,
                 exp_avg_out: Any, exp_avg_sq_out: Any, param_out: Any, *, grad_format: GradFormat | HalfFormat,
                 param_format: HalfFormat, state_format: StateFormat) -> None:
        self._gfmt = _grad_format_arg(grad_format)
        self._pfmt = _enum_arg("param_format", param_format, HalfFormat)
        self._sfmt = _enum_arg("state_format", state_format, StateFormat)
        _elementwise_state(self._sfmt, "BlockUpdate")
        bufs = _state_buffers(master_in, exp_avg_in, exp_avg_sq_in, master_out, exp_avg_out, exp_avg_sq_out,
                              param_out, self._sfmt, _half_dtypes(self._pfmt))
        self.n = _check_lengths(bufs)
        _check_overlap(bufs)  # out of place: no output may be an input
        self._bufs = bufs  # keeps the arrays (and so the pointers) alive
        self._outputs = [(b.start, b.end) for b in bufs[3:]]

    def __call__(self, grad: Any, start: int, scalars: AdamScalars,
                 param_copy: Any = None) -> tuple[int, int, int]:
        """Step elements start..start+len(grad)-1 with `grad`: (their CRC32C as adam_step_crc
        gives it, the gradient's inf/NaN elements, the CRC32C of the new params alone). `param_copy` (as many 16-bit elements) also
        receives the new params, in the same pass. A gradient with non-finite elements still
        steps (into outputs the caller then discards)."""
        return self._run(_lib.cossd_adam_step_crc_copy, grad, start, scalars, param_copy, aligned=True)

    def lent(self, grad: Any, start: int, scalars: AdamScalars,
             param_copy: Any = None) -> tuple[int, int, int, int]:
        """__call__ for a gradient in memory its lender may change meanwhile (a CMB window):
        each element read once, and counted and stepped from what was read.
        (CRC, non-finite elements, param CRC, elements stepped); the CRCs are 0 where a
        non-finite element was found, and the caller then discards the block's outputs.

        Two ways, by what the CPU and the call allow (kernels/block_update.c):
        - in registers (AVX-512 with VPCLMULQDQ, FP32 moments, 16-bit gradients, a length a
          multiple of 16, master_out 64-byte aligned: a shadow mapping's whole blocks): each
          16 elements loaded once into the register that is both counted and stepped; the
          whole range is stepped, non-finite or not;
        - otherwise in rounds of 4096 elements copied into a buffer of the kernel's own,
          counted there and stepped from there; a non-finite element ends the stepping where
          its round starts."""
        stepped = _ffi.new("size_t *")
        # The gradient may start at any byte (a network receive buffer's payload): the kernel
        # only copies it with memcpy or loads it with unaligned vector loads.
        crc, nonfinite, param_crc = self._run(_lib.cossd_adam_step_crc_lent, grad, start, scalars, param_copy,
                                              aligned=False, stepped=stepped)
        return crc, nonfinite, param_crc, int(stepped[0])

    def _run(self, kernel: Any, grad: Any, start: int, scalars: AdamScalars,
             param_copy: Any, *, aligned: bool, stepped: Any = None) -> tuple[int, int, int]:
        """The checks and the call both ways share; `stepped`: the lent kernel's last argument."""
        g = _grad_buf(grad, self._gfmt, aligned=aligned)
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
            if stepped is not None:
                stepped[0] = 0
            return 0, 0, 0
        for low, high in self._outputs:
            if g.start < high and low < g.end:
                raise KernelArgumentError("grad overlaps an output")
        mi, ai, vi, mo, ao, vo, po = (b.ptr + start for b in self._bufs)
        crc = _ffi.new("uint32_t *")
        param_crc = _ffi.new("uint32_t *")
        nonfinite = _ffi.new("size_t *")
        args = (g.ptr, self._gfmt, mi, ai, vi, mo, ao, vo, self._sfmt, po, copy, self._pfmt, n, scalars._c, crc,
                param_crc, nonfinite)
        _check_rc(kernel(*args) if stepped is None else kernel(*args, stepped), "BlockUpdate")
        return int(crc[0]), int(nonfinite[0]), int(param_crc[0])


def count_nonfinite(grad: Any, fmt: GradFormat | HalfFormat) -> int:
    """Number of inf/NaN elements in a gradient buffer of any GradFormat."""
    f = _grad_format_arg(fmt, "fmt")
    g = _grad_buf(grad, f)
    if g.arr.size == 0:
        return 0
    count = _lib.cossd_count_nonfinite(g.ptr, f, g.arr.size)
    if count == _COUNT_ERROR:
        raise KernelArgumentError("count_nonfinite: C kernel rejected its arguments")
    return int(count)


def copy_count_nonfinite(source: Any, destination: Any, fmt: GradFormat | HalfFormat) -> int:
    """Copy a gradient from memory that may change meanwhile (a lent CMB window) into
    `destination` and return the number of inf/NaN elements the copy holds: one pass over
    the source, and the count is of exactly the values left in `destination`. The source may
    start at any byte (a network receive buffer's payload): it is only copied."""
    f = _grad_format_arg(fmt, "fmt")
    src = _grad_buf(source, f, "source", aligned=False)
    dst = _grad_buf(destination, f, "destination", output=True)
    _check_lengths([src, dst])
    if src.start < dst.end and dst.start < src.end:
        raise KernelArgumentError("source and destination overlap")
    if src.arr.size == 0:
        return 0
    count = _lib.cossd_copy_count_nonfinite(src.ptr, dst.ptr, f, src.arr.size)
    if count == _COUNT_ERROR:
        raise KernelArgumentError("copy_count_nonfinite: C kernel rejected its arguments")
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


def stream_probe_out_of_place(grad: Any, master: Any, exp_avg: Any, exp_avg_sq: Any, master_out: Any,
                              exp_avg_out: Any, exp_avg_sq_out: Any, param_out: Any) -> None:
    """Move the bytes of the device's out-of-place block update with trivial arithmetic (the
    A/B update's roofline probe): the outputs get each input plus one, the param the grad's
    bits with the lowest flipped."""
    bufs = [
        _buf("grad", grad, (_U16,), "uint16_t[]"),
        _buf("master", master, (_F32,), "float[]"),
        _buf("exp_avg", exp_avg, (_F32,), "float[]"),
        _buf("exp_avg_sq", exp_avg_sq, (_F32,), "float[]"),
        _buf("master_out", master_out, (_F32,), "float[]", output=True),
        _buf("exp_avg_out", exp_avg_out, (_F32,), "float[]", output=True),
        _buf("exp_avg_sq_out", exp_avg_sq_out, (_F32,), "float[]", output=True),
        _buf("param_out", param_out, (_U16,), "uint16_t[]", output=True),
    ]
    n = _check_lengths(bufs)
    _check_overlap(bufs)  # out of place: no output may be an input
    _lib.cossd_stream_probe_out_of_place(*(b.ptr for b in bufs), n)


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of A followed by B, from crc32c(A), crc32c(B) and B's length in bytes."""
    for name, value, limit in (("crc_a", crc_a, 1 << 32), ("crc_b", crc_b, 1 << 32), ("len_b", len_b, 1 << 64)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) < limit:
            raise KernelArgumentError(f"{name} must be an int in [0, {limit}), got {value!r}")
    return int(_lib.cossd_crc32c_combine(int(crc_a), int(crc_b), int(len_b)))


def _contiguous_bytes(buf: Any) -> memoryview:
    """buf as a memoryview, refused unless it is a C-contiguous buffer (what a CRC reads)."""
    try:
        view = memoryview(buf)
    except TypeError:
        raise KernelArgumentError(f"buf must be a buffer object, got {type(buf).__name__}") from None
    if not view.c_contiguous:
        raise KernelArgumentError("buf must be C-contiguous")
    return view


def crc32c_blocks(buf: Any, block_bytes: int) -> np.ndarray:
    """The CRC32C of each `block_bytes` piece of buf (the last may be shorter), in one call
    that releases the GIL for all of them: a thread checking many blocks then needs no
    Python in between, while another thread holds the interpreter."""
    if isinstance(block_bytes, bool) or not isinstance(block_bytes, (int, np.integer)) or int(block_bytes) < 1:
        raise KernelArgumentError(f"block_bytes must be a positive int, got {block_bytes!r}")
    view = _contiguous_bytes(buf)
    out = np.zeros(-(-view.nbytes // int(block_bytes)), dtype=np.uint32)
    if view.nbytes:
        _lib.cossd_crc32c_blocks(_ffi.from_buffer(view), view.nbytes, int(block_bytes),
                                 _ffi.cast("uint32_t *", out.ctypes.data))
    return out


def crc32c(buf: Any, value: int = 0) -> int:
    """CRC32C (Castagnoli) of buf, continuing from `value` (the CRC of the preceding bytes)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= 0xFFFFFFFF:
        raise KernelArgumentError(f"value must be an int in [0, 2**32), got {value!r}")
    view = _contiguous_bytes(buf)
    if view.nbytes == 0:
        return int(value)
    return int(_lib.cossd_crc32c(int(value), _ffi.from_buffer(view), view.nbytes))
