"""The peers section's figure (step time, bytes to storage per step, checkpoint stall, per peer), its markdown table and the model check's lines."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _cells(section: dict[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(size, placement, peer, row) for every row of the report, in its order."""
    return [(size, placement, peer, row)
            for size, by_size in section["sizes"].items()
            for placement, rows in by_size["placements"].items()
            for peer, row in rows.items()]


def peers_chart(section: dict[str, Any], path: Path) -> None:
    """One column of panels per size and placement: median step time (bars, p25-p75 whiskers),
    bytes to storage per step, checkpoint stall per save. A peer that did not run is left
    blank and named 'did not run'."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [(size, placement) for size, by_size in section["sizes"].items() for placement in by_size["placements"]]
    peers = list(section["labels"])
    figure, axes = plt.subplots(3, len(groups), figsize=(4.2 * len(groups) + 1, 9), squeeze=False)
    for column, (size, placement) in enumerate(groups):
        rows = section["sizes"][size]["placements"][placement]
        ran = [rows[p].get("ok", False) for p in peers]
        labels = [p.replace("_", "\n") for p in peers]
        medians = [rows[p]["step_s"]["median"] if ok else 0 for p, ok in zip(peers, ran)]
        low = [m - rows[p]["step_s"]["p25"] if ok else 0 for p, ok, m in zip(peers, ran, medians)]
        high = [rows[p]["step_s"]["p75"] - m if ok else 0 for p, ok, m in zip(peers, ran, medians)]
        top = axes[0][column]
        top.bar(labels, medians, yerr=[low, high], color="tab:blue", capsize=3)
        top.set_title(f"{int(size) / 1e6:.0f}M params, {placement}")
        top.set_ylabel("seconds per step (median)")
        for index, ok in enumerate(ran):
            if not ok:
                top.text(index, 0, "did not run", rotation=90, ha="center", va="bottom", fontsize=8)
        moved = [(rows[p].get("storage_bytes_per_step") or 0) / 1e6 if ok else 0 for p, ok in zip(peers, ran)]
        axes[1][column].bar(labels, moved, color="tab:orange")
        axes[1][column].set_ylabel("MB host<->storage per step")
        stall = [rows[p]["checkpoint"]["stall_s"] if ok else 0 for p, ok in zip(peers, ran)]
        axes[2][column].bar(labels, stall, color="tab:red")
        axes[2][column].set_ylabel("checkpoint stall per save, s")
        for row_axes in axes:
            row_axes[column].tick_params(axis="x", labelsize=7)
    figure.suptitle("cossd beside its peers: one run, same GPT, same disk, same threads, alternating turns")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:,.1f}"


def markdown_rows(section: dict[str, Any]) -> list[str]:
    """The peers table: one line per size, placement and peer."""
    lines = ["| params | placement | peer | step s (median; p25-p75) | MB to storage / step | checkpoint stall s | "
             "checkpoint MB | restore s | restore MB read | trainer peak RSS MB | storage peak RSS MB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for size, placement, peer, row in _cells(section):
        name = section["labels"][peer]
        if not row.get("ok"):
            lines.append(f"| {int(size) / 1e6:.0f}M | {placement} | {name} | did not run: {row.get('why')} |"
                         " | | | | | | |")
            continue
        step = row["step_s"]
        restore = row.get("restore") or {}
        restored = (f"{restore['seconds']:.2f}", _mb(restore.get("storage_bytes"))) if restore.get("ok") else \
            (restore.get("why", "-"), "-")
        checkpoint = row["checkpoint"]
        lines.append(
            f"| {row['parameters'] / 1e6:.1f}M | {placement} | {name} | {step['median']:.3f} "
            f"({step['p25']:.3f}-{step['p75']:.3f}) | {_mb(row.get('storage_bytes_per_step'))} | "
            f"{checkpoint['stall_s']:.3f} | {_mb(checkpoint.get('bytes'))} | {restored[0]} | {restored[1]} | "
            f"{_mb(row['trainer_peak_rss_bytes'])} | {_mb(row.get('storage_peak_rss_bytes'))} |")
    return lines


def markdown(section: dict[str, Any]) -> list[str]:
    """bench.md's peers part: the settings, the table, and the model check beside the measured ratios."""
    settings = section["settings"]
    lines = ["", f"Peers: one GPT per size, {settings['steps']} timed steps after {settings['warmup']} warm-up steps, "
             f"{settings['turns']} alternating turns a row; pinned: trainer on cores "
             f"{section['placements'].get('pinned', {}).get('trainer_cores')}, device on "
             f"{section['placements'].get('pinned', {}).get('device_cores')}; disk {section['disk']}.", ""]
    warning = (section.get("compute") or {}).get("warning")
    if warning:
        lines += [f"**{warning}.**", ""]
    lines += markdown_rows(section)
    check = section.get("model_check") or {}
    for key, one in check.get("checks", {}).items():
        size, placement = key.split(" ", 1)
        if "error" not in one:
            lines.append(f"- model check, {int(size) / 1e6:.0f}M {placement}: {one.get('why')}")
            continue
        lines.append(f"- model check, {int(size) / 1e6:.0f}M {placement}: cossd / ZeRO-Infinity predicted "
                     f"{one['predicted_ratio']:.3f}, measured {one['measured_ratio']:.3f}, error {one['error']:+.1%} "
                     f"(device rate from {one['inputs']['device_rate_source']})")
    projection = check.get("projection") or []
    if projection:
        low, high = check["smart_infinity_published_speedup"]
        lines.append("- projection to Smart-Infinity's setup (10 drives, A100): cossd "
                     + ", ".join(f"{row['speedup']:.2f}x at {row['params'] / 1e9:g}B" for row in projection)
                     + f" over ZeRO-Infinity; Smart-Infinity published {low}-{high}x")
    return lines
