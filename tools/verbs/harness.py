"""CLI verbs that run the whole-stack harnesses: demo and bench (cossd.harness).

The harnesses need torch, which no other verb does: they are imported in the handlers, and
the parsers take their options from cossd.trainer.options, which is free of torch, so that
`cossd --help` stays quick.
"""
from __future__ import annotations

import argparse
import sys

from ..arguments import VerbFactory


def cmd_demo(args: argparse.Namespace) -> int:
    from ...harness import demo

    try:
        return demo.main(args)
    except ValueError as exc:
        print(f"cossd demo: {exc}", file=sys.stderr)
        return 2


def cmd_bench(args: argparse.Namespace) -> int:
    from ...harness import bench

    try:
        return bench.run(args)
    except ValueError as exc:  # e.g. --device cuda without a GPU
        print(f"cossd bench: {exc}", file=sys.stderr)
        return 2


def register(verb: VerbFactory) -> None:
    from ...trainer.options import add_bench_arguments, add_demo_arguments

    sub = verb("demo", cmd_demo, "Train a small GPT through a temporary mount, crash the device "
               "mid-step, restore, and compare with torch.save and DCP checkpointing.")
    add_demo_arguments(sub)

    sub = verb("bench", cmd_bench, "Measure the kernel, the file path, checkpoint and restore "
               "against torch's AdamW, torch.save and DCP, side by side in one run.")
    add_bench_arguments(sub)
