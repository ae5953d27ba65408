"""Named network link profiles for the storage server, and a command's modeled wire time on one.

A command crosses the network as a request (the submission and the data sent to the server)
and a response (the completion and the data sent back). The request must arrive before the
response can leave, so the two directions add:

    direction_ns = latency_ns + messages x message_ns
                   + (payload + messages x message_bytes) / bytes_per_s
    wire_ns      = in_ns + out_ns

`bytes_per_s` is the payload rate of one direction (the link is full duplex) after the
per-packet framing of the link's MTU (ethernet_payload_bytes_per_s), so only the headers a
message adds once (a data PDU's header, an RDMA write's RETH) are in `message_bytes`.
Integer nanoseconds, rounded up, as in model/timing.py. docs/timing-model.md cites each figure.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from ..protocol.status import DeviceError, Status
from .profiles import load_named

NS_PER_S = 1_000_000_000

DEFAULT_LINK = "loopback"


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def ethernet_payload_bytes_per_s(gbit_per_s: float, payload_per_packet: int, overhead_per_packet: int) -> int:
    """Payload rate of one direction of a link whose MAC carries `gbit_per_s` when each packet
    carries `payload_per_packet` bytes and costs `overhead_per_packet` more on the wire
    (preamble, headers, checksums, inter-frame gap)."""
    return int(gbit_per_s * 1e9 / 8 * payload_per_packet / (payload_per_packet + overhead_per_packet))


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """One network link between a trainer node and the server: each NIC and the path between."""

    name: str
    summary: str
    bytes_per_s: int  # payload per direction, after per-packet framing; full duplex
    latency_ns: int  # one way: a message's first byte from the sender's memory to the receiver's
    message_ns: int = 0  # per message, beyond the latency: the NIC's (or the stack's) work on it
    message_bytes: int = 0  # per message: the transport headers it adds once
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False)

    def validate(self) -> "LinkProfile":
        if not self.name or not isinstance(self.name, str):
            raise DeviceError(Status.INVALID_FIELD, "a link profile needs a name")
        for field, minimum in (("bytes_per_s", 1), ("latency_ns", 0), ("message_ns", 0), ("message_bytes", 0)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                kind = "a positive integer" if minimum else "an integer >= 0"
                raise DeviceError(Status.INVALID_FIELD,
                                  f"link {self.name!r}: {field} must be {kind}, got {value!r}")
        return self

    def to_json(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "sources"}
        return fields | {"sources": dict(self.sources)}

    @classmethod
    def from_json(cls, value: Any) -> "LinkProfile":
        """A link from a JSON object with LinkProfile's fields (as to_json writes them)."""
        if not isinstance(value, dict):
            raise DeviceError(Status.INVALID_FIELD, "a link profile must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise DeviceError(Status.INVALID_FIELD, f"unknown link field(s): {', '.join(unknown)}")
        given = dict(value)
        given.setdefault("summary", "user link")
        try:
            link = cls(**given)
        except TypeError as exc:
            raise DeviceError(Status.INVALID_FIELD, f"link profile: {exc}") from None
        return link.validate()


@dataclasses.dataclass(frozen=True)
class WireTiming:
    """The modeled wire time of one command (or one step's stream), each direction apart."""

    in_ns: int  # the request: trainer node to server
    out_ns: int  # the response: server to trainer node
    in_transfer_ns: int  # of in_ns, the time the bytes occupy the link (what others queue behind)
    out_transfer_ns: int

    @property
    def wire_ns(self) -> int:
        return self.in_ns + self.out_ns


class LinkModel:
    """Modeled wire time on a link profile."""

    def __init__(self, link: LinkProfile) -> None:
        self.link = link.validate()

    @classmethod
    def named(cls, name_or_path: str) -> "LinkModel":
        return cls(load_link(name_or_path))

    def transfer_ns(self, nbytes: int, messages: int = 0) -> int:
        """The time `nbytes` of payload in `messages` messages occupy one direction."""
        total = nbytes + messages * self.link.message_bytes
        return _ceil_div(total * NS_PER_S, self.link.bytes_per_s) if total else 0

    def direction_ns(self, nbytes: int, messages: int) -> int:
        """One direction: the latency once (messages stream back to back behind the first),
        each message's overhead, and the bytes."""
        if not nbytes and not messages:
            return 0
        return self.link.latency_ns + messages * self.link.message_ns + self.transfer_ns(nbytes, messages)

    def command(self, net_in: int = 0, net_out: int = 0, *, messages_in: int = 1,
                messages_out: int = 1) -> WireTiming:
        """A command that carries `net_in` payload bytes to the server in `messages_in` messages
        and `net_out` back in `messages_out`. Every command is at least one message each way
        (its submission, its completion)."""
        values = (net_in, net_out, messages_in, messages_out)
        if min(values) < 0 or not all(type(value) is int for value in values):
            raise ValueError(f"wire traffic must be integers >= 0, got {values}")
        messages_in, messages_out = max(1, messages_in), max(1, messages_out)
        return WireTiming(self.direction_ns(net_in, messages_in), self.direction_ns(net_out, messages_out),
                          self.transfer_ns(net_in, messages_in), self.transfer_ns(net_out, messages_out))


def wire_ns(link: LinkProfile, net_in: int = 0, net_out: int = 0, *, messages_in: int = 1,
            messages_out: int = 1) -> int:
    """A command's modeled wire time on `link`: both directions, each latency + bytes / rate."""
    return LinkModel(link).command(net_in, net_out, messages_in=messages_in, messages_out=messages_out).wire_ns


# ---------------------------------------------------------------------- the built-in links

# Per-packet bytes beyond the payload, on the wire:
# RoCEv2 over Ethernet: preamble+SFD 8, Ethernet header 14, IPv4 20, UDP 8, BTH 12, ICRC 4,
# FCS 4, inter-frame gap 12.
ROCE_PACKET_OVERHEAD = 8 + 14 + 20 + 8 + 12 + 4 + 4 + 12
# InfiniBand: LRH 8, BTH 12, ICRC 4, VCRC 2 (the 64b/66b coding is already out of the data rate).
IB_PACKET_OVERHEAD = 8 + 12 + 4 + 2
# TCP over Ethernet at MTU 1500 with timestamps: 1448 payload; preamble+SFD 8, header 14,
# FCS 4, gap 12, IPv4 20, TCP 20 + 12 of options.
TCP_MSS = 1448
TCP_PACKET_OVERHEAD = 8 + 14 + 4 + 12 + 20 + 32
RDMA_MTU = 4096
RETH_BYTES = 16  # an RDMA WRITE's (or READ's) extended header, once per message
NVME_TCP_DATA_PDU_HEADER = 24  # H2CData / C2HData: 8-byte common header + 16 PDU-specific

CONNECTX6_RATE = ("NVIDIA ConnectX-6 user manual / product brief: 215 million messages per second "
                  "(~4.7 ns per message)")
SWITCH_ESTIMATE = "estimate: plus ~0.3 us for one switch hop and the host PCIe on both ends"
TCP_STACK_ESTIMATE = ("estimate: one send()/recv() pair of the kernel TCP stack per PDU, ~1 us "
                      "(the per-byte copy is in the bandwidth)")

LINKS: dict[str, LinkProfile] = {
    link.name: link.validate()
    for link in (
        LinkProfile(
            "100g-rdma",
            "100 Gb/s RoCEv2, ConnectX-6 Dx class NIC on both ends, one switch, 4 KiB RDMA MTU",
            bytes_per_s=ethernet_payload_bytes_per_s(100, RDMA_MTU, ROCE_PACKET_OVERHEAD),
            latency_ns=1_100,
            message_ns=5,
            message_bytes=RETH_BYTES,
            sources={
                "bytes_per_s": "100GbE MAC rate; RoCEv2 packets of 4096 payload bytes and 82 of framing "
                               "(Ethernet, IPv4, UDP, BTH, ICRC, FCS, preamble, gap)",
                "latency_ns": "NVIDIA ConnectX-6 EN product brief: sub 0.8 us latency (Ethernet); "
                              + SWITCH_ESTIMATE,
                "message_ns": CONNECTX6_RATE,
                "message_bytes": "InfiniBand Architecture spec: RETH, 16 bytes, once per RDMA message",
            },
        ),
        LinkProfile(
            "200g-rdma",
            "200 Gb/s InfiniBand HDR, ConnectX-6 VPI class NIC on both ends, one switch, 4 KiB MTU",
            bytes_per_s=ethernet_payload_bytes_per_s(200, RDMA_MTU, IB_PACKET_OVERHEAD),
            latency_ns=900,
            message_ns=5,
            message_bytes=RETH_BYTES,
            sources={
                "bytes_per_s": "InfiniBand HDR: 4 lanes x 53.125 Gb/s, 64b/66b coding, 200 Gb/s of data; "
                               "packets of 4096 payload bytes and 26 of headers (LRH, BTH, ICRC, VCRC)",
                "latency_ns": "NVIDIA ConnectX-6 VPI user manual: sub-600 ns latency; " + SWITCH_ESTIMATE,
                "message_ns": CONNECTX6_RATE,
                "message_bytes": "InfiniBand Architecture spec: RETH, 16 bytes, once per RDMA message",
            },
        ),
        LinkProfile(
            "25gbe-tcp",
            "25 GbE, kernel TCP (NVMe/TCP-style PDUs), MTU 1500, one switch",
            bytes_per_s=ethernet_payload_bytes_per_s(25, TCP_MSS, TCP_PACKET_OVERHEAD),
            latency_ns=12_000,
            message_ns=1_000,
            message_bytes=NVME_TCP_DATA_PDU_HEADER,
            sources={
                "bytes_per_s": "25GbE MAC rate (IEEE 802.3by); 1448 payload bytes per 1538 on the wire "
                               "(MTU 1500, TCP timestamps)",
                "latency_ns": "estimate: kernel TCP request-response on 25 GbE is ~20-30 us per round trip; "
                              "12 us one way",
                "message_ns": TCP_STACK_ESTIMATE,
                "message_bytes": "NVMe/TCP 1.0: a data PDU's header is 24 bytes (8 common + 16 specific)",
            },
        ),
        LinkProfile(
            "loopback",
            "this machine's loopback: Python on both ends of a TCP socket pair",
            bytes_per_s=3_000_000_000,
            latency_ns=10_000,
            message_ns=1_000,
            message_bytes=NVME_TCP_DATA_PDU_HEADER,
            sources={
                "bytes_per_s": "measured on this machine class (issue 16): a plain TCP socket pair moved "
                               "2.2-4.2 GB/s with 1-4 MiB chunks; 3 GB/s taken",
                "latency_ns": "measured here: a Python 16-byte ping-pong over loopback, ~21 us per round "
                              "trip on the shared 2-core machine",
                "message_ns": TCP_STACK_ESTIMATE,
                "message_bytes": "NVMe/TCP 1.0: a data PDU's header is 24 bytes (8 common + 16 specific)",
            },
        ),
    )
}


def load_link(name_or_path: str | Path) -> LinkProfile:
    """A built-in link by name, or a link from a JSON file (its fields as in to_json)."""
    return load_named(name_or_path, LINKS, LinkProfile.from_json, "link")
