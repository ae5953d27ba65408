"""Named device profiles: the hardware parameters the timing model runs on, with their sources."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from ..protocol.status import DeviceError, Status

T = TypeVar("T")

NS_PER_S = 1_000_000_000
KIB = 1 << 10
GIB = 1 << 30

# Bytes that cross the updater's DRAM per element updated, when nothing else is known: the
# fused kernel's own 28 B (FP16 grad, FP32 master and moments read; the same written, plus
# the FP16 param) and the same bytes again moved by DMA (grad in from the host, state in
# from and out to the NAND, param out), since every DMA lands in or leaves from that DRAM.
DEFAULT_DRAM_BYTES_PER_ELEMENT = 56

DEFAULT_PROFILE = "gen4-arm4"


def pcie_bytes_per_s(gigatransfers: float, lanes: int) -> int:
    """Payload rate of a PCIe link per direction after 128b/130b line coding (Gen3 and later),
    before packet (TLP/DLLP) overhead."""
    return int(gigatransfers * 1e9 * lanes * 128 / 130 / 8)


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """One drive's parameters. Rates are bytes (or elements) per second, times nanoseconds."""

    name: str
    summary: str
    host_link_bytes_per_s: int  # per direction; the link is full duplex
    host_link_latency_ns: int  # per command: submission fetch and completion post
    nand_channels: int
    channel_bytes_per_s: int  # NAND bus of one channel
    dies_per_channel: int
    planes_per_die: int
    page_bytes: int  # one plane's page; a multi-plane operation moves planes x page
    read_latency_ns: int  # tR: array to page register
    program_latency_ns: int  # tPROG: page register to array
    dram_bytes: int  # the updater's working memory
    dram_bytes_per_s: int
    updater: str  # what runs Adam: "4 ARM cores", "FPGA"
    updater_units: int
    unit_elements_per_s: int  # Adam elements/s of one core (or one FPGA kernel)
    # A link between the updater and the NAND side that media traffic must cross (the
    # SmartSSD's FPGA reaches its SSD over an internal PCIe peer-to-peer path); 0: none.
    internal_link_bytes_per_s: int = 0
    dram_bytes_per_element: int = DEFAULT_DRAM_BYTES_PER_ELEMENT
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    # ------------------------------------------------------------------ derived rates

    @property
    def die_read_bytes_per_s(self) -> int:
        """One die reading multi-plane pages back to back: planes x page per tR."""
        return self.planes_per_die * self.page_bytes * NS_PER_S // self.read_latency_ns

    @property
    def die_program_bytes_per_s(self) -> int:
        return self.planes_per_die * self.page_bytes * NS_PER_S // self.program_latency_ns

    def _media_rate(self, die_rate: int) -> int:
        # A channel moves what its dies produce, up to its bus; channels work in parallel.
        rate = self.nand_channels * min(self.channel_bytes_per_s, self.dies_per_channel * die_rate)
        if self.internal_link_bytes_per_s:
            rate = min(rate, self.internal_link_bytes_per_s)
        return rate

    @property
    def media_read_bytes_per_s(self) -> int:
        return self._media_rate(self.die_read_bytes_per_s)

    @property
    def media_write_bytes_per_s(self) -> int:
        return self._media_rate(self.die_program_bytes_per_s)

    @property
    def adam_elements_per_s(self) -> int:
        """The updater's Adam rate: its units' arithmetic, or its DRAM bandwidth, whichever
        binds first."""
        return min(self.updater_units * self.unit_elements_per_s,
                   self.dram_bytes_per_s // self.dram_bytes_per_element)

    @property
    def chunk_bytes(self) -> int:
        """The pipeline's unit: one multi-plane page, the smallest piece the NAND side moves
        (double-buffered in DRAM, so at most half of it)."""
        return min(self.planes_per_die * self.page_bytes, self.dram_bytes // 2)

    # ------------------------------------------------------------------ checks, encoding

    def validate(self) -> "DeviceProfile":
        """Every rate, count and size positive (a zero would divide by zero in the model)."""
        if not self.name or not isinstance(self.name, str):
            raise DeviceError(Status.INVALID_FIELD, "a profile needs a name")
        positive = ("host_link_bytes_per_s", "nand_channels", "channel_bytes_per_s",
                    "dies_per_channel", "planes_per_die", "page_bytes", "read_latency_ns",
                    "program_latency_ns", "dram_bytes", "dram_bytes_per_s", "updater_units",
                    "unit_elements_per_s", "dram_bytes_per_element")
        for field in positive:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise DeviceError(Status.INVALID_FIELD,
                                  f"profile {self.name!r}: {field} must be a positive integer, got {value!r}")
        for field in ("host_link_latency_ns", "internal_link_bytes_per_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DeviceError(Status.INVALID_FIELD,
                                  f"profile {self.name!r}: {field} must be an integer >= 0, got {value!r}")
        return self

    def to_json(self) -> dict[str, Any]:
        """The parameters, the rates derived from them, and each parameter's source."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}
        derived = {
            "media_read_bytes_per_s": self.media_read_bytes_per_s,
            "media_write_bytes_per_s": self.media_write_bytes_per_s,
            "adam_elements_per_s": self.adam_elements_per_s,
            "chunk_bytes": self.chunk_bytes,
        }
        return fields | {"derived": derived, "sources": dict(self.sources)}

    @classmethod
    def from_json(cls, value: Any) -> "DeviceProfile":
        """A profile from a JSON object with the fields of DeviceProfile (derived ones ignored)."""
        if not isinstance(value, dict):
            raise DeviceError(Status.INVALID_FIELD, "a profile must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names - {"derived"})
        if unknown:
            raise DeviceError(Status.INVALID_FIELD, f"unknown profile field(s): {', '.join(unknown)}")
        given = {k: v for k, v in value.items() if k in names}
        given.setdefault("summary", "user profile")
        try:
            profile = cls(**given)
        except TypeError as exc:
            raise DeviceError(Status.INVALID_FIELD, f"profile: {exc}") from None
        return profile.validate()


def _ssd(name: str, summary: str, **fields: Any) -> DeviceProfile:
    return DeviceProfile(name=name, summary=summary, **fields).validate()


# Sources are cited per parameter; "estimate" marks a value no public document gives, with the
# reasoning. docs/timing-model.md has the full table with links.
SAMSUNG_V6 = "Samsung 6th-gen V-NAND announcement, Aug 2019: write < 450 us, read < 45 us"
SAMSUNG_V5 = "Samsung 5th-gen V-NAND announcement, Jul 2018: Toggle DDR 4.0 1.4 Gb/s, write 500 us, read 50 us"
LATENCY_ESTIMATE = "estimate: one PCIe round trip to fetch the 64-byte entry plus the completion post, ~1 us"
PAGE_ESTIMATE = "estimate: 16 KiB pages, 4 planes, typical of TLC 3D NAND of that generation"
CORE_ESTIMATE = ("estimate: ~0.1 G elements/s per Cortex-R class core (~1.5 GHz, ~15 cycles per fused "
                 "Adam element); the x86 scalar kernel here does ~0.25 G/s per core at ~2.5 GHz")

PROFILES: dict[str, DeviceProfile] = {
    p.name: p
    for p in (
        _ssd(
            "gen4-arm4",
            "PCIe Gen4 x4 drive, 4 ARM controller cores run Adam (PM9A3-class ratings)",
            host_link_bytes_per_s=pcie_bytes_per_s(16, 4),
            host_link_latency_ns=1_000,
            nand_channels=8,
            channel_bytes_per_s=1_400_000_000,
            dies_per_channel=3,
            planes_per_die=4,
            page_bytes=16 * KIB,
            read_latency_ns=45_000,
            program_latency_ns=450_000,
            dram_bytes=4 * GIB,
            dram_bytes_per_s=12_800_000_000,
            updater="4 ARM cores",
            updater_units=4,
            unit_elements_per_s=100_000_000,
            sources={
                "host_link_bytes_per_s": "PCIe 4.0: 16 GT/s per lane, 128b/130b coding, x4",
                "host_link_latency_ns": LATENCY_ESTIMATE,
                "nand_channels": "estimate: 8 channels, the usual count of Gen4 enterprise controllers",
                "channel_bytes_per_s": "Toggle DDR 4.0 at 1.4 Gb/s per pin, 8-bit bus (" + SAMSUNG_V5 + ")",
                "dies_per_channel": "estimate: chosen so the modeled sequential write (3.49 GB/s) matches "
                                    "PM9A3 U.2's 3.5 GB/s rating (heise.de, May 2020)",
                "planes_per_die": PAGE_ESTIMATE,
                "page_bytes": PAGE_ESTIMATE,
                "read_latency_ns": SAMSUNG_V6,
                "program_latency_ns": SAMSUNG_V6,
                "dram_bytes": "estimate: 1 GB of DRAM per TB of flash, 3.84 TB",
                "dram_bytes_per_s": "estimate: DDR4-3200 on a 32-bit bus",
                "unit_elements_per_s": CORE_ESTIMATE,
            },
        ),
        _ssd(
            "gen5-arm8",
            "PCIe Gen5 x4 drive, 8 ARM controller cores run Adam (PM1743-class ratings)",
            host_link_bytes_per_s=pcie_bytes_per_s(32, 4),
            host_link_latency_ns=1_000,
            nand_channels=8,
            channel_bytes_per_s=2_000_000_000,
            dies_per_channel=6,
            planes_per_die=4,
            page_bytes=16 * KIB,
            read_latency_ns=45_000,
            program_latency_ns=450_000,
            dram_bytes=8 * GIB,
            dram_bytes_per_s=25_600_000_000,
            updater="8 ARM cores",
            updater_units=8,
            unit_elements_per_s=100_000_000,
            sources={
                "host_link_bytes_per_s": "PCIe 5.0: 32 GT/s per lane, 128b/130b coding, x4",
                "host_link_latency_ns": LATENCY_ESTIMATE,
                "nand_channels": "estimate: 8 channels",
                "channel_bytes_per_s": "estimate: 2.0 Gb/s per pin (Toggle DDR 5.0 / ONFI 5.0 class), 8-bit bus",
                "dies_per_channel": "estimate: chosen so the modeled sequential write (6.99 GB/s) covers "
                                    "PM1743's 6.6 GB/s rating (Samsung announcement, Dec 2021)",
                "planes_per_die": PAGE_ESTIMATE,
                "page_bytes": PAGE_ESTIMATE,
                "read_latency_ns": SAMSUNG_V6 + " (PM1743 uses 6th-gen V-NAND)",
                "program_latency_ns": SAMSUNG_V6,
                "dram_bytes": "estimate: 1 GB of DRAM per TB of flash, 7.68 TB",
                "dram_bytes_per_s": "estimate: DDR4-3200 on a 64-bit bus",
                "unit_elements_per_s": CORE_ESTIMATE,
            },
        ),
        _ssd(
            "smartssd-fpga",
            "SmartSSD-like: PCIe Gen3 x4, a Kintex UltraScale+ KU15P FPGA runs Adam beside a "
            "Gen3 enterprise SSD (Smart-Infinity's setting)",
            host_link_bytes_per_s=pcie_bytes_per_s(8, 4),
            host_link_latency_ns=1_000,
            nand_channels=8,
            channel_bytes_per_s=1_400_000_000,
            dies_per_channel=2,
            planes_per_die=4,
            page_bytes=16 * KIB,
            read_latency_ns=50_000,
            program_latency_ns=500_000,
            dram_bytes=4 * GIB,
            dram_bytes_per_s=19_200_000_000,
            updater="FPGA (KU15P)",
            updater_units=1,
            unit_elements_per_s=570_000_000,
            internal_link_bytes_per_s=3_250_000_000,
            sources={
                "host_link_bytes_per_s": "PCIe 3.0: 8 GT/s per lane, 128b/130b coding, x4 (SmartSSD is Gen3 x4)",
                "host_link_latency_ns": LATENCY_ESTIMATE,
                "nand_channels": "estimate: 8 channels",
                "channel_bytes_per_s": SAMSUNG_V5,
                "dies_per_channel": "estimate: chosen so the modeled sequential write (2.10 GB/s) matches "
                                    "a Gen3 enterprise SSD (PM983 3.84 TB: 2.0-2.1 GB/s write)",
                "planes_per_die": PAGE_ESTIMATE,
                "page_bytes": PAGE_ESTIMATE,
                "read_latency_ns": SAMSUNG_V5,
                "program_latency_ns": SAMSUNG_V5,
                "dram_bytes": "SmartSSD: 4 GB DDR4 attached to the FPGA (AnandTech, Nov 2020)",
                "dram_bytes_per_s": "estimate: DDR4-2400 on a 64-bit bus",
                "unit_elements_per_s": "estimate: Smart-Infinity's HLS Adam kernel (AIS-SNU/Smart-Infinity, "
                                       "adam.cpp: 16 FP32 lanes, 7 pipelined loops per tile) at ~250 MHz",
                "internal_link_bytes_per_s": "Xilinx Vitis p2p_bandwidth example on the Samsung SmartSSD "
                                             "platform: FPGA-SSD peer-to-peer 3250 MB/s",
            },
        ),
    )
}


def load_named(name_or_path: str | Path, built_in: Mapping[str, T], from_json: Callable[[Any], T], what: str) -> T:
    """A built-in `what` (a profile, a link) by name, or one read from a JSON file of its fields
    (as its to_json writes them); INVALID_FIELD for anything else."""
    text = str(name_or_path)
    found = built_in.get(text)
    if found is not None:
        return found
    path = Path(text)
    if path.suffix == ".json" and path.is_file():
        try:
            value = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DeviceError(Status.INVALID_FIELD, f"{what} file {path}: {exc}") from None
        return from_json(value)
    raise DeviceError(
        Status.INVALID_FIELD,
        f"unknown {what} {text!r} (built in: {', '.join(built_in)}; or a .json file of {what} fields)",
    )


def load_profile(name_or_path: str | Path) -> DeviceProfile:
    """A built-in profile by name, or a profile from a JSON file (its fields as in to_json)."""
    return load_named(name_or_path, PROFILES, DeviceProfile.from_json, "profile")
