"""`cossd bench --sections scale` at tiny sizes: the report's structure and the facts that do not depend on timing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from cossd.harness.bench import scale as bench_scale
from helpers import run_cli

pytestmark = pytest.mark.mount

SIZES = [1 << 16, 1 << 20]
# A step's superblock write: the media bytes beyond the 14 B/element of the new state copy.
SUPERBLOCK_SLACK = 64 << 10


def test_scale_section_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "b"
    code, out, err = run_cli(capsys, "bench", "--sections", "scale", "--scale-sizes", "64K,1M", "--output", output)
    assert code == 0, out + err
    scale = json.loads((output / "bench.json").read_text())["scale"]
    assert [row["elements"] for row in scale["sizes"]] == SIZES
    for row in scale["sizes"]:
        n = row["elements"]
        assert row["measured"] and row["state_bytes"] == 2 * 14 * n and row["exceeds_ram"] is False
        assert row["turns"] == 15 and row["mount_seconds"] > 0 and row["create_seconds"] > 0
        for transport in ("cmb", "files"):
            moved = row[transport]
            # Every step is committed and moves what the device says a step moves: FP16 grads
            # in and FP16 params out over the host link, a new FP32 master, moments and FP16
            # param copy (14 B/element) onto the media.
            assert moved["steps_committed"] == row["turns"]
            assert moved["host_in_bytes_per_step"] == 2 * n and moved["host_out_bytes_per_step"] == 2 * n
            assert moved["host_bytes_per_step"] == 4 * n
            assert 14 * n <= moved["media_written_bytes_per_step"] <= 14 * n + SUPERBLOCK_SLACK
            assert moved["seconds"] > 0 and moved["gels"] > 0 and moved["first_step_seconds"] > 0
            if scale["disk"]["measured"]:
                assert moved["vs_disk"] > 0
        assert row["rss"]["vm_hwm"] >= row["rss"]["peak_rss"] >= row["rss"]["peak_anon"] > 0
        for transport in ("cmb", "files"):
            assert 0 < row["rss"]["by_transport"][transport]["peak_anon"] <= row["rss"]["peak_anon"]
    assert set(scale["exponents"]) == {"cmb_step_seconds", "files_step_seconds", "daemon_peak_rss",
                                       "daemon_peak_anon", "daemon_peak_anon_cmb", "daemon_peak_anon_files"}
    assert all(isinstance(value, float) for value in scale["exponents"].values())
    assert scale["state_exceeded_ram"] is False and scale["largest_state_bytes"] == 2 * 14 * SIZES[-1]
    # Neither 16M nor 256M is among the sizes: the restore runs at the largest.
    (restore,) = scale["restore"]
    assert restore["elements"] == SIZES[-1] and restore["cossd"]["bytes"] == 2 * SIZES[-1]
    assert restore["torch_load"]["bytes"] > 12 * SIZES[-1]  # FP32 param and both moments, framed
    for key in ("mount_seconds", "read_seconds", "open_seconds", "verify_seconds", "recovery_seconds",
                "open_background_seconds", "verified_after_seconds"):
        assert restore["cossd"][key] >= 0, key
    # The background verification ends after the mount started, never before it was ready.
    assert restore["cossd"]["verified_after_seconds"] >= restore["cossd"]["mount_seconds"]
    assert set(restore["cossd_verify_at_open"]) >= {"mount_seconds", "read_seconds", "seconds"}
    # The same restart started by `cossd mount` as a shell runs it, cold, RESTORE_RUNS times.
    through_cli = restore["cossd_through_cli"]
    assert len(through_cli["runs"]) == 3 and min(through_cli["runs"]) > 0
    assert through_cli["seconds"] == sorted(through_cli["runs"])[1]
    assert restore["warm"]["cossd_params_seconds"] > 0 and restore["warm"]["torch_load_seconds"] > 0
    assert scale["startup_imports"]["with_imports_seconds"] > scale["startup_imports"]["interpreter_seconds"]
    markdown = (output / "bench.md").read_text()
    assert "Scale: one namespace per size" in markdown and "Restore, cold cache" in markdown
    assert (output / "scale.png").stat().st_size > 0


def test_scale_section_skips_what_does_not_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A size whose state and margin exceed the disk's free space gets a "not measured" row,
    and the report is still written."""
    monkeypatch.setattr(bench_scale, "DISK_MARGIN", 1 << 62)
    output = tmp_path / "b"
    code, out, err = run_cli(capsys, "bench", "--sections", "scale", "--scale-sizes", "64K", "--output", output)
    assert code == 0, out + err
    scale = json.loads((output / "bench.json").read_text())["scale"]
    (row,) = scale["sizes"]
    assert not row["measured"] and row["why"].startswith("not measured: ")
    assert scale["exponents"]["cmb_step_seconds"] is None and scale["restore"] == []
    assert "not measured: " in (output / "bench.md").read_text()


def test_scale_sizes_option(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "bench", "--sections", "scale", "--scale-sizes", "1X")
    assert code == 2 and "sizes are counts like 64K" in err
