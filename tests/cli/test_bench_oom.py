"""`cossd bench --sections oom` on a tiny model and a tiny cap: the report's structure and the facts that do not depend on timing."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cossd.harness import bench, cgroups
from cossd.harness.bench.oom import METHODS, OomSettings
from cossd.harness.bench.report import markdown

MIB = 1 << 20

# The tiers' own memory beyond the pool and the parts in flight: boto3's buffers for a
# request, the spill's page cache before fsync; stated in docs/tiers.md.
TIERED_ALLOWANCE = 32 * MIB
# What a cossd step's process may drift by without any checkpoint copy (Python's allocator,
# the worker's own JSON lines): far below one version of the state.
COSSD_NOISE = 8 * MIB

# A 3.7M-param GPT: a resident trainer's state (FP32 params, AdamW's moments) is 44 MB. The
# cap leaves 1.8 versions for checkpointing: DCP's second staged copy cannot fit, the tiered
# checkpointer's pool of one version can. The sink takes 16 MiB/s, a version in about 3 s, and
# a step takes a tenth of that: DCP's saves pile up, and the tiered one's saves wait at most a
# spill each.
TINY = OomSettings(d_model=384, layers=2, heads=6, context=32, batch=2, steps=6, budget=1.8, pool=1.0,
                   spill=3.0, sink_bytes_per_s=16 * MIB, max_stall_s=0.5, chunk_bytes=5 * MIB, max_concurrency=1,
                   drain_s=15.0, run_s=45.0, archive_every=3)


def test_oom_section_tiny(tmp_path: Path) -> None:
    why = cgroups.unavailable()
    if why is not None:
        pytest.skip(f"cgroup v1 memory and blkio groups unavailable: {why}")
    output = tmp_path / "out"
    args = argparse.Namespace(sections=frozenset({"oom"}), elements=1 << 10, repeat=1, threads=[], rounds=1,
                              output=output, oom=TINY)
    assert bench.run(args) == 0
    report = json.loads((output / "bench.json").read_text())["oom"]
    if not report["measured"]:
        pytest.skip(report["why"])  # e.g. the throttle does not bind on this disk: the report says so
    assert (output / "oom.png").stat().st_size > 0
    assert "Per-step checkpoints under a cgroup v1 memory cap" in (output / "bench.md").read_text()
    assert report["setup"]["sink"]["probe"]["binds"]
    rows = report["methods"]
    assert set(rows) == set(METHODS)
    state = report["setup"]["resident_state_bytes"]
    for name, row in rows.items():
        if not row["measured"]:
            assert name == "tiered" and row["why"].startswith("not measured")  # no weed or boto3 here
            continue
        for key in ("outcome", "steps_done", "footprint_bytes", "cap_bytes", "peak_bytes", "stall_mean_s",
                    "bytes_to_sink", "series_mib"):
            assert key in row, (name, key)
        assert row["cap_bytes"] == row["footprint_bytes"] + int(TINY.budget * state)
        assert len(row["series_mib"]["t"]) == len(row["series_mib"]["usage"]) > 0

    dcp = rows["dcp"]
    # A cap smaller than two staged copies: saves that never wait pile up past it.
    assert dcp["outcome"] in ("killed by the OOM killer", "failed"), dcp
    assert dcp["steps_done"] < TINY.steps
    if dcp["oom_killed"]:
        assert dcp["exit_code"] == -9 and dcp["oom_kills"] >= 1

    cossd = rows["cossd"]
    assert cossd["outcome"] == "completed", cossd
    assert cossd["steps_done"] == TINY.steps and cossd["done"]["steps_committed"] >= TINY.steps
    assert cossd["checkpoint_memory_bytes"] <= COSSD_NOISE, cossd["checkpoint_memory_bytes"]
    assert cossd["checkpoint_anon_bytes"] <= COSSD_NOISE, cossd["checkpoint_anon_bytes"]
    assert cossd["bytes_to_sink"] == 0  # the host wrote nothing to the disk: the drive holds the state
    if "drive_archive" in cossd:  # the store runs: the drive took versions for it, from its side
        archive = cossd["drive_archive"]
        assert archive["snapshots_taken"] >= 1 and archive["last_error"] is None, archive

    tiered = rows["tiered"]
    if tiered["measured"]:
        assert tiered["outcome"] == "completed", tiered
        assert tiered["steps_done"] == TINY.steps
        bound = int(TINY.pool * state) + TINY.max_concurrency * TINY.chunk_bytes + TIERED_ALLOWANCE
        assert tiered["checkpoint_anon_bytes"] <= bound, (tiered["checkpoint_anon_bytes"], bound)
        assert not tiered["oom_killed"] and tiered["peak_bytes"] <= tiered["cap_bytes"]
        stats = tiered["done"]["stats"]
        assert stats["memory_peak"] <= stats["memory_bytes"]
        assert stats["saves"] == TINY.steps


def test_oom_section_not_measured_says_why() -> None:
    """Where the section cannot run, bench.md carries its reason in place of the table."""
    report = {"machine": {"cpu": "x", "cores": 2, "torch": "t", "simd": "s"}, "elements": 1, "repeat": 1,
              "oom": {"measured": False, "why": "not measured: not root (creating cgroups needs it)"}}
    assert "oom section): not measured: not root (creating cgroups needs it)." in markdown(report)
