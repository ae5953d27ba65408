"""What every verb of the `cossd` CLI shares: number arguments, printing, the device's client.

Apart from tools/cli.py so the verb modules (feature_cmds, inject_cmds, snapshot_cmds,
model_cmd, top) use these without importing the CLI that loads them.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..client import AdminClient

_SIZE = re.compile(r"(\d+)([KMGT]?)(i?B?)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64G', '512MiB', '1000000' -> bytes (binary multiples)."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 64G)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[match.group(2).upper()]
    return int(match.group(1)) * scale


def parse_int(text: str) -> int:
    """An integer in any base Python reads: '2', '0xc0'."""
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r} (examples: 2, 0xc0)") from None


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


def open_client(args: argparse.Namespace) -> "AdminClient":
    """The AdminClient of the device a verb names (its `mountpoint` argument)."""
    from ..client import AdminClient  # here: verbs that need no device load no client

    return AdminClient(args.mountpoint)
