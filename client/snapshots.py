"""Snapshots, rollback, clone and export jobs as calls of an AdminClient (CBh-CFh, C1h/C2h)."""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from ..protocol.entries import NSID_ALL, Opcode
from ..protocol.logpages import LogId
from ..protocol.status import DeviceError, Status
from .admin import AdminClient

POLL_INTERVAL_S = 0.1


def _call(client: AdminClient, opcode: int, nsid: int, payload: dict[str, Any]) -> dict[str, Any]:
    return json.loads(client.call(opcode, nsid=nsid, payload=json.dumps(payload).encode()).data)


def create_snapshot(client: AdminClient, nsid: int, tag: str) -> dict[str, Any]:
    """Snapshot the committed step of namespace `nsid` under `tag`."""
    return _call(client, Opcode.SNAPSHOT_CREATE, nsid, {"tag": tag})


def delete_snapshot(client: AdminClient, nsid: int, tag: str) -> dict[str, Any]:
    return _call(client, Opcode.SNAPSHOT_DELETE, nsid, {"tag": tag})


def rollback(client: AdminClient, nsid: int, tag: str) -> dict[str, Any]:
    """Make the snapshot's state the namespace's committed one: {"step", "previous_step", ...}."""
    return _call(client, Opcode.SNAPSHOT_ROLLBACK, nsid, {"tag": tag})


def clone(client: AdminClient, nsid: int, tag: str, name: str) -> dict[str, Any]:
    """A new namespace `name` from the snapshot; returns its config (with "nsid")."""
    return _call(client, Opcode.SNAPSHOT_CLONE, nsid, {"tag": tag, "name": name})


def snapshots(client: AdminClient, nsid: int = NSID_ALL) -> dict[str, list[dict[str, Any]]]:
    """Log page C1h: {namespace: [snapshot, ...]} for one namespace or all."""
    return json.loads(client.get_log_page(LogId.SNAPSHOTS, nsid))


def jobs(client: AdminClient, nsid: int = NSID_ALL) -> list[dict[str, Any]]:
    """Log page C2h: the device's background jobs with their progress."""
    return json.loads(client.get_log_page(LogId.JOBS, nsid))["jobs"]


def export(client: AdminClient, nsid: int, *, tag: str | None = None, path: str | None = None,
           optimizer_state: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Start an export job; returns the job as log page C2h describes it."""
    payload: dict[str, Any] = {"optimizer_state": optimizer_state, "overwrite": overwrite}
    if tag is not None:
        payload["tag"] = tag
    if path is not None:
        payload["path"] = path
    return _call(client, Opcode.EXPORT, nsid, payload)


def wait_for_job(client: AdminClient, job: dict[str, Any],
                 progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Poll log page C2h until the job is no longer running; returns its last state."""
    while True:
        current = next((j for j in jobs(client, job["nsid"]) if j["job"] == job["job"]), None)
        if current is None:
            raise DeviceError(Status.INTERNAL_ERROR, f"job {job['job']} vanished from log page C2h")
        if progress is not None:
            progress(current)
        if current["state"] != "running":
            return current
        time.sleep(POLL_INTERVAL_S)


def raise_if_failed(job: dict[str, Any]) -> None:
    if job["state"] == "failed":
        try:
            status = Status[job["status"]]
        except KeyError:
            status = Status.INTERNAL_ERROR
        raise DeviceError(status, f"export job {job['job']} failed: {job['error']}")
