"""`cossd top`: a live view of each namespace's step rate, traffic and kernel load, like top/iostat."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ...client import AdminClient
from ..arguments import VerbFactory, add_device_argument, parse_positive

CLEAR_SCREEN = "\x1b[H\x1b[2J"

# Namespace counters that top turns into per-second rates (key in C0h -> key of the rate).
RATES = (
    ("steps_committed", "steps_per_s"),
    ("steps_skipped", "skipped_per_s"),
    ("grad_bytes_in", "grad_bytes_per_s"),
    ("param_bytes_out", "param_bytes_per_s"),
)

# Namespace figures shown as they are (C0h keys).
SHOWN = ("committed_step", "durable_step", "step_open", "steps_committed", "steps_skipped",
         "grad_bytes_in", "param_bytes_out", "kernel_ns", "loading")
# SMART figures shown device-wide (nvme-cli keys).
SMART_SHOWN = ("temperature", "critical_warning", "percent_used", "media_errors", "num_err_log_entries",
               "unsafe_shutdowns", "power_cycles", "host_read_commands", "host_write_commands",
               "data_units_read", "data_units_written")


@dataclasses.dataclass(frozen=True)
class Sample:
    """What the device reported at one instant."""

    monotonic_s: float
    wall_s: float
    namespaces: dict[str, dict[str, Any]]
    smart: dict[str, int]


def take_sample(client: AdminClient) -> Sample:
    # The clock is read first: the interval between two samples is what separates their
    # first commands, the closest we get to when the device read its counters.
    monotonic_s, wall_s = time.monotonic(), time.time()
    return Sample(monotonic_s, wall_s, client.optimizer_log(), client.smart_log())


def _delta(now: int, before: int) -> int:
    # A counter that went down was reset (the namespace was deleted and created again, or the
    # daemon restarted): count from zero, as Prometheus' rate() does.
    return now - before if now >= before else now


def refresh(previous: Sample, current: Sample, mountpoint: Path, number: int) -> dict[str, Any]:
    """One refresh: the figures of `current` and the rates since `previous`."""
    interval_s = current.monotonic_s - previous.monotonic_s
    namespaces: dict[str, dict[str, Any]] = {}
    totals = {rate: 0.0 for _, rate in RATES} | {"kernel_busy_percent": 0.0}
    for name, figures in current.namespaces.items():
        if figures.get("kind", "optimizer") != "optimizer":
            continue  # plain NVM namespaces: their I/O shows in the device's request rates
        before = previous.namespaces.get(name)
        entry: dict[str, Any] = {key: figures.get(key) for key in SHOWN}
        for key, rate in RATES:
            entry[rate] = _delta(figures[key], before[key]) / interval_s if before else None
        # Kernel time is summed over worker threads, so this is in % of one core and can
        # pass 100 when blocks run in parallel.
        entry["kernel_busy_percent"] = (
            100 * _delta(figures["kernel_ns"], before["kernel_ns"]) / 1e9 / interval_s if before else None)
        for key in totals:
            totals[key] += entry[key] or 0.0
        namespaces[name] = entry
    device: dict[str, Any] = {key: current.smart[key] for key in SMART_SHOWN}
    device["temperature_celsius"] = current.smart["temperature"] - 273
    for key in ("host_read_commands", "host_write_commands"):
        device[f"{key}_per_s"] = _delta(current.smart[key], previous.smart[key]) / interval_s
    device |= totals
    return {"mountpoint": str(mountpoint), "refresh": number, "time": current.wall_s,
            "interval_s": interval_s, "device": device, "namespaces": namespaces}


def rate_bytes(value: float | None) -> str:
    """Bytes per second in SI units, as iostat -h prints them: '12.3 MB/s'."""
    if value is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            break
        value /= 1000
    return f"{value:.1f} {unit}/s" if unit != "B" else f"{value:.0f} B/s"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(view: dict[str, Any], iterations: int | None) -> str:
    """The text screen of one refresh."""
    device = view["device"]
    stamp = time.strftime("%H:%M:%S", time.localtime(view["time"]))
    of = f"/{iterations}" if iterations else ""
    title = (f"cossd top - {view['mountpoint']}  {stamp}  refresh {view['refresh']}{of}  "
             f"interval {view['interval_s']:.2f} s")
    health = (f"Device: {device['temperature_celsius']} °C  warning {device['critical_warning']:#04x}  "
              f"used {device['percent_used']}%  media errors {device['media_errors']}  "
              f"errors logged {device['num_err_log_entries']}  unsafe shutdowns {device['unsafe_shutdowns']}")
    load = (f"Load:   {_number(device['steps_per_s'])} steps/s  grad {rate_bytes(device['grad_bytes_per_s'])}  "
            f"param {rate_bytes(device['param_bytes_per_s'])}  kernel {device['kernel_busy_percent']:.1f}%  "
            f"read {device['host_read_commands_per_s']:.1f} req/s  "
            f"write {device['host_write_commands_per_s']:.1f} req/s")
    lines = [title, health, load, ""]
    header = ("NAMESPACE", "STEP", "DURABLE", "OPEN", "STEPS/S", "SKIPPED", "SKIP/S", "GRAD IN",
              "PARAM OUT", "KERNEL%")
    rows: list[tuple[str, ...]] = [header]
    for name, entry in view["namespaces"].items():
        step = str(entry["committed_step"]) + (" L" if entry["loading"] else "")
        rows.append((
            name, step, str(entry["durable_step"]), str(entry["step_open"] or "-"),
            _number(entry["steps_per_s"]), str(entry["steps_skipped"]), _number(entry["skipped_per_s"]),
            rate_bytes(entry["grad_bytes_per_s"]), rate_bytes(entry["param_bytes_per_s"]),
            _number(entry["kernel_busy_percent"], 1),
        ))
    if len(rows) == 1:
        rows.append(("(no namespaces)",) + ("",) * (len(header) - 1))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    for row in rows:
        # The name column reads best left-aligned, the figures right-aligned.
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def pause(seconds: float) -> None:
    """Wait between two samples."""
    time.sleep(seconds)


def run(mountpoint: Path, interval_s: float, iterations: int | None,
        show: Callable[[dict[str, Any]], None], **client_options: Any) -> int:
    """Sample every `interval_s`, and show a refresh after each sample but the first."""
    with AdminClient(mountpoint, **client_options) as client:
        previous = take_sample(client)
        number = 0
        while iterations is None or number < iterations:
            pause(interval_s)
            current = take_sample(client)
            number += 1
            show(refresh(previous, current, mountpoint, number))
            previous = current
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    clear = args.output_format == "normal" and sys.stdout.isatty()

    def show(view: dict[str, Any]) -> None:
        if args.output_format == "json":
            print(json.dumps(view, sort_keys=True), flush=True)  # one object per line
        elif clear:
            print(CLEAR_SCREEN + render(view, args.iterations), flush=True)
        else:
            # Not a terminal (a pipe, a log): refreshes one after another, as top -b does.
            print(render(view, args.iterations) + "\n", flush=True)

    try:
        return run(args.mountpoint, args.interval, args.iterations, show, token_file=args.token_file, ca=args.ca)
    except KeyboardInterrupt:
        return 0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def register(verb: VerbFactory) -> None:
    sub = verb("top", cmd_top, "Live view of each namespace's steps/s, gradient and param traffic, "
               "skipped steps, committed/durable step and kernel load, refreshed every --interval "
               "seconds (from log pages C0h and 02h).")
    add_device_argument(sub)
    sub.add_argument("-d", "--interval", type=_positive_float, default=1.0, metavar="SECONDS",
                     help="seconds between refreshes (default: 1)")
    sub.add_argument("-n", "--iterations", type=parse_positive, metavar="N",
                     help="stop after N refreshes (default: until interrupted)")
