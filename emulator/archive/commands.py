"""ARCHIVE (D4h) and ARCHIVE_LIST (D5h), and the archive tier's log page (C4h)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from . import policy as archive_policy, versions as archive
from .. import controller as controller_module
from ..jobs import JobTable
from ..namespace import Namespace
from ...protocol.entries import NSID_ALL, Command, Completion, Opcode
from ...protocol.logpages import LogId
from ...protocol.status import DeviceError, Status


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def _payload(command: Command) -> Any:
    try:
        return json.loads(command.payload.decode()) if command.payload else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DeviceError(Status.INVALID_FIELD, f"payload is not valid JSON: {exc}") from None


class ArchiveCommands:
    """The handlers; one instance per controller. The counters live as long as the daemon."""

    def __init__(self, controller: controller_module.Controller) -> None:
        self.device = controller.device
        # The archive's jobs share the export jobs' table, so log page C2h lists both (the
        # snapshot commands load first); a controller without them keeps a table of its own.
        snapshots = getattr(controller.log_pages.get(LogId.JOBS), "__self__", None)
        table = getattr(snapshots, "jobs", None)
        self.jobs = table if isinstance(table, JobTable) else JobTable()
        if not isinstance(table, JobTable):
            controller.log_pages[LogId.JOBS] = lambda command: _json({"jobs": self.jobs.jobs()})
        self.traffic: dict[str, archive.Traffic] = {}  # by namespace name
        self.running: set[str] = set()  # the versions being uploaded
        # The automatic policies (ARCHIVE with a policy), kept in the backing directory.
        self.policies = archive_policy.PolicyRunner(self.device, self.jobs, self._traffic, self.running)
        controller.closers.append(self.policies.close)
        controller.figures["archive"] = self.figures

    def _traffic(self, name: str) -> archive.Traffic:
        return self.traffic.setdefault(name, archive.Traffic())

    def _namespace(self, command: Command) -> Namespace:
        return self.device.optimizer_namespace(command.nsid, "an archive command")

    def archive(self, command: Command) -> Completion:
        namespace = self._namespace(command)
        payload = _payload(command)
        if isinstance(payload, dict) and "policy" in payload:
            # {"policy": {...}} turns the device's own archiving on, {"policy": null} off.
            if set(payload) != {"policy"}:
                raise DeviceError(Status.INVALID_FIELD, "a policy payload is {\"policy\": {...}} alone")
            described = self.policies.set(namespace, payload["policy"])
            return Completion(command.cid, Status.SUCCESS, data=_json(described | {"namespace": namespace.name}))
        job = archive.start(self.device, self.jobs, namespace, payload, self._traffic(namespace.name), self.running)
        return Completion(command.cid, Status.SUCCESS, result=job.job_id, data=_json(job.describe()))

    def archive_list(self, command: Command) -> Completion:
        request = _payload(command)
        if not isinstance(request, dict) or "url" not in request or set(request) - archive.LIST_KEYS:
            raise DeviceError(Status.INVALID_FIELD, "payload is {\"url\": \"s3://BUCKET/PREFIX\"} "
                                                    "with an optional endpoint_url")
        root = archive.parse_url(request["url"])
        endpoint = archive.parse_endpoint(request.get("endpoint_url"))
        traffic = archive.Traffic()
        unreadable: list[dict[str, str]] = []
        versions = archive.list_versions(archive.Store(endpoint, traffic=traffic, holder=archive.DAEMON), root,
                                         unreadable)
        self.traffic.setdefault("", archive.Traffic()).add(traffic)  # the device's own listing
        return Completion(command.cid, Status.SUCCESS, result=len(versions),
                          data=_json({"url": root.url, "versions": versions, "unreadable": unreadable}))

    def figures(self) -> dict[str, Any]:
        """Every namespace's network counters and policy state, for the metrics endpoints."""
        return {"namespaces": {name: dataclasses.asdict(traffic) for name, traffic in list(self.traffic.items())
                               if name},
                "policies": self.policies.page()}

    def page(self, command: Command) -> bytes:
        """Per namespace (all, or the one named): the network counters of its archives;
        "device" sums every namespace's and the listings'."""
        if command.nsid in (0, NSID_ALL):
            names = sorted(self.traffic)
        else:
            names = [self._namespace(command).name]
        total = archive.Traffic()
        for traffic in self.traffic.values():
            total.add(traffic)
        return _json({
            "namespaces": {name: dataclasses.asdict(self.traffic.get(name, archive.Traffic()))
                           for name in names if name},
            "device": dataclasses.asdict(total),
            "running": sorted(self.running),
            # Each namespace's automatic policy and what it did (versions waiting, coalesced).
            "policies": {name: view for name, view in self.policies.page().items() if name in names or
                         command.nsid in (0, NSID_ALL)},
            "policy_file_error": self.policies.load_error,
        })


def handlers(controller: controller_module.Controller) -> dict[int, Callable[[Command], Completion]]:
    commands = ArchiveCommands(controller)
    controller.log_pages[LogId.ARCHIVE] = commands.page
    return {Opcode.ARCHIVE: commands.archive, Opcode.ARCHIVE_LIST: commands.archive_list}
