"""Snapshots, rollback, clone and export: round trips bit for bit through the mount, independent
training of clones, safetensors exports, bad input, kill -9 and a power-loss sweep."""
from __future__ import annotations

import errno
import json
import os
import random
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from conftest import Mount, is_mounted, start_mount
from cossd.emulator import (
    Device,
    DeviceConfig,
    DeviceError,
    NamespaceSpec,
    Status,
    TensorSpec,
    media,
)
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.protocol.logpages import CSUPP, LBCC, NIC, LogId
from cossd.emulator.namespace import Namespace
from cossd.emulator.snapshots import clone as snapshot_clone
from cossd.protocol.entries import Opcode
from cossd.client import snapshots as snapshot_calls
from cossd.tools import cli
from cossd.client import AdminClient
from helpers import create_namespace, pread_all, pwrite_all, run_cli, tensor_dir
from powerloss import PowerLossRecorder

pytestmark = pytest.mark.mount

TENSORS = (("w", BLOCK_ELEMS + 5), ("b", 7))  # w spans two checksum blocks
ROLES = ("param", "master", "exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------------- helpers


def gradient(step: int, numel: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng([step, numel, seed])
    return (rng.standard_normal(numel) * 0.01).astype(np.float16).tobytes()


def make_namespace(mp: Path, name: str, steps: int, **options: Any) -> int:
    """A namespace with loaded masters, trained `steps` implicit steps through the mount."""
    nsid = create_namespace(mp, name, TENSORS, **options)
    for tensor, numel in TENSORS:
        master = np.random.default_rng(numel).standard_normal(numel, dtype=np.float32)
        pwrite_all(tensor_dir(mp, name, tensor) / "master", master.tobytes())
    for step in range(1, steps + 1):
        train(mp, name, step)
    return nsid


def train(mp: Path, name: str, step: int, seed: int = 0) -> None:
    for tensor, numel in TENSORS:
        pwrite_all(tensor_dir(mp, name, tensor) / "grad", gradient(step, numel, seed))


def live_state(mp: Path, name: str) -> dict[str, bytes]:
    return {f"{t}/{r}": pread_all(tensor_dir(mp, name, t) / r) for t, _ in TENSORS for r in ROLES}


def snapshot_state(mp: Path, name: str, tag: str) -> dict[str, bytes]:
    root = mp / "ns" / name / "snapshots" / tag / "tensors"
    return {f"{t}/{r}": pread_all(root / t / r) for t, _ in TENSORS for r in ROLES}


def step_of(mp: Path, name: str) -> int:
    return int((mp / "ns" / name / "step").read_text())


def status_of(action: Callable[[], object]) -> Status | None:
    try:
        action()
    except DeviceError as exc:
        return exc.status
    return None


def errno_of(action: Callable[[], object]) -> int:
    try:
        action()
    except OSError as exc:
        return exc.errno or -1
    return 0


def fingerprint(mount: Mount, admin: AdminClient) -> tuple[Any, ...]:
    """Everything bad input must leave alone: state, step, snapshots, namespaces, files."""
    mp = mount.mountpoint
    files = sorted(str(p.relative_to(mount.backing)) for p in mount.backing.rglob("*")
                   if p.name not in ("daemon.log", "superblock.json", ".superblock.json.tmp"))
    described = admin.describe()
    return (live_state(mp, "net"), step_of(mp, "net"), snapshot_calls.snapshots(admin),
            [(ns["name"], ns["nsid"]) for ns in described["namespaces"]],
            described["allocated_bytes"], files)


# ---------------------------------------------------------------------- round trips


def test_snapshot_and_rollback_round_trip_bit_identical(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = make_namespace(mp, "net", steps=2)
    at_2 = live_state(mp, "net")
    with AdminClient(mp) as admin:
        created = snapshot_calls.create_snapshot(admin, nsid, "s2")
        assert (created["tag"], created["step"], created["state"]) == ("s2", 2, "ready")

        # The snapshot in the mount: read-only, the committed bytes of step 2.
        root = mp / "ns/net/snapshots"
        assert os.listdir(root) == ["s2"]
        assert sorted(os.listdir(root / "s2")) == ["step", "tensors"]
        assert sorted(os.listdir(root / "s2/tensors")) == ["b", "w"]
        assert sorted(os.listdir(root / "s2/tensors/w")) == sorted(ROLES)
        assert (root / "s2/step").read_text() == "2\n"
        assert stat.S_IMODE(os.stat(root / "s2/tensors").st_mode) == 0o555
        assert stat.S_IMODE(os.stat(root / "s2/tensors/w/master").st_mode) == 0o444
        assert snapshot_state(mp, "net", "s2") == at_2

        train(mp, "net", 3)
        at_3 = live_state(mp, "net")
        train(mp, "net", 4)
        assert live_state(mp, "net") != at_3 != at_2
        assert snapshot_state(mp, "net", "s2") == at_2  # training never touches a snapshot

        done = snapshot_calls.rollback(admin, nsid, "s2")
        assert (done["step"], done["previous_step"]) == (2, 4)
        assert step_of(mp, "net") == 2
        assert live_state(mp, "net") == at_2
        # Replaying step 3 from the rolled-back state gives step 3's state again, bit for bit.
        train(mp, "net", 3)
        assert step_of(mp, "net") == 3 and live_state(mp, "net") == at_3
        assert admin.scrub(nsid) == {"net": {"blocks": 3, "bad": []}}
        # A rollback keeps the snapshot; it can be used again.
        assert [s["tag"] for s in snapshot_calls.snapshots(admin, nsid)["net"]] == ["s2"]


def test_snapshot_with_a_step_open_takes_the_committed_step(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = make_namespace(mp, "net", steps=1)
    at_1 = live_state(mp, "net")
    with AdminClient(mp) as admin:
        admin.begin_step(nsid)
        pwrite_all(tensor_dir(mp, "net", "w") / "grad", gradient(2, TENSORS[0][1]))
        assert snapshot_calls.create_snapshot(admin, nsid, "mid")["step"] == 1
        pwrite_all(tensor_dir(mp, "net", "b") / "grad", gradient(2, TENSORS[1][1]))
        assert admin.commit_step(nsid)["committed_step"] == 2
    assert snapshot_state(mp, "net", "mid") == at_1
    assert live_state(mp, "net") != at_1


def test_clone_trains_independently(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = make_namespace(mp, "net", steps=1)
    with AdminClient(mp) as admin:
        admin.set_hyperparameters(nsid, lr=5e-4)  # in force from step 2: the clone inherits it
        train(mp, "net", 2)
        at_2 = live_state(mp, "net")
        snapshot_calls.create_snapshot(admin, nsid, "base")
        train(mp, "net", 3)
        original_3 = live_state(mp, "net")

        config = snapshot_calls.clone(admin, nsid, "base", "ft")
        assert (config["name"], config["committed_step"], config["source"]) == ("ft", 2, "net")
        assert config["hyperparameters"]["lr"] == 5e-4
        clone_nsid = config["nsid"]
        assert clone_nsid != nsid and admin.nsid("ft") == clone_nsid
        assert step_of(mp, "ft") == 2 and live_state(mp, "ft") == at_2
        # Not loading: its state is sealed like any trained namespace.
        assert not admin.statistics(clone_nsid)["loading"]
        assert errno_of(lambda: os.open(tensor_dir(mp, "ft", "w") / "master", os.O_WRONLY)) == errno.EROFS

        # Its step 3 from the same gradients equals the original's (same state, step, lr) ...
        train(mp, "ft", 3)
        assert live_state(mp, "ft") == original_3
        # ... and from then on each trains alone.
        train(mp, "ft", 4, seed=7)
        clone_4 = live_state(mp, "ft")
        assert live_state(mp, "net") == original_3 and step_of(mp, "net") == 3
        train(mp, "net", 4)
        assert live_state(mp, "ft") == clone_4 and step_of(mp, "ft") == 4
        assert live_state(mp, "net") != clone_4
        assert admin.scrub() == {"net": {"blocks": 3, "bad": []}, "ft": {"blocks": 3, "bad": []}}
        # The clone has no snapshots of its own; the source keeps its snapshot.
        listing = snapshot_calls.snapshots(admin)
        assert listing["ft"] == [] and [s["tag"] for s in listing["net"]] == ["base"]

    # Both survive a remount as they are.
    mount.unmount()
    mount.restart()
    assert live_state(mp, "ft") == clone_4 and step_of(mp, "ft") == 4
    assert snapshot_state(mp, "net", "base") == at_2


# ---------------------------------------------------------------------- export


def wait(admin: AdminClient, job: dict[str, Any]) -> dict[str, Any]:
    done = snapshot_calls.wait_for_job(admin, job)
    assert done["state"] == "done", done
    assert done["bytes_done"] == done["bytes_total"] == os.path.getsize(done["path"])
    return done


def test_export_loads_with_safetensors_and_matches(mount: Mount, tmp_path: Path) -> None:
    mp = mount.mountpoint
    nsid = make_namespace(mp, "net", steps=2)
    at_2 = live_state(mp, "net")
    with AdminClient(mp) as admin:
        job = wait(admin, snapshot_calls.export(admin, nsid, optimizer_state=True))
        assert job["path"] == str(mount.backing / "exports/net/step-2.safetensors")
        tensors = safetensors.numpy.load_file(job["path"])
        assert sorted(tensors) == sorted(
            [t for t, _ in TENSORS] + [f"{t}.{r}" for t, _ in TENSORS for r in ROLES[1:]])
        for tensor, numel in TENSORS:
            assert tensors[tensor].dtype == np.float16 and tensors[tensor].shape == (numel,)
            assert tensors[f"{tensor}.master"].dtype == np.float32
            for role in ROLES:
                name = tensor if role == "param" else f"{tensor}.{role}"
                assert tensors[name].tobytes() == at_2[f"{tensor}/{role}"], name
        with safetensors.safe_open(job["path"], "np") as opened:
            metadata = opened.metadata()
        assert metadata["cossd.namespace"] == "net" and metadata["cossd.step"] == "2"
        assert metadata["cossd.param_dtype"] == "fp16" and metadata["cossd.state_dtype"] == "fp32"
        assert json.loads(metadata["cossd.hyperparameters"])["lr"] == 1e-3

        # A snapshot's export is the snapshot, whatever the namespace did since.
        snapshot_calls.create_snapshot(admin, nsid, "s2")
        train(mp, "net", 3)
        target = tmp_path / "out" / "s2.safetensors"
        target.parent.mkdir()
        job = wait(admin, snapshot_calls.export(admin, nsid, tag="s2", path=str(target)))
        params = safetensors.numpy.load_file(target)
        assert sorted(params) == ["b", "w"]  # params only, by default
        assert all(params[t].tobytes() == at_2[f"{t}/param"] for t, _ in TENSORS)
        with safetensors.safe_open(target, "np") as opened:
            assert opened.metadata()["cossd.snapshot"] == "s2"
        assert [entry["job"] for entry in snapshot_calls.jobs(admin, nsid)] == [1, 2]
        assert not list(target.parent.glob(".*")) and not list((mount.backing / "exports").glob(".*"))


def test_export_of_bf16_state(mount: Mount) -> None:
    torch = pytest.importorskip("torch")
    import safetensors.torch

    mp = mount.mountpoint
    nsid = make_namespace(mp, "half", steps=2, param_dtype="bf16", state_dtype="bf16")
    state = live_state(mp, "half")
    with AdminClient(mp) as admin:
        job = wait(admin, snapshot_calls.export(admin, nsid, optimizer_state=True))
    loaded = safetensors.torch.load_file(job["path"])
    assert loaded["w"].dtype == torch.bfloat16 and loaded["w.exp_avg"].dtype == torch.bfloat16
    assert loaded["w.master"].dtype == torch.float32
    for tensor, _ in TENSORS:
        for role in ROLES:
            name = tensor if role == "param" else f"{tensor}.{role}"
            value = loaded[name]
            raw = value.view(torch.int16) if value.dtype == torch.bfloat16 else value
            assert raw.numpy().tobytes() == state[f"{tensor}/{role}"], name


# ---------------------------------------------------------------------- bad input


def test_bad_input_gets_a_clear_status_and_changes_nothing(mount: Mount, tmp_path: Path) -> None:
    mp = mount.mountpoint
    nsid = make_namespace(mp, "net", steps=1)
    existing = tmp_path / "existing.safetensors"
    existing.write_bytes(b"keep me")
    with AdminClient(mp) as admin:
        snapshot_calls.create_snapshot(admin, nsid, "s1")
        train(mp, "net", 2)
        create_namespace(mp, "fresh", TENSORS)  # still loading: nothing committed to snapshot
        plain = admin.create_namespace({"name": "plain", "kind": "nvm", "capacity_bytes": 8192})
        before = fingerprint(mount, admin)

        def raw(opcode: Opcode, payload: bytes, target: int = nsid) -> Status:
            return admin.submit(opcode, nsid=target, payload=payload).status

        cases: list[tuple[str, Callable[[], object], Status]] = [
            ("duplicate tag", lambda: snapshot_calls.create_snapshot(admin, nsid, "s1"), Status.SNAPSHOT_EXISTS),
            ("tag with a slash", lambda: snapshot_calls.create_snapshot(admin, nsid, "a/b"), Status.INVALID_NAME),
            ("tag '..'", lambda: snapshot_calls.create_snapshot(admin, nsid, ".."), Status.INVALID_NAME),
            ("hidden tag", lambda: snapshot_calls.create_snapshot(admin, nsid, ".s1.tmp"), Status.INVALID_NAME),
            ("empty tag", lambda: snapshot_calls.create_snapshot(admin, nsid, ""), Status.INVALID_NAME),
            ("tag not a string", lambda: snapshot_calls.create_snapshot(admin, nsid, 5), Status.INVALID_NAME),  # type: ignore[arg-type]
            ("no tag", lambda: admin.call(Opcode.SNAPSHOT_CREATE, nsid=nsid, payload=b"{}"), Status.INVALID_FIELD),
            ("unknown key", lambda: admin.call(Opcode.SNAPSHOT_CREATE, nsid=nsid,
                                               payload=b'{"tag": "x", "when": 1}'), Status.INVALID_FIELD),
            ("not JSON", lambda: admin.call(Opcode.SNAPSHOT_ROLLBACK, nsid=nsid, payload=b"s1"), Status.INVALID_FIELD),
            ("unknown namespace", lambda: snapshot_calls.create_snapshot(admin, 99, "x"), Status.INVALID_NAMESPACE),
            ("snapshot while loading", lambda: snapshot_calls.create_snapshot(admin, admin.nsid("fresh"), "x"),
             Status.NAMESPACE_NOT_READY),
            ("export while loading", lambda: snapshot_calls.export(admin, admin.nsid("fresh")),
             Status.NAMESPACE_NOT_READY),
            ("snapshot of a plain NVM namespace", lambda: snapshot_calls.create_snapshot(admin, plain, "x"),
             Status.NAMESPACE_KIND_MISMATCH),
            ("export of a plain NVM namespace", lambda: snapshot_calls.export(admin, plain),
             Status.NAMESPACE_KIND_MISMATCH),
            ("delete unknown tag", lambda: snapshot_calls.delete_snapshot(admin, nsid, "nope"), Status.SNAPSHOT_NOT_FOUND),
            ("rollback unknown tag", lambda: snapshot_calls.rollback(admin, nsid, "nope"), Status.SNAPSHOT_NOT_FOUND),
            ("clone unknown tag", lambda: snapshot_calls.clone(admin, nsid, "nope", "c"), Status.SNAPSHOT_NOT_FOUND),
            ("export unknown tag", lambda: snapshot_calls.export(admin, nsid, tag="nope"), Status.SNAPSHOT_NOT_FOUND),
            ("clone onto an existing name", lambda: snapshot_calls.clone(admin, nsid, "s1", "fresh"),
             Status.NAMESPACE_EXISTS),
            ("clone onto its own name", lambda: snapshot_calls.clone(admin, nsid, "s1", "net"), Status.NAMESPACE_EXISTS),
            ("clone to a bad name", lambda: snapshot_calls.clone(admin, nsid, "s1", "../c"), Status.INVALID_NAME),
            ("export into a missing directory",
             lambda: snapshot_calls.export(admin, nsid, path=str(tmp_path / "missing/x.safetensors")),
             Status.INVALID_FIELD),
            ("export below a file",
             lambda: snapshot_calls.export(admin, nsid, path=str(existing / "x.safetensors")), Status.INVALID_FIELD),
            ("export over a file", lambda: snapshot_calls.export(admin, nsid, path=str(existing)), Status.INVALID_FIELD),
            ("export onto a directory", lambda: snapshot_calls.export(admin, nsid, path=str(tmp_path)),
             Status.INVALID_FIELD),
            ("export to a relative path", lambda: snapshot_calls.export(admin, nsid, path="x.safetensors"),
             Status.INVALID_FIELD),
            ("export with a bad flag", lambda: admin.call(Opcode.EXPORT, nsid=nsid,
                                                          payload=b'{"optimizer_state": 1}'), Status.INVALID_FIELD),
        ]
        for what, action, expected in cases:
            assert status_of(action) == expected, what
            assert fingerprint(mount, admin) == before, what
        assert existing.read_bytes() == b"keep me"
        assert raw(Opcode.SNAPSHOT_DELETE, b'{"tag": "s1"}', target=0xFFFFFFFF) == Status.INVALID_NAMESPACE

        # Rollback with a step open: refused, the open step goes on and commits.
        admin.begin_step(nsid)
        with_step_open = fingerprint(mount, admin)
        assert status_of(lambda: snapshot_calls.rollback(admin, nsid, "s1")) == Status.STEP_ALREADY_OPEN
        assert fingerprint(mount, admin) == with_step_open
        train(mp, "net", 3)
        assert admin.commit_step(nsid)["committed_step"] == 3

        # Every refusal is in the error log, with its opcode.
        opcodes = {entry["cs"] for entry in admin.error_log()}
        assert {Opcode.SNAPSHOT_CREATE, Opcode.SNAPSHOT_DELETE, Opcode.SNAPSHOT_ROLLBACK,
                Opcode.SNAPSHOT_CLONE, Opcode.EXPORT} <= opcodes


def test_a_corrupt_snapshot_is_never_served(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = make_namespace(mp, "net", steps=2)
    with AdminClient(mp) as admin:
        snapshot_calls.create_snapshot(admin, nsid, "s2")
        train(mp, "net", 3)
        before = live_state(mp, "net")
        # Flip one byte of w's second block (its master) in the snapshot's state file.
        state = mount.backing / "ns/net/snapshots/s2/state"
        offset = (BLOCK_ELEMS + 1) * 4
        with open(state, "r+b") as file:
            file.seek(offset)
            byte = file.read(1)
            file.seek(offset)
            file.write(bytes([byte[0] ^ 0x40]))

        root = mp / "ns/net/snapshots/s2/tensors"
        assert pread_all(root / "b/param")  # other blocks still read
        assert errno_of(lambda: pread_all(root / "w/master")) == errno.EIO
        assert status_of(lambda: snapshot_calls.rollback(admin, nsid, "s2")) == Status.UNRECOVERED_READ_ERROR
        assert live_state(mp, "net") == before and step_of(mp, "net") == 3
        assert status_of(lambda: snapshot_calls.clone(admin, nsid, "s2", "c")) == Status.UNRECOVERED_READ_ERROR
        assert "c" not in [ns["name"] for ns in admin.describe()["namespaces"]]
        assert not (mount.backing / "ns/c").exists()
        job = snapshot_calls.wait_for_job(admin, snapshot_calls.export(admin, nsid, tag="s2"))
        assert (job["state"], job["status"]) == ("failed", "UNRECOVERED_READ_ERROR")
        assert "w block 1" in job["error"]
        assert not any((mount.backing / "exports").iterdir())  # nothing half-written left
        # Training goes on, and the bad snapshot can be deleted.
        train(mp, "net", 4)
        snapshot_calls.delete_snapshot(admin, nsid, "s2")
        assert snapshot_calls.snapshots(admin, nsid) == {"net": []}


# ---------------------------------------------------------------------- device-level behaviour


def test_snapshots_count_against_capacity_and_survive_reopen(tmp_path: Path) -> None:
    spec = NamespaceSpec("n", tuple(TensorSpec(t, n) for t, n in TENSORS))
    Device.format(tmp_path / "dev", capacity_bytes=1 << 30)
    with Device.open(tmp_path / "dev") as device:
        ns = device.create_namespace(spec)
        copy_bytes = ns.snapshots.copy_bytes
        capacity = 3 * copy_bytes + copy_bytes // 2  # room for one snapshot, not two
    Device.format(tmp_path / "small", capacity_bytes=capacity)
    with Device.open(tmp_path / "small") as device:
        ns = device.create_namespace(spec)
        for tensor, numel in TENSORS:
            ns.write_grad(tensor, 0, gradient(1, numel))
        base = device.allocated_bytes
        ns.snapshots.create("a", device.reserve)
        assert device.allocated_bytes - base == ns.snapshots.bytes_used > copy_bytes
        with pytest.raises(DeviceError) as refused:
            ns.snapshots.create("b", device.reserve)
        assert refused.value.status == Status.NAMESPACE_INSUFFICIENT_CAPACITY
        assert not list((ns.directory / "snapshots").glob(".*"))
        with pytest.raises(DeviceError) as no_room:
            snapshot_clone.clone(ns.snapshots, "a", "c", device)
        assert no_room.value.status == Status.NAMESPACE_INSUFFICIENT_CAPACITY
        ns.snapshots.delete("a")
        assert device.allocated_bytes == base
        ns.snapshots.create("b", device.reserve)
        used = device.allocated_bytes
    with Device.open(tmp_path / "small") as device:
        assert device.allocated_bytes == used
        assert [s["tag"] for s in device.namespace("n").snapshots.list()] == ["b"]


def test_effects_page_and_vendor_pages(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = make_namespace(mp, "net", steps=1)
    with AdminClient(mp) as admin:
        effects = np.frombuffer(admin.get_log_page(LogId.COMMANDS_SUPPORTED_AND_EFFECTS), dtype="<u4")
        for opcode in (Opcode.SNAPSHOT_CREATE, Opcode.SNAPSHOT_DELETE, Opcode.EXPORT):
            assert effects[opcode] == CSUPP
        assert effects[Opcode.SNAPSHOT_ROLLBACK] == CSUPP | LBCC
        assert effects[Opcode.SNAPSHOT_CLONE] == CSUPP | NIC
        assert snapshot_calls.snapshots(admin) == {"net": []}
        assert snapshot_calls.jobs(admin) == []
        assert admin.submit(Opcode.GET_LOG_PAGE, nsid=77, cdw10=LogId.SNAPSHOTS).status == Status.INVALID_NAMESPACE
        snapshot_calls.create_snapshot(admin, nsid, "one")
        (entry,) = snapshot_calls.snapshots(admin, nsid)["net"]
        assert entry["tag"] == "one" and entry["step"] == 1 and entry["state"] == "ready"
        assert entry["bytes"] > 0


# ---------------------------------------------------------------------- crashes


def big_device(backing: Path) -> dict[str, bytes]:
    """A namespace big enough that a kill can land inside a snapshot or rollback: 3M
    elements (about 40 MB per state copy), loaded and at step 2. Returns step 2's digest."""
    Device.format(backing, capacity_bytes=4 << 30, force=True)
    with Device.open(backing) as device:
        ns = device.create_namespace(NamespaceSpec("big", (TensorSpec("w", 3_000_000), TensorSpec("b", 9))))
        for tensor in ns.layouts:
            master = np.random.default_rng(tensor.numel).standard_normal(tensor.numel, dtype=np.float32)
            ns.write_state(tensor.name, "master", 0, master.tobytes())
        for step in (1, 2):
            for tensor in ns.layouts:
                ns.write_grad(tensor.name, 0, gradient(step, tensor.numel))
        return big_state(lambda t, r: ns.read(t, r, 0, 1 << 40))


def big_state(read: Callable[[str, str], bytes]) -> dict[str, bytes]:
    import hashlib

    return {f"{t}/{r}": hashlib.sha256(read(t, r)).digest() for t in ("w", "b") for r in ROLES}


def big_live(mp: Path) -> dict[str, bytes]:
    return big_state(lambda t, r: pread_all(tensor_dir(mp, "big", t) / r))


def big_snapshot(mp: Path, tag: str) -> dict[str, bytes]:
    return big_state(lambda t, r: pread_all(mp / "ns/big/snapshots" / tag / "tensors" / t / r))


def in_background(work: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        try:
            work()
        except (OSError, DeviceError):
            pass  # the daemon died under the command: expected

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_kill_9_during_and_after_snapshot_and_rollback(tmp_path: Path, figures: list[str]) -> None:
    backing, chance = tmp_path / "backing", random.Random(16)
    at_2 = big_device(backing)
    mount = start_mount(backing, tmp_path / "mnt")
    mp = mount.mountpoint
    outcomes = {"snapshot kept": 0, "snapshot absent": 0, "rolled back": 0, "not rolled back": 0}
    try:
        admin = AdminClient(mp)
        nsid = admin.nsid("big")
        snapshot_calls.create_snapshot(admin, nsid, "base")  # acknowledged: must survive
        admin.close()
        mount.kill()
        mount.restart()
        assert big_snapshot(mp, "base") == at_2

        # Kills at random instants while a snapshot is being taken: whole or absent.
        for trial in range(3):
            tag = f"k{trial}"
            thread = in_background(lambda tag=tag: snapshot_calls.create_snapshot(AdminClient(mp), nsid, tag))
            time.sleep(chance.uniform(0.0, 0.15))
            mount.kill()
            thread.join()
            mount.restart()
            assert big_live(mp) == at_2 and step_of(mp, "big") == 2
            if tag in os.listdir(mp / "ns/big/snapshots"):
                assert big_snapshot(mp, tag) == at_2
                outcomes["snapshot kept"] += 1
            else:
                outcomes["snapshot absent"] += 1
            assert not list((backing / "ns/big/snapshots").glob(".*"))  # leftovers removed

        # Train on to step 4, then kill at random instants during a rollback to step 2.
        for step in (3, 4):
            for tensor, numel in (("w", 3_000_000), ("b", 9)):
                pwrite_all(tensor_dir(mp, "big", tensor) / "grad", gradient(step, numel))
        at_4 = big_live(mp)
        for trial in range(3):
            thread = in_background(lambda: snapshot_calls.rollback(AdminClient(mp), nsid, "base"))
            time.sleep(chance.uniform(0.0, 0.15))
            mount.kill()
            thread.join()
            mount.restart()
            step = step_of(mp, "big")
            assert (step, big_live(mp)) in ((2, at_2), (4, at_4)), f"trial {trial}: a mix at step {step}"
            with AdminClient(mp) as admin:
                assert admin.scrub(nsid)["big"]["bad"] == []
            if step == 2:
                outcomes["rolled back"] += 1
                for replay in (3, 4):
                    for tensor, numel in (("w", 3_000_000), ("b", 9)):
                        pwrite_all(tensor_dir(mp, "big", tensor) / "grad", gradient(replay, numel))
                assert big_live(mp) == at_4  # the replay reaches step 4 bit for bit
            else:
                outcomes["not rolled back"] += 1

        # An acknowledged rollback survives a kill right after it.
        with AdminClient(mp) as admin:
            snapshot_calls.rollback(admin, nsid, "base")
        mount.kill()
        mount.restart()
        assert step_of(mp, "big") == 2 and big_live(mp) == at_2
    finally:
        if is_mounted(mp):
            mount.unmount()
    figures.append(f"T16 kill -9 during snapshot/rollback: 6 trials, 0 failures {outcomes}")


# ---------------------------------------------------------------------- power loss


SMALL = (TensorSpec("w", 3000), TensorSpec("b", 7))


def small_state(ns: Namespace) -> dict[str, bytes]:
    return {f"{t.name}/{r}": ns.read(t.name, r, 0, 1 << 40) for t in ns.layouts for r in ROLES}


def small_grads(ns: Namespace, step: int) -> None:
    for tensor in ns.layouts:
        ns.write_grad(tensor.name, 0, gradient(step, tensor.numel))


class SnapshotPowerLoss:
    """Snapshot, step, rollback, clone and delete with a crash point at every sync; every
    image a power cut could leave must recover to a state the sequence allows, whole."""

    def __init__(self, root: Path) -> None:
        self.backing = root / "backing"
        self.images = root / "images"
        self.images.mkdir(parents=True)
        self.rng = random.Random(5)
        self.states = self.points = 0
        self.failures: list[str] = []
        self.expected: dict[int, dict[str, bytes]] = {}
        # What a crash may leave, as the sequence goes: (steps allowed, snapshot a must
        # exist / may exist, clone c must exist / may exist).
        self.steps: set[int] = {2}
        self.snapshot_needed = self.snapshot_allowed = False
        self.clone_needed = self.clone_allowed = False

    def run(self) -> None:
        Device.format(self.backing, capacity_bytes=1 << 30)
        with Device.open(self.backing, DeviceConfig(sync=True)) as device:
            ns = device.create_namespace(NamespaceSpec("n", SMALL))
            for tensor in ns.layouts:
                ns.write_state(tensor.name, "master", 0, np.arange(tensor.numel, dtype=np.float32).tobytes())
            for step in (1, 2):
                small_grads(ns, step)
                self.expected[step] = small_state(ns)
        # Step 3's state, from a scratch copy: a crash may land right after its commit.
        scratch = self.images.parent / "scratch"
        shutil.copytree(self.backing, scratch)
        with Device.open(scratch) as device:
            ns = device.namespace("n")
            small_grads(ns, 3)
            self.expected[3] = small_state(ns)
        shutil.rmtree(scratch)
        recorder = PowerLossRecorder(self.backing, self.crash_point)
        previous = media.install_hooks(recorder)
        self.recorder = recorder
        try:
            with Device.open(self.backing, DeviceConfig(sync=True)) as device:
                ns = device.namespace("n")
                self.snapshot_allowed = True
                ns.snapshots.create("a", device.reserve)
                self.snapshot_needed = True
                self.steps = {2, 3}
                small_grads(ns, 3)
                assert small_state(ns) == self.expected[3]
                self.steps = {2, 3}  # until the rollback's commit record is durable
                ns.snapshots.rollback("a")
                self.steps = {2}
                self.clone_allowed = True
                snapshot_clone.clone(ns.snapshots, "a", "c", device)
                self.clone_needed = True
                self.snapshot_needed = False
                ns.snapshots.delete("a")
                self.snapshot_allowed = False
            self.crash_point("after close")
        finally:
            media.install_hooks(previous)

    def crash_point(self, label: str) -> None:
        # Every point with only what was synced; every other one also with torn sectors.
        self.points += 1
        for variant in ("drop", "tear")[: 1 + self.points % 2]:
            image = self.images / str(self.states)
            self.recorder.build_image(image, variant, self.rng)
            self.states += 1
            try:
                problem = self.verify(image)
            except Exception as exc:  # noqa: BLE001 - any escape is a failure to report
                problem = f"{type(exc).__name__}: {exc}"
            if problem:
                self.failures.append(f"{label} [{variant}]: {problem}")
            shutil.rmtree(image)

    def verify(self, image: Path) -> str | None:
        with Device.open(image, DeviceConfig(sync=True)) as device:
            if device.failed_namespaces:
                return f"failed recovery: {device.failed_namespaces}"
            ns = device.namespace("n")
            if ns.committed_step not in self.steps:
                return f"step {ns.committed_step}, expected one of {sorted(self.steps)}"
            if small_state(ns) != self.expected[ns.committed_step]:
                return f"step {ns.committed_step} served with wrong bytes"
            leftovers = list((ns.directory / "snapshots").glob(".*"))
            if leftovers:
                return f"leftovers after open: {leftovers}"
            listing = ns.snapshots.list()
            if any(entry["state"] != "ready" for entry in listing):
                return f"a damaged snapshot: {listing}"
            has_snapshot = any(entry["tag"] == "a" for entry in listing)
            if has_snapshot and not self.snapshot_allowed or self.snapshot_needed and not has_snapshot:
                return f"snapshot present: {has_snapshot}, allowed {self.snapshot_allowed}, needed {self.snapshot_needed}"
            if has_snapshot:
                snapshot = ns.snapshots.get("a")
                ns.snapshots.verify(snapshot)
                if snapshot.step != 2:
                    return f"snapshot of step {snapshot.step}"
            clone = device.namespaces.get("c")
            if clone is None and self.clone_needed or clone is not None and not self.clone_allowed:
                return f"clone present: {clone is not None}"
            if clone is not None:
                assert isinstance(clone, Namespace)
                if clone.committed_step != 2 or small_state(clone) != self.expected[2] or clone.scrub():
                    return "clone with the wrong state"
            if clone is None and (image / "ns/c").exists():
                return "an unregistered clone directory survived the open"
        return None


def test_power_loss_at_every_sync_of_snapshot_rollback_clone_delete(tmp_path: Path, figures: list[str]) -> None:
    trial = SnapshotPowerLoss(tmp_path)
    trial.run()
    figures.append(f"T16 power loss in snapshot/rollback/clone/delete: {trial.states} crash states, "
                   f"{len(trial.failures)} failures")
    assert not trial.failures, trial.failures[:5]
    assert trial.points >= 60


# ---------------------------------------------------------------------- CLI


def test_cli_verbs_normal_and_json(mount: Mount, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mp = str(mount.mountpoint)
    make_namespace(mount.mountpoint, "net", steps=2)

    code, out, _ = run_cli(capsys, "snapshot", mp, "net", "s2")
    assert code == 0 and out.strip().startswith("snapshot 's2' of namespace 'net' at step 2")
    code, out, _ = run_cli(capsys, "snapshot", mp, "net", "s2b", "-o", "json")
    assert code == 0 and json.loads(out)["step"] == 2 and json.loads(out)["tag"] == "s2b"

    code, out, _ = run_cli(capsys, "snapshot", mp, "--list")
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].split()[:4] == ["namespace", "tag", "step", "bytes"]
    assert [line.split()[:3] for line in lines[1:]] == [["net", "s2", "2"], ["net", "s2b", "2"]]
    code, out, _ = run_cli(capsys, "snapshot", mp, "net", "--list", "-o", "json")
    assert [entry["tag"] for entry in json.loads(out)["net"]] == ["s2", "s2b"]

    code, out, _ = run_cli(capsys, "snapshot", mp, "net", "--delete", "s2b")
    assert code == 0 and out.strip() == "deleted snapshot 's2b' of namespace 'net'"
    run_cli(capsys, "snapshot", mp, "net", "s2c")
    code, out, _ = run_cli(capsys, "snapshot", mp, "net", "--delete", "s2c", "-o", "json")
    assert json.loads(out) == {"namespace": "net", "deleted": "s2c"}

    train(mount.mountpoint, "net", 3)
    code, out, _ = run_cli(capsys, "rollback", mp, "net", "s2")
    assert code == 0 and out.strip() == "namespace 'net' rolled back to snapshot 's2': step 2 (was 3)"
    train(mount.mountpoint, "net", 3)
    code, out, _ = run_cli(capsys, "rollback", mp, "net", "s2", "-o", "json")
    assert json.loads(out) == {"namespace": "net", "tag": "s2", "step": 2, "previous_step": 3}

    code, out, _ = run_cli(capsys, "clone", mp, "net", "s2", "ft")
    assert code == 0 and out.strip().startswith("cloned snapshot 's2' of namespace 'net' into namespace 'ft' (nsid")
    code, out, _ = run_cli(capsys, "clone", mp, "net", "s2", "ft2", "-o", "json")
    assert json.loads(out)["name"] == "ft2" and json.loads(out)["committed_step"] == 2

    target = tmp_path / "net.safetensors"
    code, out, err = run_cli(capsys, "export", mp, "net", "--tag", "s2", "--path", str(target))
    assert code == 0 and out.strip() == f"exported snapshot 's2' of 'net' (step 2) to {target} " \
                                        f"({os.path.getsize(target) / 1024:.1f} KiB)"
    assert "100%" in err  # the progress bar, on stderr
    code, out, err = run_cli(capsys, "export", mp, "net", "--path", str(target), "--force",
                             "--with-state", "-q", "-o", "json")
    job = json.loads(out)
    assert code == 0 and job["state"] == "done" and job["tag"] is None and err == ""
    assert len(safetensors.numpy.load_file(target)) == 8
    code, out, _ = run_cli(capsys, "export", mp, "ft", "--no-wait")
    assert code == 0 and out.startswith("export job 3 started: namespace of 'ft' (step 2) to ")
    # The same step again: refused unless replacing the first export is asked for.
    code, out, _ = run_cli(capsys, "export", mp, "ft", "--no-wait", "--force", "-o", "json")
    with AdminClient(mount.mountpoint) as admin:
        assert snapshot_calls.wait_for_job(admin, json.loads(out))["state"] == "done"

    # The vendor pages through get-log: JSON in both formats.
    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "0xc1", "-n", "net", "-o", "json")
    assert code == 0 and [entry["tag"] for entry in json.loads(out)["net"]] == ["s2"]
    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "0xc2")
    assert code == 0 and out.startswith(f"Device:{mp} log-id:0xc2")
    assert [job["state"] for job in json.loads(out.split("\n", 1)[1])["jobs"]] == ["done"] * 4

    # Failures: one line on stderr, exit 1, with the status.
    for argv, status in (
        (("snapshot", mp, "net", "s2"), "SNAPSHOT_EXISTS"),
        (("snapshot", mp, "net", "bad/tag"), "INVALID_NAME"),
        (("snapshot", mp, "net", "--delete", "nope"), "SNAPSHOT_NOT_FOUND"),
        (("rollback", mp, "net", "nope"), "SNAPSHOT_NOT_FOUND"),
        (("clone", mp, "net", "s2", "ft"), "NAMESPACE_EXISTS"),
        (("export", mp, "net", "--path", str(target)), "INVALID_FIELD"),
        (("export", mp, "nope"), "INVALID_NAMESPACE"),
    ):
        code, out, err = run_cli(capsys, *argv)
        assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, argv
        assert err.startswith(f"cossd {argv[0]}: ") and err.strip().endswith(f"[{status}]"), err
    with pytest.raises(SystemExit) as usage:
        cli.main(["snapshot", mp, "net"])
    assert "give TAG" in str(usage.value.code)


def test_snapshot_limit_per_namespace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit is one comparison; a lowered limit checks it without taking 1024 snapshots."""
    from cossd.emulator.namespace import snapshots

    monkeypatch.setattr(snapshots, "MAX_SNAPSHOTS", 2)
    Device.format(tmp_path / "dev", capacity_bytes=1 << 30)
    with Device.open(tmp_path / "dev") as device:
        ns = device.create_namespace(NamespaceSpec("n", (TensorSpec("t", 10),)))
        ns.write_grad("t", 0, gradient(1, 10))
        ns.snapshots.create("a", device.reserve)
        ns.snapshots.create("b", device.reserve)
        with pytest.raises(DeviceError) as refused:
            ns.snapshots.create("c", device.reserve)
        assert refused.value.status == Status.LIMIT_EXCEEDED
        assert sorted(p.name for p in (ns.directory / "snapshots").iterdir()) == ["a", "b"]
