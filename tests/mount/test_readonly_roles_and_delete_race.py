"""Mount tier: every tensor file the host cannot write (param, and param_fp8 of a
param_wire_dtype namespace) is refused at open for writing, EACCES as param; gradient
writes racing the deletion of their namespace each get exactly one answer, with no failed
request in the daemon's log; and a write past a tensor file's end is refused per FUSE
request, as docs/errno.md says (the requests before it are taken), with README's dd line
safe against it."""
from __future__ import annotations

import errno
import mmap
import os
import stat
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import Mount
from cossd import settings
from cossd.client import AdminClient
from helpers import create_namespace, tensor_dir

pytestmark = pytest.mark.mount

RACE_S = 5.0
REPO = Path(__file__).resolve().parents[2]


def _errno_of_open(path: os.PathLike[str], flags: int) -> int:
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        return exc.errno or -1
    os.close(fd)
    return 0


def test_read_only_roles_are_refused_at_open_for_writing(mount: Mount) -> None:
    mp = mount.mountpoint
    with AdminClient(mp) as client:
        client.create_namespace({"name": "f8", "tensors": [["t", 1000]], "grad_dtype": "fp16",
                                 "param_wire_dtype": "fp8_e4m3"})
    tensor = tensor_dir(mp, "f8", "t")
    assert "param_fp8" in os.listdir(tensor)
    for role in ("param", "param_fp8"):
        assert stat.S_IMODE(os.stat(tensor / role).st_mode) == 0o444
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_DIRECT):
            assert _errno_of_open(tensor / role, flags) == errno.EACCES, (role, flags)
        assert _errno_of_open(tensor / role, os.O_RDONLY) == 0


def test_gradient_writes_racing_delete_ns_get_one_answer_each(mount: Mount) -> None:
    """Each round: a whole gradient (the write completes a step, which the data path then has
    flushed in the background), the namespace deleted at once, then writes on the old handle.
    Bounded in time; every write answers success or ENOENT, never EIO, and the daemon logs no
    failed request (a failure after the reply was answered a second time, with EIO). The race
    is rarely lost on a mount (the deletion takes milliseconds): the unit test
    tests/unit/test_datapath_one_reply.py drives it deterministically."""
    mp = mount.mountpoint
    grad = np.full(1000, 0.01, np.float16).tobytes()
    rounds = 0
    errors: dict[int, int] = {}
    deadline = time.monotonic() + RACE_S
    with AdminClient(mp) as admin:
        while time.monotonic() < deadline:
            name = f"r{rounds}"
            nsid = create_namespace(mp, name, [("t", 1000)])
            fd = os.open(tensor_dir(mp, name, "t") / "grad", os.O_WRONLY)
            try:
                assert os.pwrite(fd, grad, 0) == len(grad)  # step 1, committed
                admin.delete_namespace(nsid)  # right behind the write's reply
                for _ in range(3):  # its namespace is gone: ENOENT, and nothing else
                    try:
                        os.pwrite(fd, grad, 0)
                        errors[0] = errors.get(0, 0) + 1
                    except OSError as exc:
                        errors[exc.errno or -1] = errors.get(exc.errno or -1, 0) + 1
            finally:
                os.close(fd)
            rounds += 1
    assert rounds >= 5
    assert errors == {errno.ENOENT: 3 * rounds}, errors
    log = (mount.backing / "daemon.log").read_text()
    assert "request failed" not in log and "Traceback" not in log, log[-4000:]


def test_a_write_past_the_end_is_refused_per_request(mount: Mount) -> None:
    """An FP32 gradient in one write() of 8 MiB to the FP16 grad file of a 4 MiB tensor (the
    review's `dd bs=8M`): the requests inside the file are taken and complete the step; the
    write is short and the rest gets EFBIG."""
    mp = mount.mountpoint
    numel = 1 << 21
    create_namespace(mp, "big", [("a", numel)])
    grad = tensor_dir(mp, "big", "a") / "grad"
    assert os.stat(grad).st_size == 2 * numel
    buffer = mmap.mmap(-1, 8 << 20)  # page-aligned, as dd's
    buffer[:] = np.full(numel, 0.01, np.float32).tobytes()  # FP32: twice the file
    fd = os.open(grad, os.O_WRONLY)
    try:
        written = os.write(fd, buffer)
        assert written == 2 * numel  # whole requests up to the end: a short write
        with pytest.raises(OSError) as info:
            os.pwrite(fd, memoryview(buffer)[written:], written)
        assert info.value.errno == errno.EFBIG
    finally:
        os.close(fd)
        buffer.close()
    assert (mp / "ns/big/step").read_text() == "1\n"  # committed from FP32 bytes read as FP16

    # What docs/errno.md says of it, with the request size the data path asks for.
    pages = settings.FUSE_REQUEST_PAGES.default
    doc = (REPO / "docs/errno.md").read_text()
    assert "#### Refused per request, not per write()" in doc
    assert f"{pages * 4096 >> 20} MiB ({pages} pages" in doc
    assert "nothing is written" not in doc

    # README's dd line: nothing written where the sizes differ, the step where they match.
    fp32 = mount.backing.parent / "grad_fp32.bin"
    fp16 = mount.backing.parent / "grad_fp16.bin"
    fp32.write_bytes(np.full(numel, 0.01, np.float32).tobytes())
    fp16.write_bytes(np.full(numel, 0.01, np.float16).tobytes())
    line = next(text for text in (REPO / "README.md").read_text().splitlines() if "&& dd if=grad_fp16.bin" in text)
    for source, step in ((fp32, "1"), (fp16, "2")):
        script = f"G={grad}\n" + line.replace("grad_fp16.bin", str(source))
        subprocess.run(["bash", "-c", script], capture_output=True)
        assert (mp / "ns/big/step").read_text() == f"{step}\n", source
