"""The placement rule of an optimizer over several devices (mount=[...]): which element ranges of which tensors each device holds, and the placement a group's devices record."""
from __future__ import annotations

from .shard import Piece, plan_shards

# The placement rule's unit: the device block of cossd's media format (docs/media-format.md).
# A constant of the rule, not read from the devices, so that the placement is a function of
# the tensor list and the device count alone, known before any namespace exists.
PLACEMENT_BLOCK_ELEMS = 1 << 18


def place_on_devices(tensors: list[tuple[str, int]], devices: int) -> list[list[Piece]]:
    """The placement rule: each device's element ranges (pieces) of `tensors` (name, numel,
    in param order) laid end to end, one contiguous run per device, about total/devices
    elements each, cut only where a block of PLACEMENT_BLOCK_ELEMS ends (a multiple of it
    inside a tensor, or a tensor's end) at the boundary nearest the ideal cut. So a large
    tensor (an embedding) is split across devices, small ones stay whole, and no device
    carries more than its share plus one block. None may be empty: ValueError."""
    shards = plan_shards(tensors, devices, PLACEMENT_BLOCK_ELEMS, none_empty=True)
    empty = [index for index, shard in enumerate(shards) if not shard]
    if empty:
        raise ValueError(
            f"{devices} devices for {sum(numel for _, numel in tensors)} elements in {len(tensors)} tensors: "
            f"device(s) {empty} would hold nothing (tensors are cut only at blocks of "
            f"{PLACEMENT_BLOCK_ELEMS} elements); use fewer devices")
    return shards


def recorded_placement(tensors: list[tuple[str, int]], layouts: list[list[tuple[str, int]]],
                       mounts: list[str]) -> list[list[Piece]]:
    """The placement the devices' namespaces record (each device's tensors, name and numel,
    in order: together they tile `tensors` in order, a tensor split across consecutive
    devices under its own name on each). A job resumes on the placement it was created with,
    whichever rule made it (whole tensors before the split existed). ValueError where the
    devices hold other tensors than these."""
    placement: list[list[Piece]] = []
    index, offset = 0, 0  # the tensor being tiled, and the elements of it placed so far
    for mount, layout in zip(mounts, layouts):
        pieces = []
        for name, numel in layout:
            if index >= len(tensors) or name != tensors[index][0] or offset + numel > tensors[index][1] \
                    or numel < 1:
                raise ValueError(
                    f"the namespace on {mount} holds {name!r} ({numel} elements) where this optimizer "
                    f"places {tensors[index][0] + ' from element ' + str(offset) if index < len(tensors) else 'nothing'}: "
                    "the devices hold a different set of tensors (another model, or the devices named in "
                    "another order); use another namespace name or delete it with `cossd delete-ns`")
            pieces.append(Piece(index, name, offset, offset + numel))
            offset += numel
            if offset == tensors[index][1]:
                index, offset = index + 1, 0
        placement.append(pieces)
    if index != len(tensors):
        raise ValueError(f"the devices' namespaces hold {index} of this optimizer's {len(tensors)} tensors "
                         f"whole ({tensors[index][0]} is not all there): a different set of tensors")
    return placement
