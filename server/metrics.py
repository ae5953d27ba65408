"""The storage server's Prometheus metrics: the device's figures (emulator/metrics/figures.py) and the
server's own (connections, refusals, leases, the link, receive memory, the parameter cache),
read from the same figures as its log page C5h when Prometheus scrapes."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..emulator import Device
from ..emulator.metrics.figures import DeviceFigures
from ..protocol.logpages import SERVER_REFUSALS

# (metric name, "gauge" or "counter" (its name then without _total), field of
# Server.figures(), scale, help). The scale turns nanoseconds into seconds.
SERVER_METRICS: tuple[tuple[str, str, str, float, str], ...] = (
    ("cossd_server_connections_open", "gauge", "connections_open", 1, "Client connections open now."),
    ("cossd_server_connections", "counter", "connections_total", 1,
     "Client connections accepted and let in (refused ones not counted)."),
    ("cossd_server_max_connections", "gauge", "max_connections", 1,
     "Connections served at once, at most (--max-connections; 0: no limit)."),
    ("cossd_server_leases_open", "gauge", "leases_open", 1,
     "Steps held open for a client that went away (the lease)."),
    ("cossd_server_leases_expired", "counter", "leases_expired", 1,
     "Steps aborted because their client did not come back within the lease."),
    ("cossd_server_link_commands", "counter", "link_commands", 1, "Commands served over the link."),
    ("cossd_server_link_received_bytes", "counter", "link_bytes_in", 1,
     "Payload bytes received from clients (capsule data and H2CData)."),
    ("cossd_server_link_sent_bytes", "counter", "link_bytes_out", 1,
     "Payload bytes sent to clients (C2HData)."),
    ("cossd_server_link_received_pdus", "counter", "link_pdus_in", 1, "PDUs received from clients."),
    ("cossd_server_link_sent_pdus", "counter", "link_pdus_out", 1, "PDUs sent to clients."),
    ("cossd_server_link_wire_seconds", "counter", "link_wire_ns", 1e-9,
     "Wire time of the commands as the link's timing model (--link) gives it."),
    ("cossd_server_recv_memory_bytes", "gauge", "recv_memory_bytes", 1,
     "Receive memory all connections may hold at once (--recv-memory)."),
    ("cossd_server_recv_held_bytes", "gauge", "recv_held_bytes", 1, "Receive memory held by connections now."),
    ("cossd_server_recv_peak_bytes", "gauge", "recv_peak_bytes", 1, "The most receive memory held at once."),
    ("cossd_server_recv_waits", "counter", "recv_waits", 1, "WRITEs that waited for receive memory."),
    ("cossd_server_recv_streamed_writes", "counter", "recv_streamed_writes", 1,
     "Gradient WRITEs received in bounded pieces as they arrived."),
    ("cossd_server_recv_idle_releases", "counter", "recv_idle_releases", 1,
     "Receive buffers given back by connections that went idle."),
    ("cossd_server_param_cache_capacity_bytes", "gauge", "cache_capacity", 1,
     "Parameter cache size (--param-cache-size; 0: off)."),
    ("cossd_server_param_cache_bytes", "gauge", "cache_bytes", 1, "Bytes of params in the cache now."),
    ("cossd_server_param_cache_namespaces", "gauge", "cache_namespaces", 1, "Namespaces in the cache now."),
    ("cossd_server_param_cache_hits", "counter", "cache_hits", 1, "Param READs served from the cache."),
    ("cossd_server_param_cache_misses", "counter", "cache_misses", 1, "Param READs the cache did not have."),
    ("cossd_server_param_cache_fills", "counter", "cache_fills", 1, "Namespaces' params copied into the cache."),
    ("cossd_server_param_cache_hit_bytes", "counter", "cache_hit_bytes", 1, "Param bytes served from the cache."),
    ("cossd_server_param_cache_fill_bytes", "counter", "cache_fill_bytes", 1,
     "Param bytes copied into the cache from the media."),
    ("cossd_server_param_cache_evictions", "counter", "cache_evictions", 1,
     "Entries dropped to make room (least recently read first)."),
    ("cossd_server_param_cache_too_large", "counter", "cache_too_large", 1,
     "Reads of namespaces whose params exceed the cache (served from the media)."),
    ("cossd_server_param_cache_invalidated", "counter", "cache_invalidated", 1,
     "Entries dropped because their step was no longer the committed one, or the namespace was deleted."),
    ("cossd_server_start_time_seconds", "gauge", "started_ns", 1e-9,
     "When the server started, in seconds since the epoch."),
    ("cossd_server_send_timeouts", "counter", "send_timeouts", 1,
     "Connections dropped because their peer took no bytes for --send-timeout-s."),
    ("cossd_server_accept_errors", "counter", "accept_errors", 1,
     "Accepts that failed for want of descriptors, memory or a thread (the server backed off)."),
)
# Labelled families: refusals by reason, receive-memory refusals by why.
RECV_REFUSALS = (("too_large", "recv_refused_too_large"), ("timeout", "recv_refused_timeout"))


class ServerCollector(DeviceFigures):
    """The device's figures (as the mount's endpoint serves them), then the server's."""

    def __init__(self, device: Device, figures: Callable[[], dict[str, int]],
                 controller_figures: dict[str, Callable[[], dict[str, Any]]] | None = None) -> None:
        super().__init__(device, controller_figures)
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        yield from super().collect()
        figures = self.figures()
        for name, kind, field, scale, text in SERVER_METRICS:
            value = figures[field] * scale if scale != 1 else figures[field]
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, text, value=value)
        refused = CounterMetricFamily("cossd_server_refused", "Connections turned away before they were "
                                      "served, by reason.", labels=("reason",))
        for reason in SERVER_REFUSALS:
            refused.add_metric((reason,), figures[f"refused_{reason}"])
        yield refused
        recv = CounterMetricFamily("cossd_server_recv_refused", "WRITEs refused for receive memory: larger "
                                   "than all of it (too_large), or none free within --recv-wait-s (timeout).",
                                   labels=("reason",))
        for reason, field in RECV_REFUSALS:
            recv.add_metric((reason,), figures[field])
        yield recv
