"""The pure parts of a group of devices: whole tensors assigned to devices, and the common step a crash leaves them to recover to."""
from __future__ import annotations

import random

import pytest
import torch

from cossd.protocol.group_commit import GroupDisagreementError, GroupPlan, common_step
from cossd.trainer.group import assign_to_devices, mount_list
from cossd.trainer.plan import Entry


def entries(sizes: list[int]) -> list[Entry]:
    return [Entry(index, f"t{index}", 0, torch.zeros(size)) for index, size in enumerate(sizes)]


def test_every_device_gets_whole_tensors_in_order_none_empty_and_the_largest_load_is_minimal() -> None:
    rng = random.Random(7)
    for _ in range(400):
        sizes = [rng.randint(1, 60) for _ in range(rng.randint(1, 10))]
        devices = rng.randint(1, len(sizes))
        runs = assign_to_devices(entries(sizes), devices)
        assert len(runs) == devices and all(runs)
        assert [entry.numel for run in runs for entry in run] == sizes
        # No split into `devices` contiguous runs has a smaller largest run (brute force).
        best = min(max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
                   for cuts in _cuts(len(sizes), devices - 1))
        assert max(sum(entry.numel for entry in run) for run in runs) == best


def _cuts(n: int, count: int, start: int = 1) -> list[tuple[int, ...]]:
    if count == 0:
        return [()]
    return [(at, *rest) for at in range(start, n - count + 1) for rest in _cuts(n, count - 1, at + 1)]


def test_a_dominant_tensor_leaves_no_device_empty() -> None:
    runs = assign_to_devices(entries([327680, 163840, 2560, 64]), 3)
    assert [[entry.numel for entry in run] for run in runs] == [[327680], [163840, 2560], [64]]
    with pytest.raises(ValueError, match="at most as many devices as tensors"):
        assign_to_devices(entries([10, 20]), 3)


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
