"""The archive tier's automatic policy: a snapshot every K committed steps, uploaded by the device in the background; the last N kept on the drive and M in the store; versions that wait while the store is slow, coalesced when too many wait."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...protocol.status import DeviceError, Status
from .. import media
from . import versions as archive
from ..jobs import JobTable
from ..namespace import Namespace
from ..namespace.snapshots import MAX_SNAPSHOTS

if TYPE_CHECKING:
    from ..device import Device

log = logging.getLogger("cossd.emulator.archive.policy")

POLICY_FILE = "archive_policy.json"  # in the backing directory: {namespace name: policy}
AUTO_PREFIX = "auto-"  # the policy's own snapshots; it never touches any other
POLICY_KEYS = {"url", "every", "keep_local", "keep_remote", "max_pending", "spill_capacity", "endpoint_url",
               "chunk_bytes", "memory_bytes"}
# Seconds between the runner's looks at the namespaces: a new version waits at most this long
# after its step commits. A failed upload is retried after RETRY_S (the store may be back).
TICK_S = 0.2
RETRY_S = 5.0


@dataclasses.dataclass(frozen=True)
class Policy:
    """One namespace's policy, as ARCHIVE's `policy` payload gives it and the file keeps it."""

    url: str
    every: int  # a new version once the committed step is this many past the last one
    keep_local: int  # the policy's snapshots kept on the drive (uploaded or not)
    keep_remote: int  # the policy's versions kept in the store
    max_pending: int  # versions waiting for the store at most; more: the older ones coalesced
    endpoint_url: str | None
    chunk_bytes: int
    memory_bytes: int
    # The drive's bytes that waiting versions (snapshots) may take at most; None: no bound
    # but max_pending. Older waiting versions are coalesced beyond it, as beyond max_pending.
    spill_capacity: int | None = None

    def waiting_at_most(self, version_bytes: int) -> int:
        """How many versions may wait for the store: max_pending, and no more than fit in
        spill_capacity (at least the newest one, which set() checked fits)."""
        if self.spill_capacity is None or version_bytes <= 0:
            return self.max_pending
        return max(1, min(self.max_pending, self.spill_capacity // version_bytes))

    @classmethod
    def parse(cls, payload: Any) -> "Policy":
        if not isinstance(payload, dict):
            raise DeviceError(Status.INVALID_FIELD, "policy must be a JSON object (or null: off)")
        unknown = set(payload) - POLICY_KEYS
        if unknown:
            raise DeviceError(Status.INVALID_FIELD, f"unknown policy key(s) {', '.join(sorted(unknown))}; "
                                                    f"use {', '.join(sorted(POLICY_KEYS))}")
        if "url" not in payload or "every" not in payload:
            raise DeviceError(Status.INVALID_FIELD, "a policy needs url and every")
        root = archive.parse_url(payload["url"])
        endpoint = archive.parse_endpoint(payload.get("endpoint_url"))
        chunk = archive.int_field(payload, "chunk_bytes", archive.DEFAULT_CHUNK_BYTES, archive.MIN_CHUNK_BYTES,
                       archive.MAX_CHUNK_BYTES)
        keep_local = archive.int_field(payload, "keep_local", 2, 1, MAX_SNAPSHOTS // 2)
        return cls(url=root.url, every=archive.int_field(payload, "every", 0, 1, 1 << 40), keep_local=keep_local,
                   keep_remote=archive.int_field(payload, "keep_remote", 3, 1, 1 << 20),
                   # Waiting versions are snapshots on the drive: never more than are kept.
                   max_pending=archive.int_field(payload, "max_pending", keep_local, 1, keep_local),
                   endpoint_url=endpoint, chunk_bytes=chunk,
                   memory_bytes=archive.int_field(payload, "memory_bytes", archive.DEFAULT_MEMORY_BYTES, chunk,
                                       archive.MAX_MEMORY_BYTES),
                   spill_capacity=(None if payload.get("spill_capacity") is None else
                                   archive.int_field(payload, "spill_capacity", 0, 1, 1 << 60)))

    def archive_payload(self, tag: str) -> dict[str, Any]:
        # Never overwrite: the policy never deletes a complete version to upload one. A version
        # cut short before a restart has no manifest, so the rerun resumes it all the same.
        payload = {"tag": tag, "url": self.url, "chunk_bytes": self.chunk_bytes,
                   "memory_bytes": self.memory_bytes, "overwrite": False}
        return payload | ({"endpoint_url": self.endpoint_url} if self.endpoint_url else {})


@dataclasses.dataclass
class PolicyState:
    """What the policy did since the daemon started, for log page C4h."""

    snapshots_taken: int = 0
    versions_archived: int = 0
    coalesced: int = 0  # versions dropped before upload because too many waited
    deleted_local: int = 0
    deleted_remote: int = 0
    upload_failures: int = 0
    last_error: str | None = None
    last_snapshot_step: int = 0
    last_archived_step: int = 0
    pending: list[str] = dataclasses.field(default_factory=list)  # oldest first
    spill_bytes: int = 0  # the drive's bytes the waiting versions take (their snapshots)
    uploading: str | None = None
    # The upload under way: its own thread starts the archive job, waits for it and trims
    # the store, so a store that hangs holds that thread only, never the policy's.
    upload: concurrent.futures.Future[None] | None = dataclasses.field(default=None, repr=False)
    retry_at: float = 0.0  # after a failure, nothing new is tried before this (monotonic s)
    resumed: bool = False  # what an earlier daemon left (snapshots, versions) was looked at
    nsid: int = 0  # the namespace instance this state is of (one created again starts afresh)

    def describe(self) -> dict[str, Any]:
        private = ("upload", "retry_at", "resumed", "nsid")  # asdict would deep-copy the Future
        view = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in private}
        view["pending"] = list(self.pending)
        return view


def _auto_step(tag: str) -> int:
    return int(tag[len(AUTO_PREFIX):])


class PolicyRunner:
    """One thread per controller that applies every namespace's policy. It takes snapshots
    (the committed copy pinned while the state is copied) and starts archive jobs; the
    uploads run on the jobs' threads, so a training step never waits for the store."""

    def __init__(self, device: Device, jobs: JobTable, traffic_of: Callable[[str], archive.Traffic],
                 running: set[str]) -> None:
        self.device, self.jobs, self.traffic_of, self.running = device, jobs, traffic_of, running
        self.path: Path = device.path / POLICY_FILE
        self._lock = threading.Lock()
        self.policies: dict[str, Policy] = {}
        self.states: dict[str, PolicyState] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Why the policies kept in the backing directory could not be read (None: they could):
        # shown in log page C4h and `cossd archive --status` until a policy is set again.
        self.load_error: str | None = None
        self._load()

    # ------------------------------------------------------------------ configuration

    def _load(self) -> None:
        if not self.path.is_file():
            return
        try:
            saved = media.read_json(self.path)
            self.policies = {name: Policy(**value) for name, value in saved.items()}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            # Never silent: the device still serves, without the policies, and says why, in its
            # log and in the log page.
            self.load_error = (f"{self.path} cannot be read ({exc}): no automatic archiving until a policy "
                               "is set again")
            log.error("%s", self.load_error)
            self.policies = {}
            return
        if self.policies:
            self._start()

    def set(self, namespace: Namespace, payload: Any) -> dict[str, Any]:
        """Turn `namespace`'s policy on (a dict) or off (None); kept across restarts."""
        policy = None if payload is None else Policy.parse(payload)
        version_bytes = namespace.snapshots.copy_bytes
        if policy is not None and policy.spill_capacity is not None and policy.spill_capacity < version_bytes:
            raise DeviceError(Status.INVALID_FIELD,
                              f"spill_capacity {policy.spill_capacity} bytes holds no version of namespace "
                              f"{namespace.name!r} (a version is a snapshot of {version_bytes} bytes)")
        if policy is not None:
            store = archive.Store(policy.endpoint_url, traffic=self.traffic_of(namespace.name), holder=archive.DAEMON)
            store.check_bucket(archive.parse_url(policy.url))  # refused now, not in the background
        with self._lock:
            policies = dict(self.policies)
            if policy is None:
                policies.pop(namespace.name, None)
            else:
                policies[namespace.name] = policy
            media.atomic_write_json(self.path, {name: dataclasses.asdict(p) for name, p in policies.items()})
            self.policies = policies
            self.load_error = None  # the file is whole again
            state = self._state_of(namespace)
        if policy is not None:
            # What the drive and the store hold already, looked at now, while the store has
            # just answered (after a restart the policy's thread looks, at its first tick).
            self._resume(namespace, policy, state,
                         sorted((t for t in namespace.snapshots.tags() if t.startswith(AUTO_PREFIX)), key=_auto_step))
        log.info("namespace %s: automatic archive %s", namespace.name,
                 "off" if policy is None else dataclasses.asdict(policy))
        if policy is not None:
            self._start()
        return self.describe(namespace.name) | {"state": state.describe()}

    def describe(self, name: str) -> dict[str, Any]:
        policy = self.policies.get(name)
        return {"policy": None if policy is None else dataclasses.asdict(policy)}

    def page(self) -> dict[str, Any]:
        with self._lock:
            names = sorted(set(self.policies) | set(self.states))
            return {name: self.describe(name) | {"state": self._current_state(name).describe()} for name in names}

    def _current_state(self, name: str) -> PolicyState:
        """The state the page shows for `name`: a fresh one where the name is another namespace's
        now (deleted and created again) and the policy's thread has not looked at it yet, so no
        reader sees the old instance's figures as the new one's."""
        state = self.states.get(name)
        namespace = self.device.namespaces.get(name)
        if state is None or (namespace is not None and state.nsid != namespace.nsid):
            return PolicyState(nsid=0 if namespace is None else namespace.nsid)
        return state

    # ------------------------------------------------------------------ the thread

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cossd-archive-policy", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop taking snapshots and starting uploads; an upload under way is left to its job
        (a restart resumes its multipart upload)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            for name, policy in list(self.policies.items()):
                found = self.device.namespaces.get(name)
                namespace = found.as_optimizer() if found is not None else None
                if namespace is None:
                    continue  # deleted, not (yet) there, or not an optimizer namespace: its policy waits
                try:
                    self.tick(namespace, policy)
                except DeviceError as exc:
                    self._failed(namespace, self._state_of(namespace), exc.message)
                except Exception:  # a bug must be seen, and must not stop the other namespaces
                    log.exception("namespace %s: automatic archive failed", name)

    def tick(self, namespace: Namespace, policy: Policy) -> None:
        """One look at one namespace: the upload that ended, a new version, coalescing, the
        next upload, and the drive's retention, in that order."""
        state = self._state_of(namespace)
        self._finished_upload(namespace, policy, state)
        if time.monotonic() < state.retry_at:
            return  # a failure a moment ago: the store or the drive gets time first
        auto = sorted((t for t in namespace.snapshots.tags() if t.startswith(AUTO_PREFIX)), key=_auto_step)
        if not state.resumed:
            self._resume(namespace, policy, state, auto)
        committed = namespace.committed_step
        if committed > 0 and committed >= state.last_snapshot_step + policy.every and not namespace.loading:
            tag = f"{AUTO_PREFIX}{committed}"
            if tag not in auto:
                namespace.snapshots.create(tag, self.device.reserve)
                auto.append(tag)
                state.snapshots_taken += 1
            state.last_snapshot_step = committed
            state.pending.append(tag)
        waiting_at_most = policy.waiting_at_most(namespace.snapshots.copy_bytes)
        while len(state.pending) > waiting_at_most:
            dropped = state.pending.pop(0)  # the oldest waiting: the newest is what matters
            state.coalesced += 1
            log.warning("namespace %s: %s coalesced: the store is slower than versions come (%d waiting at "
                        "most%s)", namespace.name, dropped, waiting_at_most,
                        "" if policy.spill_capacity is None else f" in {policy.spill_capacity} bytes of spill")
        state.spill_bytes = len(state.pending) * namespace.snapshots.copy_bytes
        if state.upload is None and state.pending:
            state.uploading = state.pending.pop(0)
            state.upload = concurrent.futures.Future()
            threading.Thread(target=self._upload, args=(namespace, policy, state, state.uploading, state.upload),
                             name=f"cossd-archive-{namespace.name}", daemon=True).start()
        self._trim_local(namespace, policy, state, auto)

    def _state_of(self, namespace: Namespace) -> PolicyState:
        """The policy's state for `namespace`: afresh where the name is another namespace's now
        (deleted and created again), whose steps and snapshots are not the old one's."""
        state = self.states.get(namespace.name)
        if state is None or state.nsid != namespace.nsid:
            state = self.states[namespace.name] = PolicyState(nsid=namespace.nsid)
        return state

    def _upload(self, namespace: Namespace, policy: Policy, state: PolicyState, tag: str,
                outcome: concurrent.futures.Future[None]) -> None:
        """One version: the archive job (as ARCHIVE starts it), then the store's retention. A
        version complete in the store already is never replaced: of the same state (the one a
        drive was restored from, snapshotted again), it counts as archived; of another
        (SNAPSHOT_EXISTS), this step is not archived, and said so."""
        try:
            location = archive.parse_url(policy.url).child(namespace.name, tag)
            store = archive.Store(policy.endpoint_url, traffic=self.traffic_of(namespace.name), holder=archive.DAEMON)
            there = archive.stored_version_of(store, location, namespace, namespace.snapshots.get(tag))
            if there is True:
                log.info("namespace %s: %s holds this state (step %d) complete already: counted as archived, "
                         "not uploaded again", namespace.name, location.url, _auto_step(tag))
                state.versions_archived += 1
                state.last_archived_step = max(state.last_archived_step, _auto_step(tag))
                outcome.set_result(None)
                return
            if there is False:
                raise DeviceError(Status.SNAPSHOT_EXISTS, (
                    f"{location.url} holds a complete version of another state (another namespace of this name, "
                    f"or one restored or cloned from it, archived it); the policy never replaces a complete "
                    f"version, so step {_auto_step(tag)} is not archived: give the policy another url, or "
                    "delete that version"))
            job = archive.start(self.device, self.jobs, namespace, policy.archive_payload(tag),
                                self.traffic_of(namespace.name), self.running)
            while job.state == "running":
                if self._stop.wait(0.05):
                    raise DeviceError(Status.NAMESPACE_NOT_READY, "the device is closing")
            if job.state != "done":
                raise DeviceError(Status[job.status] if job.status in Status.__members__ else Status.INTERNAL_ERROR,
                                  job.error or job.status)
            state.versions_archived += 1
            state.last_archived_step = max(state.last_archived_step, _auto_step(tag))
            self._trim_remote(namespace, policy, state, tag)
            outcome.set_result(None)
        except BaseException as exc:  # reported by the policy's thread
            outcome.set_exception(exc)

    def _resume(self, namespace: Namespace, policy: Policy, state: PolicyState, auto: list[str]) -> None:
        """After a restart (or a policy set anew): go on from the newest snapshot of the
        policy, and upload again those of them the store has no complete version of."""
        root = archive.parse_url(policy.url)
        store = archive.Store(policy.endpoint_url, traffic=self.traffic_of(namespace.name), holder=archive.DAEMON)
        lineage = archive.lineage_of(self.device, namespace)
        # Complete versions of this namespace's own lineage only: a version of the same tag
        # another namespace instance archived is not this snapshot (the upload finds out
        # which state it holds, and never replaces it).
        archived = {v["tag"] for v in archive.list_versions(store, root)
                    if v["namespace"] == namespace.name and v["lineage"] == lineage}
        if auto:
            state.last_snapshot_step = max(state.last_snapshot_step, _auto_step(auto[-1]))
        done = [t for t in auto if t in archived]
        if done:
            state.last_archived_step = max(state.last_archived_step, _auto_step(done[-1]))
        waiting = [t for t in auto if t not in archived and _auto_step(t) > state.last_archived_step]
        state.pending = waiting[-policy.waiting_at_most(namespace.snapshots.copy_bytes):]
        state.spill_bytes = len(state.pending) * namespace.snapshots.copy_bytes
        state.resumed = True

    def _failed(self, namespace: Namespace, state: PolicyState, why: str) -> None:
        state.upload_failures += 1
        state.last_error = why
        state.retry_at = time.monotonic() + RETRY_S
        log.error("namespace %s: automatic archive failed (%s); retried in %.0f s", namespace.name, why, RETRY_S)

    def _finished_upload(self, namespace: Namespace, policy: Policy, state: PolicyState) -> None:
        upload = state.upload
        if upload is None or not upload.done():
            return
        tag, state.upload, state.uploading = state.uploading, None, None
        assert tag is not None
        error = upload.exception()
        if error is None:
            return
        exists = isinstance(error, DeviceError) and error.status == Status.SNAPSHOT_EXISTS
        if _auto_step(tag) > state.last_archived_step and not exists:
            state.pending.insert(0, tag)  # tried again, unless newer ones coalesce it
        self._failed(namespace, state, error.message if isinstance(error, DeviceError) else repr(error))

    def _trim_local(self, namespace: Namespace, policy: Policy, state: PolicyState, auto: list[str]) -> None:
        """The policy's snapshots beyond the newest keep_local go, except one waiting or
        being uploaded (coalesced ones wait no more)."""
        keep = set(auto[-policy.keep_local:]) | set(state.pending) | {state.uploading}
        for tag in auto:
            if tag not in keep:
                namespace.snapshots.delete(tag)
                state.deleted_local += 1

    def _trim_remote(self, namespace: Namespace, policy: Policy, state: PolicyState, archived: str) -> None:
        """The policy's versions in the store of this namespace's lineage beyond the newest
        keep_remote go, never `archived` (the one just uploaded): the manifest first, so a
        version being deleted never looks complete. Versions another namespace instance
        archived (before a delete and create under the same name, on the drive a restore came
        from, a legacy manifest without a lineage) are never touched."""
        root = archive.parse_url(policy.url)
        store = archive.Store(policy.endpoint_url, traffic=self.traffic_of(namespace.name), holder=archive.DAEMON)
        lineage = archive.lineage_of(self.device, namespace)
        mine = [v for v in archive.list_versions(store, root)
                if v["namespace"] == namespace.name and v["tag"].startswith(AUTO_PREFIX) and v["lineage"] == lineage]
        mine.sort(key=lambda v: v["step"])
        kept = {v["tag"] for v in mine[-policy.keep_remote:]} | {archived}
        for version in mine:
            if version["tag"] in kept:
                continue
            location = root.child(namespace.name, version["tag"])
            store.delete(location.bucket, location.key(archive.MANIFEST_OBJECT))
            archive.drop_unnamed(store, location, None)  # its objects, and any a replacement left
            state.deleted_remote += 1
            log.info("namespace %s: %s deleted from the store (keeping %d)", namespace.name,
                     location.url, policy.keep_remote)
