"""CLI verbs for namespaces: create-ns (an optimizer's, or a plain NVM one), delete-ns, id-ns."""
from __future__ import annotations

import argparse
import math

from ..arguments import (DEVICE_HELP, VerbFactory, add_device_argument, add_nvme_options, nvme_device, parse_size,
                        parse_u32)
from ..output import binary_output, emit, open_client, write_binary


def parse_tensor_shape(text: str) -> tuple[str, int, list[int] | None]:
    """--tensor NAME:NUMEL (an element count, no shape recorded) or NAME:D1xD2x... (a shape,
    which the device keeps for the export): (name, element count, shape or None)."""
    name, sep, size = text.rpartition(":")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"tensor must be NAME:NUMEL or NAME:D1xD2..., got {text!r}")
    try:
        dims = [int(dim) for dim in size.split("x")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"tensor {name!r}: {size!r} is neither an element count nor a shape like 768x3072") from None
    if "x" not in size:
        if dims[0] < 1:
            raise argparse.ArgumentTypeError(f"tensor {name!r}: element count {size} is out of range (at least 1)")
        return name, dims[0], None
    if any(dim < 1 for dim in dims):
        raise argparse.ArgumentTypeError(f"tensor {name!r}: every dimension of {size!r} must be at least 1")
    return name, math.prod(dims), dims


def cmd_create_ns(args: argparse.Namespace) -> int:
    if args.nvm:
        return _create_nvm_ns(args)
    if not args.tensor:
        raise SystemExit("cossd create-ns: give at least one --tensor NAME:NUMEL (or --nvm --size N)")
    description = {
        "name": args.name,
        "tensors": [[name, numel] for name, numel, _ in args.tensor],
        "hyperparameters": {"lr": args.lr, "beta1": args.beta1, "beta2": args.beta2,
                            "eps": args.eps, "weight_decay": args.weight_decay, "mode": args.mode},
        "grad_dtype": args.grad_dtype,
        "param_dtype": args.param_dtype,
        "state_dtype": args.state_dtype,
    }
    if args.param_wire_dtype:
        description["param_wire_dtype"] = args.param_wire_dtype
    shapes = {name: shape for name, _, shape in args.tensor if shape is not None}
    if shapes:
        description["shapes"] = shapes
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


def cmd_id_ns(args: argparse.Namespace) -> int:
    """Identify Namespace (CNS 00h), decoded with nvme-cli's field names. The namespace: NAME,
    else -n NSID, else the one a device path MOUNTPOINT/ns/NAME names."""
    from ...protocol.entries import IdentifyCns, Opcode
    from .. import nvme_json

    named = nvme_device(args)
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
    if binary_output(args):
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


def register(verb: VerbFactory) -> None:
    sub = verb("create-ns", cmd_create_ns, "Create an optimizer namespace (one optimizer), or with "
               "--nvm a plain NVM namespace (a raw data file).")
    add_device_argument(sub)
    sub.add_argument("name")
    sub.add_argument("--tensor", type=parse_tensor_shape, action="append",
                     metavar="NAME:NUMEL|NAME:SHAPE",
                     help="a tensor and its element count, or its shape (768x3072), which `cossd "
                          "export` then writes (repeatable; required unless --nvm)")
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
    sub.add_argument("--grad-dtype", choices=("fp16", "bf16", "fp32", "fp8_e4m3", "fp8_e5m2"), default="fp16",
                     help="dtype the trainer writes gradients in: fp32 for exact parity with an FP32 "
                          "trainer (6 B/param on the wire), fp8 codes with a per-tensor scale sent with "
                          "each step (default: %(default)s)")
    sub.add_argument("--param-dtype", choices=("fp16", "bf16"), default="fp16",
                     help="dtype the device hands params back in (default: %(default)s)")
    sub.add_argument("--param-wire-dtype", choices=("fp8_e4m3", "fp8_e5m2"), default=None,
                     help="also hand each step's params out as FP8 codes with a per-tensor scale, 1 B/param, "
                          "in each tensor's read-only param_fp8 file (a 16-byte header: step, scale); the media "
                          "keep --param-dtype params (default: none)")
    sub.add_argument("--state-dtype", choices=("fp32", "bf16", "fp16", "int8"), default="fp32",
                     help="format of the Adam moments on the media: fp32, bf16, or block-scaled fp16 or int8 "
                          "(a float32 scale per 256 elements; the moment files read as fp32); master "
                          "weights are always fp32 (default: %(default)s)")

    sub = verb("delete-ns", cmd_delete_ns, "Delete a namespace and its state.")
    add_device_argument(sub)
    sub.add_argument("name")

    sub = verb("id-ns", cmd_id_ns, "Identify a namespace (NVMe CNS 00h): sizes in 4 KiB blocks, LBA format.",
               formats=("normal", "json", "binary"))
    add_device_argument(sub, metavar="DEVICE", help=DEVICE_HELP)
    sub.add_argument("name", nargs="?", help="namespace name (or -n NSID, or DEVICE MOUNTPOINT/ns/NAME)")
    sub.add_argument("-n", "--namespace-id", type=parse_u32, metavar="NSID", help="namespace id (0..0xffffffff)")
    add_nvme_options(sub)
