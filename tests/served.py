"""The tests' view of cossd.harness.served (a device served by `cossd serve` in a process of its own, and its token file): the names the tests use."""
from __future__ import annotations

from cossd.harness.served import ServedDevice, write_token

__all__ = ["ServedDevice", "write_token"]
