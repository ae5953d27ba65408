"""One tiered-checkpoint version as bytes: a model's and an optimizer's state dicts laid out in one buffer, and back."""
from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import torch

MAGIC = b"COSSDTC1"
FORMAT_VERSION = 1
# Tensors start on 64-byte boundaries, so a restore can view them in place (no unaligned loads).
ALIGN = 64
_PREFIX = struct.Struct("<8sQ")  # magic, header length


class PayloadError(ValueError):
    """A payload that does not decode: not a tiered checkpoint, or damaged."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass
class Layout:
    """Where each tensor of a version goes in its buffer, and the JSON skeleton around them."""

    header: bytes
    tensors: list[torch.Tensor]
    offsets: list[int]
    size: int


def _encode(value: Any, tensors: list[torch.Tensor], path: str) -> Any:
    """The state as JSON with tagged tensors, tuples and non-string keys. JSON, not pickle: a
    version read back from a shared object store must not be able to run code on load."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized or value.is_nested:
            raise TypeError(f"cannot checkpoint {path}: only dense tensors are supported, not {value.layout}")
        tensors.append(value)
        return {"$t": len(tensors) - 1}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, tensors, f"{path}.{k}") for k, v in value.items()}
        return {"$d": [[_encode(k, tensors, f"{path}[key]"), _encode(v, tensors, f"{path}[{k!r}]")]
                       for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value  # floats as repr: JSON carries a Python float exactly, inf and nan included
    raise TypeError(f"cannot checkpoint {path}: a {type(value).__name__} (tensors, dicts, lists, tuples, "
                    "numbers, strings and None only)")


def plan(state: dict[str, Any], step: int) -> Layout:
    """The layout of `state` (names to state dicts) as one version; TypeError names the first
    value it cannot carry. Nothing is copied yet."""
    tensors: list[torch.Tensor] = []
    skeleton = _encode(state, tensors, "state")
    offsets: list[int] = []
    described = []
    # Offsets are relative to the data area; the header's length is only known once they are.
    position = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        offsets.append(position)
        described.append([str(tensor.dtype).removeprefix("torch."), list(tensor.shape), position, nbytes])
        position += _aligned(nbytes)
    header = json.dumps({"format": FORMAT_VERSION, "step": step, "state": skeleton,
                         "tensors": described}, separators=(",", ":")).encode()
    data_start = _aligned(_PREFIX.size + len(header))
    return Layout(header, tensors, [data_start + o for o in offsets], data_start + position)


def write(layout: Layout, buffer: torch.Tensor) -> None:
    """Copy the layout's tensors into `buffer` (uint8, layout.size bytes): the checkpoint's one
    synchronous copy. Tensors on a GPU are copied straight from it."""
    prefix = _PREFIX.pack(MAGIC, len(layout.header)) + layout.header
    buffer[:len(prefix)].copy_(torch.frombuffer(bytearray(prefix), dtype=torch.uint8))
    for tensor, offset in zip(layout.tensors, layout.offsets):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            # reshape(-1) is a view for a contiguous tensor; a strided one is gathered here.
            buffer[offset:offset + nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise PayloadError(f"unknown dtype {name!r} in a checkpoint")
    return dtype


def _decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "$t" in value:
            return tensors[value["$t"]]
        if "$tuple" in value:
            return tuple(_decode(v, tensors) for v in value["$tuple"])
        if "$d" in value:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value["$d"]}
        return {k: _decode(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value


def read(buffer: torch.Tensor, copy: bool) -> tuple[int, dict[str, Any]]:
    """(step, state) of a version's bytes (uint8 tensor). Its tensors view `buffer` unless
    `copy`: an optimizer keeps the tensors it is loaded with, so a buffer that is reused or
    freed later must be copied out."""
    if buffer.numel() < _PREFIX.size:
        raise PayloadError("a checkpoint shorter than its header")
    magic, header_len = _PREFIX.unpack(bytes(buffer[:_PREFIX.size].numpy()))
    if magic != MAGIC or _PREFIX.size + header_len > buffer.numel():
        raise PayloadError("not a cossd tiered checkpoint (bad magic or header length)")
    try:
        header = json.loads(bytes(buffer[_PREFIX.size:_PREFIX.size + header_len].numpy()))
    except ValueError as exc:
        raise PayloadError(f"a checkpoint header that is not JSON: {exc}") from None
    if header.get("format") != FORMAT_VERSION:
        raise PayloadError(f"checkpoint format {header.get('format')!r}, this reader knows {FORMAT_VERSION}")
    data_start = _aligned(_PREFIX.size + header_len)
    tensors = []
    for dtype_name, shape, offset, nbytes in header["tensors"]:
        start = data_start + offset
        if start + nbytes > buffer.numel():
            raise PayloadError("a tensor past the end of the checkpoint")
        raw = buffer[start:start + nbytes]
        tensor = raw.view(_dtype(dtype_name)).reshape(shape) if nbytes else \
            torch.empty(shape, dtype=_dtype(dtype_name))
        tensors.append(tensor.clone() if copy else tensor)
    return int(header["step"]), _decode(header["state"], tensors)


def as_memoryview(buffer: torch.Tensor) -> memoryview:
    """A uint8 CPU tensor's bytes, without a copy."""
    return buffer.numpy().data.cast("B")
