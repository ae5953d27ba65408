"""The archive tier against a real S3 server (SeaweedFS on loopback): archive a snapshot from
the device, list it, restore it onto a fresh device bit for bit and train on; kill -9 of the
daemon mid-upload; a corrupted object caught on restore; bad input refused."""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Mount, is_mounted, start_mount
from cossd.client import AdminClient
from cossd.client import archive as archive_calls
from cossd.client import snapshots as snapshot_calls
from cossd.emulator import Device, DeviceError, Status
from cossd.emulator.archive import restore as archive_restore, versions as archive
from cossd.tools.verbs import archive as verbs_archive
from helpers import create_namespace, pread_all, pwrite_all, tensor_dir
from s3_server import store_in_environment

pytestmark = pytest.mark.mount

BUCKET = "cossd-archive"
ROLES = ("param", "master", "exp_avg", "exp_avg_sq")
MIB = 1 << 20


# ---------------------------------------------------------------------- the S3 server


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SeaweedFS server with its S3 gateway on loopback (free ports, a temporary directory,
    one identity, the bucket made); the daemons find it through AWS_* in their environment."""
    with store_in_environment(tmp_path_factory.mktemp("seaweedfs"), BUCKET) as endpoint:
        archive.Store().check_bucket(archive.Location(BUCKET, ""))
        yield endpoint


# ---------------------------------------------------------------------- helpers


def run_verb(*argv: object) -> int:
    """Run an archive verb as `cossd` would (tools/cli.py's factory, for these verbs only)."""
    parser = argparse.ArgumentParser(prog="cossd")
    verbs = parser.add_subparsers(dest="verb", required=True)

    def verb(name: str, handler: Any, help_text: str, formats: tuple[str, ...] = ("normal", "json")) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help_text)
        sub.set_defaults(handler=handler)
        sub.add_argument("-o", "--output-format", choices=formats, default="normal")
        return sub

    verbs_archive.register(verb)
    args = parser.parse_args([str(a) for a in argv])
    return int(args.handler(args) or 0)


def gradient(step: int, numel: int) -> bytes:
    return (np.random.default_rng([step, numel]).standard_normal(numel) * 0.01).astype(np.float16).tobytes()


def train(mp: Path, name: str, tensors: tuple[tuple[str, int], ...], step: int) -> None:
    for tensor, numel in tensors:
        pwrite_all(tensor_dir(mp, name, tensor) / "grad", gradient(step, numel))


def make_namespace(mp: Path, name: str, tensors: tuple[tuple[str, int], ...], steps: int) -> None:
    create_namespace(mp, name, tensors)
    for tensor, numel in tensors:
        master = np.random.default_rng(numel).standard_normal(numel, dtype=np.float32)
        pwrite_all(tensor_dir(mp, name, tensor) / "master", master.tobytes())
    for step in range(1, steps + 1):
        train(mp, name, tensors, step)


def state_through(mp: Path, name: str, tensors: tuple[tuple[str, int], ...], tag: str | None = None) -> dict[str, bytes]:
    base = mp / "ns" / name / ("snapshots/" + tag if tag else "") / "tensors"
    return {f"{t}/{r}": pread_all(base / t / r) for t, _ in tensors for r in ROLES}


def archive_and_wait(mp: Path, name: str, tag: str, url: str, **options: Any) -> dict[str, Any]:
    with AdminClient(mp) as client:
        job = archive_calls.archive(client, client.nsid(name), tag, url, **options)
        return archive_calls.wait_for_archive(client, job)


def status_of(action: Any) -> Status | None:
    try:
        action()
    except DeviceError as exc:
        return exc.status
    return None


# ---------------------------------------------------------------------- tests

SMALL = (("w", 1_500_000), ("b", 7))  # 21 MB of state: 5 chunks of 5 MiB


def test_archive_list_restore_and_train_on(s3: str, mount: Mount, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    make_namespace(mp, "m", SMALL, steps=2)
    with AdminClient(mp) as client:
        snapshot_calls.create_snapshot(client, client.nsid("m"), "t1")
        host_before = client.smart_log()
    # Through the verb, the endpoint given explicitly (it overrides AWS_ENDPOINT_URL).
    assert run_verb("archive", mp, "m", "t1", "--to", f"s3://{BUCKET}/runs/a", "--endpoint-url", s3,
                    "--chunk-size", "5M", "--wait", "-q") == 0
    assert "archived snapshot 't1'" in capsys.readouterr().out
    with AdminClient(mp) as client:
        host_after = client.smart_log()
        counters = archive_calls.archive_statistics(client)
        listed = archive_calls.archived_versions(client, f"s3://{BUCKET}/runs/a")
    state_bytes = (mount.backing / "ns/m/snapshots/t1/state").stat().st_size
    # The device's network bytes, never the host link's: the host read nothing of the state.
    assert counters["namespaces"]["m"]["network_bytes_sent"] >= state_bytes
    assert counters["namespaces"]["m"]["parts_uploaded"] == 5
    assert host_after["data_units_read"] - host_before["data_units_read"] < state_bytes // 512_000 // 2
    [version] = listed["versions"]
    assert (version["namespace"], version["tag"], version["step"], version["url"]) == \
        ("m", "t1", 2, f"s3://{BUCKET}/runs/a/m/t1")
    # Listed from this node too (no device), as JSON.
    assert run_verb("archive", "--list", f"s3://{BUCKET}/runs/a", "-o", "json") == 0
    assert json.loads(capsys.readouterr().out)["versions"] == listed["versions"]
    original = state_through(mp, "m", SMALL, "t1")

    # Disaster recovery: a fresh device from the store alone.
    fresh = tmp_path / "fresh"
    assert run_verb("restore", f"s3://{BUCKET}/runs/a/m/t1", fresh, "-q") == 0
    assert "restored" in capsys.readouterr().out
    assert (fresh / "ns/m/state.A").read_bytes() == (mount.backing / "ns/m/snapshots/t1/state").read_bytes()
    restored = start_mount(fresh, tmp_path / "mnt2")
    try:
        assert state_through(restored.mountpoint, "m", SMALL) == original
        assert (restored.mountpoint / "ns/m/step").read_text().strip() == "2"
        # Training resumes on it: step 3 there equals step 3 on the original device.
        train(restored.mountpoint, "m", SMALL, 3)
        train(mp, "m", SMALL, 3)
        assert state_through(restored.mountpoint, "m", SMALL) == state_through(mp, "m", SMALL)
    finally:
        restored.unmount()
    # Restoring again by name into the same (existing, offline) device: a second namespace.
    assert run_verb("restore", f"s3://{BUCKET}/runs/a/m/t1", fresh, "--name", "m2", "-q") == 0
    capsys.readouterr()
    with Device.open(fresh) as device:
        assert sorted(device.namespaces) == ["m", "m2"]
        assert device.namespace("m2").committed_step == 2


BIG = (("w", 4_000_000), ("b", 7))  # 56 MB: 11 chunks of 5 MiB, one in flight


def _kill_mid_upload(s3: str, backing: Path, tmp_path: Path, trials: int, figures: list[str]) -> None:
    mp = tmp_path / "mnt"
    mount = start_mount(backing, mp)
    resumed = 0
    try:
        make_namespace(mp, "m", BIG, steps=1)
        with AdminClient(mp) as client:
            snapshot_calls.create_snapshot(client, client.nsid("m"), "t1")
        snapshot = (backing / "ns/m/snapshots/t1/state").read_bytes()
        rng = random.Random(18)
        for trial in range(trials):
            url = f"s3://{BUCKET}/{tmp_path.name}/{trial}"  # each test its own place
            with AdminClient(mp) as client:
                job = archive_calls.archive(client, client.nsid("m"), "t1", url,
                                            chunk_bytes=5 * MIB, memory_bytes=5 * MIB)
                # At most half way: the last parts to a store on loopback go quickly, and the
                # kill must land before the upload ends.
                target = rng.uniform(0.1, 0.5) * job["bytes_total"]
                while True:
                    [current] = [j for j in snapshot_calls.jobs(client) if j["job"] == job["job"]]
                    if current["bytes_done"] >= target or current["state"] != "running":
                        break
                    time.sleep(0.005)
            assert current["state"] == "running", "the upload ended before the kill"
            mount.kill()
            # Never a complete-looking version: no manifest, not listed, not restorable.
            store = archive.Store()
            assert archive.list_versions(store, archive.parse_url(url)) == []
            assert status_of(lambda: archive_restore.restore(f"{url}/m/t1", tmp_path / f"r{trial}")) == \
                Status.SNAPSHOT_NOT_FOUND
            assert not (tmp_path / f"r{trial}").exists()
            mount.restart()
            final = archive_and_wait(mp, "m", "t1", url, chunk_bytes=5 * MIB, memory_bytes=5 * MIB)
            assert final["state"] == "done"
            with AdminClient(mp) as client:
                resumed += archive_calls.archive_statistics(client)["namespaces"]["m"]["parts_resumed"] > 0
            [version] = archive.list_versions(store, archive.parse_url(url))
            assert version["step"] == 1
        archive_restore.restore(f"{url}/m/t1", tmp_path / "restored")
        assert (tmp_path / "restored/ns/m/state.A").read_bytes() == snapshot
    finally:
        if is_mounted(mp):
            mount.unmount()
    figures.append(f"T18 kill -9 mid-archive: {trials} trials, 0 failures (never a complete-looking "
                   f"version; each rerun completed, {resumed} of them resuming the cut multipart upload)")
    assert resumed == trials


@pytest.mark.torture
def test_kill_9_mid_upload(s3: str, backing: Path, tmp_path: Path, figures: list[str]) -> None:
    _kill_mid_upload(s3, backing, tmp_path, trials=3, figures=figures)


@pytest.mark.slow
def test_kill_9_mid_upload_many(s3: str, backing: Path, tmp_path: Path, figures: list[str]) -> None:
    _kill_mid_upload(s3, backing, tmp_path, trials=20, figures=figures)


def test_corrupted_chunk_detected_nothing_built(s3: str, mount: Mount, tmp_path: Path) -> None:
    mp = mount.mountpoint
    make_namespace(mp, "m", SMALL, steps=1)
    with AdminClient(mp) as client:
        snapshot_calls.create_snapshot(client, client.nsid("m"), "t1")
    url = f"s3://{BUCKET}/corrupt"
    archive_and_wait(mp, "m", "t1", url, chunk_bytes=5 * MIB)
    store = archive.Store()
    key = f"corrupt/m/t1/{archive.STATE_OBJECT}"
    data = bytearray(store.get(BUCKET, key))
    data[3 * 5 * MIB + 12345] ^= 0x40  # one bit of chunk 3, same size
    store.put(BUCKET, key, bytes(data))
    with pytest.raises(DeviceError) as caught:
        archive_restore.restore(f"{url}/m/t1", tmp_path / "fresh")
    assert caught.value.status == Status.UNRECOVERED_READ_ERROR
    assert "chunk 3" in caught.value.message and "nothing was restored" in caught.value.message
    assert not (tmp_path / "fresh").exists()
    # Onto an existing device: it keeps what it had, and no namespace appears.
    existing = tmp_path / "existing"
    Device.format(existing, capacity_bytes=1 << 30)
    with pytest.raises(DeviceError):
        archive_restore.restore(f"{url}/m/t1", existing)
    with Device.open(existing) as device:
        assert device.namespaces == {}
    assert not any((existing / "ns").iterdir())


def test_bad_requests_change_nothing(s3: str, mount: Mount, tmp_path: Path) -> None:
    mp = mount.mountpoint
    make_namespace(mp, "m", SMALL[1:], steps=1)
    with AdminClient(mp) as client:
        nsid = client.nsid("m")
        snapshot_calls.create_snapshot(client, nsid, "t1")

        def start(tag: str = "t1", url: str = f"s3://{BUCKET}/bad", **options: Any) -> Any:
            return lambda: archive_calls.archive(client, nsid, tag, url, **options)

        assert status_of(start(url="http://x/y")) == Status.INVALID_FIELD
        assert status_of(start(url="s3://NO_SUCH")) == Status.INVALID_FIELD
        assert status_of(start(url="s3://no-such-bucket/p")) == Status.INVALID_FIELD
        assert status_of(start(tag="nope")) == Status.SNAPSHOT_NOT_FOUND
        assert status_of(start(chunk_bytes=1 * MIB)) == Status.INVALID_FIELD
        assert status_of(start(memory_bytes=1)) == Status.INVALID_FIELD
        assert status_of(start(endpoint_url="http://127.0.0.1:1")) == Status.DATA_TRANSFER_ERROR
        assert snapshot_calls.jobs(client) == []
        job = archive_calls.wait_for_archive(client, archive_calls.archive(client, nsid, "t1", f"s3://{BUCKET}/bad"))
        assert job["state"] == "done"
        assert status_of(start()) == Status.SNAPSHOT_EXISTS  # archived already
        assert archive_calls.wait_for_archive(client, archive_calls.archive(
            client, nsid, "t1", f"s3://{BUCKET}/bad", overwrite=True))["state"] == "done"
    assert status_of(lambda: archive_restore.restore(f"s3://{BUCKET}/bad/m/none", tmp_path / "x")) == \
        Status.SNAPSHOT_NOT_FOUND
    assert not (tmp_path / "x").exists()


def test_without_boto3_a_clear_error() -> None:
    """Where boto3 is not installed the archive commands fail with a message that says so."""
    code = ("import sys; sys.modules['boto3'] = None\n"
            "from cossd.emulator.archive import versions as archive\n"
            "try:\n    archive.Store()\nexcept archive.DeviceError as exc:\n"
            "    print(exc.status.name, exc.message)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("INVALID_FIELD") and "pip install 'cossd[tiers]'" in out
