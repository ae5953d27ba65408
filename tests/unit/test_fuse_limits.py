"""fs/fuse_limits.py: the FUSE page limit raised only around a mount call, put back after, and never required."""
from __future__ import annotations

from pathlib import Path

import pytest

from cossd.fs import fuse_limits


def test_the_limit_is_raised_for_the_mount_and_put_back(tmp_path: Path) -> None:
    sysctl = tmp_path / "max_pages_limit"
    sysctl.write_text("256\n")
    with fuse_limits.raised_max_pages_limit(512, sysctl) as limit:
        assert limit == 512 and sysctl.read_text().strip() == "512"  # what the mount call sees
    assert sysctl.read_text().strip() == "256"


def test_a_limit_already_high_enough_is_left_alone(tmp_path: Path) -> None:
    sysctl = tmp_path / "max_pages_limit"
    sysctl.write_text("1024\n")
    with fuse_limits.raised_max_pages_limit(512, sysctl) as limit:
        assert limit == 1024
    assert sysctl.read_text().strip() == "1024"


def test_a_value_changed_by_someone_else_meanwhile_is_not_overwritten(tmp_path: Path) -> None:
    sysctl = tmp_path / "max_pages_limit"
    sysctl.write_text("256\n")
    with fuse_limits.raised_max_pages_limit(512, sysctl):
        sysctl.write_text("768\n")  # an administrator's change while the mount ran
    assert sysctl.read_text().strip() == "768"


@pytest.mark.parametrize("setup", ["missing", "read-only"])
def test_without_a_writable_sysctl_the_mount_gets_the_limit_as_it_is(tmp_path: Path, setup: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    sysctl = tmp_path / "max_pages_limit"
    if setup == "read-only":
        sysctl.write_text("256\n")
        monkeypatch.setattr(fuse_limits.os, "access", lambda path, mode: False)
    with fuse_limits.raised_max_pages_limit(512, sysctl) as limit:
        assert limit == 256  # FUSE_MAX_MAX_PAGES where the sysctl does not exist
    if setup == "read-only":
        assert sysctl.read_text().strip() == "256"


def test_a_request_at_or_under_libfuses_own_size_touches_nothing(tmp_path: Path) -> None:
    sysctl = tmp_path / "max_pages_limit"
    sysctl.write_text("100\n")
    with fuse_limits.raised_max_pages_limit(256, sysctl) as limit:
        assert limit == 100
    assert sysctl.read_text().strip() == "100"
