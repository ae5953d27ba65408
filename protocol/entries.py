"""Control protocol v1: NVMe-shaped submission and completion entries, declared once."""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import struct
from typing import Any

import numpy as np

from .status import DeviceError, Status

# The largest payload one submission may carry; the queue refuses a longer one before reading it.
MAX_PAYLOAD_BYTES = 16 << 20

# 64-byte submission entry. NVMe's PRP/SGL data pointer has no meaning for a file, so its
# first dword carries the length of the payload that follows the entry in the same write.
SUBMISSION = np.dtype(
    [
        ("opcode", "u1"),
        ("flags", "u1"),
        ("cid", "<u2"),
        ("nsid", "<u4"),
        ("cdw2", "<u4"),
        ("cdw3", "<u4"),
        ("mptr", "<u8"),
        ("data_len", "<u4"),
        ("dptr_rsvd", "<u4"),
        ("dptr2", "<u8"),
        ("cdw10", "<u4"),
        ("cdw11", "<u4"),
        ("cdw12", "<u4"),
        ("cdw13", "<u4"),
        ("cdw14", "<u4"),
        ("cdw15", "<u4"),
    ]
)
assert SUBMISSION.itemsize == 64, SUBMISSION.itemsize

# 16-byte completion entry. Dword 1 (command specific in NVMe) carries the length of the
# data returned after the entry by the read that fetches it.
COMPLETION = np.dtype(
    [
        ("result", "<u4"),
        ("data_len", "<u4"),
        ("sq_head", "<u2"),
        ("sq_id", "<u2"),
        ("cid", "<u2"),
        ("status", "<u2"),
    ]
)
assert COMPLETION.itemsize == 16, COMPLETION.itemsize

NSID_ALL = 0xFFFFFFFF

# JSON payloads: nesting deeper than this is refused (no command's payload goes past 4), and so
# is any number that does not fit 64 bits or is not finite, before a handler sees it.
MAX_JSON_DEPTH = 32
JSON_INT_BOUND = 1 << 64


class Opcode(enum.IntEnum):
    """Admin opcodes: Get Log Page and Identify are NVMe's own; the rest are vendor specific
    (C0h-FFh)."""

    GET_LOG_PAGE = 0x02
    IDENTIFY = 0x06
    SET_FEATURES = 0x09
    GET_FEATURES = 0x0A
    VENDOR_IDENTIFY = 0xC0
    CREATE_NAMESPACE = 0xC1
    DELETE_NAMESPACE = 0xC2
    BEGIN_STEP = 0xC4
    COMMIT_STEP = 0xC5
    ABORT_STEP = 0xC6
    SET_HYPERPARAMETERS = 0xC7
    NAMESPACE_STATISTICS = 0xC8
    FLUSH = 0xC9
    SCRUB = 0xCA
    SNAPSHOT_CREATE = 0xCB
    SNAPSHOT_DELETE = 0xCC
    SNAPSHOT_ROLLBACK = 0xCD
    SNAPSHOT_CLONE = 0xCE
    EXPORT = 0xCF
    INJECT_ERROR = 0xD0
    CMB_WRITE = 0xD1
    CMB_READ = 0xD2
    ARCHIVE = 0xD4  # a snapshot uploaded to an object store, as a job (docs/tiers.md)
    ARCHIVE_LIST = 0xD5  # the complete versions archived under s3://BUCKET/PREFIX
    REVERT_STEP = 0xD6  # the last committed step undone: a group commit's recovery (docs/architecture.md)


class IoOpcode(enum.IntEnum):
    """NVMe's I/O opcodes, standing for the data path: writes and reads of the tensor files
    (and of an nvm namespace's data file)."""

    WRITE = 0x01
    READ = 0x02


class IdentifyCns(enum.IntEnum):
    NAMESPACE = 0x00
    CONTROLLER = 0x01
    ACTIVE_NAMESPACES = 0x02


class SubmissionError(Exception):
    """A write to the control file that is not a well-formed command (errno channel)."""


@dataclasses.dataclass(frozen=True)
class Command:
    opcode: int
    cid: int
    nsid: int
    cdw10: int
    cdw11: int
    cdw12: int
    cdw13: int
    cdw14: int
    cdw15: int
    flags: int
    payload: bytes
    # Dwords 2-4, which the vendor commands leave reserved; the Computational Programs
    # command set's Execute Program uses them (protocol/computational.py). CDW4 is the low
    # dword of `mptr`.
    cdw2: int = 0
    cdw3: int = 0
    cdw4: int = 0

    @property
    def cdw10_11(self) -> int:
        return self.cdw10 | (self.cdw11 << 32)

    @property
    def cdw12_13_f64(self) -> float:
        return struct.unpack("<d", struct.pack("<II", self.cdw12, self.cdw13))[0]

    @functools.cached_property
    def json(self) -> Any:
        """The payload decoded by decode_json_payload (once per command)."""
        return decode_json_payload(self.payload)


@dataclasses.dataclass(frozen=True)
class Completion:
    cid: int
    status: Status | int
    result: int = 0
    data: bytes = b""

    @property
    def status_field(self) -> int:
        value = int(self.status)
        sct, sc = (value >> 8) & 0x7, value & 0xFF
        dnr = 0 if value == 0 else 1
        return (sc << 1) | (sct << 9) | (dnr << 15)

    def encode(self) -> bytes:
        entry = np.zeros((), dtype=COMPLETION)
        entry["result"] = self.result & 0xFFFFFFFF
        entry["data_len"] = len(self.data)
        entry["cid"] = self.cid
        entry["status"] = self.status_field
        return entry.tobytes() + self.data


def submission_length(prefix: bytes) -> int:
    """Total bytes (entry + payload) of the command that `prefix` (>= 64 bytes) starts."""
    entry = np.frombuffer(prefix, dtype=SUBMISSION, count=1)[0]
    data_len = int(entry["data_len"])
    if data_len > MAX_PAYLOAD_BYTES:
        raise SubmissionError(f"payload of {data_len} bytes exceeds {MAX_PAYLOAD_BYTES}")
    return SUBMISSION.itemsize + data_len


def _invalid_json(message: str) -> DeviceError:
    return DeviceError(Status.INVALID_FIELD, f"payload is not valid JSON: {message}")


def _no_constant(name: str) -> Any:
    raise _invalid_json(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _invalid_json(f"{text[:40]} does not fit a 64-bit float")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 21:  # more digits than any 64-bit value (and no 4300-digit conversion)
        raise _invalid_json(f"integer {text[:40]}... does not fit 64 bits")
    value = int(text)
    if not -JSON_INT_BOUND < value < JSON_INT_BOUND:
        raise _invalid_json(f"integer {text} does not fit 64 bits")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        counts: dict[str, int] = {}
        for key, _ in pairs:
            counts[key] = counts.get(key, 0) + 1
        twice = next(key for key, count in counts.items() if count > 1)
        raise _invalid_json(f"key {twice[:80]!r} appears twice in one object")
    return value


# +1 for an opening bracket, -1 for a closing one, by byte value.
_NESTING = np.zeros(256, np.int8)
_NESTING[list(b"[{")] = 1
_NESTING[list(b"]}")] = -1
_QUOTE = ord('"')
_DEPTH_CHUNK = 1 << 20  # bytes counted at a time: a few MiB of scratch at most


def _depth(payload: bytes) -> int:
    """How deeply JSON text that json.loads accepted nests lists and objects, counted over its
    brackets outside strings in C (numpy), a chunk at a time. In such text every backslash
    starts a two-character escape, so once escaped backslashes and quotes are gone, each quote
    left opens or closes a string. The decoder gave up past about 1000 levels, so int16 holds
    every level."""
    text = payload.replace(b"\\\\", b"").replace(b'\\"', b"")
    deepest = depth = inside = 0
    for start in range(0, len(text), _DEPTH_CHUNK):
        chunk = np.frombuffer(text, np.uint8, count=min(_DEPTH_CHUNK, len(text) - start), offset=start)
        quotes = np.cumsum(chunk == _QUOTE, dtype=np.uint8)  # wraps, but keeps the parity
        outside = ((quotes + inside) & 1) == 0
        levels = np.cumsum(np.where(outside, _NESTING[chunk], 0), dtype=np.int16)
        deepest = max(deepest, depth + int(levels.max()))
        depth += int(levels[-1])
        inside = (inside + int(quotes[-1])) & 1
    return deepest


def decode_json_payload(payload: bytes) -> Any:
    """A command's JSON payload, or INVALID_FIELD: not UTF-8, not JSON, nested past
    MAX_JSON_DEPTH, a key twice in one object, NaN or Infinity, or a number that does not fit
    64 bits. What the value must look like is each command's own check."""
    try:
        text = payload.decode()
    except UnicodeDecodeError as exc:
        raise _invalid_json(str(exc)) from None
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float,
                           parse_int=_bounded_int, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise _invalid_json(str(exc)) from None
    except RecursionError:  # the decoder nests one call per level
        raise _invalid_json(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    # Text with no more opening brackets than the limit cannot nest past it: a command's
    # payload mostly (a CMB_WRITE's transfers), which then skips the count's numpy calls.
    if payload.count(b"[") + payload.count(b"{") > MAX_JSON_DEPTH and _depth(payload) > MAX_JSON_DEPTH:
        raise _invalid_json(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def decode_submission(raw: bytes) -> Command:
    """Decode one submission; a malformed one raises SubmissionError (never a state change)."""
    if len(raw) < SUBMISSION.itemsize:
        raise SubmissionError(f"submission of {len(raw)} bytes is shorter than 64")
    expected = submission_length(raw[: SUBMISSION.itemsize])
    if len(raw) != expected:
        raise SubmissionError(f"submission is {len(raw)} bytes; its header announces {expected}")
    entry = np.frombuffer(raw, dtype=SUBMISSION, count=1)[0]
    return Command(
        opcode=int(entry["opcode"]),
        cid=int(entry["cid"]),
        nsid=int(entry["nsid"]),
        cdw10=int(entry["cdw10"]),
        cdw11=int(entry["cdw11"]),
        cdw12=int(entry["cdw12"]),
        cdw13=int(entry["cdw13"]),
        cdw14=int(entry["cdw14"]),
        cdw15=int(entry["cdw15"]),
        flags=int(entry["flags"]),
        payload=bytes(raw[SUBMISSION.itemsize :]),
        cdw2=int(entry["cdw2"]),
        cdw3=int(entry["cdw3"]),
        cdw4=int(entry["mptr"]) & 0xFFFFFFFF,
    )


def encode_submission(
    opcode: int,
    *,
    cid: int = 0,
    nsid: int = 0,
    cdw10: int = 0,
    cdw11: int = 0,
    cdw12: int = 0,
    cdw13: int = 0,
    cdw14: int = 0,
    cdw15: int = 0,
    payload: bytes = b"",
) -> bytes:
    entry = np.zeros((), dtype=SUBMISSION)
    entry["opcode"] = opcode
    entry["cid"] = cid
    entry["nsid"] = nsid
    entry["data_len"] = len(payload)
    for name, value in (("cdw10", cdw10), ("cdw11", cdw11), ("cdw12", cdw12),
                        ("cdw13", cdw13), ("cdw14", cdw14), ("cdw15", cdw15)):
        entry[name] = value
    return entry.tobytes() + payload


def f64_to_dwords(value: float) -> tuple[int, int]:
    low, high = struct.unpack("<II", struct.pack("<d", value))
    return low, high


def decode_completion(raw: bytes) -> tuple[Completion, int]:
    """A completion entry and the number of data bytes announced to follow it."""
    if len(raw) < COMPLETION.itemsize:
        raise SubmissionError(f"completion of {len(raw)} bytes is shorter than 16")
    entry = np.frombuffer(raw, dtype=COMPLETION, count=1)[0]
    field = int(entry["status"])
    sc, sct = (field >> 1) & 0xFF, (field >> 9) & 0x7
    status = Status.from_field(sct, sc)
    data_len = int(entry["data_len"])
    data = bytes(raw[COMPLETION.itemsize : COMPLETION.itemsize + data_len])
    return Completion(int(entry["cid"]), status, int(entry["result"]), data), data_len


def status_error(completion: Completion) -> DeviceError:
    """The DeviceError a client raises for a failed completion."""
    status = completion.status if isinstance(completion.status, Status) else Status.INTERNAL_ERROR
    message = completion.data.decode(errors="replace") if completion.data else status.name
    return DeviceError(status, message)
