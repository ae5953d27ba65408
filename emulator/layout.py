"""Media layouts of a namespace, declared once: superblock slots and state-file regions.

The geometry itself (blocks, regions, copies, flags) is in geometry.py, which needs no numpy;
this adds the superblock slot's record and re-exports the rest for the device's modules.
"""
from __future__ import annotations

import numpy as np

from .geometry import (  # noqa: F401 (re-exported: the device's modules import them from here)
    BLOCK_ELEMS,
    FORMAT_VERSION,
    REGION_ALIGN,
    SCALE_BLOCK,
    SCALED_STATE_DTYPES,
    SLOT_COUNT,
    SLOT_PREFIX,
    SUPERBLOCK_MAGIC,
    Copy,
    SuperblockFlags,
    TensorLayout,
    align_up,
    block_count,
    plan_layout,
    plan_spec_layout,
    region_offset,
    scale_count,
)

# Fixed header of a superblock slot; followed by `block_count` little-endian u32 CRC32C,
# one per kernel block (covering that block's master, exp_avg, exp_avg_sq and param bytes
# in the committed copy), the records of groups 1.. and, with the flag PARAM_CRCS,
# `block_count` more u32: each block's param bytes alone. `crc` covers every byte after the
# crc field.
SUPERBLOCK_HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("format_version", "<u4"),
        ("crc", "<u4"),
        ("seq", "<u8"),
        ("committed_step", "<u8"),
        ("committed_copy", "u1"),
        ("flags", "u1"),
        ("adamw", "u1"),
        ("reserved0", "u1"),
        ("block_count", "<u4"),
        ("steps_committed", "<u8"),
        ("steps_skipped", "<u8"),
        ("last_skipped_step", "<u8"),
        ("lr", "<f8"),
        ("beta1", "<f8"),
        ("beta2", "<f8"),
        ("eps", "<f8"),
        ("weight_decay", "<f8"),
        ("last_grad_scale", "<f8"),
        ("reserved", "<u8", (2,)),
    ]
)
assert SUPERBLOCK_HEADER.itemsize == 128, SUPERBLOCK_HEADER.itemsize
SUPERBLOCK_CRC_START = 16  # bytes before this (magic, version, crc) are not covered
