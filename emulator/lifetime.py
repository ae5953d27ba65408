"""The device's lifetime SMART figures (LifetimeCounters) and what each namespace kind's own
counters add to them (SmartShare: one method, each kind's counters say it themselves)."""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol


@dataclasses.dataclass
class LifetimeCounters:
    """Figures over the life of the device; stored under "health" in superblock.json."""

    power_cycles: int = 0
    unsafe_shutdowns: int = 0
    power_on_ns: int = 0
    host_bytes_read: int = 0
    host_bytes_written: int = 0
    host_read_commands: int = 0
    host_write_commands: int = 0
    busy_ns: int = 0
    media_bytes_written: int = 0
    media_errors: int = 0
    error_log_entries: int = 0
    warning_temp_ns: int = 0
    critical_temp_ns: int = 0

    def plus(self, other: "LifetimeCounters") -> "LifetimeCounters":
        return LifetimeCounters(**{
            field.name: getattr(self, field.name) + getattr(other, field.name)
            for field in dataclasses.fields(self)
        })

    @classmethod
    def from_json(cls, stored: dict[str, Any]) -> "LifetimeCounters":
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: int(value) for key, value in stored.items() if key in names})


class SmartShare(Protocol):
    """A namespace's counters, which start at 0 when it is opened."""

    def lifetime_share(self) -> LifetimeCounters:
        """What they add to the device's lifetime figures."""
        ...
