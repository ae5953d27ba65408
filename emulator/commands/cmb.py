"""CMB_WRITE (D1h) and CMB_READ (D2h): a tensor file's bytes to or from the controller memory buffer."""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Callable

from ..cmb import ControllerMemoryBuffer, parallel_copy
from ...protocol.status import DeviceError, Status
from ..namespace import ROLES, Namespace
from ..namespace import param_fp8
from ...protocol.entries import Command, Completion, Opcode
from ..transaction import first_overlap

if TYPE_CHECKING:
    from ..controller import Controller

# A batch's transfers at most: each is a few dozen bytes of JSON, so a model's every tensor
# fits the 16 MiB payload many times over.
MAX_TRANSFERS = 65536


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One range of one tensor file and where its bytes sit in the CMB."""

    tensor: str
    role: str
    offset: int
    length: int
    cmb_offset: int
    param_cmb_offset: int | None = None  # CMB_WRITE of gradients: where the new params go

    @property
    def what(self) -> str:
        return f"{self.tensor}/{self.role}"

    def param_length(self, grad_itemsize: int) -> int:
        """Bytes of the params that come back for this transfer's gradients: 2 for each of its
        gradient elements, whatever their format (4-byte FP32, 1-byte FP8)."""
        return self.length * 2 // grad_itemsize


def _integer(entry: dict[str, Any], key: str, default: int | None, index: int) -> int:
    value = entry.get(key, default)
    if value is None:
        raise DeviceError(Status.INVALID_FIELD, f"transfer {index}: {key!r} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise DeviceError(Status.INVALID_FIELD, f"transfer {index}: {key!r} must be an integer, got {value!r}")
    if value < 0:
        raise DeviceError(Status.INVALID_FIELD, f"transfer {index}: {key!r} must be >= 0, got {value}")
    return value


def parse_transfers(command: Command, default_role: str, sizes: Callable[[str, str], int]) -> list[Transfer]:
    """The payload's JSON array of transfers ({"tensor", "role", "offset", "length",
    "cmb_offset", and for CMB_WRITE's gradients "param_cmb_offset"}); malformed ones are
    INVALID_FIELD. A missing length means the rest of the file (sizes(tensor, role) gives
    its size)."""
    value = command.json  # INVALID_FIELD for anything malformed (protocol.decode_json_payload)
    if not isinstance(value, list) or not value:
        raise DeviceError(Status.INVALID_FIELD, "payload must be a non-empty JSON array of transfers")
    if len(value) > MAX_TRANSFERS:
        raise DeviceError(Status.LIMIT_EXCEEDED, f"{len(value)} transfers in one command; at most {MAX_TRANSFERS}")
    transfers = []
    for index, entry in enumerate(value):
        if not isinstance(entry, dict):
            raise DeviceError(Status.INVALID_FIELD, f"transfer {index} is not a JSON object")
        unknown = set(entry) - {"tensor", "role", "offset", "length", "cmb_offset", "param_cmb_offset"}
        if unknown:
            raise DeviceError(Status.INVALID_FIELD, f"transfer {index}: unknown fields {sorted(unknown)}")
        tensor, role = entry.get("tensor"), entry.get("role", default_role)
        if not isinstance(tensor, str) or not isinstance(role, str):
            raise DeviceError(Status.INVALID_FIELD, f"transfer {index}: 'tensor' (and 'role') must be strings")
        if role not in ROLES and role != param_fp8.ROLE:  # param_fp8: the namespace refuses it where it has none
            raise DeviceError(Status.INVALID_FIELD, f"transfer {index}: no file {role!r} (one of {', '.join(ROLES)})")
        offset = _integer(entry, "offset", 0, index)
        cmb_offset = _integer(entry, "cmb_offset", None, index)
        length = entry.get("length")
        if length is None:
            length = max(0, sizes(tensor, role) - offset)
        param_cmb_offset = None
        if "param_cmb_offset" in entry:
            if command.opcode != Opcode.CMB_WRITE or role != "grad":
                raise DeviceError(Status.INVALID_FIELD,
                                  f"transfer {index}: param_cmb_offset goes with a CMB_WRITE of gradients")
            param_cmb_offset = _integer(entry, "param_cmb_offset", None, index)
        transfers.append(Transfer(tensor, role, offset, _integer({"length": length}, "length", None, index),
                                  cmb_offset, param_cmb_offset))
    return transfers


def check_disjoint(spans: list[tuple[int, int, str]], what: str) -> None:
    """Refuse (INVALID_FIELD) CMB ranges [start, end) that overlap: `what` says why not."""
    overlap = first_overlap([span for span in spans if span[1] > span[0]])
    if overlap is not None:
        start, first, second = overlap
        raise DeviceError(Status.INVALID_FIELD, f"{first} and {second} overlap in the CMB (from byte {start}): {what}")


def check_param_copies(transfers: list[Transfer], grad_itemsize: int = 2,
                       param_lengths: list[int] | None = None) -> None:
    """Refuse (INVALID_FIELD) param copies that overlap each other or any of the command's
    gradients: the kernel writes params while other blocks' gradients are still being read.
    (Gradients may overlap each other: they are only read.) param_lengths: each transfer's
    param place (default Transfer.param_length)."""
    lengths = param_lengths or [t.param_length(grad_itemsize) for t in transfers]
    spans = sorted([(t.cmb_offset, t.cmb_offset + t.length, False, i) for i, t in enumerate(transfers)]
                   + [(t.param_cmb_offset, t.param_cmb_offset + lengths[i], True, i)
                      for i, t in enumerate(transfers) if t.param_cmb_offset is not None])
    any_end = params_end = 0  # the furthest end so far of any span, of a param copy
    for start, end, is_params, index in spans:
        if start == end:
            continue
        if start < params_end or (is_params and start < any_end):
            raise DeviceError(Status.INVALID_FIELD,
                              f"transfer {index}'s {'params' if is_params else 'gradient'} overlap other bytes of "
                              f"the command in the CMB (from byte {start}): a param copy may overlap nothing else")
        any_end = max(any_end, end)
        if is_params:
            params_end = max(params_end, end)


def _param_place_length(namespace: Namespace, transfer: Transfer, grad_itemsize: int, index: int) -> int:
    """The param place of a transfer to a namespace with FP8 params out: its param_fp8 bytes
    (header and codes), for the tensor's whole gradient only (INVALID_FIELD otherwise: the scale
    is the whole tensor's, so its codes cannot be made a block at a time)."""
    if transfer.param_cmb_offset is None:
        return 0
    if transfer.offset != 0 or transfer.length != namespace.file_size(transfer.tensor, "grad"):
        raise DeviceError(Status.INVALID_FIELD,
                          f"transfer {index} ({transfer.what}): namespace {namespace.name!r} sends FP8 params, "
                          "whose scale is the whole tensor's: param_cmb_offset goes with the whole gradient")
    return param_fp8.out_bytes(transfer.length // grad_itemsize)


class CmbCommands:
    """The two commands, against one controller's CMB and namespaces."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def _cmb(self) -> ControllerMemoryBuffer:
        cmb = self.controller.cmb
        if cmb is None:
            raise DeviceError(Status.INVALID_FIELD,
                              "this controller has no memory buffer (mounted with --cmb-size 0)")
        return cmb

    def _namespace(self, command: Command) -> Namespace:
        return self.controller.device.optimizer_namespace(
            command.nsid, "a CMB transfer (it moves tensor files)")

    def write(self, command: Command) -> Completion:
        """Bytes from the CMB into tensor files: gradients of the open (or an implicit) step,
        or master weights and moments before the first step. Every transfer is checked
        before any is taken; the CMB ranges may be reused once the command completes."""
        cmb, namespace = self._cmb(), self._namespace(command)
        transfers = parse_transfers(command, "grad", namespace.file_size)
        regions = [cmb.region(t.cmb_offset, t.length, f"transfer {i} ({t.what})")
                   for i, t in enumerate(transfers)]
        grads = [t.role == "grad" for t in transfers]
        if any(grads) and not all(grads):
            raise DeviceError(Status.INVALID_FIELD, "one command carries gradients or state, not both")
        grad_itemsize = namespace.itemsize("grad")
        fp8_out = namespace.param_wire_dtype is not None
        lengths = [_param_place_length(namespace, t, grad_itemsize, i) if fp8_out else t.param_length(grad_itemsize)
                   for i, t in enumerate(transfers)]
        copies = [None if t.param_cmb_offset is None
                  else cmb.region(t.param_cmb_offset, lengths[i], f"transfer {i} ({t.what}) params")
                  for i, t in enumerate(transfers)]
        if any(copy is not None for copy in copies):
            check_param_copies(transfers, grad_itemsize, lengths)
        # Through the device's one I/O entry; CMB_WRITE met its injections at the controller.
        io = self.controller.io
        result = None
        if all(grads):
            # FP8 params out: the kernel stores no 16-bit params; each place gets the tensor's
            # FP8 params once all its blocks have run (param_fp8.ParamFp8.fill_step_places).
            result = io.write_grads(
                namespace, [(t.tensor, t.offset, region, None if fp8_out else copy)
                            for t, region, copy in zip(transfers, regions, copies)],
                checked=True)
            places = [(t.tensor, copy) for t, copy in zip(transfers, copies) if copy is not None]
            if fp8_out and places:
                namespace.fill_param_fp8_places(places)
        else:
            pending: set[tuple[str, str, int]] = set()  # the scale blocks the transfers leave in part
            for t, region in zip(transfers, regions):  # values too: no transfer taken before a bad one
                namespace.check_write(t.tensor, t.role, t.offset, t.length, region.data, pending)
            for t, region in zip(transfers, regions):
                io.write(namespace, t.tensor, t.role, t.offset, region.data, checked=True)  # the view's bytes
        moved = sum(t.length for t in transfers)
        report: dict[str, Any] = {"bytes": moved, "transfers": len(transfers),
                                  "committed_step": namespace.committed_step, "step_open": namespace.step_open}
        status = Status.SUCCESS
        if result is not None:
            report["commit"] = dataclasses.asdict(result)
            if result.skipped:
                status = Status.STEP_SKIPPED_NONFINITE
        return Completion(command.cid, status, result=moved & 0xFFFFFFFF,
                          data=json.dumps(report, sort_keys=True).encode())

    def read(self, command: Command) -> Completion:
        """Committed bytes of tensor files into the CMB, all of one committed step."""
        cmb, namespace = self._cmb(), self._namespace(command)
        transfers = parse_transfers(command, "param", namespace.file_size)
        for t in transfers:
            namespace.check_read(t.tensor, t.role, t.offset, t.length)
        regions = [cmb.region(t.cmb_offset, t.length, f"transfer {i} ({t.what})")
                   for i, t in enumerate(transfers)]
        check_disjoint([(t.cmb_offset, t.cmb_offset + t.length, f"transfer {i}") for i, t in enumerate(transfers)],
                       "two transfers into the same bytes would leave them to whichever ran last")
        reads = [(t.tensor, t.role, t.offset, t.length) for t in transfers]
        # Through the device's one I/O entry; CMB_READ met its injections at the controller.
        with self.controller.io.read_many(namespace, reads, checked=True) as views:
            for region, view in zip(regions, views):
                parallel_copy(region, view, namespace.workers)
            step = namespace.committed_step
        moved = sum(t.length for t in transfers)
        report = {"bytes": moved, "transfers": len(transfers), "committed_step": step}
        return Completion(command.cid, Status.SUCCESS, result=moved & 0xFFFFFFFF,
                          data=json.dumps(report, sort_keys=True).encode())


def handlers(controller: Controller) -> dict[int, Callable[[Command], Completion]]:
    commands = CmbCommands(controller)
    return {Opcode.CMB_WRITE: commands.write, Opcode.CMB_READ: commands.read}
