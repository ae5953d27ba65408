"""The device's Prometheus figures (device-wide and per namespace), read live at scrape time:
shared by both front-ends' endpoints (the mount's, fs/metrics.py, and the server's)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..kinds import OPTIMIZER_KIND, AnyNamespace
from ..archive.metrics import archive_metrics
from .. import state_counters

if TYPE_CHECKING:
    from ..device import Device

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



class DeviceFigures(Collector):
    """Reads the device's figures when Prometheus scrapes, so the I/O path updates nothing extra.

    collect() runs on the HTTP server's thread while a front-end serves requests. Every figure
    it reads is a plain int that the emulator's own lock-free readers (statistics(), SMART)
    already read the same way; a scrape that races a request is off by that request at most.
    A front-end adds its own figures by collecting these and then its own.
    """

    def __init__(self, device: "Device", controller_figures: dict[str, Callable[[], dict[str, Any]]] | None = None,
                 ) -> None:
        self.device = device
        # The controller's command modules' own figures (the archive tier's), where given.
        self.controller_figures = controller_figures or {}

    def collect(self) -> Iterator[Metric]:
        # A copy taken in one C call (atomic under the GIL): commands may add namespaces
        # while we iterate.
        namespaces = list(self.device.namespaces.values())
        yield from self.device_metrics(namespaces)
        yield from self.namespace_metrics(namespaces)
        yield from self.state_counter_metrics()
        archive = self.controller_figures.get("archive")
        if archive is not None:
            yield from archive_metrics(archive())

    def device_metrics(self, namespaces: list[AnyNamespace]) -> Iterator[Metric]:
        device = self.device
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

    def namespace_metrics(self, namespaces: list[AnyNamespace]) -> Iterator[Metric]:
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
            "cossd_verifying": GaugeMetricFamily(
                "cossd_verifying", "1 while a reopened namespace's master and moments are verified in the "
                "background (steps wait for it).", labels=NS),
            "cossd_media_failure": GaugeMetricFamily(
                "cossd_media_failure", "1 once a media failure (a failed fsync, a damaged copy, a block "
                "that failed its checksum after the device opened) has stopped the namespace.", labels=NS),
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
                "cossd_verifying": int(bool(figures["verification"]["verifying"])),
                "cossd_media_failure": int(getattr(ns, "media_failure", None) is not None),
                "cossd_parameters": figures["parameters"],
                "cossd_state_bytes": figures["state_bytes_per_copy"],
            }
            for name, value in values.items():
                gauges[name].add_metric(label, value)
        yield from gauges.values()
        yield from counters.values()

    def state_counter_metrics(self) -> Iterator[Metric]:
        """The fp16/int8 moments' counters per tensor and moment (log page C6h,
        emulator/state_counters.py): totals since the namespace opened, the last step's scales."""
        labels = ("namespace", "tensor", "moment")
        underflow = CounterMetricFamily(
            "cossd_state_underflow", "Nonzero moment values whose fp16/int8 code is zero (exp_avg_sq: raised to "
            "the smallest code), over committed steps since the namespace was opened.", labels=labels)
        overflow = CounterMetricFamily(
            "cossd_state_overflow", "Moment elements whose fp16/int8 code decodes to inf or NaN, over committed "
            "steps since the namespace was opened.", labels=labels)
        scale_min = GaugeMetricFamily(
            "cossd_state_scale_min", "Least block scale of the last committed step (fp16: 2^-k, int8: absmax), "
            "over blocks with a nonzero largest value.", labels=labels)
        scale_max = GaugeMetricFamily(
            "cossd_state_scale_max", "Greatest block scale of the last committed step (fp16: 2^-k, int8: absmax).",
            labels=labels)
        page = state_counters.page(self.device, None)
        for name, figures in page.items():
            for tensor, moments in figures.get("tensors", {}).items():
                for moment, values in moments.items():
                    label = (name, tensor, moment)
                    underflow.add_metric(label, values["underflow_total"])
                    overflow.add_metric(label, values["overflow_total"])
                    scale_min.add_metric(label, values["scale_min"])
                    scale_max.add_metric(label, values["scale_max"])
        yield from (underflow, overflow, scale_min, scale_max)
        yield from _grad_fp8_metrics(page)
        yield from _param_fp8_metrics(page)


def _grad_fp8_metrics(page: dict[str, Any]) -> Iterator[Metric]:
    """The FP8 gradients' figures per namespace and tensor (log page C6h's grad_fp8): the last
    step's scale, the trainer's encoding counts and the non-finite elements the device found."""
    labels = ("namespace", "tensor")
    scale = GaugeMetricFamily(
        "cossd_grad_fp8_scale", "FP8 gradient scale of the tensor at the last step that brought one (codes are the "
        "gradient times it; the least over the tensor's slices, which is its whole-tensor current scale).",
        labels=labels)
    families = {
        "underflow": CounterMetricFamily(
            "cossd_grad_fp8_underflow", "Nonzero gradient elements the trainer's FP8 encoding flushed to zero, as "
            "it reported them with each step's scales, since the namespace was opened.", labels=labels),
        "saturated": CounterMetricFamily(
            "cossd_grad_fp8_saturated", "Finite gradient elements the trainer clamped to the FP8 format's largest "
            "value, as it reported them, since the namespace was opened.", labels=labels),
        "nonfinite": CounterMetricFamily(
            "cossd_grad_fp8_nonfinite", "Gradient elements of the tensor the device found inf or NaN (FP8 codes "
            "that decode to NaN or E5M2's infinities), since the namespace was opened.", labels=labels),
    }
    for name, figures in page.items():
        for tensor, values in figures.get("grad_fp8", {}).items():
            if values["step"]:
                scale.add_metric((name, tensor), values["scale_min"])
            for key, family in families.items():
                family.add_metric((name, tensor), values[key])
    yield scale
    yield from families.values()


def _param_fp8_metrics(page: dict[str, Any]) -> Iterator[Metric]:
    """The FP8 params-out figures per namespace and tensor (log page C6h's param_fp8): the scale
    and step of the last encoding, and the saturated and flushed elements over steps."""
    labels = ("namespace", "tensor")
    scale = GaugeMetricFamily(
        "cossd_param_fp8_scale", "FP8 params-out scale of the tensor's last encoded step (codes are the FP32 "
        "masters times it: 2^floor(log2(fp8_max / amax))).", labels=labels)
    step = GaugeMetricFamily(
        "cossd_param_fp8_step", "The step whose params the device last encoded as FP8 for the tensor.",
        labels=labels)
    overflow = CounterMetricFamily(
        "cossd_param_fp8_overflow", "Masters of the tensor beyond the FP8 format's largest value times the scale "
        "(sent saturated), each encoded step counted once, since the namespace was opened.", labels=labels)
    underflow = CounterMetricFamily(
        "cossd_param_fp8_underflow", "Nonzero masters of the tensor sent as an FP8 zero, each encoded step "
        "counted once, since the namespace was opened.", labels=labels)
    for name, figures in page.items():
        for tensor, values in figures.get("param_fp8", {}).items():
            scale.add_metric((name, tensor), values["scale"])
            step.add_metric((name, tensor), values["step"])
            overflow.add_metric((name, tensor), values["overflow"])
            underflow.add_metric((name, tensor), values["underflow"])
    yield from (scale, step, overflow, underflow)
