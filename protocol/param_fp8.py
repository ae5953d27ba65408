"""FP8 params out's bytes on the wire: a tensor's param_fp8 file (and CMB step place) is a 16-byte header, its step and scale, then one FP8 code an element."""
from __future__ import annotations

import struct

# The read-only file of a tensor of a namespace made with param_wire_dtype.
ROLE = "param_fp8"
# The FP8 formats a namespace may send its params in (OCP E4M3FN and E5M2).
PARAM_WIRE_DTYPES = ("fp8_e4m3", "fp8_e5m2")
HEADER_BYTES = 16
# step (uint64), scale (float32: code value = param * scale), 4 zero bytes; little-endian.
_HEADER = struct.Struct("<QfI")


def header(step: int, scale: float) -> bytes:
    """The 16 bytes before a tensor's codes: the step its params belong to and their scale."""
    return _HEADER.pack(step, scale, 0)


def parse_header(data: bytes | bytearray | memoryview) -> tuple[int, float]:
    """(step, scale) from a param_fp8 file's first 16 bytes."""
    step, scale, _ = _HEADER.unpack(bytes(data[:HEADER_BYTES]))
    return int(step), float(scale)


def out_bytes(numel: int) -> int:
    """Bytes of one tensor's param_fp8 file (and of its param place in a CMB step)."""
    return HEADER_BYTES + numel
