"""Tests of the CUDA Adam step without a GPU: nvcc builds it for sm_80 and sm_90 with warnings as errors and IEEE-exact float ops, and its lane functions, compiled by nvcc and run on the host, give the scalar C kernel's bits and counts."""

from __future__ import annotations

import pathlib
import re
import struct
import subprocess
from collections.abc import Iterator
from typing import Any

import cffi
import numpy as np
import pytest

import cossd.kernels as k
from cossd.kernels import AdamHyper, HalfFormat, Moment, StateFormat
from cossd.kernels.cuda import build
from cossd.kernels.state_formats import MomentCounts, StateCounts

pytestmark = pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed: the CUDA kernel is not built")

BLOCK = k.STATE_BLOCK
SIZES = [1, 255, 256, 257, 2**16 + 3]
HYPERS = {
    "adamw": AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, mode="adamw"),
    # L2 mode and beta1 below 0.5: the lerp's other branch and the fused L2 term
    "adamL2-b1lo": AdamHyper(lr=3e-3, beta1=0.3, beta2=0.99, eps=1e-6, weight_decay=0.1, mode="adam"),
}
HALF_DTYPE = {HalfFormat.FP16: np.float16, HalfFormat.BF16: np.uint16}
CODE_DTYPE = {StateFormat.FP32: np.float32, StateFormat.BF16: np.uint16, StateFormat.FP16: np.uint16,
              StateFormat.INT8: np.uint8}  # fmt: skip
SCALED = (StateFormat.FP16, StateFormat.INT8)

_CDEF = """
typedef struct { float grad_scale, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size,
                 bias_correction2_sqrt, decay, weight_decay; int decoupled; } cossd_adam_scalars;
typedef struct { uint64_t underflow[2]; uint64_t overflow[2]; uint64_t scaled_blocks[2];
                 float scale_min[2]; float scale_max[2]; } cossd_qstate_counts;
typedef struct { float map[2][256]; float mid[2][256]; } cossd_q8_tables;
void cossd_cuda_host_tables(const float *maps, cossd_q8_tables *out);
int cossd_cuda_host_adam_step_q(const uint16_t *grad, int gfmt, const float *mi, const void *ai,
    const float *as_in, const void *vi, const float *vs_in, float *mo, void *ao, float *as_out, void *vo,
    float *vs_out, int sfmt, uint16_t *po, int pfmt, size_t n, const cossd_adam_scalars *s,
    const cossd_q8_tables *tables, cossd_qstate_counts *counts);
"""


class HostHarness:
    """The nvcc-built host harness (kernels/cuda/host_step.cu) through cffi."""

    def __init__(self, path: pathlib.Path) -> None:
        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        self.lib: Any = self.ffi.dlopen(str(path))
        maps = np.stack([k.state_map(Moment.EXP_AVG), k.state_map(Moment.EXP_AVG_SQ)]).astype(np.float32)
        self.tables = self.ffi.new("cossd_q8_tables *")
        self.lib.cossd_cuda_host_tables(self.ffi.from_buffer("float[]", maps), self.tables)

    def scalars(self, s: k.AdamScalars) -> Any:
        c = self.ffi.new("cossd_adam_scalars *")
        for name in ("grad_scale", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2", "eps", "step_size",
                     "bias_correction2_sqrt", "decay", "weight_decay", "decoupled"):  # fmt: skip
            setattr(c, name, getattr(s._c, name))
        return c

    def ptr(self, a: np.ndarray | None, keep: list[Any]) -> Any:
        """A void * to a's memory (NULL for None); keep holds the buffer alive through the call."""
        if a is None:
            return self.ffi.NULL
        keep.append(self.ffi.from_buffer(a))
        return self.ffi.cast("void *", keep[-1])

    def step(self, grad: np.ndarray, st: dict[str, np.ndarray], out: dict[str, np.ndarray], gfmt: int, sfmt: int,
             pfmt: int, scalars: k.AdamScalars, tables: bool = True) -> tuple[int, StateCounts]:  # fmt: skip
        counts = self.ffi.new("cossd_qstate_counts *")
        keep: list[Any] = []

        def p(a: np.ndarray | None) -> Any:
            return self.ptr(a, keep)

        rc = self.lib.cossd_cuda_host_adam_step_q(
            p(grad), gfmt, p(st["master"]), p(st["m"]), p(st.get("ms")), p(st["v"]), p(st.get("vs")),
            p(out["master"]), p(out["m"]), p(out.get("ms")), p(out["v"]), p(out.get("vs")), sfmt, p(out["param"]),
            pfmt, grad.size, self.scalars(scalars), self.tables if tables else self.ffi.NULL, counts)
        result = StateCounts()
        result._load(counts)
        return rc, result


@pytest.fixture(scope="module")
def harness() -> HostHarness:
    return HostHarness(build.build("host"))


@pytest.fixture(autouse=True)
def scalar_path() -> Iterator[None]:
    """The reference is the scalar C kernel (every SIMD path gives its bits: test_kernels*)."""
    before = k.simd_level()
    k.use_kernel("scalar")
    yield
    k.use_kernel(before)


def half(x: np.ndarray, fmt: HalfFormat) -> np.ndarray:
    """FP32 values as the 16-bit gradient buffer of fmt (inf where FP16 overflows)."""
    out = np.empty(x.size, HALF_DTYPE[fmt])
    with np.errstate(over="ignore"):
        k.master_to_param(np.ascontiguousarray(x, np.float32), out, fmt)
    return out


def decades(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    """Random signs and magnitudes uniform in log10 between lo and hi."""
    return (rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(lo, hi, n)).astype(np.float32)


def state(n: int, sfmt: StateFormat, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A state with nonzero moments spanning decades, encoded by the C kernels' encoder."""
    st: dict[str, np.ndarray] = {"master": decades(rng, n, -6, 1), "param": np.zeros(n, np.uint16)}
    for key, moment, x in (("m", Moment.EXP_AVG, decades(rng, n, -9, -1)),
                           ("v", Moment.EXP_AVG_SQ, np.abs(decades(rng, n, -14, -2)))):  # fmt: skip
        st[key] = np.zeros(n, CODE_DTYPE[sfmt])
        st[key + "s"] = np.zeros(k.state_scale_count(n), np.float32)
        k.encode_state(x, st[key], st[key + "s"] if sfmt in SCALED else None, state_format=sfmt, moment=moment)
    return st


def like(st: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Output buffers shaped as st's, filled with a pattern no step writes."""
    return {key: np.full_like(a, 0x5A if a.dtype == np.uint8 else 77) for key, a in st.items()}


def cpu_step(grad: np.ndarray, st: dict[str, np.ndarray], out: dict[str, np.ndarray], gfmt: HalfFormat,
             sfmt: StateFormat, pfmt: HalfFormat, scalars: k.AdamScalars) -> StateCounts:  # fmt: skip
    counts = StateCounts()
    scaled = sfmt in SCALED
    k.adam_step_q(grad, st["master"], st["m"], st["v"], out["master"], out["m"], out["v"], out["param"],
                  exp_avg_scale_in=st["ms"] if scaled else None, exp_avg_sq_scale_in=st["vs"] if scaled else None,
                  exp_avg_scale_out=out["ms"] if scaled else None, exp_avg_sq_scale_out=out["vs"] if scaled else None,
                  grad_format=gfmt, param_format=pfmt, state_format=sfmt, scalars=scalars, counts=counts)  # fmt: skip
    return counts


def gradients(n: int, steps: int, rng: np.random.Generator) -> list[np.ndarray]:
    """FP32 gradients spanning 14 decades, with crafted blocks: a zero block, a block of one 1.0
    and tiny values (underflows), and, at step 2 only, inf and NaN in one block (an INT8 block
    poisoned, FP16 codes overflowing), then finite again."""
    out = []
    for t in range(steps):
        g = decades(rng, n, -12, 2)
        if n > 3 * BLOCK:
            g[BLOCK:2 * BLOCK] = 0.0
            g[2 * BLOCK] = 1.0
            g[2 * BLOCK + 1:2 * BLOCK + 40] = 1e-15
        if t == 1 and n > 8:
            g[n // 2] = np.inf
            g[n // 2 + 1] = np.nan
            g[0] = -np.inf
        out.append(g)
    return out


def assert_same(cpu: dict[str, np.ndarray], gpu: dict[str, np.ndarray], what: str) -> None:
    for key in cpu:
        assert cpu[key].tobytes() == gpu[key].tobytes(), f"{what}: {key} differs"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("sfmt", list(StateFormat), ids=lambda f: f.name)
@pytest.mark.parametrize(("gfmt", "pfmt"), [(HalfFormat.FP16, HalfFormat.FP16), (HalfFormat.BF16, HalfFormat.BF16),
                                            (HalfFormat.BF16, HalfFormat.FP16)], ids=["fp16", "bf16", "bf16-fp16"])
@pytest.mark.parametrize("hyper", list(HYPERS), ids=list(HYPERS))
def test_lane_functions_match_the_scalar_kernel(harness: HostHarness, n: int, sfmt: StateFormat, gfmt: HalfFormat,
                                                 pfmt: HalfFormat, hyper: str) -> None:  # fmt: skip
    """Three chained steps (each from its own previous output, out of place): master, both
    moments' codes and scales, params and the counters are the scalar kernel's, bit for bit."""
    rng = np.random.default_rng(n * 31 + int(sfmt))
    cpu = state(n, sfmt, rng)
    gpu = {key: a.copy() for key, a in cpu.items()}
    for t, g in enumerate(gradients(n, 3, rng), 1):
        grad = half(g, gfmt)
        scalars = k.adam_scalars(HYPERS[hyper], t)
        cpu_out, gpu_out = like(cpu), like(gpu)
        want = cpu_step(grad, cpu, cpu_out, gfmt, sfmt, pfmt, scalars)
        rc, got = harness.step(grad, gpu, gpu_out, gfmt, sfmt, pfmt, scalars)
        assert rc == 0
        if sfmt not in SCALED:  # elementwise formats have no scales: neither path writes them
            for key in ("ms", "vs"):
                cpu_out[key], gpu_out[key] = cpu[key], gpu[key]
        assert_same(cpu_out, gpu_out, f"step {t}")
        assert got == want, f"step {t}"
        cpu, gpu = cpu_out, gpu_out


@pytest.mark.parametrize("sfmt", SCALED, ids=lambda f: f.name)
def test_in_place_and_counts_known(harness: HostHarness, sfmt: StateFormat) -> None:
    """In place (outputs are the inputs, scales too) the harness gives the out-of-place scalar
    result; crafted blocks give known counts: INT8 poisons the one block holding inf/NaN (its
    256 elements overflow in both moments), and the scales' range is the scalar kernel's."""
    n = 4 * BLOCK
    rng = np.random.default_rng(5)
    st = state(n, sfmt, rng)
    g = decades(rng, n, -6, 0)
    g[3 * BLOCK + 7] = np.nan
    grad = half(g, HalfFormat.BF16)
    scalars = k.adam_scalars(HYPERS["adamw"], 1)
    cpu_out = like(st)
    want = cpu_step(grad, st, cpu_out, HalfFormat.BF16, sfmt, HalfFormat.BF16, scalars)
    rc, got = harness.step(grad, st, st, HalfFormat.BF16, sfmt, HalfFormat.BF16, scalars)
    assert rc == 0
    assert_same(cpu_out, st, "in place")
    assert got == want
    if sfmt == StateFormat.INT8:
        assert got.exp_avg.overflow == got.exp_avg_sq.overflow == BLOCK
        assert got.exp_avg.scaled_blocks == 3
        assert np.isnan(st["ms"][3]) and not np.isnan(st["ms"][:3]).any()
    else:  # FP16 keeps NaN per element: one overflow per moment
        assert got.exp_avg.overflow == got.exp_avg_sq.overflow == 1
        assert got.exp_avg.scaled_blocks == 4


def test_refusals_change_nothing(harness: HostHarness) -> None:
    """A bad format, or INT8 without its tables, is refused with the C kernels' codes before
    anything is written."""
    n = 300
    st = state(n, StateFormat.INT8, np.random.default_rng(1))
    out = like(st)
    before = {key: a.copy() for key, a in out.items()}
    grad = half(np.ones(n, np.float32), HalfFormat.FP16)
    scalars = k.adam_scalars(HYPERS["adamw"], 1)
    assert harness.step(grad, st, out, 7, int(StateFormat.INT8), 0, scalars)[0] == -2  # COSSD_ERR_FORMAT
    assert harness.step(grad, st, out, 0, 9, 0, scalars)[0] == -2
    assert harness.step(grad, st, out, 0, int(StateFormat.INT8), 0, scalars, tables=False)[0] == -1  # ERR_NULL
    assert_same(before, out, "refused")
    assert harness.step(grad[:0], st, out, 0, int(StateFormat.INT8), 0, scalars)[1] == StateCounts(
        MomentCounts(), MomentCounts())


# ---- The device build ------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernel_library() -> pathlib.Path:
    return build.build("kernel")


def test_kernel_library_exports_the_launcher(kernel_library: pathlib.Path) -> None:
    """The library (SASS for sm_80 and sm_90, PTX for newer; nvcc with warnings as errors built
    it) exports the launcher and the counters' helpers."""
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(kernel_library)], capture_output=True, text=True,
                             check=True).stdout  # fmt: skip
    for name in ("cossd_cuda_adam_step_q", "cossd_cuda_tables", "cossd_cuda_counts_reset", "cossd_cuda_counts_finish"):
        assert re.search(rf"\bT {name}\b", symbols), name


@pytest.mark.parametrize("arch", build.ARCHS)
def test_kernel_compiles_to_each_arch(tmp_path: pathlib.Path, arch: str) -> None:
    """nvcc, warnings as errors, compiles the 16 kernels into a cubin of that architecture: a
    CUDA ELF (e_machine 190) whose e_flags name the SM."""
    out = tmp_path / f"{arch}.cubin"
    build.run_nvcc(build.kernel_command(out, (arch,), emit="-cubin"))
    elf = out.read_bytes()
    assert elf[:4] == b"\x7fELF" and struct.unpack_from("<H", elf, 18)[0] == 190
    assert (struct.unpack_from("<I", elf, 48)[0] >> 8) & 0xFF == int(arch.removeprefix("sm_"))


def ptx(tmp_path: pathlib.Path, exact: bool) -> str:
    out = tmp_path / ("exact.ptx" if exact else "loose.ptx")
    build.run_nvcc(build.kernel_command(out, ("sm_90",), exact=exact, emit="-ptx"))
    return out.read_text()


def test_ptx_float_ops_are_ieee_rounded(tmp_path: pathlib.Path) -> None:
    """Every FP32 add, sub, mul, fma, div and sqrt in the kernels' PTX is round-to-nearest with
    no flush to zero and no approximation (so ptxas may not fuse or relax it), 16 kernels are
    there; and the exact flags are what does it: without them nvcc emits plain mul.f32 and
    add.f32, which ptxas is free to fuse into FMAs the contract does not have."""
    exact = ptx(tmp_path, exact=True)
    assert exact.count(".entry") == 16
    ops = re.findall(r"\b(add|sub|mul|fma|div|sqrt|rcp|ex2|lg2)(\.[a-z0-9.]+)?\.f32\b", exact)
    assert ops
    loose = [op + mods for op, mods in ops if mods not in (".rn",)]
    assert not loose, sorted(set(loose))
    assert ".ftz" not in exact and ".approx" not in exact
    assert re.search(r"\b(mul|add|sub)\.f32\b", ptx(tmp_path, exact=False))


def test_loader_refuses_without_a_gpu() -> None:
    """On a machine where torch sees no GPU the loader says so, and names the CPU kernel."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the refusal is not what runs here")
    from cossd.kernels.cuda import CudaUnavailable, adam_step_q_cuda

    t = torch.zeros(4)
    with pytest.raises(CudaUnavailable, match="sees no CUDA GPU.*adam_step_q on the CPU"):
        adam_step_q_cuda(t, t, t, t, t, grad_format=HalfFormat.FP16, param_format=HalfFormat.FP16,
                         state_format=StateFormat.FP32, scalars=k.adam_scalars(HYPERS["adamw"], 1))  # fmt: skip
