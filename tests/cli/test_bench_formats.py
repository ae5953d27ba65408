"""`cossd bench --sections formats` at a tiny size: a CMB row per moment format with the media bytes the device counted, a kernel row per format, and each CPU peer's figure or its reason; no timing assertions."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cossd.harness.bench import runner
from cossd.model.step_model import STATE_DTYPE_BYTES
from cossd.trainer.options import add_bench_arguments

pytestmark = pytest.mark.mount

TINY = 3 * 256 + 5  # scale blocks and a short one


def test_formats_section_tiny(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--sections", "formats", "--elements", str(TINY), "--file-elements", str(TINY),
                              "--repeat", "2", "--output", str(tmp_path / "out")])
    # torchao's AdamW8bit compiles its kernel first (about 20 s here): the docs' run has it
    args.formats_peers = ["torch.optim.AdamW(fused=True)", "bitsandbytes.optim.AdamW8bit"]
    assert runner.run(args) == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())["formats"]
    cmb = {row["state_dtype"]: row for row in report["cmb"]}
    assert list(cmb) == ["fp32", "bf16", "fp16", "int8"]
    for dtype, row in cmb.items():
        assert row["g_el_per_s"] > 0
        # Each step writes the state (master, moments and their scales, param) and a superblock;
        # the copy holding it is padded to its regions' alignment.
        state = TINY * 4 + 2 * -(-TINY * STATE_DTYPE_BYTES[dtype] // 1) + 2 * TINY
        assert row["state_bytes_per_copy"] >= state
        assert state <= row["media_bytes_written_per_step"] < state + 4096
    assert cmb["int8"]["media_bytes_written_per_step"] < cmb["fp16"]["media_bytes_written_per_step"] \
        < cmb["fp32"]["media_bytes_written_per_step"]
    kernel = report["kernel"]
    assert [row["moments"] for row in kernel[:4]] == ["fp32", "bf16", "fp16", "int8"]
    assert all(row["g_el_per_s"] > 0 for row in kernel[:4])
    assert len(kernel) == 6
    for row in kernel[4:]:  # a figure, or why not
        assert ("g_el_per_s" in row) != ("unavailable" in row), row
