"""The scale section's part of the report: its markdown tables and its log-log figure (scale.png)."""
from __future__ import annotations

from pathlib import Path
from typing import Any


def _size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n:,}"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}"


def markdown_rows(report: dict[str, Any]) -> list[str]:
    scale = report["scale"]
    disk = scale["disk"]
    lines = ["", f"Scale: one namespace per size on a fresh device (a new daemon), backing on {scale['media']}, "
             f"{scale['ram_bytes'] / 2**30:.1f} GiB of RAM; each step through the CMB (the client copying "
             f"grads in and params out, one CMB_WRITE per {_mib(scale['client_chunk_bytes'])} MiB) and through the "
             "files (O_DIRECT 4 MiB pwrites of the grads, preads of the params), the CMB's steps first, then "
             "the files', each after one untimed step; seconds are medians.",
             ("The disk: dd O_DIRECT " + (f"{disk['bytes_per_second'] / 1e9:.2f} GB/s ({disk['bytes'] / 2**30:.1f} GiB), "
                                          f"{disk['gels_at_12_bytes']:.3f} G el/s at 12 B of new state per element"
                                          if disk["measured"] else disk["why"])) + ".", "",
             "| elements | A/B state | > RAM | steps | mount ready, s | namespace created, s | first step, s (CMB, files) | CMB s/step | CMB G el/s | CMB / dd | "
             "files s/step | files G el/s | files / dd | host B/el | media written B/el | media read B/el | "
             "daemon peak RSS MiB (anon, files, shared) | daemon peak anon MiB, CMB / files |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in scale["sizes"]:
        if not row["measured"]:
            lines.append(f"| {_size(row['elements'])} | {row['state_bytes'] / 1e9:.1f} GB | | | {row['why']} "
                         "| | | | | | | | | | | | | |")
            continue
        cmb, files, rss, n = row["cmb"], row["files"], row["rss"], row["elements"]
        lines.append(
            f"| {_size(n)} | {row['state_bytes'] / 1e9:.2f} GB | {'yes' if row['exceeds_ram'] else 'no'} "
            f"| {row['turns']} | {row['mount_seconds']:.2f} | {row['create_seconds']:.2f} "
            f"| {cmb['first_step_seconds']:.2f}, {files['first_step_seconds']:.2f} "
            f"| {cmb['seconds']:.3f} | {cmb['gels']:.3f} | {cmb.get('vs_disk', 0):.2f}x "
            f"| {files['seconds']:.3f} | {files['gels']:.3f} | {files.get('vs_disk', 0):.2f}x "
            f"| {cmb['host_bytes_per_step'] / n:.1f} | {cmb['media_written_bytes_per_step'] / n:.1f} "
            f"| {cmb['media_read_bytes_per_step'] / n:.1f} "
            f"| {_mib(rss['vm_hwm'])} ({_mib(rss['peak_anon'])}, {_mib(rss['peak_file'])}, {_mib(rss['peak_shmem'])}) "
            f"| {_mib(rss['by_transport']['cmb']['peak_anon'])} / {_mib(rss['by_transport']['files']['peak_anon'])} |")
    exponents = scale["exponents"]
    shown = {"cmb_step_seconds": "CMB step time", "files_step_seconds": "file step time",
             "daemon_peak_rss": "daemon peak RSS", "daemon_peak_anon": "its anonymous memory",
             "daemon_peak_anon_cmb": "anonymous while stepping through the CMB",
             "daemon_peak_anon_files": "through the files"}
    lines += ["", "Growth exponents (least-squares slope of log against log(elements)): "
              + ", ".join(f"{label} {exponents[key]:.2f}" if exponents.get(key) is not None else f"{label} n/a"
                          for key, label in shown.items())
              + f". Largest A/B state {scale['largest_state_bytes'] / 1e9:.1f} GB: "
              + ("exceeds RAM." if scale["state_exceeded_ram"] else "fits in RAM.")]
    if scale.get("restore"):
        imports = scale.get("startup_imports", {})
        lines += ["", "Restore, cold cache (posix_fadvise DONTNEED), the median of each side's cold runs: cossd "
                  "params only (a new daemon mounting the device as `cossd mount` does, reading the committed "
                  "params ahead while it imports, params verified before they are served and the rest in the "
                  "background, then the FP16 params read) against torch.load of an FP32 model and its AdamW "
                  "state. The mount's start-up is taken apart from the daemon's own log line: the process start "
                  "(exec and interpreter), its imports, Device.open (recovery) and the FUSE mount with its "
                  f"threads. A fresh python importing what the daemon imports took "
                  f"{imports.get('with_imports_seconds', 0):.3f} s; one importing what `cossd mount` imports "
                  f"before it starts the daemon, {imports.get('through_cli_seconds', 0):.3f} s. Beside it, the "
                  "same restart started by `cossd mount` from a shell (its own process first), with `--verify "
                  "open` (every block checked before the mount is ready), and when the background verification "
                  "was over.", "",
                  "| elements | cossd, s (runs) | mount | process start | imports | Device.open | FUSE mount "
                  "| params read | torch.load full state, s (runs) | bytes cossd / torch | torch.load / cossd "
                  "| through `cossd mount`, s (runs) | all verified after, s "
                  "| with --verify open, s (of which verification) "
                  "| warm: params from the running device, s | warm: torch.load, s | warm: torch.load / cossd |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in scale["restore"]:
            cossd, torch = row["cossd"], row["torch_load"]
            parts = cossd.get("startup") or {}
            at_open = row.get("cossd_verify_at_open")

            def runs(side: dict[str, Any]) -> str:
                return f" ({', '.join(f'{run:.2f}' for run in side['runs'])})" if side.get("runs") else ""

            def part(key: str) -> str:
                return f"{parts[key]:.3f}" if key in parts else "n/a"

            lines.append(
                f"| {_size(row['elements'])} | {cossd['seconds']:.3f}{runs(cossd)} | {cossd['mount_seconds']:.3f} "
                f"| {part('process_start_seconds')} | {part('imports_seconds')} | {part('device_open_seconds')} "
                f"| {part('fuse_mount_seconds')} "
                f"| {cossd['read_seconds']:.3f} | {torch['seconds']:.3f}{runs(torch)} "
                f"| {cossd['bytes'] / 1e6:.0f} MB / {torch['bytes'] / 1e6:.0f} MB | {row['torch_vs_cossd']:.2f}x "
                + (f"| {row['cossd_through_cli']['seconds']:.3f}{runs(row['cossd_through_cli'])} "
                   if row.get("cossd_through_cli") else "| n/a ")
                + f"| {cossd.get('verified_after_seconds', float('nan')):.2f} "
                + (f"| {at_open['seconds']:.3f} ({cossd['verify_seconds']:.3f}) " if at_open else "| n/a ")
                + (f"| {row['warm']['cossd_params_seconds']:.3f} | {row['warm']['torch_load_seconds']:.3f} "
                   f"| {row['warm']['torch_vs_cossd']:.1f}x |" if row.get("warm") else "| n/a | n/a | n/a |"))
    return lines


def chart(report: dict[str, Any], path: Path) -> None:
    """Step time and the daemon's peak RSS against elements, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = report["scale"]
    rows = [row for row in scale["sizes"] if row["measured"]]
    ns = [row["elements"] for row in rows]
    figure, (steps, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    steps.loglog(ns, [row["cmb"]["seconds"] for row in rows], "o-", label="through the CMB")
    steps.loglog(ns, [row["files"]["seconds"] for row in rows], "s-", label="through the files (O_DIRECT)")
    if scale["disk"]["measured"] and ns:
        rate = scale["disk"]["bytes_per_second"]
        steps.loglog(ns, [12 * n / rate for n in ns], "k--", label="12 B/element at dd's write speed")
    steps.set_xlabel("elements")
    steps.set_ylabel("seconds per step")
    steps.set_title("step time")
    steps.legend(fontsize=8)
    memory.loglog(ns, [row["rss"]["vm_hwm"] / 2**20 for row in rows], "o-", label="peak RSS (VmHWM)")
    memory.loglog(ns, [max(row["rss"]["by_transport"]["files"]["peak_anon"], 1) / 2**20 for row in rows], "s-",
                  label="peak anonymous, stepping through the files")
    memory.loglog(ns, [max(row["rss"]["by_transport"]["cmb"]["peak_anon"], 1) / 2**20 for row in rows], "D-",
                  label="peak anonymous, stepping through the CMB")
    memory.loglog(ns, [max(row["rss"]["peak_file"], 1) / 2**20 for row in rows], "^-", label="peak mapped files")
    memory.loglog(ns, [row["state_bytes"] / 2**20 for row in rows], "k:", label="A/B state")
    memory.axhline(scale["ram_bytes"] / 2**20, color="grey", linewidth=0.8, label="RAM")
    memory.set_xlabel("elements")
    memory.set_ylabel("MiB")
    memory.set_title("the daemon's memory")
    memory.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
