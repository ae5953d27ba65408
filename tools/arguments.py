"""What the `cossd` verbs share on the way in: argument types, nvme-cli's common options, the DEVICE argument.

Apart from tools/cli.py so the verb modules use these without importing the CLI that loads them.
"""
from __future__ import annotations

import argparse
from pathlib import Path
import re
from typing import Callable, Protocol

# Run as `nvme` (argv[0], e.g. a symlink to the cossd entry point), cossd answers nvme-cli's
# verbs (tools/cli.py) and `version` prints nvme-cli's lines.
NVME_PROG = "nvme"


class VerbFactory(Protocol):
    """What each verb module's register(verb) is given (tools/cli.py): verb(name, handler,
    help_text, formats) adds a verb and returns its parser; wants(name) says whether the
    command line needs that verb now, so that a family can leave out one whose registration
    alone costs imports (the parser `cossd mount` builds holds its own verb and no other)."""

    def __call__(self, name: str, handler: Callable[[argparse.Namespace], int], help_text: str,
                 formats: tuple[str, ...] = ...) -> argparse.ArgumentParser: ...

    def wants(self, name: str) -> bool: ...


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


# The widths of a command's fields: an integer option of a verb that fills one is refused at
# parse time outside them (bounded_int), never cut to fit on the way to the device.
U8_MAX = 0xFF
U16_MAX = 0xFFFF
U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF


def _bound(value: int, hexadecimal: bool) -> str:
    return f"{value:#x}" if hexadecimal and value > 0 else str(value)


def bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer as parse_int reads it, from `low` to `high` (None: no upper
    bound), else argparse's usage error ("argument --index: 65536 is out of range 0..65535").
    For a command field, its width and sign (U8_MAX ...): a value out of them would be cut, and
    another command than the one asked for sent."""

    def parse(text: str) -> int:
        value = parse_int(text)
        if value < low or (high is not None and value > high):
            if high is None:
                raise argparse.ArgumentTypeError(f"{text} is out of range (at least {low})")
            hexadecimal = text.strip().lower().lstrip("+-").startswith("0x")
            raise argparse.ArgumentTypeError(
                f"{text} is out of range {_bound(low, hexadecimal)}..{_bound(high, hexadecimal)}")
        return value

    parse.__name__ = "integer"  # argparse names it where a type fails otherwise
    return parse


# The usual ones: a field of 8, 16, 32 or 64 bits (unsigned), a count of at least 1.
parse_u8 = bounded_int(0, U8_MAX)
parse_u16 = bounded_int(0, U16_MAX)
parse_u32 = bounded_int(0, U32_MAX)
parse_u64 = bounded_int(0, U64_MAX)
parse_positive = bounded_int(1)
parse_nonnegative = bounded_int(0)


def parse_log_len(text: str) -> int:
    """GET LOG PAGE's length: bytes, a positive multiple of 4 (NUMD counts dwords)."""
    length = parse_int(text)
    if length <= 0 or length % 4 or length > 1 << 34:
        raise argparse.ArgumentTypeError(f"a log length is a positive multiple of 4 up to 16 GiB, got {text}")
    return length


def parse_log_offset(text: str) -> int:
    """GET LOG PAGE's byte offset: a multiple of 4 (the device refuses others: INVALID_FIELD)."""
    offset = parse_int(text)
    if not 0 <= offset < 1 << 64:
        raise argparse.ArgumentTypeError(f"a log page offset is 0 to 2**64-1, got {text}")
    return offset


def parse_log_entries(text: str) -> int:
    """error-log -e: a positive entry count (nvme-cli refuses 0)."""
    count = parse_int(text)
    if count <= 0:
        raise argparse.ArgumentTypeError(f"give a positive number of log entries, got {text}")
    return count


def parse_port(text: str) -> int:
    """A TCP port to listen on: 1-65535."""
    port = parse_int(text)
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r} (1-65535)")
    return port


def parse_threads(text: str) -> int:
    """A thread count: 0-64."""
    count = parse_int(text)
    if not 0 <= count <= 64:
        raise argparse.ArgumentTypeError(f"not a thread count: {text!r} (0-64)")
    return count


# ---------------------------------------------------------------------- nvme-cli shaped verbs

DEVICE_HELP = ("the device: its mountpoint, a namespace's directory MOUNTPOINT/ns/NAME "
               "(the DevicePath `list -o json` shows), or a storage server's cossd://HOST:PORT")
REMOTE_SCHEME = "cossd://"
DEVICE_METAVAR = "MOUNTPOINT|cossd://HOST:PORT"
MOUNT_OR_URL_HELP = ("where the device is mounted (as `cossd mount` was given it), or a storage server's "
                     "cossd://HOST[:PORT] (`cossd serve`)")


def add_device_argument(sub: argparse.ArgumentParser, **options: object) -> None:
    """A verb's DEVICE (a mountpoint or a server's URL, see device_location) and the options a
    server needs: the token and the CA to trust (else $COSSD_TOKEN_FILE, $COSSD_CA)."""
    # The usage line and the help say both forms: "MOUNTPOINT" alone hid the server's URL.
    options.setdefault("metavar", DEVICE_METAVAR)
    options.setdefault("help", MOUNT_OR_URL_HELP)
    sub.add_argument("mountpoint", type=device_location, **options)  # type: ignore[arg-type]
    sub.add_argument("--token-file", metavar="FILE",
                     help="a storage server's token (default: $COSSD_TOKEN_FILE); only for cossd:// devices")
    sub.add_argument("--ca", metavar="PEM",
                     help="the CA that signed a TLS server's certificate (default: $COSSD_CA); only for "
                          "cossd:// devices")


def device_location(text: str) -> Path | str:
    """A verb's DEVICE: a storage server's URL stays as given (a Path would fold its `//`), any
    other text is a path (a mountpoint, or a directory or file under one)."""
    return text if text.startswith(REMOTE_SCHEME) else Path(text)


def add_nvme_options(sub: argparse.ArgumentParser) -> None:
    """The options nvme-cli's verbs share: -v/--verbose (JSON as nvme-cli 2.11 prints it),
    -b/--raw-binary (-o binary)."""
    sub.add_argument("-v", "--verbose", action="store_true",
                     help="-o json shaped as nvme-cli 2.11 (default: as nvme-cli 2.3)")
    sub.add_argument("-b", "--raw-binary", action="store_true", help="the raw page (-o binary)")


def nvme_device(args: argparse.Namespace) -> str | None:
    """Point args.mountpoint at the mount of the device an nvme-cli style verb names (a
    mountpoint, a namespace directory MOUNTPOINT/ns/NAME, or a path under them); return the
    namespace such a path names, if any."""
    from ..client import MOUNT_FSTYPE, REMOTE_MOUNT_FSTYPE, mounted_devices
    from .nvme_json import resolve_device

    if isinstance(args.mountpoint, str):  # a server's URL: the device itself, no namespace path
        return None
    # A remote mount (cossd mount cossd://...) is named the same ways as a local one.
    mounts = mounted_devices(fstypes=(MOUNT_FSTYPE, REMOTE_MOUNT_FSTYPE))
    args.mountpoint, namespace = resolve_device(args.mountpoint, mounts)
    return namespace
