"""CLI verbs of the standard face, in nvme-cli's style with JSON: the compute namespace's
programs (CNS 05h, 88h), a memory namespace's SLM Identify fields (CNS 05h), Execute Program,
and SLM Read and Write; the calls themselves are cossd.client.computational."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ...client.computational import ComputationalClient
from ..arguments import U32_MAX, U64_MAX, VerbFactory, add_device_argument, parse_u16, parse_u32, parse_u64
from ..output import emit, open_client


def _range(text: str) -> tuple[int, int, int]:
    """MNSID:SB:LENGTH, each in any base, each within its descriptor field (32, 64, 32 bits)."""
    try:
        mnsid, sb, length = (int(part, 0) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a range is MNSID:SB:LENGTH (integers), got {text!r}") from None
    for what, value, high in (("MNSID", mnsid, U32_MAX), ("SB", sb, U64_MAX), ("LENGTH", length, U32_MAX)):
        if not 0 <= value <= high:
            raise argparse.ArgumentTypeError(f"{text}: {what} {value} is out of range 0..{high}")
    return mnsid, sb, length


def cmd_list_programs(args: argparse.Namespace) -> int:
    with open_client(args) as admin:
        identify = ComputationalClient(admin).identify(admin.nsid(args.name))

    def normal(value: dict[str, Any]) -> str:
        lines = [" ".join(f"{key}:{number}" for key, number in value["fields"].items())]
        for program in value["programs"]:
            lines.append(f"program {program['index']}: occupied:{program['occupied']} activated:"
                         f"{int(program['activated'])} type:{program['type']:#x} pid:{program['pid']:#018x}")
        return "\n".join(lines)

    emit(args, identify, normal)
    return 0


# What each SLM Identify Namespace field is, for the human-readable listing.
_SLM_FIELD_NAMES = {"msz": "Memory Namespace Size (bytes)", "mgran": "SLM I/O Granularity (bytes)",
                    "mxfer": "Maximum Read/Write Transfer (bytes)", "msrc": "Maximum Copy Source Ranges",
                    "cfmts": "Copy Formats Supported (bit n: format nh)", "mattr": "Memory Attributes"}


def cmd_slm_id_ns(args: argparse.Namespace) -> int:
    with open_client(args) as admin:
        identify = ComputationalClient(admin).identify_memory(admin.nsid(args.name))

    def normal(value: dict[str, Any]) -> str:
        fields = value["fields"]
        lines = [f"NVMe SLM Identify Namespace {args.name!r} (CNS 05h, CSI 03h):"]
        lines += [f"{key:<6}: {fields[key]:<12} {_SLM_FIELD_NAMES[key]}" for key in _SLM_FIELD_NAMES]
        lines.append("  copy formats: " + ", ".join(f"{form:x}h" for form in value["copy_formats"]))
        lines.append(f"  [0:0] : {int(value['cmb_window'])}  window on the controller memory buffer")
        lines.append(f"  [1:1] : {int(value['volatile'])}  volatile (zeroed at every restart)")
        return "\n".join(lines)

    emit(args, identify, normal)
    return 0


def cmd_activate(args: argparse.Namespace) -> int:
    with open_client(args) as admin:
        ComputationalClient(admin).activate(admin.nsid(args.name), args.index, active=not args.deactivate)
    emit(args, {"namespace": args.name, "program": args.index, "activated": not args.deactivate},
         lambda v: f"program {v['program']} of {v['namespace']!r}: {'activated' if v['activated'] else 'deactivated'}")
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    if bool(args.range) == bool(args.range_set):
        raise SystemExit("cossd cp-exec: give --range (repeatable) or --range-set, not both")
    hypers = None
    if args.lr is not None:
        hypers = {"lr": args.lr, "beta1": args.beta1, "beta2": args.beta2, "eps": args.eps,
                  "weight_decay": args.weight_decay}
    with open_client(args) as admin:
        result = ComputationalClient(admin).execute(
            admin.nsid(args.name), ranges=args.range or None, range_set=args.range_set or 0, step=args.step,
            grad_scale=args.grad_scale, hyperparameters=hypers, index=args.index)
    value = {"return_value": result.return_value, **result.report}
    emit(args, value, lambda v: f"NVMe Execute Program: success, return value {v['return_value']} "
                                f"(committed step {v['committed_step']}, open step {v['step_open']})")
    return 0


def cmd_slm_read(args: argparse.Namespace) -> int:
    with open_client(args) as admin:
        data = ComputationalClient(admin).read(admin.nsid(args.name), args.offset, args.length)
    if args.output_format == "binary":
        sys.stdout.buffer.write(data)
        return 0
    emit(args, {"namespace": args.name, "offset": args.offset, "length": len(data), "data": data.hex()},
         lambda v: "\n".join(f"{args.offset + at:08x}: {data[at:at + 16].hex(' ')}" for at in range(0, len(data), 16)))
    return 0


def cmd_slm_write(args: argparse.Namespace) -> int:
    with open(args.input_file, "rb") as source:
        data = source.read()
    with open_client(args) as admin:
        written = ComputationalClient(admin).write(admin.nsid(args.name), args.offset, data)
    emit(args, {"namespace": args.name, "offset": args.offset, "bytes": written},
         lambda v: f"NVMe Memory Write: success, {v['bytes']} bytes at {v['offset']}")
    return 0


def register(verb: VerbFactory) -> None:
    sub = verb("cp-list-programs", cmd_list_programs, "A compute namespace's CP Identify Namespace fields and "
               "program table (Identify CNS 05h, CSI 04h).")
    add_device_argument(sub)
    sub.add_argument("name", help="compute namespace")

    sub = verb("slm-id-ns", cmd_slm_id_ns, "A memory namespace's SLM Identify Namespace fields (Identify CNS "
               "05h, CSI 03h; cossd's layout: docs/command-set.md).")
    add_device_argument(sub)
    sub.add_argument("name", help="memory namespace")

    sub = verb("cp-activate", cmd_activate, "Activate (or --deactivate) a program of a compute namespace (88h).")
    add_device_argument(sub)
    sub.add_argument("name", help="compute namespace")
    sub.add_argument("--index", type=parse_u16, default=0, help="program index (default 0, adamw_step; 0..65535)")
    sub.add_argument("--deactivate", action="store_true", help="deactivate instead")

    sub = verb("cp-exec", cmd_exec, "Execute Program (I/O 01h) on a compute namespace: adamw_step over "
               "--range MNSID:SB:LENGTH groups of five (grad, master, exp_avg, exp_avg_sq, param_out) or "
               "a --range-set.")
    add_device_argument(sub)
    sub.add_argument("name", help="compute namespace")
    sub.add_argument("--range", type=_range, action="append", metavar="MNSID:SB:LENGTH", help="an inline range")
    sub.add_argument("--range-set", type=parse_u16, default=0, help="a memory range set's ID (89h; 1..65535)")
    sub.add_argument("--index", type=parse_u16, default=0, help="program index (default 0; 0..65535)")
    sub.add_argument("--step", type=parse_u64, default=0,
                     help="CPARAM1: the step (0: the open or an implicit one)")
    sub.add_argument("--grad-scale", type=float, default=None, help="CPARAM2: the gradient scale")
    sub.add_argument("--lr", type=float, default=None, help="send the hyperparameter block with this lr")
    for flag, default in (("--beta1", 0.9), ("--beta2", 0.999), ("--eps", 1e-8), ("--weight-decay", 0.01)):
        sub.add_argument(flag, type=float, default=default,
                         help=f"with --lr: the block's {flag[2:]} (default {default:g})")

    sub = verb("slm-read", cmd_slm_read, "Memory Read (I/O 02h) of a memory namespace's bytes.",
               formats=("normal", "json", "binary"))
    add_device_argument(sub)
    sub.add_argument("name", help="memory namespace")
    sub.add_argument("--offset", type=parse_u64, default=0, help="first byte (a multiple of 4)")
    sub.add_argument("--length", type=parse_u32, required=True, help="bytes (a multiple of 4)")

    sub = verb("slm-write", cmd_slm_write, "Memory Write (I/O 05h) of a file's bytes into a memory namespace.")
    add_device_argument(sub)
    sub.add_argument("name", help="memory namespace")
    sub.add_argument("--offset", type=parse_u64, default=0, help="first byte (a multiple of 4)")
    sub.add_argument("--input-file", required=True, help="the bytes to write (a multiple of 4)")
