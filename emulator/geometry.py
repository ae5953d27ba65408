"""Where a namespace's arrays lie on its media, in the standard library alone: block and region geometry, the copies, the superblock flags and the fixed start of a slot; and the CMB's sizes.

Apart from layout.py (which adds the slot's numpy record) so that what must run before numpy
is imported can use it: the mount daemon warms a restarted device's params into the page
cache while its interpreter is still importing (prefetch.py). The CMB's default and largest
sizes are here for the same reason: `cossd mount` states them in its options, and must not
import numpy (with emulator/cmb.py) before it starts the daemon.
"""
from __future__ import annotations

import dataclasses
import enum
import struct

FORMAT_VERSION = 1

# Elements per kernel block. A gradient block is processed (and its state checksummed) as
# soon as all of its bytes have arrived; block boundaries depend only on the tensor, never
# on how a client chunked its writes, which is what makes any chunking bit-identical.
BLOCK_ELEMS = 1 << 18

# Each state region starts on a page so regions never share a page (torn-page isolation).
REGION_ALIGN = 4096

SUPERBLOCK_MAGIC = b"COSSDSB1"
SLOT_COUNT = 2
# The first fields of a superblock slot (layout.SUPERBLOCK_HEADER, which a test holds this
# to): magic, format_version, crc, seq, committed_step, committed_copy, flags.
SLOT_PREFIX = struct.Struct("<8sIIQQBB")


class Copy(enum.IntEnum):
    """The two copies of every state array; a step reads the committed one, writes the other."""

    A = 0
    B = 1

    @property
    def other(self) -> "Copy":
        return Copy(1 - self.value)


class SuperblockFlags(enum.IntFlag):
    NONE = 0
    # Initial weights or moments may still be written in place; checksums not yet valid.
    LOADING = 1
    # The slot also holds a CRC32C of each block's params alone, after the group records:
    # a restart verifies those before it serves a param, and the rest in the background.
    # Slots written before this flag existed have none, and are verified whole at open.
    PARAM_CRCS = 2


def align_up(value: int, alignment: int = REGION_ALIGN) -> int:
    return (value + alignment - 1) // alignment * alignment


def block_count(numel: int) -> int:
    return max(1, -(-numel // BLOCK_ELEMS))


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where one tensor's arrays live inside each state copy, and its global block range."""

    name: str
    numel: int
    master_offset: int
    exp_avg_offset: int
    exp_avg_sq_offset: int
    param_offset: int
    first_block: int
    block_count: int
    # Block-scaled moments (state_dtype fp16 and int8): where each moment's per-block scales
    # (float32, one per SCALE_BLOCK elements) lie; -1 for fp32 and bf16 moments, which have none.
    exp_avg_scale_offset: int = -1
    exp_avg_sq_scale_offset: int = -1

    def block_range(self, local_block: int) -> tuple[int, int]:
        """Element range [start, end) of one of this tensor's blocks."""
        start = local_block * BLOCK_ELEMS
        return start, min(self.numel, start + BLOCK_ELEMS)


# Elements per scale of a block-scaled moment (kernels.STATE_BLOCK, which a test holds this
# to); a kernel block holds a whole number of them, so each block owns its scales.
SCALE_BLOCK = 256
assert BLOCK_ELEMS % SCALE_BLOCK == 0

# The state formats whose moments keep a float32 scale per SCALE_BLOCK elements, and the
# bytes of one moment code in each state format.
SCALED_STATE_DTYPES = frozenset({"fp16", "int8"})
STATE_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}


def scale_count(numel: int) -> int:
    """Scales a block-scaled moment of `numel` elements keeps."""
    return -(-numel // SCALE_BLOCK)


def plan_layout(
    tensors: list[tuple[str, int]], state_itemsize: int, param_itemsize: int, *, scaled: bool = False
) -> tuple[list[TensorLayout], int]:
    """Lay tensors out in table order; returns the layouts and the bytes of one copy. With
    `scaled` each moment's codes are followed by a region of its float32 block scales."""
    layouts = []
    offset = 0
    first_block = 0
    for name, numel in tensors:
        master = offset
        exp_avg = align_up(master + numel * 4)
        after = align_up(exp_avg + numel * state_itemsize)
        exp_avg_scale = -1
        if scaled:
            exp_avg_scale, after = after, align_up(after + scale_count(numel) * 4)
        exp_avg_sq = after
        after = align_up(exp_avg_sq + numel * state_itemsize)
        exp_avg_sq_scale = -1
        if scaled:
            exp_avg_sq_scale, after = after, align_up(after + scale_count(numel) * 4)
        param = after
        offset = align_up(param + numel * param_itemsize)
        blocks = block_count(numel)
        layouts.append(
            TensorLayout(name, numel, master, exp_avg, exp_avg_sq, param, first_block, blocks,
                         exp_avg_scale, exp_avg_sq_scale)
        )
        first_block += blocks
    return layouts, max(offset, REGION_ALIGN)


def plan_spec_layout(tensors: list[tuple[str, int]], state_dtype: str) -> tuple[list[TensorLayout], int]:
    """plan_layout for a namespace whose moments are in `state_dtype` (params 2 bytes)."""
    return plan_layout(tensors, STATE_ITEMSIZE[state_dtype], 2, scaled=state_dtype in SCALED_STATE_DTYPES)


def region_offset(tensor: TensorLayout, role: str) -> int:
    """Byte offset of one of a tensor's arrays inside a state copy (or a snapshot's state)."""
    return {
        "master": tensor.master_offset,
        "exp_avg": tensor.exp_avg_offset,
        "exp_avg_sq": tensor.exp_avg_sq_offset,
        "param": tensor.param_offset,
        "exp_avg_scale": tensor.exp_avg_scale_offset,
        "exp_avg_sq_scale": tensor.exp_avg_sq_scale_offset,
    }[role]


# The controller memory buffer's default size: address space only until a client touches it
# (memfd pages are allocated on first use), enough for the gradients and params of a
# 128M-parameter model.
DEFAULT_CMB_BYTES = 1 << 30
# Bounds of `cossd mount --cmb-size` (0 turns the CMB off).
MAX_CMB_BYTES = 1 << 40
