"""Prometheus metrics of a mounted device: the device's figures (emulator/metrics/figures.py) and the
mount's own, read live at scrape time and served over HTTP (emulator/metrics/http.py)."""
from __future__ import annotations

import errno
from typing import TYPE_CHECKING, Iterator

from prometheus_client.core import CounterMetricFamily, Metric

from ..emulator.metrics.figures import NAMESPACE_COUNTERS, NS, DeviceFigures
from ..emulator.metrics.http import (
    DEFAULT_METRICS_ADDR,
    MetricsEndpoint,
    MetricsPortError,
    load_token,
    require_bearer,
)

if TYPE_CHECKING:
    from .operations import Operations

# The names the mount daemon and the mount verb import from here (the endpoint and its token
# moved below both front-ends, so the storage server serves them too).
__all__ = ["DEFAULT_METRICS_ADDR", "NAMESPACE_COUNTERS", "NS", "DeviceCollector", "MetricsEndpoint",
           "MetricsPortError", "load_token", "require_bearer"]


class DeviceCollector(DeviceFigures):
    """The device's figures, then the mount's own: failed file operations by errno and the
    FUSE requests by who served them."""

    def __init__(self, operations: "Operations") -> None:
        super().__init__(operations.device, operations.controller.figures)
        self.operations = operations

    def collect(self) -> Iterator[Metric]:
        # A copy taken in one C call (atomic under the GIL): worker threads may add errno
        # keys while we iterate.
        errors = dict(self.operations.errors_by_errno)
        yield from super().collect()
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
