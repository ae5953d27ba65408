"""A Hypothesis state machine drives a real mount and a pure-Python model of the device side by side.

Any difference in state bytes, step numbers, errno or completion status fails, and Hypothesis
shrinks the sequence of operations to a minimal counterexample.
"""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule

import cossd.kernels as k
from conftest import FIGURES, force_unmount, is_mounted, wait_for_exit
from cossd.emulator import Device, Status
from cossd.protocol.entries import Opcode
from cossd.protocol.computational import CpAdminOpcode
from cossd.fs import daemon
from cossd.client import AdminClient
from reference_adam import ref_adam

pytestmark = pytest.mark.mount

HYPER = k.AdamHyper(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, mode="adamw")
ROLES = ("param", "master", "exp_avg", "exp_avg_sq")
VALID_NAMES = st.sampled_from(["a", "b", "net.v2", "x_y-z"])
INVALID_NAMES = st.sampled_from(["", "../x", "a/b", ".hidden", "a\x00b", "x" * 129, "sp ace"])


@dataclasses.dataclass
class ModelNamespace:
    """What the device should hold for one namespace."""

    nsid: int
    tensors: dict[str, int]
    master: dict[str, np.ndarray]
    m: dict[str, np.ndarray]
    v: dict[str, np.ndarray]
    step: int = 0
    loading: bool = True
    # The open step: gradient elements received so far, explicit or implicit, its scale.
    open: bool = False
    explicit: bool = False
    scale: float = 1.0
    grads: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    got: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def start(self, explicit: bool, scale: float) -> None:
        self.open, self.explicit, self.scale, self.loading = True, explicit, scale, False
        self.grads = {t: np.zeros(n, np.uint16) for t, n in self.tensors.items()}
        self.got = {t: np.zeros(n, bool) for t, n in self.tensors.items()}

    @property
    def complete(self) -> bool:
        return all(received.all() for received in self.got.values())

    def commit(self) -> bool:
        """Apply the open step; returns False when it is skipped (a non-finite gradient)."""
        self.open = False
        halves = {t: g.view(np.float16) for t, g in self.grads.items()}
        if any(not np.isfinite(h).all() for h in halves.values()):
            return False
        self.step += 1
        scalars = k.adam_scalars(HYPER, self.step, self.scale)
        for tensor in self.tensors:
            out = ref_adam({"grad": self.grads[tensor], "master": self.master[tensor], "m": self.m[tensor],
                            "v": self.v[tensor]}, k.HalfFormat.FP16, k.HalfFormat.FP16, k.StateFormat.FP32,
                           scalars)
            self.master[tensor], self.m[tensor], self.v[tensor] = out["master"], out["m"], out["v"]
        return True

    def expected(self, tensor: str, role: str) -> bytes:
        if role == "param":
            with np.errstate(over="ignore"):
                return self.master[tensor].astype(np.float16).tobytes()
        return {"master": self.master, "exp_avg": self.m, "exp_avg_sq": self.v}[role][tensor].tobytes()


def os_error(call) -> int:
    """0 if the call succeeds, else its errno."""
    try:
        call()
        return 0
    except OSError as exc:
        return exc.errno


class MountMachine(RuleBasedStateMachine):
    names = Bundle("names")
    runs = 0  # machines run to completion (each a sequence of rules checked against the model)

    def __init__(self) -> None:
        super().__init__()
        self.workdir = Path(tempfile.mkdtemp(prefix="cossd-sm-"))
        backing, self.mountpoint = self.workdir / "backing", self.workdir / "mnt"
        self.mountpoint.mkdir()
        Device.format(backing, capacity_bytes=1 << 30)
        self.pid = daemon.start_background(backing, self.mountpoint)
        self.admin = AdminClient(self.mountpoint)
        self.model: dict[str, ModelNamespace] = {}
        self.rng = np.random.default_rng(0)

    def teardown(self) -> None:
        MountMachine.runs += 1
        self.admin.close()
        if is_mounted(self.mountpoint):
            force_unmount(self.mountpoint)
        wait_for_exit(self.pid, 30)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def path(self, name: str, tensor: str, role: str) -> Path:
        return self.mountpoint / "ns" / name / "tensors" / tensor / role

    # ------------------------------------------------------------------ namespaces

    @initialize(target=names)
    def first_name(self) -> str:
        return "a"

    @rule(target=names, name=VALID_NAMES)
    def a_name(self, name: str) -> str:
        return name

    @rule(name=names, sizes=st.lists(st.integers(1, 700), min_size=1, max_size=3))
    def create(self, name: str, sizes: list[int]) -> None:
        tensors = {f"t{i}": n for i, n in enumerate(sizes)}
        completion = self.admin.submit(Opcode.CREATE_NAMESPACE, payload=_json(
            {"name": name, "tensors": [[t, n] for t, n in tensors.items()],
             "hyperparameters": {"lr": HYPER.lr, "weight_decay": HYPER.weight_decay}}))
        if name in self.model:
            assert completion.status == Status.NAMESPACE_EXISTS
            return
        assert completion.status == Status.SUCCESS, completion
        zeros = {t: np.zeros(n, np.float32) for t, n in tensors.items()}
        self.model[name] = ModelNamespace(completion.result, tensors, dict(zeros),
                                          {t: z.copy() for t, z in zeros.items()},
                                          {t: z.copy() for t, z in zeros.items()})

    @rule(name=INVALID_NAMES)
    def create_invalid(self, name: str) -> None:
        completion = self.admin.submit(Opcode.CREATE_NAMESPACE, payload=_json(
            {"name": name, "tensors": [["t", 4]]}))
        assert completion.status == Status.INVALID_NAME

    @rule(name=names)
    def delete(self, name: str) -> None:
        model = self.model.get(name)
        status = self.admin.submit(Opcode.DELETE_NAMESPACE, nsid=model.nsid if model else 0xDEAD).status
        if model is None:
            assert status == Status.INVALID_NAMESPACE
        elif model.open:
            assert status == Status.STEP_ALREADY_OPEN
        else:
            assert status == Status.SUCCESS
            del self.model[name]

    # ------------------------------------------------------------------ loading

    @rule(name=names, data=st.data())
    def load_master(self, name: str, data: st.DataObject) -> None:
        model = self.model.get(name)
        if model is None:
            return
        tensor = data.draw(st.sampled_from(sorted(model.tensors)))
        values = self.rng.standard_normal(model.tensors[tensor]).astype(np.float32)
        result = os_error(lambda: self.path(name, tensor, "master").write_bytes(values.tobytes()))
        if model.loading:
            assert result == 0
            model.master[tensor] = values
        else:
            assert result in (errno.EROFS, errno.EACCES), result

    # ------------------------------------------------------------------ steps

    @rule(name=names, scale=st.sampled_from([1.0, 0.5, 1 / 1024]))
    def begin(self, name: str, scale: float) -> None:
        model = self.model.get(name)
        if model is None:
            return
        completion = self.admin.submit(Opcode.BEGIN_STEP, nsid=model.nsid, **_f64(scale))
        if model.open:
            assert completion.status == Status.STEP_ALREADY_OPEN
        else:
            assert completion.status == Status.SUCCESS, completion
            model.start(explicit=True, scale=scale)

    @rule(name=names, data=st.data(), poison=st.booleans(), misalign=st.booleans())
    def write_grad(self, name: str, data: st.DataObject, poison: bool, misalign: bool) -> None:
        model = self.model.get(name)
        if model is None:
            return
        tensor = data.draw(st.sampled_from(sorted(model.tensors)))
        numel = model.tensors[tensor]
        start = data.draw(st.integers(0, numel))
        stop = data.draw(st.integers(start, numel + 2))
        values = (self.rng.standard_normal(max(0, stop - start)) * 0.05).astype(np.float16)
        if poison and len(values):
            values[0] = np.inf
        raw = values.tobytes()
        offset = 2 * start + (1 if misalign else 0)
        if not model.open and len(raw) and not misalign and stop <= numel:
            model.start(explicit=False, scale=1.0)
            implicit_started = True
        else:
            implicit_started = False
        got = model.got.get(tensor) if model.open else None
        duplicate = got is not None and stop <= numel and got[start:stop].any()
        result = os_error(lambda: _pwrite(self.path(name, tensor, "grad"), raw, offset))
        if len(raw) == 0:
            assert result == 0  # the kernel answers an empty write itself
        elif misalign:
            assert result == errno.EINVAL, result
        elif stop > numel:
            assert result == errno.EFBIG, result
        elif duplicate:
            assert result == errno.EEXIST, result
        else:
            assert result == 0, result
            model.grads[tensor][start:stop] = values.view(np.uint16)
            model.got[tensor][start:stop] = True
            if not model.explicit and model.complete:
                model.commit()
        if implicit_started and result != 0:
            model.open = False  # nothing arrived: the device never opened it

    @rule(name=names)
    def write_all_concurrently(self, name: str) -> None:
        """Every missing gradient at once, one thread per tensor."""
        model = self.model.get(name)
        if model is None:
            return
        if not model.open:
            model.start(explicit=False, scale=1.0)
        pieces = {}
        for tensor, got in model.got.items():
            missing = np.flatnonzero(~got)
            if len(missing):
                start, stop = int(missing[0]), int(missing[-1]) + 1
                if got[start:stop].any():
                    continue  # not one contiguous gap: leave it
                pieces[tensor] = (start, (self.rng.standard_normal(stop - start) * 0.05).astype(np.float16))
        errors: list[int] = []

        def send(tensor: str, start: int, values: np.ndarray) -> None:
            errors.append(os_error(lambda: _pwrite(self.path(name, tensor, "grad"), values.tobytes(), 2 * start)))

        threads = [threading.Thread(target=send, args=(t, s, v)) for t, (s, v) in pieces.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [0] * len(threads), errors
        for tensor, (start, values) in pieces.items():
            model.grads[tensor][start:start + len(values)] = values.view(np.uint16)
            model.got[tensor][start:start + len(values)] = True
        if not model.explicit and model.complete:
            model.commit()
        if not pieces and not model.explicit and not model.complete:
            model.open = any(g.any() for g in model.got.values())

    @rule(name=names)
    def commit(self, name: str) -> None:
        model = self.model.get(name)
        if model is None:
            return
        completion = self.admin.submit(Opcode.COMMIT_STEP, nsid=model.nsid)
        if not model.open:
            assert completion.status == Status.NO_STEP_OPEN
        elif not model.complete:
            assert completion.status == Status.GRADIENT_INCOMPLETE
        else:
            applied = model.commit()
            expected = Status.SUCCESS if applied else Status.STEP_SKIPPED_NONFINITE
            assert completion.status == expected, completion

    @rule(name=names)
    def abort(self, name: str) -> None:
        model = self.model.get(name)
        if model is None:
            return
        completion = self.admin.submit(Opcode.ABORT_STEP, nsid=model.nsid)
        if model.open:
            assert completion.status == Status.SUCCESS
            model.open = False
        else:
            assert completion.status == Status.NO_STEP_OPEN

    # Unknown: neither a vendor opcode nor one of the Computational Programs admin commands.
    @rule(opcode=st.integers(0, 255).filter(
        lambda op: op not in {int(o) for o in Opcode} | {int(o) for o in CpAdminOpcode}))
    def unknown_command(self, opcode: int) -> None:
        assert self.admin.submit(opcode).status == Status.INVALID_OPCODE

    # ------------------------------------------------------------------ what must hold

    @invariant()
    def namespaces_match(self) -> None:
        listed = {entry["name"]: entry for entry in self.admin.describe()["namespaces"]}
        assert set(listed) == set(self.model)
        for name, model in self.model.items():
            assert listed[name]["committed_step"] == model.step
            assert (self.mountpoint / "ns" / name / "step").read_text() == f"{model.step}\n"

    @invariant()
    def state_matches(self) -> None:
        for name, model in self.model.items():
            for tensor in model.tensors:
                for role in ROLES:
                    got = self.path(name, tensor, role).read_bytes()
                    assert got == model.expected(tensor, role), f"{name}/{tensor}/{role} differs at step {model.step}"


def _json(value: object) -> bytes:
    import json

    return json.dumps(value).encode()


def _f64(value: float) -> dict[str, int]:
    from cossd.protocol.entries import f64_to_dwords

    low, high = f64_to_dwords(value)
    return {"cdw12": low, "cdw13": high}


def _pwrite(path: Path, data: bytes, offset: int) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        written = os.pwrite(fd, data, offset)
        assert written == len(data)
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def report_runs(request: pytest.FixtureRequest):
    MountMachine.runs = 0
    yield
    if request.node.cls is None:
        return
    FIGURES.append(f"SM state machine ({request.node.cls.__name__}): {MountMachine.runs} runs of up to "
                   f"{request.node.cls.settings.stateful_step_count} rules against the model, 0 divergences")


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class TestMountMatchesModel(MountMachine.TestCase):  # type: ignore[name-defined]
    settings = settings(max_examples=12, stateful_step_count=30, **SETTINGS)


@pytest.mark.slow
class TestMountMatchesModelLong(MountMachine.TestCase):  # type: ignore[name-defined]
    settings = settings(max_examples=150, stateful_step_count=50, **SETTINGS)


def test_regression_empty_misaligned_write_is_answered_by_the_kernel(tmp_path: Path) -> None:
    """Shrunk from the state machine: a 0-byte write at an odd offset never reaches the daemon
    (the kernel answers it), so it succeeds instead of failing with EINVAL."""
    Device.format(tmp_path / "backing", capacity_bytes=1 << 30)
    (tmp_path / "mnt").mkdir()
    pid = daemon.start_background(tmp_path / "backing", tmp_path / "mnt")
    try:
        with AdminClient(tmp_path / "mnt") as admin:
            admin.create_namespace({"name": "a", "tensors": [["t0", 1]]})
        grad = tmp_path / "mnt" / "ns" / "a" / "tensors" / "t0" / "grad"
        assert os_error(lambda: _pwrite(grad, b"", 1)) == 0
        assert os_error(lambda: _pwrite(grad, b"\0", 0)) == errno.EINVAL
    finally:
        force_unmount(tmp_path / "mnt")
        wait_for_exit(pid, 30)
