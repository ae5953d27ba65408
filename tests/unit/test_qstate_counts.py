"""Tests of the block-scaled formats' counters (underflow, overflow, the block scales' range): the same counts on every kernel path, and known counts from crafted gradients."""

from __future__ import annotations

import numpy as np
import pytest

import cossd.kernels as k
from cossd.kernels import AdamHyper, HalfFormat, StateFormat
from cossd.kernels.state_formats import MomentCounts, StateCounts

from test_kernels_state_formats import BLOCK_FORMATS, COMBOS, fresh_state, grads, half_grad, kernel_path

PATHS = k.available_kernels()
HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, mode="adamw")


def counted_step(st: dict[str, np.ndarray], grad: np.ndarray, sfmt: StateFormat, scalars: k.AdamScalars,
                 gfmt: HalfFormat = HalfFormat.FP16, pfmt: HalfFormat = HalfFormat.FP16) -> StateCounts:  # fmt: skip
    counts = StateCounts()
    k.adam_step_q(grad, st["master"], st["m"], st["v"], st["master"], st["m"], st["v"], st["param"],
                  exp_avg_scale_in=st["ms"], exp_avg_sq_scale_in=st["vs"], exp_avg_scale_out=st["ms"],
                  exp_avg_sq_scale_out=st["vs"], grad_format=gfmt, param_format=pfmt, state_format=sfmt,
                  scalars=scalars, counts=counts)  # fmt: skip
    return counts


@pytest.mark.parametrize("n", [1, 17, 255, 2**16 + 3])
@pytest.mark.parametrize("sfmt", BLOCK_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(("gfmt", "pfmt", "hyper"), COMBOS, ids=["fp16-adamw", "bf16-adamL2", "mixed-b1lo"])
def test_every_path_counts_the_same(n: int, sfmt: StateFormat, gfmt: HalfFormat, pfmt: HalfFormat,
                                    hyper: AdamHyper) -> None:  # fmt: skip
    """Gradients spanning six decades (the range test's): each step's counts, scales included,
    are the scalar path's on every SIMD path, and some elements do underflow."""
    gs = grads(n, 3, seed=n + 7, gfmt=gfmt)
    results: dict[str, list[StateCounts]] = {}
    for path in PATHS:
        st = fresh_state(n, sfmt, seed=3)
        with kernel_path(path):
            results[path] = [counted_step(st, g, sfmt, k.adam_scalars(hyper, t), gfmt, pfmt)
                             for t, g in enumerate(gs, 1)]  # fmt: skip
    for path in PATHS:
        assert results[path] == results["scalar"], path
    if n > 1000 and sfmt == StateFormat.INT8:
        # Six decades inside a block: INT8's map reaches 7 decades below the absmax, so the
        # second moment's twelve do not all fit (FP16's 2^40 of range per block keeps them).
        assert results["scalar"][-1].exp_avg_sq.underflow > 0
        assert results["scalar"][-1].exp_avg_sq.scaled_blocks == k.state_scale_count(n)


def crafted_grad(n_blocks: int, tiny_per_block: int) -> np.ndarray:
    """BF16 gradients: each block of 256 holds 1.0, then tiny_per_block elements of 1e-15 (whose
    moments, 1e-15 and 1e-30 of the block's largest, no format here keeps), then zeros."""
    g = np.zeros(n_blocks * k.STATE_BLOCK, np.float32)
    blocks = g.reshape(n_blocks, k.STATE_BLOCK)
    blocks[:, 0] = 1.0
    blocks[:, 1:1 + tiny_per_block] = 1e-15
    return half_grad(g, HalfFormat.BF16)


@pytest.mark.parametrize("sfmt", BLOCK_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("path", PATHS)
def test_crafted_underflow_counts(sfmt: StateFormat, path: str) -> None:
    n_blocks, tiny = 3, 37
    st = fresh_state(n_blocks * k.STATE_BLOCK, sfmt, seed=4)
    with kernel_path(path):
        counts = counted_step(st, crafted_grad(n_blocks, tiny), sfmt, k.adam_scalars(HYPER, 1), HalfFormat.BF16)
    expected_scale = {StateFormat.FP16: (2.0**-19, 2.0**-25), StateFormat.INT8: (0.1, 1e-3)}[sfmt]
    for moment, scale in zip((counts.exp_avg, counts.exp_avg_sq), expected_scale):
        assert moment.underflow == n_blocks * tiny
        assert moment.overflow == 0
        assert moment.scaled_blocks == n_blocks
        assert moment.scale_min == moment.scale_max == np.float32(scale)


@pytest.mark.parametrize("sfmt", BLOCK_FORMATS, ids=lambda f: f.name)
def test_overflowing_second_moment_is_counted(sfmt: StateFormat) -> None:
    """A gradient of 1e30 squares past FP32's range: FP16 counts that element, INT8 its block."""
    g = np.full(2 * k.STATE_BLOCK, 1e-3, np.float32)
    g[5] = 1e30
    st = fresh_state(g.size, sfmt, seed=5)
    counts = counted_step(st, half_grad(g, HalfFormat.BF16), sfmt, k.adam_scalars(HYPER, 1), HalfFormat.BF16)
    assert counts.exp_avg.overflow == 0
    assert counts.exp_avg_sq.overflow == (1 if sfmt == StateFormat.FP16 else k.STATE_BLOCK)
    # The poisoned INT8 block has no scale; FP16 keeps one per block
    assert counts.exp_avg_sq.scaled_blocks == (2 if sfmt == StateFormat.FP16 else 1)


def test_elementwise_formats_count_nothing_and_bad_counts_refused() -> None:
    st = {"master": np.ones(300, np.float32), "m": np.zeros(300, np.float32), "v": np.zeros(300, np.float32),
          "param": np.zeros(300, np.uint16)}  # fmt: skip
    counts = StateCounts(exp_avg=MomentCounts(underflow=9))
    k.adam_step_q(np.zeros(300, np.uint16), st["master"], st["m"], st["v"],
                  st["master"], st["m"], st["v"], st["param"], grad_format=HalfFormat.BF16,
                  param_format=HalfFormat.BF16, state_format=StateFormat.FP32, scalars=k.adam_scalars(HYPER, 1),
                  counts=counts)  # fmt: skip
    assert counts == StateCounts()
    with pytest.raises(k.KernelArgumentError, match="counts must be a StateCounts"):
        k.adam_step_q(np.zeros(300, np.uint16), st["master"], st["m"], st["v"], st["master"], st["m"], st["v"],
                      st["param"], grad_format=HalfFormat.BF16, param_format=HalfFormat.BF16,
                      state_format=StateFormat.FP32, scalars=k.adam_scalars(HYPER, 1), counts={})  # fmt: skip


def test_merge_sums_counts_and_widens_the_range() -> None:
    a = MomentCounts(underflow=1, overflow=2, scaled_blocks=1, scale_min=0.5, scale_max=0.5)
    a.merge(MomentCounts())
    assert a == MomentCounts(underflow=1, overflow=2, scaled_blocks=1, scale_min=0.5, scale_max=0.5)
    a.merge(MomentCounts(underflow=3, scaled_blocks=2, scale_min=0.25, scale_max=4.0))
    assert a == MomentCounts(underflow=4, overflow=2, scaled_blocks=3, scale_min=0.25, scale_max=4.0)
    empty = MomentCounts()
    empty.merge(MomentCounts(scaled_blocks=1, scale_min=2.0, scale_max=2.0))
    assert (empty.scale_min, empty.scale_max) == (2.0, 2.0)
