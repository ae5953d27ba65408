"""Refusals that must change nothing, and opcodes that must stay apart: EXPORT paths into the device's own files or otherwise bad, Execute Program's checks before it opens a step and its gradient scale, admin injections and error locations against I/O commands of the same opcode, the effects page's I/O dwords."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from cossd.client import AdminClient
from cossd.client.computational import ComputationalClient
from cossd.emulator import Device
from cossd.emulator.controller import Controller
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.emulator.namespace import Namespace
from cossd.protocol import logpages
from cossd.protocol.computational import ComputeOpcode, MemoryOpcode
from cossd.protocol.entries import Opcode
from cossd.protocol.logpages import CSUPP, DATA_PATH_SQID, LBCC, NOT_APPLICABLE, LogId
from cossd.protocol.status import DeviceError, Status
from helpers import InProcessTransport

CMB_BYTES = 16 << 20
NUMEL = BLOCK_ELEMS + 77  # two blocks, the second partial
HYPERS = {"lr": 1e-2, "eps": 0.1, "weight_decay": 0.1}


class Rig:
    """A real device on disk and its controller (with a CMB), reached as a client reaches it."""

    def __init__(self, backing: Path) -> None:
        self.backing = backing
        self.device = Device.open(backing)
        self.device.__enter__()
        self.controller = Controller(self.device, CMB_BYTES)
        self.admin = AdminClient(InProcessTransport(self.controller))  # type: ignore[arg-type]
        self.cp = ComputationalClient(self.admin)
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.controller.close()
            self.device.__exit__(None, None, None)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    Device.format(tmp_path / "backing", capacity_bytes=1 << 30, serial="REFUSALS0001")
    opened = Rig(tmp_path / "backing")
    try:
        yield opened
    finally:
        opened.close()


def namespace(rig: Rig, name: str = "opt") -> Namespace:
    found = rig.device.namespaces[name].as_optimizer()
    assert found is not None
    return found


def optimizer(rig: Rig, name: str = "opt") -> int:
    """An optimizer namespace still loading, its master weights written."""
    nsid = rig.admin.create_namespace({"name": name, "tensors": [["w", NUMEL]], "hyperparameters": HYPERS})
    master = np.linspace(-1, 1, NUMEL, dtype=np.float32)
    namespace(rig, name).write_state("w", "master", 0, master.tobytes())
    return nsid


def state(rig: Rig, name: str = "opt") -> dict[str, object]:
    ns = namespace(rig, name)
    figures: dict[str, object] = {role: ns.read("w", role, 0, 1 << 30)
                                  for role in ("master", "exp_avg", "exp_avg_sq", "param")}
    figures.update(step=ns.committed_step, open=ns.step_open, loading=ns.loading, groups=ns.config()["groups"])
    return figures


def submit(admin: AdminClient, opcode: int, payload: dict[str, object] | bytes, nsid: int) -> tuple[Status | int, str]:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    completion = admin.submit(opcode, nsid=nsid, payload=raw)
    return completion.status, bytes(completion.data).decode(errors="replace")


# ---------------------------------------------------------------------- EXPORT paths


def test_export_never_writes_the_devices_own_files(rig: Rig, tmp_path: Path) -> None:
    nsid = optimizer(rig)
    namespace(rig).write_grad("w", 0, np.full(NUMEL, 0.5, np.float16).tobytes())  # commits step 1
    backing = rig.backing
    meta = backing / "ns" / "opt" / "meta.json"
    files = {path: path.read_bytes() for path in backing.rglob("*") if path.is_file()}
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "to-backing").symlink_to(backing)
    (outside / "to-meta").symlink_to(meta)
    (outside / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(outside / "fifo")
    (outside / "dir").mkdir()
    cases: list[tuple[str, dict[str, object] | bytes, str]] = [
        ("over a namespace's metadata", {"path": str(meta), "overwrite": True}, "backing folder"),
        ("over the superblock", {"path": str(backing / "superblock.json"), "overwrite": True}, "backing folder"),
        ("a new file in the backing folder", {"path": str(backing / "new.safetensors")}, "backing folder"),
        ("into BACKING/exports by path", {"path": str(backing / "exports" / "x.safetensors")}, "backing folder"),
        ("the backing folder itself", {"path": str(backing), "overwrite": True}, "backing folder"),
        ("through '..'", {"path": str(outside / ".." / "backing" / "ns" / "opt" / "meta.json"),
                          "overwrite": True}, "backing folder"),
        ("through a symlinked folder", {"path": str(outside / "to-backing" / "ns" / "opt" / "meta.json"),
                                        "overwrite": True}, "backing folder"),
        ("a new file below a symlinked folder", {"path": str(outside / "to-backing" / "y.safetensors")},
         "backing folder"),
        ("a symlink to a device file", {"path": str(outside / "to-meta"), "overwrite": True}, "backing folder"),
        ("a dangling symlink, overwrite", {"path": str(outside / "dangling"), "overwrite": True}, "not a regular file"),
        ("a dangling symlink", {"path": str(outside / "dangling")}, "exists"),
        ("a FIFO, overwrite", {"path": str(outside / "fifo"), "overwrite": True}, "not a regular file"),
        ("a directory, overwrite", {"path": str(outside / "dir"), "overwrite": True}, "is a directory"),
        ("a NUL byte", {"path": "/tmp/a\u0000b"}, "NUL"),
        ("a lone surrogate", b'{"path": "/tmp/\\ud800x"}', "surrogate"),
        ("a name too long", {"path": str(outside / ("x" * 300))}, "cannot write"),
    ]
    jobs_before = rig.admin.get_log_page(LogId.JOBS)
    for what, payload, message in cases:
        status, text = submit(rig.admin, Opcode.EXPORT, payload, nsid)
        assert (status, message in text) == (Status.INVALID_FIELD, True), (what, status, text)
    assert rig.admin.get_log_page(LogId.JOBS) == jobs_before  # no job started
    assert {path: path.read_bytes() for path in backing.rglob("*") if path.is_file()} == files
    assert sorted(p.name for p in outside.iterdir()) == ["dangling", "dir", "fifo", "to-backing", "to-meta"]
    # A regular file of one's own is still replaced when asked.
    mine = outside / "mine.safetensors"
    mine.write_bytes(b"old")
    status, _ = submit(rig.admin, Opcode.EXPORT, {"path": str(mine), "overwrite": True}, nsid)
    assert status == Status.SUCCESS
    deadline = time.monotonic() + 30
    while mine.read_bytes() == b"old" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mine.read_bytes()[8:24] == b'{"__metadata__":'
    # And the device still serves its namespace after a reopen.
    rig.close()
    reopened = Rig(backing)
    try:
        assert list(reopened.device.namespaces) == ["opt"]
        assert namespace(reopened).committed_step == 1
    finally:
        reopened.close()


# ---------------------------------------------------------------------- Execute Program


def cp_setup(rig: Rig) -> tuple[int, int]:
    compute = rig.cp.ensure_namespace("cp", "compute")
    window = rig.cp.ensure_namespace("slm", "memory", cmb=True)
    rig.cp.activate(compute)
    assert rig.controller.cmb is not None
    rig.controller.cmb.array[: 2 * NUMEL] = np.full(NUMEL, 0.5, np.float16).view(np.uint8)
    return compute, window


def group(window: int, opt: int, first: int, count: int, grad_at: int | None = None,
          params_at: int = 1 << 20) -> list[tuple[int, int, int]]:
    """adamw_step's five ranges for elements first..first+count (the gradient at 2*first unless
    grad_at says, the params at params_at + 2*first)."""
    grad_at = 2 * first if grad_at is None else grad_at
    return [(window, grad_at, 2 * count), (opt, 4 * first, 4 * count), (opt, 4 * first, 4 * count),
            (opt, 4 * first, 4 * count), (window, params_at + 2 * first, 2 * count)]


def test_a_refused_execute_leaves_a_loading_namespace_unsealed(rig: Rig) -> None:
    opt = optimizer(rig)
    compute, window = cp_setup(rig)
    before = state(rig)
    assert before["loading"] is True
    # Two groups naming elements 50..100 twice, from gradient and param memory that do not overlap.
    overlapping = group(window, opt, 0, 100) + group(window, opt, 50, 100, grad_at=4096, params_at=2 << 20)
    for step, scale in ((1, None), (0, 0.5), (1, 0.5)):
        with pytest.raises(DeviceError) as caught:
            rig.cp.execute(compute, ranges=overlapping, step=step, grad_scale=scale)
        assert caught.value.status == Status.GRADIENT_DUPLICATE, (step, scale)
        assert state(rig) == before, (step, scale)
    # Still loading: the master weights can still be written.
    namespace(rig).write_state("w", "master", 0, np.zeros(4, np.float32).tobytes())


def test_execute_refuses_another_scale_than_the_open_steps(rig: Rig) -> None:
    opt = optimizer(rig)
    compute, window = cp_setup(rig)
    assert rig.admin.begin_step(opt, 0, 1.0) == 1
    before = state(rig)
    with pytest.raises(DeviceError) as caught:
        rig.cp.execute(compute, ranges=group(window, opt, 0, NUMEL), grad_scale=0.001)
    assert caught.value.status == Status.INVALID_FIELD and "grad scale 1.0" in caught.value.message
    assert state(rig) == before
    # The open step's own scale, or none (CPARAM2 0), is taken, and the step commits as before.
    rig.cp.execute(compute, ranges=group(window, opt, 0, 100), grad_scale=1.0)
    rig.cp.execute(compute, ranges=group(window, opt, 100, NUMEL - 100))
    assert rig.admin.commit_step(opt)["committed_step"] == 1


def reference_master(tmp_path: Path, scale: float) -> bytes:
    """The committed master after one step at `scale` through BEGIN_STEP and a file write."""
    Device.format(tmp_path / f"reference-{scale}", capacity_bytes=1 << 30, serial="REFERENCE0001")
    reference = Rig(tmp_path / f"reference-{scale}")
    try:
        opt = optimizer(reference)
        reference.admin.begin_step(opt, 0, scale)
        namespace(reference).write_grad("w", 0, np.full(NUMEL, 0.5, np.float16).tobytes())
        reference.admin.commit_step(opt)
        return namespace(reference).read("w", "master", 0, 1 << 30)
    finally:
        reference.close()


def test_step_0_with_a_scale_is_an_implicit_step_at_that_scale(rig: Rig, tmp_path: Path) -> None:
    opt = optimizer(rig)
    compute, window = cp_setup(rig)
    # Complete in one Execute: it commits, at the scale given.
    result = rig.cp.execute(compute, ranges=group(window, opt, 0, NUMEL), grad_scale=0.5)
    assert result.report["commit"]["committed_step"] == 1 and result.report["step_open"] is None
    expected = reference_master(tmp_path, 0.5)
    assert namespace(rig).read("w", "master", 0, 1 << 30) == expected
    assert expected != reference_master(tmp_path, 1.0)
    # In two: the implicit step stays open at its scale; another scale is refused; the rest commits it.
    rig.cp.execute(compute, ranges=group(window, opt, 0, 100), grad_scale=0.25)
    assert namespace(rig).step_open == 2
    with pytest.raises(DeviceError) as caught:
        rig.cp.execute(compute, ranges=group(window, opt, 100, NUMEL - 100), grad_scale=0.5)
    assert caught.value.status == Status.INVALID_FIELD
    result = rig.cp.execute(compute, ranges=group(window, opt, 100, NUMEL - 100))
    assert result.report["commit"]["committed_step"] == 2 and result.report["step_open"] is None


# ---------------------------------------------------------------------- admin and I/O opcodes apart


def test_an_admin_injection_never_fires_on_an_io_command_of_its_opcode(rig: Rig) -> None:
    memory = rig.cp.ensure_namespace("mem", "memory", capacity_bytes=4096)
    status, _ = submit(rig.admin, Opcode.INJECT_ERROR, {"opcode": int(Opcode.GET_LOG_PAGE), "status": "WRITE_FAULT"}, 0)
    assert status == Status.SUCCESS
    assert rig.cp.read(memory, 0, 8) == bytes(8)  # Memory Read (I/O 02h) runs
    assert rig.admin.submit(Opcode.GET_LOG_PAGE, cdw10=LogId.ERROR).status == Status.WRITE_FAULT  # the admin 02h fails
    # A Memory Read refused for its offset is logged as an I/O command, not as Get Log Page.
    with pytest.raises(DeviceError) as caught:
        rig.cp.read(memory, 8192, 8)
    assert caught.value.status == Status.INVALID_FIELD
    newest = rig.admin.error_log()[0]
    assert (newest["cs"], newest["sqid"], newest["nsid"]) == (MemoryOpcode.MEMORY_READ, DATA_PATH_SQID, memory)
    assert newest["parm_error_location"] == NOT_APPLICABLE  # not 4, Get Log Page's nsid location
    # An admin command keeps its own.
    assert rig.admin.submit(Opcode.GET_LOG_PAGE, nsid=1, cdw10=LogId.SMART).status == Status.INVALID_FIELD
    newest = rig.admin.error_log()[0]
    assert (newest["cs"], newest["sqid"], newest["parm_error_location"]) == (Opcode.GET_LOG_PAGE, 0, 4)


def test_the_effects_page_lists_the_io_commands(rig: Rig) -> None:
    effects = np.frombuffer(rig.admin.get_log_page(LogId.COMMANDS_SUPPORTED_AND_EFFECTS), dtype="<u4")
    io = {opcode: int(effects[256 + opcode]) for opcode in range(256) if effects[256 + opcode]}
    assert io == {ComputeOpcode.EXECUTE_PROGRAM: CSUPP | LBCC, MemoryOpcode.MEMORY_READ: CSUPP,
                  MemoryOpcode.MEMORY_FILL: CSUPP | LBCC, MemoryOpcode.MEMORY_WRITE: CSUPP | LBCC}
    assert set(logpages.decode_effects(effects.tobytes())["io_cmd_set"]) == {"IOCS_1", "IOCS_2", "IOCS_4", "IOCS_5"}
