"""Races of the archive tier against a real S3 server (SeaweedFS): a snapshot deleted and taken
again under the same tag while its archive starts (by a second client of `cossd serve`, the store
paused with SIGSTOP; and in the daemon's own code at each point of the start), and restores into
a folder that a restore killed with kill -9 left (a user's file put there since, a half-done move
of the device up), a second restore while the first still runs, a restore into a mounted device;
and an export whose snapshot is replaced as it starts."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors
from conftest import start_mount, stop_mount
from cossd.client import AdminClient
from cossd.client import archive as archive_calls
from cossd.client import snapshots as snapshot_calls
from cossd.emulator import Device, DeviceError, Status
from cossd.emulator.archive import restore as archive_restore, versions as archive
from cossd.emulator.jobs import JobTable
from cossd.emulator.snapshots import export as snapshot_export
from cossd.emulator.namespace import NamespaceSpec
from cossd.emulator.superblock import Superblock
from s3_server import WeedServer, weed_in_environment
from served import ServedDevice, write_token
from test_archive import make_namespace, train

pytestmark = pytest.mark.mount

BUCKET = "cossd-races"
MIB = 1 << 20
TINY = (("w", 300_000), ("b", 7))  # 4.2 MB of state: one chunk
WAIT_S = 120.0


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WeedServer]:
    """SeaweedFS on loopback with the bucket made, named by AWS_* in this process's environment
    (so the daemons started meanwhile find it too); the server itself, to pause it."""
    with weed_in_environment(tmp_path_factory.mktemp("seaweedfs"), BUCKET) as server:
        archive.Store().check_bucket(archive.Location(BUCKET, ""))
        yield server


def pause(server: WeedServer, stopped: bool) -> None:
    try:
        os.killpg(server.process.pid, signal.SIGSTOP if stopped else signal.SIGCONT)
    except ProcessLookupError:
        pass


def check_version(url: str, states: dict[int, bytes], tmp_path: Path) -> int | None:
    """What the store holds at `url`: None (no manifest, never complete) or the step of a
    version that is whole and labelled right: the manifest's step is its superblock's, and a
    restore gives, bit for bit, the state the snapshot of that step held (`states`)."""
    location = archive.parse_url(url)
    store = archive.Store()
    try:
        manifest = archive.read_manifest(store, location)
    except DeviceError as exc:
        assert exc.status == Status.SNAPSHOT_NOT_FOUND, exc.message
        return None
    raw = store.get(location.bucket, archive.object_key(location, manifest, archive.SUPERBLOCK_OBJECT))
    stored = Superblock.decode(raw, manifest["total_blocks"],
                               len(NamespaceSpec.from_json(manifest["spec"]).group_hypers))
    assert stored is not None
    meta = json.loads(store.get(location.bucket, archive.object_key(location, manifest, archive.META_OBJECT)))
    assert (meta["step"], meta["id"]) == (manifest["step"], manifest["snapshot_id"]), (meta, manifest)
    assert stored.committed_step == manifest["step"], \
        f"the manifest says step {manifest['step']}, its superblock holds step {stored.committed_step}"
    target = tmp_path / f"check-{time.monotonic_ns()}"
    result = archive_restore.restore(url, target)  # every chunk and block checked
    assert result["step"] == manifest["step"], (result, manifest["step"])
    assert (target / f"ns/{result['namespace']}/state.A").read_bytes() == states[manifest["step"]]
    return int(manifest["step"])


# ---------------------------------------------------------------------- suspicion A: the archive


def test_a_snapshot_replaced_while_its_archive_starts_on_a_served_device(weed: WeedServer, prepared: Path,
                                                                        tmp_path: Path) -> None:
    """Two clients of `cossd serve` (each connection runs its commands on a thread of its own;
    through one mount the kernel runs the control file's writes one at a time): one archives
    snapshot a1 (step 1) while the store is paused, the other deletes a1 and takes it again
    (step 2) meanwhile. The version is the snapshot the archive pinned, whole and labelled with
    its own step, or there is none and the archive said why; never step 1's label on step 2's
    state."""
    states = {1: (prepared / "ns/m/snapshots/a1/state").read_bytes()}
    served = ServedDevice(prepared, write_token(tmp_path / "token"))
    url = f"s3://{BUCKET}/served"
    outcome: dict[str, Any] = {}

    def client() -> AdminClient:
        return AdminClient(served.url, WAIT_S, token_file=tmp_path / "token")

    def start_archive() -> None:
        try:
            with client() as admin:
                outcome["job"] = archive_calls.archive(admin, admin.nsid("m"), "a1", url, chunk_bytes=5 * MIB)
                outcome["final"] = archive_calls.wait_for_archive(admin, outcome["job"])
        except DeviceError as exc:
            outcome["error"] = exc

    try:
        with client() as admin:  # the server has the namespace open and answers
            assert admin.nsid("m") > 0
        pause(weed, True)
        try:
            thread = threading.Thread(target=start_archive)
            thread.start()
            time.sleep(3)  # the server has looked the snapshot up and waits on the store
            assert thread.is_alive() and not outcome, outcome
            with client() as admin:
                snapshot_calls.delete_snapshot(admin, admin.nsid("m"), "a1")
                snapshot_calls.create_snapshot(admin, admin.nsid("m"), "a1")
        finally:
            pause(weed, False)
        thread.join(WAIT_S)
        assert not thread.is_alive()
    finally:
        served.stop()
    states[2] = (prepared / "ns/m/snapshots/a1/state").read_bytes()
    assert states[1] != states[2]
    step = check_version(f"{url}/m/a1", states, tmp_path)
    if step is None:
        assert outcome.get("error") is not None and outcome["error"].status == Status.SNAPSHOT_NOT_FOUND, outcome
        assert "replaced" in outcome["error"].message, outcome["error"].message
    else:
        assert "error" not in outcome, outcome
    assert step == 1  # pinned before the store was asked anything: the snapshot as it was


@pytest.fixture
def prepared(weed: WeedServer, backing: Path, tmp_path: Path) -> Path:
    """A device with namespace m: snapshots a1, b1, c1 of step 1, step 2 committed; unmounted."""
    mounted = start_mount(backing, tmp_path / "mnt-prep")
    try:
        make_namespace(mounted.mountpoint, "m", TINY, steps=1)
        with AdminClient(mounted.mountpoint) as client:
            for tag in ("a1", "b1", "c1"):
                snapshot_calls.create_snapshot(client, client.nsid("m"), tag)
        train(mounted.mountpoint, "m", TINY, 2)
    finally:
        stop_mount(mounted)
    return backing


def wait_job(job: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while job.state == "running":
        assert time.monotonic() < deadline, "the archive job did not end"
        time.sleep(0.02)


def archive_a1(device: Device, url: str, overwrite: bool) -> Any:
    """The daemon's ARCHIVE of namespace m's snapshot a1 to `url`, in this process: its job, ended."""
    job = archive.start(device, JobTable(), device.namespaces["m"].as_optimizer(),
                        {"tag": "a1", "url": url, "chunk_bytes": 5 * MIB, "overwrite": overwrite},
                        archive.Traffic(), set())
    wait_job(job)
    return job


def retake_a1(device: Device, prepared: Path) -> bytes:
    """Snapshot a1 deleted and taken again (at step 2 now): its new state's bytes."""
    namespace = device.namespaces["m"].as_optimizer()
    namespace.snapshots.delete("a1")
    namespace.snapshots.create("a1", device.reserve)
    return (prepared / "ns/m/snapshots/a1/state").read_bytes()


def test_an_export_of_a_snapshot_replaced_after_its_lookup_is_refused_whole(prepared: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """EXPORT pins its snapshot as ARCHIVE does: snapshot a1 deleted and taken again (at step 2)
    right after the export looked it up. Before, the export read the new snapshot's state
    against the old one's superblock and failed part way on a checksum; now its start is
    refused, SNAPSHOT_NOT_FOUND, nothing written; exported again, the file is the new
    snapshot's, labelled with its step."""
    target = prepared.parent / "a1.safetensors"
    with Device.open(prepared) as device:
        namespace = device.namespaces["m"].as_optimizer()
        original_get = namespace.snapshots.get
        fired: list[bool] = []

        def get(wanted: object) -> Any:
            found = original_get(wanted)
            if not fired:
                fired.append(True)
                namespace.snapshots.delete("a1")
                namespace.snapshots.create("a1", device.reserve)
            return found

        monkeypatch.setattr(namespace.snapshots, "get", get)
        with pytest.raises(DeviceError) as refused:
            snapshot_export.start(device, JobTable(), namespace, {"tag": "a1", "path": str(target)})
        assert refused.value.status == Status.SNAPSHOT_NOT_FOUND, refused.value.message
        assert "while the export started; nothing was written: export it again" in refused.value.message
        assert fired and not target.exists() and not list(target.parent.glob(f".{target.name}*"))
        job = snapshot_export.start(device, JobTable(), namespace, {"tag": "a1", "path": str(target)})
        wait_job(job)
        assert job.state == "done", job.error
    with safetensors.safe_open(str(target), "np") as exported:
        assert exported.metadata()["cossd.step"] == "2" and exported.metadata()["cossd.snapshot"] == "a1"


def test_an_overwrite_keeps_the_version_it_replaces_until_it_is_complete(prepared: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`cossd archive --force` of a tag archived already, after the tag was taken again at a
    later step. Before, the old manifest was deleted first: a replacement that failed part way
    left no version at all. Now the new objects go under a generation of their own and the
    new manifest replaces the old one last: a replacement that fails (here its superblock's
    upload) leaves the old version whole, restorable, and nothing of its own in the store; one
    that succeeds leaves the new version and nothing of the old."""
    url = f"s3://{BUCKET}/overwrite"
    location = archive.parse_url(f"{url}/m/a1")
    store = archive.Store()
    states = {1: (prepared / "ns/m/snapshots/a1/state").read_bytes()}

    def run(device: Device, overwrite: bool) -> Any:
        return archive_a1(device, url, overwrite)

    with Device.open(prepared) as device:
        assert run(device, False).state == "done"
        first = sorted(store.keys(location))
        states[2] = retake_a1(device, prepared)
        original_put = archive.Store.put

        def put(self: archive.Store, bucket: str, key: str, data: bytes) -> None:
            if key.endswith("." + archive.SUPERBLOCK_OBJECT):  # the new generation's
                raise DeviceError(Status.DATA_TRANSFER_ERROR, "injected: the store refused the upload")
            original_put(self, bucket, key, data)

        monkeypatch.setattr(archive.Store, "put", put)
        failed = run(device, True)
        assert failed.state == "failed" and "injected" in str(failed.error), (failed.state, failed.error)
        assert check_version(f"{url}/m/a1", states, tmp_path) == 1  # the old version, whole
        assert sorted(store.keys(location)) == first  # nothing of the failed replacement left
        monkeypatch.setattr(archive.Store, "put", original_put)
        assert run(device, True).state == "done"
    assert check_version(f"{url}/m/a1", states, tmp_path) == 2
    manifest = archive.read_manifest(store, location)
    assert sorted(store.keys(location)) == sorted(
        [location.key(archive.MANIFEST_OBJECT)] + [archive.object_key(location, manifest, name) for name in
                                                   (archive.STATE_OBJECT, archive.SUPERBLOCK_OBJECT, archive.META_OBJECT)])
    assert manifest["generation"] and not set(first) & set(store.keys(location)) - {location.key(archive.MANIFEST_OBJECT)}


@pytest.mark.parametrize("replacing", [False, True], ids=["first", "overwrite"])
def test_an_archive_whose_manifest_upload_lands_though_reported_failed_is_done(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replacing: bool) -> None:
    """An archive whose manifest's PUT lands in the store while the client sees it fail (the
    answer lost on the way back): the manifest read back is this job's, byte for byte, so the
    version is complete. The job says done (not a failure the store contradicts) and the version
    restores as the state archived. A first archive (before, it reported failed) and
    `cossd archive --force`, whose replaced objects are gone (before, they were kept)."""
    url = f"s3://{BUCKET}/lost-answer-{'overwrite' if replacing else 'first'}"
    location = archive.parse_url(f"{url}/m/a1")
    store = archive.Store()
    states = {1: (prepared / "ns/m/snapshots/a1/state").read_bytes()}
    with Device.open(prepared) as device:
        if replacing:
            assert archive_a1(device, url, True).state == "done"
            states[2] = retake_a1(device, prepared)
        original_put = archive.Store.put

        def put(self: archive.Store, bucket: str, key: str, data: bytes) -> None:
            original_put(self, bucket, key, data)
            if key == location.key(archive.MANIFEST_OBJECT):
                raise DeviceError(Status.DATA_TRANSFER_ERROR, "injected: the answer to the manifest's PUT was lost")

        monkeypatch.setattr(archive.Store, "put", put)
        job = archive_a1(device, url, replacing)
        assert job.state == "done", (job.state, job.error)
    assert check_version(f"{url}/m/a1", states, tmp_path) == (2 if replacing else 1)
    manifest = archive.read_manifest(store, location)
    # A replaced version's manifest names its generation (version 3: a cossd reading 1 and 2 refuses it).
    assert bool(manifest.get("generation")) == replacing and (manifest["version"] == 3) == replacing
    assert sorted(store.keys(location)) == sorted(
        [location.key(archive.MANIFEST_OBJECT)] + [archive.object_key(location, manifest, name) for name in
                                                   (archive.STATE_OBJECT, archive.SUPERBLOCK_OBJECT, archive.META_OBJECT)])


def test_a_first_archive_whose_manifest_upload_fails_before_landing_is_failed(
        prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the test above: the manifest's PUT fails and nothing lands. The
    read-back finds no manifest, so the job reports the failure and the store holds no version;
    archiving the tag again then completes it."""
    url = f"s3://{BUCKET}/lost-put"
    location = archive.parse_url(f"{url}/m/a1")
    states = {1: (prepared / "ns/m/snapshots/a1/state").read_bytes()}
    with Device.open(prepared) as device:
        original_put = archive.Store.put

        def put(self: archive.Store, bucket: str, key: str, data: bytes) -> None:
            if key == location.key(archive.MANIFEST_OBJECT):
                raise DeviceError(Status.DATA_TRANSFER_ERROR, "injected: the manifest's PUT failed")
            original_put(self, bucket, key, data)

        monkeypatch.setattr(archive.Store, "put", put)
        job = archive_a1(device, url, False)
        assert job.state == "failed" and "injected" in str(job.error), (job.state, job.error)
        assert check_version(f"{url}/m/a1", states, tmp_path) is None
        monkeypatch.setattr(archive.Store, "put", original_put)
        assert archive_a1(device, url, False).state == "done"
    assert check_version(f"{url}/m/a1", states, tmp_path) == 1


@pytest.mark.parametrize("point", ["lookup", "check_bucket", "exists", "lineage"])
def test_a_snapshot_replaced_at_each_point_of_the_archive_start(prepared: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch, point: str) -> None:
    """The daemon's ARCHIVE, in this process, with the snapshot deleted and taken again (at
    step 2) at one point of the start: after its lookup, while the bucket is checked, while the
    old manifest is looked for, while the lineage is read. Whatever the point, the version is
    whole and labelled right, or there is none and the archive said why."""
    tag = {"lookup": "a1", "check_bucket": "b1", "exists": "c1", "lineage": "a1"}[point]
    with Device.open(prepared) as device:
        namespace = device.namespaces["m"].as_optimizer()
        states = {1: (prepared / f"ns/m/snapshots/{tag}/state").read_bytes()}
        fired: list[str] = []

        def replace() -> None:
            if not fired:
                fired.append(point)
                namespace.snapshots.delete(tag)
                namespace.snapshots.create(tag, device.reserve)

        if point == "lookup":
            original_get = namespace.snapshots.get

            def get(wanted: object) -> Any:
                found = original_get(wanted)
                replace()
                return found

            monkeypatch.setattr(namespace.snapshots, "get", get)
        elif point == "lineage":
            original_lineage = archive.lineage_of

            def lineage_of(*args: Any) -> str:
                replace()
                return original_lineage(*args)

            monkeypatch.setattr(archive, "lineage_of", lineage_of)
        else:
            original = getattr(archive.Store, point)

            def wrapped(self: archive.Store, *args: Any) -> Any:
                replace()
                return original(self, *args)

            monkeypatch.setattr(archive.Store, point, wrapped)
        url = f"s3://{BUCKET}/points/{point}"
        error: DeviceError | None = None
        try:
            job = archive.start(device, JobTable(), namespace, {"tag": tag, "url": url, "chunk_bytes": 5 * MIB},
                                archive.Traffic(), set())
            wait_job(job)
            assert job.state == "done", job.error
        except DeviceError as exc:
            error = exc
        assert fired == [point]
        states[2] = (prepared / f"ns/m/snapshots/{tag}/state").read_bytes()
        assert states[1] != states[2]
    step = check_version(f"{url}/m/{tag}", states, tmp_path)
    if step is None:
        assert error is not None and error.status == Status.SNAPSHOT_NOT_FOUND, error
        assert "replaced" in error.message, error.message
    else:
        assert error is None
    # After the lookup, before the pin: refused, nothing uploaded. Once pinned (the store's
    # checks and the lineage come after): the snapshot pinned, step 1, whole.
    assert step == (None if point == "lookup" else 1)


# ---------------------------------------------------------------------- suspicion B: the restore

RESTORER = """
import os, sys
from pathlib import Path
from cossd.emulator.archive import restore as archive_restore

where = sys.argv[3]
stopped = []

def stop():
    stopped.append(1)
    print("midway", flush=True)
    sys.stdin.readline()

def progress(done, total):
    if where == "download" and not stopped:
        stop()

rename = os.rename

def renamed(source, target, *args, **kwargs):
    rename(source, target, *args, **kwargs)
    if where == "move" and not stopped and archive_restore.STAGING_DIR in str(source):
        stop()  # one entry of the device moved up into the target, the rest (superblock.json) not

os.rename = renamed
try:
    archive_restore.restore(sys.argv[1], Path(sys.argv[2]), memory_bytes=5 << 20, progress=progress)
except Exception as exc:
    print("failed", type(exc).__name__, getattr(exc, "message", exc), flush=True)
    sys.exit(3)
print("finished", flush=True)
"""


def start_restorer(version: str, target: Path, where: str) -> subprocess.Popen[str]:
    """A restore in a process of its own, stopped at `where` ("download": the state written,
    not yet checked nor registered; "move": its device moved up in part)."""
    child = subprocess.Popen([sys.executable, "-c", RESTORER, version, str(target), where],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = child.stdout.readline() if child.stdout else ""
    if not line.startswith("midway"):
        child.kill()
        child.wait()
        raise AssertionError(f"the restore did not reach {where}: {line!r}")
    return child


def kill_9(child: subprocess.Popen[str]) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL


def tree(path: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(path.rglob("*"))}


@pytest.fixture
def version(prepared: Path) -> tuple[str, bytes]:
    """Snapshot a1 (step 1) archived: its URL and its state."""
    url = f"s3://{BUCKET}/restores"
    with Device.open(prepared) as device:
        namespace = device.namespaces["m"].as_optimizer()
        job = archive.start(device, JobTable(), namespace, {"tag": "a1", "url": url, "chunk_bytes": 5 * MIB,
                                                            "overwrite": True}, archive.Traffic(), set())
        wait_job(job)
        assert job.state == "done", job.error
    return f"{url}/m/a1", (prepared / "ns/m/snapshots/a1/state").read_bytes()


@pytest.mark.parametrize("where", ["download", "move"])
def test_a_restore_into_a_reused_folder_never_deletes_what_is_not_its_own(
        version: tuple[str, bytes], tmp_path: Path, where: str) -> None:
    """A restore killed with kill -9 leaves its staging directory (and, killed while moving its
    device up, part of the device) in the target. A file the user put there since is not the
    restore's: the next restore refuses, saying so, and changes nothing; once the file is gone
    it clears its own leftovers and restores."""
    url, state = version
    target = tmp_path / "reused"
    kill_9(start_restorer(url, target, where))
    assert (target / archive_restore.STAGING_DIR).is_dir()
    assert not (target / "superblock.json").exists()
    (target / "notes.txt").write_text("the user's\n")
    (target / "results").mkdir()
    (target / "results" / "run.csv").write_text("1,2\n")
    before = tree(target)
    with pytest.raises(DeviceError) as refused:
        archive_restore.restore(url, target)
    assert refused.value.status == Status.INVALID_FIELD
    assert "notes.txt" in refused.value.message and "nothing was removed" in refused.value.message
    assert tree(target) == before
    (target / "notes.txt").unlink()
    (target / "results" / "run.csv").unlink()
    (target / "results").rmdir()
    archive_restore.restore(url, target)
    assert sorted(p.name for p in target.iterdir() if p.name.startswith(".cossd")) == []
    assert (target / "ns/m/state.A").read_bytes() == state
    with Device.open(target) as device:
        assert device.namespace("m").committed_step == 1


def test_a_restore_while_another_into_the_same_folder_runs_is_refused(version: tuple[str, bytes],
                                                                     tmp_path: Path) -> None:
    """Two restores into one new folder: the second, started while the first downloads, is
    refused (changing nothing) instead of clearing the first's work as a leftover; the first
    then finishes whole, and nothing removes the device it made."""
    url, state = version
    target = tmp_path / "shared"
    first = start_restorer(url, target, "download")
    try:
        before = tree(target)
        with pytest.raises(DeviceError) as refused:
            archive_restore.restore(url, target)
        assert refused.value.status == Status.NAMESPACE_NOT_READY, refused.value.message
        assert tree(target) == before
    finally:
        assert first.stdin is not None and first.stdout is not None
        first.stdin.write("\n")
        first.stdin.flush()
        ended = first.stdout.readline()
        first.wait(WAIT_S)
    assert ended.startswith("finished"), ended
    assert (target / "ns/m/state.A").read_bytes() == state
    with Device.open(target) as device:
        assert device.namespace("m").committed_step == 1


def test_a_restore_into_a_mounted_device_is_refused_changing_nothing(version: tuple[str, bytes], prepared: Path,
                                                                    tmp_path: Path) -> None:
    """A leftover staging directory beside a device that a daemon serves: the restore is
    refused by the device's lock before it looks at (or removes) anything."""
    url, _ = version
    leftover = prepared / archive_restore.STAGING_DIR
    leftover.mkdir()
    (leftover / "kept").write_text("left by a restore cut short\n")
    mounted = start_mount(prepared, tmp_path / "mnt-live")
    try:
        with pytest.raises(DeviceError) as refused:
            archive_restore.restore(url, prepared, name="m2")
        assert refused.value.status == Status.NAMESPACE_NOT_READY, refused.value.message
        assert "nothing was changed" in refused.value.message
        assert (leftover / "kept").read_text() == "left by a restore cut short\n"
    finally:
        stop_mount(mounted)
    # Offline, the same restore clears the leftover and adds the namespace.
    archive_restore.restore(url, prepared, name="m2")
    assert not leftover.exists()
    with Device.open(prepared) as device:
        assert sorted(device.namespaces) == ["m", "m2"]
