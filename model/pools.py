"""Named memory-pool profiles for the trainer's staging pool (the talk's CXL memory tier), and a copy's modeled time into one.

A save copies a version into the pool once; what bounds that copy on a real pool is its write
bandwidth, plus one access latency to start:

    copy_ns = latency_ns + bytes x 1e9 / bytes_per_s

The pool is emulated in host memory, which is at least as fast as any of these, so a timed
pool can only slow a copy down to its profile's time, never speed it up. docs/timing-model.md
cites each figure.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..protocol.status import DeviceError, Status
from .profiles import load_named

NS_PER_S = 1_000_000_000


@dataclasses.dataclass(frozen=True)
class PoolProfile:
    """One memory pool: how fast a version is copied into it."""

    name: str
    summary: str
    bytes_per_s: int  # sustained copy bandwidth into the pool
    latency_ns: int  # one access before the first byte lands
    sources: dict[str, str] = dataclasses.field(default_factory=dict)

    def copy_ns(self, nbytes: int) -> int:
        """Modeled nanoseconds to copy `nbytes` into the pool (integer, rounded up)."""
        if nbytes < 0:
            raise ValueError(f"bytes must be >= 0, got {nbytes}")
        return self.latency_ns + -(-nbytes * NS_PER_S // self.bytes_per_s)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> "PoolProfile":
        fields = {field.name for field in dataclasses.fields(cls)}
        if not isinstance(value, dict) or set(value) - fields or not {"name", "bytes_per_s", "latency_ns"} <= set(value):
            raise DeviceError(Status.INVALID_FIELD, f"a pool profile is an object of {', '.join(sorted(fields))} "
                                                    "(name, bytes_per_s and latency_ns required)")
        for key in ("bytes_per_s", "latency_ns"):
            number = value[key]
            if not isinstance(number, int) or isinstance(number, bool) or number < (1 if key == "bytes_per_s" else 0):
                raise DeviceError(Status.INVALID_FIELD, f"pool profile {key} must be an integer "
                                                        f"{'> 0' if key == 'bytes_per_s' else '>= 0'}, got {number!r}")
        return cls(name=str(value["name"]), summary=str(value.get("summary", "")), bytes_per_s=value["bytes_per_s"],
                   latency_ns=value["latency_ns"], sources=dict(value.get("sources", {})))


GB = 1_000_000_000
CXL_LATENCY = ("estimate: ~100 ns to local DRAM plus ~150 ns for the CXL controller and link, a "
               "typical figure for a direct-attached CXL 2.0 Type 3 expander")

POOLS: dict[str, PoolProfile] = {
    profile.name: profile
    for profile in (
        PoolProfile("ddr5-channel", "one DDR5-4800 RDIMM channel of host memory", 38_400_000_000, 100,
                    {"bytes_per_s": "DDR5-4800: 4800 MT/s x 8 bytes = 38.4 GB/s peak per channel",
                     "latency_ns": "estimate: ~100 ns to local DRAM"}),
        PoolProfile("cxl-x8", "one CXL 2.0 Type 3 memory expander on PCIe 5.0 x8 (Micron CZ120 class)",
                    36 * GB, 250,
                    {"bytes_per_s": "Micron CZ120 (CXL 2.0, PCIe 5.0 x8): up to 36 GB/s, measured by Micron "
                                    "with MLC at a 2:1 read/write mix on one module",
                     "latency_ns": CXL_LATENCY}),
        PoolProfile("cxl-x8-4way", "four CZ120-class expanders interleaved", 4 * 36 * GB, 250,
                    {"bytes_per_s": "4 x 36 GB/s, the modules interleaved (hardware or NUMA interleave)",
                     "latency_ns": CXL_LATENCY}),
    )
}


def load_pool(name_or_path: str | Path) -> PoolProfile:
    """A built-in pool profile by name, or one from a JSON file (its fields as in to_json)."""
    return load_named(name_or_path, POOLS, PoolProfile.from_json, "pool profile")
