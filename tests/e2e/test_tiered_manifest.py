"""The tiered checkpointer's manifests carry their own CRC32C (the device archive's seal): a bit
flipped in a stored manifest or a spill sidecar makes restore skip that version, with a warning
naming it, and load the one before bit for bit; format-1 manifests are refused unless accepted."""
from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import s3_server  # tests/, on the path as conftest's directory
from test_tiered import (BUCKET, VERSION, assert_identical, checkpointer, make_model, restored, snapshot,  # noqa: F401
                         store, train_step, wait_for)

SEALED = "manifest_crc32c"


def flip_in_value(raw: bytes, field: str, nth_digit_from_end: int = 0) -> bytes:
    """`raw` with one bit flipped in a digit of `field`'s value (bit 0: a digit stays a digit,
    '4' <-> '5', so the JSON still parses and only the checksum can tell)."""
    start = raw.index(f'"{field}": '.encode()) + len(field) + 4
    digits = [i for i in range(start, len(raw)) if raw[i:i + 1].isdigit()]
    # Digits of the value only: they run up to the first separator after it.
    end = next(i for i in range(start, len(raw)) if raw[i:i + 1] in (b",", b"}"))
    if field == "chunks_crc32c":
        end = raw.index(b"]", start)
    position = [i for i in digits if i < end][-1 - nth_digit_from_end]
    changed = bytearray(raw)
    changed[position] ^= 0x01
    return bytes(changed)


# ---------------------------------------------------------------------- the seal itself


def test_one_seal_for_the_device_and_the_trainer() -> None:
    """protocol/manifest_seal.py is what both sealers use: CRC32C (Castagnoli, the value the
    device's kernels computed before, so archives sealed then still verify) of compact
    sorted-key JSON without the seal; any changed field is found, indentation is not."""
    from cossd import kernels
    from cossd.emulator.archive import versions as archive
    from cossd.protocol import manifest_seal
    from cossd.trainer.checkpoint import store as tier_store

    record = tier_store.manifest(7, 12_602_880, 5 << 20, [2892736014, 2957909845, 359192300],
                                 "2026-12-02T04:58:09Z")
    sealed = manifest_seal.sealed(record)
    compact = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    assert sealed[SEALED] == kernels.crc32c(compact) == manifest_seal.seal_of(sealed)
    assert archive.MANIFEST_CHECKSUM == tier_store.MANIFEST_CHECKSUM == SEALED
    reread = json.loads(json.dumps(sealed, indent=3))
    assert manifest_seal.seal_problem(reread) is None
    for field, value in (("step", 8), ("chunk_bytes", 5 << 21), ("created", "2026-12-02T04:58:08Z"),
                         ("chunks_crc32c", [2892736014, 2957909845, 359192301])):
        assert "fails its own checksum" in manifest_seal.seal_problem(sealed | {field: value})
    assert manifest_seal.seal_problem(record) is not None  # no seal at all
    # The device's archive seals with the same helper: its encoded manifest verifies here.
    device = json.loads(archive.encode_manifest({"format": "cossd-archive", "version": 2, "step": 3}))
    assert device[SEALED] == manifest_seal.seal_of(device)


def test_spill_sidecars_are_sealed_and_format_1_is_refused_unless_accepted(tmp_path: Path) -> None:
    """A sidecar is written sealed; scan() discards one whose seal fails (damage: it is only
    ever written whole), and leaves a format-1 one alone unless accepted."""
    from cossd.trainer.checkpoint import store as tier_store
    from cossd.trainer.checkpoint.spill import SpillDir

    spill = SpillDir(tmp_path)
    view = memoryview(bytes(range(256)) * 1024)
    for step in (1, 2, 3):
        assert spill.write(step, view, 64 << 10) is not None
    assert json.loads(spill.sidecar_path(1).read_text())["version"] == 2
    # Version 2's sidecar damaged; version 3's rewritten as an older cossd wrote it (format 1).
    spill.sidecar_path(2).write_bytes(flip_in_value(spill.sidecar_path(2).read_bytes(), "payload_bytes", 2))
    old = {k: v for k, v in json.loads(spill.sidecar_path(3).read_text()).items() if k != SEALED} | {"version": 1}
    spill.sidecar_path(3).write_text(json.dumps(old))
    found = spill.scan()
    assert list(found.complete) == [1] and found.cut_short == []
    assert len(found.corrupt) == 1 and "version 2" in found.corrupt[0] and "fails its own checksum" in found.corrupt[0]
    assert not spill.sidecar_path(2).exists() and not spill.data_path(2).exists()
    assert len(found.unchecked) == 1 and "accept_unchecked_manifests=True" in found.unchecked[0]
    assert spill.sidecar_path(3).exists() and spill.data_path(3).exists()  # left, not removed
    accepting = SpillDir(tmp_path, accept_unchecked=True)
    with pytest.warns(RuntimeWarning, match="version 3 .* format-1 manifest"):
        accepted = accepting.scan()
    assert list(accepted.complete) == [1, 3]
    with pytest.warns(RuntimeWarning, match="version 3 .* format-1 manifest"):
        assert bytes(accepting.read_version(3, accepted.complete[3], bytearray(len(view)))) == bytes(view)
    spill.sidecar_path(1).write_text("{")
    with pytest.raises(tier_store.CorruptVersionError, match="not JSON"):
        spill.read_sidecar(1)


# ---------------------------------------------------------------------- against the store


@pytest.fixture
def two_archived(store: str, tmp_path: Path) -> Iterator[tuple[str, dict[int, Any], Any, str, bytes]]:
    """Versions 1 and 2 archived: (url, their states, an S3 client, version 2's manifest key,
    its stored bytes)."""
    url = f"s3://{BUCKET}/{tmp_path.name}"
    ck = checkpointer(url, memory_bytes=VERSION * 3)
    model, optimizer = make_model()
    states = {}
    for step in (1, 2):
        train_step(model, optimizer, step)
        ck.save(model, optimizer, step)
        states[step] = snapshot(model, optimizer)
    assert ck.close()["stats"]["archived"] == 2
    s3 = s3_server.client(store)
    key = f"{tmp_path.name}/v{2:012d}/manifest.json"
    yield url, states, s3, key, s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def test_a_bit_flipped_in_the_stored_manifest_skips_that_version(
        two_archived: tuple[str, dict[int, Any], Any, str, bytes]) -> None:
    from cossd.protocol import manifest_seal
    from cossd.trainer.checkpoint.tiered import RestoreError

    url, states, s3, key, original = two_archived
    stored = json.loads(original)
    assert stored["version"] == 2 and manifest_seal.seal_problem(stored) is None and "archived" in stored
    # A field no other check reads (the old code restored this version), a chunk's checksum and
    # the size (the old code blamed a chunk): each is the manifest's own damage, and said so.
    for field, digit in (("created", 0), ("chunks_crc32c", 3), ("payload_bytes", 1)):
        s3.put_object(Bucket=BUCKET, Key=key, Body=flip_in_value(original, field, digit))
        fresh = checkpointer(url, memory_bytes=VERSION)
        with pytest.warns(RuntimeWarning, match=r"skips version 2 from the store tier: .*its manifest fails its "
                                                r"own checksum"):
            info, state = restored(fresh)
        assert info["step"] == 1 and len(info["skipped"]) == 1, field
        assert_identical(state, states[1])
        model, optimizer = make_model(seed=7)
        before = snapshot(model, optimizer)
        with pytest.warns(RuntimeWarning), pytest.raises(RestoreError, match="version 2 .*fails its own checksum"):
            fresh.restore(model, optimizer, 2)
        assert_identical(snapshot(model, optimizer), before)  # nothing loaded
        fresh.close()
    s3.put_object(Bucket=BUCKET, Key=key, Body=original)
    info, state = restored(checkpointer(url, memory_bytes=VERSION))
    assert info["step"] == 2 and info["skipped"] == []
    assert_identical(state, states[2])


def test_a_format_1_manifest_is_refused_unless_accepted(
        two_archived: tuple[str, dict[int, Any], Any, str, bytes]) -> None:
    """What an older cossd wrote (the same fields, version 1, no seal): refused by default with
    the option named, as the device's archive does; restored bit for bit once accepted."""
    url, states, s3, key, original = two_archived
    old = {k: v for k, v in json.loads(original).items() if k != SEALED} | {"version": 1}
    s3.put_object(Bucket=BUCKET, Key=key, Body=json.dumps(old).encode())
    fresh = checkpointer(url, memory_bytes=VERSION)
    with pytest.warns(RuntimeWarning, match="version 2 .*format 1.*accept_unchecked_manifests=True"):
        info, state = restored(fresh)
    assert info["step"] == 1
    assert_identical(state, states[1])
    fresh.close()
    accepting = checkpointer(url, memory_bytes=VERSION, accept_unchecked_manifests=True)
    with pytest.warns(RuntimeWarning, match="format-1 manifest .*used as accept_unchecked_manifests asks"):
        info, state = restored(accepting)
    assert info["step"] == 2 and info["skipped"] == []
    assert_identical(state, states[2])
    accepting.close()


def test_a_bit_flipped_in_a_spill_sidecar_skips_that_version(store: str, tmp_path: Path) -> None:
    """Versions 1 and 2 only in the spill dir (the upload held by a 1 B/s cap). Version 2's
    sidecar damaged on the disk: restore in the same process checks it again and skips the
    version; a checkpointer started on the dir discards it; both load version 1 bit for bit."""
    url = f"s3://{BUCKET}/{tmp_path.name}"
    spill = tmp_path / "spill"
    ck = checkpointer(url, memory_bytes=VERSION * 3 // 2, spill_dir=spill, spill_bytes=3 * VERSION,
                      upload_bytes_per_s=1.0, max_stall_s=30.0)
    model, optimizer = make_model()
    states = {}
    for step in (1, 2):
        train_step(model, optimizer, step)
        ck.save(model, optimizer, step)
        states[step] = snapshot(model, optimizer)
    wait_for(lambda: ck.stats()["versions_in_spill"] == [1, 2] and ck.stats()["versions_in_memory"] == [],
             "versions 1 and 2 spilled")
    sidecar = spill / f"v{2:012d}.json"
    assert json.loads(sidecar.read_text())["version"] == 2
    sidecar.write_bytes(flip_in_value(sidecar.read_bytes(), "created", 1))
    with pytest.warns(RuntimeWarning, match=r"skips version 2 from the spill tier: .*its manifest fails its own "
                                            r"checksum"):
        info, state = restored(ck)
    assert (info["step"], info["tier"], len(info["skipped"])) == (1, "spill", 1)
    assert_identical(state, states[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "left in the spill dir": what the next checkpointer takes over
        assert ck.close(drain=False)["left_in_spill"] == [1, 2]

    with pytest.warns(RuntimeWarning, match=r"discarded version 2 in the spill dir .*fails its own checksum"):
        fresh = checkpointer(url, memory_bytes=VERSION, spill_dir=spill, spill_bytes=3 * VERSION)
    figures = fresh.stats()
    assert figures["adopted_from_spill"] == 1 and figures["spill_corrupt"] == 1
    assert not sidecar.exists() and not (spill / f"v{2:012d}.data").exists()
    assert [row["step"] for row in fresh.versions()] == [1]
    info, state = restored(fresh)
    assert info["step"] == 1 and info["skipped"] == []
    assert_identical(state, states[1])
    assert fresh.close(drain=True)["drained"]
