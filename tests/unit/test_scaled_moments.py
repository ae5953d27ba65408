"""Namespaces with block-scaled moments (state_dtype fp16, int8): steps equal the kernel reference bit for bit, remount, loads, torn scales."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cossd import kernels as k
from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.emulator.layout import BLOCK_ELEMS, Copy, region_offset
from cossd.emulator.namespace import Namespace
from cossd.emulator.spec import STATE_FORMATS

# Two kernel blocks and a part (so a block boundary and a partial scale block), and a tensor
# smaller than one scale block.
TENSORS = (TensorSpec("w", BLOCK_ELEMS * 2 + 300), TensorSpec("b", 7))
HYPER = k.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, mode="adamw")
SCALED = ("fp16", "int8")
MOMENTS = {"exp_avg": k.Moment.EXP_AVG, "exp_avg_sq": k.Moment.EXP_AVG_SQ}


def make_spec(state_dtype: str, name: str = "q") -> NamespaceSpec:
    return NamespaceSpec(name=name, tensors=TENSORS, state_dtype=state_dtype)


def masters(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.numel, dtype=np.float32) for t in TENSORS}


def grads(seed: int) -> dict[str, np.ndarray]:
    """Gradients over several decades, so the blocks' scales differ."""
    rng = np.random.default_rng(100 + seed)
    out = {}
    for t in TENSORS:
        decades = 10.0 ** rng.integers(-6, 0, t.numel)
        out[t.name] = (rng.standard_normal(t.numel) * decades).astype(np.float16)
    return out


def reference(state_dtype: str, steps: int) -> dict[str, dict[str, np.ndarray]]:
    """The same steps through the kernel alone, in place over each whole tensor (adam_step_q)."""
    sfmt = STATE_FORMATS[state_dtype]
    code = np.uint16 if state_dtype == "fp16" else np.uint8
    out = {}
    for t in TENSORS:
        n = t.numel
        st = {"master": masters()[t.name].copy(), "exp_avg": np.zeros(n, code), "exp_avg_sq": np.zeros(n, code),
              "exp_avg_scale": np.zeros(k.state_scale_count(n), np.float32),
              "exp_avg_sq_scale": np.zeros(k.state_scale_count(n), np.float32), "param": np.zeros(n, np.uint16)}
        for step in range(steps):
            k.adam_step_q(grads(step)[t.name], st["master"], st["exp_avg"], st["exp_avg_sq"], st["master"],
                          st["exp_avg"], st["exp_avg_sq"], st["param"], exp_avg_scale_in=st["exp_avg_scale"],
                          exp_avg_sq_scale_in=st["exp_avg_sq_scale"], exp_avg_scale_out=st["exp_avg_scale"],
                          exp_avg_sq_scale_out=st["exp_avg_sq_scale"], grad_format=k.HalfFormat.FP16,
                          param_format=k.HalfFormat.FP16, state_format=sfmt,
                          scalars=k.adam_scalars(HYPER, step + 1))
        out[t.name] = st
    return out


def load_and_step(ns: Namespace, steps: range) -> None:
    if ns.loading:
        for name, master in masters().items():
            ns.write_state(name, "master", 0, master.tobytes())
    for step in steps:
        for name, grad in grads(step).items():
            ns.write_grad(name, 0, grad.tobytes())


def assert_equals_reference(ns: Namespace, ref: dict[str, dict[str, np.ndarray]], state_dtype: str) -> None:
    sfmt = STATE_FORMATS[state_dtype]
    copy = ns._sb.committed_copy
    for t in ns.layouts:
        st = ref[t.name]
        for role in ("master", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "param"):
            # The media itself: codes and scales bit for bit.
            assert ns._view(copy, t, role).tobytes() == st[role].tobytes(), (t.name, role)
        for role, moment in MOMENTS.items():
            # The mount tree's file: the moments decoded to FP32.
            decoded = np.empty(t.numel, np.float32)
            k.decode_state(st[role], st[role + "_scale"], decoded, state_format=sfmt, moment=moment)
            assert ns.file_size(t.name, role) == 4 * t.numel
            assert ns.read(t.name, role, 0, 1 << 40) == decoded.tobytes()
            # A read that starts and ends inside elements and scale blocks.
            assert ns.read(t.name, role, 1030, 2001) == decoded.tobytes()[1030:3031]
        assert ns.read(t.name, "master", 0, 1 << 40) == st["master"].tobytes()


@pytest.mark.parametrize("writes", ["pwrite", "mapped"])
@pytest.mark.parametrize("state_dtype", SCALED)
def test_steps_equal_the_kernel_reference_and_survive_remount(backing: Path, state_dtype: str, writes: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways new state reaches the shadow copy (emulator/media.py write_mode_for)."""
    monkeypatch.setenv("COSSD_STATE_WRITES", writes)
    with Device.open(backing) as device:
        ns = device.create_namespace(make_spec(state_dtype))
        assert ns.statistics()["state_writes"] == writes
        load_and_step(ns, range(3))
        assert ns.committed_step == 3
        assert ns.config()["state_dtype"] == state_dtype
        assert_equals_reference(ns, reference(state_dtype, 3), state_dtype)
        assert ns.scrub() == []
    with Device.open(backing) as device:
        ns = device.namespace("q")
        assert ns.committed_step == 3
        assert ns.scrub() == []
        assert_equals_reference(ns, reference(state_dtype, 3), state_dtype)
        load_and_step(ns, range(3, 5))
        assert_equals_reference(ns, reference(state_dtype, 5), state_dtype)


@pytest.mark.parametrize("state_dtype", SCALED)
def test_the_moments_take_fewer_bytes_on_the_media(device: Device, state_dtype: str) -> None:
    fp32 = device.create_namespace(make_spec("fp32", "full"))
    scaled = device.create_namespace(make_spec(state_dtype))
    w_full, w = fp32.tensors["w"], scaled.tensors["w"]
    code_bytes = 2 if state_dtype == "fp16" else 1
    assert w.exp_avg_scale_offset - w.exp_avg_offset == -(-w.numel * code_bytes // 4096) * 4096
    assert w.exp_avg_sq_offset - w.exp_avg_scale_offset == -(-k.state_scale_count(w.numel) * 4 // 4096) * 4096
    assert scaled.allocated_bytes < fp32.allocated_bytes
    assert w_full.exp_avg_scale_offset == -1


@pytest.mark.parametrize("state_dtype", SCALED)
def test_loaded_moments_are_encoded_as_a_step_encodes(device: Device, state_dtype: str) -> None:
    ns = device.create_namespace(make_spec(state_dtype))
    t = ns.tensors["w"]
    rng = np.random.default_rng(5)
    values = {"exp_avg": rng.standard_normal(t.numel, dtype=np.float32) * 1e-3,
              "exp_avg_sq": np.abs(rng.standard_normal(t.numel, dtype=np.float32)) * 1e-6}
    for role, x in values.items():
        # In pieces of whole 256-element blocks, the last one ending at the file's end.
        ns.write_state("w", role, 0, x[:1024].tobytes())
        ns.write_state("w", role, 4096, x[1024:].tobytes())
        codes = np.zeros(t.numel, ns._view(Copy.A, t, role).dtype)
        scales = np.zeros(k.state_scale_count(t.numel), np.float32)
        k.encode_state(x, codes, scales, state_format=STATE_FORMATS[state_dtype], moment=MOMENTS[role])
        decoded = np.empty(t.numel, np.float32)
        k.decode_state(codes, scales, decoded, state_format=STATE_FORMATS[state_dtype], moment=MOMENTS[role])
        assert ns.read("w", role, 0, 1 << 40) == decoded.tobytes()


@pytest.mark.parametrize("state_dtype", SCALED)
def test_a_load_inside_a_scale_block_is_held_and_the_first_step_refused(device: Device, state_dtype: str) -> None:
    """A request of whole elements covering part of a scale block is taken and held (the
    kernel cuts a writer's whole-block write() anywhere), never read or stepped: the first
    step's begin is refused, changing nothing, until each such block is whole
    (tests/unit/test_held_state_loads.py has the rest)."""
    ns = device.create_namespace(make_spec(state_dtype))
    before = ns.read("w", "exp_avg", 0, 1 << 40)
    for offset, length in ((4, 1024), (0, 1020), (1024, 4)):
        ns.check_write("w", "exp_avg", offset, length)
        assert ns.write_state("w", "exp_avg", offset, bytes(length)) == length
    assert ns.read("w", "exp_avg", 0, 1 << 40) == before
    with pytest.raises(DeviceError) as caught:
        ns.begin_step()
    assert caught.value.status == Status.MISALIGNED_ACCESS and "loaded only in part" in str(caught.value)
    assert ns.loading and ns.read("w", "exp_avg", 0, 1 << 40) == before
    ns.write_state("w", "exp_avg", 0, bytes(4096))  # blocks 0..3 whole: nothing is held now
    ns.write_state("b", "exp_avg", 0, np.ones(7, np.float32).tobytes())  # the whole (short) file
    assert ns.begin_step() == 1


@pytest.mark.parametrize("state_dtype", SCALED)
@pytest.mark.parametrize("role", ["exp_avg_scale", "exp_avg_sq_scale"])
def test_a_torn_scale_fails_its_block(backing: Path, state_dtype: str, role: str) -> None:
    with Device.open(backing) as device:
        ns = device.create_namespace(make_spec(state_dtype))
        load_and_step(ns, range(3))
        t = ns.tensors["w"]
        copy = ns._sb.committed_copy
        # The second kernel block's first scale: the scale's own region, not the codes.
        offset = region_offset(t, role) + (BLOCK_ELEMS // k.STATE_BLOCK) * 4
    path = backing / "ns" / "q" / f"state.{copy.name}"
    with open(path, "r+b") as state:
        state.seek(offset)
        byte = state.read(1)
        state.seek(offset)
        state.write(bytes([(byte[0] + 1) & 0xFF]))
    with Device.open(backing) as device:
        ns = device.namespace("q")
        # Recovery finds step 3's block 1 torn and falls back to step 2, whole.
        assert ns.committed_step == 2
        assert ns.recovery_errors and ns.recovery_errors[0][:2] == ("w", 1)
        assert_equals_reference(ns, reference(state_dtype, 2), state_dtype)
