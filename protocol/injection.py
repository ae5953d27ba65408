"""INJECT_ERROR (D0h) as it travels: the action in cdw10 and the queue an injection fails."""
from __future__ import annotations

import enum


class InjectAction(enum.IntEnum):
    """INJECT_ERROR cdw10 bits 7:0."""

    ARM = 0x00
    CORRUPT = 0x01
    CLEAR = 0x02


class Queue(str, enum.Enum):
    """Which queue an injection fails (the payload's "queue"): .admin's commands or the data path."""

    ADMIN = "admin"  # commands through .admin
    IO = "io"  # the data path
