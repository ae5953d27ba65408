"""How fast this CPU runs torch's matmul in FP32 and BF16, and a warning where BF16 is on a slow path.

The peers section trains its GPT in BF16 (cossd's BF16 params, the resident rows' BF16
autocast). A CPU without BF16 matrix instructions (AVX-512 BF16, AMX) runs torch's BF16 matmul
tens of times below FP32 (an AVX2 EPYC: 1.1 GFLOP/s against 58.5 at this shape): every row's step
is then mostly forward and backward, and the rows say little of the optimizer or the storage.
The report says so rather than print ratios near 1.0 that look like a result.
"""
from __future__ import annotations

import time
from typing import Any

# BF16 this many times slower than FP32 is a slow path, not the two formats' usual spread.
SLOW_FACTOR = 4.0
SHAPE = (64, 512, 1024)  # a (tokens x width) by (width x 2 width) product: the GPT's kind
REPEATS = 3


def matmul_rates() -> dict[str, Any]:
    """torch's matmul on one thread in GFLOP/s, FP32 and BF16 (the best of REPEATS after a
    warm-up), torch's CPU capability, and `warning` (None where BF16 is not on a slow path)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows, inner, cols = SHAPE
        rates: dict[str, Any] = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, cols).to(dtype)
            a @ b
            best = float("inf")
            for _ in range(REPEATS):
                started = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - started)
            rates[f"{name}_gflops"] = 2 * rows * inner * cols / max(best, 1e-9) / 1e9
    finally:
        torch.set_num_threads(threads)
    rates["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    rates["warning"] = slow_bf16_warning(rates)
    return rates


def slow_bf16_warning(rates: dict[str, Any]) -> str | None:
    """What the peers rows mean where BF16 runs SLOW_FACTOR or more below FP32; else None."""
    fp32, bf16 = rates["fp32_gflops"], rates["bf16_gflops"]
    if bf16 * SLOW_FACTOR > fp32:
        return None
    return (f"torch's BF16 matmul runs at {bf16:.1f} GFLOP/s on this CPU against {fp32:.1f} for FP32 "
            f"({fp32 / bf16:.0f}x slower; torch's CPU capability: {rates.get('cpu_capability')}): "
            "the GPT trains in BF16, so every row's step is mostly its forward and backward, and the rows "
            "say little of the optimizer or the storage. Run the section where BF16 has matrix instructions "
            "(AVX-512 BF16, AMX) or on a GPU")
