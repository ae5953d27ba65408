"""`cossd bench --sections ranks`: the sharded optimizer at 1, 2 and 4 ranks on one shared namespace: step time, and the bytes each rank moved."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..emulator import Device
from ..fs import daemon

from .measure import say

WORLDS = (1, 2, 4)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _job(mountpoint: Path, world: int, config: dict[str, Any], timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """`world` ranks as torchrun starts them; each one's report (a JSON line), by rank."""
    env = os.environ | {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                        "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "cossd.harness.ranks_worker", json.dumps(config | {"mount": str(mountpoint)})]
    ranks = [subprocess.Popen(argv, env=env | {"RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in range(world)]
    reports = []
    try:
        for rank, process in enumerate(ranks):
            out, err = process.communicate(timeout=timeout_s)
            if process.returncode != 0:
                raise RuntimeError(f"rank {rank} of {world} failed (exit {process.returncode}): {err.strip()[-800:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
    return reports


def ranks_costs(workdir: Path, elements: int, steps: int) -> dict[str, Any]:
    """For each world size, a fresh device (backing in `workdir`), one job of `steps` timed
    steps after 2 of warm-up: the step time (the slowest rank's, median) and the bytes moved,
    as the device counted them in all (gradients in, params out) and each rank's share."""
    import statistics

    width = 1024
    layers = max(1, round(elements / (width * width)))
    config = {"width": width, "layers": layers, "warmup": 2, "steps": steps}
    rows = []
    for world in WORLDS:
        directory = workdir / f"ranks-{world}"
        (directory / "mnt").mkdir(parents=True)
        Device.format(directory / "backing")
        pid = daemon.start_background(directory / "backing", directory / "mnt")
        try:
            reports = _job(directory / "mnt", world, config)
        finally:
            daemon.stop_background(directory / "mnt", pid)
        # Rank 0 read the device's counts (every rank's traffic) around the timed steps.
        counted = reports[0]["device"]
        if counted["steps_committed"] != steps:
            raise RuntimeError(f"{world} ranks: the device committed {counted['steps_committed']} of {steps} steps")
        per_step = {key: counted[key] / steps for key in ("grad_bytes_in", "bytes_read")}
        # Every rank steps together (a barrier before each): the step takes the slowest's time.
        slowest = [max(times) for times in zip(*(report["step_s"] for report in reports))]
        n = reports[0]["elements"]
        row = {
            "ranks": world, "elements": n, "step_seconds": statistics.median(slowest),
            "committed_step": reports[0]["committed_step"],
            "device_grad_bytes_in_per_step": per_step["grad_bytes_in"],
            "device_param_bytes_out_per_step": per_step["bytes_read"],
            "per_rank": [{"rank": report["rank"], "shard_elements": report["shard_elements"],
                          "grad_bytes": 2 * report["shard_elements"],
                          "param_bytes": per_step["bytes_read"] / world,
                          "step_seconds": statistics.median(report["step_s"])} for report in reports],
        }
        row["host_bytes_per_rank_per_shard_element"] = [
            (rank["grad_bytes"] + rank["param_bytes"]) / max(1, rank["shard_elements"]) for rank in row["per_rank"]]
        rows.append(row)
        shares = ", ".join(f"{r['grad_bytes'] / 1e6:.1f} MB grads + {r['param_bytes'] / 1e6:.1f} MB params"
                           for r in row["per_rank"])
        say(f"  ranks {world}: step {row['step_seconds'] * 1e3:.1f} ms; the device took "
            f"{per_step['grad_bytes_in'] / 1e6:.1f} MB of gradients and gave {per_step['bytes_read'] / 1e6:.1f} MB "
            f"of params a step; per rank: {shares}")
    return {"layers": layers, "width": width, "steps": steps, "rows": rows}


def markdown_rows(report: dict[str, Any]) -> list[str]:
    section = report["ranks"]
    rows = section["rows"]
    lines = ["", f"Sharded AdamW (ZeRO-1) on one shared namespace: {rows[0]['elements']:,} BF16 params "
             f"({section['layers']} layers of {section['width']}x{section['width']}), ranks as processes on gloo "
             f"(torch.distributed), one thread each, {section['steps']} timed steps after 2 of warm-up; the step time "
             "is the median of the slowest rank's; bytes as the device counted them a step (gradients in, params "
             "out), each rank's gradients from its shard, its params a 1/N share of what the device sent (every "
             "rank reads every param).", "",
             "| ranks | step | gradients in (device, a step) | params out (device, a step) | per rank: shard elements, grads + params |",
             "|---|---|---|---|---|"]
    for row in rows:
        ranks = "; ".join(f"{r['shard_elements']:,}: {r['grad_bytes'] / 1e6:.1f} + {r['param_bytes'] / 1e6:.1f} MB"
                          for r in row["per_rank"])
        lines.append(f"| {row['ranks']} | {row['step_seconds'] * 1e3:.1f} ms | "
                     f"{row['device_grad_bytes_in_per_step'] / 1e6:.1f} MB | "
                     f"{row['device_param_bytes_out_per_step'] / 1e6:.1f} MB | {ranks} |")
    return lines
