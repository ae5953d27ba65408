"""C3 injected fsync/write failures and a full disk; I1 corruption of the backing files is always caught."""
from __future__ import annotations

import dataclasses
import errno
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from cossd.emulator import Device, DeviceConfig, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.emulator import media
from cossd.emulator.layout import BLOCK_ELEMS
from test_powerloss import NAME, ROLES, grads, load, reference, spec, state_of


class FailNth(media.MediaHooks):
    """Raise OSError(code) at the `nth` matching sync (or write) of a file named like `match`."""

    def __init__(self, kind: str, match: str, nth: int, code: int) -> None:
        self.kind, self.match, self.nth, self.code = kind, match, nth, code
        self.seen = 0
        self.fired = False

    def _maybe_fail(self, kind: str, path: Path) -> None:
        if kind == self.kind and self.match in path.name and not self.fired:
            self.seen += 1
            if self.seen == self.nth:
                self.fired = True
                raise OSError(self.code, os.strerror(self.code))

    def before_sync(self, path: Path) -> None:
        self._maybe_fail("sync", path)

    def before_write(self, path: Path) -> None:
        self._maybe_fail("write", path)


def run_steps(ns, first: int, last: int, total: int) -> None:
    for step in range(first, last + 1):
        for name, data in grads(step, step % 7 == 3).items():
            ns.write_grad(name, 0, data)


STEPS = 8
CASES = [
    # (what fails, which file, at which occurrence, errno)
    ("sync", "state.", 3, errno.EIO),
    ("sync", "state.", 4, errno.ENOSPC),
    ("sync", "sb.", 4, errno.EIO),
    ("write", "state.", 5, errno.EIO),
    ("write", "state.", 9, errno.ENOSPC),
    ("write", "sb.", 4, errno.EIO),
]


@pytest.mark.parametrize(("sync", "case"), [(s, c) for s in (False, True) for c in CASES],
                         ids=[f"{'sync' if s else 'plp'}-{c[0]}-{c[1]}{c[2]}-{errno.errorcode[c[3]]}"
                              for s in (False, True) for c in CASES])
@pytest.mark.torture
def test_injected_media_failure_fails_loudly_and_keeps_the_committed_step(
        tmp_path: Path, sync: bool, case: tuple[str, str, int, int], figures: list[str]) -> None:
    kind, match, nth, code = case
    expected = reference(STEPS)
    backing = tmp_path / "dev"
    Device.format(backing, capacity_bytes=1 << 30)
    hooks = FailNth(kind, match, nth, code)
    failed_at = None
    with Device.open(backing, DeviceConfig(sync=sync)) as device:
        ns = device.create_namespace(spec())
        load(ns)
        previous = media.install_hooks(hooks)
        try:
            for step in range(1, STEPS + 1):
                before = ns.committed_step
                try:
                    run_steps(ns, step, step, STEPS)
                except DeviceError as exc:
                    failed_at = step
                    assert exc.status in (Status.WRITE_FAULT, Status.CAPACITY_EXCEEDED, Status.INTERNAL_ERROR)
                    # Loud, and the committed step did not move or change.
                    assert ns.committed_step == before
                    assert state_of(ns) == expected[before]
                    break
        finally:
            media.install_hooks(previous)
        assert hooks.fired and failed_at is not None
        if kind == "sync":
            # fsync errors cannot be retried on Linux: the namespace stops until reopened.
            assert ns.media_failure is not None
            with pytest.raises(DeviceError) as info:
                run_steps(ns, failed_at, failed_at, STEPS)
            assert info.value.status == Status.WRITE_FAULT and "remount" in info.value.message
        else:
            # A failed write only aborts its step; the next attempt goes through.
            ns.abort_step() if ns.step_open is not None else None
            run_steps(ns, ns.committed_step + 1, ns.committed_step + 1, STEPS)
            assert state_of(ns) == expected[ns.committed_step]
    # After a restart the device serves a committed step, bit for bit.
    with Device.open(backing) as device:
        ns = device.namespace(NAME)
        assert state_of(ns) == expected[ns.committed_step]
        assert ns.committed_step >= failed_at - 2
    figures.append(f"C3 {errno.errorcode[code]} on {kind} #{nth} of {match}* ({'sync' if sync else 'plp'}): "
                   f"1 trial, 0 failures (step {failed_at} failed loudly; step "
                   f"{ns.committed_step} served after restart)")


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """A 24 MiB tmpfs: a real full disk."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(where)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.torture
def test_full_disk_fails_at_create_and_steps_keep_running(small_tmpfs: Path, figures: list[str]) -> None:
    backing = small_tmpfs / "dev"
    # The device is told it has more room than the disk: the disk itself runs out.
    Device.format(backing, capacity_bytes=1 << 30)
    expected = reference(4)
    with Device.open(backing) as device:
        ns = device.create_namespace(spec())  # 2 x 3.7 MB
        load(ns)
        with pytest.raises(DeviceError) as info:
            device.create_namespace(NamespaceSpec("huge", (TensorSpec("w", 2 * BLOCK_ELEMS * 8),)))
        assert info.value.status == Status.CAPACITY_EXCEEDED
        assert "huge" not in device.namespaces and not (backing / "ns" / "huge").exists()
        # Fill what is left of the disk: preallocated state means steps still need no block.
        with open(small_tmpfs / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(b"\0" * (1 << 20))
                    filler.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        run_steps(ns, 1, 4, 4)
        assert ns.committed_step == 4 - 1  # step 3 is poisoned (skipped)
        assert state_of(ns) == expected[ns.committed_step]
    with Device.open(backing) as device:
        assert state_of(device.namespace(NAME)) == expected[3]
    figures.append("C3 full disk (24 MiB tmpfs): 1 trial, 0 failures (create refused with "
                   "CAPACITY_EXCEEDED, 4 steps on a full disk, no SIGBUS)")


# ---------------------------------------------------------------------- I1 corruption

@dataclasses.dataclass
class Tally:
    trials: int = 0
    detected: int = 0
    silent: int = 0
    kinds: dict[str, int] = dataclasses.field(default_factory=dict)


def _data_ranges(ns) -> list[tuple[int, int]]:
    """Byte ranges of a copy that hold state (what the block checksums cover)."""
    ranges = []
    for tensor in ns.layouts:
        for role in ROLES:
            offset = ns._region_offset(tensor, role)
            ranges.append((offset, offset + tensor.numel * ns._role_dtype(role).itemsize))
    return ranges


def corrupt(path: Path, kind: str, ranges: list[tuple[int, int]], stale: bytes, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    start, end = rng.choice([r for r in ranges if r[1] - r[0] >= 4096] if kind != "bitflip" else ranges)
    if kind == "bitflip":
        at = rng.randrange(start, end)
        data[at] ^= 1 << rng.randrange(8)
    else:
        sector = rng.randrange(start // 4096, end // 4096) * 4096
        sector = max(sector, start)
        length = min(4096, end - sector)
        if kind == "zero-sector":
            data[sector:sector + length] = bytes(length)
        elif kind == "misplaced-chunk":
            other_start, other_end = rng.choice([r for r in ranges if r[1] - r[0] >= 4096])
            source = rng.randrange(other_start, other_end - length + 1)
            data[sector:sector + length] = data[source:source + length]
        elif kind == "stale-chunk":
            data[sector:sector + length] = stale[sector:sector + length]
    path.write_bytes(bytes(data))


def judge_background_open(target: Path, expected: dict[int, dict[str, bytes]], remounts: int = 2) -> str:
    """Open `target` as `cossd mount` does (verify="background"): read the params first, as a
    restart does, then let the background verification end. "detected" where the corruption
    was caught (the read or the background pass stopped the namespace, and a remount then
    serves an older step that is exactly right), "silent" where a wrong byte was served,
    "clean" where everything served was right and nothing failed."""
    with Device.open(target, DeviceConfig(verify="background")) as device:
        if NAME in device.failed_namespaces:
            return "detected"
        ns = device.namespace(NAME)
        step = ns.committed_step
        try:
            params = {t.name: ns.read(t.name, "param", 0, 1 << 40) for t in ns.layouts}
        except DeviceError as exc:
            assert exc.status == Status.UNRECOVERED_READ_ERROR, exc
            params = None
        assert ns.wait_verified(timeout=60)
        if params is not None and any(params[name] != expected[step][f"{name}/param"] for name in params):
            return "silent"
        if ns.media_failure is not None:
            with pytest.raises(DeviceError) as refused:  # nothing is served any more
                ns.read(ns.layouts[0].name, "param", 0, 2)
            assert refused.value.status == Status.UNRECOVERED_READ_ERROR
            failed = True
        else:
            if state_of(ns) != expected[ns.committed_step]:
                return "silent"
            failed = bool(ns.counters.checksum_failures or ns.scrub())
            if not failed:
                bad = ns._verify_copy(dataclasses.replace(ns._sb, committed_copy=ns._sb.committed_copy.other))
                return "detected" if bad else "silent"
    if not failed:
        return "detected"
    # Stopped after it opened: the remount recovers the newest older step that passes.
    if remounts == 0:
        return "detected"
    again = judge_background_open(target, expected, remounts - 1)
    return "silent" if again == "silent" else "detected"


def corruption_trials(tmp_path: Path, trials: int, seed: int, verify: str = "open") -> Tally:
    expected = reference(6)
    pristine = tmp_path / "pristine"
    Device.format(pristine, capacity_bytes=1 << 30)
    with Device.open(pristine) as device:
        ns = device.create_namespace(spec())
        load(ns)
        run_steps(ns, 1, 4, 6)
        older = {copy: (pristine / "ns" / NAME / f"state.{copy}").read_bytes() for copy in "AB"}
        run_steps(ns, 5, 6, 6)
        ranges = _data_ranges(ns)
    rng = random.Random(seed)
    tally = Tally()
    kinds = ("bitflip", "zero-sector", "misplaced-chunk", "stale-chunk")
    for trial in range(trials):
        kind = kinds[trial % len(kinds)]
        target = tmp_path / f"t{trial}"
        shutil.copytree(pristine, target)
        copy = rng.choice("AB")
        path = target / "ns" / NAME / f"state.{copy}"
        before = path.read_bytes()
        corrupt(path, kind, ranges, older[copy], rng)
        if path.read_bytes() == before:
            shutil.rmtree(target)
            continue  # e.g. a stale chunk that had not changed since: nothing to detect
        tally.trials += 1
        tally.kinds[kind] = tally.kinds.get(kind, 0) + 1
        if verify == "background":
            verdict = judge_background_open(target, expected)
            tally.detected += verdict == "detected"
            tally.silent += verdict != "detected"
            shutil.rmtree(target)
            continue
        with Device.open(target) as device:
            if NAME in device.failed_namespaces:
                tally.detected += 1  # refused loudly
            else:
                ns = device.namespace(NAME)
                served = state_of(ns)
                if served != expected[ns.committed_step]:
                    tally.silent += 1
                elif ns.counters.checksum_failures or ns.scrub():
                    tally.detected += 1  # caught at restore or by scrub; a verified step served
                else:
                    # The corrupted copy was not the one served, and it fails scrub later:
                    # check the damaged copy itself, as a scrub of it would.
                    bad = ns._verify_copy(dataclasses.replace(ns._sb, committed_copy=ns._sb.committed_copy.other))
                    tally.detected += 1 if bad else 0
                    tally.silent += 0 if bad else 1
        shutil.rmtree(target)
    return tally


def report_corruption(tally: Tally, figures: list[str]) -> None:
    figures.append(f"I1 corruption of backing files: {tally.trials} trials {tally.kinds}, "
                   f"{tally.trials - tally.detected} failures ({tally.detected} detected, "
                   f"{tally.silent} served silently)")


def test_corruption_is_always_detected_short(tmp_path: Path, figures: list[str]) -> None:
    tally = corruption_trials(tmp_path, trials=24, seed=3)
    report_corruption(tally, figures)
    assert tally.silent == 0 and tally.detected == tally.trials >= 20


@pytest.mark.slow
def test_corruption_torture(tmp_path: Path, figures: list[str]) -> None:
    tally = corruption_trials(tmp_path, trials=400, seed=4)
    report_corruption(tally, figures)
    assert tally.silent == 0 and tally.detected == tally.trials >= 350


def test_corruption_is_always_detected_with_background_verification(tmp_path: Path, figures: list[str]) -> None:
    """I1b: the same corruptions, opened as `cossd mount` opens (params checked as first read,
    the rest in the background): never a wrong byte served, every one caught."""
    tally = corruption_trials(tmp_path, trials=24, seed=5, verify="background")
    figures.append(f"I1b (background verification): {tally.trials} trials {tally.kinds}, "
                   f"{tally.silent} served silently or missed")
    assert tally.silent == 0 and tally.detected == tally.trials >= 20


@pytest.mark.slow
def test_corruption_torture_with_background_verification(tmp_path: Path, figures: list[str]) -> None:
    tally = corruption_trials(tmp_path, trials=400, seed=6, verify="background")
    figures.append(f"I1b torture (background verification): {tally.trials} trials {tally.kinds}, "
                   f"{tally.silent} served silently or missed")
    assert tally.silent == 0 and tally.detected == tally.trials >= 350


def test_scrub_of_a_live_device_reports_a_flipped_bit(tmp_path: Path) -> None:
    Device.format(tmp_path / "dev", capacity_bytes=1 << 30)
    with Device.open(tmp_path / "dev") as device:
        ns = device.create_namespace(spec())
        load(ns)
        run_steps(ns, 1, 2, 2)
        ns.flush()
        assert ns.scrub() == []
        copy = ns._sb.committed_copy
        path = tmp_path / "dev" / "ns" / NAME / f"state.{copy.name}"
        with open(path, "r+b") as stream:
            stream.seek(ns.tensors["w"].exp_avg_offset + 4 * 1000)
            byte = stream.read(1)
            stream.seek(-1, os.SEEK_CUR)
            stream.write(bytes([byte[0] ^ 0x10]))
        assert ns.scrub() == [("w", 0)]
        assert ns.counters.checksum_failures == 1
