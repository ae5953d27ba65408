"""Kernel selection: which SIMD path the dispatching kernels run (simd_level, use_kernel, the COSSD_KERNEL variable), and the streaming-store threshold and plan."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .. import settings
from ._cossd_kernels import ffi as _ffi
from ._cossd_kernels import lib as _lib
from .validation import (
    _F16,
    _U16,
    KernelArgumentError,
    StateFormat,
    _check_lengths,
    _elementwise_state,
    _enum_arg,
    _state_buffers,
)


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
    _elementwise_state(sfmt, "stream_plan")
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
    choice = settings.KERNEL.read()
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
