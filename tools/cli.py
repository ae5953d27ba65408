"""The `cossd` command line: format, mount and administer an emulated computational SSD."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from cossd.protocol.status import DeviceError, Status

from .output import emit, open_client, parse_int, parse_size, write_binary


def parse_log_len(text: str) -> int:
    """GET LOG PAGE's length: bytes, a positive multiple of 4 (NUMD counts dwords)."""
    length = parse_int(text)
    if length <= 0 or length % 4 or length > 1 << 34:
        raise argparse.ArgumentTypeError(f"a log length is a positive multiple of 4 up to 16 GiB, got {text}")
    return length


def parse_log_offset(text: str) -> int:
    """GET LOG PAGE's byte offset: a multiple of 4 (the device refuses others: INVALID_FIELD)."""
    offset = parse_int(text)
    if not 0 <= offset < 1 << 64:
        raise argparse.ArgumentTypeError(f"a log page offset is 0 to 2**64-1, got {text}")
    return offset


def parse_port(text: str) -> int:
    """A TCP port to listen on: 1-65535."""
    port = parse_int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r} (1-65535)")
    return port


def parse_cmb_size(text: str) -> int:
    """A CMB size: 0, or a multiple of 4 KiB up to 1 TiB."""
    from cossd.emulator.cmb import MAX_CMB_BYTES

    size = parse_size(text)
    if size and (size % 4096 or size > MAX_CMB_BYTES):
        raise argparse.ArgumentTypeError(f"not a CMB size: {text!r} (0, or a multiple of 4K up to 1T)")
    return size


def parse_threads(text: str) -> int:
    """A thread count: 0-64."""
    count = parse_int(text)
    if not 0 <= count <= 64:
        raise argparse.ArgumentTypeError(f"not a thread count: {text!r} (0-64)")
    return count


def parse_tensor(text: str) -> tuple[str, int]:
    name, sep, numel = text.rpartition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"tensor must be NAME:NUMEL, got {text!r}")
    try:
        count = int(numel)
    except ValueError:
        raise argparse.ArgumentTypeError(f"element count of {name!r} is not an integer: {numel!r}") from None
    return name, count


# ---------------------------------------------------------------------- verbs


def cmd_format(args: argparse.Namespace) -> int:
    from cossd.emulator import Device

    identity = Device.format(args.backing, capacity_bytes=args.capacity, serial=args.serial, force=args.force)
    emit(args, identity, lambda i: f"formatted {args.backing}: serial {i['serial']}, "
         f"capacity {i['capacity_bytes']} bytes, model {i['model']!r}")
    return 0


def cmd_mount(args: argparse.Namespace) -> int:
    from cossd.fs import daemon

    if args.foreground:
        logging.basicConfig(
            level=logging.DEBUG if args.debug else logging.INFO,
            format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
        )
        daemon.serve(args.backing, args.mountpoint, sync=args.sync, allow_other=args.allow_other,
                     debug=args.debug, ready_fd=args.ready_fd,
                     metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
                     metrics_token_file=args.metrics_token_file, profile=args.profile, timed=args.timed,
                     io_threads=args.io_threads, cmb_bytes=args.cmb_size)
        return 0
    if args.metrics_token_file is not None:  # a one-line error before anything starts
        from cossd.fs.metrics import MetricsPortError, load_token

        if args.metrics_port is None:
            raise MetricsPortError("--metrics-token-file goes with --metrics-port")
        load_token(args.metrics_token_file)
    try:
        pid = daemon.start_background(args.backing, args.mountpoint, sync=args.sync,
                                      allow_other=args.allow_other, log_file=args.log_file,
                                      metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
                                      metrics_token_file=args.metrics_token_file,
                                      profile=args.profile, timed=args.timed,
                                      io_threads=args.io_threads, cmb_bytes=args.cmb_size)
    except DeviceError as exc:
        where = _mounted_at(args.backing) if exc.status == Status.NAMESPACE_NOT_READY else []
        if where:
            raise DeviceError(exc.status, f"{args.backing} is already mounted at "
                                          f"{', '.join(map(str, where))}") from None
        raise
    host = f"[{args.metrics_addr}]" if ":" in args.metrics_addr else args.metrics_addr  # IPv6
    metrics = f"http://{host}:{args.metrics_port}/metrics" if args.metrics_port else None
    emit(args, {"mountpoint": str(args.mountpoint), "pid": pid} | ({"metrics": metrics} if metrics else {}),
         lambda v: f"mounted {args.backing} at {v['mountpoint']} (daemon pid {v['pid']})"
         + (f", metrics at {metrics}" if metrics else ""))
    return 0


def _mounted_at(backing: Path) -> list[Path]:
    """The mountpoints where the device in `backing` is mounted now (from mountinfo)."""
    from cossd.client import mounted_devices

    target = os.path.realpath(backing)
    return [mountpoint for mountpoint, source in mounted_devices() if os.path.realpath(source) == target]


def cmd_umount(args: argparse.Namespace) -> int:
    from cossd.client import MOUNT_FSTYPE, AdminClient, mount_type_at

    # Only ever a cossd mount: fusermount3 would detach any FUSE mount of this user, and as
    # root any filesystem at all (a tmpfs, an ext4 loop mount).
    fstype = mount_type_at(args.mountpoint)
    if fstype is None:
        raise SystemExit(f"cossd umount: nothing is mounted at {args.mountpoint}")
    if fstype != MOUNT_FSTYPE:
        raise SystemExit(f"cossd umount: {args.mountpoint} is a {fstype} mount, not a cossd device "
                         f"({MOUNT_FSTYPE}); refusing to unmount it")
    pid = None
    try:
        with AdminClient(args.mountpoint) as client:
            pid = client.describe()["pid"]
    except (OSError, DeviceError):
        pass  # not answering (crashed daemon): still detach the mount
    command = ["fusermount3", "-u"] + (["-z"] if args.lazy else []) + [str(args.mountpoint)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"cossd umount: {result.stderr.strip() or 'fusermount3 failed'}")
    if pid is not None:
        # The daemon flushes the committed state after the unmount; wait for it.
        deadline = time.monotonic() + args.timeout
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            try:
                if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.05)
        if Path(f"/proc/{pid}").exists() and time.monotonic() >= deadline:
            raise SystemExit(f"cossd umount: daemon {pid} still running after {args.timeout} s")
    return 0


def cmd_create_ns(args: argparse.Namespace) -> int:
    if args.nvm:
        return _create_nvm_ns(args)
    if not args.tensor:
        raise SystemExit("cossd create-ns: give at least one --tensor NAME:NUMEL (or --nvm --size N)")
    description = {
        "name": args.name,
        "tensors": [[name, numel] for name, numel in args.tensor],
        "hyperparameters": {"lr": args.lr, "beta1": args.beta1, "beta2": args.beta2,
                            "eps": args.eps, "weight_decay": args.weight_decay, "mode": args.mode},
        "grad_dtype": args.grad_dtype,
        "param_dtype": args.param_dtype,
        "state_dtype": args.state_dtype,
    }
    with open_client(args) as client:
        nsid = client.create_namespace(description)
    emit(args, {"name": args.name, "nsid": nsid},
         lambda v: f"created namespace {v['name']!r} (nsid {v['nsid']}, {len(args.tensor)} tensors)")
    return 0


def _create_nvm_ns(args: argparse.Namespace) -> int:
    """create-ns --nvm: a plain NVM namespace of --size bytes (emulator/nvm.py)."""
    if args.size is None or args.tensor:
        raise SystemExit("cossd create-ns: --nvm takes --size (a multiple of 4096) and no --tensor")
    with open_client(args) as client:
        nsid = client.create_namespace({"name": args.name, "kind": "nvm", "capacity_bytes": args.size})
    emit(args, {"name": args.name, "nsid": nsid, "kind": "nvm", "capacity_bytes": args.size},
         lambda v: f"created nvm namespace {v['name']!r} (nsid {v['nsid']}, {v['capacity_bytes']} bytes)")
    return 0


def cmd_delete_ns(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        client.delete_namespace(client.nsid(args.name))
    emit(args, {"deleted": args.name}, lambda v: f"deleted namespace {args.name!r}")
    return 0


def _nvme_device(args: argparse.Namespace) -> str | None:
    """Point args.mountpoint at the mount of the device an nvme-cli style verb names (a
    mountpoint, a namespace directory MOUNTPOINT/ns/NAME, or a path under them); return the
    namespace such a path names, if any."""
    from cossd.client import mounted_devices
    from cossd.tools.nvme_json import resolve_device

    args.mountpoint, namespace = resolve_device(args.mountpoint, mounted_devices())
    return namespace


def _binary(args: argparse.Namespace) -> bool:
    """-o binary, or nvme-cli's -b/--raw-binary."""
    return args.output_format == "binary" or getattr(args, "raw_binary", False)


def cmd_id_ctrl(args: argparse.Namespace) -> int:
    from cossd.protocol.entries import IdentifyCns, Opcode
    from cossd.tools import nvme_json

    _nvme_device(args)
    with open_client(args) as client:
        page = client.call(Opcode.IDENTIFY, cdw10=IdentifyCns.CONTROLLER).data
        if _binary(args):  # the 4096-byte Identify Controller page
            write_binary(page)
            return 0
        described = client.describe()
    if args.output_format == "json":  # nvme-cli's keys from the page, cossd's own under one key
        value = nvme_json.id_ctrl(page, nvme_json.version_for(args.verbose))
        emit(args, value | {nvme_json.VENDOR_KEY: described}, str, sort_keys=False)
        return 0

    def normal(value: dict[str, Any]) -> str:
        identity = value["identity"]
        lines = [
            f"sn        : {identity['serial']}",
            f"mn        : {identity['model']}",
            f"fr        : {identity['firmware_revision']}",
            f"capacity  : {value['capacity_bytes']} bytes ({value['allocated_bytes']} allocated)",
            f"durability: {value['durability']}",
            f"timing    : profile {value['timing']['profile']}" + (" (timed)" if value["timing"]["timed"] else ""),
            f"backing   : {value['backing']}",
            "cmb       : " + (f"{value['cmb']['size']} bytes at {value['cmb']['path']}" if value.get("cmb")
                               else "none (mounted with --cmb-size 0)"),
            f"namespaces: {len(value['namespaces'])}",
        ]
        for ns in value["namespaces"]:
            if ns.get("kind") == "nvm":
                lines.append(f"  nsid {ns['nsid']:>3} {ns['name']:<24} nvm (plain 4 KiB blocks)")
                continue
            lines.append(f"  nsid {ns['nsid']:>3} {ns['name']:<24} step {ns['committed_step']} "
                         f"(durable {ns['durable_step']}){' loading' if ns['loading'] else ''}")
        return "\n".join(lines)

    emit(args, described, normal)
    return 0


def cmd_step(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        nsid = client.nsid(args.name)
        if args.verb == "begin-step":
            value: Any = {"step": client.begin_step(nsid, args.step or 0, args.grad_scale)}
        elif args.verb == "commit-step":
            value = client.commit_step(nsid)
        else:
            value = {"aborted_step": client.abort_step(nsid)}
    emit(args, value, lambda v: " ".join(f"{k}={v[k]}" for k in sorted(v)))
    return 0


# ---------------------------------------------------------------------- nvme-cli shaped verbs

DEVICE_HELP = ("the device: its mountpoint, or a namespace's directory MOUNTPOINT/ns/NAME "
               "(the DevicePath `list -o json` shows)")


def add_nvme_options(sub: argparse.ArgumentParser) -> None:
    """The options nvme-cli's verbs share: -v/--verbose (JSON as nvme-cli 2.11 prints it),
    -b/--raw-binary (-o binary)."""
    sub.add_argument("-v", "--verbose", action="store_true",
                     help="-o json shaped as nvme-cli 2.11 (default: as nvme-cli 2.3)")
    sub.add_argument("-b", "--raw-binary", action="store_true", help="the raw page (-o binary)")


def parse_log_entries(text: str) -> int:
    """error-log -e: a positive entry count (nvme-cli refuses 0)."""
    count = parse_int(text)
    if count <= 0:
        raise argparse.ArgumentTypeError(f"give a positive number of log entries, got {text}")
    return count


# Critical warning bits as nvme-cli names them (-H).
CRITICAL_WARNING_BITS = (
    ("available_spare", "Available Spare[0]"),
    ("temp_threshold", "Temp. Threshold[1]"),
    ("reliability_degraded", "NVM subsystem Reliability[2]"),
    ("ro", "Read-only[3]"),
    ("vmbu_failed", "Volatile mem. backup failed[4]"),
    ("pmr_ro", "Persistent Mem. RO[5]"),
)


def si_bytes(count: int) -> str:
    """nvme-cli's SI rendering of a byte count: '512.00 kB'."""
    value, unit = float(count), "B"
    for unit in ("B", "kB", "MB", "GB", "TB", "PB", "EB"):
        if value < 1000:
            break
        value /= 1000
    return f"{value:.2f} {unit}"


def _line(label: str, value: object) -> str:
    return f"{label:<40}: {value}"


def cmd_smart_log(args: argparse.Namespace) -> int:
    from cossd.protocol.logpages import DATA_UNIT_BYTES

    from cossd.protocol.logpages import LogId, decode_smart
    from cossd.protocol.entries import NSID_ALL
    from cossd.tools import nvme_json

    _nvme_device(args)  # SMART is controller wide: a namespace's path reads its controller's
    with open_client(args) as client:
        page = client.get_log_page(LogId.SMART, NSID_ALL)
        if _binary(args):  # the 512-byte page, as nvme smart-log -o binary
            write_binary(page)
            return 0
        backing = client.describe()["backing"] if args.media else None
    smart = decode_smart(page)
    warning = smart["critical_warning"]
    bits = {name: (warning >> bit) & 1 for bit, (name, _) in enumerate(CRITICAL_WARNING_BITS)}
    # nvme-cli's JSON: its keys, order and types (the 128-bit counters strings in 2.3).
    value = nvme_json.smart_log(page, nvme_json.version_for(args.verbose), human=args.human_readable)
    media = None
    if backing is not None:  # --media: the real drive under the backing directory
        from cossd.tools.media_health import media_report, render_media

        media = media_report(backing)
        value[nvme_json.VENDOR_KEY] = {"media": media}

    def normal(_: object) -> str:
        lines = [f"Smart Log for NVME device:{args.mountpoint} namespace-id:ffffffff",
                 _line("critical_warning", warning)]
        if args.human_readable:
            lines += [f"      {label:<31}: {bits[name]}" for name, label in CRITICAL_WARNING_BITS]
        kelvin = smart["temperature"]
        lines += [
            _line("temperature", f"{kelvin - 273} °C ({kelvin} K)"),
            _line("available_spare", f"{smart['avail_spare']}%"),
            _line("available_spare_threshold", f"{smart['spare_thresh']}%"),
            _line("percentage_used", f"{smart['percent_used']}%"),
            _line("endurance group critical warning summary",
                  smart["endurance_grp_critical_warning_summary"]),
            _line("Data Units Read", f"{smart['data_units_read']} "
                                     f"({si_bytes(smart['data_units_read'] * DATA_UNIT_BYTES)})"),
            _line("Data Units Written", f"{smart['data_units_written']} "
                                        f"({si_bytes(smart['data_units_written'] * DATA_UNIT_BYTES)})"),
        ]
        for key in ("host_read_commands", "host_write_commands", "controller_busy_time",
                    "power_cycles", "power_on_hours", "unsafe_shutdowns", "media_errors",
                    "num_err_log_entries"):
            lines.append(_line(key, smart[key]))
        lines += [_line("Warning Temperature Time", smart["warning_temp_time"]),
                  _line("Critical Composite Temperature Time", smart["critical_comp_time"])]
        for key, kelvin in smart.items():
            if key.startswith("temperature_sensor_"):
                lines.append(_line(f"Temperature Sensor {key.rsplit('_', 1)[1]}",
                                   f"{kelvin - 273} °C ({kelvin} K)"))
        for kind, label in (("trans_count", "Trans Count"), ("total_time", "Total Time")):
            lines += [_line(f"Thermal Management T{number} {label}", smart[f"thm_temp{number}_{kind}"])
                      for number in (1, 2)]
        return "\n".join(lines) + (f"\n\n{render_media(media)}" if media is not None else "")

    emit(args, value, normal, sort_keys=False)
    return 1 if media is not None and media["status"] == "failed" else 0


def _status_name(status_field: int) -> str:
    """The Status named by an error log entry's status field (without its phase tag)."""
    from cossd.protocol.status import Status

    status = Status.from_field((status_field >> 8) & 0x7, status_field & 0xFF)
    return status.name if isinstance(status, Status) else f"{status:#05x}"


def _opcode_name(opcode: int, sqid: int = 0) -> str:
    from cossd.protocol.entries import IoOpcode, Opcode
    from cossd.protocol.logpages import DATA_PATH_SQID

    try:
        # An injected data-path failure is logged with sqid 1 and an I/O opcode (D0h).
        return IoOpcode(opcode).name if sqid == DATA_PATH_SQID else Opcode(opcode).name
    except ValueError:
        return "unknown"


def _error_entries_text(device: object, entries: list[dict[str, int]]) -> str:
    rule = "................."
    lines = [f"Error Log Entries for device:{device} entries:{len(entries)}", rule]
    for index, entry in enumerate(entries):
        location = entry["parm_error_location"]
        lines += [
            f" Entry[{index:2}]", rule,
            f"error_count     : {entry['error_count']}",
            f"sqid            : {entry['sqid']}",
            f"cmdid           : {entry['cmdid']:#x}",
            f"status_field    : {entry['status_field']:#x}({_status_name(entry['status_field'])})",
            f"phase_tag       : {entry['phase_tag']}",
            f"parm_err_loc    : {location:#x}" + ("" if location == 0xFFFF else f" (byte {location & 0xFF})"),
            f"lba             : {entry['lba']:#x}",
            f"nsid            : {entry['nsid']:#x}",
            f"vs              : {entry['vs']}",
            f"cs              : {entry['cs']:#x} (opcode {_opcode_name(entry['cs'], entry['sqid'])})",
            rule,
        ]
    return "\n".join(lines)


def cmd_error_log(args: argparse.Namespace) -> int:
    from cossd.protocol.logpages import ERROR_LOG_ENTRIES, LogId, decode_error_log
    from cossd.tools import nvme_json

    _nvme_device(args)
    with open_client(args) as client:
        page = client.get_log_page(LogId.ERROR)
    # As many entries as nvme-cli asks for: -e, at most ELPE + 1 (all of the page).
    count = min(args.log_entries or ERROR_LOG_ENTRIES, ERROR_LOG_ENTRIES)
    page = page[: count * nvme_json.ERROR_ENTRY_BYTES]
    if _binary(args):  # 64-byte entries, as nvme error-log -o binary
        write_binary(page)
        return 0
    if args.output_format == "json":  # every entry asked for, the empty ones too, as nvme-cli
        emit(args, nvme_json.error_log(page, count), str, sort_keys=False)
        return 0
    print(_error_entries_text(args.mountpoint, decode_error_log(page)))  # people: the valid ones
    return 0


def hexdump(data: bytes, start: int = 0) -> str:
    """nvme-cli's raw page dump: 16 bytes per row, offset (counted from `start`, where the
    data begins in the page), hex, then the printable ASCII."""
    lines = ["       0  1  2  3  4  5  6  7  8  9  a  b  c  d  e  f"]
    for offset in range(0, len(data), 16):
        row = data[offset : offset + 16]
        text = "".join(chr(byte) if 32 <= byte < 127 else "." for byte in row)
        lines.append(f"{start + offset:04x}: {' '.join(f'{byte:02x}' for byte in row):<47} \"{text}\"")
    return "\n".join(lines)


def cmd_get_log(args: argparse.Namespace) -> int:
    from cossd.protocol import logpages
    from cossd.protocol.logpages import LogId
    from cossd.protocol.entries import NSID_ALL

    with open_client(args) as client:
        nsid = client.nsid(args.namespace) if args.namespace else NSID_ALL
        data = client.get_log_page(args.log_id, nsid, args.log_len, args.lpo)
    if args.output_format == "binary":
        write_binary(data)
        return 0
    if args.log_len is not None or args.lpo:
        # A part of a page: bytes, which no page decoder takes.
        if args.output_format == "json":
            print(json.dumps({"log_id": args.log_id, "offset": args.lpo, "length": len(data), "data": data.hex()},
                             indent=2))
        else:
            print(f"Device:{args.mountpoint} log-id:{args.log_id:#04x} namespace-id:{nsid:#x} "
                  f"offset:{args.lpo} length:{len(data)}\n{hexdump(data, args.lpo)}")
        return 0
    json_page = args.log_id in (LogId.OPTIMIZER_STATISTICS, LogId.SNAPSHOTS, LogId.JOBS)  # vendor JSON pages
    if args.output_format == "json":
        decoders: dict[int, Callable[[bytes], Any]] = {
            LogId.SMART: logpages.decode_smart,
            LogId.ERROR: lambda raw: {"errors": logpages.decode_error_log(raw)},
            LogId.COMMANDS_SUPPORTED_AND_EFFECTS: logpages.decode_effects,
            LogId.OPTIMIZER_STATISTICS: json.loads,
        }
        decode = decoders.get(args.log_id) or (json.loads if json_page else None)
        value = decode(data) if decode else {"log_id": args.log_id, "data": data.hex()}
        print(json.dumps(value, indent=2, sort_keys=json_page))
        return 0
    header = f"Device:{args.mountpoint} log-id:{args.log_id:#04x} namespace-id:{nsid:#x}"
    body = json.dumps(json.loads(data), indent=2, sort_keys=True) if json_page else hexdump(data)
    print(f"{header}\n{body}")
    return 0


def cmd_id_ns(args: argparse.Namespace) -> int:
    """Identify Namespace (CNS 00h), decoded with nvme-cli's field names. The namespace: NAME,
    else -n NSID, else the one a device path MOUNTPOINT/ns/NAME names."""
    from cossd.protocol.entries import IdentifyCns, Opcode
    from cossd.tools import nvme_json

    named = _nvme_device(args)
    with open_client(args) as client:
        if args.name is not None:
            nsid, name = client.nsid(args.name), args.name
        elif args.namespace_id is not None:
            nsid = args.namespace_id
            name = next((ns["name"] for ns in client.describe()["namespaces"] if ns["nsid"] == nsid), None)
        elif named is not None:
            nsid, name = client.nsid(named), named
        else:
            raise SystemExit("cossd id-ns: name the namespace: NAME, -n NSID, or the device "
                             "MOUNTPOINT/ns/NAME (as `cossd list` shows it)")
        page = client.call(Opcode.IDENTIFY, nsid=nsid, cdw10=int(IdentifyCns.NAMESPACE)).data
    if _binary(args):
        write_binary(page)
        return 0
    value = nvme_json.id_ns(page, nvme_json.version_for(args.verbose))
    lbaf0 = value["lbafs"][0]
    emit(args, value | {nvme_json.VENDOR_KEY: {"nsid": nsid, "name": name}}, lambda v: "\n".join([
        f"NVME Identify Namespace {nsid} ({name}):",
        f"nsze    : {v['nsze']:#x}", f"ncap    : {v['ncap']:#x}", f"nuse    : {v['nuse']:#x}",
        f"nlbaf   : {v['nlbaf']}", f"flbas   : {v['flbas']:#x}",
        f"lbaf  0 : ms:{lbaf0['ms']} lbads:{lbaf0['ds']} rp:{lbaf0['rp']} (in use)",
    ]), sort_keys=False)
    return 0


def cmd_admin_passthru(args: argparse.Namespace) -> int:
    """Send one raw admin command, like `nvme admin-passthru`; print its completion."""
    payload = b""
    if args.input_file is not None:
        payload = args.input_file.read_bytes()
    fields = {f"cdw{n}": getattr(args, f"cdw{n}") for n in range(10, 16)}
    with open_client(args) as client:
        completion = client.submit(args.opcode, nsid=args.namespace_id, payload=payload, **fields)
    status = getattr(completion.status, "name", str(completion.status))
    value = {"opcode": args.opcode, "nsid": args.namespace_id, "result": completion.result,
             "status": int(completion.status), "status_name": status, "data_len": len(completion.data),
             "data": completion.data.hex()}
    if args.output_format == "binary":
        sys.stdout.buffer.write(completion.data)
        sys.stdout.buffer.flush()
    else:
        emit(args, value, lambda v: (f"NVMe command result:{v['result']:08x} status:{v['status']:#06x} "
                                     f"({v['status_name']}) data_len:{v['data_len']}"
                                     + (f"\n{hexdump(completion.data)}" if completion.data and args.raw_data
                                        else "")))
    return 0 if completion.status == 0 or status == "STEP_SKIPPED_NONFINITE" else 1


def cmd_flush(args: argparse.Namespace) -> int:
    """FLUSH (C9h), like `nvme flush`: make one namespace's committed step (or an NVM
    namespace's acknowledged writes) durable, or every namespace's."""
    from cossd.protocol.entries import NSID_ALL

    with open_client(args) as client:
        nsid = client.nsid(args.name) if args.name else NSID_ALL
        client.flush(nsid)
        # The durable step in full (FLUSH's result dword holds only its low 32 bits).
        stats = client.statistics(nsid) if args.name else {}
    value = {"namespace": args.name, "nsid": nsid,
             "durable_step": stats["durable_step"] if args.name and "kind" not in stats else None}
    emit(args, value, lambda v: "NVMe Flush: success" + (
        f" (namespace {v['namespace']}, durable step {v['durable_step']})" if v["durable_step"] is not None
        else f" (namespace {v['namespace']})" if v["namespace"] else " (every namespace)"))
    return 0


def cmd_scrub(args: argparse.Namespace) -> int:
    from cossd.protocol.entries import NSID_ALL

    with open_client(args) as client:
        nsid = client.nsid(args.name) if args.name else NSID_ALL
        report = client.scrub(nsid)

    def normal(value: dict[str, Any]) -> str:
        lines = []
        for name, entry in value.items():
            verified = f"{entry['blocks']} blocks verified" if entry["blocks"] else \
                "0 blocks verified (still loading: no checksums yet)"
            lines.append(f"{name}: {verified}, {len(entry['bad'])} bad")
            lines += [f"  bad block: tensor {tensor} block {block}" for tensor, block in entry["bad"]]
        return "\n".join(lines) or "no namespaces"

    emit(args, report, normal)
    # Bad blocks fail the verb, as a failed check should in a script.
    return 1 if any(entry["bad"] for entry in report.values()) else 0


def cmd_list(args: argparse.Namespace) -> int:
    """nvme-cli's list: -o json as 2.3 (a flat entry per namespace), with -v as 2.11 (hosts,
    subsystems, controllers, namespaces); every cossd mount, also a crashed one, under "cossd"."""
    from cossd.emulator.device import SUPERBLOCK_FILE
    from cossd.tools import nvme_json
    from cossd.client import AdminClient, mounted_devices

    devices, controllers = [], []
    for mountpoint, backing in mounted_devices(args.mountinfo):
        entry: dict[str, Any] = {"DevicePath": str(mountpoint), "Backing": str(backing)}
        try:
            with AdminClient(mountpoint, timeout_s=args.timeout) as client:
                described = client.describe()
                controllers.append(nvme_json.listed_controller(client, mountpoint, backing,
                                                               described["namespaces"]))
            identity = described["identity"]
            namespaces = [{"NameSpace": ns["nsid"], "Name": ns["name"]} for ns in described["namespaces"]]
            entry |= {"State": "live", "Pid": described["pid"],
                      "UsedBytes": described["allocated_bytes"]}
        except (OSError, DeviceError, ValueError, KeyError) as exc:
            # A crashed or stopped daemon: what the backing directory itself says (it has
            # no identify pages to answer nvme-cli's part with, so it is only listed here).
            entry |= {"State": f"not answering ({exc})"}
            try:
                stored = json.loads((backing / SUPERBLOCK_FILE).read_text())
                identity = stored["identity"]
                namespaces = [{"NameSpace": nsid, "Name": name}
                              for name, nsid in sorted(stored["namespaces"].items(), key=lambda kv: kv[1])]
            except (OSError, ValueError, KeyError):
                identity, namespaces = {}, []
        entry |= {"SerialNumber": identity.get("serial", ""), "ModelNumber": identity.get("model", ""),
                  "Firmware": identity.get("firmware_revision", ""),
                  "PhysicalSize": identity.get("capacity_bytes", 0), "Namespaces": namespaces}
        devices.append(entry)

    def normal(value: dict[str, Any]) -> str:
        rows = [("Node", "Backing", "SN", "Namespaces"), ("-" * 24, "-" * 32, "-" * 20, "-" * 24)]
        for device in value[nvme_json.VENDOR_KEY]["Devices"]:
            names = ", ".join(f"{ns['Name']}({ns['NameSpace']})" for ns in device["Namespaces"]) or "-"
            if device["State"] != "live":
                names += f" [{device['State']}]"
            rows.append((device["DevicePath"], device["Backing"], device["SerialNumber"], names))
        return "\n".join(f"{a:<24} {b:<32} {c:<20} {d}" for a, b, c, d in rows)

    shaped = (nvme_json.detail_list(controllers, nvme_json.host_identity()) if args.verbose
              else nvme_json.simple_list(controllers))
    emit(args, shaped | {nvme_json.VENDOR_KEY: {"Devices": devices}}, normal, sort_keys=False)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    # Imported here: the demo needs torch, which no other verb does.
    from cossd.trainer import demo

    try:
        return demo.main(args)
    except ValueError as exc:
        print(f"cossd demo: {exc}", file=sys.stderr)
        return 2


def cmd_bench(args: argparse.Namespace) -> int:
    from cossd.trainer import bench  # needs torch, which no other verb does

    try:
        return bench.run(args)
    except ValueError as exc:  # e.g. --device cuda without a GPU
        print(f"cossd bench: {exc}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------- parser

# Modules that add verbs beside the ones above. Each has `register(verb)`, where `verb` is
# build_parser's factory below; keeping a verb family in its own module keeps this one small.
VERB_MODULES: tuple[str, ...] = ("cossd.tools.top", "cossd.tools.feature_cmds", "cossd.tools.inject_cmds", "cossd.tools.model_cmd", "cossd.tools.snapshot_cmds")


def build_parser(prog: str = "cossd") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="An emulated computational SSD that runs the Adam optimizer inside the drive.",
        epilog="Run `cossd VERB --help` for a verb's options. Docs: docs/ in the source tree.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, handler: Callable[[argparse.Namespace], int], help_text: str,
             formats: tuple[str, ...] = ("normal", "json")) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        sub.add_argument("-o", "--output-format", choices=formats, default="normal",
                         help="output format (default: normal)")
        return sub

    sub = verb("format", cmd_format, "Create an empty device in a backing directory.")
    sub.add_argument("backing", type=Path, help="backing directory (created if missing)")
    sub.add_argument("--capacity", type=parse_size, help="device capacity, e.g. 64G (default: free space)")
    sub.add_argument("--serial", help="serial number (default: random)")
    sub.add_argument("--force", action="store_true", help="erase an existing device in BACKING")

    sub = verb("mount", cmd_mount, "Mount a device; returns once the mount is ready.")
    sub.add_argument("backing", type=Path)
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("--foreground", action="store_true", help="serve in this process until unmounted")
    sub.add_argument("--sync", action="store_true",
                     help="flush every commit before acknowledging it (default: power-loss-protected "
                          "mode, commits reach the media in the background, one step behind at most)")
    sub.add_argument("--allow-other", action="store_true", help="let other users access the mount")
    sub.add_argument("--debug", action="store_true", help="log every FUSE request")
    sub.add_argument("--log-file", type=Path, help="daemon log (default: BACKING/daemon.log)")
    sub.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    sub.add_argument("--metrics-port", type=parse_port, metavar="N",
                     help="serve Prometheus metrics on this TCP port (docs/metrics.md). Unauthenticated "
                          "unless --metrics-token-file is given: any local user (and anyone who can reach "
                          "ADDR) can read them, namespace names included, even without --allow-other")
    sub.add_argument("--metrics-addr", default="127.0.0.1", metavar="ADDR",
                     help="address the metrics endpoint listens on (default: 127.0.0.1, loopback only)")
    sub.add_argument("--metrics-token-file", metavar="FILE",
                     help="require 'Authorization: Bearer TOKEN' on every metrics request, TOKEN being "
                          "FILE's content (one word; the file must not be readable by every user); others "
                          "get 401. Prometheus: authorization: {credentials_file: FILE}")
    from cossd.model.profiles import DEFAULT_PROFILE, PROFILES

    sub.add_argument("--profile", default=DEFAULT_PROFILE, metavar="NAME|FILE.json",
                     help=f"device profile of the timing model: {', '.join(PROFILES)}, or a JSON file "
                          f"of profile fields (default: {DEFAULT_PROFILE}; `cossd model --list-profiles`)")
    sub.add_argument("--timed", action="store_true",
                     help="complete file I/O and step commands no earlier than their modeled device time")
    sub.add_argument("--io-threads", type=parse_threads, metavar="N",
                     help="threads that serve tensor reads and writes in front of pyfuse3; 0 leaves "
                          "them to pyfuse3's single event loop (default: $COSSD_IO_THREADS, else one "
                          "per core and at least 2; docs/architecture.md, the data path)")
    from cossd.emulator.cmb import DEFAULT_CMB_BYTES

    sub.add_argument("--cmb-size", type=parse_cmb_size, default=DEFAULT_CMB_BYTES, metavar="SIZE",
                     help="controller memory buffer: shared memory that CMB_WRITE/CMB_READ move tensor "
                          "bytes through without FUSE copies; memory is used only as clients touch it; "
                          "0 turns it off (default: 1G; docs/command-set.md)")

    sub = verb("umount", cmd_umount, "Unmount; waits until the daemon has flushed the state.")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("--lazy", action="store_true", help="detach even if busy (fusermount3 -z)")
    sub.add_argument("--timeout", type=float, default=120.0,
                     help="seconds to wait for the daemon to flush and exit (default: %(default)s)")

    sub = verb("create-ns", cmd_create_ns, "Create an optimizer namespace (one optimizer), or with "
               "--nvm a plain NVM namespace (a raw data file).")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("name")
    sub.add_argument("--tensor", type=parse_tensor, action="append",
                     metavar="NAME:NUMEL", help="a tensor and its element count (repeatable; "
                                                "required unless --nvm)")
    sub.add_argument("--nvm", action="store_true",
                     help="a plain NVM namespace: MOUNTPOINT/ns/NAME/data, 4 KiB blocks")
    sub.add_argument("--size", type=parse_size, help="with --nvm: its size, e.g. 1G (a multiple of 4096)")
    sub.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: %(default)s)")
    sub.add_argument("--beta1", type=float, default=0.9,
                     help="decay of the first moment, exp_avg (default: %(default)s)")
    sub.add_argument("--beta2", type=float, default=0.999,
                     help="decay of the second moment, exp_avg_sq (default: %(default)s)")
    sub.add_argument("--eps", type=float, default=1e-8,
                     help="term added to the denominator for stability (default: %(default)s)")
    sub.add_argument("--weight-decay", type=float, default=0.01,
                     help="weight decay, decoupled in adamw mode (default: %(default)s)")
    sub.add_argument("--mode", choices=("adamw", "adam"), default="adamw",
                     help="adamw: decoupled weight decay; adam: L2 penalty added to the gradient "
                          "(default: %(default)s)")
    sub.add_argument("--grad-dtype", choices=("fp16", "bf16"), default="fp16",
                     help="dtype the trainer writes gradients in (default: %(default)s)")
    sub.add_argument("--param-dtype", choices=("fp16", "bf16"), default="fp16",
                     help="dtype the device hands params back in (default: %(default)s)")
    sub.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32",
                     help="dtype of the Adam moments; master weights are always fp32 "
                          "(default: %(default)s)")

    sub = verb("delete-ns", cmd_delete_ns, "Delete a namespace and its state.")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("name")

    sub = verb("id-ctrl", cmd_id_ctrl, "Identify the device: serial, model, capacity, namespaces "
               "(-o json: nvme-cli's keys, cossd's own under \"cossd\"; -o binary: the raw Identify "
               "Controller page).", formats=("normal", "json", "binary"))
    sub.add_argument("mountpoint", type=Path, metavar="DEVICE", help=DEVICE_HELP)
    add_nvme_options(sub)

    for name, text in (("begin-step", "Open a step transaction."),
                       ("commit-step", "Commit the open step (reports a skip on inf/NaN)."),
                       ("abort-step", "Abort the open step; the committed state is untouched.")):
        sub = verb(name, cmd_step, text)
        sub.add_argument("mountpoint", type=Path)
        sub.add_argument("name")
        if name == "begin-step":
            sub.add_argument("--step", type=int, help="step number (default: the next one)")
            sub.add_argument("--grad-scale", type=float, default=1.0,
                             help="combined gradient scale: 1/loss_scale x clip coefficient "
                                  "(default: %(default)s)")

    sub = verb("smart-log", cmd_smart_log, "SMART / health log (log page 02h), as nvme smart-log prints it.",
               formats=("normal", "json", "binary"))
    sub.add_argument("mountpoint", type=Path, metavar="DEVICE", help=DEVICE_HELP)
    add_nvme_options(sub)
    sub.add_argument("-H", "--human-readable", action="store_true",
                     help="decode the critical warning bits")
    sub.add_argument("--media", action="store_true",
                     help="add the health of the real NVMe drive under the backing directory "
                          "(runs `nvme smart-log DEV -o json`)")

    sub = verb("error-log", cmd_error_log, "Error information log (log page 01h): the latest failed "
               "commands and media errors, newest first (-o json: every entry, empty ones too, "
               "as nvme-cli).", formats=("normal", "json", "binary"))
    sub.add_argument("mountpoint", type=Path, metavar="DEVICE", help=DEVICE_HELP)
    sub.add_argument("-e", "--log-entries", type=parse_log_entries, metavar="N",
                     help="entries to read (default: all the device keeps, ELPE + 1 = 64)")
    add_nvme_options(sub)

    sub = verb("get-log", cmd_get_log, "Any log page, raw (hex dump, -o binary) or decoded (-o json).",
               formats=("normal", "json", "binary"))
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("-i", "--log-id", type=parse_int, required=True,
                     help="log page identifier, e.g. 2 or 0xc0")
    sub.add_argument("-n", "--namespace", help="namespace name, for namespace-scoped pages (default: all)")
    sub.add_argument("-l", "--log-len", type=parse_log_len,
                     help="bytes to read, a multiple of 4 (NUMD); fewer come back where the page ends "
                          "first (default: the whole page, from --lpo)")
    sub.add_argument("-L", "--lpo", type=parse_log_offset, default=0,
                     help="byte offset into the page to read from, a multiple of 4 (LPOL/LPOU; default 0)")

    sub = verb("id-ns", cmd_id_ns, "Identify a namespace (NVMe CNS 00h): sizes in 4 KiB blocks, LBA format.",
               formats=("normal", "json", "binary"))
    sub.add_argument("mountpoint", type=Path, metavar="DEVICE", help=DEVICE_HELP)
    sub.add_argument("name", nargs="?", help="namespace name (or -n NSID, or DEVICE MOUNTPOINT/ns/NAME)")
    sub.add_argument("-n", "--namespace-id", type=parse_int, metavar="NSID", help="namespace id")
    add_nvme_options(sub)

    sub = verb("admin-passthru", cmd_admin_passthru, "Send a raw admin command through .admin "
               "(like nvme admin-passthru); exits 1 unless it succeeds.", formats=("normal", "json", "binary"))
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("--opcode", type=parse_int, required=True, help="opcode, e.g. 0x06 or 0xc0")
    sub.add_argument("--namespace-id", type=parse_int, default=0, help="nsid (default 0)")
    for n in range(10, 16):
        sub.add_argument(f"--cdw{n}", type=parse_int, default=0, help=argparse.SUPPRESS if n > 13 else f"command dword {n}")
    sub.add_argument("--input-file", type=Path, help="payload to send after the entry (data_len is its size)")
    sub.add_argument("-r", "--raw-data", action="store_true", help="with -o normal, hex-dump the returned data")

    sub = verb("flush", cmd_flush, "Make a namespace's committed step durable (an NVM namespace: its "
               "acknowledged writes), or every namespace's (FLUSH C9h, like nvme flush).")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("name", nargs="?", help="namespace (default: every namespace)")

    sub = verb("scrub", cmd_scrub, "Verify every block checksum of a namespace (default: all); "
               "exits 1 if any block is bad.")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("name", nargs="?", help="namespace (default: every namespace)")

    sub = verb("list", cmd_list, "List the mounted cossd devices (from /proc/self/mountinfo); -o json "
               "as nvme-cli 2.3 (one entry per namespace), with -v as nvme-cli 2.11 (subsystems, "
               "controllers, namespaces).")
    sub.add_argument("-v", "--verbose", action="store_true",
                     help="nvme-cli 2.11's JSON layout (Subsystems/Controllers/Namespaces)")
    # Which mounts to list; $COSSD_MOUNTINFO lets a test show a script only its own mount.
    sub.add_argument("--mountinfo", default=os.environ.get("COSSD_MOUNTINFO", "/proc/self/mountinfo"),
                     help=argparse.SUPPRESS)
    sub.add_argument("--timeout", type=float, default=5.0,
                     help="seconds to wait for each daemon (default: 5)")

    verb("version", cmd_version, "Show cossd's version and the nvme-cli versions whose JSON it prints.")

    sub = verb("demo", cmd_demo, "Train a small GPT through a temporary mount, crash the device "
               "mid-step, restore, and compare with torch.save and DCP checkpointing.")
    from cossd.trainer.options import add_bench_arguments, add_demo_arguments

    add_demo_arguments(sub)

    sub = verb("bench", cmd_bench, "Measure the kernel, the file path, checkpoint and restore "
               "against torch's AdamW, torch.save and DCP, side by side in one run.")
    add_bench_arguments(sub)

    for module in VERB_MODULES:
        importlib.import_module(module).register(verb)
    _describe_common_arguments(verbs)
    return parser


# What the positionals most verbs share mean, said once for every verb that takes them.
COMMON_ARGUMENT_HELP = {
    "mountpoint": "where the device is mounted (as `cossd mount` was given it)",
    "backing": "the device's backing directory (as `cossd format` was given it)",
    "name": "namespace name",
}


def _describe_common_arguments(verbs: argparse._SubParsersAction) -> None:
    for sub in verbs.choices.values():
        for action in sub._actions:
            if action.help is None and action.dest in COMMON_ARGUMENT_HELP:
                action.help = COMMON_ARGUMENT_HELP[action.dest]


# Run as `nvme` (argv[0], e.g. a symlink to the cossd entry point), cossd answers nvme-cli's
# verbs, so that monitoring scripts written for nvme-cli run against it unchanged.
NVME_PROG = "nvme"
NVME_VERBS = ("list", "id-ctrl", "id-ns", "smart-log", "error-log", "get-log", "admin-passthru",
              "version", "help")


def cmd_version(args: argparse.Namespace) -> int:
    from cossd import __version__
    from cossd.tools.nvme_json import PLAIN_VERSION, VERBOSE_VERSION

    value = {"cossd": __version__, "nvme_cli_json": PLAIN_VERSION, "nvme_cli_json_verbose": VERBOSE_VERSION}
    if getattr(args, "prog", "cossd") == NVME_PROG:
        # nvme-cli's two lines; scripts read the first (`^nvme version (\S+)`).
        text = (f"nvme version {PLAIN_VERSION} (git cossd-{__version__})\n"
                f"libnvme version none (cossd {__version__} answering as nvme: JSON as nvme-cli "
                f"{PLAIN_VERSION}, with --verbose as {VERBOSE_VERSION})")
    else:
        text = (f"cossd version {__version__}\nnvme-cli JSON: as nvme-cli {PLAIN_VERSION}, with "
                f"-v/--verbose as {VERBOSE_VERSION}; run as `nvme` (a symlink), cossd answers as nvme-cli")
    emit(args, value, lambda _: text, sort_keys=False)
    return 0


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    if prog is None:  # the name it was run by: `nvme` answers as nvme-cli
        prog = NVME_PROG if argv is None and Path(sys.argv[0]).name == NVME_PROG else "cossd"
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    if not words or words == ["help"]:
        # The bare name prints the usage and succeeds, as nvme-cli does: scripts probe for
        # nvme-cli that way (nvme_metrics.py runs `nvme` and stops on a failure).
        parser.print_help()
        return 0
    if words[0] == "help":  # nvme-cli's `help VERB`
        words = [words[1], "--help"]
    elif words[0] == "--version":
        words[0] = "version"
    if prog == NVME_PROG and not words[0].startswith("-") and words[0] not in NVME_VERBS:
        print(f"{prog}: {words[0]!r} is not a verb cossd answers as nvme-cli "
              f"({', '.join(NVME_VERBS)}); run it as `cossd {words[0]}`", file=sys.stderr)
        return 1
    args = parser.parse_args(words)
    args.prog = prog
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except BrokenPipeError:
        # The reader went away (`cossd list | head`): stop quietly, as a C tool killed by
        # SIGPIPE would. Later writes, and the flush at exit, go to /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, what a shell reports for such a tool
    except DeviceError as exc:
        print(f"{prog} {args.verb}: {exc.message} [{exc.status.name}]", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:
        print(f"{prog} {args.verb}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
