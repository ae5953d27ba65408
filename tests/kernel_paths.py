"""The kernel tests' choice of SIMD path: a context that runs its body on one path, and one pytest param per path."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

import cossd.kernels as k

ALL_PATHS = ("scalar", "avx2", "avx512")
PATHS = k.available_kernels()  # what this CPU runs, e.g. ("scalar", "avx2", "avx512")


@contextlib.contextmanager
def kernel_path(name: str) -> Iterator[None]:
    """Run the body on path `name` ("scalar", "avx2", "avx512"), then restore the one before."""
    before = k.simd_level()
    k.use_kernel(name)
    try:
        assert k.simd_level() == name, f"asked for {name}, dispatch uses {k.simd_level()}"
        yield
    finally:
        k.use_kernel(before)


def path_params() -> list[Any]:
    """One pytest param per kernel path; a path this CPU lacks is skipped, not silently run as another."""
    return [pytest.param(p, id=p, marks=pytest.mark.skipif(p not in PATHS, reason=f"CPU lacks the {p} path"))
            for p in ALL_PATHS]
