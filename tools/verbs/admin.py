"""CLI admin verbs: id-ctrl, the step verbs (begin/commit/abort/revert-step), admin-passthru, flush, scrub, version."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..arguments import (DEVICE_HELP, VerbFactory, add_device_argument, add_nvme_options, nvme_device, parse_u8,
                         parse_u32, parse_u64)
from ..output import binary_output, emit, hexdump, open_client, write_binary


def cmd_id_ctrl(args: argparse.Namespace) -> int:
    from ...protocol.entries import IdentifyCns, Opcode
    from ...protocol.logpages import LogId
    from ...protocol.status import DeviceError, Status
    from .. import nvme_json

    nvme_device(args)
    with open_client(args) as client:
        page = client.call(Opcode.IDENTIFY, cdw10=IdentifyCns.CONTROLLER).data
        if binary_output(args):  # the 4096-byte Identify Controller page
            write_binary(page)
            return 0
        described = client.describe()
        # Only a storage server's controller serves its page C5h (a mount answers
        # INVALID_LOG_PAGE), through a URL or a remote mount alike: why there is no CMB.
        served = False
        if not described.get("cmb"):
            try:
                client.get_log_page(LogId.SERVER, length=4)
                served = True
            except DeviceError as exc:
                if exc.status != Status.INVALID_LOG_PAGE:
                    raise
    if args.output_format == "json":  # nvme-cli's keys from the page, cossd's own under one key
        value = nvme_json.id_ctrl(page, nvme_json.version_for(args.verbose))
        emit(args, value | {nvme_json.VENDOR_KEY: described}, str, sort_keys=False)
        return 0
    emit(args, described, lambda value: _controller_text(value, served))
    return 0


def _controller_text(value: dict[str, Any], served: bool = False) -> str:
    """id-ctrl -o normal: the device as `describe` reports it, one namespace a line
    (`served`: through a storage server, which has no CMB for a client to map)."""
    no_cmb = ("none (a storage server: a client across the network cannot map one)" if served
              else "none (mounted with --cmb-size 0)")
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
                           else no_cmb),
        f"namespaces: {len(value['namespaces'])}",
    ]
    for ns in value["namespaces"]:
        if ns.get("kind") == "nvm":
            lines.append(f"  nsid {ns['nsid']:>3} {ns['name']:<24} nvm (plain 4 KiB blocks)")
            continue
        lines.append(f"  nsid {ns['nsid']:>3} {ns['name']:<24} step {ns['committed_step']} "
                     f"(durable {ns['durable_step']}){' loading' if ns['loading'] else ''}")
    return "\n".join(lines)


def cmd_step(args: argparse.Namespace) -> int:
    with open_client(args) as client:
        nsid = client.nsid(args.name)
        if args.verb == "begin-step":
            value: Any = {"step": client.begin_step(nsid, args.step or 0, args.grad_scale)}
        elif args.verb == "commit-step":
            value = client.commit_step(nsid)
        elif args.verb == "revert-step":
            value = client.revert_step(nsid, args.step)
        else:
            value = {"aborted_step": client.abort_step(nsid)}
    emit(args, value, lambda v: " ".join(f"{k}={v[k]}" for k in sorted(v)))
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
    from ...protocol.entries import NSID_ALL

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
    from ...protocol.entries import NSID_ALL

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


def cmd_version(args: argparse.Namespace) -> int:
    from ... import __version__
    from ..arguments import NVME_PROG
    from ..nvme_json import PLAIN_VERSION, VERBOSE_VERSION

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


def register(verb: VerbFactory) -> None:
    sub = verb("id-ctrl", cmd_id_ctrl, "Identify the device: serial, model, capacity, namespaces "
               "(-o json: nvme-cli's keys, cossd's own under \"cossd\"; -o binary: the raw Identify "
               "Controller page).", formats=("normal", "json", "binary"))
    add_device_argument(sub, metavar="DEVICE", help=DEVICE_HELP)
    add_nvme_options(sub)

    for name, text in (("begin-step", "Open a step transaction."),
                       ("commit-step", "Commit the open step (reports a skip on inf/NaN)."),
                       ("abort-step", "Abort the open step; the committed state is untouched."),
                       ("revert-step", "Undo committed step STEP from the copy that still holds the one "
                                       "before (REVERT_STEP: a group of devices brought to one step; "
                                       "refused, nothing changed, once a step began since).")):
        sub = verb(name, cmd_step, text)
        add_device_argument(sub)
        sub.add_argument("name")
        if name == "revert-step":
            sub.add_argument("--step", type=parse_u64, required=True,
                             help="the committed step to undo (the namespace goes back to STEP - 1)")
        if name == "begin-step":
            sub.add_argument("--step", type=parse_u64, help="step number (default: the next one)")
            sub.add_argument("--grad-scale", type=float, default=1.0,
                             help="combined gradient scale: 1/loss_scale x clip coefficient "
                                  "(default: %(default)s)")

    sub = verb("admin-passthru", cmd_admin_passthru, "Send a raw admin command through .admin "
               "(like nvme admin-passthru); exits 1 unless it succeeds.", formats=("normal", "json", "binary"))
    add_device_argument(sub)
    sub.add_argument("--opcode", type=parse_u8, required=True, help="opcode, e.g. 0x06 or 0xc0 (0..0xff)")
    sub.add_argument("--namespace-id", type=parse_u32, default=0, help="nsid (default 0; 0..0xffffffff)")
    for n in range(10, 16):
        sub.add_argument(f"--cdw{n}", type=parse_u32, default=0,
                         help=f"command dword {n} (default 0; 0..0xffffffff)")
    sub.add_argument("--input-file", type=Path, help="payload to send after the entry (data_len is its size)")
    sub.add_argument("-r", "--raw-data", action="store_true", help="with -o normal, hex-dump the returned data")

    sub = verb("flush", cmd_flush, "Make a namespace's committed step durable (an NVM namespace: its "
               "acknowledged writes), or every namespace's (FLUSH C9h, like nvme flush).")
    add_device_argument(sub)
    sub.add_argument("name", nargs="?", help="namespace (default: every namespace)")

    sub = verb("scrub", cmd_scrub, "Verify every block checksum of a namespace (default: all); "
               "exits 1 if any block is bad.")
    add_device_argument(sub)
    sub.add_argument("name", nargs="?", help="namespace (default: every namespace)")

    verb("version", cmd_version, "Show cossd's version and the nvme-cli versions whose JSON it prints.")
