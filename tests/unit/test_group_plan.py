"""The pure parts of a group of devices: the placement rule (element ranges cut at blocks), a recorded placement read back, and the common step a crash leaves them to recover to."""
from __future__ import annotations

import random

import pytest

from cossd.protocol.group_commit import GroupDisagreementError, GroupPlan, common_step
from cossd.trainer.group import mount_list
from cossd.trainer.placement import PLACEMENT_BLOCK_ELEMS, place_on_devices, recorded_placement


BLOCK = PLACEMENT_BLOCK_ELEMS


def tensors(sizes: list[int]) -> list[tuple[str, int]]:
    return [(f"t{index}", size) for index, size in enumerate(sizes)]


def test_the_placement_rule_tiles_every_tensor_cut_at_blocks_within_a_share_plus_one_block() -> None:
    """Random tensor lists (sizes up to 5 blocks) over 1-6 devices: the pieces tile every
    tensor once, in order; every cut is at a block boundary of its tensor or a tensor's end;
    no device is empty or carries more than its share plus one block; and the rule is a
    function of the list and the count (the same answer twice)."""
    rng = random.Random(7)
    checked = 0
    for _ in range(400):
        sizes = [rng.choice([rng.randint(1, 300), rng.randint(1, 5 * BLOCK)]) for _ in range(rng.randint(1, 8))]
        devices = rng.randint(1, 6)
        try:
            placement = place_on_devices(tensors(sizes), devices)
        except ValueError as exc:
            assert "would hold nothing" in str(exc)
            assert sum(-(-size // BLOCK) for size in sizes) < devices  # fewer blocks than devices
            continue
        checked += 1
        assert placement == place_on_devices(tensors(sizes), devices)
        assert len(placement) == devices and all(placement)
        flat = [piece for shard in placement for piece in shard]
        at = {index: 0 for index in range(len(sizes))}
        for piece in flat:
            assert piece.start == at[piece.index] and piece.stop > piece.start
            assert piece.stop == sizes[piece.index] or piece.stop % BLOCK == 0
            at[piece.index] = piece.stop
        assert [at[index] for index in range(len(sizes))] == sizes
        assert [piece.index for piece in flat] == sorted(piece.index for piece in flat)
        share = sum(sizes) / devices
        assert max(sum(piece.numel for piece in shard) for shard in placement) <= share + BLOCK
    assert checked > 200


def test_a_dominant_tensor_is_split_and_small_ones_stay_whole() -> None:
    """The test net (fc1.weight 1.25 blocks): two or three devices split it at its first block."""
    sizes = [327680, 163840, 2560, 64]
    two = place_on_devices(tensors(sizes), 2)
    assert [[(p.index, p.start, p.stop) for p in shard] for shard in two] == [
        [(0, 0, BLOCK)], [(0, BLOCK, 327680), (1, 0, 163840), (2, 0, 2560), (3, 0, 64)]]
    # An embedding of 30% of 4 blocks' worth of params over 4 devices: no device waits on it alone.
    sizes = [int(0.3 * 16 * BLOCK)] + [BLOCK] * 11
    four = place_on_devices(tensors(sizes), 4)
    assert len({piece.index for piece in four[0]} & {piece.index for piece in four[1]}) == 1
    assert max(sum(p.numel for p in shard) for shard in four) <= sum(sizes) / 4 + BLOCK
    with pytest.raises(ValueError, match="would hold nothing"):
        place_on_devices(tensors([10, 20]), 3)


def test_a_recorded_placement_is_read_back_whole_tensors_included() -> None:
    """What the devices' namespaces list (the old rule's whole tensors, or the new rule's
    pieces) is the placement a resumed job takes; another model's is refused."""
    sizes = [327680, 163840, 2560, 64]
    mounts = ["a", "b", "c"]
    old = [[("t0", 327680)], [("t1", 163840), ("t2", 2560)], [("t3", 64)]]
    placement = recorded_placement(tensors(sizes), old, mounts)
    assert [[(p.index, p.start, p.stop) for p in shard] for shard in placement] == [
        [(0, 0, 327680)], [(1, 0, 163840), (2, 0, 2560)], [(3, 0, 64)]]
    new = place_on_devices(tensors(sizes), 3)
    assert recorded_placement(tensors(sizes), [[(p.name, p.numel) for p in shard] for shard in new], mounts) == new
    with pytest.raises(ValueError, match="different set of tensors"):
        recorded_placement(tensors(sizes), [[("t0", 327680)], [("t1", 163840)], [("t3", 64)]], mounts)
    with pytest.raises(ValueError, match="different set of tensors"):
        recorded_placement(tensors(sizes), [[("t0", 300000)], [("t1", 163840), ("t2", 2560)], [("t3", 64)]], mounts)
    with pytest.raises(ValueError, match="different set of tensors"):
        recorded_placement(tensors(sizes), old[:2] + [[]], mounts)


def test_mount_lists_are_checked() -> None:
    assert mount_list("/mnt/a") is None
    assert mount_list(["cossd://h:1", "cossd://h:2"]) == ["cossd://h:1", "cossd://h:2"]
    with pytest.raises(ValueError, match="more than once"):
        mount_list(["/mnt/a", "/mnt/../mnt/a"])
    with pytest.raises(ValueError, match="non-empty list"):
        mount_list([])
    with pytest.raises(ValueError, match="paths or cossd:// URLs"):
        mount_list(["/mnt/a", 3])


def test_the_common_step_reverts_only_the_devices_one_ahead() -> None:
    assert common_step([4, 4, 4]) == GroupPlan(4, ())
    assert common_step([5, 4, 5]) == GroupPlan(4, (0, 2))
    assert common_step([0, 1]) == GroupPlan(0, (1,))
    with pytest.raises(GroupDisagreementError, match="a at step 2, b at step 4"):
        common_step([2, 4], ["a", "b"])
    with pytest.raises(ValueError):
        common_step([])
