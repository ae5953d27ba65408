"""cffi builder (out-of-line API mode) that compiles the kernel sources (kernels/*.c) into cossd.kernels._cossd_kernels."""

from __future__ import annotations

import os
import pathlib
import sys

import cffi

_HERE = pathlib.Path(__file__).resolve().parent
_HEADER = _HERE / "cossd_kernels.h"
# The block-scaled formats' counters and their counted step (kernels/qstate.c).
_COUNTS_HEADER = _HERE / "qstate_counts.h"
# The kernels, one job a file (docs/kernels.md, "Source files"). Listed, not globbed, so a
# stray file (cffi's own generated _cossd_kernels.c, say) never joins the module.
_SOURCES = [
    _HERE / name
    for name in (
        "dispatch.c",  # CPU detection, the SIMD level cap, the stream threshold
        "adam.c",  # Adam step entry points, scalar kernel, stream plan, roofline probe
        "convert.c",  # FP32 <-> FP16/BF16 entry points and scalar loops
        "nonfinite.c",  # count of inf/NaN gradient elements
        "simd_avx2.c",  # adam_body.h and convert_body.h compiled for AVX2
        "simd_avx512.c",  # the same bodies compiled for AVX-512
        "crc32c.c",  # CRC32C: tables, crc32 instruction, carry-less folding, combine
        "block_update.c",  # the device's block update: step plus checksum in one pass
        "fp8_param.c",  # FP8 params out: absmax and the saturating encode with a per-tensor scale
        "qstate.c",  # block-scaled moments (FP16 + scale, INT8 + absmax): maps, scalar step, encode/decode
    )
]
_INTERNAL_HEADERS = [
    _HERE / name
    for name in ("cossd_internal.h", "cossd_scalar.h", "simd.h", "adam_body.h", "convert_body.h", "simd_kernels.h",
                 "crc32c_internal.h", "qstate_scalar.h", "qstate_body.h", "cossd_elem.h")
]
# The SIGBUS guard of the state-file mappings: a separate C file in the same module.
_GUARD_HEADER = _HERE / "cossd_guard.h"
_GUARD_SOURCE = _HERE / "cossd_guard.c"

_CDEF_BEGIN = "/* BEGIN CDEF */"
_CDEF_END = "/* END CDEF */"


def _cdef_text(header: pathlib.Path = _HEADER) -> str:
    """Return the cffi-parsable part of a header, so declarations live in one place."""
    text = header.read_text(encoding="utf-8")
    start = text.index(_CDEF_BEGIN) + len(_CDEF_BEGIN)
    end = text.index(_CDEF_END)
    return text[start:end]


def _compile_args() -> list[str]:
    """Flags that keep float results IEEE-exact: -O3 but no FMA contraction and no fast-math.

    One list for every source (setuptools has no per-file flags): the SIMD code asks for its
    instruction sets per function, with target attributes (kernels/simd.h)."""
    if sys.platform == "win32":  # the C source requires GCC/Clang anyway; keep MSVC from choking on flags
        return ["/O2", "/fp:strict"]
    return ["-O3", "-ffp-contract=off", "-std=gnu11"]


ffibuilder = cffi.FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.cdef(_cdef_text(_COUNTS_HEADER))
ffibuilder.cdef(_cdef_text(_GUARD_HEADER))
ffibuilder.set_source(
    "cossd.kernels._cossd_kernels",
    # The module's own file only declares: the kernels are compiled from their sources.
    '#include "cossd_kernels.h"\n#include "qstate_counts.h"\n#include "cossd_guard.h"\n',
    # setuptools wants source paths relative to where it runs (the project root).
    sources=[os.path.relpath(p) for p in (*_SOURCES, _GUARD_SOURCE)],
    include_dirs=[str(_HERE)],
    extra_compile_args=_compile_args(),
    libraries=[] if sys.platform == "win32" else ["m"],
    depends=[str(p) for p in (_HEADER, _COUNTS_HEADER, *_SOURCES, *_INTERNAL_HEADERS, _GUARD_HEADER, _GUARD_SOURCE)],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
