"""The oom section's table for bench.md and its figure, oom.png: each method's memory over time against its cap."""
from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 1 << 20
COLORS = {"dcp": "#d95f02", "tiered": "#7570b3", "cossd": "#1b9e77"}


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:.0f} MiB"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def _bytes_row(name: str, row: dict[str, Any]) -> str:
    """What each method wrote: into the sink's files, the part its own tasks wrote to the disk
    (the throttle's count), and beyond the sink."""
    done = row.get("done") or {}
    throttled = f"{row.get('bytes_to_sink', 0) / 1e6:.0f} MB through the throttle"
    if name == "dcp":
        saved = (f"{done['saves_completed']} saves completed" if "saves_completed" in done else "no save completed")
        return f"{row.get('sink_file_bytes', 0) / 1e6:.0f} MB into checkpoint files ({throttled}); {saved}"
    if name == "tiered" and "stats" in done:
        stats = done["stats"]
        return (f"{row.get('bytes_to_sink', 0) / 1e6:.0f} MB into spill files through the throttle ({stats['spilled']} "
                f"versions spilled whole, the others' spills overtaken by their upload); "
                f"{stats['bytes_uploaded'] / 1e6:.0f} MB to the store ({stats['archived']} versions archived, "
                f"{stats['coalesced']} coalesced)")
    parts = [f"{row.get('bytes_to_sink', 0) / 1e6:.0f} MB to the sink"]
    if name == "cossd" and "host_link_bytes" in done:
        parts.append(f"{done['host_link_bytes'] / 1e6:.0f} MB over the host link (grads in, params out); the state "
                     "is committed on the drive")
        archive = row.get("drive_archive")
        if archive and "error" in archive:
            parts.append(f"the drive's archive: {archive['error']}")
        elif row.get("on_warm_error"):
            parts.append(f"the drive's archive policy was refused: {row['on_warm_error']}")
        elif archive:
            parts.append(f"the drive archived {archive['versions_archived']} versions ({archive['network_bytes_sent'] / 1e6:.0f}"
                         f" MB over its own link, none over the host's)")
    return "; ".join(parts)


def markdown_rows(report: dict[str, Any]) -> list[str]:
    """bench.md's oom table: one row a method, with the setup above it."""
    oom = report["oom"]
    if not oom.get("measured"):
        return ["", f"Per-step checkpoints under a memory cap (oom section): {oom['why']}."]
    setup = oom["setup"]
    sink = setup["sink"]
    model = setup["model"]
    rows = oom["methods"]
    params = next((row["parameters"] for row in rows.values() if row.get("parameters")), 0)
    lines = ["", f"Per-step checkpoints under a cgroup v1 memory cap with a throttled sink (oom section): a GPT of "
             f"{params / 1e6:.1f}M params (d_model {model['d_model']}, {model['layers']} layers), batch "
             f"{setup['batch']}, {setup['steps']} steps, each method in a worker process of its own; the resident "
             f"trainers' state (FP32 params, AdamW moments) is {setup['resident_state_bytes'] / 1e6:.0f} MB. Each "
             f"worker's cap is its own footprint after a warm-up step plus {setup['budget_versions']} versions of "
             f"that state; the sink is {sink['filesystem']}, the worker's writes to it throttled by blkio to "
             f"{sink['write_bytes_per_s'] / MIB:.0f} MiB/s (a probe's buffered writes ran at "
             f"{sink['probe']['bytes_per_s'] / MIB:.1f} MiB/s). Memory is the group's memory.usage_in_bytes "
             f"(what the cap counts: anonymous memory and page cache), sampled every "
             f"{setup['sample_s'] * 1e3:.0f} ms; anonymous is memory.stat's rss + shmem, what the process "
             "allocated; checkpointing's share is its peak over the checkpointed steps less the same figure "
             "over a step of training alone.", "",
             "| method | outcome | steps | footprint (anonymous) | cap | peak (anonymous) | checkpointing's share, "
             "anonymous | stall per step (median, mean, max) | bytes |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        if not row.get("measured"):
            lines.append(f"| {row['label']} | {row['why']} | | | | | | | |")
            continue
        outcome = row["outcome"] + (f" ({row['error']})" if row.get("error") else "")
        lines.append(f"| {row['label']} | {outcome} | {row['steps_done']}/{row['steps_asked']} "
                     f"| {_mib(row.get('footprint_bytes'))} ({_mib(row.get('footprint_anon_bytes'))}) "
                     f"| {_mib(row.get('cap_bytes'))} | {_mib(row.get('peak_bytes'))} "
                     f"({_mib(row.get('peak_anon_bytes'))}) | {_mib(row.get('checkpoint_anon_bytes'))} "
                     f"| {_ms(row.get('stall_median_s'))}, {_ms(row.get('stall_mean_s'))}, {_ms(row.get('stall_max_s'))} "
                     f"| {_bytes_row(name, row)} |")
    tiered = rows.get("tiered", {})
    if tiered.get("done", {}).get("statement"):
        lines += ["", f"The tiered checkpointer's close(): {tiered['done']['statement']}"]
    return lines


def chart(report: dict[str, Any], path: Path) -> None:
    """oom.png: memory over time of the three workers (the cap's count solid, anonymous
    memory dotted), each with its cap dashed; an x where a worker was killed or failed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    oom = report["oom"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, row in oom["methods"].items():
        series = row.get("series_mib")
        if not series or not series["t"]:
            continue
        color = COLORS.get(name, None)
        ax.plot(series["t"], series["usage"], color=color, label=f"{row['label']}: {row['outcome']}")
        ax.plot(series["t"], series["anon"], color=color, linestyle=":", linewidth=1)
        ax.axhline(row["cap_bytes"] / MIB, color=color, linestyle="--", linewidth=0.8)
        if row.get("oom_killed"):  # the kernel kills at the cap; the last sample may be after it
            ax.plot(series["t"][-1], row["cap_bytes"] / MIB, marker="x", markersize=12, color=color)
        elif row.get("outcome") == "failed":
            ax.plot(series["t"][-1], series["usage"][-1], marker="x", markersize=12, color=color)
    ax.axvline(0, color="gray", linewidth=0.5)
    ax.set(xlabel="seconds since the first checkpointed step (before 0: a step of training alone)",
           ylabel="cgroup memory (MiB)",
           title="per-step checkpoints under a memory cap\n(solid: memory.usage_in_bytes, dotted: anonymous, "
                 "dashed: each worker's cap)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
