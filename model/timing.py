"""The device timing model: modeled device time of a command from the bytes and elements it moves.

A command's work runs on four resources of the drive: the host link inbound (host to
device), the host link outbound, the NAND media (reads and writes share the channels and
dies) and the updater (the cores or FPGA that run Adam). They form a pipeline: the work is
cut into chunks (one multi-plane page each, see DeviceProfile.chunk_bytes), and while one
chunk is on the media the one before it is being updated and the one after it is still
crossing the link. With n equal chunks and per-resource busy times s_i,

    device_ns = fixed_ns + (sum(s_i) + (n - 1) * max(s_i)) / n

which is sum(s_i) for a single chunk (no overlap) and tends to max(s_i) (the bottleneck)
for many. What cannot overlap is fixed: one host link latency per command, one tR before
the first page read reaches the bus, one tPROG per flush (the last program must finish).
A write completes once its data is in the device's DRAM (as on a drive with power-loss
protection), so tPROG shows only through the write bandwidth and in flushes.
docs/timing-model.md derives each term.
"""
from __future__ import annotations

import dataclasses
import math

from .profiles import NS_PER_S, DeviceProfile, load_profile

TRAFFIC_FIELDS = ("host_in", "host_out", "media_read", "media_write", "elements", "flushes")


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def transfer_ns(nbytes: int, bytes_per_s: int) -> int:
    """Nanoseconds to move `nbytes` at `bytes_per_s`, rounded up."""
    return _ceil_div(nbytes * NS_PER_S, bytes_per_s) if nbytes else 0


def pipeline_ns(stages: list[int], chunks: int) -> int:
    """Time of `chunks` equal chunks flowing through `stages` (each a total busy time)."""
    busy = [stage for stage in stages if stage]
    if not busy:
        return 0
    chunks = max(1, chunks)
    return _ceil_div(sum(busy) + (chunks - 1) * max(busy), chunks)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What a command (or a whole step) moves: bytes over the host link each way, bytes read
    from and written to the media, Adam elements updated, flushes."""

    host_in: int = 0
    host_out: int = 0
    media_read: int = 0
    media_write: int = 0
    elements: int = 0
    flushes: int = 0

    def __post_init__(self) -> None:
        values = (self.host_in, self.host_out, self.media_read, self.media_write, self.elements,
                  self.flushes)
        if min(values) < 0 or not all(type(value) is int for value in values):
            raise ValueError(f"traffic must be integers >= 0, got {self}")

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(*(getattr(self, f) + getattr(other, f) for f in TRAFFIC_FIELDS))

    def scaled(self, factor: int) -> "Traffic":
        return Traffic(*(getattr(self, f) * factor for f in TRAFFIC_FIELDS))

    @property
    def host_link(self) -> int:
        return self.host_in + self.host_out

    def __bool__(self) -> bool:
        return any(getattr(self, f) for f in TRAFFIC_FIELDS)


@dataclasses.dataclass(frozen=True)
class Timing:
    """The modeled time of one piece of work, and the busy time of each resource in it."""

    host_in_ns: int
    host_out_ns: int
    media_ns: int
    compute_ns: int
    fixed_ns: int
    chunks: int
    device_ns: int

    @property
    def bottleneck(self) -> str:
        busy = {"host link in": self.host_in_ns, "host link out": self.host_out_ns,
                "media": self.media_ns, "updater": self.compute_ns}
        name, value = max(busy.items(), key=lambda item: item[1])
        return name if value else "latency"


class TimingModel:
    """Modeled device time for a profile. Integer nanoseconds throughout, so that known
    inputs give exact results."""

    def __init__(self, profile: DeviceProfile, *, adam_elements_per_s: int | None = None) -> None:
        self.profile = profile.validate()
        # The updater's rate; another one models the same drive with Adam elsewhere (the
        # host CPU of ZeRO-Infinity-style offload).
        self.adam_elements_per_s = adam_elements_per_s or profile.adam_elements_per_s

    @classmethod
    def named(cls, name_or_path: str) -> "TimingModel":
        return cls(load_profile(name_or_path))

    # ------------------------------------------------------------------ resources

    def link_ns(self, nbytes: int) -> int:
        """One direction of the host link."""
        return transfer_ns(nbytes, self.profile.host_link_bytes_per_s)

    def media_ns(self, read_bytes: int, write_bytes: int) -> int:
        """Streaming time on the media; reads and writes share channels and dies, so they add."""
        return (transfer_ns(read_bytes, self.profile.media_read_bytes_per_s)
                + transfer_ns(write_bytes, self.profile.media_write_bytes_per_s))

    def compute_ns(self, elements: int) -> int:
        return transfer_ns(elements, self.adam_elements_per_s)

    def fixed_ns(self, traffic: Traffic, *, host_command: bool = True) -> int:
        """The latencies no pipelining hides."""
        profile = self.profile
        return ((profile.host_link_latency_ns if host_command else 0)
                + (profile.read_latency_ns if traffic.media_read else 0)
                + traffic.flushes * profile.program_latency_ns)

    def chunks(self, traffic: Traffic) -> int:
        largest = max(traffic.host_in, traffic.host_out, traffic.media_read, traffic.media_write)
        return max(1, _ceil_div(largest, self.profile.chunk_bytes))

    # ------------------------------------------------------------------ commands

    def command(self, traffic: Traffic, *, host_command: bool = True) -> Timing:
        """Modeled time of one command (or of a whole step modeled as one stream of work).
        `host_command` False: device-internal work, which pays no host link latency."""
        stages = [self.link_ns(traffic.host_in), self.link_ns(traffic.host_out),
                  self.media_ns(traffic.media_read, traffic.media_write),
                  self.compute_ns(traffic.elements)]
        chunks = self.chunks(traffic)
        fixed = self.fixed_ns(traffic, host_command=host_command)
        host_in, host_out, media, compute = stages
        return Timing(host_in, host_out, media, compute, fixed, chunks, fixed + pipeline_ns(stages, chunks))


def state_media_bytes(elements: int, moment_bytes: float = 4) -> int:
    """Bytes of an FP32 master and both moments of `elements` parameters on the media; a
    block-scaled moment's bytes per element include its share of the block scales (fp16
    2.015625, int8 1.015625: model/step_model.py STATE_DTYPE_BYTES), rounded up per moment."""
    return elements * 4 + 2 * math.ceil(elements * moment_bytes)


def step_traffic(elements: int, *, grad_bytes: int = 2, param_bytes: int = 2,
                 moment_bytes: float = 4) -> Traffic:
    """What one optimizer step of `elements` parameters moves on a cossd device, as the
    emulator does it: gradients in and params out over the host link; master (FP32) and both
    moments read from the committed copy and written, with the param, to the shadow copy;
    the params the host reads come from the media too. The commit record is not included
    (it is a superblock: a few bytes per 256K-element block). An FP32 param (which the
    emulator does not offer; `cossd model` does, for Smart-Infinity's setting) is the master
    itself, so no separate param copy is written."""
    state = state_media_bytes(elements, moment_bytes)
    param_copy = elements * param_bytes if param_bytes < 4 else 0
    return Traffic(
        host_in=elements * grad_bytes,
        host_out=elements * param_bytes,
        media_read=state + elements * param_bytes,
        media_write=state + param_copy,
        elements=elements,
    )

