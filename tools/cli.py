"""The `cossd` command line: format, mount and administer an emulated computational SSD."""
from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from cossd.emulator.errors import DeviceError

_SIZE = re.compile(r"(\d+)([KMGT]?)(i?B?)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64G', '512MiB', '1000000' -> bytes (binary multiples)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 64G)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[match.group(2).upper()]
    return int(match.group(1)) * scale


def parse_tensor(text: str) -> tuple[str, int]:
    name, sep, numel = text.rpartition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"tensor must be NAME:NUMEL, got {text!r}")
    try:
        count = int(numel)
    except ValueError:
        raise argparse.ArgumentTypeError(f"element count of {name!r} is not an integer: {numel!r}") from None
    return name, count


def emit(args: argparse.Namespace, value: Any, normal: Callable[[Any], str]) -> None:
    if getattr(args, "output_format", "normal") == "json":
        print(json.dumps(value, indent=2, sort_keys=True))
    else:
        print(normal(value))


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
                     debug=args.debug, ready_fd=args.ready_fd)
        return 0
    pid = daemon.start_background(args.backing, args.mountpoint, sync=args.sync,
                                  allow_other=args.allow_other, log_file=args.log_file)
    emit(args, {"mountpoint": str(args.mountpoint), "pid": pid},
         lambda v: f"mounted {args.backing} at {v['mountpoint']} (daemon pid {v['pid']})")
    return 0


def cmd_umount(args: argparse.Namespace) -> int:
    from cossd.tools.client import AdminClient

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


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from cossd.tools.client import AdminClient

    return AdminClient(args.mountpoint)


def cmd_create_ns(args: argparse.Namespace) -> int:
    description = {
        "name": args.name,
        "tensors": [[name, numel] for name, numel in args.tensor],
        "hyperparameters": {"lr": args.lr, "beta1": args.beta1, "beta2": args.beta2,
                            "eps": args.eps, "weight_decay": args.weight_decay, "mode": args.mode},
        "grad_dtype": args.grad_dtype,
        "param_dtype": args.param_dtype,
        "state_dtype": args.state_dtype,
    }
    with _client(args) as client:
        nsid = client.create_namespace(description)
    emit(args, {"name": args.name, "nsid": nsid},
         lambda v: f"created namespace {v['name']!r} (nsid {v['nsid']}, {len(args.tensor)} tensors)")
    return 0


def cmd_delete_ns(args: argparse.Namespace) -> int:
    with _client(args) as client:
        client.delete_namespace(client.nsid(args.name))
    emit(args, {"deleted": args.name}, lambda v: f"deleted namespace {args.name!r}")
    return 0


def cmd_id_ctrl(args: argparse.Namespace) -> int:
    with _client(args) as client:
        described = client.describe()

    def normal(value: dict[str, Any]) -> str:
        identity = value["identity"]
        lines = [
            f"sn        : {identity['serial']}",
            f"mn        : {identity['model']}",
            f"fr        : {identity['firmware_revision']}",
            f"capacity  : {value['capacity_bytes']} bytes ({value['allocated_bytes']} allocated)",
            f"durability: {value['durability']}",
            f"backing   : {value['backing']}",
            f"namespaces: {len(value['namespaces'])}",
        ]
        for ns in value["namespaces"]:
            lines.append(f"  nsid {ns['nsid']:>3} {ns['name']:<24} step {ns['committed_step']} "
                         f"(durable {ns['durable_step']}){' loading' if ns['loading'] else ''}")
        return "\n".join(lines)

    emit(args, described, normal)
    return 0


def cmd_step(args: argparse.Namespace) -> int:
    with _client(args) as client:
        nsid = client.nsid(args.name)
        if args.verb == "begin-step":
            value: Any = {"step": client.begin_step(nsid, args.step or 0, args.grad_scale)}
        elif args.verb == "commit-step":
            value = client.commit_step(nsid)
        else:
            value = {"aborted_step": client.abort_step(nsid)}
    emit(args, value, lambda v: " ".join(f"{k}={v[k]}" for k in sorted(v)))
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

    return bench.run(args)


# ---------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cossd",
        description="An emulated computational SSD that runs the Adam optimizer inside the drive.",
        epilog="Run `cossd VERB --help` for a verb's options. Docs: docs/ in the source tree.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    def verb(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(handler=handler)
        sub.add_argument("-o", "--output-format", choices=("normal", "json"), default="normal",
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

    sub = verb("umount", cmd_umount, "Unmount; waits until the daemon has flushed the state.")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("--lazy", action="store_true", help="detach even if busy (fusermount3 -z)")
    sub.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the daemon")

    sub = verb("create-ns", cmd_create_ns, "Create an optimizer namespace (one optimizer).")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("name")
    sub.add_argument("--tensor", type=parse_tensor, action="append", required=True,
                     metavar="NAME:NUMEL", help="a tensor and its element count (repeatable)")
    sub.add_argument("--lr", type=float, default=1e-3)
    sub.add_argument("--beta1", type=float, default=0.9)
    sub.add_argument("--beta2", type=float, default=0.999)
    sub.add_argument("--eps", type=float, default=1e-8)
    sub.add_argument("--weight-decay", type=float, default=0.01)
    sub.add_argument("--mode", choices=("adamw", "adam"), default="adamw",
                     help="adamw: decoupled weight decay; adam: L2 penalty added to the gradient")
    sub.add_argument("--grad-dtype", choices=("fp16", "bf16"), default="fp16")
    sub.add_argument("--param-dtype", choices=("fp16", "bf16"), default="fp16")
    sub.add_argument("--state-dtype", choices=("fp32", "bf16"), default="fp32",
                     help="dtype of the Adam moments (master weights are always fp32)")

    sub = verb("delete-ns", cmd_delete_ns, "Delete a namespace and its state.")
    sub.add_argument("mountpoint", type=Path)
    sub.add_argument("name")

    sub = verb("id-ctrl", cmd_id_ctrl, "Identify the device: serial, model, capacity, namespaces.")
    sub.add_argument("mountpoint", type=Path)

    for name, text in (("begin-step", "Open a step transaction."),
                       ("commit-step", "Commit the open step (reports a skip on inf/NaN)."),
                       ("abort-step", "Abort the open step; the committed state is untouched.")):
        sub = verb(name, cmd_step, text)
        sub.add_argument("mountpoint", type=Path)
        sub.add_argument("name")
        if name == "begin-step":
            sub.add_argument("--step", type=int, help="step number (default: the next one)")
            sub.add_argument("--grad-scale", type=float, default=1.0,
                             help="combined gradient scale: 1/loss_scale x clip coefficient")

    sub = verb("demo", cmd_demo, "Train a small GPT through a temporary mount, crash the device "
               "mid-step, restore, and compare with torch.save and DCP checkpointing.")
    from cossd.trainer.options import add_bench_arguments, add_demo_arguments

    add_demo_arguments(sub)

    sub = verb("bench", cmd_bench, "Measure the kernel, the file path, checkpoint and restore "
               "against torch's AdamW, torch.save and DCP, side by side in one run.")
    add_bench_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except DeviceError as exc:
        print(f"cossd {args.verb}: {exc.message} [{exc.status.name}]", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as exc:
        print(f"cossd {args.verb}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
