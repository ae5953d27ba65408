"""Prometheus metrics of a mounted device, read live at scrape time and served over HTTP."""
from __future__ import annotations

import dataclasses
import errno
import hmac
import logging
import os
import socket
import socketserver
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from ..emulator.kinds import OPTIMIZER_KIND

if TYPE_CHECKING:
    from ..emulator.namespace import Namespace

    from .operations import Operations

log = logging.getLogger(__name__)

DEFAULT_METRICS_ADDR = "127.0.0.1"
NS = ("namespace",)

# Per-namespace counters: (metric name without _total, key in Namespace.statistics(), scale, help).
# The scale turns nanoseconds into seconds; everything else is copied as is.
NAMESPACE_COUNTERS: tuple[tuple[str, str, float, str], ...] = (
    ("cossd_steps_committed", "steps_committed", 1, "Steps committed, over the namespace's life."),
    ("cossd_steps_skipped", "steps_skipped", 1,
     "Steps skipped for inf/NaN gradients, over the namespace's life."),
    ("cossd_steps_aborted", "steps_aborted", 1, "Steps aborted since the namespace was opened."),
    ("cossd_nonfinite_elements", "nonfinite_elements", 1,
     "Non-finite gradient elements seen since the namespace was opened."),
    ("cossd_grad_bytes", "grad_bytes_in", 1, "Gradient bytes written by the host."),
    ("cossd_param_bytes", "param_bytes_out", 1, "Param bytes read by the host."),
    ("cossd_state_loaded_bytes", "state_bytes_loaded", 1,
     "Master and moment bytes loaded by the host before the first step."),
    ("cossd_namespace_read_bytes", "bytes_read", 1,
     "Bytes read by the host from any tensor file (param, master, moments)."),
    ("cossd_namespace_read_requests", "read_commands", 1, "Read requests served on tensor files."),
    ("cossd_namespace_write_requests", "write_commands", 1, "Write requests accepted on tensor files."),
    ("cossd_namespace_media_written_bytes", "media_bytes_written", 1,
     "Bytes the device wrote into state copies and superblock slots."),
    ("cossd_kernel_blocks", "kernel_blocks", 1, "Blocks the Adam kernel has processed."),
    ("cossd_kernel_seconds", "kernel_ns", 1e-9, "Wall time of the Adam kernels, summed over threads."),
    ("cossd_flushes", "flushes", 1, "Flushes (fsyncs of a committed step)."),
    ("cossd_flush_seconds", "flush_ns", 1e-9, "Wall time spent in flushes."),
    ("cossd_checksum_failures", "checksum_failures", 1, "Block checksum failures found."),
)


class DeviceCollector(Collector):
    """Reads the device's figures when Prometheus scrapes, so the I/O path updates nothing extra.

    collect() runs on the HTTP server's thread while the daemon serves requests. Every figure
    it reads is a plain int that the emulator's own lock-free readers (statistics(), SMART)
    already read the same way; a scrape that races a request is off by that request at most.
    """

    def __init__(self, operations: "Operations") -> None:
        self.operations = operations

    def collect(self) -> Iterator[Metric]:
        device = self.operations.device
        # Copies taken in one C call each (atomic under the GIL): the event loop and worker
        # threads may add namespaces or errno keys while we iterate.
        namespaces = list(device.namespaces.values())
        errors = dict(self.operations.errors_by_errno)
        yield from self._device_metrics(namespaces)
        yield from self._namespace_metrics(namespaces)
        fs_errors = CounterMetricFamily(
            "cossd_fs_errors", "File operations on the mount that failed, by errno.", labels=("errno",))
        for number, count in sorted(errors.items()):
            fs_errors.add_metric((errno.errorcode.get(number, str(number)),), count)
        yield fs_errors
        data_path = self.operations.data_path
        if data_path is not None:
            requests = CounterMetricFamily(
                "cossd_fs_requests", "FUSE requests by who served them: the data path's threads "
                "(file reads and writes, lookups, getattrs) or pyfuse3 (everything else).", labels=("served_by",))
            requests.add_metric(("data_path",), data_path.requests_served)
            requests.add_metric(("pyfuse3",), data_path.requests_forwarded)
            yield requests

    def _device_metrics(self, namespaces: list["Namespace"]) -> Iterator[Metric]:
        device = self.operations.device
        smart = device.smart()
        totals = device.health.totals([ns.counters for ns in namespaces])
        identity = device.identity
        info = GaugeMetricFamily(
            "cossd_device_info", "Identity of the device (always 1).",
            labels=("serial", "model", "firmware", "durability", "backing"))
        info.add_metric((str(identity.get("serial", "")), str(identity.get("model", "")),
                         str(identity.get("firmware_revision", "")),
                         "sync" if device.config.sync else "plp", str(device.path)), 1)
        yield info

        gauges = (
            ("cossd_temperature_celsius", "Modeled composite temperature (SMART, whole Kelvin - 273.15).",
             round(smart["temperature"] - 273.15, 2)),
            ("cossd_critical_warning", "SMART critical warning bits (0: none).", smart["critical_warning"]),
            ("cossd_available_spare_ratio", "SMART available spare, as a ratio.", smart["avail_spare"] / 100),
            ("cossd_endurance_used_ratio", "SMART percentage used (modeled wear), as a ratio.",
             smart["percent_used"] / 100),
            ("cossd_capacity_bytes", "Device capacity.", device.capacity_bytes),
            ("cossd_allocated_bytes", "Bytes allocated to namespaces (state copies, snapshots, NVM data).",
             device.allocated_bytes),
            ("cossd_namespaces", "Namespaces served.", len(namespaces)),
            ("cossd_failed_namespaces", "Namespaces that failed recovery at mount.",
             len(device.failed_namespaces)),
            ("cossd_start_time_seconds", "When the device was opened, in seconds since the epoch.",
             device.opened_at),
        )
        for name, text, value in gauges:
            yield GaugeMetricFamily(name, text, value=value)

        counters = (
            ("cossd_data_units_read", "SMART data units read (1000 x 512 bytes, rounded up).",
             smart["data_units_read"]),
            ("cossd_data_units_written", "SMART data units written (1000 x 512 bytes, rounded up).",
             smart["data_units_written"]),
            ("cossd_host_read_bytes", "Bytes the host read from tensor files, device lifetime.",
             totals.host_bytes_read),
            ("cossd_host_written_bytes", "Bytes the host wrote into tensor files, device lifetime.",
             totals.host_bytes_written),
            ("cossd_host_read_commands", "Read requests served on tensor files, device lifetime.",
             totals.host_read_commands),
            ("cossd_host_write_commands", "Write requests accepted on tensor files, device lifetime.",
             totals.host_write_commands),
            ("cossd_media_written_bytes", "Bytes the device wrote to its media, device lifetime.",
             totals.media_bytes_written),
            ("cossd_busy_seconds", "Kernel and flush time, device lifetime (SMART busy time, unrounded).",
             totals.busy_ns / 1e9),
            ("cossd_power_cycles", "Opens of the device.", totals.power_cycles),
            ("cossd_power_on_seconds", "Time the device has been open, device lifetime.",
             totals.power_on_ns / 1e9),
            ("cossd_unsafe_shutdowns", "Opens that found the previous open had not closed cleanly.",
             totals.unsafe_shutdowns),
            ("cossd_media_errors", "Block checksum failures found, device lifetime.", totals.media_errors),
            ("cossd_error_log_entries", "Error log entries, device lifetime.", totals.error_log_entries),
            ("cossd_warning_temperature_seconds", "Time the modeled temperature was at or above WCTEMP.",
             totals.warning_temp_ns / 1e9),
            ("cossd_critical_temperature_seconds", "Time the modeled temperature was at or above CCTEMP.",
             totals.critical_temp_ns / 1e9),
        )
        for name, text, value in counters:
            yield CounterMetricFamily(name, text, value=value)

    def _namespace_metrics(self, namespaces: list["Namespace"]) -> Iterator[Metric]:
        stats = [(ns, ns.statistics()) for ns in namespaces]
        gauges = {
            "cossd_committed_step": GaugeMetricFamily(
                "cossd_committed_step", "Last committed (acknowledged) step.", labels=NS),
            "cossd_durable_step": GaugeMetricFamily(
                "cossd_durable_step", "Last step known to be on the media.", labels=NS),
            "cossd_last_skipped_step": GaugeMetricFamily(
                "cossd_last_skipped_step", "Last step skipped for inf/NaN gradients (0: none).", labels=NS),
            "cossd_open_step": GaugeMetricFamily(
                "cossd_open_step", "Step now open (0: none).", labels=NS),
            "cossd_loading": GaugeMetricFamily(
                "cossd_loading", "1 while the namespace takes initial weights (before step 1).", labels=NS),
            "cossd_media_failure": GaugeMetricFamily(
                "cossd_media_failure", "1 once a failed fsync has stopped the namespace.", labels=NS),
            "cossd_parameters": GaugeMetricFamily(
                "cossd_parameters", "Parameters (elements) in the namespace.", labels=NS),
            "cossd_state_bytes": GaugeMetricFamily(
                "cossd_state_bytes", "Size of one state copy.", labels=NS),
        }
        counters = {name: CounterMetricFamily(name, text, labels=NS)
                    for name, _, _, text in NAMESPACE_COUNTERS}
        for ns, figures in stats:
            label = (figures["name"],)
            for name, key, scale, _ in NAMESPACE_COUNTERS:
                if key in figures:  # a plain NVM namespace has the I/O counters only
                    # Integers stay integers; only the nanosecond timers become float seconds.
                    counters[name].add_metric(label, figures[key] * scale if scale != 1 else figures[key])
            if figures.get("kind", OPTIMIZER_KIND) != OPTIMIZER_KIND:
                continue
            values = {
                "cossd_committed_step": figures["committed_step"],
                "cossd_durable_step": figures["durable_step"],
                "cossd_last_skipped_step": figures["last_skipped_step"] or 0,
                "cossd_open_step": figures["step_open"] or 0,
                "cossd_loading": int(bool(figures["loading"])),
                "cossd_media_failure": int(ns.media_failure is not None),
                "cossd_parameters": figures["parameters"],
                "cossd_state_bytes": figures["state_bytes_per_copy"],
            }
            for name, value in values.items():
                gauges[name].add_metric(label, value)
        yield from gauges.values()
        yield from counters.values()


class MetricsPortError(RuntimeError):
    """The metrics endpoint could not be bound (port in use, bad address), or its token file
    is unusable."""


# ---------------------------------------------------------------------- access


def load_token(path: str | os.PathLike[str]) -> str:
    """The bearer token in `path`: its text without surrounding white space (Prometheus trims
    a credentials_file the same way). Refused: unreadable, empty, not one line, or readable
    by every user (the token would keep no local user out)."""
    where = Path(path)
    try:
        mode = where.stat().st_mode
        text = where.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise MetricsPortError(f"cannot read the metrics token file {where}: {reason}") from None
    if not stat.S_ISREG(mode):
        raise MetricsPortError(f"metrics token file {where} is not a regular file")
    if mode & stat.S_IROTH:
        raise MetricsPortError(f"metrics token file {where} is readable by every user: chmod o-r {where}")
    if not text:
        raise MetricsPortError(f"metrics token file {where} is empty")
    if any(c.isspace() for c in text):
        raise MetricsPortError(f"metrics token file {where} must hold one token, without white space")
    return text


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def require_bearer(app: WsgiApp, token: str) -> WsgiApp:
    """`app` behind `Authorization: Bearer <token>`; any other request answers 401."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if hmac.compare_digest(given, expected):  # in constant time
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", 'Bearer realm="cossd metrics"')])
        return [b"401 Unauthorized: this endpoint needs Authorization: Bearer <token>\n"]

    return guarded


class _QuietHandler(WSGIRequestHandler):
    # A connection that sends nothing is dropped after this long, so that idle connections do
    # not keep threads of the daemon for ever.
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # a scrape every few seconds would fill the daemon log


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per scrape, so a slow client cannot hold the others up."""

    daemon_threads = True


def _serve_http(port: int, addr: str, app: WsgiApp) -> tuple[WSGIServer, threading.Thread]:
    # The address decides the family (an IPv6 address needs AF_INET6).
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server_class = type("MetricsHTTPServer", (_ThreadingServer,), {"address_family": family})
    httpd = make_server(sockaddr[0], port, app, server_class, handler_class=_QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, name="cossd-metrics", daemon=True)
    thread.start()
    return httpd, thread


@dataclasses.dataclass
class MetricsServer:
    """The HTTP endpoint; bound before the device opens, so a busy port starts nothing."""

    addr: str
    port: int
    registry: CollectorRegistry
    httpd: WSGIServer
    thread: threading.Thread
    authenticated: bool = False

    @classmethod
    def bind(cls, port: int, addr: str = DEFAULT_METRICS_ADDR,
             token_file: str | os.PathLike[str] | None = None) -> "MetricsServer":
        """Serve on addr:port; with `token_file`, only to requests that carry its token
        (load_token, require_bearer)."""
        token = load_token(token_file) if token_file is not None else None
        # An empty registry until attach(): a scrape in the few ms before the mount is ready
        # gets an empty page, never a half-built device.
        registry = CollectorRegistry(auto_describe=False)
        app: WsgiApp = make_wsgi_app(registry)
        if token is not None:
            app = require_bearer(app, token)
        try:
            httpd, thread = _serve_http(port, addr, app)
        except OSError as exc:
            reason = "address already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
            raise MetricsPortError(f"cannot serve metrics on {addr}:{port}: {reason}") from None
        if token is None:
            log.warning("metrics on http://%s:%d/metrics without authentication: anyone who can reach it "
                        "reads them, namespace names included (--metrics-token-file restricts it)", addr, port)
        else:
            log.info("metrics on http://%s:%d/metrics, bearer token required", addr, port)
        return cls(addr, port, registry, httpd, thread, token is not None)

    def attach(self, operations: "Operations") -> None:
        self.registry.register(DeviceCollector(operations))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
