"""C2: simulated power loss at every sync point (and at random writes) of creates, loads and steps."""
from __future__ import annotations

import dataclasses
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from cossd.emulator import Device, DeviceConfig, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.emulator import media
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.emulator.namespace import Namespace
from powerloss import PowerLossRecorder

TENSORS = (TensorSpec("w", BLOCK_ELEMS + 3), TensorSpec("b", 7))
NAME = "opt"
ROLES = ("master", "exp_avg", "exp_avg_sq", "param")


# The moments' format of every namespace these trials make (a test over fp16/int8 sets it).
STATE_DTYPE = "fp32"


def spec() -> NamespaceSpec:
    return NamespaceSpec(name=NAME, tensors=TENSORS, state_dtype=STATE_DTYPE)


def load(ns: Namespace) -> None:
    rng = np.random.default_rng(0)
    for tensor in ns.layouts:
        ns.write_state(tensor.name, "master", 0, rng.standard_normal(tensor.numel, dtype=np.float32).tobytes())


def grads(step: int, poisoned: bool) -> dict[str, bytes]:
    rng = np.random.default_rng(1000 + step)
    out = {}
    for tensor in TENSORS:
        values = (rng.standard_normal(tensor.numel) * 0.01).astype(np.float16)
        if poisoned and tensor.name == "w":
            values[12345] = np.inf
        out[tensor.name] = values.tobytes()
    return out


def state_of(ns: Namespace) -> dict[str, bytes]:
    return {f"{t.name}/{r}": ns.read(t.name, r, 0, 1 << 40) for t in ns.layouts for r in ROLES}


def poisoned_steps(steps: int) -> set[int]:
    return {s for s in range(1, steps + 1) if s % 7 == 3}


def reference(steps: int) -> dict[int, dict[str, bytes]]:
    """The state after every committed step, from a run nobody interrupts."""
    with tempfile.TemporaryDirectory() as scratch:
        Device.format(Path(scratch) / "dev", capacity_bytes=1 << 30)
        with Device.open(Path(scratch) / "dev") as device:
            ns = device.create_namespace(spec())
            load(ns)
            states = {0: state_of(ns)}  # sealed at step 0: the loaded weights, zero moments
            for step in range(1, steps + 1):
                for name, data in grads(step, step in poisoned_steps(steps)).items():
                    ns.write_grad(name, 0, data)
                states[ns.committed_step] = state_of(ns)
            return states


@dataclasses.dataclass
class Outcome:
    states: int = 0
    silent_wrong: int = 0
    loud: int = 0
    by_variant: dict[str, int] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)


class PowerLossTrial:
    """Runs creates, loads and steps on a device whose every sync point is a crash point."""

    def __init__(self, root: Path, sync: bool, steps: int, variants: tuple[str, ...], *,
                 write_probability: float, seed: int, verify: str = "open", daemon_mark: bool = False) -> None:
        self.root, self.sync, self.steps, self.variants = root, sync, steps, variants
        self.verify_mode = verify  # how the image is opened (DeviceConfig.verify)
        # The device marked in use as the mount daemon marks it: the in-use file at once, the
        # superblock's record by a thread (joined here, so its sync points are crash points too).
        self.daemon_mark = daemon_mark
        self.expected = reference(steps)
        self.outcome = Outcome()
        self.rng = random.Random(seed)
        self.created = False    # create_namespace has returned
        self.low = -1           # the oldest step a crash may recover (-1: none promised yet)
        self.high = 0           # the newest step a crash may recover
        self.backing = root / "backing"
        self.images = root / "images"
        self.images.mkdir(parents=True)
        Device.format(self.backing, capacity_bytes=1 << 30, serial="POWERLOSS0001")
        self.recorder = PowerLossRecorder(self.backing, self.crash_point,
                                          write_probability=write_probability, seed=seed)

    def run(self) -> Outcome:
        previous = media.install_hooks(self.recorder)
        try:
            with Device.open(self.backing, DeviceConfig(sync=self.sync), mark_in_use=not self.daemon_mark) as device:
                if self.daemon_mark:
                    device.mark_in_use(durable_now=False)
                    assert device._marking is not None
                    device._marking.join()
                ns = device.create_namespace(spec())
                self.created = True
                load(ns)
                for step in range(1, self.steps + 1):
                    self.high = ns.committed_step + 1
                    for name, data in grads(step, step in poisoned_steps(self.steps)).items():
                        ns.write_grad(name, 0, data)
                    # Returned: a sync-mode commit is durable now; in PLP mode this step's
                    # begin made the step before it durable.
                    self.high = ns.committed_step
                    self.low = ns.committed_step if self.sync else max(self.low, ns.durable_step)
                ns.flush()
                self.low = ns.committed_step
            self.crash_point("after close")
        finally:
            media.install_hooks(previous)
        return self.outcome

    def crash_point(self, label: str) -> None:
        for variant in self.variants:
            image = self.images / f"{self.outcome.states}"
            self.recorder.build_image(image, variant, self.rng)
            self.outcome.states += 1
            self.outcome.by_variant[variant] = self.outcome.by_variant.get(variant, 0) + 1
            try:
                problem, silent = self.verify(image)
            except Exception as exc:  # noqa: BLE001 - any escape is a failure to report
                problem, silent = f"{type(exc).__name__}: {exc}", False
            if problem:
                self.outcome.failures.append(f"{label} [{variant}]: {problem}")
                if silent:
                    self.outcome.silent_wrong += 1
                else:
                    self.outcome.loud += 1
            shutil.rmtree(image)

    def verify(self, image: Path) -> tuple[str | None, bool]:
        """(problem, silent): what is wrong with the state a power cut left in `image`. With
        background verification the params are read first, as a restart reads them; a
        namespace the background pass then stops is remounted, as its error asks, and the
        step served after that is judged."""
        for _remount in range(3):
            verdict = self._verify_once(image)
            if verdict != "remount":
                return verdict  # type: ignore[return-value]
        return "stopped again at every remount", False

    def _verify_once(self, image: Path) -> tuple[str | None, bool] | str:
        config = DeviceConfig(sync=self.sync, verify=self.verify_mode)
        with Device.open(image, config) as device:
            if NAME in device.failed_namespaces:
                return f"namespace failed recovery: {device.failed_namespaces[NAME]}", False
            if NAME not in device.namespaces:
                return (None, False) if not self.created else ("acknowledged namespace is gone", False)
            ns = device.namespace(NAME)
            step = ns.committed_step
            if ns.loading:
                # Initial weights are not a committed step: a trainer loads them again.
                return (None, False) if self.low <= 0 else (f"back to loading; step {self.low} lost", False)
            if not self.low <= step <= self.high:
                return f"recovered step {step}, expected {max(self.low, 0)}..{self.high}", False
            if ns.verifying:
                try:
                    for tensor in ns.layouts:
                        if ns.read(tensor.name, "param", 0, 1 << 40) != self.expected[step][f"{tensor.name}/param"]:
                            return f"step {step}: params served wrong before verification ended", True
                except DeviceError as exc:
                    if exc.status != Status.UNRECOVERED_READ_ERROR:
                        raise
            assert ns.wait_verified(timeout=60)
            if ns.media_failure is not None:  # the pass (perhaps over already) stopped it
                return "remount"
            state = state_of(ns)
            if state != self.expected[step]:
                wrong = [key for key in state if state[key] != self.expected[step][key]]
                return f"step {step} served with wrong bytes in {wrong}", True
            if ns.scrub():
                return f"step {step} served but scrub finds bad blocks", False
        return None, False


def run_trials(tmp_path: Path, steps: int, variants: tuple[str, ...], write_probability: float,
               seed: int, verify: str = "open", daemon_mark: bool = False) -> dict[str, Outcome]:
    outcomes = {}
    for sync in (False, True):
        mode = "sync" if sync else "plp"
        outcomes[mode] = PowerLossTrial(tmp_path / mode, sync, steps, variants, write_probability=write_probability,
                                        seed=seed, verify=verify, daemon_mark=daemon_mark).run()
    return outcomes


def report(outcomes: dict[str, Outcome], figures: list[str], how: str = "") -> None:
    for mode, outcome in outcomes.items():
        figures.append(
            f"C2 power loss ({mode} commits{', ' + how if how else ''}): {outcome.states} crash states {outcome.by_variant}, "
            f"{outcome.silent_wrong + outcome.loud} failures ({outcome.silent_wrong} silent wrong, "
            f"{outcome.loud} unrecovered)")
        for failure in outcome.failures[:10]:
            figures.append(f"    {failure}")
    for outcome in outcomes.values():
        assert outcome.silent_wrong == 0 and outcome.loud == 0, outcome.failures[:5]


@pytest.mark.parametrize("writes", ["pwrite", "mapped"])
def test_power_loss_at_every_sync_point_short(tmp_path: Path, figures: list[str], writes: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways new state reaches the shadow copy (emulator/media.py write_mode_for)."""
    monkeypatch.setenv("COSSD_STATE_WRITES", writes)
    outcomes = run_trials(tmp_path, steps=4, variants=("drop", "tear"), write_probability=0.0, seed=1)
    report(outcomes, figures, f"{writes} state writes")
    assert sum(o.states for o in outcomes.values()) >= 40


@pytest.mark.parametrize("state_dtype", ["fp16", "int8"])
def test_power_loss_over_block_scaled_moments(tmp_path: Path, figures: list[str], state_dtype: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-scaled moments (codes and a scale per 256 elements, all under the block
    checksums): every crash state recovers a promised step with the right bytes, scales
    included (the moments read decoded, so a wrong scale shows as wrong bytes)."""
    monkeypatch.setattr(sys.modules[__name__], "STATE_DTYPE", state_dtype)
    assert spec().state_dtype == state_dtype
    outcomes = run_trials(tmp_path, steps=3, variants=("drop", "tear"), write_probability=0.0, seed=13)
    report(outcomes, figures, f"{state_dtype} moments")
    assert sum(o.states for o in outcomes.values()) >= 30


def test_power_loss_with_background_verification_short(tmp_path: Path, figures: list[str]) -> None:
    """The same crash states opened as `cossd mount` opens them: params served as first read,
    master and moments verified in the background (a failure there remounts)."""
    outcomes = run_trials(tmp_path, steps=4, variants=("drop", "tear"), write_probability=0.1, seed=7,
                          verify="background")
    report(outcomes, figures, "background verification")
    assert sum(o.states for o in outcomes.values()) >= 40


def test_power_loss_with_the_in_use_mark_made_as_the_daemon_makes_it(tmp_path: Path, figures: list[str]) -> None:
    """The in-use file created unsynced and superblock.json's mark written by a thread, as the
    mount daemon does (Device.mark_in_use(durable_now=False)): every crash state, a power cut
    ("drop", "tear") or a kill -9 ("keep", which leaves the file for the next open), recovers
    a promised step with the right bytes."""
    outcomes = run_trials(tmp_path, steps=3, variants=("drop", "keep", "tear"), write_probability=0.0, seed=11,
                          verify="background", daemon_mark=True)
    report(outcomes, figures, "the daemon's in-use mark")
    assert sum(o.states for o in outcomes.values()) >= 60


@pytest.mark.slow
def test_power_loss_torture_with_background_verification(tmp_path: Path, figures: list[str]) -> None:
    outcomes = run_trials(tmp_path, steps=24, variants=("drop", "keep", "tear", "tear"),
                          write_probability=0.1, seed=8, verify="background")
    report(outcomes, figures, "background verification")
    assert sum(o.states for o in outcomes.values()) >= 1000


@pytest.mark.slow
def test_power_loss_torture(tmp_path: Path, figures: list[str]) -> None:
    outcomes = run_trials(tmp_path, steps=24, variants=("drop", "keep", "tear", "tear"),
                          write_probability=0.1, seed=2)
    report(outcomes, figures)
    assert sum(o.states for o in outcomes.values()) >= 1000


@pytest.mark.slow
def test_power_loss_torture_mapped_writes(tmp_path: Path, figures: list[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The torture again with the kernel storing into the shadow's mapping (as on tmpfs)."""
    monkeypatch.setenv("COSSD_STATE_WRITES", "mapped")
    outcomes = run_trials(tmp_path, steps=12, variants=("drop", "keep", "tear"),
                          write_probability=0.1, seed=3)
    report(outcomes, figures, "mapped state writes")
    assert sum(o.states for o in outcomes.values()) >= 300
