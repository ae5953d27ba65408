"""Validation of client-supplied names (namespaces, tensors) and of the device's limits."""
from __future__ import annotations

import re

from ..protocol.status import DeviceError, Status

# One path component of a safe alphabet. The first character may not be '.', which keeps
# '.', '..' and hidden names out; '/' and NUL can never match.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")

MAX_NAME_BYTES = 128
MAX_NAMESPACES = 1024
MAX_TENSORS_PER_NAMESPACE = 65536
MAX_TENSOR_ELEMENTS = 1 << 40
# Hyperparameter groups (torch param groups) per namespace; each is 40 bytes of superblock.
MAX_GROUPS = 1024
# Dimensions of a tensor's recorded shape (what the export writes; torch allows 64, models use
# a handful).
MAX_SHAPE_DIMS = 16


def check_name(name: object, what: str) -> str:
    """Return `name` if it is a valid namespace or tensor name, else raise INVALID_NAME."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        shown = repr(name)[:80]
        raise DeviceError(
            Status.INVALID_NAME,
            f"invalid {what} name {shown}: use 1-{MAX_NAME_BYTES} characters of "
            "[A-Za-z0-9_.-], not starting with '.'",
        )
    return name
