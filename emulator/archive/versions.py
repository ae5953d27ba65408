"""The archive tier: a snapshot uploaded by the device to an S3-compatible object store, and a
namespace restored from one (disaster recovery). boto3 is optional (the `tiers` extra).

An archived version lives under s3://BUCKET/PREFIX/<namespace>/<tag>/ as four objects: `state`
(the snapshot's state file, a multipart upload of fixed-size chunks), `sb` (its superblock,
whose block checksums cover the state), `meta.json` (the snapshot's description) and
`manifest.json`, written last: a version is complete exactly when its manifest exists, and
the manifest carries every chunk's CRC32C, those of `sb` and `meta.json`, and its own
(`manifest_crc32c`, over its canonical bytes), which a restore verifies before anything is built.
docs/tiers.md describes the layout and the procedure.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import kernels
from ...protocol import manifest_seal
from ...protocol.pacing import AimdWindow, StoreMeter
from ...protocol.status import DeviceError, Status
from .. import media
from ..jobs import Job, JobTable
from ..namespace import Namespace
from ..namespace import snapshot_pin
from ..namespace.snapshot_pin import same_state
from ..namespace.snapshots import Snapshot
from ..superblock import Superblock

if TYPE_CHECKING:
    from ..device import Device

from .store import (DAEMON, DEFAULT_CHUNK_BYTES, DEFAULT_MEMORY_BYTES, LIST_KEYS, MANIFEST_CHECKSUM,  # noqa: F401
                            GENERATION_MANIFEST_VERSION, MANIFEST_FORMAT, MANIFEST_OBJECT, MANIFEST_VERSION, UNCHECKED_MANIFEST_VERSION, MAX_CHUNK_BYTES, MAX_MEMORY_BYTES, MAX_PARTS,
                            META_OBJECT, MIN_CHUNK_BYTES, PAYLOAD_KEYS, STATE_OBJECT, SUPERBLOCK_OBJECT,
                            GENERATION_CHARS, Location, Store, Traffic, object_key, parse_endpoint, parse_url)

log = logging.getLogger("cossd.emulator.archive")

# Held while a version is added to or taken from the running set.
_RUNNING = threading.Lock()
# In the backing directory: {nsid: lineage}, the lineage of each namespace of the device that
# archived a version (lineage_of). Held while it is read and written.
LINEAGE_FILE = "archive_lineage.json"
_LINEAGE = threading.Lock()
# A part back slower than this rate (its bytes over its latency) halves the window of parts in
# flight; one back within it opens the window by one: 1 s for an 8 MiB part.
PART_TARGET_BYTES_PER_S = 8 << 20


# ---------------------------------------------------------------------- lineage


def lineage_of(device: Device, namespace: Namespace) -> str:
    """The lineage of `namespace`: which namespace instance wrote a version (each manifest
    carries it). Minted at random the first time the instance archives, and kept in the backing
    directory under its nsid, which the device never gives again. So a namespace deleted and
    created again under the same name, a clone, and a namespace restored from the store (on a
    new drive or not) each have a lineage of their own; the policy's store retention only ever
    deletes versions of the namespace's own lineage. A file that cannot be read is replaced
    (said in the log): its namespaces then get new lineages, so the policy deletes fewer
    versions, never others'."""
    path: Path = device.path / LINEAGE_FILE
    key = str(namespace.nsid)
    with _LINEAGE:
        known: dict[str, Any] = {}
        try:
            read = media.read_json(path)
            if not isinstance(read, dict):
                raise ValueError("not a JSON object")
            known = read
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("%s cannot be read (%s): written again; the policy's versions archived before keep "
                        "their place in the store (retention deletes only those of a namespace's lineage)",
                        path, exc)
        value = known.get(key)
        if isinstance(value, str) and value:
            return value
        live = {str(other.nsid) for other in list(device.namespaces.values())} | {key}
        lineage = f"{device.identity.get('serial', '')}-{namespace.nsid}-{secrets.token_hex(8)}"
        try:
            media.atomic_write_json(path, {k: v for k, v in known.items() if k in live} | {key: lineage})
        except OSError as exc:
            raise media.media_error(exc, f"writing {path}") from exc
        return lineage


def _same_layout(spec: dict[str, Any]) -> str:
    """A namespace description without what a restore or a clone changes (name, first step)."""
    return json.dumps({k: v for k, v in spec.items() if k not in ("name", "initial_step")}, sort_keys=True)


def stored_version_of(store: Store, version: Location, namespace: Namespace, snapshot: Snapshot) -> bool | None:
    """Whether the store holds a complete version at `version`, and of what: None, none (no
    manifest: nothing, or an upload cut short); True, one of the same state as `snapshot` (its
    step, its namespace's layout, its superblock's hyperparameters and block checksums: e.g. the
    version a drive was restored from, snapshotted again); False, another state. A manifest or
    `sb` that cannot be read or fails its checks is SNAPSHOT_EXISTS: a version is there, and
    nothing says it is this one."""
    try:
        manifest = read_manifest(store, version, accept_unchecked=True)
    except DeviceError as exc:
        if exc.status == Status.SNAPSHOT_NOT_FOUND:
            return None
        if exc.status != Status.UNRECOVERED_READ_ERROR:
            raise
        raise DeviceError(Status.SNAPSHOT_EXISTS, f"{version.url} holds a manifest that cannot be read "
                                                  f"({exc.message}); it is not replaced") from None
    if int(manifest["step"]) != snapshot.step or int(manifest["state_bytes"]) != namespace.snapshots.copy_bytes \
            or _same_layout(manifest["spec"]) != _same_layout(namespace.spec.to_json()):
        return False
    raw = store.get(version.bucket, object_key(version, manifest, SUPERBLOCK_OBJECT))
    expected = manifest["objects"][SUPERBLOCK_OBJECT]
    stored = Superblock.decode(raw, namespace.total_blocks, len(namespace.spec.group_hypers))
    if len(raw) != expected["bytes"] or kernels.crc32c(raw) != expected["crc32c"] or stored is None:
        raise DeviceError(Status.SNAPSHOT_EXISTS, f"{version.url}/{SUPERBLOCK_OBJECT} fails its CRC32C (or does "
                                                  "not decode); the version there is not replaced")
    return same_state(stored, snapshot.superblock)


# ---------------------------------------------------------------------- upload


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked ARCHIVE payload."""

    tag: str
    root: Location
    endpoint_url: str | None
    chunk_bytes: int
    memory_bytes: int
    overwrite: bool

    @property
    def in_flight(self) -> int:
        """Chunks held at once: the memory bound over the chunk size (at least one)."""
        return max(1, self.memory_bytes // self.chunk_bytes)


def int_field(payload: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    """payload[key] (else `default`), an integer in [low, high], or INVALID_FIELD saying so."""
    value = payload.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise DeviceError(Status.INVALID_FIELD, f"{key} must be an integer from {low} to {high}, got {value!r}")
    return value


def parse_request(payload: Any) -> Request:
    if not isinstance(payload, dict):
        raise DeviceError(Status.INVALID_FIELD, "payload must be a JSON object")
    unknown = set(payload) - PAYLOAD_KEYS
    if unknown:
        raise DeviceError(Status.INVALID_FIELD, f"unknown key(s) {', '.join(sorted(unknown))}; "
                                                f"use {', '.join(sorted(PAYLOAD_KEYS))}")
    for key in ("tag", "url"):
        if key not in payload:
            raise DeviceError(Status.INVALID_FIELD, f"payload needs {key}")
    endpoint = parse_endpoint(payload.get("endpoint_url"))
    if not isinstance(payload.get("overwrite", False), bool):
        raise DeviceError(Status.INVALID_FIELD, "overwrite must be true or false")
    chunk = int_field(payload, "chunk_bytes", DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    memory = int_field(payload, "memory_bytes", DEFAULT_MEMORY_BYTES, chunk, MAX_MEMORY_BYTES)
    return Request(payload["tag"], parse_url(payload["url"]), endpoint, chunk, memory,
                   payload.get("overwrite", False))


def chunk_ranges(size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(offset, min(size, offset + chunk_bytes)) for offset in range(0, size, chunk_bytes)] or [(0, 0)]


def upload_state(store: Store, fd: int, size: int, bucket: str, key: str, request: Request,
                 job: Job) -> list[int]:
    """Upload `size` bytes of `fd` as the multipart object `key`, resuming an upload cut short
    (a part whose size and MD5 match the chunk is kept); at most `request.in_flight` chunks
    are in memory at once. Returns each chunk's CRC32C."""
    ranges = chunk_ranges(size, request.chunk_bytes)
    upload_id, existing = store.pending_upload(bucket, key)
    if upload_id is None:
        upload_id = store.start_upload(bucket, key)
    crcs = [0] * len(ranges)
    etags: dict[int, str] = {}
    # Parts in flight: at most the memory bound's in_flight, and within that as many as the
    # store takes without slowing down (AIMD on each part's latency: a congested store gets
    # fewer requests at once, not a queue of them).
    window = AimdWindow(min(2, request.in_flight), request.in_flight,
                        latency_target_s=request.chunk_bytes / PART_TARGET_BYTES_PER_S)
    meter = StoreMeter()
    room = threading.Condition()
    held = [0]  # chunks in memory now: read, and not yet sent or resumed
    failed: list[BaseException] = []
    lock = threading.Lock()

    def give_back() -> None:
        with room:
            held[0] -= 1
            room.notify_all()

    def send(number: int, data: bytes) -> None:
        started, ok = time.monotonic(), False
        try:
            etag = store.put_part(bucket, key, upload_id, number, data)
            ok = True
            with lock:
                etags[number] = etag
                job.bytes_done += len(data)
            store.bump("parts_uploaded")
        except BaseException as exc:
            failed.append(exc)
        finally:
            ended = time.monotonic()
            meter.record(started, ended, len(data), ok)
            if ok:
                window.success(ended - started)
            else:
                window.failure()
            give_back()

    with concurrent.futures.ThreadPoolExecutor(request.in_flight, thread_name_prefix="cossd-archive") as pool:
        for index, (start, stop) in enumerate(ranges):
            with room:  # blocks while the window's chunks are held: bounded memory
                while held[0] >= window.limit and not failed:
                    room.wait()
                if failed:
                    break
                held[0] += 1
            data = media.read_exact(fd, stop - start, start, "the snapshot's state")
            crcs[index] = kernels.crc32c(data)
            have = existing.get(index + 1)
            if have is not None and have[1] == len(data) and \
                    have[0].strip('"') == hashlib.md5(data, usedforsecurity=False).hexdigest():
                with lock:
                    etags[index + 1] = have[0]
                    job.bytes_done += len(data)
                store.bump("parts_resumed")
                give_back()
                continue
            pool.submit(send, index + 1, data)
            del data  # the pool's task holds the only reference now
    store.bump("window_increases", window.increases)
    store.bump("window_decreases", window.decreases)
    if failed:
        raise failed[0]
    pace = meter.summary()
    log.info("s3://%s/%s: parts in flight ended at %d of %d (%d up, %d down); %s", bucket, key, window.limit,
             request.in_flight, window.increases, window.decreases,
             ", ".join(f"{name} {value:.3g}" for name, value in pace.items() if value is not None))
    store.finish_upload(bucket, key, upload_id, etags)
    stored = store.size(bucket, key)
    if stored != size:
        raise DeviceError(Status.DATA_TRANSFER_ERROR,
                          f"s3://{bucket}/{key} holds {stored} bytes after the upload, expected {size}")
    return crcs


def manifest_for(namespace: Namespace, snapshot: Snapshot, request: Request, crcs: list[int],
                 superblock: bytes, meta: bytes, serial: str, lineage: str,
                 generation: str | None = None) -> dict[str, Any]:
    named = {"generation": generation} if generation else {}  # object_key: a replaced version's objects
    return named | {
        "format": MANIFEST_FORMAT, "version": GENERATION_MANIFEST_VERSION if generation else MANIFEST_VERSION,
        "namespace": namespace.name, "nsid": namespace.nsid, "lineage": lineage, "tag": snapshot.tag,
        "snapshot_id": snapshot.snapshot_id, "step": snapshot.step,
        "created": snapshot.created, "device_serial": serial,
        "archived": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "spec": namespace.spec.to_json(), "total_blocks": namespace.total_blocks,
        "state_bytes": namespace.snapshots.copy_bytes, "chunk_bytes": request.chunk_bytes,
        "chunks_crc32c": crcs,
        "objects": {
            STATE_OBJECT: {"bytes": namespace.snapshots.copy_bytes},
            SUPERBLOCK_OBJECT: {"bytes": len(superblock), "crc32c": kernels.crc32c(superblock)},
            META_OBJECT: {"bytes": len(meta), "crc32c": kernels.crc32c(meta)},
        },
    }


def pin_snapshot(namespace: Namespace, tag: object) -> tuple[Snapshot, int, bytes, bytes]:
    """Snapshot `tag` pinned for the upload (namespace/snapshot_pin.py): it, its state file's
    descriptor, its superblock's and meta.json's bytes, all one snapshot's."""
    return snapshot_pin.pin(namespace, tag, "archive", "nothing was uploaded")


def start(device: Device, jobs: JobTable, namespace: Namespace, payload: Any,
          traffic: Traffic, running: set[str]) -> Job:
    """Check the request, pin the snapshot (pin_snapshot), check the store, then upload it as
    a job. `traffic` is the namespace's network counters; `running` the versions being archived."""
    request = parse_request(payload)
    # Pinned first, before the store is asked anything: from here on a delete, or a delete and
    # a create of the same tag, changes nothing of what is uploaded (it stays readable through
    # the descriptor) nor of how the manifest labels it.
    snapshot, source_fd, superblock, meta = pin_snapshot(namespace, request.tag)
    try:
        version = request.root.child(namespace.name, snapshot.tag)
        parts = len(chunk_ranges(namespace.snapshots.copy_bytes, request.chunk_bytes))
        if parts > MAX_PARTS:
            raise DeviceError(Status.INVALID_FIELD, f"{parts} chunks of {request.chunk_bytes} bytes exceed S3's "
                                                    f"{MAX_PARTS} parts: use a larger chunk_bytes")
        store = Store(request.endpoint_url, request.in_flight, traffic, holder=DAEMON)  # counted as they move
        store.check_bucket(version)
        manifest_key = version.key(MANIFEST_OBJECT)
        replacing = store.exists(version.bucket, manifest_key)
        if replacing and not request.overwrite:
            raise DeviceError(Status.SNAPSHOT_EXISTS, f"{version.url} is archived already "
                                                      "(replaced only when asked: overwrite, `cossd archive --force`)")
        # The version replaced stays whole until the new manifest takes its place: the new
        # objects go under a generation of their own (object_key), its old ones go after.
        generation = {"generation": secrets.token_hex(8)} if replacing else None
        lineage = lineage_of(device, namespace)
        with _RUNNING:
            if version.url in running:
                raise DeviceError(Status.INVALID_FIELD, f"{version.url} is being archived by another job")
            running.add(version.url)
    except BaseException:
        os.close(source_fd)
        raise
    job = Job(jobs.next_id(), "archive", namespace.nsid, namespace.name, snapshot.tag,
              snapshot.step, version.url, namespace.snapshots.copy_bytes)
    serial = str(device.identity.get("serial", ""))
    completed = False

    def work(job: Job) -> None:
        crcs = upload_state(store, source_fd, job.bytes_total, version.bucket,
                            object_key(version, generation, STATE_OBJECT), request, job)
        store.put(version.bucket, object_key(version, generation, SUPERBLOCK_OBJECT), superblock)
        store.put(version.bucket, object_key(version, generation, META_OBJECT), meta)
        manifest = manifest_for(namespace, snapshot, request, crcs, superblock, meta, serial, lineage,
                                generation["generation"] if generation else None)
        encoded = encode_manifest(manifest)
        try:
            store.put(version.bucket, manifest_key, encoded)  # the version is the new one
        except DeviceError as exc:
            # A PUT the client saw fail may have landed all the same (the answer lost on the
            # way back): where the store's manifest is this job's, byte for byte, the version
            # is complete (a first archive) or replaced (its generation is this job's alone),
            # and the job says so rather than a failure the store contradicts.
            if not _holds_manifest(store, version, encoded):
                raise
            log.warning("%s: the manifest's upload was reported failed (%s), yet the store holds it: the "
                        "version is this job's", version.url, exc.message)
        nonlocal completed
        completed = True
        if generation:
            drop_unnamed(store, version, manifest)
        log.info("namespace %s: snapshot %s (step %d) archived to %s", namespace.name,
                 snapshot.tag, snapshot.step, version.url)

    def cleanup() -> None:
        os.close(source_fd)
        # The new objects of a replacement that did not happen. Where the store cannot be
        # asked which generation its manifest names, they stay (as space only).
        named = _names_generation(store, version, generation["generation"]) if generation and not completed else None
        if named:
            # The manifest's PUT landed though the device saw it fail, and could not tell at
            # once (its read-back failed too): the version is the new one, the job failed.
            log.warning("%s: the replacement's manifest is in the store although the job failed: the version "
                        "is the new one (step %d)", version.url, snapshot.step)
            drop_unnamed(store, version, generation)
        elif named is False:
            for name in (STATE_OBJECT, SUPERBLOCK_OBJECT, META_OBJECT):
                try:
                    store.delete(version.bucket, object_key(version, generation, name))
                except DeviceError as exc:
                    log.warning("%s: %s", version.url, exc.message)
            with contextlib.suppress(DeviceError):
                store.abort_uploads(version, keep=version.key(STATE_OBJECT))  # a plain upload may resume
        with _RUNNING:
            running.discard(version.url)
        store.bump("archives_completed" if completed else "archives_failed")

    return jobs.start(job, work, cleanup)


def drop_unnamed(store: Store, version: Location, manifest: dict[str, Any] | None) -> None:
    """Every object and unfinished upload of the version's folder that `manifest` does not
    name (None: all of them): after a replacement, the replaced version's and those of a
    replacement cut short before (a kill -9); for a version deleted, everything. Best effort:
    a leftover only takes space."""
    named = set() if manifest is None else {version.key(MANIFEST_OBJECT)} | {
        object_key(version, manifest, name) for name in (STATE_OBJECT, SUPERBLOCK_OBJECT, META_OBJECT)}
    try:
        for key in [key for key in store.keys(version) if key not in named]:
            store.delete(version.bucket, key)
        store.abort_uploads(version)
    except DeviceError as exc:
        log.warning("%s: objects of a version it replaced were left in the store: %s", version.url, exc.message)


def _holds_manifest(store: Store, version: Location, encoded: bytes) -> bool:
    """Whether the manifest at `version` is `encoded`, byte for byte (False where it cannot
    be read: nothing says it landed)."""
    try:
        return store.get(version.bucket, version.key(MANIFEST_OBJECT)) == encoded
    except DeviceError:
        return False


def _names_generation(store: Store, version: Location, generation: str) -> bool | None:
    """Whether the manifest at `version` names `generation` now (None: it cannot be told)."""
    try:
        return read_manifest(store, version, accept_unchecked=True).get("generation") == generation
    except DeviceError as exc:
        return False if exc.status == Status.SNAPSHOT_NOT_FOUND else None


# ---------------------------------------------------------------------- the manifest


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The stored manifest.json: the fields and their checksum, indented for a reader."""
    # The seal (protocol/manifest_seal.py) is the one the trainer's tiered manifests carry too.
    return (json.dumps(manifest_seal.sealed(manifest, MANIFEST_CHECKSUM), indent=1, sort_keys=True)
            + "\n").encode()


def decode_manifest(raw: bytes, url: str, *, accept_unchecked: bool = False) -> dict[str, Any]:
    """A manifest.json read back, its checksum and form verified; UNRECOVERED_READ_ERROR naming
    the object otherwise. A format-1 manifest (no checksum of its own) only with
    `accept_unchecked`, and then marked `"manifest_checked": False`."""
    where = f"{url}/{MANIFEST_OBJECT}"
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, not {MANIFEST_FORMAT!r}")
        version = manifest.get("version")
        if version == UNCHECKED_MANIFEST_VERSION:
            if not accept_unchecked:
                raise DeviceError(Status.UNRECOVERED_READ_ERROR, (
                    f"{where} is format {version}, which carries no checksum of its own: a flipped bit in it "
                    "(the namespace's spec, its sizes) would go unnoticed. Restore it only if you trust it: "
                    "`cossd restore --accept-unchecked-manifest` (its chunks and blocks are still verified)"))
        elif version not in (MANIFEST_VERSION, GENERATION_MANIFEST_VERSION):
            raise ValueError(f"version {version!r}: this cossd reads {UNCHECKED_MANIFEST_VERSION}, "
                             f"{MANIFEST_VERSION} and {GENERATION_MANIFEST_VERSION}")
        else:
            problem = manifest_seal.seal_problem(manifest, MANIFEST_CHECKSUM)
            if problem is not None:
                raise DeviceError(Status.UNRECOVERED_READ_ERROR, (
                    f"{where} {problem}: the manifest was altered or damaged in the store; nothing was restored"))
        for key in ("namespace", "tag", "spec", "objects", "archived"):
            manifest[key]  # noqa: B018 (KeyError names a missing field)
        int(manifest["state_bytes"]), int(manifest["chunk_bytes"]), int(manifest["step"])
        if not isinstance(manifest.get("lineage", ""), str):
            raise ValueError(f"lineage {manifest['lineage']!r} is not a string")
        # A version 2 may name a generation too: the build before version 3 wrote those.
        if ("generation" not in manifest and version == GENERATION_MANIFEST_VERSION) or (
                "generation" in manifest and version == UNCHECKED_MANIFEST_VERSION):
            raise ValueError(f"version {version} {'without' if version == GENERATION_MANIFEST_VERSION else 'with'} "
                             "a generation field")
        generation = manifest.get("generation", "0")
        if not (isinstance(generation, str) and 0 < len(generation) <= 32 and set(generation) <= GENERATION_CHARS):
            raise ValueError(f"generation {generation!r} is not a short hex string")
        [int(crc) for crc in manifest["chunks_crc32c"]]
        for name in (SUPERBLOCK_OBJECT, META_OBJECT):
            int(manifest["objects"][name]["bytes"]), int(manifest["objects"][name]["crc32c"])
    except DeviceError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        detail = f"no field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise DeviceError(Status.UNRECOVERED_READ_ERROR, f"{where} cannot be read: {detail}") from None
    manifest["manifest_checked"] = version != UNCHECKED_MANIFEST_VERSION
    return manifest


# ---------------------------------------------------------------------- listing


def list_versions(store: Store, root: Location,
                  unreadable: list[dict[str, str]] | None = None) -> list[dict[str, Any]]:
    """Every complete version under `root` (those with a manifest), oldest step first. A
    manifest that fails its checks is left out, logged, and added to `unreadable` (url, error)
    where given; a format-1 manifest is listed with "manifest_checked": False."""
    versions = []
    depth = len([p for p in root.prefix.split("/") if p])
    for key in store.keys(root):
        parts = key.split("/")
        if parts[-1] != MANIFEST_OBJECT or len(parts) != depth + 3:
            continue
        location = Location(root.bucket, "/".join(parts[:-1]))
        try:
            manifest = decode_manifest(store.get(root.bucket, key), location.url, accept_unchecked=True)
        except DeviceError as exc:
            if exc.status != Status.UNRECOVERED_READ_ERROR:
                raise
            log.warning("%s", exc.message)
            if unreadable is not None:
                unreadable.append({"url": location.url, "error": exc.message})
            continue
        versions.append({"namespace": manifest["namespace"], "tag": manifest["tag"],
                         "step": manifest["step"], "bytes": manifest["state_bytes"],
                         "archived": manifest["archived"], "url": location.url,
                         "endpoint": store.endpoint, "manifest_checked": manifest["manifest_checked"],
                         # None: archived before manifests named their lineage.
                         "lineage": manifest.get("lineage"),
                         # Where its objects are (object_key); None: their plain names.
                         "generation": manifest.get("generation")})
    return sorted(versions, key=lambda v: (v["namespace"], v["step"], v["tag"]))


def read_manifest(store: Store, version: Location, *, accept_unchecked: bool = False) -> dict[str, Any]:
    """The version's manifest, verified (decode_manifest); SNAPSHOT_NOT_FOUND where it has none."""
    try:
        raw = store.get(version.bucket, version.key(MANIFEST_OBJECT))
    except DeviceError as exc:
        if exc.status == Status.SNAPSHOT_NOT_FOUND:
            raise DeviceError(Status.SNAPSHOT_NOT_FOUND,
                              f"{version.url} is no complete archived version (no {MANIFEST_OBJECT}; "
                              "an upload cut short is never complete)") from None
        raise
    return decode_manifest(raw, version.url, accept_unchecked=accept_unchecked)
