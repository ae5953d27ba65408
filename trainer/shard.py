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


def plan_shards(tensors: list[tuple[str, int]], world: int, block_elems: int) -> list[list[Piece]]:
    """Each rank's pieces of `tensors` (name, numel), in order: contiguous runs of the
    tensors laid end to end, about total/world elements each.

    A cut falls only where a device block ends (a tensor's end, or a multiple of
    `block_elems` inside a tensor), so every gradient block reaches the device whole from one
    rank and none is assembled from two (each block then runs the kernel as soon as it
    arrives, with no staging copy). Each cut is the block boundary nearest the ideal one;
    with fewer blocks than ranks some ranks get nothing (they still join every step).
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
    for rank in range(1, world):
        ideal = total * rank / world
        nearest = min(boundaries, key=lambda at: (abs(at - ideal), at))
        cuts.append(max(nearest, cuts[-1]))
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
