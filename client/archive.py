"""The archive tier as calls of an AdminClient: ARCHIVE (D4h), ARCHIVE_LIST (D5h), page C4h."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..protocol.entries import NSID_ALL, Opcode
from ..protocol.logpages import LogId
from ..protocol.status import DeviceError, Status
from .admin import AdminClient
from .snapshots import wait_for_job


def archive(client: AdminClient, nsid: int, tag: str, url: str, *, endpoint_url: str | None = None,
            chunk_bytes: int | None = None, memory_bytes: int | None = None,
            overwrite: bool = False) -> dict[str, Any]:
    """Start uploading snapshot `tag` of namespace `nsid` to `url` (s3://BUCKET/PREFIX) from
    the device; returns the job as log page C2h describes it (its path: the version's URL)."""
    payload: dict[str, Any] = {"tag": tag, "url": url, "overwrite": overwrite}
    for key, value in (("endpoint_url", endpoint_url), ("chunk_bytes", chunk_bytes),
                       ("memory_bytes", memory_bytes)):
        if value is not None:
            payload[key] = value
    completion = client.call(Opcode.ARCHIVE, nsid=nsid, payload=json.dumps(payload).encode())
    return json.loads(completion.data)


def set_archive_policy(client: AdminClient, nsid: int, policy: dict[str, Any] | None) -> dict[str, Any]:
    """Turn the device's automatic archiving of namespace `nsid` on (`policy`: url, every and
    optionally keep_local, keep_remote, max_pending, endpoint_url, chunk_bytes, memory_bytes;
    docs/tiers.md) or off (None). Kept by the device across restarts."""
    completion = client.call(Opcode.ARCHIVE, nsid=nsid, payload=json.dumps({"policy": policy}).encode())
    return json.loads(completion.data)


def archived_versions(client: AdminClient, url: str, *, endpoint_url: str | None = None) -> dict[str, Any]:
    """The complete versions under `url`, as the device sees the store: {"url", "versions"}."""
    payload: dict[str, Any] = {"url": url}
    if endpoint_url is not None:
        payload["endpoint_url"] = endpoint_url
    return json.loads(client.call(Opcode.ARCHIVE_LIST, payload=json.dumps(payload).encode()).data)


def archive_statistics(client: AdminClient, nsid: int = NSID_ALL) -> dict[str, Any]:
    """Log page C4h: the device's network bytes and archive counts, per namespace and in all."""
    return json.loads(client.get_log_page(LogId.ARCHIVE, nsid))


def wait_for_archive(client: AdminClient, job: dict[str, Any],
                     progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Poll until the archive job ends; DeviceError with the job's status if it failed."""
    final = wait_for_job(client, job, progress)
    if final["state"] == "failed":
        try:
            status = Status[final["status"]]
        except KeyError:
            status = Status.INTERNAL_ERROR
        raise DeviceError(status, f"archive job {final['job']} failed: {final['error']}")
    return final
