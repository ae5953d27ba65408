"""`cossd bench --sections ranks`: the sharded optimizer at 1, 2 and 4 ranks on one shared namespace, its params read back from the device by every rank or read once and all-gathered: step time, and the bytes each rank moved."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from ...emulator import Device
from ...fs import daemon

from ..measure import say

WORLDS = (1, 2, 4)
# How a rank gets the params back (the optimizer's param_gather=).
GATHERS = ("device", "allgather")


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
    """For each world size, a fresh device (backing in `workdir`) and a job of `steps` timed
    steps after 2 of warm-up for each way the params come back (GATHERS; one process has
    only one): the step time and the params' part of it (the slowest rank's, median), and
    the bytes moved, as the device counted them in all (gradients in, params out) and each
    rank's share: its gradients, the params it read from the device, what it all-gathered."""

    width = 1024
    layers = max(1, round(elements / (width * width)))
    # "rows": param_gather="device" at every world size (the section's table before the
    # all-gather existed, kept as it was); "allgather_rows": the all-gather where there are ranks.
    rows: list[dict[str, Any]] = []
    gathered: list[dict[str, Any]] = []
    for world in WORLDS:
        directory = workdir / f"ranks-{world}"
        (directory / "mnt").mkdir(parents=True)
        Device.format(directory / "backing")
        pid = daemon.start_background(directory / "backing", directory / "mnt")
        try:
            for gather in (GATHERS if world > 1 else GATHERS[:1]):
                config = {"width": width, "layers": layers, "warmup": 2, "steps": steps, "param_gather": gather}
                row = _row(world, gather, steps, _job(directory / "mnt", world, config))
                (rows if gather == "device" else gathered).append(row)
        finally:
            daemon.stop_background(directory / "mnt", pid)
    return {"layers": layers, "width": width, "steps": steps, "rows": rows, "allgather_rows": gathered}


def _row(world: int, gather: str, steps: int, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One job's figures (every rank's report) as a row of the section, said as it goes."""
    import statistics

    # Rank 0 read the device's counts (every rank's traffic) around the timed steps.
    counted = reports[0]["device"]
    if counted["steps_committed"] != steps:
        raise RuntimeError(f"{world} ranks: the device committed {counted['steps_committed']} of {steps} steps")
    per_step = {key: counted[key] / steps for key in ("grad_bytes_in", "bytes_read")}
    # Every rank steps together (a barrier before each): the step takes the slowest's time.
    slowest = [max(times) for times in zip(*(report["step_s"] for report in reports))]
    slowest_params = [max(times) for times in zip(*(report["params_s"] for report in reports))]

    def mean(report: dict[str, Any], key: str) -> float:
        return statistics.fmean(moved[key] for moved in report["moved"])

    row = {
        "ranks": world, "param_gather": gather, "elements": reports[0]["elements"],
        "step_seconds": statistics.median(slowest), "params_seconds": statistics.median(slowest_params),
        "committed_step": reports[0]["committed_step"],
        "device_grad_bytes_in_per_step": per_step["grad_bytes_in"],
        "device_param_bytes_out_per_step": per_step["bytes_read"],
        "per_rank": [{"rank": report["rank"], "shard_elements": report["shard_elements"],
                      "grad_bytes": 2 * report["shard_elements"],
                      "param_bytes": mean(report, "device"),
                      "allgather_bytes": mean(report, "allgather_sent") + mean(report, "allgather_received"),
                      "step_seconds": statistics.median(report["step_s"])} for report in reports],
    }
    row["host_bytes_per_rank_per_shard_element"] = [
        (rank["grad_bytes"] + rank["param_bytes"]) / max(1, rank["shard_elements"]) for rank in row["per_rank"]]
    shares = ", ".join(f"{r['grad_bytes'] / 1e6:.1f} MB grads + {r['param_bytes'] / 1e6:.1f} MB params"
                       + (f" + {r['allgather_bytes'] / 1e6:.1f} MB all-gathered" if r["allgather_bytes"] else "")
                       for r in row["per_rank"])
    say(f"  ranks {world}, param_gather={gather}: step {row['step_seconds'] * 1e3:.1f} ms (params back "
        f"{row['params_seconds'] * 1e3:.1f} ms); the device took {per_step['grad_bytes_in'] / 1e6:.1f} MB of "
        f"gradients and gave {per_step['bytes_read'] / 1e6:.1f} MB of params a step; per rank: {shares}")
    return row


def markdown_rows(report: dict[str, Any]) -> list[str]:
    section = report["ranks"]
    rows = sorted(section["rows"] + section.get("allgather_rows", []), key=lambda row: row["ranks"])
    lines = ["", f"Sharded AdamW (ZeRO-1) on one shared namespace: {rows[0]['elements']:,} BF16 params "
             f"({section['layers']} layers of {section['width']}x{section['width']}), ranks as processes on gloo "
             f"(torch.distributed), one thread each, {section['steps']} timed steps after 2 of warm-up; the step time "
             "is the median of the slowest rank's, the params' part of it (params back) likewise; bytes as the device "
             "counted them a step (gradients in, params out), each rank's gradients from its shard, the params it "
             "read from the device (param_gather=\"device\": every param; \"allgather\": its shard's) and the "
             "bytes its all-gather sent and received.", "",
             "| ranks | param_gather | step | params back | gradients in (device, a step) | params out (device, a step) "
             "| per rank: shard elements, grads + params from the device + all-gathered |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        ranks = "; ".join(f"{r['shard_elements']:,}: {r['grad_bytes'] / 1e6:.1f} + {r['param_bytes'] / 1e6:.1f}"
                          f" + {r.get('allgather_bytes', 0) / 1e6:.1f} MB" for r in row["per_rank"])
        lines.append(f"| {row['ranks']} | {row.get('param_gather', 'device')} | {row['step_seconds'] * 1e3:.1f} ms | "
                     f"{row.get('params_seconds', 0.0) * 1e3:.1f} ms | "
                     f"{row['device_grad_bytes_in_per_step'] / 1e6:.1f} MB | "
                     f"{row['device_param_bytes_out_per_step'] / 1e6:.1f} MB | {ranks} |")
    return lines
