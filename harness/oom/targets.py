"""The OOM bench's targets outside the workers' cgroups: SeaweedFS on loopback (the object store) and a mounted cossd device (the drive)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

BUCKET = "cossd-oom"


class Store:
    """SeaweedFS on loopback, outside the workers' cgroups (the store is another machine's);
    why is set where weed is missing or does not start, and the tiered row says so."""

    def __init__(self, root: Path) -> None:
        from .. import s3_server

        self.server: Any = None
        self.why: str | None = None
        self.endpoint = ""
        self._module = s3_server
        if s3_server.WEED is None:
            self.why = f"not measured: {s3_server.MISSING}"
            return
        try:
            import boto3  # noqa: F401  (the checkpointer's client)
        except ImportError:
            self.why = "not measured: boto3 is not installed (pip install 'cossd[tiers]')"
            return
        root.mkdir(parents=True)
        try:
            self.server = s3_server.start_weed(root, BUCKET)
            self.endpoint = self.server.endpoint
        except RuntimeError as exc:
            self.why = f"not measured: {exc}"

    def credentials(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": self._module.KEY, "AWS_SECRET_ACCESS_KEY": self._module.SECRET,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def describe(self) -> dict[str, Any]:
        if self.why is not None:
            return {"why": self.why}
        return {"kind": "SeaweedFS on loopback (its data on the same disk, outside the throttle)",
                "endpoint": self.endpoint, "bucket": BUCKET}

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.server.stop()


class Drive:
    """A fresh cossd device mounted for the offload run; its daemon is the drive, started by the
    bench outside the workers' cgroups (a drive's memory is not the host's), with the store's
    credentials in its environment: it archives from its own side (docs/tiers.md)."""

    def __init__(self, root: Path, store: Store) -> None:
        from ...emulator import Device
        from ...fs import daemon

        root.mkdir(parents=True)
        self.backing, self.mountpoint = root / "backing", root / "mnt"
        self.mountpoint.mkdir()
        self.store = store
        Device.format(self.backing)
        self._daemon = daemon
        saved = dict(os.environ)
        os.environ.update(store.credentials() if store.why is None else {})
        try:
            self.pid = daemon.start_background(self.backing, self.mountpoint)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def archive_every(self, namespace: str, every: int, url: str) -> None:
        from ...client import AdminClient
        from ...client.archive import set_archive_policy

        with AdminClient(self.mountpoint) as admin:
            set_archive_policy(admin, admin.nsid(namespace), {"url": url, "every": every, "keep_local": 2,
                                                              "keep_remote": 3, "endpoint_url": self.store.endpoint})

    def archive_report(self, namespace: str, wait_s: float) -> dict[str, Any]:
        """What the drive archived (log page C4h): once nothing waits or uploads, or after
        wait_s; the policy is turned off then."""
        from ...client import AdminClient
        from ...client.archive import archive_statistics, set_archive_policy

        with AdminClient(self.mountpoint) as admin:
            nsid = admin.nsid(namespace)
            deadline = time.monotonic() + wait_s
            while True:
                page = archive_statistics(admin, nsid)
                state = page["policies"].get(namespace, {}).get("state", {})
                if (not state.get("pending") and not state.get("uploading")) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            set_archive_policy(admin, nsid, None)
        traffic = page["namespaces"].get(namespace, {})
        return {"snapshots_taken": state.get("snapshots_taken", 0),
                "versions_archived": state.get("versions_archived", 0), "coalesced": state.get("coalesced", 0),
                "pending": len(state.get("pending", [])) + bool(state.get("uploading")),
                "last_error": state.get("last_error"), "network_bytes_sent": traffic.get("network_bytes_sent", 0)}

    def __enter__(self) -> "Drive":
        return self

    def __exit__(self, *exc: object) -> None:
        self._daemon.stop_background(self.mountpoint, self.pid)
