"""The frameworks' checkpoint figures (`cossd bench --sections frameworks`, docs/trainer.md): runs the slow-tier figure tests of the plain torch loop, HF's Trainer, DeepSpeed ZeRO-1/2/3, FSDP2 + DCP and torchtitan, and makes one table of their bytes, save stalls and restore times.

Each framework's own test measures its checkpoint with torch.optim.AdamW and with cossd's
AdamW on a real mount (tests/e2e: test_checkpoint_figures.py, test_deepspeed_zero.py,
test_dcp.py, test_torchtitan.py) and reports a figure line; this runs them as the test suite
does (as root, real FUSE mounts; DeepSpeed's need `make frameworks`, torchtitan's `make
torchtitan`, else pytest skips them and their rows are missing) and turns the lines into rows.
Usage, from the repository root:

    .venv/bin/python -m cossd.harness.bench.frameworks [--frameworks plain,hf] [--out table.md]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...trainer.options import BENCH_FRAMEWORKS, parse_bench_frameworks

REPO = Path(__file__).resolve().parents[2]
# Each framework: its test file and the -k expression of its figure tests.
FRAMEWORKS: dict[str, tuple[str, str]] = {
    "plain": ("tests/e2e/test_checkpoint_figures.py", "test_plain_loop_checkpoint_against_torch_adamw"),
    "hf": ("tests/e2e/test_checkpoint_figures.py", "test_hf_trainer_checkpoint_against_torch_adamw"),
    "deepspeed": ("tests/e2e/test_deepspeed_zero.py", "test_checkpoint_bytes_stall_and_restore_against_torch_adamw"),
    "dcp": ("tests/e2e/test_dcp.py", "test_checkpoint_bytes_stall_and_restore_against_torch_adamw"),
    "torchtitan": ("tests/e2e/test_torchtitan.py", "test_checkpoint_bytes_stall_and_restore_against_torch_adamw"),
}
assert tuple(FRAMEWORKS) == BENCH_FRAMEWORKS  # the names `cossd bench --frameworks` takes
# A figure line: "<what> <N> params, <torch|cossd>: checkpoint <B> B[ (optimizer files <B> B)],
# save <s> s, restore <s> s".
FIGURE = re.compile(r"^(?P<what>.+?) (?P<params>\d+) params, (?P<kind>torch|cossd): checkpoint (?P<bytes>\d+) B"
                    r"(?: \(optimizer files (?P<optim>\d+) B\))?, save (?P<save>[0-9.]+) s, "
                    r"restore (?P<restore>[0-9.]+) s$")


def run_figure_tests(python: str, frameworks: list[str]) -> tuple[int, list[str], str]:
    """pytest on the chosen frameworks' figure tests (slow tier included); its exit code, the
    figure lines of its summary and its whole output."""
    files = list(dict.fromkeys(FRAMEWORKS[name][0] for name in frameworks))
    expression = " or ".join(dict.fromkeys(FRAMEWORKS[name][1] for name in frameworks))
    command = [python, "-m", "pytest", "-q", "-m", "", "-p", "no:cacheprovider", "-rs", "-k", expression, *files]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    output = done.stdout + done.stderr
    lines = output.splitlines()
    marks = [index for index, line in enumerate(lines) if "reliability figures" in line]
    figures = [line.strip() for line in lines[marks[-1] + 1:]] if marks else []
    return done.returncode, [line for line in figures if FIGURE.match(line)], output


def figure_row(line: str) -> dict[str, Any]:
    """One figure line as a row of the report's JSON."""
    found = FIGURE.match(line)
    if found is None:
        raise ValueError(f"not a figure line: {line!r}")
    return {"what": found["what"], "params": int(found["params"]), "optimizer": found["kind"],
            "bytes": int(found["bytes"]), "optimizer_bytes": int(found["optim"]) if found["optim"] else None,
            "save_s": float(found["save"]), "restore_s": float(found["restore"])}


def frameworks_costs(python: str, frameworks: list[str]) -> dict[str, Any]:
    """The section's report: one row per figure, and what pytest said where it failed or skipped."""
    started = time.monotonic()
    code, figures, output = run_figure_tests(python, frameworks)
    report: dict[str, Any] = {"frameworks": frameworks, "rows": [figure_row(line) for line in figures],
                              "pytest_exit": code, "seconds": round(time.monotonic() - started, 1)}
    skipped = [line.strip() for line in output.splitlines() if line.startswith("SKIPPED")]
    if skipped:
        report["skipped"] = skipped
    if code != 0:
        report["failure_tail"] = output[-4000:]
    return report


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The markdown rows: per framework and config, torch's AdamW then cossd's."""
    lines = ["| framework and config | params | optimizer | bytes one checkpoint writes | B/param | save stall | "
             "restore |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        optimizer = "`torch.optim.AdamW`" if row["optimizer"] == "torch" else "cossd `AdamW`"
        detail = f" (optimizer files {row['optimizer_bytes']:,})" if row.get("optimizer_bytes") is not None else ""
        lines.append(f"| {row['what']} | {row['params']:,} | {optimizer} | {row['bytes']:,}{detail} | "
                     f"{row['bytes'] / row['params']:.1f} | {row['save_s']:.2f} s | {row['restore_s']:.2f} s |")
    return lines


def markdown_rows(report: dict[str, Any]) -> list[str]:
    """The frameworks section of `cossd bench`'s markdown (report.py)."""
    section = report["frameworks"]
    lines = ["", f"Framework checkpoints ({', '.join(section['frameworks'])}): torch.optim.AdamW against cossd's "
             f"AdamW, {len(section['rows'])} figures in {section['seconds']:.0f} s.", ""]
    lines += table(section["rows"])
    if section["pytest_exit"] != 0:
        lines += ["", f"The figure tests failed (pytest exit {section['pytest_exit']}): rows may be missing; "
                  "bench.json holds the end of pytest's output."]
    for line in section.get("skipped", []):
        lines.append(f"- {line}")
    return lines


def main() -> int:
    cli = argparse.ArgumentParser(prog="python -m cossd.harness.bench.frameworks", description=__doc__.splitlines()[0])
    cli.add_argument("--frameworks", type=parse_bench_frameworks, default=list(FRAMEWORKS),
                     help=f"comma separated, of {', '.join(FRAMEWORKS)} (default all)")
    cli.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = cli.parse_args()
    report = frameworks_costs(sys.executable, args.frameworks)
    if report["pytest_exit"] != 0 or not report["rows"]:
        sys.stderr.write(report.get("failure_tail", ""))
        print(f"the figure tests failed (pytest exit {report['pytest_exit']}) or reported no figures", file=sys.stderr)
        return 1
    rows = table(report["rows"])
    rows.append("")
    rows.append(f"({len(report['rows'])} figures, {report['seconds']:.0f} s, {time.strftime('%Y-%m-%d')})")
    print("\n".join(rows))
    if args.out is not None:
        args.out.write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
