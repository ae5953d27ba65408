"""`cossd bench`'s report: bench.json, the markdown tables (bench.md, also printed) and the charts (bench.png, oom.png, scale.png)."""
from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from . import trainer as bench_trainer
from ..measure import say


def write_report(report: dict[str, Any], output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (output / "bench.md").write_text(markdown(report) + "\n")
    written = [output / "bench.json", output / "bench.md"]
    try:
        chart(report, output / "bench.png")
        written.append(output / "bench.png")
        if report.get("oom", {}).get("measured"):
            from .oom_report import chart as oom_chart  # the oom section's own figure

            oom_chart(report, output / "oom.png")
            written.append(output / "oom.png")
        if any(row["measured"] for row in report.get("scale", {}).get("sizes", [])):
            from .scale_report import chart as scale_chart  # the scale section's log-log figure

            scale_chart(report, output / "scale.png")
            written.append(output / "scale.png")
        drawn = ""
    except ImportError as exc:  # matplotlib comes with the trainer extra
        drawn = (f"\nbench.png not drawn: {exc.name or 'matplotlib'} is not installed "
                 "(pip install 'cossd[trainer]', or pip install matplotlib); the figures are in the files above")
    say("")
    say(markdown(report))
    say(f"\nwritten: {', '.join(str(path) for path in written)}{drawn}")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _device_update_share(row: dict[str, Any]) -> str:
    """The block update as a share of the kernel, and of its own roofline where measured."""
    share = f"{row['device_update_vs_kernel']:.0%} of the kernel"
    if row.get("device_update_vs_out_of_place_roofline") is not None:  # older reports lack it
        share += f", {row['device_update_vs_out_of_place_roofline']:.0%} of its roofline"
    return share


def _out_of_place_roofline(row: dict[str, Any]) -> str:
    if row.get("out_of_place_roofline_gels") is None:
        return "not measured"
    return f"{row['out_of_place_roofline_gels']:.2f} G el/s ({row['out_of_place_vs_in_place_roofline']:.2f}x)"


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, torch "
             f"{report['machine']['torch']}, kernel path {report['machine']['simd']}; "
             f"{report['elements']:,} elements, median of {report['repeat']}"
             + (f" turns in each of {report['rounds']} rounds" if "rounds" in report else "") + "."]
    if report.get("kernel"):
        lines += ["", "Kernel, in memory: every contender steps on the same buffers, in turns; G el/s are medians, "
                  "the ratios are medians of turn-by-turn ratios, with the range of the round medians.", "",
                  "| threads | memory bandwidth | roofline (28 B/el) | cossd kernel | torch fused | torch foreach "
                  "| DeepSpeed CPUAdam (cossd / it) | cossd / fused | cossd / roofline | device block update "
                  "| out-of-place roofline (over in place) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report.get("kernel", []):
        deepspeed = (f"{row['deepspeed_gels']:.2f} ({row['cossd_vs_deepspeed']:.2f}x)" if row["deepspeed_gels"]
                     else "not installed" if (row.get("deepspeed_missing") or "").startswith("not installed")
                     else "did not build")
        fused_low, fused_high = row["cossd_vs_fused_round_range"]
        roof_low, roof_high = row["cossd_vs_roofline_round_range"]
        lines.append(f"| {row['threads']} | {row['bandwidth_gbs']:.1f} GB/s | {row['adam_roofline_gels']:.2f} G el/s "
                     f"| {row['cossd_gels']:.2f} | {row['torch_fused_gels']:.2f} | {row['torch_foreach_gels']:.2f} "
                     f"| {deepspeed} | {row['cossd_vs_fused']:.2f}x ({fused_low:.2f}-{fused_high:.2f}) "
                     f"| {row['cossd_vs_roofline']:.0%} ({roof_low:.0%}-{roof_high:.0%}) "
                     f"| {row['cossd_device_gels']:.2f} ({_device_update_share(row)}) "
                     f"| {_out_of_place_roofline(row)} |")
    missing = next((row["deepspeed_missing"] for row in report.get("kernel", []) if row.get("deepspeed_missing")), None)
    if missing:
        lines += ["", f"DeepSpeed CPUAdam: {missing}."]
    if report.get("kernel"):
        moved = report["kernel"][0]["bytes_per_element"]
        lines += ["", "Bytes per element, read + written: " + "; ".join(
            f"{name} {b['read']} + {b['written']}" for name, b in moved.items())
            + (" (torch foreach: at least; it makes a pass per operation)" if "torch_foreach" in moved else "")
            + ". cossd's outputs written with streaming stores: "
            + (", ".join(report["kernel"][0]["streaming_stores"])
               + "; cossd / cossd with ordinary stores: "
               + ", ".join(f"{row['streaming_gain']:.2f}x" for row in report["kernel"]) + " (by thread count)."
               if report["kernel"][0]["streaming_stores"] else
               "none, the call is below kernels.stream_threshold() (the param lines are read first: +2 B).")]
    if "trainer" in report:
        lines += bench_trainer.markdown_rows(report["trainer"])
    if "net" in report:
        from .net import markdown_rows as net_rows  # the net section's own tables

        lines += net_rows(report)
    if "oom" in report:
        from .oom_report import markdown_rows as oom_rows  # the oom section's table

        lines += oom_rows(report)
    if "ranks" in report:
        from .ranks import markdown_rows as ranks_rows  # the ranks section's table

        lines += ranks_rows(report)
    if "devices" in report:
        if report["devices"].get("link") == "netns":  # each device served in a network namespace of its own
            from .devices_net import markdown_rows as devices_net_rows

            lines += devices_net_rows(report["devices"])
        else:
            from .devices import markdown_rows as devices_rows  # the devices section's table

            lines += devices_rows(report)
    if "scale" in report:
        from .scale_report import markdown_rows as scale_rows  # the scale section's tables

        lines += scale_rows(report)
    if "frameworks" in report:
        from .frameworks import markdown_rows as frameworks_rows  # the frameworks' checkpoint table

        lines += frameworks_rows(report)
    if "peers" in report:
        from .peers_report import markdown as peers_markdown  # the peers section's table and model check

        lines += peers_markdown(report["peers"])
    if "file_path" not in report:  # no mount section
        return "\n".join(lines)
    lines += ["", f"Through the mount: medians of {report.get('mount_turns', report['repeat'])} steps each; "
              "rows measured in turns say so.", "",
              "| through the mount (FP16 grads in, FP16 params out) | backing store | front end | G el/s "
              "| of the kernel in memory | of the device block update in memory "
              "| of what the disk sustains at 12 B/element (dd, same run) |",
              "|---|---|---|---|---|---|---|"]
    for row in report.get("file_path", []):
        share = f"{row['vs_kernel_in_memory']:.0%}" if row["vs_kernel_in_memory"] else "kernel not run"
        device_share = (f"{row['vs_device_update_in_memory']:.0%}" if row.get("vs_device_update_in_memory")
                        else "kernel not run")
        what = row["what"]
        if row.get("data_path_speedup"):
            what += f" (the data path is {row['data_path_speedup']:.2f}x this, turn by turn)"
        if row.get("vs_file_path"):
            what += f" ({row['vs_file_path']:.2f}x the O_DIRECT file step, turn by turn)"
        disk = f"{row['vs_disk_at_12_bytes']:.2f}x" if row.get("vs_disk_at_12_bytes") else "-"
        lines.append(f"| {what} | {row.get('media', '')} | {row.get('front_end', '')} | {row['gels']:.3f} "
                     f"| {share} | {device_share} | {disk} |")
    lines += ["", "| checkpoint of one step | seconds | bytes over the link |", "|---|---|---|"]
    for name, row in report.get("checkpoint", {}).items():
        extra = ""
        if "device_flush_seconds" in row:
            extra = (f" (the device's own fsync of {row['device_media_bytes'] / 1e6:.0f} MB took "
                     f"{row['device_flush_seconds']:.3f} s, off the trainer's path)")
        elif "blocking_seconds" in row:
            extra = f" (the call blocked {row['blocking_seconds']:.3f} s; the rest ran in the background)"
        lines.append(f"| {name} | {row['seconds']:.3f}{extra} | {row['bytes_over_link'] / 1e6:.0f} MB |")
    lines += ["", "| restore (cold page cache) | seconds | bytes read |", "|---|---|---|"]
    for name, row in report.get("restore", {}).items():
        detail = ""
        if "mount_seconds" in row:
            detail = f" (device restart {row['mount_seconds']:.3f} + read {row['read_seconds']:.3f})"
        lines.append(f"| {name} | {row['seconds']:.3f}{detail} | {row['bytes'] / 1e6:.0f} MB |")
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trainer = report.get("trainer")
    # Steps through the mount with the media in RAM: files and the memory buffer.
    mount_rows = [row for row in report.get("file_path", [])
                  if row["media"].startswith("tmpfs") and row["o_direct"] and not row["skipped_steps"]]
    panels = 3 + bool(trainer) + bool(mount_rows)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    rows = report.get("kernel", [])
    labels = [f"{r['threads']} thr" for r in rows]
    bars = [("cossd_gels", "cossd"), ("cossd_device_gels", "device update"), ("torch_fused_gels", "torch fused"),
            ("torch_foreach_gels", "torch foreach"), ("deepspeed_gels", "DeepSpeed CPUAdam"),
            ("adam_roofline_gels", "roofline")]
    bars = [(key, name) for key, name in bars if all(r.get(key) for r in rows)]
    width = 0.8 / max(1, len(bars))
    for offset, (key, name) in enumerate(bars):
        axes[0].bar([i + offset * width for i in range(len(rows))], [r[key] for r in rows], width, label=name)
    axes[0].set_xticks([i + (len(bars) - 1) * width / 2 for i in range(len(rows))], labels)
    axes[0].set(title="Adam kernel, in memory", ylabel="G elements/s")
    axes[0].legend(fontsize=8)
    checkpoint = report.get("checkpoint", {})
    axes[1].bar(list(checkpoint), [row["seconds"] for row in checkpoint.values()], color="#d95f02")
    axes[1].set(title="make one step durable", ylabel="seconds")
    axes[1].tick_params(axis="x", labelsize=7)
    restore = report.get("restore", {})
    axes[2].bar(list(restore), [row["seconds"] for row in restore.values()], color="#7570b3")
    axes[2].set(title="restore (cold)", ylabel="seconds")
    axes[2].tick_params(axis="x", labelsize=7)
    if trainer:
        rows = {name.split(" (")[0]: row for name, row in trainer.items()
                if isinstance(row, dict) and name != "iterations"}
        axes[3].bar(list(rows), [row["seconds"] for row in rows.values()], color="#1b9e77")
        axes[3].set(title=f"one durable step, trainer on {trainer['device']}", ylabel="seconds")
        axes[3].tick_params(axis="x", labelsize=7)
    if mount_rows:
        transport_labels = {"files": "files", "cmb": "CMB,\nclient copies", "cmb_in_place": "CMB,\nin place",
                            "execute_program": "Execute\nProgram"}
        names = [transport_labels[row.get("transport", "files")] + ("\n(pyfuse3 alone)" if row["front_end"] == "pyfuse3 alone"
                                                          else "") for row in mount_rows]
        ax = axes[panels - 1]
        ax.bar(names, [row["gels"] for row in mount_rows], color="#e7298a")
        kernel = max((row["cossd_gels"] for row in report.get("kernel", [])), default=None)
        if kernel:
            ax.axhline(0.6 * kernel, color="gray", linestyle="--", label="60% of the kernel")
            ax.legend(fontsize=8)
        ax.set(title="one step through the mount (tmpfs)", ylabel="G elements/s")
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
