"""FP8 params out on the trainer: the option's checks, and the device's param_fp8 bytes (step, scale, codes) decoded into the model's params."""
from __future__ import annotations

from typing import Any

import torch

from ..protocol import param_fp8 as wire
from .namespace.files import NamespaceFiles
from .plan import Entry

PARAM_WIRE_DTYPES = wire.PARAM_WIRE_DTYPES
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def check_option(param_wire_dtype: str | None, *, streaming: bool, sharded: bool, transport: str,
                 remote: bool) -> None:
    """Refuse (ValueError naming the option) a param_wire_dtype this optimizer cannot use.
    `sharded`: a job of several ranks. Several devices (mount=[...]) in one process are fine:
    each device's optimizer (a job of one rank) reads its own pieces' param_fp8 files."""
    if param_wire_dtype is None:
        return
    if param_wire_dtype not in PARAM_WIRE_DTYPES:
        raise ValueError(f"param_wire_dtype must be None (params in the model's 16-bit dtype) or one of "
                         f"{', '.join(PARAM_WIRE_DTYPES)}, got {param_wire_dtype!r}")
    unsupported = [what for what, used in (
        ("streaming=True", streaming), ("a sharded job (torch.distributed with several ranks)", sharded),
        ("transport='cp' (Execute Program)", transport == "cp"),
        ("a storage server (cossd://)", remote)) if used]
    if unsupported:
        raise ValueError(f"param_wire_dtype={param_wire_dtype!r} (FP8 params with a per-tensor scale) is supported "
                         f"in one process on local devices; not with {', '.join(unsupported)}")


def decode(codes: torch.Tensor, scale: float, param_wire_dtype: str) -> torch.Tensor:
    """FP8 codes (uint8) as FP32 params: each code's value times 1/scale (exact: a power of two)."""
    return codes.view(TORCH_FP8[param_wire_dtype]).to(torch.float32) * (1.0 / scale)


def read_params(files: NamespaceFiles, entries: list[Entry], param_wire_dtype: str, new_step: int | None) -> int:
    """Fill every entry's param with the device's FP8 params of one step, decoded; returns that step.

    Where the step that just ended (new_step, after a CMB step) had the device put them in the
    CMB with its gradients, from there, once every tensor's header names new_step; else (no
    such places, or a place from another step: the step was skipped or failed after the
    device filled it) by reading each tensor's param_fp8 file through the step transport (the
    files, or CMB_READ). Every tensor's header must name the same step: a RuntimeError names
    the tensors otherwise (another client stepped the namespace between the reads)."""
    transport = files.step_transport()
    back = transport.take_params_back()
    cmb = transport.cmb
    sources: dict[str, torch.Tensor] = {}
    if cmb is not None and back and new_step is not None:
        window = torch.from_numpy(cmb.array)
        placed = {entry.name: window[back[entry.name][0]: back[entry.name][0] + back[entry.name][1]]
                  for entry in entries if entry.name in back and back[entry.name][1] == wire.out_bytes(entry.numel)}
        if len(placed) == len(entries) and all(
                wire.parse_header(place[: wire.HEADER_BYTES].numpy().tobytes())[0] == new_step for place in placed.values()):
            sources = placed
    if not sources:
        buffers = {entry.name: torch.empty(wire.out_bytes(entry.numel), dtype=torch.uint8) for entry in entries}
        ranges: list[Any] = [(entry.name, wire.ROLE, 0, buffers[entry.name]) for entry in entries]
        counts = transport.read(files.nsid, ranges)
        for entry, count in zip(entries, counts):
            if count != wire.out_bytes(entry.numel):
                raise OSError(f"{entry.name}/{wire.ROLE}: {count} bytes, not {wire.out_bytes(entry.numel)}")
        sources = buffers
    steps = {}
    for entry in entries:
        source = sources[entry.name]
        step, scale = wire.parse_header(source[: wire.HEADER_BYTES].cpu().numpy().tobytes())
        steps[entry.name] = step
        values = decode(source[wire.HEADER_BYTES:], scale, param_wire_dtype)
        param = entry.param.detach()
        param.copy_(values.view(param.shape))
    if len(set(steps.values())) > 1:
        raise RuntimeError(f"the device's FP8 params are of several steps ({steps}): another client stepped "
                           f"namespace {files.name!r} while they were read")
    return next(iter(steps.values()))
