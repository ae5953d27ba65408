"""The wire format of a cossd device: entries, opcodes, status codes, log-page layouts.

What a device and its clients must agree on, declared once: the 64-byte submission and
16-byte completion entries with the opcodes (`entries`), the completion statuses with the
errno each becomes at the file edge and `DeviceError` (`status`), the log-page and
identify layouts (`logpages`), and the fields of Get/Set Features (`features`) and of
INJECT_ERROR (`injection`). Imports nothing of cossd, so a client ships it without the
device's code.
"""

from .entries import COMPLETION, NSID_ALL, SUBMISSION, Completion, IdentifyCns, Opcode
from .logpages import LogId
from .status import STATUS_ERRNO, DeviceError, Status

__all__ = [
    "COMPLETION",
    "Completion",
    "DeviceError",
    "IdentifyCns",
    "LogId",
    "NSID_ALL",
    "Opcode",
    "STATUS_ERRNO",
    "SUBMISSION",
    "Status",
]
