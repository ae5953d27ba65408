"""The device's gradient path in every wire format (no mount): FP32 sized by its 4 bytes, param copies of 2 bytes an element, the server's element cuts."""
from __future__ import annotations

import numpy as np
import pytest

from cossd.client.step_transport import _step_slots
from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.emulator.commands.cmb import Transfer, check_param_copies
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.server.writes import Writes

TENSORS = (TensorSpec("w", BLOCK_ELEMS * 2 + 5), TensorSpec("b", 7))


def _loaded(device: Device, name: str, grad_dtype: str):
    ns = device.create_namespace(NamespaceSpec(name=name, tensors=TENSORS, grad_dtype=grad_dtype, param_dtype="bf16"))
    rng = np.random.default_rng(0)
    for tensor in ns.layouts:
        ns.write_state(tensor.name, "master", 0, rng.standard_normal(tensor.numel, dtype=np.float32).tobytes())
    return ns


def _state(ns) -> dict[str, bytes]:
    return {f"{t.name}/{r}": ns.read(t.name, r, 0, 1 << 40)
            for t in ns.layouts for r in ("master", "exp_avg", "exp_avg_sq", "param")}


def test_fp32_gradients_in_pieces_and_lent_step_like_bf16(device: Device) -> None:
    """The same gradient values (BF16-exact) as FP32 in odd pieces (partial blocks staged at 4
    bytes an element) and lent with a param copy, and as BF16 whole: the same state, bit for bit;
    the FP32 param copy gets 2 bytes an element."""
    fp32, bf16 = _loaded(device, "f32", "fp32"), _loaded(device, "b16", "bf16")
    rng = np.random.default_rng(1)
    for step in range(3):
        values = {t.name: (rng.standard_normal(t.numel) * 0.01).astype(np.float32) for t in fp32.layouts}
        # Round to BF16 (its top 16 bits, ties away are fine: any BF16 value will do).
        values = {name: (v.view(np.uint32) & 0xFFFF0000).view(np.float32) for name, v in values.items()}
        for name, v in values.items():
            bf16.write_grad(name, 0, (v.view(np.uint32) >> 16).astype(np.uint16).tobytes())
        if step == 1:
            copies = {name: np.zeros(2 * len(v), dtype=np.uint8) for name, v in values.items()}
            fp32.write_grads_lent([(name, 0, memoryview(v.tobytes()), copies[name]) for name, v in values.items()])
            assert all(bytes(copies[name]) == fp32.read(name, "param", 0, 1 << 40) for name in values)
        else:
            for name, v in values.items():
                data = v.tobytes()
                cut = 4 * (len(v) // 3)  # a piece ending inside a block, then the rest
                fp32.write_grad(name, cut, data[cut:])
                fp32.write_grad(name, 0, data[:cut])
    assert fp32.committed_step == bf16.committed_step == 3
    assert _state(fp32) == _state(bf16)
    assert fp32.file_size("w", "grad") == 4 * (BLOCK_ELEMS * 2 + 5)


def test_fp32_writes_off_their_elements_and_short_param_copies_are_refused(device: Device) -> None:
    ns = _loaded(device, "f32", "fp32")
    before = _state(ns)
    with pytest.raises(DeviceError) as misaligned:
        ns.write_grad("b", 2, b"\0" * 8)
    assert misaligned.value.status == Status.MISALIGNED_ACCESS and "4-byte" in str(misaligned.value)
    grad = np.zeros(7, dtype=np.float32)
    with pytest.raises(DeviceError, match="a param copy of 28 bytes for 28 of fp32 gradient .it takes 14"):
        ns.write_grads_lent([("b", 0, memoryview(grad.tobytes()), np.zeros(28, dtype=np.uint8))])
    assert ns.step_open is None and _state(ns) == before


def test_cmb_param_copies_are_two_bytes_an_element() -> None:
    """A gradient of 4-byte elements has params half its length: a param copy right after half
    of it overlaps nothing; one that would overlap at 2 bytes an element per gradient byte does."""
    check_param_copies([Transfer("w", "grad", 0, 400, 0, 400)], grad_itemsize=4)
    check_param_copies([Transfer("w", "grad", 0, 400, 0, 600), Transfer("b", "grad", 0, 400, 800, 400)],
                       grad_itemsize=4)  # params 400..600, 600..800 miss the second gradient at 800
    with pytest.raises(DeviceError, match="overlap"):
        check_param_copies([Transfer("w", "grad", 0, 400, 0, 600), Transfer("b", "grad", 0, 400, 700, None)],
                           grad_itemsize=4)


def test_step_slots_size_gradients_and_params_apart() -> None:
    slots = _step_slots([("w", 100), ("b", 3)], 1 << 20, grad_itemsize=4)
    assert slots is not None
    assert (slots["w"][2], slots["w"][3], slots["b"][2], slots["b"][3]) == (400, 200, 12, 6)
    places = sorted((at, at + size) for grad_at, param_at, gsize, psize in slots.values()
                    for at, size in ((grad_at, gsize), (param_at, psize)))
    assert all(end <= start for (_, end), (start, _) in zip(places, places[1:]))


def test_a_streamed_write_hands_whole_four_byte_elements() -> None:
    """A PDU that cuts an FP32 element hands the device only the whole ones before the cut."""
    ranges = [("w", 0, 0, 40)]
    cursor = {"range": 0, "handed": 0}
    window = memoryview(bytearray(range(40)))
    first = Writes._hand(ranges, cursor, window, 0, 10, 4)
    assert [(t, offset, len(view)) for t, offset, view, _ in first] == [("w", 0, 8)]
    assert cursor["handed"] == 8
    rest = Writes._hand(ranges, cursor, window, 0, 40, 4)
    assert [(t, offset, len(view)) for t, offset, view, _ in rest] == [("w", 8, 32)]
