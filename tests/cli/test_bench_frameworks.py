"""`cossd bench --sections frameworks`: the table rendered from recorded figure lines (fast), bad names refused, and the section run for the plain loop through the bench itself (slow: it runs a figure test under pytest)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cossd.harness.bench import report as bench_report, runner
from cossd.harness.bench.frameworks import FRAMEWORKS, figure_row, markdown_rows
from cossd.trainer.options import BENCH_FRAMEWORKS, BENCH_SECTIONS, add_bench_arguments

# Lines the figure tests printed in one run (docs/trainer.md's table).
RECORDED = [
    "plain torch loop, FP32, torch.save of model and optimizer 540688 params, torch: checkpoint 6494069 B, "
    "save 0.05 s, restore 0.12 s",
    "plain torch loop, FP32, no checkpoint (the restart reads the device's step) 540688 params, cossd: "
    "checkpoint 0 B, save 0.00 s, restore 0.28 s",
    "DeepSpeed ZeRO-3 BF16 2 ranks 540688 params, cossd: checkpoint 2177328 B (optimizer files 2169866 B), "
    "save 0.07 s, restore 0.05 s",
]


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser()
    add_bench_arguments(made)
    return made


def test_the_table_is_rendered_from_a_recorded_result() -> None:
    rows = [figure_row(line) for line in RECORDED]
    assert rows[2] == {"what": "DeepSpeed ZeRO-3 BF16 2 ranks", "params": 540688, "optimizer": "cossd",
                       "bytes": 2177328, "optimizer_bytes": 2169866, "save_s": 0.07, "restore_s": 0.05}
    section = {"frameworks": ["plain", "deepspeed"], "rows": rows, "pytest_exit": 0, "seconds": 95.0}
    report = {"machine": {"cpu": "x", "cores": 2, "torch": "t", "simd": "s"}, "elements": 1, "repeat": 1,
              "frameworks": section}
    text = bench_report.markdown(report)
    assert text.splitlines()[-4:] == markdown_rows(report)[-4:]
    assert ("| plain torch loop, FP32, torch.save of model and optimizer | 540,688 | `torch.optim.AdamW` | "
            "6,494,069 | 12.0 | 0.05 s | 0.12 s |") in text
    assert "| DeepSpeed ZeRO-3 BF16 2 ranks | 540,688 | cossd `AdamW` | 2,177,328 (optimizer files 2,169,866) | 4.0 " \
           "| 0.07 s | 0.05 s |" in text
    assert "failed" not in text
    section["pytest_exit"] = 1
    assert "The figure tests failed (pytest exit 1)" in bench_report.markdown(report)


def test_bad_figure_lines_and_framework_names_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="not a figure line"):
        figure_row("plain loop: checkpoint 12 B")
    with pytest.raises(SystemExit):
        parser().parse_args(["--sections", "frameworks", "--frameworks", "plain,megatron"])
    assert "unknown framework(s) ['megatron']: choose from plain, hf, deepspeed, dcp, torchtitan" in \
        capsys.readouterr().err
    assert parser().parse_args(["--frameworks", "torchtitan,plain"]).frameworks == ["plain", "torchtitan"]
    assert "frameworks" in BENCH_SECTIONS and tuple(FRAMEWORKS) == BENCH_FRAMEWORKS


@pytest.mark.mount
@pytest.mark.slow  # a figure test under pytest, with a mount: about a minute on 2 cores
def test_frameworks_section_runs_the_plain_loop(tmp_path: Path) -> None:
    args = parser().parse_args(["--sections", "frameworks", "--frameworks", "plain", "--output", str(tmp_path)])
    assert runner.run(args) == 0
    section = json.loads((tmp_path / "bench.json").read_text())["frameworks"]
    assert section["pytest_exit"] == 0 and section["frameworks"] == ["plain"]
    torch_row, cossd_row = section["rows"]
    assert (torch_row["optimizer"], cossd_row["optimizer"]) == ("torch", "cossd")
    # torch.save of an FP32 model and torch's AdamW: params, both moments (12 B/param); cossd writes nothing.
    assert torch_row["bytes"] > 12 * torch_row["params"] and cossd_row["bytes"] == 0
    assert "| plain torch loop, FP32, no checkpoint" in (tmp_path / "bench.md").read_text()
