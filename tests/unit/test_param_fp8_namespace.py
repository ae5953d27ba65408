"""FP8 params out on the device (emulator/namespace/param_fp8.py): the param_fp8 files' header, scale and codes against the masters, per committed step, over a reopen, and their refusals."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.emulator.namespace import Namespace
from cossd.emulator.namespace import param_fp8
from cossd.kernels import fp8_params

TENSORS = (TensorSpec("w", BLOCK_ELEMS * 2 + 5), TensorSpec("b", 7))
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def make_spec(wire: str | None = "fp8_e4m3", **kw: object) -> NamespaceSpec:
    return NamespaceSpec(name="opt", tensors=TENSORS, param_wire_dtype=wire, **kw)  # type: ignore[arg-type]


def load(ns: Namespace) -> None:
    rng = np.random.default_rng(0)
    for tensor in ns.layouts:
        values = rng.standard_normal(tensor.numel).astype(np.float32) * (0.05 if tensor.name == "w" else 3.0)
        ns.write_state(tensor.name, "master", 0, values.tobytes())


def step(ns: Namespace, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for tensor in ns.layouts:
        ns.write_grad(tensor.name, 0, (rng.standard_normal(tensor.numel) * 0.01).astype(np.float16).tobytes())


def expected(ns: Namespace, tensor: str, wire: str) -> tuple[float, np.ndarray]:
    """The scale and codes the masters give, by numpy and torch (not the device's kernel)."""
    master = np.frombuffer(ns.read(tensor, "master", 0, 1 << 40), dtype=np.float32)
    amax = float(np.abs(master).max())
    scale = 2.0 ** np.floor(np.log2(fp8_params.FP8_MAX[wire] / amax))
    codes = (torch.from_numpy(master.copy()) * scale).to(TORCH_FP8[wire]).view(torch.uint8).numpy()
    return float(scale), codes


@pytest.mark.parametrize("wire", ["fp8_e4m3", "fp8_e5m2"])
def test_param_fp8_is_the_committed_masters_encoded_with_their_scale(device: Device, wire: str) -> None:
    ns = device.create_namespace(make_spec(wire))
    load(ns)
    assert "param_fp8" in ns.roles and ns.file_size("w", "param_fp8") == 16 + TENSORS[0].numel
    for seed in (1, 2, 3):
        step(ns, seed)
        for tensor in ("w", "b"):
            data = ns.read(tensor, "param_fp8", 0, 1 << 40)
            assert param_fp8.parse_header(data) == (ns.committed_step, expected(ns, tensor, wire)[0])
            np.testing.assert_array_equal(np.frombuffer(data[16:], dtype=np.uint8), expected(ns, tensor, wire)[1])
            # A range of it is the same bytes.
            assert ns.read(tensor, "param_fp8", 10, 5) == data[10:15]
    stats = ns.statistics()
    assert stats["param_fp8_overflows"] == 0 and stats["param_fp8_underflows"] >= 0
    # The decoded params are the masters within FP8's rounding (3 mantissa bits: 1/16 relative).
    data = ns.read("w", "param_fp8", 0, 1 << 40)
    _, scale = param_fp8.parse_header(data)
    decoded = torch.from_numpy(np.frombuffer(data[16:], dtype=np.uint8).copy()).view(TORCH_FP8[wire]).float() / scale
    master = torch.from_numpy(np.frombuffer(ns.read("w", "master", 0, 1 << 40), dtype=np.float32).copy())
    bound = (2.0 ** -4 if wire == "fp8_e4m3" else 2.0 ** -3) * master.abs() + 2.0 ** -20
    assert bool(((decoded - master).abs() <= bound).all())


def test_param_fp8_survives_a_reopen(backing: Path) -> None:
    with Device.open(backing) as device:
        ns = device.create_namespace(make_spec())
        load(ns)
        step(ns, 1)
        before = ns.read("w", "param_fp8", 0, 1 << 40)
    with Device.open(backing) as device:
        ns = device.namespaces["opt"]
        assert ns.param_wire_dtype == "fp8_e4m3"
        ns.wait_verified()
        assert ns.read("w", "param_fp8", 0, 1 << 40) == before


def test_namespace_without_fp8_params_has_no_param_fp8(device: Device) -> None:
    ns = device.create_namespace(make_spec(None))
    load(ns)
    assert "param_fp8" not in ns.roles and "param_wire_dtype" not in ns.config()
    with pytest.raises(DeviceError, match="no param_fp8 files") as info:
        ns.read("w", "param_fp8", 0, 16)
    assert info.value.status == Status.INVALID_FIELD


@pytest.mark.parametrize("wire", ["fp8", "fp16", "bf16", 8])
def test_bad_param_wire_dtype_is_refused(device: Device, wire: object) -> None:
    with pytest.raises(DeviceError, match="param_wire_dtype") as info:
        device.create_namespace(make_spec(wire))  # type: ignore[arg-type]
    assert info.value.status == Status.INVALID_FIELD
    assert "opt" not in device.namespaces


def test_param_fp8_is_read_only(device: Device) -> None:
    ns = device.create_namespace(make_spec())
    with pytest.raises(DeviceError):
        ns.write_state("w", "param_fp8", 0, b"\0" * 16)
