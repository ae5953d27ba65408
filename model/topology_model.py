"""A storage-server topology's training step: one server with several cossd drives, many trainer
nodes reaching it over a network link profile. The arithmetic behind `cossd model --topology server`."""
from __future__ import annotations

import dataclasses
from typing import Any

from .links import LinkModel, LinkProfile
from .profiles import NS_PER_S, DeviceProfile
from .timing import TimingModel, Traffic, pipeline_ns, step_traffic, transfer_ns

# The data of a command crosses the wire in messages of at most this much (a data PDU or one
# RDMA operation); each pays the link's per-message bytes and work.
MESSAGE_PAYLOAD_BYTES = 1 << 20
# Per node and step: one command carries the gradients in, one the params back (the direct
# client's batch), each a request and a response: four one-way latencies that nothing hides.
LATENCIES_PER_STEP = 4
PARAM_READS = ("all", "shard")


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


@dataclasses.dataclass(frozen=True)
class TopologySetup:
    """A model, its dtypes, the server's drives and NICs, and the trainer nodes."""

    params: int
    compute_s: float
    profile: DeviceProfile
    link: LinkProfile
    drives: int = 1  # the server's drives; the optimizer state is striped evenly over them
    nodes: int = 1  # trainer nodes, each with one NIC of the link profile
    server_nics: int = 1  # the server's NICs of the link profile; the nodes spread over them
    grad_bytes: int = 2
    param_bytes: int = 2
    moment_bytes: float = 4  # per element, block scales included (step_model.STATE_DTYPE_BYTES)
    # "all": every node reads every param each step (data parallel), served from the server's
    # param cache; "shard": each reads its 1/nodes and the nodes all-gather among themselves
    # over their own network (not modeled).
    param_reads: str = "all"
    uplink_bytes_per_s: int = 0  # a PCIe uplink in the server that all drives share; 0: none

    def validate(self) -> "TopologySetup":
        checks = (
            (self.params >= 1, f"params must be at least 1, got {self.params}"),
            (self.compute_s >= 0, f"compute time must be >= 0 s, got {self.compute_s}"),
            (self.drives >= 1, f"drives must be at least 1, got {self.drives}"),
            (self.nodes >= 1, f"nodes must be at least 1, got {self.nodes}"),
            (self.server_nics >= 1, f"server NICs must be at least 1, got {self.server_nics}"),
            (self.param_reads in PARAM_READS, f"param reads must be one of {PARAM_READS}, got {self.param_reads!r}"),
            (self.uplink_bytes_per_s >= 0, f"uplink bandwidth must be >= 0, got {self.uplink_bytes_per_s}"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.profile.validate()
        self.link.validate()
        return self


@dataclasses.dataclass(frozen=True)
class Resource:
    """One resource of the topology: how many there are, and what one of them does per step."""

    name: str
    count: int
    busy_ns: int
    nbytes: int  # bytes through one of them per step (elements, for the drive controller)


def _nic_ns(model: LinkModel, nbytes: int) -> int:
    """Busy time of one NIC direction: the bytes with their messages' headers, and each
    message's work."""
    messages = _ceil_div(nbytes, MESSAGE_PAYLOAD_BYTES)
    return model.transfer_ns(nbytes, messages) + messages * model.link.message_ns


def predict_topology(setup: TopologySetup) -> dict[str, Any]:
    """One training step through the server, modeled as one pipelined stream (the ideal a deep
    queue reaches, as `cossd model` treats a drive): the slowest resource bounds it, plus the
    fill and drain of the others and the latencies nothing hides."""
    setup.validate()
    p, n = setup.params, setup.nodes
    per_drive = _ceil_div(p, setup.drives)
    drive_traffic: Traffic = step_traffic(per_drive, grad_bytes=setup.grad_bytes, param_bytes=setup.param_bytes,
                                          moment_bytes=setup.moment_bytes)
    drive_model = TimingModel(setup.profile)
    drive = drive_model.command(drive_traffic)
    link = LinkModel(setup.link)
    # Gradients: each node sends its shard (reduce-scattered among the nodes beforehand).
    grads_total = p * setup.grad_bytes
    node_out = _ceil_div(grads_total, n)
    params_total = p * setup.param_bytes
    node_in = params_total if setup.param_reads == "all" else _ceil_div(params_total, n)
    server_in = node_out * n
    server_out = node_in * n
    nics = setup.server_nics
    resources = [
        Resource("drive media", setup.drives, drive.media_ns, drive_traffic.media_read + drive_traffic.media_write),
        Resource("drive controller", setup.drives, drive.compute_ns, drive_traffic.elements),
        Resource("drive link in", setup.drives, drive.host_in_ns, drive_traffic.host_in),
        Resource("drive link out", setup.drives, drive.host_out_ns, drive_traffic.host_out),
        Resource("server NIC in", nics, _nic_ns(link, _ceil_div(server_in, nics)), _ceil_div(server_in, nics)),
        Resource("server NIC out", nics, _nic_ns(link, _ceil_div(server_out, nics)), _ceil_div(server_out, nics)),
        Resource("node NIC out", n, _nic_ns(link, node_out), node_out),
        Resource("node NIC in", n, _nic_ns(link, node_in), node_in),
    ]
    if setup.uplink_bytes_per_s:
        # Both directions of the drives' traffic cross the uplink; it is full duplex.
        up = max(drive_traffic.host_in, drive_traffic.host_out) * setup.drives
        resources.append(Resource("server PCIe uplink", 1, transfer_ns(up, setup.uplink_bytes_per_s), up))
    fixed_ns = drive.fixed_ns + LATENCIES_PER_STEP * setup.link.latency_ns
    io_ns = fixed_ns + pipeline_ns([r.busy_ns for r in resources], drive.chunks)
    bound = max(resources, key=lambda r: r.busy_ns)
    bottleneck = bound.name if bound.busy_ns else "latency"
    compute_ns = round(setup.compute_s * NS_PER_S)
    drives_traffic = drive_traffic.scaled(setup.drives)
    cycle = {
        "server_in_bytes": server_in,
        "server_out_bytes": server_out,
        # Params served from the server's cache beyond the one copy the drives send up.
        "param_cache_hit_bytes": max(0, server_out - drives_traffic.host_out),
        "node_out_bytes": node_out,
        "node_in_bytes": node_in,
        "drive_link_in_bytes": drives_traffic.host_in,
        "drive_link_out_bytes": drives_traffic.host_out,
        "media_read_bytes": drives_traffic.media_read,
        "media_write_bytes": drives_traffic.media_write,
        "network_bytes": server_in + server_out,
    }
    return {
        "resources": {r.name: {"count": r.count, "busy_s": r.busy_ns / NS_PER_S, "busy_ns": r.busy_ns,
                               ("elements" if r.name == "drive controller" else "bytes"): r.nbytes}
                      for r in resources},
        "bottleneck": bottleneck,
        "fixed_s": fixed_ns / NS_PER_S,
        "io_s": io_ns / NS_PER_S,
        "io_ns": io_ns,
        "step_s": (compute_ns + io_ns) / NS_PER_S,
        "slowdown": (compute_ns + io_ns) / compute_ns if compute_ns else None,
        "bytes_per_cycle": cycle,
        "network_bytes_per_param": (server_in + server_out) / p,
    }
