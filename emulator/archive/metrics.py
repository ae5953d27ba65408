"""The archive tier's Prometheus figures: what each namespace's uploads moved over the device's own link, and what its automatic policy did (versions archived, waiting, coalesced)."""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

NS = ("namespace",)

# (metric name without _total, the counter in log page C4h's per-namespace figures, help)
TRAFFIC_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("cossd_archive_network_sent_bytes", "network_bytes_sent",
     "Bytes the device sent to object stores for this namespace, over its own link (never the host's)."),
    ("cossd_archive_network_received_bytes", "network_bytes_received",
     "Bytes the device received from object stores for this namespace."),
    ("cossd_archive_parts_uploaded", "parts_uploaded", "Multipart parts uploaded."),
    ("cossd_archive_parts_resumed", "parts_resumed", "Parts of an upload cut short found in the store and kept."),
    ("cossd_archive_archives_completed", "archives_completed", "Archive jobs completed (a manifest written)."),
    ("cossd_archive_archives_failed", "archives_failed", "Archive jobs that failed."),
    ("cossd_archive_window_decreases", "window_decreases",
     "Times an upload halved its parts in flight: a part slower than its latency target, or failed."),
)
# (metric name without _total, the field of a policy's state, help)
POLICY_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("cossd_archive_policy_versions_archived", "versions_archived",
     "Versions the automatic policy archived (since the daemon started)."),
    ("cossd_archive_policy_coalesced", "coalesced",
     "Versions the policy dropped before upload: more waited for the store than max_pending."),
    ("cossd_archive_policy_upload_failures", "upload_failures", "The policy's uploads that failed (retried)."),
)


def archive_metrics(figures: dict[str, Any]) -> Iterator[Metric]:
    """The families from ArchiveCommands.figures(): counters per namespace, and for each
    namespace with a policy the versions waiting and the last step archived."""
    namespaces = figures["namespaces"]
    for name, key, text in TRAFFIC_COUNTERS:
        family = CounterMetricFamily(name, text, labels=NS)
        for namespace, counters in sorted(namespaces.items()):
            family.add_metric((namespace,), counters[key])
        yield family
    states = {name: view["state"] for name, view in figures["policies"].items()}
    for name, key, text in POLICY_COUNTERS:
        family = CounterMetricFamily(name, text, labels=NS)
        for namespace, state in sorted(states.items()):
            family.add_metric((namespace,), state[key])
        yield family
    pending = GaugeMetricFamily("cossd_archive_policy_pending", "Versions waiting on the drive for the store.",
                                labels=NS)
    archived = GaugeMetricFamily("cossd_archive_policy_last_archived_step",
                                 "The newest step the policy archived.", labels=NS)
    spill = GaugeMetricFamily("cossd_archive_policy_spill_bytes",
                              "Bytes of the drive the versions waiting for the store take (their snapshots).",
                              labels=NS)
    for namespace, state in sorted(states.items()):
        pending.add_metric((namespace,), len(state["pending"]))
        archived.add_metric((namespace,), state["last_archived_step"])
        spill.add_metric((namespace,), state.get("spill_bytes", 0))
    yield pending
    yield archived
    yield spill
