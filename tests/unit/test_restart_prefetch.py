"""A restart's cheap start: the params read ahead from the stopped device's own media (prefetch.py) and no recovery fsyncs after a clean close."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cossd.emulator import Device, DeviceConfig
from cossd.emulator import kinds, prefetch
from cossd.emulator.health import Health
from cossd.emulator.layout import SLOT_PREFIX, SUPERBLOCK_HEADER, Copy
from cossd.emulator.media import StateFile
from cossd.protocol.status import DeviceError
from test_powerloss import NAME, grads, load, spec

SLOT_FIELDS = ("magic", "format_version", "crc", "seq", "committed_step", "committed_copy", "flags")


def _device(path: Path, steps: int) -> Path:
    Device.format(path, capacity_bytes=1 << 30)
    with Device.open(path) as device:
        ns = device.create_namespace(spec())
        load(ns)
        for step in range(1, steps + 1):
            for name, data in grads(step, False).items():
                ns.write_grad(name, 0, data)
    return path


def test_the_slot_prefix_read_without_numpy_is_the_superblock_records_first_fields() -> None:
    offset = 0
    for name, (code, size) in zip(SLOT_FIELDS, [(c, np.dtype(c).itemsize) for c in
                                               ("S8", "<u4", "<u4", "<u8", "<u8", "u1", "u1")]):
        assert SUPERBLOCK_HEADER.fields[name][1] == offset, name
        assert SUPERBLOCK_HEADER.fields[name][0] == np.dtype(code), name
        offset += size
    assert SLOT_PREFIX.size == offset


@pytest.mark.parametrize("steps", [1, 2])  # the committed copy is B after one step, A after two
def test_the_ranges_read_ahead_are_the_committed_params_of_every_tensor(tmp_path: Path, steps: int) -> None:
    path = _device(tmp_path / "dev", steps)
    ranges = prefetch.namespace_params(path / "ns" / NAME)
    with Device.open(path) as device:
        ns = device.namespace(NAME)
        committed = ns._sb.committed_copy
        assert committed == (Copy.B if steps % 2 else Copy.A)
        assert [r.path.name for r in ranges] == [f"state.{committed.name}"] * len(ns.layouts)
        for piece, tensor in zip(ranges, ns.layouts):
            with open(piece.path, "rb") as stream:
                stream.seek(piece.offset)
                on_media = stream.read(piece.length)
            assert on_media == ns.read(tensor.name, "param", 0, 2 * tensor.numel)
    assert prefetch.prefetch_params(path) == sum(r.length for r in ranges)


def test_the_read_ahead_stops_at_its_budget(tmp_path: Path) -> None:
    path = _device(tmp_path / "dev", 1)
    assert prefetch.prefetch_params(path, budget=4096) == 4096
    assert prefetch.prefetch_params(path, budget=0) == 0


def test_what_cannot_be_read_ahead_is_passed_over_quietly(tmp_path: Path) -> None:
    path = _device(tmp_path / "dev", 1)
    directory = path / "ns" / NAME
    # No slot that starts as one of this format should: nothing to read ahead.
    for index in (0, 1):
        (directory / f"sb.{index}").write_bytes(b"\0" * 64)
    assert prefetch.namespace_params(directory) == []
    (directory / "meta.json").write_text("{not json")
    assert prefetch.namespace_params(directory) == []
    assert prefetch.prefetch_params(tmp_path / "no-such-device") == 0


def test_the_read_ahead_process_leaves_the_daemon_no_child_to_reap(tmp_path: Path) -> None:
    """start() forks twice and waits for the first: the worker belongs to init."""
    path = _device(tmp_path / "dev", 1)
    script = ("import os, sys; from pathlib import Path; from cossd.emulator import prefetch\n"
              "started = prefetch.start(Path(sys.argv[1]))\n"
              "try:\n    os.wait(); left = True\nexcept ChildProcessError:\n    left = False\n"
              "print(started, left)")
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


def _syncs_at_open(path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    synced: list[Path] = []
    original = StateFile.sync

    def counting(self: StateFile) -> None:
        synced.append(self.path)
        original(self)

    with monkeypatch.context() as patched:
        patched.setattr(StateFile, "sync", counting)
        Device.open(path, DeviceConfig(verify="background")).close()
    return len(synced)


def test_recovery_fsyncs_the_state_copies_only_after_a_close_that_was_not_clean(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _device(tmp_path / "dev", 2)
    # After a clean close nothing of the device's can sit in the page cache only: the opens
    # (and the close, with nothing stepped) sync no state copy.
    assert _syncs_at_open(path, monkeypatch) == 0
    # A daemon that died in use leaves the mark set: what it wrote may be in the page cache
    # only, and recovery makes both copies durable before anything can overwrite them.
    superblock = json.loads((path / "superblock.json").read_text())
    superblock["health"]["clean"] = False
    (path / "superblock.json").write_text(json.dumps(superblock))
    assert _syncs_at_open(path, monkeypatch) == 2
    # A device formatted before the mark existed has none: not taken for a clean close.
    superblock["health"].pop("clean")
    (path / "superblock.json").write_text(json.dumps(superblock))
    assert _syncs_at_open(path, monkeypatch) == 2


def test_an_open_told_not_to_mark_the_device_in_use_leaves_it_to_mark_in_use(tmp_path: Path) -> None:
    """The mount daemon opens the device while the params are read ahead and makes the in-use
    mark (an fsync) just before it mounts: until then superblock.json keeps the last close's
    mark; after it, a crash is counted as an unsafe shutdown as before."""
    path = _device(tmp_path / "dev", 1)

    def clean() -> bool:
        return json.loads((path / "superblock.json").read_text())["health"]["clean"]

    device = Device.open(path, mark_in_use=False)
    try:
        assert clean() is True
        device.mark_in_use()
        assert clean() is False
        device.mark_in_use()  # once is enough
        assert clean() is False
    finally:
        device.close()
    assert clean() is True
    with Device.open(path) as device:  # the default marks it at open
        assert clean() is False


def test_a_mark_left_to_its_thread_is_an_in_use_file_at_once_removed_by_a_clean_close(tmp_path: Path) -> None:
    """The mount daemon marks the device in use without waiting for the mark's fsyncs: an
    empty in-use file, visible to the next open at once; superblock.json records the mark
    durably behind it; a clean close records itself, then removes the file."""
    path = _device(tmp_path / "dev", 1)
    in_use = path / "in-use"

    def health() -> dict:
        return json.loads((path / "superblock.json").read_text())["health"]

    device = Device.open(path, mark_in_use=False)
    try:
        assert not in_use.exists()
        device.mark_in_use(durable_now=False)
        assert in_use.is_file() and in_use.stat().st_size == 0
        assert device._marking is not None
        device._marking.join()
        assert health()["clean"] is False
    finally:
        device.close()
    assert not in_use.exists() and health()["clean"] is True
    cycles, unsafe = health()["power_cycles"], health()["unsafe_shutdowns"]
    with Device.open(path):
        pass
    assert (health()["power_cycles"], health()["unsafe_shutdowns"]) == (cycles + 1, unsafe)


def test_an_in_use_file_left_behind_is_an_unclean_close_whatever_superblock_json_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon killed after it created the in-use file and before its thread recorded the
    mark leaves superblock.json saying clean: the file alone makes the next open count an
    unsafe shutdown and fsync both copies (what the daemon wrote may be in the page cache
    only). That open's clean close removes the file; a format removes one too."""
    path = _device(tmp_path / "dev", 2)
    in_use = path / "in-use"
    in_use.touch()
    before = json.loads((path / "superblock.json").read_text())["health"]
    assert before["clean"] is True
    assert _syncs_at_open(path, monkeypatch) == 2
    after = json.loads((path / "superblock.json").read_text())["health"]
    assert after["unsafe_shutdowns"] == before["unsafe_shutdowns"] + 1 and after["clean"] is True
    assert not in_use.exists()
    assert _syncs_at_open(path, monkeypatch) == 0  # clean again
    # A directory that held a device's leftovers but no superblock is formatted afresh.
    other = tmp_path / "other"
    other.mkdir()
    (other / "in-use").touch()
    Device.format(other, capacity_bytes=1 << 30)
    assert not (other / "in-use").exists()


def test_an_in_use_link_is_refused_and_never_followed(tmp_path: Path) -> None:
    path = _device(tmp_path / "dev", 1)
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (path / "in-use").symlink_to(target)
    with pytest.raises(DeviceError, match="in-use is a symbolic link"):
        Device.open(path)
    assert target.read_text() == "keep"


def test_a_close_waits_for_the_marks_thread_before_it_folds_the_counters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mark's thread adds the open namespaces' counters to the device's base as it records
    clean: false; a close that started meanwhile (a mount that failed at once, an immediate
    umount) waits for it before it folds those counters into the base and clears them, so
    the thread's record counts nothing twice, and the clean record lands last."""
    path = _device(tmp_path / "dev", 1)
    release, in_thread = threading.Event(), threading.Event()
    recorded: list[dict] = []
    original = Health.totals

    def held(self: Health, live: object) -> object:
        if threading.current_thread().name == "cossd-in-use-mark":
            live = list(live)  # type: ignore[call-overload]  # the namespaces as the thread saw them
            in_thread.set()
            assert release.wait(30)
            totals = original(self, live)
            recorded.append(dataclasses.asdict(totals))
            return totals
        return original(self, live)

    def health() -> dict:
        return json.loads((path / "superblock.json").read_text())["health"]

    monkeypatch.setattr(Health, "totals", held)
    device = Device.open(path, mark_in_use=False)
    for name, data in grads(2, False).items():  # counted by the live namespace, not yet the base
        device.namespaces[NAME].write_grad(name, 0, data)
    expected = device.health.totals([ns.counters for ns in device.namespaces.values()]).host_write_commands
    device.mark_in_use(durable_now=False)
    assert in_thread.wait(30)
    closing = threading.Thread(target=device.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # waiting for the mark: nothing closed, folded or recorded yet
    assert device.namespaces and health()["clean"] is True and (path / "in-use").exists()
    release.set()
    closing.join(30)
    assert not closing.is_alive()
    assert [entry["host_write_commands"] for entry in recorded] == [expected]
    after = health()
    assert after["clean"] is True and after["host_write_commands"] == expected
    assert not (path / "in-use").exists()


def test_a_clean_close_names_the_namespaces_it_could_not_open_and_their_recovery_fsyncs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a crash, an open that could not open a namespace (a transient error) never
    recovered or flushed it: its clean close says so, and the next open recovers that
    namespace as after a crash, fsyncing what it keeps."""
    path = _device(tmp_path / "dev", 2)
    (path / "in-use").touch()  # the crashed daemon's
    original = kinds.open_namespace

    def failing(*args: object, **kwargs: object) -> object:
        raise OSError(24, "Too many open files")

    with monkeypatch.context() as patched:
        patched.setattr(kinds, "open_namespace", failing)
        with Device.open(path, DeviceConfig(verify="background")) as device:
            assert NAME in device.failed_namespaces
    superblock = json.loads((path / "superblock.json").read_text())
    assert superblock["health"]["clean"] is True and superblock["unflushed_namespaces"] == [NAME]
    assert kinds.open_namespace is original
    assert _syncs_at_open(path, monkeypatch) == 2  # both copies, as after the crash
    assert json.loads((path / "superblock.json").read_text())["unflushed_namespaces"] == []
    assert _syncs_at_open(path, monkeypatch) == 0


def test_an_open_that_fails_part_way_leaves_the_mark_as_it_found_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An open interrupted before recovery went over every namespace recorded nothing clean:
    the crashed daemon's in-use file stays, and the next open still recovers as after a crash."""
    path = _device(tmp_path / "dev", 2)
    (path / "in-use").touch()

    def interrupted(self: Device, *args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(Device, "_open_namespaces", interrupted)
        with pytest.raises(KeyboardInterrupt):
            Device.open(path, mark_in_use=False)
    assert (path / "in-use").exists()
    assert _syncs_at_open(path, monkeypatch) == 2
    assert not (path / "in-use").exists()


def test_format_refuses_an_in_use_that_is_not_a_file_and_writes_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "fresh"
    (directory / "in-use").mkdir(parents=True)
    with pytest.raises(DeviceError, match="in-use: it is not a regular file"):
        Device.format(directory, capacity_bytes=1 << 30)
    assert sorted(child.name for child in directory.iterdir()) == ["in-use"]


def test_a_fifo_in_place_of_the_in_use_file_never_hangs_the_mark(tmp_path: Path) -> None:
    """A fifo put there after the open's check: creating the file would block forever for a
    reader; the mark is made durably instead, and says why in the log."""
    path = _device(tmp_path / "dev", 1)
    device = Device.open(path, mark_in_use=False)
    try:
        os.mkfifo(path / "in-use")
        device.mark_in_use(durable_now=False)
        assert device._marking is None
        assert json.loads((path / "superblock.json").read_text())["health"]["clean"] is False
    finally:
        (path / "in-use").unlink()
        device.close()
