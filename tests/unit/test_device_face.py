"""The device face (issue 35): every kind answers the one I/O entry, which meets injections once per request."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from cossd.emulator import Device, DeviceError, NamespaceSpec, Status, TensorSpec
from cossd.emulator.controller import Controller
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.emulator.nvm import NvmSpec
from cossd.protocol.entries import IoOpcode
from cossd.protocol.injection import Queue

ROOT = Path(__file__).resolve().parents[2]
TENSOR = TensorSpec("w", BLOCK_ELEMS + 3)


def _grads(seed: int) -> bytes:
    return np.random.default_rng(seed).standard_normal(TENSOR.numel).astype(np.float16).tobytes()


def test_every_kind_answers_the_io_entry(device: Device) -> None:
    """The same DeviceIO calls serve an optimizer namespace and an NVM one; a request the kind
    cannot serve (gradients into NVM data) is NAMESPACE_KIND_MISMATCH and changes nothing."""
    io = Controller(device).io
    optimizer = device.create_namespace(NamespaceSpec(name="opt", tensors=(TENSOR,)))
    nvm = device.create_namespace(NvmSpec(name="raw", capacity_bytes=1 << 20))
    master = np.arange(TENSOR.numel, dtype=np.float32).tobytes()
    assert io.write(optimizer, "w", "master", 0, master) == len(master)
    assert io.write(nvm, None, "data", 4096, b"abcd") == 4

    result = io.write_grads(optimizer, [("w", 0, _grads(1), None)])
    assert result is not None and result.committed_step == 1  # the implicit step, committed
    with io.read_many(optimizer, [("w", "param", 0, 8), ("w", "master", 0, 8)]) as views:
        assert [len(view) for view in views] == [8, 8]
    with io.read_many(nvm, [(None, "data", 4096, 4), (None, "data", 0, 2)]) as views:
        assert [bytes(view) for view in views] == [b"abcd", b"\0\0"]
    assert io.read_nowait(nvm, None, "data", 4096, 4) is None  # NVM reads block: a thread's
    assert io.write_nowait(nvm, None, "data", 0, b"x") is None

    with pytest.raises(DeviceError) as refused:
        io.write_grads(nvm, [("w", 0, _grads(2), None)])
    assert refused.value.status == Status.NAMESPACE_KIND_MISMATCH
    assert io.read(nvm, None, "data", 0, 8) == bytes(8)  # nothing written
    assert nvm.counters.write_commands == 1


def test_an_armed_io_failure_meets_a_batched_gradient_write_once(device: Device) -> None:
    """INJECT_ERROR on the data path fails a batch of lent gradients before the device takes
    any (no step opens), once; a request that consulted the injections already (checked=True,
    as the server's lease handover and the CMB's admin command do) does not consume one."""
    controller = Controller(device)
    io = controller.io
    namespace = device.create_namespace(NamespaceSpec(name="opt", tensors=(TENSOR,)))
    io.write(namespace, "w", "master", 0, np.zeros(TENSOR.numel, dtype=np.float32).tobytes())
    controller.injector.arm(Queue.IO, IoOpcode.WRITE, Status.WRITE_FAULT, 1, None)

    assert io.write_grads(namespace, [("w", 0, _grads(1), None)], checked=True) is not None
    with pytest.raises(DeviceError) as failed:
        io.write_grads(namespace, [("w", 0, _grads(2), None)])
    assert failed.value.status == Status.WRITE_FAULT
    assert namespace.committed_step == 1 and namespace.step_open is None  # nothing taken
    assert io.write_grads(namespace, [("w", 0, _grads(2), None)]) is not None  # disarmed
    assert namespace.committed_step == 2


KIND_CLASSES = re.compile(r"isinstance\([^)]*\b(Namespace|NvmNamespace|ComputeNamespace|MemoryNamespace)\b")


def test_no_front_end_tells_the_kinds_apart_by_class() -> None:
    """fs/, server/ and the I/O entry ask the kind itself (as_optimizer, as_nvm, the io_*
    methods), never isinstance of a namespace class."""
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for folder in ("fs", "server") for path in sorted((ROOT / folder).glob("*.py"))
                 for number, line in enumerate(path.read_text().splitlines(), 1) if KIND_CLASSES.search(line)]
    offenders += [f"emulator/io.py: {line.strip()}" for line in (ROOT / "emulator/io.py").read_text().splitlines()
                  if KIND_CLASSES.search(line)]
    assert not offenders, "\n".join(offenders)
