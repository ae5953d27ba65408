"""nvcc builds of the CUDA Adam step (adam_step.cu) and its host harness (host_step.cu), with the flags that keep the arithmetic IEEE-exact, cached by a hash of the sources and flags."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

from ... import settings

HERE = pathlib.Path(__file__).resolve().parent
KERNELS = HERE.parent
KERNEL_SOURCE = HERE / "adam_step.cu"
HOST_HARNESS_SOURCE = HERE / "host_step.cu"
# Every file the builds read: a change to any of them makes a new cached build.
SOURCES = (KERNEL_SOURCE, HOST_HARNESS_SOURCE, HERE / "adam_lane.cuh", HERE / "adam_step.h",
           KERNELS / "cossd_elem.h", KERNELS / "cossd_kernels.h", KERNELS / "qstate_counts.h")
# The architectures the kernel is built for: __reduce_max_sync needs sm_80 or later.
ARCHS = ("sm_80", "sm_90")

# -fmad=false: nvcc would otherwise contract a product and a sum into an FMA (as gcc's
# -ffp-contract); the contract fuses exactly three operations, written as fmaf. Division and
# square root stay IEEE-rounded (nvcc's -prec-div/-prec-sqrt defaults), denormals are kept
# (-ftz=false); -use_fast_math would undo all three, so it is never passed.
EXACT_FLAGS = ("-fmad=false", "-prec-div=true", "-prec-sqrt=true", "-ftz=false")
# Warnings are errors, in nvcc's front end and in the host compiler.
STRICT_FLAGS = ("-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror")
HOST_FLAGS = ("-Xcompiler", "-fPIC,-ffp-contract=off")


class CudaBuildError(RuntimeError):
    """nvcc is missing or refused a source; the message holds its output."""


def nvcc_path() -> str | None:
    """The nvcc on PATH, or in /usr/local/cuda/bin, or None."""
    found = shutil.which("nvcc")
    if found:
        return found
    fallback = pathlib.Path("/usr/local/cuda/bin/nvcc")
    return str(fallback) if fallback.exists() else None


def _nvcc() -> str:
    path = nvcc_path()
    if path is None:
        raise CudaBuildError("nvcc not found (PATH, /usr/local/cuda/bin): the CUDA kernel cannot be built")
    return path


def _gencode(archs: tuple[str, ...]) -> list[str]:
    """SASS for each architecture, and PTX of the last one for newer GPUs to JIT."""
    flags = []
    for arch in archs:
        num = arch.removeprefix("sm_")
        flags += ["-gencode", f"arch=compute_{num},code=sm_{num}"]
    last = archs[-1].removeprefix("sm_")
    return flags + ["-gencode", f"arch=compute_{last},code=compute_{last}"]


def kernel_command(out: pathlib.Path, archs: tuple[str, ...] = ARCHS, exact: bool = True,
                   emit: str = "--shared") -> list[str]:
    """nvcc's command line for the kernel library (emit="--shared"), or its PTX or cubin
    (emit="-ptx" or "-cubin", for archs[0]). exact=False drops EXACT_FLAGS, for the test that
    shows they matter."""
    arch_flags = [f"-arch={archs[0]}"] if emit in ("-ptx", "-cubin") else _gencode(archs)
    return [_nvcc(), "-std=c++17", "-O3", *(EXACT_FLAGS if exact else ()), *STRICT_FLAGS, *HOST_FLAGS,
            *arch_flags, emit, str(KERNEL_SOURCE), "-o", str(out)]


def host_harness_command(out: pathlib.Path) -> list[str]:
    """nvcc's command line for the host harness library (the lane functions run on the CPU)."""
    return [_nvcc(), "-std=c++17", "-O2", *EXACT_FLAGS, *STRICT_FLAGS, *HOST_FLAGS, "-arch=sm_80", "--shared",
            str(HOST_HARNESS_SOURCE), "-o", str(out)]


def cache_dir() -> pathlib.Path:
    """Where builds are kept: $COSSD_CUDA_CACHE, else a folder in the temp dir."""
    root = settings.CUDA_CACHE.read() or os.path.join(tempfile.gettempdir(), "cossd-cuda-build")
    path = pathlib.Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _digest(command: list[str]) -> str:
    h = hashlib.sha256(" ".join(command[1:]).encode())
    for src in SOURCES:
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def run_nvcc(command: list[str]) -> None:
    """Runs nvcc; CudaBuildError with its output when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CudaBuildError(f"nvcc failed ({done.returncode}): {' '.join(command)}\n{done.stdout}{done.stderr}")


def build(kind: str) -> pathlib.Path:
    """The cached library of kind "kernel" (the GPU kernel and its launcher) or "host" (the
    host harness), built first if the sources or flags changed."""
    makers = {"kernel": kernel_command, "host": host_harness_command}
    if kind not in makers:
        raise ValueError(f"kind must be one of {sorted(makers)}, got {kind!r}")
    probe = makers[kind](pathlib.Path("OUT"))
    out = cache_dir() / f"cossd_cuda_{kind}_{_digest(probe)}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        run_nvcc(makers[kind](tmp))
        os.replace(tmp, out)  # atomic: a concurrent builder finds a whole library or none
    return out
