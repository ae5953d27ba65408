"""A step is checked on the very gradient values it uses, and a skipped step keeps the fallback copy."""
from __future__ import annotations

import errno
import random
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.emulator import Device, DeviceConfig, NamespaceSpec, TensorSpec, media
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.emulator.namespace import Namespace
from cossd.emulator.superblock import Superblock
from cossd.fs import daemon
from cossd.client import AdminClient
from helpers import create_namespace, pread_all, pwrite_all, tensor_dir
from powerloss import PowerLossRecorder

# ---------------------------------------------------------------------- gradients changing in the CMB

# Two whole blocks and a tail that is not a multiple of 16 elements (the kernel's masked tail).
NUMEL = 2 * BLOCK_ELEMS + 4099
GRAD_AT = 4096  # where the gradient lies in the CMB
# Split transfers cut at element boundaries inside blocks, so every block is staged in pieces.
SPLIT_AT = [0, 100_001, BLOCK_ELEMS + 77_777, 2 * BLOCK_ELEMS + 1001, NUMEL]
# The elements the racing client flips between finite and NaN/inf: some in every block (and
# next to each split), the last ones in the tail.
FLIPPED = np.unique(np.concatenate([
    np.arange(0, NUMEL, 3001), np.array(SPLIT_AT[1:-1]) - 1, np.array(SPLIT_AT[1:-1]),
    np.arange(NUMEL - 15, NUMEL)]))
FLIP_RUN, FINITE_SPINS = 8, 20
NONFINITE = (np.uint16(0x7E00), np.uint16(0x7C00), np.uint16(0xFC00))  # NaN, +inf, -inf (FP16)


def _tmpfs_dir() -> Path:
    with open("/proc/mounts") as mounts:
        kinds = {line.split()[1]: line.split()[2] for line in mounts}
    if kinds.get("/dev/shm") != "tmpfs":
        raise RuntimeError("/dev/shm is not tmpfs here: no backing for mapped state writes")
    return Path(tempfile.mkdtemp(prefix="cossd-t20-", dir="/dev/shm"))


@pytest.fixture(params=["mapped", "pwrite"])
def racing_mount(request: pytest.FixtureRequest, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Mount, str]]:
    """A mount whose state copies are written as `param` says: on tmpfs the kernel stores into
    the mapping ("mapped"), on the test's disk-backed directory it writes buffers ("pwrite")."""
    mode = request.param
    root = _tmpfs_dir() if mode == "mapped" else tmp_path
    backing, mountpoint = root / "backing", tmp_path / "mnt"
    try:
        Device.format(backing)
        mountpoint.mkdir()
        monkeypatch.delenv("COSSD_STATE_WRITES", raising=False)  # the backing decides
        pid = daemon.start_background(backing, mountpoint)
        mount = Mount(backing, mountpoint, pid)
        try:
            yield mount, mode
        finally:
            if is_mounted(mountpoint):
                subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
                try:
                    wait_for_exit(pid, 30)
                except TimeoutError:
                    force_unmount(mountpoint)
    finally:
        if mode == "mapped":
            shutil.rmtree(root, ignore_errors=True)


def _fresh_namespace(mp: Path, client: AdminClient, name: str, seed: int) -> int:
    create_namespace(mp, name, [("w", NUMEL)])
    rng = np.random.default_rng(seed)
    pwrite_all(tensor_dir(mp, name, "w") / "master", rng.standard_normal(NUMEL, dtype=np.float32).tobytes())
    return client.nsid(name)


class _Flipper:
    """A client thread that keeps changing gradient bytes in the CMB, finite <-> NaN/inf,
    while the device reads them."""

    def __init__(self, grads: np.ndarray, finite: np.ndarray, seed: int) -> None:
        self._grads, self._finite, self._rng = grads, finite, random.Random(seed)
        self._stop = threading.Event()
        self.flips = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            # A few of the flipped elements turn non-finite, then back: often enough to race
            # the device's reads, briefly enough that most steps still find them finite.
            chosen = FLIPPED[self._rng.randrange(len(FLIPPED) - FLIP_RUN):][:FLIP_RUN]
            self._grads[chosen] = NONFINITE[self.flips % len(NONFINITE)]
            self._grads[chosen] = self._finite[chosen]
            self.flips += 1
            for _ in range(FINITE_SPINS):  # finite for a while
                pass

    def __enter__(self) -> "_Flipper":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def race_trials(mount: Mount, mode: str, split: bool, trials: int, figures: list[str]) -> None:
    """`trials` CMB_WRITE steps, each while a client thread flips gradient bytes; every commit
    must leave an all-finite master (or the step must have been skipped)."""
    mp = mount.mountpoint
    rng = np.random.default_rng(20)
    outcomes = {"committed": 0, "skipped": 0, "nonfinite_commits": 0}
    with AdminClient(mp) as client:
        namespaces = 0
        nsid = _fresh_namespace(mp, client, f"race{namespaces}", seed=namespaces)
        stats_mode = client.statistics(nsid)["state_writes"]
        assert stats_mode == mode, f"the backing gave {stats_mode} state writes, not {mode}"
        cmb = client.cmb()
        assert cmb is not None
        try:
            region = cmb.array[GRAD_AT : GRAD_AT + 2 * NUMEL].view(np.uint16)
            cuts = SPLIT_AT if split else [0, NUMEL]
            transfers = [{"tensor": "w", "offset": 2 * lo, "length": 2 * (hi - lo), "cmb_offset": GRAD_AT + 2 * lo}
                         for lo, hi in zip(cuts, cuts[1:])]
            for trial in range(trials):
                finite = (rng.standard_normal(NUMEL) * 0.01).astype(np.float16).view(np.uint16)
                region[:] = finite
                with _Flipper(region, finite, seed=trial):
                    report = client.cmb_write(nsid, transfers)
                if report["commit"]["skipped"]:
                    outcomes["skipped"] += 1
                    continue
                outcomes["committed"] += 1
                master = np.frombuffer(pread_all(tensor_dir(mp, f"race{namespaces}", "w") / "master"),
                                       dtype=np.float32)
                if not np.isfinite(master).all():
                    outcomes["nonfinite_commits"] += 1
                    # Its master is lost to the NaN: go on with a fresh namespace.
                    client.delete_namespace(nsid)
                    namespaces += 1
                    nsid = _fresh_namespace(mp, client, f"race{namespaces}", seed=namespaces)
        finally:
            cmb.close()
    what = f"{mode} state writes, {'split' if split else 'whole'} transfers"
    figures.append(f"T20 gradients changing in the CMB during CMB_WRITE ({what}): {trials} trials, "
                   f"{outcomes['nonfinite_commits']} failures (committed {outcomes['committed']}, "
                   f"skipped {outcomes['skipped']}, non-finite commits {outcomes['nonfinite_commits']})")
    assert outcomes["nonfinite_commits"] == 0, outcomes
    assert outcomes["committed"], "no step committed: the race never tested a commit"


@pytest.mark.mount
@pytest.mark.torture
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_gradients_changing_in_the_cmb_never_commit_a_nan(
        racing_mount: tuple[Mount, str], split: bool, figures: list[str]) -> None:
    race_trials(*racing_mount, split=split, trials=20, figures=figures)


@pytest.mark.mount
@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_gradients_changing_in_the_cmb_never_commit_a_nan_many(
        racing_mount: tuple[Mount, str], split: bool, figures: list[str]) -> None:
    race_trials(*racing_mount, split=split, trials=250, figures=figures)


# ---------------------------------------------------------------------- a skip keeps the fallback

TENSORS = (TensorSpec("w", 2 * BLOCK_ELEMS + 5), TensorSpec("b", 7))
SMALL = (TensorSpec("w", 1000), TensorSpec("b", 7))


def _load(ns: Namespace) -> None:
    rng = np.random.default_rng(0)
    for tensor in ns.layouts:
        ns.write_state(tensor.name, "master", 0, rng.standard_normal(tensor.numel, dtype=np.float32).tobytes())


def _step(ns: Namespace, seed: int, poisoned: tuple[str, ...] = ()) -> bool:
    """One implicit step; every block of the tensors in `poisoned` holds an inf or a NaN.
    Returns whether it was skipped."""
    rng = np.random.default_rng(seed)
    before = ns.counters.steps_skipped
    for tensor in ns.layouts:
        values = (rng.standard_normal(tensor.numel) * 0.01).astype(np.float16)
        if tensor.name in poisoned:
            values[::BLOCK_ELEMS] = np.inf
            values[-1] = np.nan
        ns.write_grad(tensor.name, 0, values.tobytes())
    return ns.counters.steps_skipped > before


def _state(ns: Namespace) -> dict[str, bytes]:
    return {f"{t.name}/{r}": ns.read(t.name, r, 0, 1 << 40)
            for t in ns.layouts for r in ("master", "exp_avg", "exp_avg_sq", "param")}


def _slots(ns: Namespace) -> list[tuple[int, int, int]]:
    """(seq, committed step, copy) of each valid superblock slot on the media, newest first."""
    decoded = [Superblock.decode((ns.directory / f"sb.{slot}").read_bytes(), ns.total_blocks)
               for slot in (0, 1)]
    return sorted(((sb.seq, sb.committed_step, int(sb.committed_copy)) for sb in decoded if sb is not None),
                  reverse=True)


@pytest.mark.parametrize("writes", ["mapped", "pwrite"])
@pytest.mark.parametrize("skip", [False, True], ids=["no skip", "skip"])
def test_a_corrupted_committed_copy_falls_back_to_the_step_before_even_after_a_skip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes: str, skip: bool) -> None:
    """Commit 1 and 2, skip 3 (every block non-finite), corrupt one block of step 2's copy:
    the remount serves step 1, bit for bit, as it does without the skip; the skip's counters
    survive the remount."""
    monkeypatch.setenv("COSSD_STATE_WRITES", writes)
    backing = tmp_path / "backing"
    Device.format(backing)
    with Device.open(backing) as device:
        ns = device.create_namespace(NamespaceSpec(name="opt", tensors=TENSORS))
        _load(ns)
        assert not _step(ns, 1)
        step_1 = _state(ns)
        assert not _step(ns, 2)
        if skip:
            assert _step(ns, 3, poisoned=("w", "b"))
            assert ns.committed_step == 2 and ns.statistics()["last_skipped_step"] == 3
        assert [step for _, step, _ in _slots(ns)] == [2, 1]
        ns.corrupt_block("w", 1)
    with Device.open(backing) as device:
        assert "opt" not in device.failed_namespaces
        ns = device.namespace("opt")
        assert ns.committed_step == 1 and _state(ns) == step_1
        assert ns.recovery_errors == [("w", 1, 1)]
        stats = ns.statistics()
        assert (stats["steps_skipped"], stats["last_skipped_step"]) == ((1, 3) if skip else (0, 0))
        assert _step(ns, 2) is False and ns.committed_step == 2


def test_a_skip_that_stepped_blocks_before_its_nonfinite_one_leaves_no_false_fallback(tmp_path: Path) -> None:
    """A skipped step whose first blocks were finite has stepped them into the fallback copy
    before it found the non-finite one: that copy no longer holds step 1, and recovery, which
    checks every block, refuses it rather than serve a mix (loud, never wrong)."""
    backing = tmp_path / "backing"
    Device.format(backing)
    with Device.open(backing) as device:
        ns = device.create_namespace(NamespaceSpec(name="opt", tensors=TENSORS))
        _load(ns)
        _step(ns, 1)
        step_1 = _state(ns)
        _step(ns, 2)
        written = ns.counters.media_bytes_written
        assert _step(ns, 3, poisoned=("b",))  # w's three blocks are finite: they ran, as a rule
        # More than the skip record's few bytes: blocks of state went into the fallback copy.
        stepped = ns.counters.media_bytes_written - written > 4096
        ns.corrupt_block("w", 0)
    with Device.open(backing) as device:
        if stepped:
            assert "no committed step passes its checksums" in str(device.failed_namespaces["opt"])
        else:  # b's block was found non-finite before any of w's ran: the fallback is whole
            assert device.namespace("opt").committed_step == 1 and _state(device.namespace("opt")) == step_1


def test_a_lent_block_nonfinite_past_its_first_round_is_skipped_and_refused_as_a_fallback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lent gradient (the CMB's path, state stored into the mapping) whose only non-finite
    element lies deep in its block: the kernel steps at least the block's rounds before it
    into the fallback copy (all of it, in registers). The step is skipped, the committed state and the host's param
    copy are step 2's, the bytes written are counted, and a corrupted step-2 copy is then
    refused at the remount rather than served from a fallback that is no longer step 1."""
    monkeypatch.setenv("COSSD_STATE_WRITES", "mapped")
    root = _tmpfs_dir()
    try:
        backing = root / "backing"
        Device.format(backing)
        with Device.open(backing) as device:
            ns = device.create_namespace(NamespaceSpec(name="opt", tensors=(TensorSpec("w", BLOCK_ELEMS),)))
            _load(ns)
            assert not _step(ns, 1) and not _step(ns, 2)
            step_2 = _state(ns)
            grad = (np.random.default_rng(3).standard_normal(BLOCK_ELEMS) * 0.01).astype(np.float16)
            grad[3 * 4096 + 5] = np.nan  # in the fourth of the kernel's rounds of 4096
            params = np.full(2 * BLOCK_ELEMS, 0xAB, dtype=np.uint8)
            written = ns.counters.media_bytes_written
            result = ns.write_grads_lent([("w", 0, grad.view(np.uint8), params)])
            assert result is not None and result.skipped and result.nonfinite_elements == 1
            assert ns.committed_step == 2 and _state(ns) == step_2
            assert params.tobytes() == step_2["w/param"]
            # At least three rounds of 4096 elements, 14 bytes each (master, moments, param):
            # what the kernel stored into the fallback copy is counted.
            assert ns.counters.media_bytes_written - written >= 3 * 4096 * 14
            ns.corrupt_block("w", 0)
        with Device.open(backing) as device:
            assert "no committed step passes its checksums" in str(device.failed_namespaces["opt"])
    finally:
        shutil.rmtree(root)


@pytest.mark.parametrize("writes", ["mapped", "pwrite"])
def test_lent_gradients_at_an_odd_byte_step_as_aligned_ones(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writes: str) -> None:
    """Lent gradients whose payload starts at an odd byte, as a storage server's receive buffer
    holds them after a header: the step commits the state an aligned write commits."""
    monkeypatch.setenv("COSSD_STATE_WRITES", writes)
    root = _tmpfs_dir() if writes == "mapped" else tmp_path
    try:
        states = []
        for name, shift in (("aligned", 0), ("odd", 1)):
            backing = root / name
            Device.format(backing)
            with Device.open(backing) as device:
                ns = device.create_namespace(NamespaceSpec(name="opt", tensors=TENSORS))
                _load(ns)
                for seed in (1, 2):
                    for tensor in ns.layouts:
                        values = (np.random.default_rng(seed).standard_normal(tensor.numel) * 0.01).astype(np.float16)
                        raw = bytearray(values.nbytes + shift)
                        raw[shift:] = values.tobytes()
                        ns.write_grads_lent([(tensor.name, 0, np.frombuffer(raw, np.uint8)[shift:], None)])
                assert ns.committed_step == 2
                states.append(_state(ns))
        assert states[0] == states[1]
    finally:
        if writes == "mapped":
            shutil.rmtree(root)


def commit_and_skip_sequences(tmp_path: Path, trials: int, figures: list[str]) -> None:
    """Random sequences of commits and skips: after each, the two slots name the newest two
    committed steps, in the two copies, and the skip counters match; a clean remount keeps
    them; then a corrupted committed copy falls back to the step before it, bit for bit,
    counters intact (or, where a skip since stepped blocks into that copy, is refused)."""
    fallbacks, lost = 0, 0
    for trial in range(trials):
        rng = random.Random(trial)
        backing = tmp_path / f"backing{trial}"
        Device.format(backing)
        skipped, last_skipped = 0, 0
        with Device.open(backing) as device:
            ns = device.create_namespace(NamespaceSpec(name="opt", tensors=SMALL))
            _load(ns)
            # (step, copy, state) of each committed step; the first step seals the loaded
            # state as step 0 in copy A.
            commits = [(0, 0, _state(ns))]
            fallback_whole = True  # no skip since the last commit stepped a block into the other copy
            for seed in range(rng.randrange(2, 14)):
                poisoned = rng.choice([(), (), ("w",), ("b",), ("w", "b")])
                was_skipped = _step(ns, seed, poisoned)
                assert was_skipped == bool(poisoned)
                if was_skipped:
                    skipped, last_skipped = skipped + 1, ns.committed_step + 1
                    # Finite blocks of a skipped step may have run into the fallback copy
                    # before the non-finite ones were found.
                    fallback_whole = fallback_whole and poisoned == ("w", "b")
                else:
                    commits.append((ns.committed_step, int(ns._sb.committed_copy), _state(ns)))
                    fallback_whole = True
                stats = ns.statistics()
                assert (stats["steps_skipped"], stats["last_skipped_step"]) == (skipped, last_skipped)
                named = [(step, copy) for _, step, copy in _slots(ns)]
                if len(commits) == 1:  # sealed, nothing committed since: the other slot is the load's
                    assert named[0] == (0, 0), (trial, seed)
                    continue
                newest = [(step, copy) for step, copy, _ in commits[-2:]][::-1]
                assert named == newest and newest[0][1] != newest[1][1], (trial, seed)
            final = _state(ns)
        with Device.open(backing) as device:  # a clean remount keeps everything
            ns = device.namespace("opt")
            assert _state(ns) == final
            stats = ns.statistics()
            assert (stats["steps_skipped"], stats["last_skipped_step"]) == (skipped, last_skipped)
            if len(commits) < 2:  # nothing committed after the seal: no fallback to test
                continue
            ns.corrupt_block("b", 0)
        with Device.open(backing) as device:
            if not fallback_whole and "opt" in device.failed_namespaces:
                lost += 1  # refused, loudly: never a mix of steps
                continue
            ns = device.namespace("opt")
            assert ns.committed_step == commits[-2][0] and _state(ns) == commits[-2][2], trial
            stats = ns.statistics()
            assert (stats["steps_skipped"], stats["last_skipped_step"]) == (skipped, last_skipped)
            fallbacks += 1
        shutil.rmtree(backing)
    figures.append(f"T20 random commits and skips, then the committed copy corrupted: {trials} trials, 0 failures "
                   f"(fell back bit for bit {fallbacks}; fallback overwritten by a partly finite skip, refused {lost})")


@pytest.mark.torture
def test_slots_name_the_two_newest_committed_copies_after_any_commits_and_skips(
        tmp_path: Path, figures: list[str]) -> None:
    commit_and_skip_sequences(tmp_path, trials=6, figures=figures)


@pytest.mark.slow
def test_slots_name_the_two_newest_committed_copies_after_any_commits_and_skips_many(
        tmp_path: Path, figures: list[str]) -> None:
    commit_and_skip_sequences(tmp_path, trials=200, figures=figures)


@pytest.mark.parametrize("sync", [False, True], ids=["plp", "sync"])
def test_power_loss_during_a_skip_keeps_the_committed_step_and_its_fallback(
        tmp_path: Path, sync: bool, figures: list[str]) -> None:
    """A power cut at every sync point of a skip (synced-only, torn and kept images): step 2,
    the committed one, is served bit for bit; once the skip is acknowledged its counters are
    there; and a corrupted step-2 copy still falls back to step 1."""
    backing, images = tmp_path / "backing", tmp_path / "images"
    Device.format(backing, capacity_bytes=1 << 30)
    config = DeviceConfig(sync=sync)
    rng = random.Random(7)
    checked: list[str] = []
    acknowledged = False

    def verify(label: str) -> None:
        for variant in ("drop", "tear", "keep"):
            image = images / f"{len(checked)}"
            recorder.build_image(image, variant, rng)
            with Device.open(image, config) as device:
                ns = device.namespace("opt")
                assert ns.committed_step == 2 and _state(ns) == step_2, (label, variant)
                stats = ns.statistics()
                counters = (stats["steps_skipped"], stats["last_skipped_step"])
                assert counters == (1, 3) if acknowledged else counters in ((0, 0), (1, 3)), (label, variant)
                ns.corrupt_block("w", 2)
            with Device.open(image, config) as device:
                ns = device.namespace("opt")
                assert ns.committed_step == 1 and _state(ns) == step_1, (label, variant)
            shutil.rmtree(image)
            checked.append(f"{label} [{variant}]")

    with Device.open(backing, config) as device:
        ns = device.create_namespace(NamespaceSpec(name="opt", tensors=TENSORS))
        _load(ns)
        _step(ns, 1)
        step_1 = _state(ns)
        _step(ns, 2)
        step_2 = _state(ns)
        ns.flush()
        recorder = PowerLossRecorder(backing, verify)
        previous = media.install_hooks(recorder)
        try:
            assert _step(ns, 3, poisoned=("w", "b"))
            acknowledged = True
            verify("after the skip")
        finally:
            media.install_hooks(previous)
    assert len(checked) >= 12  # the record's file and directory syncs, each before and after
    figures.append(f"T20 power loss during a skip ({'sync' if sync else 'plp'} commits): {len(checked)} crash states, "
                   "0 failures (step 2 bit for bit, acknowledged skip counters there, fallback to step 1 intact)")


class _FailSkipRecord(media.MediaHooks):
    """Fails every fsync of the skip record's temporary file with EIO."""

    def before_sync(self, path: Path) -> None:
        if path.name == ".skips.json.tmp":
            raise OSError(errno.EIO, "injected")


def test_a_skip_whose_record_cannot_be_written_is_still_a_skip(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The record holds statistics only: a skip it cannot be written for is still reported
    as a skip (with a warning), changes nothing, and the next commit's superblock carries
    the counters across a remount."""
    backing = tmp_path / "backing"
    Device.format(backing)
    with Device.open(backing) as device:
        ns = device.create_namespace(NamespaceSpec(name="opt", tensors=SMALL))
        _load(ns)
        _step(ns, 1)
        before = _state(ns)
        previous = media.install_hooks(_FailSkipRecord())
        try:
            assert _step(ns, 2, poisoned=("w",))
        finally:
            media.install_hooks(previous)
        assert "skip counters not recorded" in caplog.text
        assert not (ns.directory / "skips.json").exists() and not (ns.directory / ".skips.json.tmp").exists()
        assert _state(ns) == before and ns.committed_step == 1
        stats = ns.statistics()
        assert (stats["steps_skipped"], stats["last_skipped_step"]) == (1, 2)
        assert not _step(ns, 3)
    with Device.open(backing) as device:
        stats = device.namespace("opt").statistics()
        assert (stats["committed_step"], stats["steps_skipped"], stats["last_skipped_step"]) == (2, 1, 2)
