"""Emulator tier (no mount): namespaces, step transactions, skips, recovery, durability."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.emulator.namespace import Namespace
from cossd.emulator.spec import Hyperparameters
from cossd.protocol.computational import CpAdminOpcode

TENSORS = (TensorSpec("w", BLOCK_ELEMS * 2 + 5), TensorSpec("b", 7))


def make_spec(name: str = "opt", **kw: object) -> NamespaceSpec:
    return NamespaceSpec(name=name, tensors=TENSORS, **kw)  # type: ignore[arg-type]


def load(ns: Namespace, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for tensor in ns.layouts:
        ns.write_state(tensor.name, "master", 0, rng.standard_normal(tensor.numel, dtype=np.float32).tobytes())


def grads(ns: Namespace, seed: int, poison: tuple[str, int] | None = None) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    out = {}
    for tensor in ns.layouts:
        values = (rng.standard_normal(tensor.numel) * 0.01).astype(np.float16)
        if poison and poison[0] == tensor.name:
            values[poison[1]] = np.nan
        out[tensor.name] = values.tobytes()
    return out


def snapshot(ns: Namespace) -> dict[str, bytes]:
    return {f"{t.name}/{r}": ns.read(t.name, r, 0, 1 << 40)
            for t in ns.layouts for r in ("master", "exp_avg", "exp_avg_sq", "param")}


def run_steps(ns: Namespace, seeds: range) -> None:
    for seed in seeds:
        for name, data in grads(ns, seed).items():
            ns.write_grad(name, 0, data)


def test_format_and_identity(backing: Path) -> None:
    with Device.open(backing) as device:
        identity = device.identity
        assert identity["serial"] == "TESTSERIAL0001"
        assert identity["capacity_bytes"] == 8 << 30
        assert device.describe()["format_version"] == 1
    with pytest.raises(DeviceError, match="already holds"):
        Device.format(backing)


def test_device_is_opened_exclusively(device: Device) -> None:
    with pytest.raises(DeviceError, match="already opened"):
        Device.open(device.path)


def test_implicit_steps_commit_and_survive_reopen(backing: Path) -> None:
    with Device.open(backing) as device:
        ns = device.create_namespace(make_spec())
        load(ns)
        assert ns.loading
        run_steps(ns, range(3))
        assert ns.committed_step == 3 and not ns.loading
        state = snapshot(ns)
    with Device.open(backing) as device:
        ns = device.namespace("opt")
        assert ns.committed_step == 3
        assert snapshot(ns) == state
        run_steps(ns, range(3, 4))
        assert ns.committed_step == 4


def test_explicit_transaction(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    load(ns)
    with pytest.raises(DeviceError) as info:
        ns.begin_step(5)
    assert info.value.status == Status.STEP_NUMBER_MISMATCH
    assert ns.begin_step(1, grad_scale=0.5) == 1
    with pytest.raises(DeviceError) as info:
        ns.begin_step()
    assert info.value.status == Status.STEP_ALREADY_OPEN
    data = grads(ns, 1)
    ns.write_grad("w", 0, data["w"])
    # An explicit step does not commit by itself, and refuses to commit while incomplete.
    with pytest.raises(DeviceError) as info:
        ns.commit_step()
    assert info.value.status == Status.GRADIENT_INCOMPLETE and "'b'" not in str(info.value)
    ns.write_grad("b", 0, data["b"])
    assert ns.committed_step == 0
    result = ns.commit_step()
    assert (result.step, result.skipped) == (1, False)
    assert ns.committed_step == 1


def test_abort_leaves_state_untouched(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    load(ns)
    run_steps(ns, range(1))
    before = snapshot(ns)
    ns.begin_step()
    ns.write_grad("w", 0, grads(ns, 9)["w"])
    assert ns.abort_step() == 2
    assert snapshot(ns) == before and ns.committed_step == 1
    with pytest.raises(DeviceError) as info:
        ns.commit_step()
    assert info.value.status == Status.NO_STEP_OPEN


def test_grad_scale_is_applied(backing: Path, tmp_path: Path) -> None:
    with Device.open(backing) as device:
        a = device.create_namespace(make_spec("a"))
        b = device.create_namespace(make_spec("b"))
        load(a)
        load(b)
        data = grads(a, 4)
        doubled = {k: (np.frombuffer(v, dtype=np.float16) * np.float16(2)).tobytes() for k, v in data.items()}
        a.begin_step(grad_scale=1.0)
        b.begin_step(grad_scale=0.5)
        for name in data:
            a.write_grad(name, 0, data[name])
            b.write_grad(name, 0, doubled[name])
        a.commit_step()
        b.commit_step()
        assert snapshot(a) == snapshot(b)


def test_nan_skips_step_and_is_counted(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    load(ns)
    run_steps(ns, range(1))
    before = snapshot(ns)
    ns.begin_step()
    for name, data in grads(ns, 5, poison=("w", BLOCK_ELEMS + 3)).items():
        ns.write_grad(name, 0, data)
    result = ns.commit_step()
    assert result.skipped and result.nonfinite_elements == 1 and result.committed_step == 1
    assert snapshot(ns) == before
    stats = ns.statistics()
    assert stats["steps_skipped"] == 1 and stats["last_skipped_step"] == 2
    assert stats["committed_step"] == 1


def test_nonfinite_counted_across_pieces_and_blocks(device: Device) -> None:
    """Non-finite elements are counted as the pieces arrive: one in each of three pieces of
    one block (one piece straddling into the next block, with another there), and a write
    refused as a duplicate counts nothing."""
    ns = device.create_namespace(make_spec())
    load(ns)
    before = snapshot(ns)
    ns.begin_step()
    data = grads(ns, 7)
    w = np.frombuffer(data["w"], dtype=np.float16).copy()
    for index in (10, 5000, BLOCK_ELEMS - 1, BLOCK_ELEMS + 2):
        w[index] = np.inf if index % 2 else np.nan
    raw = w.tobytes()
    cuts = [0, 4000, 9000, 2 * (BLOCK_ELEMS + 100), len(raw)]  # byte offsets, whole elements
    for start, end in zip(cuts, cuts[1:]):
        ns.write_grad("w", start, raw[start:end])
        if start == 4000:
            with pytest.raises(DeviceError):  # a duplicate of the piece just taken
                ns.write_grad("w", start, raw[start:end])
    for name, piece in data.items():
        if name != "w":
            ns.write_grad(name, 0, piece)
    result = ns.commit_step()
    assert result.skipped and result.nonfinite_elements == 4
    assert snapshot(ns) == before


def test_file_errors(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    cases = [
        (lambda: ns.write_grad("w", 1, b"\0\0"), Status.MISALIGNED_ACCESS, errno.EINVAL),
        (lambda: ns.write_grad("w", 0, b"\0\0\0"), Status.MISALIGNED_ACCESS, errno.EINVAL),
        (lambda: ns.write_grad("b", 14, b"\0\0"), Status.LBA_OUT_OF_RANGE, errno.EFBIG),
        (lambda: ns.write_grad("nope", 0, b"\0\0"), Status.INVALID_NAMESPACE, errno.ENOENT),
        (lambda: ns.write_state("b", "param", 0, b"\0\0"), Status.ACCESS_DENIED, errno.EACCES),
        (lambda: ns.write_state("b", "master", 2, b"\0\0\0\0"), Status.MISALIGNED_ACCESS, errno.EINVAL),
        (lambda: ns.read("b", "grad", 0, 2), Status.ACCESS_DENIED, errno.EACCES),
    ]
    for call, status, code in cases:
        with pytest.raises(DeviceError) as info:
            call()
        assert info.value.status == status and info.value.errno == code
    ns.write_grad("b", 0, b"\0\0" * 3)
    with pytest.raises(DeviceError) as info:
        ns.write_grad("b", 4, b"\0\0" * 2)  # overlaps element 2
    assert info.value.status == Status.GRADIENT_DUPLICATE and info.value.errno == errno.EEXIST
    ns.abort_step()
    with pytest.raises(DeviceError) as info:
        ns.write_state("b", "master", 0, b"\0\0\0\0")
    assert info.value.status == Status.STATE_SEALED and info.value.errno == errno.EROFS


@pytest.mark.parametrize("bad", [
    dict(name="../x"), dict(name="a/b"), dict(name="a\0b"), dict(name=""), dict(name="x" * 129),
    dict(name=".hidden"), dict(grad_dtype="fp8"), dict(state_dtype="fp64"),
    dict(hyper=Hyperparameters(lr=float("nan"))), dict(hyper=Hyperparameters(beta1=1.0)),
    dict(hyper=Hyperparameters(eps=0.0)), dict(hyper=Hyperparameters(mode="sgd")),
    dict(tensors=(TensorSpec("t", 0),)), dict(tensors=(TensorSpec("t", 1), TensorSpec("t", 2))),
    dict(tensors=(TensorSpec("t/..", 1),)), dict(tensors=()),
])
def test_invalid_namespace_specs_change_nothing(device: Device, bad: dict) -> None:
    fields = dict(name="ok", tensors=TENSORS) | bad
    with pytest.raises(DeviceError):
        device.create_namespace(NamespaceSpec(**fields))
    assert device.namespaces == {}
    assert sorted(os.listdir(device.path / "ns")) == []


def test_capacity_is_checked_before_allocation(backing: Path) -> None:
    with Device.open(backing) as device:
        spec = NamespaceSpec("huge", (TensorSpec("t", 1 << 31),))
        with pytest.raises(DeviceError) as info:
            device.create_namespace(spec)
        assert info.value.status == Status.NAMESPACE_INSUFFICIENT_CAPACITY
        assert info.value.errno == errno.ENOSPC
        assert list((device.path / "ns").iterdir()) == []


def test_delete_namespace(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    directory = ns.directory
    device.delete_namespace("opt")
    assert not directory.exists()
    with pytest.raises(DeviceError) as info:
        device.namespace("opt")
    assert info.value.status == Status.INVALID_NAMESPACE
    device.create_namespace(make_spec())  # the name is free again


def test_recovery_falls_back_when_newest_copy_is_corrupt(backing: Path) -> None:
    with Device.open(backing) as device:
        ns = device.create_namespace(make_spec())
        load(ns)
        run_steps(ns, range(2))
        step1_state_copy = ns._sb.committed_copy.other  # holds step 1
        run_steps(ns, range(2, 3))  # step 3 goes into the copy of step 1
        newest_copy = ns._sb.committed_copy
        assert newest_copy == step1_state_copy
    # Corrupt one byte of the newest copy's master: recovery must refuse it and serve step 2.
    path = backing / "ns" / "opt" / f"state.{newest_copy.name}"
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    with Device.open(backing) as device:
        ns = device.namespace("opt")
        assert ns.committed_step == 2
        assert ns.statistics()["checksum_failures"] == 1


def test_scrub_detects_corruption(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    load(ns)
    run_steps(ns, range(1))
    assert ns.scrub() == []
    copy = ns._sb.committed_copy
    view = ns._copies[copy].bytes
    view[ns.tensors["w"].exp_avg_offset + 4 * BLOCK_ELEMS + 8] ^= 0xFF
    assert ns.scrub() == [("w", 1)]


def test_plp_mode_flushes_one_step_behind(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    load(ns)
    run_steps(ns, range(1))
    # Acknowledged, but not yet flushed: the durable step is visible beside it.
    assert (ns.committed_step, ns.durable_step) == (1, 0)
    assert ns.flush_pending
    # The next step may not write over the copy of step 0 before step 1 is durable.
    ns.begin_step()
    assert ns.durable_step == 1
    ns.abort_step()
    assert ns.flush() == 1 and not ns.flush_pending


def test_sync_mode_flushes_every_commit(sync_device: Device) -> None:
    ns = sync_device.create_namespace(make_spec())
    load(ns)
    run_steps(ns, range(2))
    assert (ns.committed_step, ns.durable_step) == (2, 2)
    assert not ns.flush_pending


def test_bf16_moments(device: Device) -> None:
    ns = device.create_namespace(make_spec(state_dtype="bf16", param_dtype="bf16", grad_dtype="bf16"))
    load(ns)
    run_steps(ns, range(2))
    assert ns.file_size("w", "exp_avg") == 2 * ns.tensors["w"].numel
    assert ns.scrub() == []
    assert ns.committed_step == 2


def test_parallel_writers_match_serial(backing: Path) -> None:
    import threading

    with Device.open(backing) as device:
        serial = device.create_namespace(make_spec("serial"))
        parallel = device.create_namespace(make_spec("parallel"))
        load(serial)
        load(parallel)
        for seed in range(3):
            data = grads(serial, seed)
            for name, raw in data.items():
                serial.write_grad(name, 0, raw)
            pieces = [(name, off, raw[off:off + 65536]) for name, raw in data.items()
                      for off in range(0, len(raw), 65536)]
            threads = [threading.Thread(target=lambda part=pieces[i::2]: [parallel.write_grad(*p) for p in part])
                       for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert parallel.committed_step == seed + 1
        assert snapshot(serial) == snapshot(parallel)


def test_controller_answers_every_input(device: Device) -> None:
    """Random and hostile submissions: an errno-channel error or exactly one completion."""
    from hypothesis import HealthCheck, given, settings, strategies as st

    from cossd.emulator.controller import Controller
    from cossd.protocol.entries import SUBMISSION, Opcode, SubmissionError, encode_submission

    controller = Controller(device)
    device.create_namespace(make_spec())

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        opcode=st.integers(0, 255),
        nsid=st.sampled_from([0, 1, 2, 0xFFFFFFFF]),
        cdws=st.lists(st.integers(0, 0xFFFFFFFF), min_size=6, max_size=6),
        payload=st.one_of(st.binary(max_size=64), st.just(b'{"name": "x", "tensors": [["t", -1]]}'),
                          st.just(b'{"lr": "fast"}'), st.just(b"[]")),
        garbage=st.binary(min_size=0, max_size=80),
        use_garbage=st.booleans(),
    )
    def check(opcode, nsid, cdws, payload, garbage, use_garbage):  # type: ignore[no-untyped-def]
        if opcode in (0xC2,):  # keep the namespace for later examples
            return
        raw = garbage if use_garbage else encode_submission(
            opcode, nsid=nsid, cdw10=cdws[0], cdw11=cdws[1], cdw12=cdws[2], cdw13=cdws[3],
            cdw14=cdws[4], cdw15=cdws[5], payload=payload)
        try:
            completion = controller.submit(raw)
        except SubmissionError:
            assert use_garbage or len(raw) < SUBMISSION.itemsize
            return
        assert isinstance(completion.status, Status)
        # The standard face's admin opcodes (85h, 88h, 89h) are the controller's too.
        if opcode not in {int(o) for o in Opcode} | {int(o) for o in CpAdminOpcode} and not use_garbage:
            assert completion.status == Status.INVALID_OPCODE
        assert completion.status != Status.INTERNAL_ERROR, completion.data
        ns = device.namespaces.get("opt")
        if ns is not None and ns.step_open is not None:
            ns.abort_step()

    check()
    assert device.namespace("opt").committed_step == 0


def test_out_of_float32_range_values_are_refused_before_any_change(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    load(ns)
    with pytest.raises(DeviceError) as info:
        ns.begin_step(grad_scale=1e39)
    assert info.value.status == Status.INVALID_FIELD
    assert ns.loading and ns.step_open is None  # not sealed, nothing opened
    with pytest.raises(DeviceError) as info:
        ns.set_hyperparameters(lr=1e39)
    assert info.value.status == Status.INVALID_FIELD
    with pytest.raises(DeviceError) as info:
        ns.set_hyperparameters(momentum=0.9)
    assert info.value.status == Status.INVALID_FIELD
    assert ns.set_hyperparameters(lr=0.5).lr == 0.5
    run_steps(ns, range(1))
    assert ns.committed_step == 1


def test_damaged_namespace_is_isolated_and_deletable(backing: Path) -> None:
    from cossd.emulator.controller import Controller
    from cossd.protocol.entries import Opcode, encode_submission

    with Device.open(backing) as device:
        for name in ("good", "bad"):
            load(device.create_namespace(make_spec(name)))
    (backing / "ns" / "bad" / "meta.json").unlink()
    with Device.open(backing) as device:
        assert list(device.namespaces) == ["good"]
        assert "bad" in device.failed_namespaces
        with pytest.raises(DeviceError) as info:
            device.namespace("bad")
        assert info.value.status == Status.UNRECOVERED_READ_ERROR
        completion = Controller(device).submit(encode_submission(Opcode.DELETE_NAMESPACE, nsid=2))
        assert completion.status == Status.SUCCESS
        assert device.failed_namespaces == {}
        device.create_namespace(make_spec("bad"))  # the name is usable again


def test_groups_update_each_tensor_with_its_own_hyperparameters(backing: Path) -> None:
    """Two groups in one namespace give what two one-group namespaces give, bit for bit."""
    tensors = (TensorSpec("w", 300, group=0), TensorSpec("b", 7, group=1))
    a, b = Hyperparameters(lr=1e-2, weight_decay=0.1), Hyperparameters(lr=3e-3, weight_decay=0.0)
    with Device.open(backing) as device:
        grouped = device.create_namespace(NamespaceSpec("grouped", tensors, hyper=a, groups=(a, b)))
        only_w = device.create_namespace(NamespaceSpec("w", (TensorSpec("w", 300),), hyper=a))
        only_b = device.create_namespace(NamespaceSpec("b", (TensorSpec("b", 7),), hyper=b))
        rng = np.random.default_rng(3)
        initial = {"w": rng.standard_normal(300, dtype=np.float32), "b": rng.standard_normal(7, dtype=np.float32)}
        for ns, names in ((grouped, ("w", "b")), (only_w, ("w",)), (only_b, ("b",))):
            for name in names:
                ns.write_state(name, "master", 0, initial[name].tobytes())
        for step in range(1, 4):
            if step == 3:  # a schedule: group 1's lr changes, on its own
                grouped.set_hyperparameters(group=1, lr=1e-3)
                only_b.set_hyperparameters(lr=1e-3)
            grad = {n: (rng.standard_normal(len(v)) * 0.1).astype(np.float16).tobytes() for n, v in initial.items()}
            for ns, names in ((grouped, ("w", "b")), (only_w, ("w",)), (only_b, ("b",))):
                for name in names:
                    ns.write_grad(name, 0, grad[name])
        assert grouped.read("w", "master", 0, 1 << 20) == only_w.read("w", "master", 0, 1 << 20)
        assert grouped.read("b", "master", 0, 1 << 20) == only_b.read("b", "master", 0, 1 << 20)
        assert [h.lr for h in grouped.hypers] == [1e-2, 1e-3]
        with pytest.raises(DeviceError) as info:
            grouped.set_hyperparameters(group=2, lr=0.1)
        assert info.value.status == Status.INVALID_FIELD
        with pytest.raises(DeviceError):
            grouped.set_hyperparameters(mode="adam")
    # The per-group values are recorded with the committed step and survive a restart.
    with Device.open(backing) as device:
        grouped = device.namespace("grouped")
        assert [h.lr for h in grouped.hypers] == [1e-2, 1e-3]
        assert [h.weight_decay for h in grouped.hypers] == [0.1, 0.0]
        assert [t["group"] for t in grouped.config()["tensors"]] == [0, 1]


def test_group_and_initial_step_fields_are_validated() -> None:
    base = {"name": "x", "tensors": [["w", 4, 1]], "hyperparameters": {"lr": 0.1}}
    spec = NamespaceSpec.from_json(base | {"groups": [{}, {"lr": 0.5, "weight_decay": 0.0}], "initial_step": 7})
    assert [g.lr for g in spec.group_hypers] == [0.1, 0.5] and spec.initial_step == 7
    assert NamespaceSpec.from_json(spec.to_json()) == spec
    for bad in ({"groups": [{}]},                      # tensor names group 1 of one
                {"groups": [{}, {"mode": "adam"}]},    # groups must share the mode
                {"groups": "fast"},
                {"groups": [{}, {"lr": -1.0}]},
                {"groups": [{}, {}], "initial_step": -1},
                {"groups": [{}, {}], "initial_step": True}):
        with pytest.raises(DeviceError) as info:
            NamespaceSpec.from_json(base | bad)
        assert info.value.status == Status.INVALID_FIELD, bad


def test_initial_step_continues_the_step_count(device: Device) -> None:
    ns = device.create_namespace(make_spec(initial_step=41))
    load(ns)
    assert ns.committed_step == 41 and ns.loading
    with pytest.raises(DeviceError) as info:
        ns.begin_step(1)
    assert info.value.status == Status.STEP_NUMBER_MISMATCH
    run_steps(ns, range(1))
    assert ns.committed_step == 42


# ------------------------------------------------------------------ how new state reaches the shadow copy


def test_write_mode_follows_the_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores straight into the mapping where the filesystem never write-protects a page
    (tmpfs), pwrite elsewhere; COSSD_STATE_WRITES forces either, and refuses anything else."""
    from cossd.emulator import media

    def mode_of(directory: Path) -> str:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return media.write_mode_for(fd)
        finally:
            os.close(fd)

    monkeypatch.delenv("COSSD_STATE_WRITES", raising=False)
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        assert mode_of(Path("/dev/shm")) == "mapped"
    with open("/proc/mounts") as mounts:
        kinds = {line.split()[1]: line.split()[2] for line in mounts}
    mount = max((m for m in kinds if str(tmp_path.resolve()).startswith(m)), key=len)
    assert mode_of(tmp_path) == ("mapped" if kinds[mount] in ("tmpfs", "ramfs") else "pwrite")
    for forced in ("mapped", "pwrite"):
        monkeypatch.setenv("COSSD_STATE_WRITES", forced)
        assert mode_of(tmp_path) == forced
    monkeypatch.setenv("COSSD_STATE_WRITES", "mmap-please")
    with pytest.raises(ValueError, match="COSSD_STATE_WRITES"):
        mode_of(tmp_path)


def test_both_write_modes_give_the_same_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapped and pwrite shadow writes: identical state, checksums that scrub and reopen
    accept, and a skipped (NaN) step that changes nothing, in either mode."""
    results = {}
    for mode in ("mapped", "pwrite"):
        monkeypatch.setenv("COSSD_STATE_WRITES", mode)
        backing = tmp_path / mode
        Device.format(backing)
        with Device.open(backing) as device:
            ns = device.create_namespace(make_spec())
            assert all(copy.write_mode == mode for copy in ns._copies)
            assert ns.statistics()["state_writes"] == mode  # shown in log page C0h
            load(ns)
            run_steps(ns, range(3))
            before = snapshot(ns)
            for name, data in grads(ns, 99, poison=("w", 17)).items():
                ns.write_grad(name, 0, data)
            assert ns.counters.steps_skipped == 1 and snapshot(ns) == before
            run_steps(ns, range(3, 5))
            assert ns.scrub() == []
            results[mode] = snapshot(ns)
        with Device.open(backing) as device:
            ns = device.namespace("opt")
            assert ns.committed_step == 5 and snapshot(ns) == results[mode] and ns.scrub() == []
    assert results["mapped"] == results["pwrite"]


# ------------------------------------------------------------------ the fs layer's non-blocking calls


def test_nowait_calls_match_the_blocking_ones(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    load(ns)
    run_steps(ns, range(1))
    for role in ("param", "master", "exp_avg"):
        for offset, size in ((0, 100), (6, 1 << 20), (ns.file_size("w", role) - 4, 64), (1 << 40, 8)):
            view = ns.read_nowait("w", role, offset, size)
            assert view is not None and bytes(view) == ns.read("w", role, offset, size)
    with pytest.raises(DeviceError):
        ns.read_nowait("w", "grad", 0, 8)
    data = grads(ns, 7)
    # No step open: the begin may wait for a flush, so it is left to a thread.
    assert ns.write_grad_nowait("w", 0, data["w"]) is None
    ns.begin_step()
    assert ns.write_grad_nowait("w", 0, data["w"]) == (len(data["w"]), None)  # explicit: no implicit commit
    assert ns.write_grad_nowait("b", 0, data["b"]) == (len(data["b"]), None)
    assert ns.commit_step().step == 2
    ns.write_grad("w", 0, data["w"])  # opens implicit step 3
    length, implicit = ns.write_grad_nowait("b", 0, data["b"])
    assert length == len(data["b"]) and implicit is not None and ns.committed_step == 2
    ns.finish_implicit_step(implicit)
    assert ns.committed_step == 3 and ns.step_open is None


def test_nowait_calls_step_aside_when_they_would_block(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    load(ns)
    run_steps(ns, range(1))
    ns.begin_step()
    data = grads(ns, 3)
    with ns._lock:  # held by another thread, as across a flush
        assert ns.read_nowait("w", "param", 0, 64) is None
        assert ns.write_grad_nowait("w", 0, data["w"]) is None
    ns.timing.timed = True  # timed mode sleeps to the model: never on the event loop
    try:
        assert ns.read_nowait("w", "param", 0, 64) is None
        assert ns.write_grad_nowait("w", 0, data["w"]) is None
    finally:
        ns.timing.timed = False
    # Nothing was taken by the refused calls: the whole gradient is still missing.
    assert ns.counters.grad_bytes_in == sum(len(d) for d in grads(ns, 0).values())
    ns.abort_step()


def test_a_writer_faster_than_the_kernels_waits_instead_of_queuing_without_bound(device: Device) -> None:
    """Gradient writes (not lent memory) queue at most max_queued_blocks blocks for the
    kernels, each holding a copy of its bytes: with the kernels held, a writer of more blocks
    waits at the bound (counted) and goes on as they run; the step ends as unbounded would."""
    import threading

    blocks = 12
    ns = device.create_namespace(NamespaceSpec(name="queue", tensors=(TensorSpec("w", blocks * BLOCK_ELEMS),)))
    ns.max_queued_blocks = 4
    held = threading.Event()
    run = ns.writes._run_blocks_in_background
    most = [0]

    def held_blocks(tx, blocks):  # type: ignore[no-untyped-def]
        most[0] = max(most[0], tx.inflight)
        held.wait(60)
        run(tx, blocks)

    ns.writes._run_blocks_in_background = held_blocks  # type: ignore[method-assign]
    grads = (np.random.default_rng(9).standard_normal(blocks * BLOCK_ELEMS) * 0.01).astype(np.float16).tobytes()
    begun = ns.begin_step()
    writer = threading.Thread(target=lambda: [ns.write_grad("w", 2 * BLOCK_ELEMS * b, grads[2 * BLOCK_ELEMS * b:
                                                                                            2 * BLOCK_ELEMS * (b + 1)])
                                              for b in range(blocks)])
    writer.start()
    for _ in range(600):  # bounded: the writer reaches the bound and waits there
        if ns.counters.grad_writes_waited:
            break
        threading.Event().wait(0.01)
    assert ns.counters.grad_writes_waited == 1 and ns._tx is not None and ns._tx.inflight == 4
    held.set()
    writer.join(60)
    assert not writer.is_alive()
    assert ns.commit_step().committed_step == begun and most[0] <= 4
    # The same step, unbounded, on a second namespace: the same state.
    other = device.create_namespace(NamespaceSpec(name="free", tensors=(TensorSpec("w", blocks * BLOCK_ELEMS),)))
    other.begin_step()
    other.write_grad("w", 0, grads)
    other.commit_step()
    for role in ("master", "exp_avg", "exp_avg_sq", "param"):
        assert ns.read("w", role, 0, 1 << 40) == other.read("w", role, 0, 1 << 40)
