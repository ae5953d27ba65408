"""`cossd bench --sections devices`: one optimizer over 1, 2 and 4 devices (mount=[...]), each its own daemon and backing, on a GPT-shaped model whose embedding is about 30% of its params (split across devices by the placement rule): step time, each device's share of the elements and of the step's time, and the bytes on each device's link."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ...emulator import Device
from ...fs import daemon

from ..measure import say

DEVICE_COUNTS = (1, 2, 4)
EMBEDDING_SHARE = 0.3  # of the model's params, as in a small LLM


def gpt_shapes(width: int, layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """A GPT's param shapes: a token embedding (its vocabulary sized for EMBEDDING_SHARE of
    the params), then per layer attention (qkv, proj), an MLP of 4x width and two norms,
    then a final norm. The params laid end to end in this order are what the devices split."""
    per_layer = 12 * width * width + 4 * width
    vocab = round(EMBEDDING_SHARE / (1 - EMBEDDING_SHARE) * (per_layer * layers + width) / width)
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (vocab, width))]
    for layer in range(layers):
        shapes += [(f"h{layer}.qkv", (3 * width, width)), (f"h{layer}.proj", (width, width)),
                   (f"h{layer}.fc", (4 * width, width)), (f"h{layer}.out", (width, 4 * width)),
                   (f"h{layer}.ln1", (2 * width,)), (f"h{layer}.ln2", (2 * width,))]
    return shapes + [("ln_f", (width,))]


def _timed(target: Any, name: str, spent: list[float]) -> None:
    """Wrap target.name so that each call's seconds add to spent[0] (a device's share); a
    call made inside another timed call of the same device (spent[1], the depth) is not
    counted twice."""
    original: Callable[..., Any] = getattr(target, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        spent[1] += 1
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[1] -= 1
            if spent[1] == 0:
                spent[0] += time.perf_counter() - started

    setattr(target, name, timed)


# Per device, a reading of counters outside the device's own (a link's bytes), taken before
# and after the timed steps; the job reports their differences a step.
Counters = Callable[[], dict[str, int]]


def run_job(mounts: list[str], shapes: list[tuple[str, tuple[int, ...]]], warmup: int, steps: int,
            counters: list[Counters] | None = None, **options: Any) -> dict[str, Any]:
    """One process, one optimizer over `mounts` (paths or cossd:// URLs; `options` go to the
    optimizer, a token_file say): `warmup` then `steps` timed steps on fixed BF16 gradients;
    the step times, and per device its elements, seconds and the bytes it counted, with each
    of `counters`' differences a step under "link"."""
    from ...trainer import AdamW

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=torch.bfloat16) * 0.02) for _, shape in shapes]
    optimizer = AdamW([{"params": params, "param_names": [name for name, _ in shapes]}], lr=1e-4,
                      mount=mounts, namespace="bench-devices", **options)
    try:
        children = optimizer._group
        assert children is not None
        # Each device's part of a step: its gradients sent (begin included), its commit waited
        # for, its flush, its params read back, each on the device's own thread (the devices
        # work at once, so their parts overlap within the step).
        spent = [[0.0, 0] for _ in children]
        for child, seconds in zip(children, spent):
            for name in ("_begin_shared", "_wait_for_commit", "_read_params"):
                _timed(child, name, seconds)
            _timed(child.files, "command", seconds)  # the flush (and the commit's polls, counted once)
        for param in params:
            param.grad = (torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel()))
                          * 1e-3).to(torch.bfloat16)
        readers = counters or [lambda: {} for _ in children]
        step_s: list[float] = []
        before: list[dict[str, Any]] = []
        links_before: list[dict[str, int]] = []
        for index in range(warmup + steps):
            if index == warmup:
                before = [child.files.statistics() for child in children]
                links_before = [read() for read in readers]  # after the statistics: their bytes fall outside
                for seconds in spent:
                    seconds[0] = 0.0
            started = time.perf_counter()
            optimizer.step()
            if index >= warmup:
                step_s.append(time.perf_counter() - started)
        links_after = [read() for read in readers]
        after = [child.files.statistics() for child in children]
        devices = []
        for child, seconds, old, new, link_old, link_new in zip(children, spent, before, after, links_before,
                                                                 links_after):
            devices.append({
                "link": {key: (link_new[key] - link_old[key]) / steps for key in link_new},
                "elements": sum(entry.numel for entry in child.entries),
                "tensors": [(entry.name, entry.numel) for entry in child.entries],
                "seconds_per_step": seconds[0] / steps,
                "grad_bytes_in_per_step": (new["grad_bytes_in"] - old["grad_bytes_in"]) / steps,
                "param_bytes_out_per_step": (new["bytes_read"] - old["bytes_read"]) / steps,
                "steps_committed": new["steps_committed"] - old["steps_committed"]})
        return {"step_s": step_s, "devices": devices, "elements": sum(p.numel() for p in params)}
    finally:
        optimizer.close()


def devices_costs(workdir: Path, width: int, layers: int, steps: int) -> dict[str, Any]:
    """For 1, 2 and 4 devices (fresh ones, each its own daemon, backings in `workdir`), one
    job of `steps` timed steps after 2 of warm-up (devices_costs' rows, said as they go)."""
    shapes = gpt_shapes(width, layers)
    rows = []
    for count in DEVICE_COUNTS:
        mounts, pids = [], []
        try:
            for index in range(count):
                directory = workdir / f"devices-{count}-{index}"
                (directory / "mnt").mkdir(parents=True)
                Device.format(directory / "backing", serial=f"BENCHDEV{count}{index:04d}")
                pids.append(daemon.start_background(directory / "backing", directory / "mnt"))
                mounts.append(directory / "mnt")
            job = run_job([str(mount) for mount in mounts], shapes, 2, steps)
        finally:
            for mount, pid in zip(mounts, pids):
                daemon.stop_background(mount, pid)
        if any(device["steps_committed"] != steps for device in job["devices"]):
            raise RuntimeError(f"{count} devices: not every device committed the {steps} timed steps")
        step = statistics.median(job["step_s"])
        row = {"devices": count, "elements": job["elements"], "step_seconds": step, "per_device": job["devices"]}
        rows.append(row)
        shares = "; ".join(f"{d['elements'] / job['elements']:.0%} of the elements, {d['seconds_per_step'] * 1e3:.1f} ms, "
                           f"{d['grad_bytes_in_per_step'] / 1e6:.1f} MB in + {d['param_bytes_out_per_step'] / 1e6:.1f} MB out"
                           for d in job["devices"])
        say(f"  devices {count}: step {step * 1e3:.1f} ms; per device: {shares}")
    embedding = shapes[0][1][0] * shapes[0][1][1]
    return {"width": width, "layers": layers, "steps": steps, "embedding_elements": embedding, "rows": rows}


def markdown_rows(report: dict[str, Any]) -> list[str]:
    """The table of the daemons' run (report.py sends the --devices-link netns run to devices_net.py)."""
    section = report["devices"]
    rows = section["rows"]
    total = rows[0]["elements"]
    lines = ["", f"One optimizer over several devices (mount=[...]), each its own FUSE daemon and backing, one "
             f"process: a GPT-shaped model of {total:,} BF16 params (width {section['width']}, {section['layers']} "
             f"layers, an embedding of {section['embedding_elements']:,} = "
             f"{section['embedding_elements'] / total:.0%} of them, split across devices by the placement rule), "
             f"{section['steps']} timed steps after 2 of warm-up on fixed gradients; the step time is the median; "
             "each device's part of it is the time in its begin and gradients, its commit, its flush and its "
             "params back (each phase of the step runs on every device at once, a thread each, so the devices' "
             "times overlap); bytes as each device counted them a step.", "",
             "| devices | step | per device: share of the elements, time a step, gradients in + params out a step |",
             "|---|---|---|"]
    for row in rows:
        devices = "; ".join(f"{d['elements'] / total:.0%}, {d['seconds_per_step'] * 1e3:.1f} ms, "
                            f"{d['grad_bytes_in_per_step'] / 1e6:.1f} + {d['param_bytes_out_per_step'] / 1e6:.1f} MB"
                            for d in row["per_device"])
        lines.append(f"| {row['devices']} | {row['step_seconds'] * 1e3:.1f} ms | {devices} |")
    return lines
