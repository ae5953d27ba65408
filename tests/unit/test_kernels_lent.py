"""Kernels for a gradient in lent memory (a CMB window): copy_count_nonfinite and BlockUpdate.lent, on every path and gradient format, and against a lender that changes its buffer mid-call."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cossd.kernels as k
from cossd.kernels import AdamHyper, GradFormat, HalfFormat, KernelArgumentError, StateFormat
from kernel_paths import kernel_path, path_params

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, mode="adamw")
# BlockUpdate.lent's round: elements copied, counted and stepped at a time (kernels/block_update.c).
LENT_CHUNK = 4096
GRAD_FORMATS = [HalfFormat.FP16, HalfFormat.BF16, GradFormat.FP32, GradFormat.FP8_E4M3, GradFormat.FP8_E5M2]
# One non-finite pattern per format: all exponent bits set (E4M3 has only its NaN, S.1111.111).
NONFINITE = {HalfFormat.FP16: 0x7C00, HalfFormat.BF16: 0xFF80, GradFormat.FP32: np.float32(np.nan),
             GradFormat.FP8_E4M3: 0x7F, GradFormat.FP8_E5M2: 0x7C}


def finite_grads(gfmt: HalfFormat | GradFormat, n: int, seed: int) -> np.ndarray:
    """n finite gradient elements of gfmt, in its buffer dtype."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_normal(n) * 0.01).astype(np.float32)
    if gfmt == GradFormat.FP32:
        return values
    if gfmt == HalfFormat.FP16:
        return values.astype(np.float16).view(np.uint16)
    if gfmt == HalfFormat.BF16:
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return rng.integers(0, 0x70, n, dtype=np.uint8)  # FP8 codes below both formats' inf/NaN


def state(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32), (rng.standard_normal(n) * 0.1).astype(np.float32),
            (np.abs(rng.standard_normal(n)) * 0.01).astype(np.float32)]


def _zeros_at(n: int, dtype: type, offset: int) -> np.ndarray:
    """n zeros of dtype whose first byte lies `offset` bytes past a 64-byte boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(n * itemsize + 128, np.uint8)
    skip = (offset - raw.ctypes.data) % 64
    return raw[skip : skip + n * itemsize].view(dtype)


def outputs(n: int, aligned: bool = False) -> list[np.ndarray]:
    """The four outputs, 64-byte aligned as a shadow mapping's blocks are, or 4 bytes past
    that (the kernel then peels, and a lent call takes rounds)."""
    offset = 0 if aligned else 4
    return [_zeros_at(n, np.float32, offset) for _ in range(3)] + [_zeros_at(n, np.uint16, offset)]


# Whether this CPU has the checksum fold in registers that lets BlockUpdate.lent step a
# gradient straight from the lender's memory (AVX-512 with VPCLMULQDQ).
with open("/proc/cpuinfo") as _cpuinfo:
    _FOLD_IN_REGISTERS = "vpclmulqdq" in _cpuinfo.read().split()


def lent_in_registers(path: str, gfmt: HalfFormat | GradFormat, n: int, aligned: bool) -> bool:
    """Whether BlockUpdate.lent takes its in-register way here: each element loaded once into
    the register both counted and stepped, the whole range stepped even where non-finite
    (kernels/block_update.c: step_crc_in_registers where whole_vectors_only)."""
    return (path == "avx512" and _FOLD_IN_REGISTERS and gfmt in (HalfFormat.FP16, HalfFormat.BF16)
            and n % 16 == 0 and aligned)


def update_of(inputs: list[np.ndarray], outs: list[np.ndarray], gfmt: HalfFormat | GradFormat) -> k.BlockUpdate:
    return k.BlockUpdate(*inputs, *outs, grad_format=gfmt, param_format=HalfFormat.BF16,
                         state_format=StateFormat.FP32)


def as_bytes(arrays: list[np.ndarray]) -> list[bytes]:
    return [array.tobytes() for array in arrays]


# ---------------------------------------------------------------------------
# copy_count_nonfinite
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("gfmt", GRAD_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [1, 31, 4096, 8192 + 5, 2**18 + 3])
def test_copy_count_nonfinite_copies_and_counts_the_copy(path: str, gfmt: HalfFormat | GradFormat, n: int) -> None:
    """The destination gets every byte, and the count is count_nonfinite's, at every size around
    the copy's 16 KiB rounds."""
    grad = finite_grads(gfmt, n, seed=n)
    spots = sorted({0, n - 1, n // 2, min(n - 1, 8191), min(n - 1, 8192)})
    grad[spots] = NONFINITE[gfmt]
    copy = np.zeros_like(grad)
    with kernel_path(path):
        assert k.copy_count_nonfinite(grad, copy, gfmt) == len(spots) == k.count_nonfinite(grad, gfmt)
    assert copy.tobytes() == grad.tobytes()
    assert k.copy_count_nonfinite(grad[:0], copy[:0], gfmt) == 0


@pytest.mark.parametrize("gfmt", GRAD_FORMATS, ids=lambda f: f.name)
def test_lent_gradients_may_start_at_any_byte(gfmt: HalfFormat | GradFormat) -> None:
    """A network receive buffer holds its payload after a header, at any byte: both lent
    reads take it (they only copy it), with the bits and counts of an aligned copy."""
    n = LENT_CHUNK + 77
    grad = finite_grads(gfmt, n, seed=4)
    grad[[5, n - 1]] = NONFINITE[gfmt]
    raw = bytearray(grad.nbytes + 1)
    raw[1:] = grad.tobytes()
    odd = np.frombuffer(memoryview(raw)[1:], dtype=grad.dtype)
    assert not odd.flags.aligned or grad.itemsize == 1
    copy = np.zeros_like(grad)
    assert k.copy_count_nonfinite(odd, copy, gfmt) == 2 and copy.tobytes() == grad.tobytes()
    grad[[5, n - 1]] = finite_grads(gfmt, 2, seed=5)
    raw[1:] = grad.tobytes()
    inputs, scalars = state(n, seed=8), k.adam_scalars(HYPER, step=3)
    ordinary, lent = outputs(n), outputs(n)
    expected = update_of(inputs, ordinary, gfmt)(grad, 0, scalars)
    assert update_of(inputs, lent, gfmt).lent(odd, 0, scalars) == (*expected, n)
    assert as_bytes(lent) == as_bytes(ordinary)
    # A whole aligned range: where the registers read the gradient, with unaligned loads.
    whole = LENT_CHUNK
    ordinary, lent = outputs(whole, aligned=True), outputs(whole, aligned=True)
    inputs = [array[:whole] for array in inputs]
    expected = update_of(inputs, ordinary, gfmt)(grad[:whole], 0, scalars)
    assert update_of(inputs, lent, gfmt).lent(odd[:whole], 0, scalars) == (*expected, whole)
    assert as_bytes(lent) == as_bytes(ordinary)


def test_copy_count_nonfinite_refuses_bad_arguments_and_writes_nothing() -> None:
    grad = finite_grads(HalfFormat.FP16, 64, seed=1)
    copy = np.zeros(64, np.uint16)
    for source, destination, fmt in ((grad, copy[:63], HalfFormat.FP16),  # lengths differ
                                     (grad, np.zeros(64, np.float32), HalfFormat.FP16),  # not 16-bit
                                     (grad, copy, 9)):  # no such format
        with pytest.raises(KernelArgumentError):
            k.copy_count_nonfinite(source, destination, fmt)
    with pytest.raises(KernelArgumentError):  # overlapping: the copy would read what it wrote
        k.copy_count_nonfinite(grad[:32], grad[16:48], HalfFormat.FP16)
    readonly = np.zeros(64, np.uint16)
    readonly.flags.writeable = False
    with pytest.raises(KernelArgumentError):
        k.copy_count_nonfinite(grad, readonly, HalfFormat.FP16)
    assert not copy.any()


# ---------------------------------------------------------------------------
# BlockUpdate.lent
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("gfmt", GRAD_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("aligned", [False, True], ids=["peeled", "aligned"])
def test_lent_block_update_equals_the_ordinary_one(path: str, gfmt: HalfFormat | GradFormat, aligned: bool) -> None:
    """Ranges at any start and length (whole rounds, a round and a bit, one element, a tail),
    in rounds or in registers: the same bits, CRCs, count and param copy as BlockUpdate's
    ordinary call."""
    n = 4 * LENT_CHUNK + 77
    grad = finite_grads(gfmt, n, seed=7)
    inputs = state(n, seed=3)
    scalars = k.adam_scalars(HYPER, step=4, grad_scale=2.0)
    with kernel_path(path):
        ordinary, lent = outputs(n, aligned), outputs(n, aligned)
        copies = [np.zeros(n, np.uint16), np.zeros(n, np.uint16)]
        updates = [update_of(inputs, ordinary, gfmt), update_of(inputs, lent, gfmt)]
        for start, stop in ((0, LENT_CHUNK), (LENT_CHUNK, LENT_CHUNK + 1), (5000, 3 * LENT_CHUNK),
                            (LENT_CHUNK + 1, 5000), (3 * LENT_CHUNK, n)):
            s = slice(start, stop)
            expected = updates[0](grad[s], start, scalars, param_copy=copies[0][s])
            assert updates[1].lent(grad[s], start, scalars, param_copy=copies[1][s]) == (*expected, stop - start)
            assert expected[1] == 0
        assert as_bytes(lent + copies[1:]) == as_bytes(ordinary + copies[:1])
        assert updates[1].lent(grad[:0], n, scalars) == (0, 0, 0, 0)


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("gfmt", GRAD_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("aligned", [False, True], ids=["peeled", "aligned"])
def test_lent_block_update_counts_every_nonfinite_element_and_reports_no_crc(
        path: str, gfmt: HalfFormat | GradFormat, aligned: bool) -> None:
    """Every non-finite element of the range is counted and the CRCs are 0 (the device's caller
    then discards the outputs). In rounds, a non-finite element ends the stepping where its
    round starts: the rounds before it are written, nothing from there on. In registers the
    whole range is stepped, as an ordinary call steps it."""
    n = 4 * LENT_CHUNK + (0 if aligned else 9)
    grad = finite_grads(gfmt, n, seed=5)
    spots = [2 * LENT_CHUNK + 17, 3 * LENT_CHUNK, n - 1]
    grad[spots] = NONFINITE[gfmt]
    inputs = state(n, seed=6)
    scalars = k.adam_scalars(HYPER, step=2)
    stepped = n if lent_in_registers(path, gfmt, n, aligned) else 2 * LENT_CHUNK
    with kernel_path(path):
        lent, ordinary = outputs(n, aligned), outputs(n, aligned)
        assert update_of(inputs, lent, gfmt).lent(grad, 0, scalars) == (0, len(spots), 0, stepped)
        update_of(inputs, ordinary, gfmt)(grad, 0, scalars)
    written = slice(0, stepped)
    assert as_bytes([a[written] for a in lent]) == as_bytes([a[written] for a in ordinary])
    assert not any(a[stepped:].any() for a in lent)


@pytest.mark.parametrize("path", path_params())
@pytest.mark.parametrize("aligned", [False, True], ids=["peeled", "aligned"])
def test_lent_block_update_is_checked_on_what_it_steps_while_the_lender_changes_it(path: str, aligned: bool) -> None:
    """A lender flipping gradient elements between finite values and inf/NaN during the call,
    in rounds and in registers: a block counted finite stepped only finite values (no NaN in
    the new state, and its CRC is that of the outputs), and one counted non-finite reports
    CRC 0. Never a NaN stepped under a finite count."""
    n = 1 << 18
    grad = finite_grads(HalfFormat.FP16, n, seed=9)
    finite = grad.copy()
    inputs = state(n, seed=10)
    scalars = k.adam_scalars(HYPER, step=1)
    done = threading.Event()
    spots = np.random.default_rng(11).integers(0, n, 4)

    def flip() -> None:  # NaN for a moment, then finite for a while: both outcomes occur
        while not done.is_set():
            grad[spots] = 0x7E00
            done.wait(0.0001)
            grad[spots] = finite[spots]
            done.wait(0.0003)

    flipper = threading.Thread(target=flip)
    outcomes = {"finite": 0, "nonfinite": 0}
    with kernel_path(path):
        flipper.start()
        try:
            for _ in range(40):
                outs = outputs(n, aligned)
                crc, nonfinite, _, stepped = update_of(inputs, outs, HalfFormat.FP16).lent(grad, 0, scalars)
                if nonfinite:
                    assert crc == 0
                    if lent_in_registers(path, HalfFormat.FP16, n, aligned):
                        assert stepped == n
                    else:
                        assert stepped < n and stepped % LENT_CHUNK == 0
                    outcomes["nonfinite"] += 1
                    continue
                outcomes["finite"] += 1
                assert stepped == n
                assert all(np.isfinite(a).all() for a in outs[:3])
                chained = 0
                for array in outs:
                    chained = k.crc32c(array, chained)
                assert crc == chained
        finally:
            done.set()
            flipper.join()
    assert sum(outcomes.values()) == 40


@pytest.mark.parametrize("kernel", ["__call__", "lent"])
def test_lent_block_update_refuses_what_the_ordinary_one_refuses(kernel: str) -> None:
    n = 256
    inputs, outs = state(n, seed=2), outputs(n)
    update = update_of(inputs, outs, HalfFormat.FP16)
    run = getattr(update, kernel)
    grad = finite_grads(HalfFormat.FP16, 16, seed=2)
    scalars = k.adam_scalars(HYPER, step=1)
    for bad_grad, start in ((grad, n - 15), (grad, -1), (grad, True), (np.zeros(16, np.float32), 0),
                            (outs[3][:16], 0)):  # the last: the gradient is an output's memory
        with pytest.raises(KernelArgumentError):
            run(bad_grad, start, scalars)
    with pytest.raises(KernelArgumentError):
        run(grad, 0, None)
    for copy in (np.zeros(15, np.uint16), outs[3][:16], grad):  # short, a state array, the gradient
        with pytest.raises(KernelArgumentError):
            run(grad, 0, scalars, param_copy=copy)
    assert not any(a.any() for a in outs)
