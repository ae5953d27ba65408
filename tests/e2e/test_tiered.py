"""cossd.trainer.TieredCheckpointer against a real S3 server (SeaweedFS): a small model and
torch's AdamW saved every step within the memory pool's bound and restored bit for bit; a store
behind a tbf-limited veth (network namespaces) that fills the spill tier, which drains when the
limit is lifted; every tier full, coalescing counted; a corrupted object caught on restore;
kill -9 of a process mid-upload leaves no complete-looking version; bad input refused."""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

MIB = 1 << 20
BUCKET = "tiered"
CHUNK = 5 * MIB
WAIT_S = 60.0  # the most any condition below is waited for (a failure, never a figure)


# ---------------------------------------------------------------------- the model


def make_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """About 1.05M params: a version is 12.6 MB (FP32 params, AdamW's two moments), 3 parts."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    inputs = torch.randn(16, 512, generator=torch.Generator().manual_seed(step))
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def assert_identical(a: Any, b: Any, path: str = "state") -> None:
    """Equal bit for bit: tensors by their bytes (and dtype, shape), everything else by value."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for key in a:
            assert_identical(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def restored(checkpointer: Any, version: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what restore() said, the state it loaded) into a fresh model and optimizer."""
    model, optimizer = make_model(seed=99)
    info = checkpointer.restore(model, optimizer, version)
    return info, snapshot(model, optimizer)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"still not {what} after {WAIT_S} s"
        time.sleep(0.05)


# ---------------------------------------------------------------------- the stores

if __name__ == "__main__":  # the child process of the kill test: tests/ is not on its path
    sys.path.append(str(Path(__file__).resolve().parents[1]))
import s3_server  # noqa: E402  (tests/, on the path as conftest's directory)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SeaweedFS on loopback; boto3 finds it through AWS_* in the environment, as a user's would."""
    with s3_server.store_in_environment(tmp_path_factory.mktemp("weed"), BUCKET) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def far_store(store: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """SeaweedFS in network namespace a (10.77.0.1), reached from namespace b across a veth
    pair whose b side a tbf qdisc can slow: (the pair, the endpoint). The tests run their
    checkpointers inside b (`with pair.b.entered()`)."""
    import netns

    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with netns.joined_namespaces() as pair:
        server = s3_server.start_weed(tmp_path_factory.mktemp("weed-far"), BUCKET, ip=pair.a.address,
                                      popen=lambda argv, **kw: pair.popen(pair.a, argv, **kw),
                                      reach=lambda function: pair.b.call(function))
        try:
            yield pair, server.endpoint
        finally:
            server.stop()


def checkpointer(url: str, **options: Any) -> Any:
    from cossd.trainer import TieredCheckpointer

    options.setdefault("chunk_bytes", CHUNK)
    return TieredCheckpointer(url, **options)


def version_bytes() -> int:
    from cossd.trainer.checkpoint import payload as tier_payload

    model, optimizer = make_model()
    train_step(model, optimizer, 1)
    return tier_payload.plan({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                              "optimizer_class": "AdamW"}, 1).size


VERSION = version_bytes()


# ---------------------------------------------------------------------- tests


def test_the_policy_aimd_and_the_coalescing_rule() -> None:
    """The policy's rules alone (no store): AIMD's window, and which versions coalescing drops."""
    from cossd.trainer.checkpoint.policy import AimdWindow, Candidate, coalesce

    window = AimdWindow(initial=2, maximum=4, latency_target_s=1.0)
    for _ in range(5):
        window.success(0.1)
    assert window.limit == 4  # one more per part within the target, up to the maximum
    window.success(1.5)
    assert window.limit == 2  # a slow part halves it
    window.failure()
    window.failure()
    assert window.limit == 1 and window.decreases == 2  # never below one
    with pytest.raises(ValueError):
        AimdWindow(initial=5, maximum=4, latency_target_s=1.0)
    versions = [Candidate(1, 10, uploading=True), Candidate(2, 10, False), Candidate(3, 10, False),
                Candidate(4, 10, False)]
    # Oldest first, never the one being uploaded (before the stall bound), never the newer one.
    assert coalesce(versions, 15, newer_than_all=4, include_uploading=False) == [2, 3]
    assert coalesce(versions, 25, newer_than_all=4, include_uploading=False) == []  # not enough: none
    assert coalesce(versions, 25, newer_than_all=4, include_uploading=True) == [2, 3, 1]
    assert coalesce(versions, 5, newer_than_all=2, include_uploading=False) == []


def test_a_spill_no_longer_needed_stops_and_leaves_nothing(tmp_path: Path) -> None:
    """A version archived (or dropped) while it is being spilled: the spill stops at the next
    chunk and removes what it wrote, so a save waiting for its pool room is not held for the
    rest of a slow disk; a version still needed is spilled whole and complete."""
    from cossd.trainer.checkpoint.spill import SpillDir

    spill = SpillDir(tmp_path / "spill")
    view = memoryview(bytes(range(256)) * 4096)  # 1 MiB: 16 chunks of 64 KiB
    asked = []

    def needed() -> bool:
        asked.append(True)
        return len(asked) < 4  # archived meanwhile, after three chunks
    assert spill.write(7, view, 64 << 10, needed=needed) is None
    assert len(asked) <= 5 and list((tmp_path / "spill").iterdir()) == []  # not the 16 chunks
    record = spill.write(8, view, 64 << 10)
    assert record is not None and spill.data_path(8).read_bytes() == bytes(view) and spill.sidecar_path(8).exists()


def test_every_step_within_the_pool_bound_restored_bit_for_bit(store: str, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}"
    memory = VERSION * 5 // 2
    ck = checkpointer(url, memory_bytes=memory, spill_dir=tmp_path / "spill", spill_bytes=VERSION * 3,
                      max_stall_s=2.0)
    model, optimizer = make_model()
    states = {}
    for step in range(1, 13):
        train_step(model, optimizer, step)
        ck.save(model, optimizer, step)
        states[step] = snapshot(model, optimizer)
    # The newest version, from the pool or the spill dir (wherever the spill thread has it by now).
    info, state = restored(ck)
    assert info["step"] == 12 and info["tier"] in ("memory", "spill")
    assert_identical(state, states[12])
    report = ck.close(drain=True)
    figures = report["stats"]
    assert report["drained"] and "nothing left to archive" in report["statement"]
    assert 0 < figures["memory_peak"] <= memory
    assert figures["spill_peak"] <= VERSION * 3 and figures["spill_used"] == 0
    assert figures["saves"] == 12
    # Every version archived or dropped by coalescing, and each drop counted.
    assert figures["archived"] + figures["coalesced"] == 12
    assert len(figures["coalesced_steps"]) == figures["coalesced"]
    assert figures["parts_uploaded"] >= 3 * figures["archived"] > 0

    # From the store alone (a new process's view): every archived version, restorable bit for bit.
    fresh = checkpointer(url, memory_bytes=VERSION)
    listed = fresh.versions()
    archived = [row["step"] for row in listed]
    assert archived == sorted(set(range(1, 13)) - set(figures["coalesced_steps"]))
    assert 12 in archived and all(row["tiers"] == ["store"] for row in listed)
    info, state = restored(fresh)
    assert (info["step"], info["tier"], info["skipped"]) == (12, "store", [])
    assert_identical(state, states[12])
    info, state = restored(fresh, archived[0])
    assert info["step"] == archived[0]
    assert_identical(state, states[archived[0]])

    # Bad input: a clear error, and nothing changes.
    from cossd.trainer.checkpoint.tiered import RestoreError

    model, optimizer = make_model(seed=5)
    before = snapshot(model, optimizer)
    with pytest.raises(RestoreError, match="no complete version 999"):
        fresh.restore(model, optimizer, 999)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="does not fit"):
        fresh.restore(other, torch.optim.AdamW(other.parameters()))
    assert_identical(snapshot(model, optimizer), before)
    tiny = checkpointer(url, memory_bytes=1024)
    with pytest.raises(ValueError, match="must hold at least one version"):
        tiny.save(model, optimizer, 1)
    assert tiny.stats()["saves"] == 0 and tiny.close()["drained"]
    fresh.save(model, optimizer, 20)
    with pytest.raises(ValueError, match="not after the last saved step 20"):
        fresh.save(model, optimizer, 20)
    assert fresh.stats()["saves"] == 1
    fresh.close(drain=False)
    with pytest.raises(RuntimeError, match="closed"):
        fresh.save(model, optimizer, 21)
    with pytest.raises(ValueError, match="s3://BUCKET/PREFIX"):
        checkpointer("/tmp/nowhere", memory_bytes=memory)
    with pytest.raises(ValueError, match="chunk_bytes"):
        checkpointer(url, memory_bytes=memory, chunk_bytes=MIB)
    with pytest.raises(ValueError, match="spill_dir and spill_bytes"):
        checkpointer(url, memory_bytes=memory, spill_bytes=VERSION)
    from cossd.trainer.checkpoint.store import StoreError

    with pytest.raises(StoreError, match="no-such-bucket"):
        checkpointer("s3://no-such-bucket/x", memory_bytes=memory)


def test_corrupted_object_detected_on_restore(store: str, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/{tmp_path.name}"
    # With a bandwidth cap (the token bucket), far above what the store takes here.
    ck = checkpointer(url, memory_bytes=VERSION * 3, upload_bytes_per_s=1e9)
    model, optimizer = make_model()
    states = {}
    for step in (1, 2):
        train_step(model, optimizer, step)
        ck.save(model, optimizer, step)
        states[step] = snapshot(model, optimizer)
    # A version in the pool is restored from it (archived versions stay there until room is needed).
    info, state = restored(ck)
    assert (info["step"], info["tier"]) == (2, "memory")
    assert_identical(state, states[2])
    assert ck.close()["stats"]["archived"] == 2
    s3 = s3_server.client(store)
    key = f"{tmp_path.name}/v{2:012d}/data"
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[CHUNK + 4321] ^= 0x10  # one bit of chunk 1, the size unchanged
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))

    fresh = checkpointer(url, memory_bytes=VERSION)
    with pytest.warns(RuntimeWarning, match="version 2 from the store tier.*chunk 1"):
        info, state = restored(fresh)
    assert info["step"] == 1 and len(info["skipped"]) == 1  # fell back to the older complete version
    assert_identical(state, states[1])
    model, optimizer = make_model(seed=7)
    before = snapshot(model, optimizer)
    from cossd.trainer.checkpoint.tiered import RestoreError

    with pytest.warns(RuntimeWarning), pytest.raises(RestoreError, match="chunk 1.*CRC32C"):
        fresh.restore(model, optimizer, 2)
    assert_identical(snapshot(model, optimizer), before)
    fresh.close()


def test_slow_store_spills_then_drains(far_store: tuple[Any, str], tmp_path: Path) -> None:
    pair, endpoint = far_store
    url = f"s3://{BUCKET}/{tmp_path.name}"
    memory, spill = VERSION * 5 // 2, VERSION * 4
    with pair.b.entered():
        pair.rate_limit(pair.b, mbit=16)  # 2 MB/s towards the store: a version takes 6 s
        try:
            ck = checkpointer(url, endpoint_url=endpoint, memory_bytes=memory, spill_dir=tmp_path / "spill",
                              spill_bytes=spill, max_stall_s=10.0)
            model, optimizer = make_model()
            states = {}
            for step in range(1, 6):
                train_step(model, optimizer, step)
                ck.save(model, optimizer, step)
                states[step] = snapshot(model, optimizer)
            # Versions arrive faster than the store takes them: the spill tier fills, within its bound.
            wait_for(lambda: len(ck.stats()["versions_in_spill"]) >= 3, "spilled")
            during = ck.stats()
            assert during["spill_used"] >= 3 * VERSION
            # The policy sees parts slower than its latency target and halves its concurrency.
            wait_for(lambda: ck.stats()["concurrency_decreases"] > 0, "backing off")
        finally:
            pair.clear_rate_limit(pair.b)
        # Bandwidth back: the spill tier drains into the store, with nothing dropped.
        wait_for(lambda: ck.stats()["spill_used"] == 0 and ck.stats()["archived"] == 5, "drained")
        figures = ck.stats()
        assert figures["coalesced"] == 0 and figures["spilled"] >= 3
        assert figures["memory_peak"] <= memory and figures["spill_peak"] <= spill
        assert figures["concurrency_increases"] > 0
        assert [(row["step"], "store" in row["tiers"]) for row in ck.versions()] == [(s, True) for s in range(1, 6)]
        assert not list((tmp_path / "spill").iterdir())
        assert ck.close()["drained"]
        fresh = checkpointer(url, endpoint_url=endpoint, memory_bytes=VERSION)
        info, state = restored(fresh)
        assert info["step"] == 5
        assert_identical(state, states[5])
        fresh.close()


def test_the_devices_archive_paces_itself_across_a_throttled_link(far_store: tuple[Any, str],
                                                                   tmp_path: Path) -> None:
    """The device's own archiver (ARCHIVE, emulator/archive/versions.py) shares the AIMD window of
    protocol/pacing.py: across a 40 Mbit/s link a 5 MiB part takes longer than its 0.625 s
    target, so the window of parts in flight halves (counted in log page C4h's figures), and
    the version still arrives whole."""
    import numpy as np

    from cossd.emulator import Device, NamespaceSpec, TensorSpec
    from cossd.emulator.archive import versions as archive
    from cossd.emulator.jobs import JobTable

    pair, endpoint = far_store
    backing = tmp_path / "backing"
    Device.format(backing)
    pair.rate_limit(pair.b, mbit=40)  # what the device (in b) sends to the store (in a)
    try:
        with Device.open(backing) as device:
            numel = 1_500_000  # 21 MB of state: 5 parts of 5 MiB
            namespace = device.create_namespace(NamespaceSpec("pace", (TensorSpec("w", numel),)))
            namespace.write_grad("w", 0, (np.random.default_rng(3).standard_normal(numel) * 0.01)
                                 .astype(np.float16).tobytes())
            namespace.snapshots.create("s1", device.reserve)
            traffic, jobs = archive.Traffic(), JobTable()
            payload = {"tag": "s1", "url": f"s3://{BUCKET}/pace", "endpoint_url": endpoint,
                       "chunk_bytes": 5 << 20, "memory_bytes": 20 << 20}
            # Started inside b: the job's threads are made there and so live there too.
            job = pair.b.call(lambda: archive.start(device, jobs, namespace, payload, traffic, set()))
            jobs.join(120)
            assert job.state == "done", job.describe()
            assert traffic.parts_uploaded == 5 and traffic.window_decreases >= 1, traffic
    finally:
        pair.clear_rate_limit(pair.b)


def test_the_devices_policy_through_a_link_that_slows_and_recovers(far_store: tuple[Any, str], tmp_path: Path,
                                                                   figures: list[str]) -> None:
    """The device's automatic policy (a version every step, at most two versions' bytes
    waiting on the drive) with the store behind the veth: fast, then tbf 8 Mbit/s while steps
    go on (versions wait within the spill capacity, the older ones coalesced, every step
    committed without waiting for the store), then fast again: the waiting ones drain and the
    store ends with the newest step. Step times are reported per phase, not asserted."""
    import statistics

    import numpy as np

    from cossd.emulator import Device, NamespaceSpec, TensorSpec
    from cossd.emulator.archive import versions as archive
    from cossd.emulator.archive.policy import PolicyRunner
    from cossd.emulator.jobs import JobTable

    pair, endpoint = far_store
    backing = tmp_path / "backing"
    Device.format(backing)
    numel = 500_000  # a version (one state copy) of 7 MB: two parts of 5 MiB
    with Device.open(backing) as device:
        namespace = device.create_namespace(NamespaceSpec("policy", (TensorSpec("w", numel),)))
        version = namespace.snapshots.copy_bytes
        traffic = archive.Traffic()
        runner = PolicyRunner(device, JobTable(), lambda name: traffic, set())
        policy = {"url": f"s3://{BUCKET}/{tmp_path.name}", "endpoint_url": endpoint, "every": 1, "keep_local": 4,
                  "keep_remote": 20, "spill_capacity": 2 * version, "chunk_bytes": 5 << 20}
        # Set inside b: the policy's thread, and the upload threads it starts, live there.
        pair.b.call(lambda: runner.set(namespace, policy))
        rng = np.random.default_rng(5)
        times: dict[str, list[float]] = {"fast": [], "slow": [], "fast again": []}
        most_waiting = 0

        def step(phase: str) -> None:
            grads = (rng.standard_normal(numel) * 0.01).astype(np.float16).tobytes()
            started = time.perf_counter()
            namespace.write_grad("w", 0, grads)  # an implicit step: committed when this returns
            times[phase].append(time.perf_counter() - started)

        def state() -> dict[str, Any]:
            return runner.page()["policy"]["state"]

        try:
            for _ in range(2):
                step("fast")
                wait_for(lambda: state()["last_archived_step"] == namespace.committed_step, "archived while fast")
            pair.rate_limit(pair.b, mbit=8)  # 1 MB/s: a version takes 7 s
            try:
                for _ in range(6):
                    step("slow")
                    wait_for(lambda: state()["last_snapshot_step"] == namespace.committed_step, "snapshot taken")
                    most_waiting = max(most_waiting, state()["spill_bytes"])
                during = state()
                assert during["spill_bytes"] <= 2 * version and len(during["pending"]) <= 2, during
                assert during["coalesced"] >= 3, during
            finally:
                pair.clear_rate_limit(pair.b)
            for _ in range(2):
                step("fast again")
                wait_for(lambda: state()["last_snapshot_step"] == namespace.committed_step, "snapshot taken")
            wait_for(lambda: state()["last_archived_step"] == 10 and state()["uploading"] is None
                     and not state()["pending"], "drained")
        finally:
            runner.close()
        done = state()
        assert namespace.committed_step == 10 and done["upload_failures"] == 0
        assert done["versions_archived"] + done["coalesced"] == 10, done
    medians = ", ".join(f"{phase} {statistics.median(values) * 1e3:.1f} ms" for phase, values in times.items())
    figures.append(f"T18p device policy across a veth fast -> tbf 8 Mbit/s -> fast: step medians {medians}; "
                   f"spill peak {most_waiting} of {2 * version} bytes; {done['versions_archived']} archived, "
                   f"{done['coalesced']} coalesced, the newest (step 10) in the store")


def test_every_tier_full_coalesces_and_keeps_the_newest(far_store: tuple[Any, str], tmp_path: Path) -> None:
    pair, endpoint = far_store
    url = f"s3://{BUCKET}/{tmp_path.name}"
    memory, spill = VERSION * 5 // 2, VERSION * 3 // 2
    with pair.b.entered():
        pair.rate_limit(pair.b, mbit=8)  # 1 MB/s: one version takes 13 s, eight arrive at once
        try:
            ck = checkpointer(url, endpoint_url=endpoint, memory_bytes=memory, spill_dir=tmp_path / "spill",
                              spill_bytes=spill, max_stall_s=5.0)
            model, optimizer = make_model()
            states = {}
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for step in range(1, 9):
                    train_step(model, optimizer, step)
                    ck.save(model, optimizer, step)
                    states[step] = snapshot(model, optimizer)
                wait_for(lambda: 8 in ck.stats()["versions_in_spill"], "coalesced")
            during = ck.stats()
            assert during["coalesced"] >= 5
            assert during["memory_peak"] <= memory and during["spill_peak"] <= spill
            drops = [str(w.message) for w in caught if "every tier is full" in str(w.message)]
            assert drops and all("the newest version is kept" in d for d in drops)
            # The newest is kept, and the oldest, whose upload is progress already paid for.
            local = {row["step"] for row in ck.versions()}
            assert {1, 8} <= local and not local & set(during["coalesced_steps"])
        finally:
            pair.clear_rate_limit(pair.b)
        report = ck.close(drain=True)
        assert report["drained"]
        kept = sorted(set(range(1, 9)) - set(report["stats"]["coalesced_steps"]))
        assert report["stats"]["archived"] == len(kept)
        assert f"{report['stats']['coalesced']} dropped by coalescing" in report["statement"]
        fresh = checkpointer(url, endpoint_url=endpoint, memory_bytes=VERSION)
        assert [row["step"] for row in fresh.versions()] == kept
        info, state = restored(fresh)
        assert info["step"] == 8
        assert_identical(state, states[8])
        fresh.close()


def test_a_spill_to_a_slow_disk_does_not_hold_a_save_past_its_bound(
        far_store: tuple[Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store crawls and the spill dir's disk takes 2 s a chunk (each chunk of the spill
    delayed before it is written): a save that needs the pool room of a version being spilled
    waits max_stall_s (and a short grace), then that version is coalesced and its spill stops
    at its next chunk, instead of the save waiting for the whole version to reach the disk."""
    from cossd.trainer.checkpoint import spill as tier_spill

    chunks: list[int] = []
    write = tier_spill.SpillDir.write

    def slow_disk(self: Any, step: int, view: memoryview, chunk_bytes: int, needed: Any = lambda: True) -> Any:
        def slowly() -> bool:
            time.sleep(2.0)  # the disk: one chunk's time, before each chunk goes
            chunks.append(step)
            return needed()
        return write(self, step, view, chunk_bytes, needed=slowly)

    monkeypatch.setattr(tier_spill.SpillDir, "write", slow_disk)
    pair, endpoint = far_store
    url = f"s3://{BUCKET}/{tmp_path.name}"
    with pair.b.entered():
        pair.rate_limit(pair.b, mbit=1)  # nothing reaches the store during the test
        try:
            ck = checkpointer(url, endpoint_url=endpoint, memory_bytes=VERSION * 3 // 2,
                              spill_dir=tmp_path / "spill", spill_bytes=VERSION * 4, max_stall_s=0.5)
            model, optimizer = make_model()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                train_step(model, optimizer, 1)
                ck.save(model, optimizer, 1)
                wait_for(lambda: 1 in chunks, "the spill of version 1 begun")
                train_step(model, optimizer, 2)
                saved = ck.save(model, optimizer, 2)  # needs version 1's pool room
            stats = ck.stats()
            assert saved["stall_s"] > 0 and stats["coalesced_steps"] == [1], stats
            drops = [str(w.message) for w in caught if "slower than the saves" in str(w.message)]
            assert drops, [str(w.message) for w in caught]
            wait_for(lambda: ck.stats()["spills_stopped"] == 1, "the spill stopped")
            # Stopped at its next chunk: not all of its chunks went to the disk.
            assert chunks.count(1) < -(-VERSION // CHUNK) + 1, chunks
            assert not tier_spill.SpillDir(tmp_path / "spill").data_path(1).exists()
            assert [row["step"] for row in ck.versions()] == [2]
        finally:
            pair.clear_rate_limit(pair.b)
        ck.close(drain=False)


def test_the_pool_as_a_tier_with_a_timing_profile(store: str, tmp_path: Path) -> None:
    """pool_profile models each save's copy into the pool (the CXL memory tier); timed, a save
    into a pool slower than host memory takes at least the modeled time."""
    slow = tmp_path / "slow-pool.json"
    slow.write_text('{"name": "slow", "bytes_per_s": 50000000, "latency_ns": 1000}')  # 50 MB/s
    url = f"s3://{BUCKET}/{tmp_path.name}"
    with pytest.raises(ValueError, match="pool_timed needs a pool_profile"):
        checkpointer(url, endpoint_url=store, memory_bytes=2 * VERSION, pool_timed=True)
    ck = checkpointer(url, endpoint_url=store, memory_bytes=2 * VERSION, pool_profile="cxl-x8")
    model, optimizer = make_model()
    train_step(model, optimizer, 1)
    saved = ck.save(model, optimizer, 1)
    assert saved["modeled_copy_s"] == (250 + -(-saved["bytes"] * 10**9 // 36_000_000_000)) / 1e9
    assert ck.stats()["pool_profile"] == "cxl-x8" and not ck.stats()["pool_timed"]
    ck.close()
    ck = checkpointer(url, endpoint_url=store, memory_bytes=2 * VERSION, pool_profile=slow, pool_timed=True)
    train_step(model, optimizer, 2)
    saved = ck.save(model, optimizer, 2)
    assert saved["modeled_copy_s"] > 0.2 and saved["copy_s"] >= saved["modeled_copy_s"]
    assert ck.stats()["pool_modeled_copy_s_total"] == saved["modeled_copy_s"]
    ck.close()


def test_kill_9_mid_upload_leaves_no_complete_looking_version(far_store: tuple[Any, str], tmp_path: Path) -> None:
    pair, endpoint = far_store
    url = f"s3://{BUCKET}/{tmp_path.name}"
    spill = tmp_path / "spill"
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    child = pair.popen(pair.b, [sys.executable, __file__, "child", url, str(spill), str(tmp_path)],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "archived 1"
        pair.rate_limit(pair.b, mbit=16)  # 2 MB/s: version 2's parts take seconds
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "mid-upload 2, 3 spilled"
        child.send_signal(signal.SIGKILL)
        child.wait()
    finally:
        pair.clear_rate_limit(pair.b)
        if child.poll() is None:
            child.kill()
            child.wait()
    expected = {step: torch.load(tmp_path / f"step{step}.pt") for step in (1, 2, 3)}
    with pair.b.entered():
        s3 = s3_server.client(endpoint)
        # The kill came mid-upload: version 2's data is an unfinished multipart upload ...
        uploads = s3.list_multipart_uploads(Bucket=BUCKET, Prefix=tmp_path.name).get("Uploads", [])
        unfinished = [u["Key"] for u in uploads]
        assert f"{tmp_path.name}/v{2:012d}/data" in unfinished
        # ... with no manifest: the store lists version 1 only, restore never sees version 2 there.
        from cossd.trainer.checkpoint.store import ObjectStore

        assert ObjectStore(url, endpoint).complete_steps() == [1]
        # Versions 2 and 3 survived in the spill dir. Version 3's file goes bad on the disk.
        with open(spill / f"v{3:012d}.data", "r+b") as f:
            f.seek(CHUNK + 99)
            byte = f.read(1)
            f.seek(CHUNK + 99)
            f.write(bytes([byte[0] ^ 1]))
        # What a kill in the middle of a spill leaves: a data file without its sidecar.
        (spill / f"v{4:012d}.data").write_bytes(b"cut short")
        with pytest.warns(RuntimeWarning, match="removed 1 file.*spill was cut short"):
            fresh = checkpointer(url, endpoint_url=endpoint, memory_bytes=VERSION, spill_dir=spill,
                                 spill_bytes=3 * VERSION)
        figures = fresh.stats()
        assert figures["stale_uploads_aborted"] == 1 and figures["adopted_from_spill"] == 2
        assert figures["spill_leftovers_removed"] == 1 and not (spill / f"v{4:012d}.data").exists()
        # Version 3 fails its CRC32C (in the spill dir, or is gone from it as found bad by the
        # uploader): restore takes version 2, from the spill dir or the store.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            info, state = restored(fresh)
        assert info["step"] == 2
        assert_identical(state, expected[2])
        with pytest.warns(RuntimeWarning, match="version 3 discarded.*CRC32C"):
            report = fresh.close(drain=True)
        assert report["drained"] and report["stats"]["spill_corrupt"] == 1
        assert ObjectStore(url, endpoint).complete_steps() == [1, 2]
        assert not list(spill.iterdir())
        assert not s3.list_multipart_uploads(Bucket=BUCKET, Prefix=tmp_path.name).get("Uploads")
        again = checkpointer(url, endpoint_url=endpoint, memory_bytes=VERSION)
        info, state = restored(again, 1)
        assert_identical(state, expected[1])
        again.close()



def test_restore_finds_a_version_whose_upload_ends_while_it_reads(store: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The recovery flow: a new checkpointer adopts the versions a crashed one left in the
    spill dir and uploads them. If the newest one's upload ends (its spill files removed, the
    version forgotten) while restore is about to read it from the spill dir, restore reads it
    from the store: never an older version in silence, never "none". The race is made certain
    by holding the uploads until restore has listed, and holding restore's spill read until
    the upload has ended (a preemption, a slow disk)."""
    from cossd.trainer.checkpoint import spill as tier_spill, store as tier_store

    url = f"s3://{BUCKET}/{tmp_path.name}"
    spill = tmp_path / "spill"
    # A store too slow to take anything (1 byte/s): every version ends in the spill dir.
    ck1 = checkpointer(url, memory_bytes=VERSION * 3 // 2, spill_dir=spill, spill_bytes=4 * VERSION,
                       upload_bytes_per_s=1.0, max_stall_s=5.0)
    model, optimizer = make_model()
    expected = {}
    for step in (1, 2):
        train_step(model, optimizer, step)
        ck1.save(model, optimizer, step)
        expected[step] = snapshot(model, optimizer)
        wait_for(lambda step=step: step in ck1.stats()["versions_in_spill"], f"version {step} spilled")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck1.close(drain=False)  # the crash: versions 1 and 2 left in the spill dir

    listed = threading.Event()
    begin = tier_store.ObjectStore.begin

    def held_begin(self: Any, step: int) -> str:
        assert listed.wait(WAIT_S), "restore never listed"
        return begin(self, step)

    read_sidecar = tier_spill.SpillDir.read_sidecar
    holder: dict[str, Any] = {"armed": False, "gone": False}

    def slow_read_sidecar(self: Any, step: int) -> dict[str, Any]:
        record = read_sidecar(self, step)
        if step == 2 and holder["armed"]:
            holder["armed"] = False
            listed.set()  # the uploads go on now, and end before this read does
            ck = holder["ck"]
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline and 2 in ck._state.versions:
                time.sleep(0.01)
            holder["gone"] = 2 not in ck._state.versions
        return record

    monkeypatch.setattr(tier_store.ObjectStore, "begin", held_begin)
    monkeypatch.setattr(tier_spill.SpillDir, "read_sidecar", slow_read_sidecar)
    ck2 = checkpointer(url, memory_bytes=VERSION * 3 // 2, spill_dir=spill, spill_bytes=4 * VERSION)
    holder["ck"] = ck2
    try:
        assert [(row["step"], row["tiers"]) for row in ck2.versions()] == [(1, ["spill"]), (2, ["spill"])]
        holder["armed"] = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            info, state = restored(ck2)
        assert holder["gone"], "version 2 was not archived during the held read"
        assert (info["step"], info["tier"], info["skipped"]) == (2, "store", []), (info, caught)
        assert not [w for w in caught if "restore skips" in str(w.message)]
        assert_identical(state, expected[2])
    finally:
        listed.set()
        ck2.close()


def child_main(url: str, spill: str, out: str) -> None:
    """The process killed mid-upload: version 1 archived; then, with the store slowed,
    version 2 being uploaded (one part of it in the store, not all) and version 3 saved, both
    moved to the spill dir by then (the pool holds one version and a half)."""
    from cossd.trainer import TieredCheckpointer

    ck = TieredCheckpointer(url, memory_bytes=VERSION * 3 // 2, spill_dir=spill, spill_bytes=3 * VERSION,
                            chunk_bytes=CHUNK, initial_concurrency=1, max_concurrency=1, max_stall_s=30.0)
    model, optimizer = make_model()
    for step in (1, 2, 3):
        train_step(model, optimizer, step)
        ck.save(model, optimizer, step)
        torch.save(snapshot(model, optimizer), Path(out) / f"step{step}.pt")
        if step == 1:
            while ck.stats()["archived"] < 1:
                time.sleep(0.02)
            print("archived 1", flush=True)
            sys.stdin.readline()
    deadline = time.monotonic() + 120
    while ck.stats()["parts_uploaded"] < 4 or ck.stats()["versions_in_spill"] != [2, 3]:
        if time.monotonic() > deadline:  # say so, rather than leave the parent reading forever
            print(f"never mid-upload 2 with 3 spilled: {ck.stats()}", flush=True)
            return
        time.sleep(0.01)  # version 1's 3 parts and one of version 2's
    print("mid-upload 2, 3 spilled", flush=True)
    time.sleep(600)


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child_main(*sys.argv[2:5])
