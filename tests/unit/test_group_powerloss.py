"""C2g: simulated power loss across 2 and 3 devices stepped as one group commit (whole tensors, or one split across two devices); recovery by common_step + revert_step lands every device on one step, bit-identical to an uninterrupted run."""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from cossd.emulator import Device, DeviceConfig, NamespaceSpec, TensorSpec
from cossd.emulator import media
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.emulator.namespace import Namespace
from cossd.protocol.group_commit import GroupDisagreementError, common_step
from powerloss import PowerLossRecorder

NAME = "opt"
ROLES = ("master", "exp_avg", "exp_avg_sq", "param")


@dataclasses.dataclass(frozen=True)
class Protocol:
    """How the trainer steps the group; the defaults are trainer/group.py's protocol."""

    flush: bool = True               # step 4: FLUSH every device before step N + 1 begins
    eager: int | None = None         # this device begins N + 1 (and writes its gradients)
                                     # before the others have committed N: the violation
    poison: bool = True              # some steps poisoned on one device (or all)
    many_tensors: bool = False       # the last device holds enough tensors for a 2-sector superblock
    split: bool = False              # one tensor split across devices 0 and 1, as the placement rule cuts it


# The split tensor: SPLIT_ELEMS elements, device 0 holding its first block, device 1 the rest
# (trainer/group.py's placement rule cuts at a block boundary), each under the tensor's name.
SPLIT_NAME, SPLIT_ELEMS = "w", BLOCK_ELEMS + 1000


def tensors_of(device: int, protocol: Protocol, count: int) -> tuple[TensorSpec, ...]:
    """Each device holds part of the model: device 0 a tensor of two kernel blocks (one
    partial), the others small ones, to keep each crash image cheap to build."""
    if protocol.split and device < 2:
        piece = BLOCK_ELEMS if device == 0 else SPLIT_ELEMS - BLOCK_ELEMS
        return (TensorSpec(SPLIT_NAME, piece), TensorSpec(f"b{device}", 7))
    if protocol.many_tensors and device == count - 1:
        # 130 one-block tensors: 128 header bytes + 4 per block checksum > one 512-byte sector.
        return tuple(TensorSpec(f"n{device}_{index}", 5 + index % 3) for index in range(130))
    if device == 0:
        return (TensorSpec("w0", BLOCK_ELEMS + 3), TensorSpec("b0", 7))
    return (TensorSpec(f"w{device}", 3000 + device), TensorSpec(f"b{device}", 7))


def spec(device: int, protocol: Protocol, count: int) -> NamespaceSpec:
    return NamespaceSpec(name=NAME, tensors=tensors_of(device, protocol, count))


def load(ns: Namespace, device: int) -> None:
    rng = np.random.default_rng(device)
    for tensor in ns.layouts:
        ns.write_state(tensor.name, "master", 0, rng.standard_normal(tensor.numel, dtype=np.float32).tobytes())


def poisoned(iteration: int, count: int, protocol: Protocol) -> set[int]:
    """The devices whose gradients of `iteration` hold an inf: mostly one device (so the
    others commit and step 5 reverts them), now and then all (every device skips)."""
    if not protocol.poison:
        return set()
    if iteration % 7 == 6:
        return set(range(count))
    if iteration % 3 == 2:
        return {(iteration // 3) % count}
    return set()


def write_grads(ns: Namespace, device: int, iteration: int, poison: bool) -> None:
    rng = np.random.default_rng(10_000 * device + iteration)
    # A split tensor's gradient is one tensor's, of which each device gets its elements.
    whole = (np.random.default_rng(iteration).standard_normal(SPLIT_ELEMS) * 0.01).astype(np.float16)
    for index, tensor in enumerate(ns.layouts):
        values = (rng.standard_normal(tensor.numel) * 0.01).astype(np.float16)
        if tensor.name == SPLIT_NAME:
            start = 0 if device == 0 else BLOCK_ELEMS
            values = whole[start : start + tensor.numel].copy()
        if poison and index == 0:
            values[tensor.numel // 2] = np.inf
        ns.write_grad(tensor.name, 0, values.tobytes())


def state_of(ns: Namespace) -> dict[str, bytes]:
    return {f"{t.name}/{r}": ns.read(t.name, r, 0, 1 << 40) for t in ns.layouts for r in ROLES}


class Bounds:
    """What the trainer has been promised so far: the step a crash may recover, low..high."""

    def __init__(self) -> None:
        self.low = 0    # the last group step flushed on every device (0: the loaded weights)
        self.high = 0   # the newest step begun anywhere


def run_group(namespaces: list[Namespace], iterations: int, protocol: Protocol, sync: bool,
              bounds: Bounds, reached: dict[int, list[dict[str, bytes]]] | None = None) -> None:
    """The trainer's protocol (see trainer/group.py) over `namespaces`, one per device.

    `reached`, when given, collects every device's state at each group step (the reference).
    """
    count = len(namespaces)
    eager_open = False  # the eager device has begun the next step already
    if reached is not None:
        reached[0] = [state_of(ns) for ns in namespaces]
    for iteration in range(1, iterations + 1):
        step = min(ns.committed_step for ns in namespaces) + 1
        bad = poisoned(iteration, count, protocol)
        bounds.high = max(bounds.high, step)
        # 1. BEGIN everywhere, 2. gradients everywhere.
        for device, ns in enumerate(namespaces):
            if not (device == protocol.eager and eager_open):
                ns.begin_step(step, 1.0)
        for device, ns in enumerate(namespaces):
            if not (device == protocol.eager and eager_open):
                write_grads(ns, device, iteration, device in bad)
        order = list(range(count))
        results: dict[int, bool] = {}
        if protocol.eager is not None:
            # The violation: the eager device commits, flushes and goes on into the next
            # step (its gradients overwrite the copy holding step - 1) while the others
            # have not committed this one yet.
            eager = protocol.eager
            order.remove(eager)
            results[eager] = not namespaces[eager].commit_step().skipped
            namespaces[eager].flush()
            eager_open = iteration < iterations
            if eager_open:
                bounds.high = step + 1
                namespaces[eager].begin_step(step + 1, 1.0)
                write_grads(namespaces[eager], eager, iteration + 1,
                            eager in poisoned(iteration + 1, count, protocol))
        # 3. COMMIT everywhere (a device with inf/NaN gradients skips).
        for device in order:
            results[device] = not namespaces[device].commit_step().skipped
        if sync and all(results.values()):
            bounds.low = step  # every commit returned durable
        # 4. FLUSH everywhere.
        if protocol.flush:
            for device in order:
                namespaces[device].flush()
        committed = [device for device, done in results.items() if done]
        if len(committed) == count:
            # The trainer now takes step `step` as the group's (data consumed, logged...);
            # without step 4 that promise is what a crash breaks.
            bounds.low = step
        elif committed:
            # 5. Some skipped: the others revert, so the whole group skips the step.
            for device in committed:
                namespaces[device].revert_step(step)
            if protocol.eager is None:
                bounds.high = step - 1  # the reverts are durable (a synced superblock)
        if reached is not None and len(committed) == count:
            reached[step] = [state_of(ns) for ns in namespaces]


@dataclasses.dataclass
class Outcome:
    states: int = 0
    by_variant: dict[str, int] = dataclasses.field(default_factory=dict)
    disagreements: int = 0   # devices > 1 step apart, or not on one step after the reverts
    unrecovered: int = 0     # recovery raised (a refused revert, a failed namespace)
    wrong: int = 0           # a step outside the promised range, or wrong bytes
    recovery_states: int = 0  # further crash states: power lost again during recovery's reverts
    failures: list[str] = dataclasses.field(default_factory=list)

    @property
    def failed(self) -> int:
        return self.disagreements + self.unrecovered + self.wrong


class Failure(Exception):
    """What is wrong with a recovered group; `kind` names the Outcome counter it adds to."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Group:
    """The `count` devices dev0.. under `root`, opened together and all closed on exit."""

    def __init__(self, root: Path, count: int, config: DeviceConfig) -> None:
        self.root, self.count, self.config = root, count, config
        self.devices: list[Device] = []

    def __enter__(self) -> list[Device]:
        try:
            for device in range(self.count):
                self.devices.append(Device.open(self.root / f"dev{device}", self.config))
        except BaseException:
            self.__exit__()
            raise
        return self.devices

    def __exit__(self, *exc_info: object) -> None:
        for dev in reversed(self.devices):
            dev.close()


class GroupPowerLossTrial:
    """Devices under one root, one recorder: a crash point at any device's sync cuts power to
    the whole group ("drop"/"tear"/"keep" for all), or to one device while the others keep
    everything (that drive alone lost power)."""

    def __init__(self, root: Path, count: int, sync: bool, iterations: int, protocol: Protocol, *,
                 group_variants: tuple[str, ...], single_variants: tuple[str, ...],
                 write_probability: float, seed: int, sample: bool = False,
                 nested: bool = False) -> None:
        self.sample, self.nested = sample, nested
        self._inner: PowerLossRecorder | None = None  # the recorder of a recovery under test
        self.count, self.sync, self.iterations, self.protocol = count, sync, iterations, protocol
        self.group_variants, self.single_variants = group_variants, single_variants
        self.rng = random.Random(seed)
        self.outcome = Outcome()
        self.bounds = Bounds()
        self.devices_root = root / "devices"
        self.images = root / "images"
        self.images.mkdir(parents=True)
        self.expected = self._reference(root / "reference")
        for device in range(count):
            path = self.devices_root / f"dev{device}"
            Device.format(path, capacity_bytes=1 << 30, serial=f"GROUPPL{count}{device:05d}")
        # Created and loaded before the recorder: the initial state counts as durable (the
        # create and load crash points are test_powerloss.py's).
        with self._opened(self.devices_root) as devices:
            for device, dev in enumerate(devices):
                load(dev.create_namespace(spec(device, protocol, count)), device)
        self.recorder = PowerLossRecorder(self.devices_root, self.crash_point,
                                          write_probability=write_probability, seed=seed)

    def _opened(self, root: Path) -> "_Group":
        return _Group(root, self.count, DeviceConfig(sync=self.sync))

    def _reference(self, root: Path) -> dict[int, list[dict[str, bytes]]]:
        """Every device's state at each group step, from the protocol run uninterrupted."""
        reached: dict[int, list[dict[str, bytes]]] = {}
        for device in range(self.count):
            Device.format(root / f"dev{device}", capacity_bytes=1 << 30)
        with self._opened(root) as devices:
            namespaces = []
            # The reference keeps to the protocol even where the trial under test breaks it.
            proper = Protocol(poison=self.protocol.poison, many_tensors=self.protocol.many_tensors,
                              split=self.protocol.split)
            for device, dev in enumerate(devices):
                ns = dev.create_namespace(spec(device, proper, self.count))
                load(ns, device)
                namespaces.append(ns)
            run_group(namespaces, self.iterations, proper, self.sync, Bounds(), reached)
        shutil.rmtree(root)
        return reached

    def run(self) -> Outcome:
        previous = media.install_hooks(self.recorder)
        try:
            with self._opened(self.devices_root) as devices:
                run_group([dev.namespace(NAME) for dev in devices], self.iterations, self.protocol,
                          self.sync, self.bounds)
            self.crash_point("after close")
        finally:
            media.install_hooks(previous)
        return self.outcome

    def crash_point(self, label: str) -> None:
        cuts: list[tuple[str, dict[str, str], str]] = [(v, {}, v) for v in self.group_variants]
        singles = [(f"dev{device} {variant}", {f"dev{device}": variant}, "keep")
                   for device in range(self.count) for variant in self.single_variants]
        if self.sample:
            # The short run: one whole-group cut and one single-device cut per crash point.
            cuts = [self.rng.choice(cuts)] if cuts else []
            singles = [self.rng.choice(singles)] if singles else []
        cuts += singles
        for name, variants, default in cuts:
            image = self.images / f"{self.outcome.states}"
            self.recorder.build_split_image(image, variants, self.rng, default=default)
            self.outcome.states += 1
            # "all drop": the whole group lost power; "drop": one drive alone did.
            kind = name.split()[-1] if variants else f"all {name}"
            self.outcome.by_variant[kind] = self.outcome.by_variant.get(kind, 0) + 1
            try:
                self.verify(image, nested=self.nested)
            except Failure as failure:
                self._fail(failure.kind, f"{label} [{name}]: {failure}")
            except Exception as exc:  # noqa: BLE001 - any escape from recovery is a failure
                self._fail("unrecovered", f"{label} [{name}]: {type(exc).__name__}: {exc}")
            shutil.rmtree(image)

    def _fail(self, kind: str, message: str) -> None:
        setattr(self.outcome, kind, getattr(self.outcome, kind) + 1)
        self.outcome.failures.append(message)

    def verify(self, image: Path, nested: bool = False, expect: int | None = None) -> None:
        """Recover the group in `image` as the trainer does; raise Failure on anything wrong.

        `nested`: also cut power at every sync point of the recovery's reverts. `expect`: the
        step the group must come back to (that of an interrupted recovery)."""
        low, high = self.bounds.low, self.bounds.high
        with self._opened(image) as devices:
            namespaces = []
            for device, dev in enumerate(devices):
                if NAME in dev.failed_namespaces:
                    raise Failure("unrecovered", f"dev{device} namespace failed recovery: "
                                  f"{dev.failed_namespaces[NAME]}")
                namespaces.append(dev.namespace(NAME))
            steps = [ns.committed_step for ns in namespaces]
            try:
                plan = common_step(steps)
            except GroupDisagreementError:
                raise Failure("disagreements", f"devices more than one step apart: {steps}") from None
            inner = None
            if nested and plan.revert:
                # Power lost again while recovery reverts: a second recovery from what that
                # cut leaves must reach the same step.
                inner = self._inner = PowerLossRecorder(
                    image, lambda label: self._recovery_crash(image, label, plan.step))
            previous = media.install_hooks(inner) if inner is not None else None
            try:
                for device in plan.revert:
                    namespaces[device].revert_step(plan.step + 1)
            finally:
                if inner is not None:
                    media.install_hooks(previous)
            if not plan.revert:
                self._check(namespaces, steps, low, high, expect)
                return
        # Reopened after a revert: it must be durable, and a trainer reads the media's state.
        with self._opened(image) as devices:
            self._check([dev.namespace(NAME) for dev in devices], steps, low, high, expect)

    def _recovery_crash(self, image: Path, label: str, step: int) -> None:
        """A crash point inside recovery's reverts: recover each cut image again."""
        for variant in ("drop", "tear"):
            again = image.with_name(f"{image.name}-again")
            assert self._inner is not None
            self._inner.build_image(again, variant, self.rng)
            self.outcome.recovery_states += 1
            try:
                self.verify(again, nested=False, expect=step)
            except Failure as failure:
                self._fail(failure.kind, f"recovery {label} [{variant}]: {failure}")
            except Exception as exc:  # noqa: BLE001 - any escape from recovery is a failure
                self._fail("unrecovered", f"recovery {label} [{variant}]: {type(exc).__name__}: {exc}")
            shutil.rmtree(again)

    def _check(self, namespaces: list[Namespace], steps: list[int], low: int, high: int,
               expect: int | None) -> None:
        after = [ns.committed_step for ns in namespaces]
        if len(set(after)) != 1:
            raise Failure("disagreements", f"steps {steps} -> {after} after the reverts")
        step = after[0]
        if expect is not None and step != expect:
            raise Failure("wrong", f"recovered again to step {step} (from {steps}), the interrupted "
                          f"recovery was going to {expect}")
        if not low <= step <= high:
            raise Failure("wrong", f"group recovered step {step} (from {steps}), "
                          f"promised {low}..{high}")
        for device, ns in enumerate(namespaces):
            state = state_of(ns)
            want = self.expected[step][device]
            if state != want:
                wrong = [key for key in state if state[key] != want[key]]
                raise Failure("wrong", f"dev{device} at step {step} (from {steps}) "
                              f"with wrong bytes in {wrong}")
            if not ns.loading and ns.scrub():
                raise Failure("wrong", f"dev{device} at step {step}: scrub finds bad blocks")


def run_trials(tmp_path: Path, counts: tuple[int, ...], iterations: int, protocol: Protocol, *,
               modes: tuple[bool, ...] = (False, True), group_variants: tuple[str, ...],
               single_variants: tuple[str, ...], write_probability: float,
               seed: int, sample: bool = False, nested: bool = False) -> dict[str, Outcome]:
    outcomes = {}
    for count in counts:
        for sync in modes:
            key = f"{count} devices, {'sync' if sync else 'plp'}"
            outcomes[key] = GroupPowerLossTrial(
                tmp_path / f"{count}-{'sync' if sync else 'plp'}", count, sync, iterations, protocol,
                group_variants=group_variants, single_variants=single_variants,
                write_probability=write_probability, seed=seed, sample=sample,
                nested=nested).run()
    return outcomes


def report(outcomes: dict[str, Outcome], figures: list[str], how: str = "") -> None:
    for key, outcome in outcomes.items():
        count, mode = key.split(", ")
        figures.append(
            f"C2g power loss across {count} ({mode} commits{', ' + how if how else ''}): "
            f"{outcome.states} crash states {outcome.by_variant}"
            f"{f' + {outcome.recovery_states} during recovery' if outcome.recovery_states else ''}, "
            f"{outcome.failed} failures "
            f"({outcome.disagreements} disagreeing, {outcome.unrecovered} unrecovered, "
            f"{outcome.wrong} wrong step or bytes)")
        for failure in outcome.failures[:5]:
            figures.append(f"    {failure}")


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where the trials run, made cheap: the recorder, not the disk, decides what a cut leaves,
    so a real fsync only costs time (milliseconds each on a shared disk) and is skipped; on
    tmpfs when there is one (image builds are thousands of creates and removes). State writes
    are pinned to pwrite, the disk's way, whatever the filesystem under the scratch."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    monkeypatch.setenv("COSSD_STATE_WRITES", "pwrite")
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        root = Path(tempfile.mkdtemp(prefix="cossd-group-powerloss-", dir=shm))
        try:
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        yield tmp_path


def test_group_power_loss_at_every_sync_point_short(scratch: Path, figures: list[str]) -> None:
    """2 and 3 devices, plp and sync commits, one step poisoned on one device (step 5 reverts
    the others) and one on all; per crash point one whole-group cut and one single-drive cut."""
    outcomes = run_trials(scratch, counts=(2, 3), iterations=3, protocol=Protocol(),
                          group_variants=("drop", "tear"), single_variants=("drop", "tear"),
                          write_probability=0.0, seed=1, sample=True)
    report(outcomes, figures)
    assert sum(o.states for o in outcomes.values()) >= 200
    assert all(o.failed == 0 for o in outcomes.values()), [o.failures[:3] for o in outcomes.values()]


def test_group_power_loss_over_a_split_tensor_short(scratch: Path, figures: list[str]) -> None:
    """As the short run, with one tensor split across devices 0 and 1 (its first block on
    device 0, the rest on device 1, each device's piece under the tensor's name, its
    gradient one tensor's cut in two): every cut recovers the group to one promised step
    with every device's bytes, the pieces of the split tensor included, as the reference's."""
    outcomes = run_trials(scratch, counts=(2, 3), iterations=3, protocol=Protocol(split=True),
                          group_variants=("drop", "tear"), single_variants=("drop", "tear"),
                          write_probability=0.0, seed=7, sample=True)
    report(outcomes, figures, "a tensor split across devices 0 and 1")
    assert sum(o.states for o in outcomes.values()) >= 200
    assert all(o.failed == 0 for o in outcomes.values()), [o.failures[:3] for o in outcomes.values()]


@pytest.mark.slow
def test_group_power_loss_over_a_split_tensor_torture(scratch: Path, figures: list[str]) -> None:
    """Every cut at every sync point and at 5% of the writes, 5 group steps, a split tensor."""
    outcomes = run_trials(scratch, counts=(2, 3), iterations=5, protocol=Protocol(split=True),
                          group_variants=("drop", "keep", "tear"), single_variants=("drop", "tear"),
                          write_probability=0.05, seed=8)
    report(outcomes, figures, "torture, a split tensor")
    assert all(o.failed == 0 for o in outcomes.values()), [o.failures[:3] for o in outcomes.values()]


@pytest.mark.slow
def test_group_power_loss_torture(scratch: Path, figures: list[str]) -> None:
    """Every cut at every sync point and at 5% of the writes, 6 group steps."""
    outcomes = run_trials(scratch, counts=(2, 3), iterations=6, protocol=Protocol(),
                          group_variants=("drop", "keep", "tear"), single_variants=("drop", "tear"),
                          write_probability=0.05, seed=2)
    report(outcomes, figures, "torture")
    assert sum(o.states for o in outcomes.values()) >= 1000
    assert all(o.failed == 0 for o in outcomes.values()), [o.failures[:3] for o in outcomes.values()]


@pytest.mark.slow
def test_group_power_loss_during_recovery(scratch: Path, figures: list[str]) -> None:
    """Every crash state that recovery must revert is recovered with power cut again at each
    sync point of those reverts ("drop", "tear"): the second recovery reaches the same step.
    (Slow: about 70 s, most of it the 3-device runs.)"""
    outcomes = run_trials(scratch, counts=(2, 3), iterations=3, protocol=Protocol(),
                          group_variants=("drop", "tear"), single_variants=("drop", "tear"),
                          write_probability=0.0, seed=6, sample=True, nested=True)
    report(outcomes, figures, "power cut again during recovery")
    assert sum(o.recovery_states for o in outcomes.values()) >= 100
    assert all(o.failed == 0 for o in outcomes.values()), [o.failures[:3] for o in outcomes.values()]


def test_negative_control_no_flush_loses_a_promised_step(scratch: Path, figures: list[str]) -> None:
    """Step 4 left out (plp): the trainer takes step N as the group's while a cut still loses
    it, on some devices or all; the checker must see it (else it could see nothing). The
    devices still agree: BEGIN of N + 1 flushes N before writing the copy of N - 1."""
    outcomes = run_trials(scratch, counts=(2,), iterations=2, protocol=Protocol(flush=False),
                          modes=(False,), group_variants=("drop",), single_variants=("drop",),
                          write_probability=0.0, seed=3)
    report(outcomes, figures, "negative control: no FLUSH")
    assert sum(o.failed for o in outcomes.values()) > 0


def test_negative_control_early_begin_breaks_recovery(scratch: Path, figures: list[str]) -> None:
    """Device 0 begins step N + 1 and writes its gradients before device 1 has committed N:
    a cut then leaves device 0 at N with its copy of N - 1 overwritten, which no revert can
    bring back; the checker must see it. (A whole-group "drop" hides it: the overwrites were
    not synced either; device 1's drive alone losing power, or a "tear", shows it.)"""
    outcomes = run_trials(scratch, counts=(2,), iterations=2, protocol=Protocol(eager=0, poison=False),
                          modes=(False, True), group_variants=("drop", "tear"), single_variants=("drop",),
                          write_probability=0.0, seed=4)
    report(outcomes, figures, "negative control: early BEGIN")
    assert all(o.failed > 0 for o in outcomes.values())


@pytest.mark.slow
def test_group_power_loss_torn_superblocks(scratch: Path, figures: list[str]) -> None:
    """The last device's superblock spans two sectors (130 tensors): a torn slot write, of a
    commit or of a revert, must still leave a group that recovers to one step."""
    outcomes = run_trials(scratch, counts=(2, 3), iterations=4, protocol=Protocol(many_tensors=True),
                          group_variants=("tear",), single_variants=("tear",),
                          write_probability=0.0, seed=5)
    report(outcomes, figures, "2-sector superblocks")
    assert all(o.failed == 0 for o in outcomes.values()), [o.failures[:3] for o in outcomes.values()]
