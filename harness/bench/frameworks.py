"""The frameworks' checkpoint figures (docs/trainer.md): runs the slow-tier figure tests of DeepSpeed ZeRO-1/2/3 and FSDP2 + DCP, and prints one markdown table of their bytes, save stalls and restore times.

Each framework's own test measures its checkpoint with torch.optim.AdamW and with cossd's
AdamW on a real mount (tests/e2e: test_deepspeed_zero.py, test_dcp.py, each
`test_checkpoint_bytes_stall_and_restore_against_torch_adamw`) and reports a figure line;
this runs them as the test suite does (as root, real FUSE mounts; DeepSpeed's need `make
frameworks`) and turns the lines into rows. Usage, from the repository root:

    .venv/bin/python -m cossd.harness.bench.frameworks [--out table.md]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEST = "test_checkpoint_bytes_stall_and_restore_against_torch_adamw"
# torchtitan has no such test yet (its CheckpointManager's save and load times were not found in
# its log the one time it was tried): its checkpoint bytes are in test_torchtitan.py's kill test.
FILES = ("tests/e2e/test_deepspeed_zero.py", "tests/e2e/test_dcp.py")
# A figure line: "<what> <N> params, <torch|cossd>: checkpoint <B> B[ (optimizer files <B> B)],
# save <s> s, restore <s> s".
FIGURE = re.compile(r"^(?P<what>.+?) (?P<params>\d+) params, (?P<kind>torch|cossd): checkpoint (?P<bytes>\d+) B"
                    r"(?: \(optimizer files (?P<optim>\d+) B\))?, save (?P<save>[0-9.]+) s, "
                    r"restore (?P<restore>[0-9.]+) s$")


def run_figure_tests(python: str) -> tuple[int, list[str], str]:
    """pytest on the figure tests (slow tier included); its exit code, the figure lines of
    its summary and its whole output."""
    command = [python, "-m", "pytest", "-q", "-m", "", "-p", "no:cacheprovider", "-k", TEST, *FILES]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    output = done.stdout + done.stderr
    lines = output.splitlines()
    marks = [index for index, line in enumerate(lines) if "reliability figures" in line]
    figures = [line.strip() for line in lines[marks[-1] + 1:]] if marks else []
    return done.returncode, [line for line in figures if FIGURE.match(line)], output


def table(figures: list[str]) -> list[str]:
    """The markdown rows: per framework and config, torch's AdamW then cossd's."""
    rows = ["| framework and config | params | optimizer | bytes one checkpoint writes | B/param | save stall | "
            "restore |", "|---|---|---|---|---|---|---|"]
    for line in figures:
        found = FIGURE.match(line)
        assert found is not None
        params, written = int(found["params"]), int(found["bytes"])
        optimizer = "`torch.optim.AdamW`" if found["kind"] == "torch" else "cossd `AdamW`"
        detail = f" (optimizer files {int(found['optim']):,})" if found["optim"] else ""
        rows.append(f"| {found['what']} | {params:,} | {optimizer} | {written:,}{detail} | {written / params:.1f} | "
                    f"{float(found['save']):.2f} s | {float(found['restore']):.2f} s |")
    return rows


def main() -> int:
    cli = argparse.ArgumentParser(prog="python -m cossd.harness.bench.frameworks", description=__doc__.splitlines()[0])
    cli.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = cli.parse_args()
    started = time.monotonic()
    code, figures, output = run_figure_tests(sys.executable)
    if code != 0 or not figures:
        sys.stderr.write(output[-6000:])
        print(f"the figure tests failed (pytest exit {code}) or reported no figures", file=sys.stderr)
        return 1
    rows = table(figures)
    rows.append("")
    rows.append(f"({len(figures)} figures, {time.monotonic() - started:.0f} s, {time.strftime('%Y-%m-%d')})")
    print("\n".join(rows))
    if args.out is not None:
        args.out.write_text("\n".join(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
