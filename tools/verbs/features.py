"""CLI verbs get-feature and set-feature (like nvme-cli's), and their AdminClient helpers."""
from __future__ import annotations

import argparse
import json
import struct
import sys
from typing import TYPE_CHECKING, Any

from ...protocol.features import (
    ALL_GROUPS,
    CAP_CHANGEABLE,
    CAP_NAMESPACE_SPECIFIC,
    CAP_SAVEABLE,
    DURABILITY_MODES,
    KERNEL_CHOICES,
    SAVE_BIT,
    FeatureId,
    Select,
)
from ...protocol.entries import Completion, Opcode
from ...protocol.hyperparameters import GROUP_FIELDS

from ..arguments import VerbFactory, add_device_argument, parse_int, parse_u8, parse_u32
from ..output import emit, open_client

if TYPE_CHECKING:
    from ...client import AdminClient

# nvme-cli's names of the features, as its get-feature prints them.
FEATURE_NAMES = {
    FeatureId.TEMPERATURE_THRESHOLD: "Temperature Threshold",
    FeatureId.NUMBER_OF_QUEUES: "Number of Queues",
    FeatureId.HYPERPARAMETERS: "Optimizer Hyperparameters (vendor)",
    FeatureId.DEVICE_SETTINGS: "Device Settings (vendor)",
}
SELECT_NAMES = {Select.CURRENT: "Current", Select.DEFAULT: "Default", Select.SAVED: "Saved",
                Select.SUPPORTED_CAPABILITIES: "Supported capabilities"}
HYPERPARAMETER_FLAGS = GROUP_FIELDS


# ---------------------------------------------------------------------- client helpers


def get_feature(client: AdminClient, fid: int, *, nsid: int = 0, select: int = Select.CURRENT,
                cdw11: int = 0) -> Completion:
    """Get Features (0Ah): the completion (value in `result`, JSON `data` for vendor features).
    A field out of its width (FID 8 bits, SEL 3): ValueError, nothing sent."""
    from ...client.admin import check_field

    cdw10 = check_field("feature identifier", fid, 8) | check_field("select", select, 3) << 8
    return client.call(Opcode.GET_FEATURES, nsid=nsid, cdw10=cdw10, cdw11=cdw11)


def set_feature(client: AdminClient, fid: int, *, nsid: int = 0, value: int = 0,
                data: dict[str, Any] | None = None, save: bool = False) -> Completion:
    """Set Features (09h): `value` goes in cdw11, `data` as the JSON payload; `save` sets SV.
    A field out of its width (FID 8 bits, the value 32): ValueError, nothing sent."""
    from ...client.admin import check_field

    payload = json.dumps(data).encode() if data is not None else b""
    cdw10 = check_field("feature identifier", fid, 8) | (SAVE_BIT if save else 0)
    return client.call(Opcode.SET_FEATURES, nsid=nsid, cdw10=cdw10, cdw11=check_field("value", value, 32),
                       payload=payload)


# ---------------------------------------------------------------------- decoding


def feature_name(fid: int) -> str:
    try:
        return FEATURE_NAMES[FeatureId(fid)]
    except ValueError:
        return "Unknown"


def decode_value(fid: int, select: int, value: int) -> dict[str, Any]:
    """The result dword's fields (-H), named as nvme-cli names them."""
    if select == Select.SUPPORTED_CAPABILITIES:
        return {"saveable": bool(value & CAP_SAVEABLE), "namespace_specific": bool(value & CAP_NAMESPACE_SPECIFIC),
                "changeable": bool(value & CAP_CHANGEABLE)}
    if fid == FeatureId.TEMPERATURE_THRESHOLD:
        return {"tmpth": value & 0xFFFF, "tmpsel": (value >> 16) & 0xF, "thsel": (value >> 20) & 0x3}
    if fid == FeatureId.NUMBER_OF_QUEUES:
        return {"nsqa": value & 0xFFFF, "ncqa": value >> 16}
    if fid == FeatureId.HYPERPARAMETERS:
        return {"groups": value}
    return {}


def _human_lines(fid: int, select: int, fields: dict[str, Any]) -> list[str]:
    if select == Select.SUPPORTED_CAPABILITIES:
        return [f"\tFeature is {'' if fields[key] else 'not '}{key.replace('_', ' ')}"
                for key in ("saveable", "namespace_specific", "changeable")]
    if fid == FeatureId.TEMPERATURE_THRESHOLD:
        kelvin = fields["tmpth"]
        thsel = "Over" if fields["thsel"] == 0 else "Under"
        return [f"\tThreshold Type Select         (THSEL): {fields['thsel']} - {thsel} Temperature Threshold",
                f"\tThreshold Temperature Select (TMPSEL): {fields['tmpsel']} - Composite Temperature",
                f"\tTemperature Threshold         (TMPTH): {kelvin - 273} °C ({kelvin} K)"]
    if fid == FeatureId.NUMBER_OF_QUEUES:
        return [f"\tNumber of IO Completion Queues Allocated (NCQA): {fields['ncqa'] + 1}",
                f"\tNumber of IO Submission Queues Allocated (NSQA): {fields['nsqa'] + 1}"]
    return []


def _data_json(completion: Completion) -> Any:
    return json.loads(completion.data) if completion.data else None


# ---------------------------------------------------------------------- verbs


def _nsid(client: AdminClient, name: str | None) -> int:
    return client.nsid(name) if name else 0


def cmd_get_feature(args: argparse.Namespace) -> int:

    with open_client(args) as client:
        nsid = _nsid(client, args.namespace)
        completion = get_feature(client, args.feature_id, nsid=nsid, select=args.sel, cdw11=args.cdw11)
    if args.output_format == "binary":
        # The data buffer, as nvme-cli writes it; a feature without one: its value dword.
        sys.stdout.buffer.write(completion.data or struct.pack("<I", completion.result))
        sys.stdout.buffer.flush()
        return 0
    fields = decode_value(args.feature_id, args.sel, completion.result)
    value: dict[str, Any] = {"feature_id": args.feature_id, "feature_name": feature_name(args.feature_id),
                             "nsid": nsid, "sel": SELECT_NAMES[Select(args.sel)].lower(),
                             "value": completion.result, "data": _data_json(completion)}
    if args.human_readable:
        value["fields"] = fields

    def normal(v: dict[str, Any]) -> str:
        lines = [f"get-feature:{args.feature_id:#04x} ({v['feature_name']}), "
                 f"{SELECT_NAMES[Select(args.sel)]} value:{v['value']:#010x}"]
        if args.human_readable:
            lines += _human_lines(args.feature_id, args.sel, fields)
        if v["data"] is not None:
            lines.append(json.dumps(v["data"], indent=2, sort_keys=True))
        return "\n".join(lines)

    emit(args, value, normal, sort_keys=False)
    return 0


def _set_payload(args: argparse.Namespace) -> dict[str, Any] | None:
    """The JSON payload of set-feature: --data, or the named flags; never both."""
    named = {key: getattr(args, key) for key in (*HYPERPARAMETER_FLAGS, "durability", "kernel")
             if getattr(args, key) is not None}
    if args.data is not None and named:
        raise SystemExit("cossd set-feature: give --data or the named flags (--lr, --durability, ...), not both")
    if args.data is not None:
        try:
            return json.loads(args.data)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"cossd set-feature: --data is not JSON: {exc}") from None
    return named or None


def cmd_set_feature(args: argparse.Namespace) -> int:

    payload = _set_payload(args)
    value = args.value
    if value is None:
        if args.feature_id == FeatureId.HYPERPARAMETERS:
            value = ALL_GROUPS  # C0h: every group unless -v names one
        elif payload is None:
            raise SystemExit(f"cossd set-feature: feature {args.feature_id:#04x} needs -v VALUE "
                             "(or --data / named flags for a vendor feature)")
        else:
            value = 0
    with open_client(args) as client:
        nsid = _nsid(client, args.namespace)
        completion = set_feature(client, args.feature_id, nsid=nsid, value=value, data=payload, save=args.save)
    shown = {"feature_id": args.feature_id, "feature_name": feature_name(args.feature_id), "nsid": nsid,
             "value": value, "save": args.save, "result": completion.result, "data": _data_json(completion)}

    def normal(v: dict[str, Any]) -> str:
        line = (f"set-feature:{args.feature_id:#04x} ({v['feature_name']}), value:{v['value']:#010x}, "
                f"save:{int(v['save'])}, result:{v['result']:#010x}")
        return line + (f"\n{json.dumps(v['data'], indent=2, sort_keys=True)}" if v["data"] is not None else "")

    emit(args, shown, normal, sort_keys=False)
    return 0


def _select(text: str) -> int:

    select = parse_int(text)
    if select not in tuple(Select):
        raise argparse.ArgumentTypeError(f"SEL must be 0 (current), 1 (default), 2 (saved) or 3 (capabilities), "
                                         f"not {text!r}")
    return select


def register(verb: VerbFactory) -> None:

    fids = ", ".join(f"{int(fid):#04x} {name}" for fid, name in FEATURE_NAMES.items())
    sub = verb("get-feature", cmd_get_feature, f"Get Features (0Ah), like nvme get-feature: {fids}.",
               formats=("normal", "json", "binary"))
    add_device_argument(sub)
    sub.add_argument("-f", "--feature-id", type=parse_u8, required=True,
                     help="feature identifier, e.g. 4 or 0xc1 (0..0xff)")
    sub.add_argument("-n", "--namespace", help="namespace name (needed by 0xc0)")
    sub.add_argument("-s", "--sel", type=_select, default=Select.CURRENT,
                     help="0 current (default), 1 default, 2 saved, 3 supported capabilities")
    sub.add_argument("-c", "--cdw11", type=parse_u32, default=0,
                     help="command dword 11 (0x04: TMPSEL bits 19:16, THSEL bits 21:20; 0 = composite, over)")
    sub.add_argument("-H", "--human-readable", action="store_true", help="decode the value's fields")

    sub = verb("set-feature", cmd_set_feature, f"Set Features (09h), like nvme set-feature: {fids}.")
    add_device_argument(sub)
    sub.add_argument("-f", "--feature-id", type=parse_u8, required=True,
                     help="feature identifier, e.g. 4 or 0xc1 (0..0xff)")
    sub.add_argument("-n", "--namespace", help="namespace name (needed by 0xc0)")
    sub.add_argument("-v", "--value", type=parse_u32,
                     help="command dword 11 (0x04: the threshold in Kelvin, with TMPSEL/THSEL; "
                          "0xc0: the group, default every group)")
    sub.add_argument("--data", help="the JSON payload of a vendor feature, e.g. '{\"durability\": \"sync\"}'")
    for flag in HYPERPARAMETER_FLAGS:
        sub.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=float, help=f"0xc0: {flag}")
    sub.add_argument("--durability", choices=DURABILITY_MODES, help="0xc1: sync or plp")
    sub.add_argument("--kernel", choices=KERNEL_CHOICES, help="0xc1: the kernel path")
    sub.add_argument("-s", "--save", action="store_true", help="save the value: it survives remounts (SV)")

