"""cffi builder (out-of-line API mode) that compiles kernels/cossd_kernels.c into cossd.kernels._cossd_kernels."""

from __future__ import annotations

import os
import pathlib
import sys

import cffi

_HERE = pathlib.Path(__file__).resolve().parent
_HEADER = _HERE / "cossd_kernels.h"
_SOURCE = _HERE / "cossd_kernels.c"
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
    """Flags that keep float results IEEE-exact: -O3 but no FMA contraction and no fast-math."""
    if sys.platform == "win32":  # the C source requires GCC/Clang anyway; keep MSVC from choking on flags
        return ["/O2", "/fp:strict"]
    return ["-O3", "-ffp-contract=off", "-std=gnu11"]


ffibuilder = cffi.FFI()
ffibuilder.cdef(_cdef_text())
ffibuilder.cdef(_cdef_text(_GUARD_HEADER))
ffibuilder.set_source(
    "cossd.kernels._cossd_kernels",
    _SOURCE.read_text(encoding="utf-8") + '\n#include "cossd_guard.h"\n',
    # setuptools wants source paths relative to where it runs (the project root).
    sources=[os.path.relpath(_GUARD_SOURCE)],
    include_dirs=[str(_HERE)],
    extra_compile_args=_compile_args(),
    libraries=[] if sys.platform == "win32" else ["m"],
    depends=[str(_HEADER), str(_SOURCE), str(_GUARD_HEADER), str(_GUARD_SOURCE)],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
