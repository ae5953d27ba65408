"""The shard plan of a sharded optimizer: which elements of which tensors each rank sends, balanced by elements, cut at device block boundaries."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements start..stop-1 of one tensor (an entry of the plan), sent by one rank."""

    index: int  # the entry's index in the plan
    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_shards(tensors: list[tuple[str, int]], world: int, block_elems: int,
                none_empty: bool = False) -> list[list[Piece]]:
    """Each rank's pieces of `tensors` (name, numel), in order: contiguous runs of the
    tensors laid end to end, about total/world elements each.

    A cut falls only where a device block ends (a tensor's end, or a multiple of
    `block_elems` inside a tensor), so every gradient block reaches the device whole from one
    rank and none is assembled from two (each block then runs the kernel as soon as it
    arrives, with no staging copy). Each cut is the block boundary nearest the ideal one;
    with fewer blocks than ranks some ranks get nothing (they still join every step).
    `none_empty` (the devices of a group, trainer/group.py): each cut is the nearest among
    the boundaries that leave every part at least one block, where there are enough blocks;
    a part then still holds at most total/world plus one block.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if block_elems < 1:
        raise ValueError(f"block size must be >= 1, got {block_elems}")
    # Every block boundary, as (elements before it in the whole layout, tensor, element).
    boundaries = [0]
    for _, numel in tensors:
        blocks = -(-numel // block_elems)
        base = boundaries[-1]
        boundaries.extend(base + min(numel, (block + 1) * block_elems) for block in range(blocks))
    total = boundaries[-1]
    cuts = [0]
    at = 0  # the index in `boundaries` of the last cut
    for rank in range(1, world):
        ideal = total * rank / world
        low, high = 0, len(boundaries) - 1
        if none_empty and len(boundaries) - 1 >= world:
            # After the last cut, and leaving one boundary for each part still to come.
            low, high = at + 1, len(boundaries) - 1 - (world - rank)
        at = min(range(low, high + 1), key=lambda index: (abs(boundaries[index] - ideal), boundaries[index]))
        cuts.append(max(boundaries[at], cuts[-1]))
    cuts.append(total)
    shards: list[list[Piece]] = []
    for rank in range(world):
        low, high = cuts[rank], cuts[rank + 1]
        pieces = []
        offset = 0
        for index, (name, numel) in enumerate(tensors):
            start, stop = max(low, offset) - offset, min(high, offset + numel) - offset
            if start < stop:
                pieces.append(Piece(index, name, start, stop))
            offset += numel
        shards.append(pieces)
    return shards
