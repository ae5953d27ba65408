"""A job's process group is freed by destroy_process_group after a cossd optimizer was made (or failed to be): no gloo thread outlives it into exit()."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# One process of a gloo job of one: the group made first (as a job does), then an optimizer
# whose device is missing, then the group destroyed. Prints the threads left, and the default
# torch.distributed.nn.functional.broadcast holds for its group.
JOB = """
import gc, json, os, sys
import torch, torch.distributed as dist
from cossd.trainer import AdamW
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=0, world_size=1)
try:
    AdamW([torch.nn.Parameter(torch.zeros(8))], mount=sys.argv[1] + "/missing", namespace="x")
    failure = None
except Exception as exc:
    failure = type(exc).__name__
    del exc
import torch.distributed.nn.functional as functional
default = repr(functional.broadcast.__defaults__)
dist.destroy_process_group()
gc.collect()
threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
print(json.dumps({"failure": failure, "threads": threads, "default": default}))
"""


def test_a_failed_optimizer_leaves_no_gloo_thread_behind(tmp_path: Path) -> None:
    """Building any torch optimizer imports torch.distributed.nn, whose functions then hold
    the job's group as a default; held, the group outlived destroy_process_group and a rank
    failing at construction could abort at exit (-6) instead of exiting with its own code
    (tests/e2e/test_multirank.py saw it about one run in ten). The optimizer drops them."""
    done = subprocess.run([sys.executable, "-c", JOB, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failure"] is not None  # the missing mount was refused
    assert result["default"] == "(None,)", result
    assert not [name for name in result["threads"] if "gloo" in name], result
