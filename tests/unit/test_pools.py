"""The memory-pool profiles of the trainer's staging pool (model/pools.py): the copy time they model, and bad profiles refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cossd.model.pools import POOLS, PoolProfile, load_pool
from cossd.protocol.status import DeviceError


def test_a_copy_takes_latency_plus_bytes_over_bandwidth_rounded_up() -> None:
    cxl = load_pool("cxl-x8")
    assert cxl.bytes_per_s == 36_000_000_000 and cxl.sources["bytes_per_s"].startswith("Micron CZ120")
    assert cxl.copy_ns(0) == 250
    assert cxl.copy_ns(36_000_000_000) == 1_000_000_250
    assert cxl.copy_ns(1) == 251  # one byte still costs a nanosecond
    assert load_pool("cxl-x8-4way").copy_ns(1 << 30) < cxl.copy_ns(1 << 30)
    with pytest.raises(ValueError):
        cxl.copy_ns(-1)


def test_a_profile_from_a_file_and_bad_ones_refused(tmp_path: Path) -> None:
    path = tmp_path / "slow.json"
    path.write_text(json.dumps({"name": "slow", "bytes_per_s": 100_000_000, "latency_ns": 0}))
    assert load_pool(path) == PoolProfile("slow", "", 100_000_000, 0)
    assert PoolProfile.from_json(POOLS["cxl-x8"].to_json()) == POOLS["cxl-x8"]
    for bad in ({"name": "x", "bytes_per_s": 0, "latency_ns": 0}, {"name": "x", "bytes_per_s": 1},
                {"name": "x", "bytes_per_s": 1, "latency_ns": -1, }, {"name": "x", "bytes_per_s": 1.5, "latency_ns": 0},
                {"name": "x", "bytes_per_s": 1, "latency_ns": 0, "colour": "red"}, ["x"]):
        path.write_text(json.dumps(bad))
        with pytest.raises(DeviceError):
            load_pool(path)
    with pytest.raises(DeviceError, match="built in: ddr5-channel, cxl-x8"):
        load_pool("optane")
