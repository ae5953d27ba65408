"""What every verb of the `cossd` CLI shares on the way out: printing (normal, JSON, binary), the device's client.

Apart from tools/cli.py so the verb modules (tools/verbs_*.py) use these without importing the
CLI that loads them; their argument types are in tools/arguments.py.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..client import AdminClient


def emit(args: argparse.Namespace, value: Any, normal: Callable[[Any], str], *,
         sort_keys: bool = True) -> None:
    """Print `value` as JSON (-o json) or as `normal` renders it. nvme-cli shaped verbs keep
    nvme-cli's key order (sort_keys=False)."""
    if getattr(args, "output_format", "normal") == "json":
        print(json.dumps(value, indent=2, sort_keys=sort_keys))
    else:
        print(normal(value))


def write_binary(data: bytes) -> None:
    """-o binary: the raw page on stdout, as nvme-cli writes it (for xxd or a parser)."""
    sys.stdout.flush()
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


def binary_output(args: argparse.Namespace) -> bool:
    """-o binary, or nvme-cli's -b/--raw-binary."""
    return args.output_format == "binary" or getattr(args, "raw_binary", False)


def hexdump(data: bytes, start: int = 0) -> str:
    """nvme-cli's raw page dump: 16 bytes per row, offset (counted from `start`, where the
    data begins in the page), hex, then the printable ASCII."""
    lines = ["       0  1  2  3  4  5  6  7  8  9  a  b  c  d  e  f"]
    for offset in range(0, len(data), 16):
        row = data[offset : offset + 16]
        text = "".join(chr(byte) if 32 <= byte < 127 else "." for byte in row)
        lines.append(f"{start + offset:04x}: {' '.join(f'{byte:02x}' for byte in row):<47} \"{text}\"")
    return "\n".join(lines)


def open_client(args: argparse.Namespace) -> "AdminClient":
    """The AdminClient of the device a verb names (its `mountpoint` argument)."""
    from ..client import AdminClient  # here: verbs that need no device load no client

    return AdminClient(args.mountpoint, token_file=getattr(args, "token_file", None), ca=getattr(args, "ca", None))


def human_bytes(count: float) -> str:
    """A byte count as people read it: 512 B, 1.5 KiB, 3.2 GiB."""
    value, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
