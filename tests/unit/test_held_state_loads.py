"""Initial state loads on the device: block-scaled moments cut anywhere (whole elements) load as one write does, parts of scale blocks are held and never used, and values no step can start from are refused, changing nothing."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.emulator.namespace.held_loads import HeldLoads

SCALED = ("fp16", "int8")
W = 3 * BLOCK_ELEMS + 300  # several kernel blocks and a short last scale block
TENSORS = (TensorSpec("w", W), TensorSpec("b", 7))


def make(device: Device, state_dtype: str, name: str = "q"):  # type: ignore[no-untyped-def]
    return device.create_namespace(NamespaceSpec(name=name, tensors=TENSORS, state_dtype=state_dtype))


def moments(seed: int, numel: int = W) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    decades = 10.0 ** rng.integers(-8, 0, numel)
    return {"exp_avg": (rng.standard_normal(numel) * decades).astype(np.float32),
            "exp_avg_sq": (np.abs(rng.standard_normal(numel)) * decades ** 2).astype(np.float32)}


def load_all(ns, values: dict[str, np.ndarray], cuts: list[int], reverse: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Each moment written in requests cut at byte offsets `cuts` (whole elements)."""
    for role, x in values.items():
        raw = x.tobytes()
        edges = [0, *cuts, len(raw)]
        pieces = [(a, raw[a:b]) for a, b in zip(edges, edges[1:])]
        for offset, piece in reversed(pieces) if reverse else pieces:
            assert ns.write_state("w", role, offset, piece) == len(piece)


def state_of(ns) -> dict[str, bytes]:  # type: ignore[no-untyped-def]
    return {f"{t}/{r}": ns.read(t, r, 0, 1 << 40) for t in ("w", "b") for r in ("master", "exp_avg", "exp_avg_sq")}


# The cuts the kernel makes of a 1 MiB-request mount's write() from a buffer 16 bytes into its
# page (1 MiB - 16, then every 1 MiB), and stranger ones: mid-block, a block's last element
# alone, two cuts inside one block.
CUTS = [[BLOCK_ELEMS * 4 - 16, 2 * BLOCK_ELEMS * 4 - 16], [4, 1020, 1024, 1028, 5000], [2044, 2048, 2052]]


@pytest.mark.parametrize("state_dtype", SCALED)
@pytest.mark.parametrize("cuts", CUTS)
@pytest.mark.parametrize("reverse", [False, True])
def test_a_whole_block_load_cut_anywhere_equals_one_write(device: Device, state_dtype: str, cuts: list[int],
                                                          reverse: bool) -> None:
    whole, cut = make(device, state_dtype, "whole"), make(device, state_dtype, "cut")
    values = moments(1)
    load_all(whole, values, [])
    load_all(cut, values, cuts, reverse)
    assert state_of(cut) == state_of(whole)
    assert len(cut.core.held_loads) == 0
    assert cut.begin_step() == whole.begin_step() == 1


@pytest.mark.parametrize("state_dtype", SCALED)
def test_a_part_never_completed_is_never_used_and_the_first_step_is_refused(device: Device, state_dtype: str) -> None:
    ns = make(device, state_dtype)
    values = moments(2)
    load_all(ns, values, [])  # every block whole
    before, seq = state_of(ns), ns.seq
    # The first 300 elements of new values, then of block 1 all but its last element.
    ns.write_state("w", "exp_avg", 0, (values["exp_avg"][:300] * 3).tobytes())
    ns.write_state("w", "exp_avg", 4 * 256, (values["exp_avg"][256:511] * 5).tobytes())
    assert len(ns.core.held_loads) == 1  # block 0 was whole and encoded; of block 1 elements 256..510 held
    after = state_of(ns)
    decoded = np.frombuffer(after["w/exp_avg"], np.float32)
    assert after["w/exp_avg_sq"] == before["w/exp_avg_sq"]
    # Block 0 was written whole (new values); blocks 1 and beyond are as loaded before.
    assert after["w/exp_avg"][4 * 256:] == before["w/exp_avg"][4 * 256:]
    assert not np.array_equal(decoded[:256], np.frombuffer(before["w/exp_avg"], np.float32)[:256])
    for _attempt in range(2):
        with pytest.raises(DeviceError) as caught:
            ns.begin_step()
        assert caught.value.status == Status.MISALIGNED_ACCESS
        assert "w/exp_avg elements 256..511" in str(caught.value) and "element 511" in str(caught.value)
        assert ns.loading and ns.seq == seq and state_of(ns) == after and ns.step_open is None
    # The missing element completes block 1: encoded from what was held (x5), then x5 values.
    ns.write_state("w", "exp_avg", 4 * 511, (values["exp_avg"][511:512] * 5).tobytes())
    assert len(ns.core.held_loads) == 0
    reference = make(device, state_dtype, "ref")
    x = values["exp_avg"].copy()
    x[:256] *= 3
    x[256:512] *= 5
    load_all(reference, {"exp_avg": x, "exp_avg_sq": values["exp_avg_sq"]}, [])
    assert state_of(ns)["w/exp_avg"] == state_of(reference)["w/exp_avg"]
    assert ns.begin_step() == 1


@pytest.mark.parametrize("state_dtype", SCALED)
def test_a_whole_block_write_replaces_what_was_held(device: Device, state_dtype: str) -> None:
    ns = make(device, state_dtype)
    values = moments(3)
    ns.write_state("w", "exp_avg_sq", 4 * 300, np.ones(100, np.float32).tobytes())  # part of block 1
    assert len(ns.core.held_loads) == 1
    load_all(ns, values, [])
    assert len(ns.core.held_loads) == 0
    reference = make(device, state_dtype, "ref")
    load_all(reference, values, [])
    assert state_of(ns) == state_of(reference)
    assert ns.begin_step() == 1


def test_holding_is_bounded_and_its_refusal_changes_nothing(device: Device) -> None:
    ns = make(device, "int8")
    ns.core.held_loads.max_blocks = 2
    ns.write_state("w", "exp_avg", 4, bytes(8))
    ns.write_state("w", "exp_avg", 4 * 257, bytes(8))
    before = state_of(ns)
    with pytest.raises(DeviceError) as caught:
        ns.write_state("w", "exp_avg", 4 * 511, bytes(8))  # parts of blocks 1 (held) and 2 (new)
    assert caught.value.status == Status.MISALIGNED_ACCESS and "at most 2" in str(caught.value)
    with pytest.raises(DeviceError):
        ns.check_write("w", "exp_avg", 4 * 511, 8)
    assert state_of(ns) == before and len(ns.core.held_loads) == 2
    ns.write_state("w", "exp_avg", 4 * 260, bytes(4))  # another part of a held block: taken


def test_a_batch_over_the_bound_is_refused_before_any_of_it_is_taken(device: Device) -> None:
    """A CMB_WRITE of two state transfers, each leaving a new block in part, with room for
    one more: the two are counted together before either is taken (the second was refused
    after the first was written). The same for a server WRITE's ranges."""
    from cossd.emulator.controller import Controller
    from cossd.client import AdminClient
    from cossd.server.paths import OpenFile
    from cossd.server.writes import _check_singles
    from helpers import InProcessTransport

    ns = make(device, "int8")
    ns.core.held_loads.max_blocks = 2
    ns.write_state("w", "exp_avg", 4, bytes(8))  # block 0 held in part
    before = state_of(ns)
    controller = Controller(device, 1 << 20)
    try:
        admin = AdminClient(InProcessTransport(controller))  # type: ignore[arg-type]
        controller.cmb.array[:16] = np.ones(4, np.float32).view(np.uint8)
        transfers = [{"tensor": "w", "role": "exp_avg", "offset": 4 * 257, "length": 8, "cmb_offset": 0},
                     {"tensor": "w", "role": "exp_avg", "offset": 4 * 513, "length": 8, "cmb_offset": 8}]
        with pytest.raises(DeviceError) as caught:
            admin.cmb_write(admin.nsid("q"), transfers)
        assert caught.value.status == Status.MISALIGNED_ACCESS and "at most 2" in str(caught.value)
        assert state_of(ns) == before and len(ns.core.held_loads) == 1
        admin.cmb_write(admin.nsid("q"), transfers[:1])  # one of them alone: taken
        assert len(ns.core.held_loads) == 2
    finally:
        controller.close()
    ns.core.held_loads.max_blocks = 3
    opened = OpenFile(nsid=0, tensor="w", role="exp_avg", writing=True, size=W * 4, path="ns/q/tensors/w/exp_avg")
    ones = memoryview(np.ones(2, np.float32).tobytes())
    with pytest.raises(DeviceError, match="at most 3"):
        _check_singles([(opened, ns, 4 * 769, ones), (opened, ns, 4 * 1025, ones)])  # type: ignore[list-item]
    _check_singles([(opened, ns, 4 * 769, ones)])  # type: ignore[list-item]


def test_split() -> None:
    held = HeldLoads()
    assert held.split(1000, 0, 1000) == ((0, 1000), [])
    assert held.split(1000, 10, 20) == ((10, 10), [(0, 10, 20)])
    assert held.split(1000, 10, 600) == ((256, 512), [(0, 10, 256), (2, 512, 600)])
    assert held.split(100, 10, 100) == ((10, 10), [(0, 10, 100)])
    assert held.split(1000, 768, 1000) == ((768, 1000), [])


# ------------------------------------------------------------------ values no step can start from

BAD = [("master", np.nan), ("master", np.inf), ("exp_avg", -np.inf), ("exp_avg", np.nan),
       ("exp_avg_sq", -1.0), ("exp_avg_sq", -1e-30), ("exp_avg_sq", np.nan), ("exp_avg_sq", np.inf)]


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "fp16", "int8"])
@pytest.mark.parametrize("role,bad", BAD)
def test_impossible_initial_state_is_refused_and_changes_nothing(device: Device, state_dtype: str, role: str,
                                                                 bad: float) -> None:
    ns = make(device, state_dtype)
    good = moments(4)
    good["master"] = np.random.default_rng(4).standard_normal(W).astype(np.float32)
    for r, x in good.items():
        ns.write_state("w", r, 0, (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
                       if state_dtype == "bf16" and r != "master" else x.tobytes())
    before = state_of(ns) | {"param": ns.read("w", "param", 0, 1 << 40)}
    values = good[role].copy()
    values[700] = bad
    raw = values.tobytes()
    if state_dtype == "bf16" and role != "master":
        raw = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    with pytest.raises(DeviceError) as caught:
        ns.write_state("w", role, 0, raw)
    assert caught.value.status == Status.INVALID_FIELD
    message = str(caught.value)
    assert f"w/{role}" in message and "element 700" in message and "nothing was written" in message
    assert (state_of(ns) | {"param": ns.read("w", "param", 0, 1 << 40)}) == before
    assert len(ns.core.held_loads) == 0


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "int8"])
def test_negative_zero_exp_avg_sq_is_taken(device: Device, state_dtype: str) -> None:
    ns = make(device, state_dtype)
    zeros = np.full(W, -0.0, np.float32)
    raw = (zeros.view(np.uint32) >> 16).astype(np.uint16).tobytes() if state_dtype == "bf16" else zeros.tobytes()
    assert ns.write_state("w", "exp_avg_sq", 0, raw) == len(raw)


def test_refused_values_never_reach_a_step(device: Device) -> None:
    """The reviewer's case: exp_avg_sq -1 loaded, then finite gradients: step 1 was NaN."""
    ns = make(device, "fp32")
    ns.write_state("w", "master", 0, np.ones(W, np.float32).tobytes())
    with pytest.raises(DeviceError):
        ns.write_state("w", "exp_avg_sq", 0, np.full(W, -1.0, np.float32).tobytes())
    ns.write_grad("w", 0, np.full(W, 0.01, np.float16).tobytes())
    ns.write_grad("b", 0, np.full(7, 0.01, np.float16).tobytes())
    assert ns.committed_step == 1 and ns.statistics()["steps_skipped"] == 0
    assert np.isfinite(np.frombuffer(ns.read("w", "master", 0, 1 << 40), np.float32)).all()


def test_the_held_list_on_the_media_never_names_fewer_blocks_than_are_held(
        device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """held_loads.json names at least every block held: where it cannot be written before a
    request's part is held, the request is refused and nothing changes; where it cannot be
    brought down after a block is whole, it keeps naming that block (only a refusal more after
    a restart), and the block is encoded and no longer held; the next change brings it down
    (tests/mount/test_state_load_cuts.py: a daemon killed or unmounted with blocks held).)"""
    from cossd.emulator.namespace import held_loads

    ns = make(device, "int8")
    marker = ns.core.directory / held_loads.HELD_FILE
    values = moments(3)
    load_all(ns, values, [])
    before = state_of(ns)
    real = held_loads.atomic_write_json

    def full(path, value):  # type: ignore[no-untyped-def]
        raise DeviceError(Status.CAPACITY_EXCEEDED, "no space left (injected)")

    monkeypatch.setattr(held_loads, "atomic_write_json", full)
    with pytest.raises(DeviceError) as caught:
        ns.write_state("w", "exp_avg", 0, (values["exp_avg"][:300] * 3).tobytes())  # block 0 whole, part of 1
    assert caught.value.status == Status.CAPACITY_EXCEEDED
    assert len(ns.core.held_loads) == 0 and state_of(ns) == before and not marker.exists()
    monkeypatch.setattr(held_loads, "atomic_write_json", real)
    ns.write_state("w", "exp_avg", 4 * 256, (values["exp_avg"][256:511] * 5).tobytes())
    assert len(ns.core.held_loads) == 1 and marker.exists()

    def unlink_fails(self, missing_ok=False):  # type: ignore[no-untyped-def]
        raise OSError(5, "Input/output error (injected)")

    monkeypatch.setattr(type(marker), "unlink", unlink_fails)
    ns.write_state("w", "exp_avg", 4 * 511, (values["exp_avg"][511:512] * 5).tobytes())  # block 1 whole
    monkeypatch.undo()
    assert len(ns.core.held_loads) == 0 and marker.exists()  # a stale listing, never a short one
    x = values["exp_avg"].copy()
    x[256:512] *= 5
    assert np.array_equal(np.frombuffer(state_of(ns)["w/exp_avg"], np.float32)[256:512],
                          np.frombuffer(encoded_like(device, x), np.float32)[256:512])
    ns.write_state("w", "exp_avg", 4 * 600, (values["exp_avg"][600:700]).tobytes())  # a part of block 2
    assert sorted(map(tuple, json.loads(marker.read_text()))) == [("w", "exp_avg", 2)]  # brought down again


def encoded_like(device: Device, exp_avg: np.ndarray) -> bytes:
    """exp_avg loaded whole into a fresh int8 namespace, read back."""
    ref = make(device, "int8", "ref-enc")
    ref.write_state("w", "exp_avg", 0, exp_avg.tobytes())
    return ref.read("w", "exp_avg", 0, 1 << 40)
