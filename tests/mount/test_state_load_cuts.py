"""Initial state through a real mount: a block-scaled moment's one write() from a buffer anywhere in its page loads whatever requests the kernel cuts it into, the trainer's load_state_dict of int8 state works, a block left in part refuses the first step, and impossible values are EINVAL, changing nothing."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Mount
from cossd import kernels as k
from cossd.emulator.spec import STATE_FORMATS
from cossd.trainer import AdamW
from helpers import pread_all, run_cli, tensor_dir

pytestmark = pytest.mark.mount

NUMEL = 1_048_576 + 300  # 4 MiB of FP32 and a part scale block: several requests whatever the mount's size


def page_offset_array(numel: int, page_offset: int) -> np.ndarray:
    """FP32 numel elements whose buffer starts `page_offset` bytes into a page (where a numpy
    array of this size from malloc usually starts: 16)."""
    raw = np.empty(numel * 4 + 8192, np.uint8)
    start = (-raw.ctypes.data) % 4096 + page_offset
    out = raw[start : start + numel * 4].view(np.float32)
    assert out.ctypes.data % 4096 == page_offset
    return out


def create(capsys: pytest.CaptureFixture[str], mp: Path, name: str, state_dtype: str) -> None:
    code, _, err = run_cli(capsys, "create-ns", str(mp), name, "--tensor", f"w:{NUMEL}", "--state-dtype", state_dtype)
    assert code == 0, err


def encoded(values: np.ndarray, state_dtype: str, role: str) -> bytes:
    """What the mount reads back of `values` loaded whole: encoded per block, decoded."""
    codes = np.zeros(values.size, np.uint16 if state_dtype == "fp16" else np.uint8)
    scales = np.zeros(k.state_scale_count(values.size), np.float32)
    moment = k.Moment.EXP_AVG if role == "exp_avg" else k.Moment.EXP_AVG_SQ
    k.encode_state(values, codes, scales, state_format=STATE_FORMATS[state_dtype], moment=moment)
    out = np.empty(values.size, np.float32)
    k.decode_state(codes, scales, out, state_format=STATE_FORMATS[state_dtype], moment=moment)
    return out.tobytes()


@pytest.mark.parametrize("state_dtype", ["int8", "fp16"])
def test_one_write_from_anywhere_in_a_page_loads(mount: Mount, capsys: pytest.CaptureFixture[str],
                                                 state_dtype: str) -> None:
    mp = mount.mountpoint
    create(capsys, mp, "q", state_dtype)
    rng = np.random.default_rng(0)
    for page_offset, role in ((16, "exp_avg"), (100, "exp_avg_sq"), (0, "exp_avg")):
        values = page_offset_array(NUMEL, page_offset)
        values[:] = np.abs(rng.standard_normal(NUMEL, dtype=np.float32)) * 1e-3
        path = tensor_dir(mp, "q", "w") / role
        fd = os.open(path, os.O_WRONLY)
        try:
            assert os.pwrite(fd, memoryview(values).cast("B"), 0) == values.nbytes  # one write() call
        finally:
            os.close(fd)
        assert pread_all(path) == encoded(values, state_dtype, role), (page_offset, role)
    with open(tensor_dir(mp, "q", "w") / "exp_avg", "r+b", buffering=0) as f:  # f.write(ndarray)
        values = page_offset_array(NUMEL, 16)
        values[:] = 1.5
        assert f.write(values) == values.nbytes
    assert pread_all(tensor_dir(mp, "q", "w") / "exp_avg") == encoded(values, state_dtype, "exp_avg")
    (tensor_dir(mp, "q", "w") / "grad").write_bytes(np.full(NUMEL, 1e-3, np.float16).tobytes())
    assert (mp / "ns" / "q" / "step").read_text().strip() == "1"


def test_a_block_left_in_part_refuses_the_first_step(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    create(capsys, mp, "q", "int8")
    w = tensor_dir(mp, "q", "w")
    with open(w / "exp_avg", "r+b", buffering=0) as f:
        f.write(np.ones(1000, np.float32).tobytes())  # blocks 0..2 whole, elements 768..999 of block 3
    before = {role: pread_all(w / role) for role in ("master", "exp_avg", "exp_avg_sq")}
    with pytest.raises(OSError) as caught:
        (w / "grad").write_bytes(np.full(NUMEL, 1e-3, np.float16).tobytes())
    assert caught.value.errno == errno.EINVAL
    assert (mp / "ns" / "q" / "step").read_text().strip() == "0"
    assert {role: pread_all(w / role) for role in before} == before
    with open(w / "exp_avg", "r+b", buffering=0) as f:  # the rest of block 3: the step goes
        f.seek(4000)
        f.write(np.ones(24, np.float32).tobytes())
    (w / "grad").write_bytes(np.full(NUMEL, 1e-3, np.float16).tobytes())
    assert (mp / "ns" / "q" / "step").read_text().strip() == "1"


@pytest.mark.parametrize("state_dtype", ["fp32", "int8"])
@pytest.mark.parametrize("role,bad", [("exp_avg_sq", -1.0), ("exp_avg", float("nan")), ("master", float("inf"))])
def test_impossible_values_are_einval_and_change_nothing(mount: Mount, capsys: pytest.CaptureFixture[str],
                                                         state_dtype: str, role: str, bad: float) -> None:
    mp = mount.mountpoint
    create(capsys, mp, "q", state_dtype)
    w = tensor_dir(mp, "q", "w")
    before = {r: pread_all(w / r) for r in ("param", "master", "exp_avg", "exp_avg_sq")}
    with open(w / role, "r+b", buffering=0) as f, pytest.raises(OSError) as caught:
        f.write(np.full(1024, bad, np.float32).tobytes())  # 4 KiB: one request, whole scale blocks
    assert caught.value.errno == errno.EINVAL
    assert {r: pread_all(w / r) for r in before} == before


@pytest.mark.parametrize("state_dtype", ["fp32", "int8", "fp16"])
def test_trainer_load_state_dict_of_scaled_state(mount: Mount, state_dtype: str) -> None:
    """The reviewer's p14: int8 state of a 1M-element param loads into a second optimizer."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1_048_576))
    first = AdamW([p], lr=1e-3, mount=mount.mountpoint, namespace="a", state_dtype=state_dtype)
    p.grad = torch.randn_like(p) * 0.01
    first.step()
    saved = first.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    second = AdamW([q], lr=1e-3, mount=mount.mountpoint, namespace="b", state_dtype=state_dtype)
    second.load_state_dict(saved)
    loaded = second.state_dict()
    for role in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(loaded["state"][0][role], saved["state"][0][role]), role
    assert torch.equal(loaded["cossd_master"][0], saved["cossd_master"][0])
    q.grad = p.grad.clone()
    p.grad = p.grad.clone()
    first.step()
    second.step()
    assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("stop", ["kill", "unmount"])
def test_a_block_held_in_part_when_the_daemon_stops_still_refuses_the_first_step(
        mount: Mount, capsys: pytest.CaptureFixture[str], stop: str) -> None:
    """The held part of a scale block lives in the daemon's memory: a daemon killed (kill -9)
    or unmounted with it has lost its values, and the namespace it reopens refuses the
    first step (EINVAL, still loading) rather than start from a block half old; the block
    written whole again, the step goes."""
    mp = mount.mountpoint
    create(capsys, mp, "q", "int8")
    w = tensor_dir(mp, "q", "w")
    with open(w / "exp_avg", "r+b", buffering=0) as f:
        f.write(np.full(1000, 0.5, np.float32).tobytes())  # elements 768..999 of block 3 held
    mount.kill() if stop == "kill" else mount.unmount()
    mount.restart()
    grad = np.full(NUMEL, 1e-3, np.float16).tobytes()
    with pytest.raises(OSError) as caught:
        (w / "grad").write_bytes(grad)
    assert caught.value.errno == errno.EINVAL
    assert (mp / "ns" / "q" / "step").read_text().strip() == "0"
    with open(w / "exp_avg", "r+b", buffering=0) as f:
        f.seek(768 * 4)
        f.write(np.full(256, 0.5, np.float32).tobytes())  # block 3 whole
    (w / "grad").write_bytes(grad)
    assert (mp / "ns" / "q" / "step").read_text().strip() == "1"
