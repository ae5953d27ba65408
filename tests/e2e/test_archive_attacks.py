"""Attacks on the archive tier against a real S3 server (SeaweedFS): a manifest altered in the
store, the bucket deleted during an archive and a restore, kill -9 of a restore, a daemon
without credentials, `restore --capacity`; a full and a read-only spill dir for the trainer's
TieredCheckpointer."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Mount, start_mount, stop_mount
from cossd.client import AdminClient
from cossd.client import archive as archive_calls
from cossd.client import snapshots as snapshot_calls
from cossd.emulator import Device, DeviceError, Status
from cossd.emulator.archive import restore as archive_restore, versions as archive
from s3_server import client, store_in_environment
from test_archive import BIG, SMALL, make_namespace, run_verb, state_through

pytestmark = pytest.mark.mount

BUCKET = "cossd-attacks"
MIB = 1 << 20
WAIT_S = 120.0  # the most a condition below is waited for (a failure, never a figure)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with store_in_environment(tmp_path_factory.mktemp("seaweedfs"), BUCKET) as endpoint:
        yield endpoint


def snapshot_and_archive(mp: Path, url: str, tensors: tuple[tuple[str, int], ...] = SMALL) -> None:
    """Namespace m trained a step, snapshot t1 archived to `url`."""
    make_namespace(mp, "m", tensors, steps=1)
    with AdminClient(mp) as admin:
        snapshot_calls.create_snapshot(admin, admin.nsid("m"), "t1")
        job = archive_calls.archive(admin, admin.nsid("m"), "t1", url, chunk_bytes=5 * MIB)
        archive_calls.wait_for_archive(admin, job)


def snapshot_state(mount: Mount) -> bytes:
    return (mount.backing / "ns/m/snapshots/t1/state").read_bytes()


def refused(action: Callable[[], Any]) -> DeviceError:
    with pytest.raises(DeviceError) as caught:
        action()
    return caught.value


def tree(path: Path) -> dict[str, Any]:
    """What "unchanged" compares: every file under `path` with its bytes (directories as None),
    and of superblock.json its namespaces (an open of the device counts a power cycle in it)."""
    files: dict[str, Any] = {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None)
                             for p in sorted(path.rglob("*")) if p.name != ".lock"}
    if "superblock.json" in files:
        record = json.loads(files.pop("superblock.json"))
        files["superblock.json namespaces"] = (record["namespaces"], record["next_nsid"])
    return files


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {WAIT_S} s"
        time.sleep(0.01)


def drop_bucket(endpoint: str, bucket: str) -> None:
    """Delete a bucket with whatever it holds (objects and unfinished uploads), as an operator
    or a lifecycle rule might while the device uses it. SeaweedFS makes a bucket again for a
    write already on its way, so this deletes until it stays gone."""
    s3 = client(endpoint)
    deadline = time.monotonic() + WAIT_S
    while True:
        if bucket_exists(endpoint, bucket):
            for upload in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
                s3.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                for entry in page.get("Contents", []):
                    s3.delete_object(Bucket=bucket, Key=entry["Key"])
            s3.delete_bucket(Bucket=bucket)
        time.sleep(0.5)
        if not bucket_exists(endpoint, bucket):
            return
        assert time.monotonic() < deadline, f"bucket {bucket} still there after {WAIT_S} s"


def bucket_exists(endpoint: str, bucket: str) -> bool:
    return any(b["Name"] == bucket for b in client(endpoint).list_buckets().get("Buckets", []))


def make_bucket(endpoint: str, bucket: str) -> None:
    """The bucket there (SeaweedFS may have made it again already, for a retried write)."""
    if not bucket_exists(endpoint, bucket):
        client(endpoint).create_bucket(Bucket=bucket)
    wait_until(lambda: bucket_exists(endpoint, bucket), f"bucket {bucket} made")


# The tests' server has room for few buckets (SeaweedFS's volumes: harness/s3_server.py), so
# the bucket these tests delete is one, removed again after each.
GONE = "cossd-gone"


@pytest.fixture
def gone_bucket(s3: str) -> Iterator[str]:
    make_bucket(s3, GONE)
    try:
        yield GONE
    finally:
        if bucket_exists(s3, GONE):
            drop_bucket(s3, GONE)


# ---------------------------------------------------------------------- the manifest


def rewrite_manifest(url: str, edit: Callable[[bytes], bytes]) -> None:
    location = archive.parse_url(url)
    store = archive.Store()
    key = location.key(archive.MANIFEST_OBJECT)
    store.put(location.bucket, key, edit(store.get(location.bucket, key)))


def test_a_manifest_altered_in_the_store_is_refused_before_anything_is_written(
        s3: str, mount: Mount, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://{BUCKET}/manifest"
    snapshot_and_archive(mount.mountpoint, url)
    version = f"{url}/m/t1"
    original = archive.Store().get(BUCKET, "manifest/m/t1/manifest.json")
    manifest = json.loads(original)
    assert manifest["version"] == 2 and isinstance(manifest["manifest_crc32c"], int)
    existing = tmp_path / "existing"
    Device.format(existing, capacity_bytes=1 << 30)
    before = tree(existing)

    def refused_everywhere(expect: str) -> None:
        for target in (tmp_path / "fresh", existing):
            error = refused(lambda: archive_restore.restore(version, target))
            assert error.status == Status.UNRECOVERED_READ_ERROR, error.message
            assert expect in error.message, error.message
        assert not (tmp_path / "fresh").exists()
        assert tree(existing) == before

    # The flip: param_dtype bf16 <-> fp16, one bit of one byte ('b' 0x62, 'f' 0x66).
    dtype = manifest["spec"]["param_dtype"]
    flipped = {"fp16": "bp16", "bf16": "ff16"}[dtype]
    rewrite_manifest(url + "/m/t1", lambda raw: raw.replace(f'"param_dtype": "{dtype}"'.encode(),
                                                             f'"param_dtype": "{flipped}"'.encode(), 1))
    refused_everywhere("manifest.json fails its own checksum")
    # Every other single bit of a byte inside a value of the manifest: refused too, never restored.
    body_start = original.index(b'"chunk_bytes"')
    for offset in range(body_start, len(original) - 2, max(1, (len(original) - body_start) // 12)):
        bad = bytearray(original)
        bad[offset] ^= 0x04
        rewrite_manifest(url + "/m/t1", lambda raw: bytes(bad))
        error = refused(lambda: archive_restore.restore(version, tmp_path / "fresh"))
        assert error.status == Status.UNRECOVERED_READ_ERROR and "manifest.json" in error.message, error.message
        assert not (tmp_path / "fresh").exists()
    # Listed neither by the device nor from this node, and said to be left out.
    assert run_verb("archive", "--list", url, "-o", "json") == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["versions"] == [] and "left out" in captured.err
    with AdminClient(mount.mountpoint) as admin:
        listing = archive_calls.archived_versions(admin, url)
    assert listing["versions"] == [] and listing["unreadable"][0]["url"] == version

    # meta.json altered (the manifest intact): refused before anything is written, naming it.
    rewrite_manifest(url + "/m/t1", lambda raw: original)
    store = archive.Store()
    meta = store.get(BUCKET, "manifest/m/t1/meta.json")
    store.put(BUCKET, "manifest/m/t1/meta.json", meta.replace(b"t1", b"t2", 1))
    refused_everywhere("meta.json fails its CRC32C")
    store.put(BUCKET, "manifest/m/t1/meta.json", meta)

    # A whole valid manifest copied into another version's place: it names another version.
    store.put(BUCKET, "manifest/m/other/manifest.json", original)
    error = refused(lambda: archive_restore.restore(f"{url}/m/other", tmp_path / "fresh"))
    assert "describes m/t1" in error.message and not (tmp_path / "fresh").exists()
    store.delete(BUCKET, "manifest/m/other/manifest.json")

    # A format-1 manifest (before checksums): refused unless asked, then restored (its chunks
    # and blocks still checked), and listed as unchecked.
    old = {k: v for k, v in manifest.items() if k != "manifest_crc32c"} | {"version": 1}
    rewrite_manifest(url + "/m/t1", lambda raw: json.dumps(old).encode())
    error = refused(lambda: archive_restore.restore(version, tmp_path / "fresh"))
    assert "--accept-unchecked-manifest" in error.message and not (tmp_path / "fresh").exists()
    [listed] = archive.list_versions(archive.Store(), archive.parse_url(url))
    assert listed["manifest_checked"] is False
    assert run_verb("restore", version, tmp_path / "fresh", "--accept-unchecked-manifest", "-q") == 0
    assert (tmp_path / "fresh/ns/m/state.A").read_bytes() == snapshot_state(mount)

    # And the intact manifest restores, bit for bit.
    rewrite_manifest(url + "/m/t1", lambda raw: original)
    result = archive_restore.restore(version, existing)
    assert result["manifest_checked"] is True
    assert (existing / "ns/m/state.A").read_bytes() == snapshot_state(mount)


# ---------------------------------------------------------------------- --capacity


def test_restore_capacity(s3: str, mount: Mount, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"s3://{BUCKET}/capacity"
    snapshot_and_archive(mount.mountpoint, url)
    version = f"{url}/m/t1"
    assert run_verb("restore", version, tmp_path / "sized", "--capacity", "256M", "-q", "-o", "json") == 0
    assert json.loads(capsys.readouterr().out)["capacity_bytes"] == 256 * MIB
    with Device.open(tmp_path / "sized") as device:
        assert device.capacity_bytes == 256 * MIB and sorted(device.namespaces) == ["m"]
    # On a device that exists, refused: its capacity was set by its format.
    before = tree(tmp_path / "sized")
    error = refused(lambda: archive_restore.restore(version, tmp_path / "sized", name="m2",
                                                    capacity_bytes=1 << 30))
    assert error.status == Status.INVALID_FIELD and "--capacity is for a fresh one" in error.message
    assert tree(tmp_path / "sized") == before
    # Too small for the namespace's two state copies: refused, no device left behind.
    (tmp_path / "small").mkdir()
    error = refused(lambda: archive_restore.restore(version, tmp_path / "small", capacity_bytes=MIB))
    assert error.status == Status.NAMESPACE_INSUFFICIENT_CAPACITY, error.message
    assert list((tmp_path / "small").iterdir()) == []
    # Without it: the filesystem's free space, as `cossd format`.
    result = archive_restore.restore(version, tmp_path / "default")
    statvfs = os.statvfs(tmp_path)
    assert abs(result["capacity_bytes"] - statvfs.f_bavail * statvfs.f_frsize) < 1 << 30


# ---------------------------------------------------------------------- the bucket deleted


def test_bucket_deleted_during_an_archive(s3: str, gone_bucket: str, mount: Mount, tmp_path: Path) -> None:
    bucket = gone_bucket
    mp = mount.mountpoint
    make_namespace(mp, "m", BIG, steps=1)
    url = f"s3://{bucket}/p"
    with AdminClient(mp) as admin:
        nsid = admin.nsid("m")
        snapshot_calls.create_snapshot(admin, nsid, "t1")
        live, snap = state_through(mp, "m", BIG), state_through(mp, "m", BIG, "t1")
        # One part in flight, so the upload is still running when the bucket goes.
        job = archive_calls.archive(admin, nsid, "t1", url, chunk_bytes=5 * MIB, memory_bytes=5 * MIB)

        def current() -> dict[str, Any]:
            [row] = [j for j in snapshot_calls.jobs(admin) if j["job"] == job["job"]]
            return row

        wait_until(lambda: current()["bytes_done"] > 0 or current()["state"] != "running", "a part uploaded")
        assert current()["state"] == "running", "the upload ended before the bucket went"
        # The daemon held still while the bucket goes (a part already sent would make SeaweedFS
        # create it again), then let go on with the upload into no bucket.
        os.kill(mount.pid, signal.SIGSTOP)
        try:
            drop_bucket(s3, bucket)
        finally:
            os.kill(mount.pid, signal.SIGCONT)
        with pytest.raises(DeviceError) as caught:
            archive_calls.wait_for_archive(admin, job)
        assert caught.value.status in (Status.INVALID_FIELD, Status.DATA_TRANSFER_ERROR), caught.value.message
        assert bucket in caught.value.message, caught.value.message
        counters = archive_calls.archive_statistics(admin)["namespaces"]["m"]
        assert counters["archives_failed"] == 1 and counters["archives_completed"] == 0
        # The device is as it was: its state, its snapshot, nothing running.
        assert state_through(mp, "m", BIG) == live and state_through(mp, "m", BIG, "t1") == snap
        assert archive_calls.archive_statistics(admin)["running"] == []
        # The bucket back: a new archive completes and restores bit for bit.
        make_bucket(s3, bucket)
        final = archive_calls.wait_for_archive(admin, archive_calls.archive(
            admin, nsid, "t1", url, chunk_bytes=5 * MIB, memory_bytes=5 * MIB))
        assert final["state"] == "done"
    archive_restore.restore(f"{url}/m/t1", tmp_path / "back")
    assert (tmp_path / "back/ns/m/state.A").read_bytes() == snapshot_state(mount)


def test_bucket_deleted_during_a_restore(s3: str, gone_bucket: str, mount: Mount, tmp_path: Path) -> None:
    bucket = gone_bucket
    url = f"s3://{bucket}/p"
    snapshot_and_archive(mount.mountpoint, url, BIG)
    version = f"{url}/m/t1"
    existing = tmp_path / "existing"
    Device.format(existing, capacity_bytes=1 << 30)
    before = tree(existing)
    for target in (tmp_path / "fresh", existing):
        dropped = []

        def drop_on_first_chunk(done: int, total: int) -> None:
            if not dropped:  # a chunk is written: the bucket goes before the next is fetched
                dropped.append(total - done)
                drop_bucket(s3, bucket)

        error = refused(lambda: archive_restore.restore(version, target, memory_bytes=5 * MIB,
                                                        progress=drop_on_first_chunk))
        assert dropped and dropped[0] > 0, "the bucket went after the last chunk"
        assert error.status in (Status.INVALID_FIELD, Status.DATA_TRANSFER_ERROR, Status.SNAPSHOT_NOT_FOUND)
        assert bucket in error.message, error.message
        assert not (tmp_path / "fresh").exists()
        assert tree(existing) == before
        # The bucket back, the version archived again: the same restore works.
        make_bucket(s3, bucket)
        with AdminClient(mount.mountpoint) as admin:
            archive_calls.wait_for_archive(admin, archive_calls.archive(
                admin, admin.nsid("m"), "t1", url, chunk_bytes=5 * MIB))
    for target in (tmp_path / "fresh", existing):
        archive_restore.restore(version, target)
        assert (target / "ns/m/state.A").read_bytes() == snapshot_state(mount)


# ---------------------------------------------------------------------- kill -9 of a restore

RESTORER = """
import sys
from pathlib import Path
from cossd.emulator.archive import restore as archive_restore

stopped = []

def progress(done, total):
    # Past a third, tell the parent and wait for its kill -9: the restore is midway, some of
    # the state written, the rest not (a kill at a known point, not a race with the download).
    if not stopped and done * 3 >= total:
        stopped.append(done)
        print("midway", done, total, flush=True)
        sys.stdin.readline()

archive_restore.restore(sys.argv[1], Path(sys.argv[2]), memory_bytes=5 << 20, progress=progress)
print("finished", flush=True)
"""


def kill_restore_midway(version: str, target: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", RESTORER, version, str(target)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline() if child.stdout else ""
        assert line.startswith("midway"), f"the restore did not reach its midpoint: {line!r}"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL


def test_kill_9_of_a_restore(s3: str, mount: Mount, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/killed"
    snapshot_and_archive(mount.mountpoint, url, BIG)
    version = f"{url}/m/t1"
    fresh = tmp_path / "fresh"
    kill_restore_midway(version, fresh)
    # What it left is no device: it cannot be opened or mounted as one.
    assert (fresh / archive_restore.STAGING_DIR).is_dir()
    assert not (fresh / "superblock.json").exists()
    assert refused(lambda: Device.open(fresh)).status == Status.INVALID_FIELD
    with pytest.raises(DeviceError):
        start_mount(fresh, tmp_path / "mnt-partial")
    # The next restore clears it and builds the device whole.
    archive_restore.restore(version, fresh)
    assert sorted(p.name for p in fresh.iterdir() if p.name.startswith(".cossd")) == []
    assert (fresh / "ns/m/state.A").read_bytes() == snapshot_state(mount)
    restored = start_mount(fresh, tmp_path / "mnt-restored")
    try:
        assert state_through(restored.mountpoint, "m", BIG) == state_through(mount.mountpoint, "m", BIG, "t1")
    finally:
        stop_mount(restored)

    # Into a device that exists: killed midway, the device has no such namespace (its half-built
    # directory is removed when the device opens), and the restore again works.
    existing = tmp_path / "existing"
    Device.format(existing, capacity_bytes=1 << 30)
    kill_restore_midway(version, existing)
    with Device.open(existing) as device:
        assert device.namespaces == {}
    assert not (existing / "ns/m").exists()
    archive_restore.restore(version, existing)
    assert (existing / "ns/m/state.A").read_bytes() == snapshot_state(mount)


# ---------------------------------------------------------------------- credentials

_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE",
                "AWS_CONFIG_FILE", "AWS_EC2_METADATA_DISABLED")


def test_a_daemon_without_credentials_says_which_process_needs_them(s3: str, backing: Path,
                                                                   tmp_path: Path) -> None:
    saved = {name: os.environ.get(name) for name in _CREDENTIALS}
    os.environ.pop("AWS_ACCESS_KEY_ID")
    os.environ.pop("AWS_SECRET_ACCESS_KEY")
    os.environ.pop("AWS_PROFILE", None)
    # No file and no instance metadata either: the daemon has no credentials from anywhere.
    os.environ.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
                      AWS_EC2_METADATA_DISABLED="true")
    try:
        mounted = start_mount(backing, tmp_path / "mnt-nocreds")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        make_namespace(mounted.mountpoint, "m", SMALL[1:], steps=1)
        with AdminClient(mounted.mountpoint) as admin:
            snapshot_calls.create_snapshot(admin, admin.nsid("m"), "t1")
            # This process has credentials; the daemon, which uploads, has none.
            error = refused(lambda: archive_calls.archive(admin, admin.nsid("m"), "t1", f"s3://{BUCKET}/creds"))
            assert snapshot_calls.jobs(admin) == []
    finally:
        stop_mount(mounted)
    assert error.status == Status.DATA_TRANSFER_ERROR
    for words in ("the device's daemon (pid", "has no S3 credentials", "AWS_ACCESS_KEY_ID",
                  "environment of `cossd mount`", s3):
        assert words in error.message, error.message


# ---------------------------------------------------------------------- the trainer's spill dir


@pytest.fixture
def paused_store(s3: str, tmp_path: Path) -> Iterator[tuple[str, Callable[[bool], None]]]:
    """A SeaweedFS of its own (the module's keys), and pause(True/False): SIGSTOP/SIGCONT of it,
    so the store takes nothing while the tiers fill."""
    from s3_server import start_weed

    server = start_weed(tmp_path / "weed-paused", "tiered-attacks")

    def pause(stopped: bool) -> None:
        os.killpg(server.process.pid, signal.SIGSTOP if stopped else signal.SIGCONT)

    try:
        yield server.endpoint, pause
    finally:
        pause(False)
        server.stop()


@pytest.fixture(params=["full", "read-only"])
def bad_spill_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A spill dir on a 1 MiB tmpfs (smaller than one version), or on one mounted read-only:
    (the dir, the error its writes get)."""
    path = tmp_path / "spill"
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(path)], check=True)
    try:
        if request.param == "read-only":
            subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
        yield path, "No space left on device" if request.param == "full" else "Read-only file system"
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_or_read_only_spill_dir_loses_no_version_silently(
        paused_store: tuple[str, Callable[[bool], None]], bad_spill_dir: tuple[Path, str]) -> None:
    from cossd.trainer import TieredCheckpointer
    from test_tiered import assert_identical, make_model, restored, snapshot, train_step

    endpoint, pause = paused_store
    spill, expected_error = bad_spill_dir
    model, optimizer = make_model()
    url = f"s3://tiered-attacks/{spill.parent.name}"
    states = {}
    with warnings_caught() as caught:
        ckpt = TieredCheckpointer(url, endpoint_url=endpoint, memory_bytes=32 * MIB, spill_dir=spill,
                                  spill_bytes=256 * MIB, chunk_bytes=5 * MIB, max_stall_s=0.3)
        try:
            pause(True)  # the store takes nothing: the pool (2.5 versions) fills, the spill dir fails
            for step in range(1, 7):
                train_step(model, optimizer, step)
                ckpt.save(model, optimizer, step)
                states[step] = snapshot(model, optimizer)
            during = ckpt.stats()
            pause(False)
            report = ckpt.close(drain=True, timeout_s=WAIT_S)
        except BaseException:
            pause(False)
            ckpt.close(drain=False)
            raise
    # Every spill failed, each counted and warned of with the disk's own error.
    assert during["spilled"] == 0 and during["spill_errors"] >= 1, during
    assert expected_error in during["last_error"], during["last_error"]
    messages = [str(w.message) for w in caught]
    assert any(expected_error in m and "spill tier pauses" in m for m in messages), messages
    # No version lost silently: each saved step is archived, or dropped by coalescing, which
    # is counted, named and warned of.
    final = report["stats"]
    dropped = set(final["coalesced_steps"])
    assert final["coalesced"] == len(dropped) >= 1
    # The drops' warnings say why the spill tier took nothing: its disk's error.
    assert any("dropped version(s)" in m and "spill tier failing" in m and expected_error in m
               for m in messages), messages
    with TieredCheckpointer(url, endpoint_url=endpoint, memory_bytes=32 * MIB) as reader:
        archived = {row["step"] for row in reader.versions()}
        assert archived | dropped == set(states) and not archived & dropped, (archived, dropped)
        assert 6 in archived  # the newest is never the one dropped
        info, loaded = restored(reader)
        assert info["step"] == 6
        assert_identical(loaded, states[6])
    assert report["drained"] and list(spill.iterdir()) == []


@contextlib.contextmanager
def warnings_caught() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
