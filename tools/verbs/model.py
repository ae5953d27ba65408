"""`cossd model`: predict a training step's I/O bytes and time for cossd, ZeRO-Infinity-style
NVMe offload and a per-step checkpoint on a device profile; reproduce Smart-Infinity's table;
and a storage-server topology (one server, several drives, many trainer nodes over a link)."""
from __future__ import annotations

import argparse
import math
import re
from typing import Any

from ...protocol.status import DeviceError
from ...model.links import LINKS, LinkProfile, load_link
from ...model.offload import zero_infinity_serial
from ...model.profiles import (
    DEFAULT_PROFILE,
    PROFILES,
    DeviceProfile,
    load_profile,
)

from ..arguments import VerbFactory
from ..output import emit
from ...model.step_model import (
    DTYPE_BYTES,
    GPU_ADAM_ELEMENTS_PER_S,
    HOST_ADAM_ELEMENTS_PER_S,
    STATE_DTYPE_BYTES,
    StepSetup,
    predict_all,
    smart_infinity_table,
)
from ...model.topology_model import PARAM_READS, TopologySetup, predict_topology

_COUNT = re.compile(r"([0-9]*\.?[0-9]+(?:e[+]?[0-9]+)?)([kmbgt]?)", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def _fail(message: str) -> SystemExit:
    return SystemExit(f"cossd model: {message}")


def parse_count(text: str, what: str) -> int:
    """'7B', '350M', '1.5e9', '124000000' -> a positive integer (decimal multiples)."""
    match = _COUNT.fullmatch(text.strip())
    value = float(match.group(1)) * _SCALE[match.group(2).lower()] if match else 0.0
    if value < 1 or value != round(value):
        raise _fail(f"{what} must be a positive whole number like 7B, 350M or 1.5e9, got {text!r}")
    return round(value)


def parse_number(text: str, what: str, *, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _fail(f"{what} must be a number, got {text!r}") from None
    if not math.isfinite(value) or not (value > 0 if positive else value >= 0):
        raise _fail(f"{what} must be a finite number {'> 0' if positive else '>= 0'}, got {text!r}")
    return value


def _profile(text: str) -> DeviceProfile:
    try:
        return load_profile(text)
    except DeviceError as exc:
        raise _fail(exc.message) from None


def _link(text: str) -> LinkProfile:
    try:
        return load_link(text)
    except DeviceError as exc:
        raise _fail(exc.message) from None


# ---------------------------------------------------------------------- rendering


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.2f}"


def _profiles_text(profiles: list[dict[str, Any]]) -> str:
    rows: list[tuple[str, ...]] = [("profile", "link GB/s", "NAND ch x GB/s", "tR us", "tPROG us", "media r/w GB/s",
             "DRAM GiB", "updater", "Adam G el/s")]
    for p in profiles:
        derived = p["derived"]
        rows.append((p["name"], f"{p['host_link_bytes_per_s'] / 1e9:.2f}",
                     f"{p['nand_channels']} x {p['channel_bytes_per_s'] / 1e9:.1f}",
                     f"{p['read_latency_ns'] / 1000:g}", f"{p['program_latency_ns'] / 1000:g}",
                     f"{derived['media_read_bytes_per_s'] / 1e9:.2f}/{derived['media_write_bytes_per_s'] / 1e9:.2f}",
                     f"{p['dram_bytes'] / (1 << 30):g}", p["updater"],
                     f"{derived['adam_elements_per_s'] / 1e9:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines += [f"  {p['name']}: {p['summary']}" for p in profiles]
    lines.append("sources and equations: docs/timing-model.md")
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(width) if i else cell.ljust(width)
                      for i, (cell, width) in enumerate(zip(row, widths))).rstrip() for row in rows]


def _prediction_text(value: dict[str, Any]) -> str:
    setup = value["setup"]
    uplink = f", shared uplink {setup['uplink_gbs']:g} GB/s" if setup["uplink_gbs"] else ""
    lines = [
        (f"model: {setup['params']:,} params, compute {setup['compute_s']:g} s/step, "
         f"grad {setup['grad_dtype']}, param {setup['param_dtype']}, moments {setup['state_dtype']} "
         "(master fp32)"),
        f"device: {setup['drives']} x {value['profile']['name']} ({value['profile']['summary']}){uplink}",
        "",
    ]
    rows: list[tuple[str, ...]] = [("scheme", "link B/param", "link GB/step", "media read GB", "media write GB",
             "I/O s/step", "step s", "x compute", "bottleneck")]
    for scheme in value["schemes"].values():
        slowdown = scheme["slowdown"]
        rows.append((scheme["label"], f"{scheme['host_link_bytes_per_param']:g}",
                     _gb(scheme["host_link_bytes"]), _gb(scheme["media_read_bytes"]),
                     _gb(scheme["media_write_bytes"]), f"{scheme['io_s']:.3f}", f"{scheme['step_s']:.3f}",
                     "-" if slowdown is None else f"{slowdown:.2f}", scheme["bottleneck"]))
    lines += _table(rows)
    table = value["smart_infinity_table"]
    m = table["M_bytes"]
    lines += ["", (f"Smart-Infinity (HPCA 2024) Table I, host-link traffic per step; M = FP16 model "
                   f"bytes = 2 x params = {_gb(m)} GB")]
    names = {"zero_infinity": "ZeRO-Infinity", "smart_infinity": "Smart-Infinity (FP32 grad/param)",
             "cossd": f"cossd ({setup['grad_dtype']} grad, {setup['param_dtype']} param)"}
    parts = ("gradient_write", "gradient_read", "optimizer_read", "optimizer_write", "param_read")
    rows = [("", *(p.replace("_", " ") for p in parts), "total", "GB")]
    for key, row in table["rows"].items():
        cells = [f"{row['in_M'][p]:g}M" if p in row["in_M"] else "-" for p in parts]
        rows.append((names[key], *cells, f"{row['total_M']:g}M", _gb(row["total_bytes"])))
    lines += _table(rows)
    lines.append(f"ZeRO-Infinity / Smart-Infinity = {table['zero_over_smart_infinity']:g}x, "
                 f"ZeRO-Infinity / cossd = {table['zero_over_cossd']:g}x")
    serial = value["zero_infinity_serial"]
    phases = ", ".join(f"{name.replace('_', ' ')} {seconds:.3f}" for name, seconds in serial["phases_s"].items())
    lines += ["", (f"ZeRO-Infinity as DeepSpeed runs it by default (swap-in, Adam, swap-out in series): "
                   f"{serial['step_s']:.3f} s/step ({phases}); cossd {serial['speedup_of_cossd']:.2f}x faster")]
    return "\n".join(lines)


def _links_text(links: list[dict[str, Any]]) -> str:
    rows: list[tuple[str, ...]] = [("link", "GB/s per direction", "latency us", "per message ns", "per message B")]
    rows += [(link["name"], f"{link['bytes_per_s'] / 1e9:.3f}", f"{link['latency_ns'] / 1000:g}",
              f"{link['message_ns']}", f"{link['message_bytes']}") for link in links]
    lines = _table(rows) + [f"  {link['name']}: {link['summary']}" for link in links]
    lines.append("sources: docs/timing-model.md, or -o json")
    return "\n".join(lines)


def _topology_text(value: dict[str, Any]) -> str:
    setup, link, profile = value["setup"], value["link"], value["profile"]
    reads = ("every node reads every param (from the server's param cache)" if setup["param_reads"] == "all"
             else "each node reads its 1/nodes of the params")
    uplink = f", drives share a {setup['uplink_gbs']:g} GB/s uplink" if setup["uplink_gbs"] else ""
    lines = [
        (f"topology: 1 server with {setup['drives']} x {profile['name']} and {setup['server_nics']} NIC(s), "
         f"{setup['nodes']} trainer node(s), over {link['name']} ({link['summary']}){uplink}"),
        (f"model: {setup['params']:,} params, compute {setup['compute_s']:g} s/step, grad {setup['grad_dtype']}, "
         f"param {setup['param_dtype']}, moments {setup['state_dtype']} (master fp32); {reads}"),
        "",
    ]
    rows: list[tuple[str, ...]] = [("resource", "count", "busy s/step (each)", "GB/step (each)")]
    for name, resource in value["resources"].items():
        moved = "-" if "elements" in resource else _gb(resource["bytes"])
        rows.append((name, str(resource["count"]), f"{resource['busy_s']:.4f}", moved))
    rows.append(("latency (fixed)", "", f"{value['fixed_s']:.6f}", ""))
    lines += _table(rows)
    cycle = value["bytes_per_cycle"]
    lines += [
        "",
        (f"step: I/O {value['io_s']:.3f} s + compute {setup['compute_s']:g} s = {value['step_s']:.3f} s; "
         f"bound by {value['bottleneck']}"),
        (f"bytes per cycle (one step): into the server {_gb(cycle['server_in_bytes'])} GB, out of it "
         f"{_gb(cycle['server_out_bytes'])} GB ({_gb(cycle['param_cache_hit_bytes'])} GB from the param cache); "
         f"each node sends {_gb(cycle['node_out_bytes'])} GB and receives {_gb(cycle['node_in_bytes'])} GB"),
        (f"drives (all): PCIe in {_gb(cycle['drive_link_in_bytes'])} GB, out {_gb(cycle['drive_link_out_bytes'])} GB; "
         f"media read {_gb(cycle['media_read_bytes'])} GB, write {_gb(cycle['media_write_bytes'])} GB"),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- the verb


def cmd_model(args: argparse.Namespace) -> int:

    if args.list_profiles:
        profiles = [profile.to_json() for profile in PROFILES.values()]
        emit(args, {"profiles": profiles}, lambda v: _profiles_text(v["profiles"]))
        return 0
    if args.list_links:
        links = [link.to_json() for link in LINKS.values()]
        emit(args, {"links": links}, lambda v: _links_text(v["links"]))
        return 0
    if args.topology == "server":
        return _cmd_topology(args)
    given = [flag for flag, value in (("--nodes", args.nodes), ("--link", args.link),
                                      ("--server-nics", args.server_nics), ("--param-reads", args.param_reads))
             if value is not None]
    if given:
        raise _fail(f"{', '.join(given)} only apply with --topology server")
    if args.params is None:
        raise _fail("give --params (the model size, e.g. 7B), or --list-profiles")
    profile = _profile(args.profile)
    uplink_gbs = parse_number(args.uplink_gbs, "--uplink-gbs", positive=False)
    drives = parse_count(args.drives, "--drives")
    setup = StepSetup(
        params=parse_count(args.params, "--params"),
        compute_s=parse_number(args.compute_s, "--compute-s", positive=False),
        profile=profile,
        grad_bytes=DTYPE_BYTES[args.grad_dtype],
        param_bytes=DTYPE_BYTES[args.param_dtype],
        moment_bytes=STATE_DTYPE_BYTES[args.state_dtype],
        drives=drives,
        uplink_bytes_per_s=round(uplink_gbs * 1e9),
        host_adam_elements_per_s=round(parse_number(args.host_adam_rate, "--host-adam-rate", positive=True)),
        gpu_adam_elements_per_s=round(parse_number(args.gpu_adam_rate, "--gpu-adam-rate", positive=True)),
    )
    try:
        predictions = predict_all(setup)
    except (ValueError, DeviceError) as exc:
        raise _fail(getattr(exc, "message", str(exc))) from None
    value = {
        "setup": {"params": setup.params, "compute_s": setup.compute_s, "grad_dtype": args.grad_dtype,
                  "param_dtype": args.param_dtype, "state_dtype": args.state_dtype, "drives": drives,
                  "uplink_gbs": uplink_gbs, "host_adam_elements_per_s": setup.host_adam_elements_per_s,
                  "gpu_adam_elements_per_s": setup.gpu_adam_elements_per_s},
        "profile": profile.to_json(),
        "schemes": {p.scheme: p.to_json(setup) for p in predictions},
        "smart_infinity_table": smart_infinity_table(setup.params, grad_bytes=setup.grad_bytes,
                                                     param_bytes=setup.param_bytes),
        "zero_infinity_serial": _serial_zero(setup, predictions[0].step_ns),
    }
    emit(args, value, _prediction_text)
    return 0


def _serial_zero(setup: StepSetup, cossd_step_ns: int) -> dict[str, Any]:
    """ZeRO-Infinity as DeepSpeed runs it by default: swap-in, Adam, swap-out one after the
    other (model/offload.py), and cossd's speedup over it."""
    step = zero_infinity_serial(setup.params, setup.compute_ns, setup.profile, drives=setup.drives,
                                uplink_bytes_per_s=setup.uplink_bytes_per_s,
                                host_adam_elements_per_s=setup.host_adam_elements_per_s,
                                moment_bytes=setup.moment_bytes)
    return {"step_s": step.step_ns / 1e9, "speedup_of_cossd": step.step_ns / cossd_step_ns,
            "phases_s": {"gradient_swap_out": step.gradient_swap_out_ns / 1e9, "swap_in": step.swap_in_ns / 1e9,
                         "adam": step.adam_ns / 1e9, "swap_out": step.swap_out_ns / 1e9}}


def _cmd_topology(args: argparse.Namespace) -> int:
    if args.params is None:
        raise _fail("give --params (the model size, e.g. 7B)")
    profile, link = _profile(args.profile), _link(args.link or DEFAULT_TOPOLOGY_LINK)
    uplink_gbs = parse_number(args.uplink_gbs, "--uplink-gbs", positive=False)
    setup = TopologySetup(
        params=parse_count(args.params, "--params"),
        compute_s=parse_number(args.compute_s, "--compute-s", positive=False),
        profile=profile, link=link,
        drives=parse_count(args.drives, "--drives"),
        nodes=parse_count(args.nodes or "1", "--nodes"),
        server_nics=parse_count(args.server_nics or "1", "--server-nics"),
        grad_bytes=DTYPE_BYTES[args.grad_dtype], param_bytes=DTYPE_BYTES[args.param_dtype],
        moment_bytes=STATE_DTYPE_BYTES[args.state_dtype],
        param_reads=args.param_reads or "all",
        uplink_bytes_per_s=round(uplink_gbs * 1e9),
    )
    try:
        prediction = predict_topology(setup)
    except (ValueError, DeviceError) as exc:
        raise _fail(getattr(exc, "message", str(exc))) from None
    value = {
        "topology": "server",
        "setup": {"params": setup.params, "compute_s": setup.compute_s, "grad_dtype": args.grad_dtype,
                  "param_dtype": args.param_dtype, "state_dtype": args.state_dtype, "drives": setup.drives,
                  "nodes": setup.nodes, "server_nics": setup.server_nics, "param_reads": setup.param_reads,
                  "uplink_gbs": uplink_gbs},
        "profile": profile.to_json(),
        "link": link.to_json(),
    } | prediction
    emit(args, value, _topology_text)
    return 0


DEFAULT_TOPOLOGY_LINK = "100g-rdma"


def register(verb: VerbFactory) -> None:
    sub = verb("model", cmd_model, "Predict a training step's host-link and media bytes and time for "
               "cossd, ZeRO-Infinity-style NVMe offload and a per-step checkpoint on a device profile, "
               "and reproduce Smart-Infinity's traffic table (docs/timing-model.md).")
    sub.add_argument("--params", metavar="N", help="model size in parameters: 7B, 350M, 1.5e9")
    sub.add_argument("--compute-s", default="0", metavar="S",
                     help="forward + backward time per step in seconds (default: 0)")
    sub.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|FILE.json",
                     help=f"device profile: {', '.join(PROFILES)}, or a JSON file of profile fields "
                          f"(default: {DEFAULT_PROFILE})")
    sub.add_argument("--grad-dtype", choices=tuple(DTYPE_BYTES), default="fp16",
                     help="gradient dtype sent to the drive (default: fp16)")
    sub.add_argument("--param-dtype", choices=tuple(DTYPE_BYTES), default="fp16",
                     help="param dtype read back (default: fp16)")
    sub.add_argument("--state-dtype", choices=tuple(STATE_DTYPE_BYTES), default="fp32",
                     help="dtype of the Adam moments on the media (master weights are fp32): fp32 4 B, bf16 2 B, "
                          "fp16 2.016 B and int8 1.016 B per element with their block scales (default: fp32)")
    sub.add_argument("--drives", default="1", metavar="N", help="drives the state is striped over (default: 1)")
    sub.add_argument("--uplink-gbs", default="0", metavar="GB/s",
                     help="a host uplink all drives share, e.g. 15.75 for PCIe Gen3 x16 (default: none)")
    sub.add_argument("--host-adam-rate", default=str(HOST_ADAM_ELEMENTS_PER_S), metavar="EL/S",
                     help="host CPU Adam rate for the ZeRO-Infinity row (default: 3.7e9, 16 cores measured)")
    sub.add_argument("--gpu-adam-rate", default=str(GPU_ADAM_ELEMENTS_PER_S), metavar="EL/S",
                     help="GPU Adam rate for the checkpoint row (default: 1.18e11, one H200 measured)")
    sub.add_argument("--list-profiles", action="store_true", help="list the device profiles and exit")
    sub.add_argument("--topology", choices=("drive", "server"), default="drive",
                     help="drive: the three schemes on drives in the trainer's box (default); server: one "
                          "storage server with --drives drives and --nodes trainer nodes over --link")
    sub.add_argument("--nodes", metavar="N", help="--topology server: trainer nodes (default: 1)")
    sub.add_argument("--link", metavar="NAME|FILE.json",
                     help=f"--topology server: the network link of each NIC: {', '.join(LINKS)}, or a JSON "
                          f"file of link fields (default: {DEFAULT_TOPOLOGY_LINK})")
    sub.add_argument("--server-nics", metavar="N", help="--topology server: the server's NICs (default: 1)")
    sub.add_argument("--param-reads", choices=PARAM_READS,
                     help="--topology server: all: every node reads every param from the server's cache "
                          "(default); shard: each reads its 1/nodes")
    sub.add_argument("--list-links", action="store_true", help="list the network link profiles and exit")
