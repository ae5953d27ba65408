"""`python -m cossd.harness.bench`: the bench without the CLI (the options of `cossd bench`)."""
from __future__ import annotations

import argparse
import sys

from ...trainer.options import add_bench_arguments
from . import runner

cli = argparse.ArgumentParser(prog="python -m cossd.harness.bench", description=runner.__doc__)
add_bench_arguments(cli)
sys.exit(runner.run(cli.parse_args()))
