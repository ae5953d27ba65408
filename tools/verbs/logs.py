"""CLI verbs that read log pages: smart-log (02h), error-log (01h), server-log (C5h, a storage
server's own), get-log (any page), and their printers."""
from __future__ import annotations

import argparse
import enum
import json
from typing import Any, Callable

from ..arguments import (
    DEVICE_HELP,
    VerbFactory,
    add_device_argument,
    add_nvme_options,
    nvme_device,
    parse_log_entries,
    parse_log_len,
    parse_log_offset,
    parse_u8,
)
from ..output import binary_output, emit, hexdump, open_client, write_binary

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
    units = ("B", "kB", "MB", "GB", "TB", "PB", "EB")
    value, index = float(count), 0
    # Past the last unit the value grows instead (the old loop divided once more and misnamed it).
    while value >= 1000 and index < len(units) - 1:
        value /= 1000
        index += 1
    return f"{value:.2f} {units[index]}"


def _line(label: str, value: object) -> str:
    return f"{label:<40}: {value}"


def _smart_text(device: object, smart: dict[str, Any], human: bool) -> str:
    """The SMART page as nvme smart-log prints it (-H: the critical warning bits decoded)."""
    from ...protocol.logpages import DATA_UNIT_BYTES

    warning = smart["critical_warning"]
    lines = [f"Smart Log for NVME device:{device} namespace-id:ffffffff", _line("critical_warning", warning)]
    if human:
        lines += [f"      {label:<31}: {(warning >> bit) & 1}"
                  for bit, (_, label) in enumerate(CRITICAL_WARNING_BITS)]
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
    return "\n".join(lines)


def cmd_smart_log(args: argparse.Namespace) -> int:
    from ...protocol.entries import NSID_ALL
    from ...protocol.logpages import LogId, decode_smart
    from .. import nvme_json

    nvme_device(args)  # SMART is controller wide: a namespace's path reads its controller's
    with open_client(args) as client:
        page = client.get_log_page(LogId.SMART, NSID_ALL)
        if binary_output(args):  # the 512-byte page, as nvme smart-log -o binary
            write_binary(page)
            return 0
        backing = client.describe()["backing"] if args.media else None
    smart = decode_smart(page)
    # nvme-cli's JSON: its keys, order and types (the 128-bit counters strings in 2.3).
    value = nvme_json.smart_log(page, nvme_json.version_for(args.verbose), human=args.human_readable)
    media = None
    if backing is not None:  # --media: the real drive under the backing directory
        from ..media_health import media_report, render_media

        media = media_report(backing)
        value[nvme_json.VENDOR_KEY] = {"media": media}

    def normal(_: object) -> str:
        text = _smart_text(args.mountpoint, smart, args.human_readable)
        return text + (f"\n\n{render_media(media)}" if media is not None else "")

    emit(args, value, normal, sort_keys=False)
    return 1 if media is not None and media["status"] == "failed" else 0


def _status_name(status_field: int) -> str:
    """The Status named by an error log entry's status field (without its phase tag)."""
    from ...protocol.status import Status

    status = Status.from_field((status_field >> 8) & 0x7, status_field & 0xFF)
    return status.name if isinstance(status, Status) else f"{status:#05x}"


def _opcode_name(opcode: int, sqid: int = 0, kind: str | None = None) -> str:
    """An entry's opcode by its queue (sqid 1: an I/O command) and, for an I/O command, by the
    kind of namespace it went to: opcode 01h is a tensor file's WRITE, a compute namespace's
    Execute Program or a memory namespace's Memory Copy."""
    from ...protocol.computational import ComputeOpcode, MemoryOpcode
    from ...protocol.entries import IoOpcode, Opcode
    from ...protocol.logpages import DATA_PATH_SQID

    io_opcodes: type[enum.IntEnum] = {"compute": ComputeOpcode, "memory": MemoryOpcode}.get(kind or "", IoOpcode)
    try:
        # An I/O command's failure (an injected data-path one, an Execute Program, an SLM
        # command) is logged with sqid 1 and its I/O opcode.
        return io_opcodes(opcode).name if sqid == DATA_PATH_SQID else Opcode(opcode).name
    except ValueError:
        return "unknown"


def _error_entries_text(device: object, entries: list[dict[str, int]], kinds: dict[int, str] | None = None) -> str:
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
            f"cs              : {entry['cs']:#x} (opcode {_opcode_name(entry['cs'], entry['sqid'], (kinds or {}).get(entry['nsid']))})",
            rule,
        ]
    return "\n".join(lines)


def cmd_error_log(args: argparse.Namespace) -> int:
    from ...protocol.logpages import ERROR_LOG_ENTRIES, LogId, decode_error_log
    from .. import nvme_json

    nvme_device(args)
    with open_client(args) as client:
        page = client.get_log_page(LogId.ERROR)
        # Each namespace's kind, which names an I/O command's opcode (text output only).
        kinds = {} if args.output_format != "normal" else {
            int(entry["nsid"]): str(entry.get("kind")) for entry in client.describe()["namespaces"]}
    # As many entries as nvme-cli asks for: -e, at most ELPE + 1 (all of the page).
    count = min(args.log_entries or ERROR_LOG_ENTRIES, ERROR_LOG_ENTRIES)
    page = page[: count * nvme_json.ERROR_ENTRY_BYTES]
    if binary_output(args):  # 64-byte entries, as nvme error-log -o binary
        write_binary(page)
        return 0
    if args.output_format == "json":  # every entry asked for, the empty ones too, as nvme-cli
        emit(args, nvme_json.error_log(page, count), str, sort_keys=False)
        return 0
    print(_error_entries_text(args.mountpoint, decode_error_log(page), kinds))  # people: the valid ones
    return 0


def _server_text(device: object, figures: dict[str, int]) -> str:
    """The server page, one field a line; byte counts also in SI units, times in seconds."""
    lines = [f"Server Log for device:{device}"]
    for key, value in figures.items():
        if key.endswith(("_bytes", "_capacity")) and value:
            shown: object = f"{value} ({si_bytes(value)})"
        elif key.endswith("_ns") and key != "started_ns" and value:
            shown = f"{value} ({value / 1e9:.3f} s)"
        else:
            shown = value
        lines.append(_line(key, shown))
    return "\n".join(lines)


def cmd_server_log(args: argparse.Namespace) -> int:
    from ...protocol.logpages import LogId, decode_server_log

    with open_client(args) as client:
        page = client.get_log_page(LogId.SERVER)
    if binary_output(args):  # the 512-byte page
        write_binary(page)
        return 0
    emit(args, decode_server_log(page), lambda figures: _server_text(args.mountpoint, figures), sort_keys=False)
    return 0


def cmd_get_log(args: argparse.Namespace) -> int:
    from ...protocol import logpages
    from ...protocol.entries import NSID_ALL
    from ...protocol.logpages import LogId

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
    json_page = args.log_id in (LogId.OPTIMIZER_STATISTICS, LogId.SNAPSHOTS, LogId.JOBS,
                                LogId.STATE_COUNTERS)  # vendor JSON pages
    if args.output_format == "json":
        decoders: dict[int, Callable[[bytes], Any]] = {
            LogId.SMART: logpages.decode_smart,
            LogId.SERVER: logpages.decode_server_log,
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


def register(verb: VerbFactory) -> None:
    sub = verb("smart-log", cmd_smart_log, "SMART / health log (log page 02h), as nvme smart-log prints it.",
               formats=("normal", "json", "binary"))
    add_device_argument(sub, metavar="DEVICE", help=DEVICE_HELP)
    add_nvme_options(sub)
    sub.add_argument("-H", "--human-readable", action="store_true",
                     help="decode the critical warning bits")
    sub.add_argument("--media", action="store_true",
                     help="add the health of the real NVMe drive under the backing directory "
                          "(runs `nvme smart-log DEV -o json`)")

    sub = verb("error-log", cmd_error_log, "Error information log (log page 01h): the latest failed "
               "commands and media errors, newest first (-o json: every entry, empty ones too, "
               "as nvme-cli).", formats=("normal", "json", "binary"))
    add_device_argument(sub, metavar="DEVICE", help=DEVICE_HELP)
    sub.add_argument("-e", "--log-entries", type=parse_log_entries, metavar="N",
                     help="entries to read (default: all the device keeps, ELPE + 1 = 64)")
    add_nvme_options(sub)

    sub = verb("server-log", cmd_server_log, "A storage server's own figures (log page C5h): connections, "
               "refusals by reason, leases, the link's bytes, receive memory, the parameter cache.",
               formats=("normal", "json", "binary"))
    add_device_argument(sub, metavar="cossd://HOST:PORT", help="the storage server (a mount has no such page)")

    sub = verb("get-log", cmd_get_log, "Any log page, raw (hex dump, -o binary) or decoded (-o json).",
               formats=("normal", "json", "binary"))
    add_device_argument(sub)
    sub.add_argument("-i", "--log-id", type=parse_u8, required=True,
                     help="log page identifier, e.g. 2 or 0xc0 (0..0xff)")
    sub.add_argument("-n", "--namespace", help="namespace name, for namespace-scoped pages (default: all)")
    sub.add_argument("-l", "--log-len", type=parse_log_len,
                     help="bytes to read, a multiple of 4 (NUMD); fewer come back where the page ends "
                          "first (default: the whole page, from --lpo)")
    sub.add_argument("-L", "--lpo", type=parse_log_offset, default=0,
                     help="byte offset into the page to read from, a multiple of 4 (LPOL/LPOU; default 0)")
