"""Bytes per element of each optimizer-state format on the media, as plain numbers: what the timing model and the CLI need without loading the kernels.

The kernels own the formats (kernels/validation.py, kernels/state_formats.py; docs/kernels.md,
"Block-scaled moments"); tests/unit/test_state_layout.py checks this table against them, so
the two cannot drift apart.
"""
from __future__ import annotations

STATE_BLOCK = 256  # elements per scale of a block-scaled moment (kernels: STATE_BLOCK)
SCALE_BYTES = 4  # one FP32 scale (FP16's power of two, INT8's absmax) per block

# Bytes of one moment element's code, and whether the format keeps a scale per block.
MOMENT_CODE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
BLOCK_SCALED: frozenset[str] = frozenset({"fp16", "int8"})


def moment_bytes_per_element(state_dtype: str) -> float:
    """One moment element's bytes on the media, its share of the block scale included
    (fp32 4, bf16 2, fp16 2.0156, int8 1.0156)."""
    if state_dtype not in MOMENT_CODE_BYTES:
        raise ValueError(f"unknown state format {state_dtype!r} (one of {', '.join(MOMENT_CODE_BYTES)})")
    scale_share = SCALE_BYTES / STATE_BLOCK if state_dtype in BLOCK_SCALED else 0.0
    return MOMENT_CODE_BYTES[state_dtype] + scale_share
