"""A gradient of the wrong size or half dtype is refused by the trainer's files with its reason
(the device itself can answer a write only with an errno: EFBIG, "File too large"), and the
daemon's log says why a raw write got EFBIG."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from conftest import Mount
from cossd.trainer.namespace.files import NamespaceFiles
from helpers import create_namespace, tensor_dir
from cossd.fs.refusals import RefusedWriteLog
from cossd.protocol.status import DeviceError, Status

pytestmark = pytest.mark.mount

NUMEL = 1000


def step_of(mount: Mount, name: str) -> str:
    return (mount.mountpoint / "ns" / name / "step").read_text()


@pytest.mark.parametrize("use_cmb", [False, True])
def test_an_fp32_gradient_is_refused_naming_sizes_and_dtype(mount: Mount, use_cmb: bool) -> None:
    create_namespace(mount.mountpoint, "bf", [("w", NUMEL)], grad_dtype="bf16", param_dtype="bf16")
    files = NamespaceFiles(mount.mountpoint, "bf", use_cmb=use_cmb)
    try:
        assert files.exists()
        assert (files.cmb() is not None) == use_cmb
        fp32 = torch.ones(NUMEL, dtype=torch.float32)
        for write in (lambda: files.write("w", "grad", fp32), lambda: files.write_many([("w", "grad", fp32)]),
                      lambda: files.write_streamed([("w", fp32, None)])):
            with pytest.raises(ValueError) as refused:
                write()
            assert str(refused.value) == (
                "gradient for w has 4000 bytes, the namespace 'bf' expects 2000 bytes (1000 elements "
                "of bf16): convert to bf16 (.to(torch.bfloat16))")
        with pytest.raises(ValueError, match="gradient for w is fp16, the namespace 'bf' takes bf16"):
            files.write_many([("w", "grad", torch.ones(NUMEL, dtype=torch.float16))])
        with pytest.raises(ValueError, match="gradient piece for w has 10 elements of 4 bytes from element 990"):
            files.write_pieces([("w", 990, torch.ones(10, dtype=torch.float32))])
        with pytest.raises(ValueError, match="within its 1000: check the range"):
            files.write_pieces([("w", 995, torch.ones(10, dtype=torch.bfloat16))])
        assert step_of(mount, "bf") == "0\n"  # nothing reached the device
        # The right gradient goes through, and trains.
        files.write("w", "grad", torch.ones(NUMEL, dtype=torch.bfloat16))
        assert step_of(mount, "bf") == "1\n"
    finally:
        files.close()


def test_a_raw_oversized_write_is_efbig_and_the_log_says_why(mount: Mount) -> None:
    create_namespace(mount.mountpoint, "raw", [("w", NUMEL)])
    fd = os.open(tensor_dir(mount.mountpoint, "raw", "w") / "grad", os.O_WRONLY)
    try:
        for _ in range(3):
            with pytest.raises(OSError) as refused:
                os.pwrite(fd, b"\0" * 4 * NUMEL, 0)  # an FP32 gradient
            assert refused.value.errno == errno.EFBIG
    finally:
        os.close(fd)
    lines = [line for line in (mount.backing / "daemon.log").read_text().splitlines() if "EFBIG" in line]
    # One line for the three writes (rate-limited), with the file, the sizes and the likely cause.
    assert len(lines) == 1, lines
    assert "w/grad: write of 4000 bytes at 0 passes the end (2000 bytes)" in lines[0]
    assert "FP32 into an FP16/BF16 grad file" in lines[0]
    stats = json.loads((mount.mountpoint / "ns/raw/stats.json").read_text())
    assert stats["committed_step"] == 0


def test_the_log_is_rate_limited_and_counts_what_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    """Every refused write gets its line (EFBIG, EINVAL...), with the device's reason; other
    requests' refusals none; at most one line a window, the next one counting those left out."""
    every = RefusedWriteLog(interval_s=0.0)  # every refusal logged
    refusal = DeviceError(Status.LBA_OUT_OF_RANGE, "w/master: write of 8 bytes at 3996 passes the end (4000 bytes)")
    cut = DeviceError(Status.MISALIGNED_ACCESS, "w/grad: writes must start and end on 2-byte element boundaries")
    with caplog.at_level("WARNING", logger="cossd.fs.refusals"):
        every.note(refusal, "write")
        every.note(DeviceError(Status.LBA_OUT_OF_RANGE, "w/param: read of 8 bytes at 0 passes the end"), "read")
        every.note(cut, "write")
    assert [r.getMessage() for r in caplog.records] == [
        "write refused with EFBIG (File too large): " + refusal.message,  # not a grad: no hint
        "write refused with EINVAL (Invalid argument): " + cut.message]
    caplog.clear()
    slow = RefusedWriteLog(interval_s=3600.0)
    with caplog.at_level("WARNING", logger="cossd.fs.refusals"):
        for _ in range(5):
            slow.note(refusal)
        slow._limiter._began -= 3600.0  # the window has passed
        slow.note(refusal)
    assert len(caplog.records) == 2 and "(4 more such lines not logged" in caplog.records[1].getMessage()
