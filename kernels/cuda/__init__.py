"""cossd.kernels.cuda: the Adam step of kernels/cuda/adam_step.cu on torch CUDA tensors, built by nvcc on first use; it refuses clearly where torch sees no GPU. NEVER RUN ON A GPU (none was lent while it was written): docs/kernels.md, "CUDA".

Importing this package imports neither torch nor the CUDA runtime; adam_step_q_cuda does.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

from ..hyper import AdamScalars
from ..state_formats import StateCounts, state_map, state_scale_count
from ..validation import HalfFormat, KernelArgumentError, Moment, StateFormat
from . import build


class CudaUnavailable(RuntimeError):
    """No GPU (or no torch with CUDA, or no nvcc) to run the CUDA kernel on."""


class _Counts(ctypes.Structure):  # cossd_cuda_counts (adam_step.h)
    _fields_ = [("underflow", ctypes.c_ulonglong * 2), ("overflow", ctypes.c_ulonglong * 2),
                ("scaled_blocks", ctypes.c_ulonglong * 2), ("scale_min_bits", ctypes.c_uint * 2),
                ("scale_max_bits", ctypes.c_uint * 2)]  # fmt: skip


class _QCounts(ctypes.Structure):  # cossd_qstate_counts (qstate_counts.h)
    _fields_ = [("underflow", ctypes.c_uint64 * 2), ("overflow", ctypes.c_uint64 * 2),
                ("scaled_blocks", ctypes.c_uint64 * 2), ("scale_min", ctypes.c_float * 2),
                ("scale_max", ctypes.c_float * 2)]  # fmt: skip


_SCALAR_FIELDS = ("grad_scale", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "step_size",
                  "bias_correction2_sqrt", "decay", "weight_decay")  # fmt: skip


class _Scalars(ctypes.Structure):  # cossd_adam_scalars (cossd_kernels.h)
    _fields_ = [*((name, ctypes.c_float) for name in _SCALAR_FIELDS), ("decoupled", ctypes.c_int)]


def _torch() -> Any:
    """torch, where it sees a GPU; CudaUnavailable saying why not."""
    try:
        import torch
    except ImportError as exc:
        raise CudaUnavailable(f"the CUDA kernel runs on torch CUDA tensors, and torch does not import: {exc}") from exc
    if not torch.cuda.is_available():
        raise CudaUnavailable(f"torch {torch.__version__} sees no CUDA GPU (torch.version.cuda={torch.version.cuda}): "
                              "the CUDA Adam step cannot run here; use cossd.kernels.adam_step_q on the CPU")
    return torch


@functools.cache
def _library() -> ctypes.CDLL:
    try:
        return ctypes.CDLL(str(build.build("kernel")))
    except build.CudaBuildError as exc:
        raise CudaUnavailable(str(exc)) from exc


@functools.cache
def _tables(device: str) -> Any:
    """The INT8 tables (each moment's map, then its midpoints) on `device`."""
    torch = _torch()
    maps = np.ascontiguousarray(np.stack([state_map(Moment.EXP_AVG), state_map(Moment.EXP_AVG_SQ)]), np.float32)
    host = np.empty(4 * 256, np.float32)
    _library().cossd_cuda_tables(maps.ctypes.data_as(ctypes.c_void_p), host.ctypes.data_as(ctypes.c_void_p))
    return torch.from_numpy(host).to(device)


def _check(name: str, t: Any, dtypes: tuple[Any, ...], size: int, device: Any) -> int:
    """t's device address, after checking it: a contiguous CUDA tensor of `size` elements."""
    torch = _torch()
    if not isinstance(t, torch.Tensor) or not t.is_cuda:
        raise KernelArgumentError(f"{name} must be a CUDA tensor, got {type(t).__name__}")
    if t.device != device or t.dtype not in dtypes or t.numel() != size or not t.is_contiguous():
        raise KernelArgumentError(f"{name} must be a contiguous {'/'.join(map(str, dtypes))} tensor of {size} "
                                  f"elements on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    return int(t.data_ptr())


def adam_step_q_cuda(grad: Any, master: Any, exp_avg: Any, exp_avg_sq: Any, param_out: Any, *,
                     exp_avg_scale: Any = None, exp_avg_sq_scale: Any = None, grad_format: HalfFormat,
                     param_format: HalfFormat, state_format: StateFormat, scalars: AdamScalars,
                     counts: StateCounts | None = None) -> None:  # fmt: skip
    """One Adam/AdamW step in place on the GPU, on the current stream: the contract of
    cossd.kernels.adam_step_q (the same bits, by construction; never checked on a GPU).

    grad and param_out are 16-bit tensors (torch.float16 or bfloat16, or int16/uint16 bits),
    master float32, the moments float32 (FP32), 16-bit (BF16, FP16 codes) or uint8 (INT8
    codes); FP16 and INT8 need the float32 scales, one per 256 elements. With counts the call
    waits for the kernel and fills them."""
    torch = _torch()
    gfmt, pfmt, sfmt = HalfFormat(grad_format), HalfFormat(param_format), StateFormat(state_format)
    if not isinstance(scalars, AdamScalars):
        raise KernelArgumentError(f"scalars must come from adam_scalars(), got {type(scalars).__name__}")
    half = (torch.float16, torch.bfloat16, torch.int16, torch.uint16)
    moment_dtypes = {StateFormat.FP32: (torch.float32,), StateFormat.BF16: half, StateFormat.FP16: half,
                     StateFormat.INT8: (torch.uint8, torch.int8)}[sfmt]  # fmt: skip
    n = int(master.numel()) if isinstance(master, torch.Tensor) else -1
    device = master.device if n >= 0 else None
    g = _check("grad", grad, half, n, device)
    mi = _check("master", master, (torch.float32,), n, device)
    ai = _check("exp_avg", exp_avg, moment_dtypes, n, device)
    vi = _check("exp_avg_sq", exp_avg_sq, moment_dtypes, n, device)
    po = _check("param_out", param_out, half, n, device)
    scaled = sfmt in (StateFormat.FP16, StateFormat.INT8)
    nscales = state_scale_count(n)
    asc = _check("exp_avg_scale", exp_avg_scale, (torch.float32,), nscales, device) if scaled else 0
    vsc = _check("exp_avg_sq_scale", exp_avg_sq_scale, (torch.float32,), nscales, device) if scaled else 0
    if n == 0:
        if counts is not None:
            counts._load(_QCounts())
        return
    lib = _library()
    c_scalars = _Scalars(*(getattr(scalars._c, name) for name in _SCALAR_FIELDS), scalars._c.decoupled)
    tables = _tables(str(device)) if sfmt == StateFormat.INT8 else None
    host_counts = _Counts()
    lib.cossd_cuda_counts_reset(ctypes.byref(host_counts))
    dev_counts = torch.frombuffer(bytearray(bytes(host_counts)), dtype=torch.uint8).to(device)
    err = ctypes.c_int(0)
    p = ctypes.c_void_p
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream().cuda_stream
        rc = lib.cossd_cuda_adam_step_q(
            p(g), int(gfmt), p(mi), p(ai), p(asc or None), p(vi), p(vsc or None), p(mi), p(ai), p(asc or None), p(vi),
            p(vsc or None), int(sfmt), p(po), int(pfmt), ctypes.c_size_t(n), ctypes.byref(c_scalars),
            p(int(tables.data_ptr()) if tables is not None else None), p(int(dev_counts.data_ptr())), p(stream),
            ctypes.byref(err))
    if rc != 0:
        raise RuntimeError(f"cossd_cuda_adam_step_q returned {rc} (CUDA error {err.value})")
    if counts is not None:
        ctypes.memmove(ctypes.byref(host_counts), bytes(dev_counts.cpu().numpy()), ctypes.sizeof(host_counts))
        out = _QCounts()
        lib.cossd_cuda_counts_finish(ctypes.byref(host_counts), ctypes.byref(out))
        counts._load(out)
