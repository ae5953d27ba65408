"""Mount tier: training through a real FUSE mount with plain pwrite/pread tracks torch."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import Mount
from helpers import (
    TorchReference,
    create_namespace,
    pread_all,
    pwrite_all,
    random_half,
    round_to_half,
    tensor_dir,
)

pytestmark = pytest.mark.mount

TENSORS = [("scalar", 1), ("odd", 1_000_003), ("matrix", 4096 * 1024)]


@pytest.mark.parametrize(
    "mode,dtype",
    [("adamw", "fp16"), ("adamw", "bf16"), ("adam", "fp16")],
)
def test_hundred_steps_match_torch(mount: Mount, mode: str, dtype: str) -> None:
    mp = mount.mountpoint
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    create_namespace(mp, "model", TENSORS, mode=mode, grad_dtype=dtype, param_dtype=dtype, **hyper)
    rng = np.random.default_rng(7)
    initial = {name: rng.standard_normal(numel, dtype=np.float32) for name, numel in TENSORS}
    for name, values in initial.items():
        pwrite_all(tensor_dir(mp, "model", name) / "master", values.tobytes())
    reference = TorchReference(initial, mode=mode, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                               eps=hyper["eps"], weight_decay=hyper["weight_decay"])
    # Before the first step the params are the initial weights, rounded.
    for name, values in initial.items():
        assert pread_all(tensor_dir(mp, "model", name) / "param") == round_to_half(values, dtype)

    worst = 0.0
    for step in range(1, 101):
        grads = {}
        for name, numel in TENSORS:
            raw, upcast = random_half(rng, numel, dtype, scale=0.01)
            grads[name] = upcast
            pwrite_all(tensor_dir(mp, "model", name) / "grad", raw)
        reference.step(grads)
        # The write that completed the last gradient returned after the commit.
        assert (mp / "ns/model/step").read_text() == f"{step}\n"
        for name, numel in TENSORS:
            master = np.frombuffer(pread_all(tensor_dir(mp, "model", name) / "master"), dtype=np.float32)
            expected = reference.master(name)
            tolerance = 1e-6 * float(np.abs(expected).max())
            error = float(np.abs(master - expected).max())
            worst = max(worst, error / max(tolerance, 1e-30))
            assert error <= tolerance, (step, name, error, tolerance)
            if step % 25 == 0 or numel == 1:
                param = pread_all(tensor_dir(mp, "model", name) / "param")
                assert param == round_to_half(master, dtype), (step, name)
    stats = json.loads((mp / "ns/model/stats.json").read_text())
    assert stats["steps_committed"] == 100 and stats["steps_skipped"] == 0
    assert worst <= 1.0


def _train_once(mount: Mount, name: str, write: dict) -> dict[str, bytes]:
    mp = mount.mountpoint
    create_namespace(mp, name, TENSORS[:2])
    rng = np.random.default_rng(11)
    for tensor, numel in TENSORS[:2]:
        pwrite_all(tensor_dir(mp, name, tensor) / "master", rng.standard_normal(numel, dtype=np.float32).tobytes())
    for _ in range(2):
        for tensor, numel in TENSORS[:2]:
            raw, _ = random_half(rng, numel, "fp16", scale=0.1)
            pwrite_all(tensor_dir(mp, name, tensor) / "grad", raw, **write)
    assert (mp / "ns" / name / "step").read_text() == "2\n"
    state = {}
    for tensor, _ in TENSORS[:2]:
        for role in ("master", "exp_avg", "exp_avg_sq", "param"):
            state[f"{tensor}/{role}"] = pread_all(tensor_dir(mp, name, tensor) / role)
    return state


def test_any_chunking_is_bit_identical(mount: Mount) -> None:
    reference = _train_once(mount, "whole", {})
    variants = {
        "pieces4k": {"chunk": 4096},
        "shuffled4k": {"chunk": 4096, "shuffle": 3},
        "odd_pieces": {"chunk": 65538, "shuffle": 5},
        "direct": {"o_direct": True, "chunk": 1 << 20},
        # O_DIRECT takes the kernel's asynchronous direct I/O: one write of the whole file
        # goes out as several requests at once, served in parallel, finishing in any order.
        "direct_whole": {"o_direct": True},
    }
    for label, write in variants.items():
        assert _train_once(mount, label, write) == reference, label


def test_one_inf_skips_the_whole_step(mount: Mount) -> None:
    mp = mount.mountpoint
    tensors = [("a", 1000), ("b", 300_000), ("c", 17)]
    create_namespace(mp, "skip", tensors)
    rng = np.random.default_rng(3)
    for tensor, numel in tensors:
        pwrite_all(tensor_dir(mp, "skip", tensor) / "master", rng.standard_normal(numel, dtype=np.float32).tobytes())
    for tensor, numel in tensors:
        raw, _ = random_half(rng, numel, "fp16")
        pwrite_all(tensor_dir(mp, "skip", tensor) / "grad", raw)
    assert (mp / "ns/skip/step").read_text() == "1\n"
    before = {(t, r): pread_all(tensor_dir(mp, "skip", t) / r)
              for t, _ in tensors for r in ("master", "exp_avg", "exp_avg_sq", "param")}
    for tensor, numel in tensors:
        raw, _ = random_half(rng, numel, "fp16")
        if tensor == "b":
            poisoned = np.frombuffer(raw, dtype=np.float16).copy()
            poisoned[123_457] = np.inf
            raw = poisoned.tobytes()
        pwrite_all(tensor_dir(mp, "skip", tensor) / "grad", raw)
    assert (mp / "ns/skip/step").read_text() == "1\n"
    after = {(t, r): pread_all(tensor_dir(mp, "skip", t) / r)
             for t, _ in tensors for r in ("master", "exp_avg", "exp_avg_sq", "param")}
    assert after == before
    stats = json.loads((mp / "ns/skip/stats.json").read_text())
    assert stats["steps_skipped"] == 1
    assert stats["last_skipped_step"] == 2
    assert stats["nonfinite_elements"] == 1
    # The next clean step is step 2 again: the counter did not advance.
    for tensor, numel in tensors:
        raw, _ = random_half(rng, numel, "fp16")
        pwrite_all(tensor_dir(mp, "skip", tensor) / "grad", raw)
    assert (mp / "ns/skip/step").read_text() == "2\n"
