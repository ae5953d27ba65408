"""A Ctrl-C or SIGTERM on the rank that runs a device group's rank-0 work stays an interrupt: it is not turned into a RuntimeError text (the other ranks get the text)."""
from __future__ import annotations

import pytest

from cossd.trainer.group import DeviceGroup, SoloRanks


def group_of_one_process() -> DeviceGroup:
    # Only the ranks are needed by _on_rank0; the devices themselves are not touched.
    group = object.__new__(DeviceGroup)
    group._group_ranks = SoloRanks()
    return group


def test_an_interrupt_in_rank0_work_is_raised_as_itself() -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        group_of_one_process()._on_rank0(interrupted)


def test_an_error_in_rank0_work_is_handed_to_every_rank_as_text() -> None:
    def failing() -> None:
        raise OSError("device gone")

    assert group_of_one_process()._on_rank0(failing) == "OSError: device gone"
