"""The wire format of a cossd device: entries, opcodes, status codes, log-page layouts.

What a device and its clients must agree on, declared once: the 64-byte submission and
16-byte completion entries with the opcodes (`entries`), the completion statuses with the
errno each becomes at the file edge and `DeviceError` (`status`), the log-page and
identify layouts (`logpages`), and the fields of Get/Set Features (`features`) and of
INJECT_ERROR (`injection`), the Computational Programs and Subsystem Local Memory layouts
(`computational`), and the seal (canonical bytes and CRC32C) that the device's archive and the
trainer's tiered checkpointer put on their manifests (`manifest_seal`). Two helpers they
share: the pacing of uploads to an object store (`pacing`) and a rate-limited log for lines
whose number peers decide (`log_limit`). Imports no other layer of cossd (only the root
package's lazy.py), so a client ships it without the device's code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:  # `X as X`: an explicit re-export, so ruff and mypy see what __all__ lists
    from .entries import (
        COMPLETION as COMPLETION,
        NSID_ALL as NSID_ALL,
        SUBMISSION as SUBMISSION,
        Completion as Completion,
        IdentifyCns as IdentifyCns,
        Opcode as Opcode,
    )
    from .logpages import LogId as LogId
    from .status import STATUS_ERRNO as STATUS_ERRNO, DeviceError as DeviceError, Status as Status

# Where each name lives, imported on first use: `from cossd.protocol.status import ...` (the
# command line, the mount daemon's launcher) must not import numpy through `entries`.
_HOMES = {"COMPLETION": ".entries", "Completion": ".entries", "IdentifyCns": ".entries", "NSID_ALL": ".entries",
          "Opcode": ".entries", "SUBMISSION": ".entries", "LogId": ".logpages", "DeviceError": ".status",
          "STATUS_ERRNO": ".status", "Status": ".status"}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
