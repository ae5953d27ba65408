"""CLI verb inject-error (INJECT_ERROR D0h, log page C3h) and its AdminClient helpers."""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from ...protocol.entries import NSID_ALL, IoOpcode, Opcode
from ...protocol.injection import InjectAction, Queue
from ...protocol.logpages import LogId

from ..arguments import U8_MAX, U32_MAX, VerbFactory, add_device_argument, bounded_int, parse_nonnegative
from ..output import emit, open_client

if TYPE_CHECKING:
    from ...client import AdminClient


# ---------------------------------------------------------------------- client helpers


def arm_injection(client: AdminClient, opcode: int, status: str | int, *, count: int = 1,
                  queue: str = Queue.ADMIN.value, nsid: int = 0) -> dict[str, Any]:
    """Fail the next `count` commands (queue "admin") or tensor-file I/Os (queue "io", opcode
    1 write / 2 read) of `opcode`, of namespace `nsid` (0: any), with `status`."""
    payload = json.dumps({"opcode": opcode, "queue": queue, "status": status, "count": count}).encode()
    completion = client.call(Opcode.INJECT_ERROR, nsid=nsid, cdw10=InjectAction.ARM, payload=payload)
    return json.loads(completion.data)


def corrupt_block(client: AdminClient, nsid: int, tensor: str, block: int) -> dict[str, Any]:
    """Change one byte of a block of the committed copy on the media: scrub will find it."""
    payload = json.dumps({"tensor": tensor, "block": block}).encode()
    return json.loads(client.call(Opcode.INJECT_ERROR, nsid=nsid, cdw10=InjectAction.CORRUPT,
                                  payload=payload).data)


def clear_injections(client: AdminClient) -> int:
    """Disarm every injection; returns how many were armed."""
    return client.call(Opcode.INJECT_ERROR, cdw10=InjectAction.CLEAR).result


def injection_log(client: AdminClient) -> dict[str, Any]:
    """Log page C3h: armed injections, the ones that fired, the blocks corrupted."""
    return json.loads(client.get_log_page(LogId.INJECTED_ERRORS, NSID_ALL))


# ---------------------------------------------------------------------- the verb

# A status's value: (SCT << 8) | SC, SCT 3 bits and SC 8 (the completion's status field).
STATUS_MAX = 0x7FF
# --count: how many commands fail, 1 to the most the device arms (a 32-bit count).
COUNT_TYPE = bounded_int(1, U32_MAX)


def parse_target(text: str) -> tuple[str, int]:
    """(queue, opcode): 'write'/'read' (the tensor files), an opcode name or a number."""
    key = text.strip().upper().replace("-", "_")
    if key in IoOpcode.__members__:
        return Queue.IO.value, int(IoOpcode[key])
    if key in Opcode.__members__:
        return Queue.ADMIN.value, int(Opcode[key])
    try:
        opcode = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an opcode: {text!r} (a number like 0xc5, a name like commit-step, or write/read "
            "for the tensor files)") from None
    if not 0 <= opcode <= U8_MAX:
        raise argparse.ArgumentTypeError(f"{text} is out of range 0..{U8_MAX:#x}")
    return Queue.ADMIN.value, opcode


def parse_status(text: str) -> str | int:
    """A status name (write-fault) or its value ((SCT << 8) | SC, e.g. 0x280: SCT 3 bits, SC 8)."""
    try:
        value = int(text, 0)
    except ValueError:
        return text.strip().upper().replace("-", "_")
    if not 0 <= value <= STATUS_MAX:
        raise argparse.ArgumentTypeError(f"{text} is out of range 0..{STATUS_MAX:#x}")
    return value


def _armed_line(entry: dict[str, Any]) -> str:
    scope = "any namespace" if entry["nsid"] is None else f"nsid {entry['nsid']}"
    return (f"injection {entry['id']}: {entry['opcode_name']} ({entry['queue']}, {scope}) fails with "
            f"{entry['status']}, {entry['remaining']} more, fired {entry['fired']}")


def _log_text(page: dict[str, Any]) -> str:
    lines = [f"armed: {len(page['armed'])}"] + [f"  {_armed_line(entry)}" for entry in page["armed"]]
    lines.append(f"fired: {page['fired_total']} (latest first)")
    for entry in page["fired"]:
        cid = "" if entry["cid"] is None else f" cid {entry['cid']}"
        lines.append(f"  injection {entry['id']}: {entry['opcode_name']} ({entry['queue']}, nsid {entry['nsid']}"
                     f"{cid}) -> {entry['status']}")
    lines.append(f"corrupted: {len(page['corrupted'])}")
    lines += [f"  {c['namespace']}/{c['tensor']} block {c['block']} (lba {c['lba']}), copy {c['copy']} "
              f"byte {c['offset']}" for c in page["corrupted"]]
    return "\n".join(lines)


def cmd_inject_error(args: argparse.Namespace) -> int:

    if args.opcode is not None and args.status is None:
        raise SystemExit("cossd inject-error: --opcode needs --status NAME")
    if args.corrupt is not None and args.tensor is None:
        raise SystemExit("cossd inject-error: --corrupt needs --tensor T (and --block K)")
    with open_client(args) as client:
        if args.opcode is not None:
            queue, opcode = args.opcode
            nsid = client.nsid(args.namespace) if args.namespace else 0
            value: Any = arm_injection(client, opcode, args.status, count=args.count, queue=queue, nsid=nsid)
            text = f"armed {_armed_line(value)}"
        elif args.corrupt is not None:
            value = corrupt_block(client, client.nsid(args.corrupt), args.tensor, args.block)
            text = (f"corrupted {value['namespace']}/{value['tensor']} block {value['block']} "
                    f"(lba {value['lba']}) in copy {value['copy']} at byte {value['offset']}")
        elif args.clear:
            value = {"cleared": clear_injections(client)}
            text = f"cleared {value['cleared']} armed injection(s)"
        else:
            value = injection_log(client)
            text = _log_text(value)
    emit(args, value, lambda _: text)
    return 0


def register(verb: VerbFactory) -> None:
    sub = verb("inject-error", cmd_inject_error,
               "Inject errors (INJECT_ERROR D0h): fail the next N commands or tensor-file I/Os, "
               "corrupt a block on the media, clear, or list (log page C3h).")
    add_device_argument(sub)
    mode = sub.add_mutually_exclusive_group(required=True)
    mode.add_argument("--opcode", type=parse_target,
                      help="arm: the command to fail (0xc5, commit-step) or write/read (tensor files)")
    mode.add_argument("--corrupt", metavar="NS", help="corrupt a block of namespace NS")
    mode.add_argument("--clear", action="store_true", help="disarm every injection")
    mode.add_argument("--list", action="store_true", help="armed, fired and corrupted (log page C3h)")
    sub.add_argument("--status", type=parse_status, help="arm: the status to fail with (write-fault, 0x280)")
    sub.add_argument("--count", type=COUNT_TYPE, default=1, help="arm: how many commands fail (default 1)")
    sub.add_argument("-n", "--namespace", help="arm: only commands of this namespace (default: any)")
    sub.add_argument("--tensor", help="corrupt: the tensor")
    sub.add_argument("--block", type=parse_nonnegative, default=0, help="corrupt: the block within the tensor (default 0)")
