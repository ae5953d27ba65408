"""The device's automatic archiving against a real S3 server (SeaweedFS on loopback): a version
every K committed steps, N kept on the drive and M in the store; a store that stops answering
makes versions wait and coalesce while training goes on, then drains; the policy survives a
remount; bad policies refused, changing nothing."""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import Mount, start_mount, stop_mount
from helpers import pwrite_all, tensor_dir
from s3_server import client as s3_client
from prometheus_client.parser import text_string_to_metric_families
from cossd.client import AdminClient
from cossd.client import archive as archive_calls
from cossd.emulator import DeviceError, Status
from cossd.emulator.archive import restore as archive_restore, versions as archive
from cossd.fs import daemon
from test_archive import BUCKET, SMALL, gradient, make_namespace, run_verb, s3, state_through, train  # noqa: F401

pytestmark = pytest.mark.mount

URL = f"s3://{BUCKET}/auto"


def policy_state(mp: Path, name: str) -> dict[str, Any]:
    with AdminClient(mp) as client:
        return archive_calls.archive_statistics(client, client.nsid(name))["policies"][name]["state"]


def wait_for(mp: Path, name: str, done: Callable[[dict[str, Any]], bool], timeout_s: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        state = policy_state(mp, name)
        if done(state):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"the policy did not get there in {timeout_s} s: {state}")
        time.sleep(0.05)


def versions(prefix: str, name: str) -> list[tuple[str, int]]:
    listed = archive.list_versions(archive.Store(), archive.parse_url(prefix))
    return [(v["tag"], v["step"]) for v in listed if v["namespace"] == name]


def local_auto(mp: Path, name: str) -> list[str]:
    return sorted((p.name for p in (mp / "ns" / name / "snapshots").iterdir() if p.name.startswith("auto-")),
                  key=lambda tag: int(tag[5:]))


def test_every_k_steps_keeping_n_on_the_drive_and_m_in_the_store(s3: str, mount: Mount, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    make_namespace(mp, "p", SMALL, steps=0)
    assert run_verb("archive", mp, "p", "--every", "2", "--to", f"{URL}/a", "--keep-local", "1",
                    "--keep-remote", "2", "--chunk-size", "5M") == 0
    assert "a snapshot every 2 committed steps" in capsys.readouterr().out
    expected: dict[int, dict[str, bytes]] = {}
    for step in range(1, 7):
        train(mp, "p", SMALL, step)
        if step % 2 == 0:
            expected[step] = state_through(mp, "p", SMALL)
            wait_for(mp, "p", lambda s, step=step: s["last_archived_step"] >= step and s["uploading"] is None)
    state = wait_for(mp, "p", lambda s: s["deleted_local"] == 2)
    assert (state["snapshots_taken"], state["versions_archived"], state["coalesced"]) == (3, 3, 0)
    assert state["deleted_remote"] == 1 and state["upload_failures"] == 0
    assert versions(f"{URL}/a", "p") == [("auto-4", 4), ("auto-6", 6)]  # the newest M = 2
    assert local_auto(mp, "p") == ["auto-6"]  # the newest N = 1
    # What the store holds is the step it is named after, bit for bit: restored and compared.
    fresh = tmp_path / "fresh"
    assert run_verb("restore", f"{URL}/a/p/auto-4", fresh, "-q") == 0
    restored = start_mount(fresh, tmp_path / "mnt2")
    try:
        assert state_through(restored.mountpoint, "p", SMALL) == expected[4]
    finally:
        restored.unmount()
    # Shown by the verb, and turned off: no more versions.
    assert run_verb("archive", mp, "p", "--status") == 0
    assert "every 2 steps" in capsys.readouterr().out
    assert run_verb("archive", mp, "p", "--off", "-o", "json") == 0
    assert json.loads(capsys.readouterr().out)["policy"] is None
    train(mp, "p", SMALL, 7)
    train(mp, "p", SMALL, 8)
    time.sleep(1.0)  # several of the policy's looks
    assert local_auto(mp, "p") == ["auto-6"] and policy_state(mp, "p")["snapshots_taken"] == 3


def _weed_group(endpoint: str) -> int:
    """The process group of the SeaweedFS server whose S3 gateway is `endpoint`."""
    port = endpoint.rsplit(":", 1)[1]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"-s3.port={port}".encode() in argv:
                return os.getpgid(int(entry.name))
    raise AssertionError(f"no weed process serves {endpoint}")


@pytest.fixture
def metrics_mount(backing: Path, tmp_path: Path) -> Iterator[tuple[Mount, int]]:
    """A mount whose daemon serves Prometheus metrics on a free loopback port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    pid = daemon.start_background(backing, mountpoint, metrics_port=port)
    try:
        yield Mount(backing, mountpoint, pid), port
    finally:
        daemon.stop_background(mountpoint, pid)


@pytest.mark.parametrize("bound", ["max_pending", "spill_capacity"])
def test_a_store_that_stops_answering_makes_versions_wait_and_coalesce(
        s3: str, metrics_mount: tuple[Mount, int], bound: str) -> None:
    """SIGSTOP of the S3 server: the upload under way hangs; training goes on, a version every
    step waits on the drive, the older waiting ones are coalesced beyond max_pending, or beyond
    the spill capacity in bytes (in the log page and the metrics); SIGCONT: the waiting ones
    drain and the store holds the newest step."""
    mount, port = metrics_mount
    mp = mount.mountpoint
    name = f"q-{bound}"
    make_namespace(mp, name, SMALL, steps=0)
    with AdminClient(mp) as client:
        version_bytes = client.statistics(client.nsid(name))["state_bytes_per_copy"]
        limit = {"max_pending": 2} if bound == "max_pending" else {"spill_capacity": 2 * version_bytes + 4096}
        archive_calls.set_archive_policy(client, client.nsid(name), {
            "url": f"{URL}/b-{bound}", "every": 1, "keep_local": 3, "keep_remote": 5, "chunk_bytes": 5 << 20} | limit)
    group = _weed_group(s3)
    os.killpg(group, signal.SIGSTOP)
    try:
        for step in range(1, 7):
            train(mp, name, SMALL, step)  # a training step never waits for the store
            wait_for(mp, name, lambda s, step=step: s["snapshots_taken"] == step, timeout_s=30)
        state = policy_state(mp, name)
        assert state["uploading"] == "auto-1"  # hung in the stopped store
        assert state["pending"] == ["auto-5", "auto-6"] and state["coalesced"] == 3
        # Coalesced versions leave the drive too (kept: the newest 3 and the one uploading).
        assert local_auto(mp, name) == ["auto-1", "auto-4", "auto-5", "auto-6"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
        samples = {(sample.name, sample.labels.get("namespace")): sample.value
                   for family in text_string_to_metric_families(text) for sample in family.samples}
        assert samples[("cossd_archive_policy_coalesced_total", name)] == 3
        assert samples[("cossd_archive_policy_pending", name)] == 2
        assert samples[("cossd_archive_policy_spill_bytes", name)] == 2 * version_bytes
    finally:
        os.killpg(group, signal.SIGCONT)
    state = wait_for(mp, name, lambda s: s["last_archived_step"] == 6 and s["uploading"] is None)
    assert state["versions_archived"] == 3 and state["coalesced"] == 3
    assert versions(f"{URL}/b-{bound}", name) == [("auto-1", 1), ("auto-5", 5), ("auto-6", 6)]


def test_the_policy_survives_a_remount(s3: str, mount: Mount, tmp_path: Path) -> None:
    mp = mount.mountpoint
    make_namespace(mp, "r", SMALL, steps=1)
    with AdminClient(mp) as client:
        archive_calls.set_archive_policy(client, client.nsid("r"), {"url": f"{URL}/c", "every": 1,
                                                                    "chunk_bytes": 5 << 20})
    wait_for(mp, "r", lambda s: s["last_archived_step"] == 1 and s["uploading"] is None)
    mount.unmount()
    again = start_mount(mount.backing, tmp_path / "mnt-again")
    try:
        train(again.mountpoint, "r", SMALL, 2)
        wait_for(again.mountpoint, "r", lambda s: s["last_archived_step"] == 2)
        assert versions(f"{URL}/c", "r") == [("auto-1", 1), ("auto-2", 2)]
    finally:
        again.unmount()


def test_bad_policies_are_refused_and_change_nothing(s3: str, mount: Mount) -> None:
    mp = mount.mountpoint
    make_namespace(mp, "s", SMALL, steps=1)
    bad = [
        {"url": f"{URL}/d"},  # no every
        {"url": f"{URL}/d", "every": 0},
        {"url": f"{URL}/d", "every": 1, "keep_local": 2, "max_pending": 3},  # waits beyond what is kept
        {"url": f"{URL}/d", "every": 1, "spill_capacity": 4096},  # holds no version of the namespace
        {"url": f"{URL}/d", "every": 1, "retention": 4},
        {"url": "s3://no-such-bucket-here/x", "every": 1},
        {"url": "file:///tmp/x", "every": 1},
        ["every", 1],
    ]
    with AdminClient(mp) as client:
        nsid = client.nsid("s")
        for policy in bad:
            with pytest.raises(DeviceError) as refused:
                archive_calls.set_archive_policy(client, nsid, policy)  # type: ignore[arg-type]
            assert refused.value.status in (Status.INVALID_FIELD, Status.SNAPSHOT_NOT_FOUND), policy
        page = archive_calls.archive_statistics(client, nsid)
    assert page["policies"] == {} and not (mount.backing / "archive_policy.json").exists()
    assert local_auto(mp, "s") == []


def test_an_unreadable_policy_file_is_said_not_silently_dropped(s3: str, backing: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A policy file that cannot be read (damaged by hand): the device still serves, without
    the policies, and says why in log page C4h and `cossd archive --status` until one is set."""
    (backing / "archive_policy.json").write_text("{not json")
    mounted = start_mount(backing, tmp_path / "mnt")
    try:
        mp = mounted.mountpoint
        make_namespace(mp, "u", SMALL, steps=1)
        with AdminClient(mp) as client:
            page = archive_calls.archive_statistics(client)
        assert "archive_policy.json cannot be read" in page["policy_file_error"] and page["policies"] == {}
        assert run_verb("archive", mp, "--status") == 0
        assert "cannot be read" in capsys.readouterr().err
        assert run_verb("archive", mp, "u", "--every", "1", "--to", f"{URL}/e", "--chunk-size", "5M") == 0
        with AdminClient(mp) as client:
            assert archive_calls.archive_statistics(client)["policy_file_error"] is None
    finally:
        mounted.unmount()



def _manifest_bytes(endpoint: str, key: str) -> bytes:
    return bytes(s3_client(endpoint).get_object(Bucket=BUCKET, Key=key)["Body"].read())


def test_a_drive_restored_from_the_store_never_replaces_the_version_it_came_from(
        s3: str, mount: Mount, tmp_path: Path) -> None:
    """Disaster recovery as tiers.md tells it: the newest version restored onto a new drive, the
    same policy set again. Its first look snapshots the committed step as auto-2, the very
    version it came from: counted as archived (the same state), never uploaded again, so its
    manifest is never deleted (a kill -9 then would have left no complete version)."""
    url = f"{URL}/restored"
    policy = {"url": url, "every": 2, "keep_local": 1, "keep_remote": 1, "chunk_bytes": 5 << 20}
    make_namespace(mount.mountpoint, "v", SMALL, steps=0)
    with AdminClient(mount.mountpoint) as client:
        archive_calls.set_archive_policy(client, client.nsid("v"), policy)
    for step in (1, 2):
        train(mount.mountpoint, "v", SMALL, step)
    wait_for(mount.mountpoint, "v", lambda s: s["last_archived_step"] == 2 and s["uploading"] is None)
    mount.unmount()  # drive A is lost
    key = "auto/restored/v/auto-2/manifest.json"
    before = _manifest_bytes(s3, key)
    archive_restore.restore(f"{url}/v/auto-2", tmp_path / "B", capacity_bytes=8 << 30)
    b = start_mount(tmp_path / "B", tmp_path / "mB")
    missing: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        client = s3_client(s3)
        while not stop.is_set():
            try:
                client.head_object(Bucket=BUCKET, Key=key)
            except Exception:
                missing.append(time.monotonic())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with AdminClient(b.mountpoint) as client:
            archive_calls.set_archive_policy(client, client.nsid("v"), policy)
        state = wait_for(b.mountpoint, "v", lambda s: s["last_archived_step"] == 2 and s["uploading"] is None
                         and not s["pending"])
        assert (state["snapshots_taken"], state["versions_archived"], state["upload_failures"],
                state["deleted_remote"]) == (1, 1, 0, 0), state
        stop.set()
        watcher.join()
        assert missing == [] and _manifest_bytes(s3, key) == before  # never deleted, never rewritten
        # Training goes on: the next version is archived; the one B came from is A's, and stays.
        for step in (3, 4):
            train(b.mountpoint, "v", SMALL, step)
        state = wait_for(b.mountpoint, "v", lambda s: s["last_archived_step"] == 4 and s["uploading"] is None)
        assert state["deleted_remote"] == 0 and state["upload_failures"] == 0
        assert versions(url, "v") == [("auto-2", 2), ("auto-4", 4)]
        b.kill()
    finally:
        stop.set()
        watcher.join()
        stop_mount(b)
    assert _manifest_bytes(s3, key) == before
    assert archive_restore.restore(f"{url}/v/auto-2", tmp_path / "C", capacity_bytes=8 << 30)["step"] == 2


def _train_other(mp: Path, name: str, step: int) -> None:
    """Another run's gradients: the states differ from train()'s at every step."""
    for tensor, numel in SMALL:
        pwrite_all(tensor_dir(mp, name, tensor) / "grad", gradient(step + 1000, numel))


def test_retention_deletes_only_the_namespaces_own_versions(s3: str, mount: Mount) -> None:
    """A namespace deleted and created again under the same name (its policy, kept by name,
    applies): the new one's versions are a lineage of their own. Retention keeps the one just
    archived and deletes only the new lineage's older ones, never the previous run's; a tag the
    previous run archived is never replaced (that step is not archived, and said so)."""
    mp = mount.mountpoint
    url = f"{URL}/lineage"
    make_namespace(mp, "w", SMALL, steps=0)
    with AdminClient(mp) as client:
        archive_calls.set_archive_policy(client, client.nsid("w"), {
            "url": url, "every": 1, "keep_local": 1, "keep_remote": 1, "chunk_bytes": 5 << 20})
    for step in (1, 2, 3):
        train(mp, "w", SMALL, step)
    wait_for(mp, "w", lambda s: s["last_archived_step"] == 3 and s["uploading"] is None and not s["pending"])
    assert versions(url, "w") == [("auto-3", 3)]
    run1 = _manifest_bytes(s3, "auto/lineage/w/auto-3/manifest.json")
    with AdminClient(mp) as client:
        client.delete_namespace(client.nsid("w"))
    make_namespace(mp, "w", SMALL, steps=0)  # the same daemon: its policy state starts afresh too
    _train_other(mp, "w", 1)
    state = wait_for(mp, "w", lambda s: s["versions_archived"] == 1 and s["uploading"] is None and not s["pending"])
    assert state["deleted_remote"] == 0 and state["last_archived_step"] == 1
    assert versions(url, "w") == [("auto-1", 1), ("auto-3", 3)]  # run 2's only version kept
    _train_other(mp, "w", 2)
    state = wait_for(mp, "w", lambda s: s["last_archived_step"] == 2 and s["uploading"] is None)
    assert state["deleted_remote"] == 1  # run 2's auto-1, beyond keep_remote of its own lineage
    assert versions(url, "w") == [("auto-2", 2), ("auto-3", 3)]
    _train_other(mp, "w", 3)  # auto-3 is run 1's, complete, of another state: not replaced
    state = wait_for(mp, "w", lambda s: s["upload_failures"] == 1 and not s["pending"] and s["uploading"] is None)
    assert "another state" in state["last_error"] and state["last_archived_step"] == 2
    assert _manifest_bytes(s3, "auto/lineage/w/auto-3/manifest.json") == run1
    _train_other(mp, "w", 4)
    state = wait_for(mp, "w", lambda s: s["last_archived_step"] == 4 and s["uploading"] is None)
    assert state["deleted_remote"] == 2
    assert versions(url, "w") == [("auto-3", 3), ("auto-4", 4)]
    assert _manifest_bytes(s3, "auto/lineage/w/auto-3/manifest.json") == run1
