"""Mount tier: the data path (fs/datapath.py) answers exactly as pyfuse3 alone does, keeps reads
whole under concurrent steps, and ends cleanly; its fallback when it cannot start."""
from __future__ import annotations

import errno
import mmap
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.emulator import Device
from cossd.fs import daemon, datapath
from cossd.client import AdminClient
from helpers import TorchReference, create_namespace, pread_all, pwrite_all, random_half, tensor_dir

pytestmark = pytest.mark.mount

SERVED = re.compile(r"data path: (\d+) requests served, (\d+) passed to pyfuse3")


def _mount(tmp_path: Path, label: str, io_threads: int) -> Mount:
    backing, mountpoint = tmp_path / f"{label}-backing", tmp_path / f"{label}-mnt"
    Device.format(backing)
    mountpoint.mkdir()
    pid = daemon.start_background(backing, mountpoint, io_threads=io_threads)
    return Mount(backing, mountpoint, pid)


def _unmount_and_log(mounted: Mount) -> str:
    mounted.unmount()
    return (mounted.backing / "daemon.log").read_text()


def _errno_of(action) -> int:  # type: ignore[no-untyped-def]
    try:
        action()
    except OSError as exc:
        return exc.errno or 0
    return 0


def _session(mp: Path) -> dict[str, object]:
    """One session of everything the data path serves, and its refusals; what it observed."""
    seen: dict[str, object] = {}
    tensors = [("odd", 300_007), ("big", 1 << 20)]
    create_namespace(mp, "m", tensors)
    rng = np.random.default_rng(5)
    for name, numel in tensors:
        pwrite_all(tensor_dir(mp, "m", name) / "master", rng.standard_normal(numel, dtype=np.float32).tobytes())
    seen["initial params"] = pread_all(tensor_dir(mp, "m", "big") / "param")
    writes = [{}, {"chunk": 4096, "shuffle": 1}, {"chunk": 1 << 20, "o_direct": True}, {"chunk": 65538, "shuffle": 2}]
    for step, write in enumerate(writes, 1):
        for name, numel in tensors:
            raw, _ = random_half(rng, numel, "fp16", scale=0.1)
            if step == 3 and name == "odd":
                poisoned = np.frombuffer(raw, dtype=np.float16).copy()
                poisoned[77] = np.nan  # this step is skipped
                raw = poisoned.tobytes()
            pwrite_all(tensor_dir(mp, "m", name) / "grad", raw, **write)
        seen[f"step {step}"] = (mp / "ns/m/step").read_text()
    grad = tensor_dir(mp, "m", "odd") / "grad"
    fd = os.open(grad, os.O_WRONLY)
    try:
        seen["misaligned"] = _errno_of(lambda: os.pwrite(fd, b"\0" * 3, 1))
        seen["past the end"] = _errno_of(lambda: os.pwrite(fd, b"\0" * 4, 2 * 300_007 - 2))
        os.pwrite(fd, b"\0" * 8, 0)  # opens step 5
        seen["duplicate"] = _errno_of(lambda: os.pwrite(fd, b"\0" * 8, 0))
    finally:
        os.close(fd)
    with AdminClient(mp) as admin:
        admin.abort_step(admin.nsid("m"))
    seen["sealed master"] = _errno_of(lambda: pwrite_all(tensor_dir(mp, "m", "odd") / "master", b"\0" * 4))
    for name, _ in tensors:
        for role in ("master", "exp_avg", "exp_avg_sq", "param"):
            seen[f"{name}/{role}"] = pread_all(tensor_dir(mp, "m", name) / role)
    fd = os.open(tensor_dir(mp, "m", "big") / "master", os.O_RDONLY)
    try:
        seen["odd read"] = os.pread(fd, 12345, 4097)
        seen["read at the end"] = os.pread(fd, 100, 4 << 20)
    finally:
        os.close(fd)
    # LOOKUP and GETATTR (the data path answers them too): every node's attributes, a missing one.
    paths = [mp, mp / "ns", mp / "ns/m", mp / "ns/m/tensors", tensor_dir(mp, "m", "odd"), mp / "ns/m/step",
             mp / "ns/m/stats.json", mp / ".admin", *(tensor_dir(mp, "m", "big") / role for role in
                                                      ("grad", "param", "master", "exp_avg", "exp_avg_sq"))]
    # (stats.json's size varies from run to run: it holds timings.)
    seen["stat"] = [(s.st_ino, s.st_mode, s.st_nlink, s.st_size if path.name != "stats.json" else s.st_size > 0,
                     s.st_blocks if path.name != "stats.json" else None, s.st_blksize, s.st_mtime_ns > 0)
                    for path, s in zip(paths, map(os.stat, paths))]
    seen["stat missing"] = _errno_of(lambda: os.stat(mp / "ns/m/tensors/nope/param"))
    seen["listing"] = sorted(os.listdir(tensor_dir(mp, "m", "big")))
    with AdminClient(mp) as admin:
        admin.create_namespace({"name": "blocks", "kind": "nvm", "capacity_bytes": 1 << 20})
    data = mp / "ns/blocks/data"
    payload = rng.integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    fd = os.open(data, os.O_RDWR)
    try:
        seen["nvm write"] = os.pwrite(fd, payload, 5000)
        seen["nvm read"] = os.pread(fd, 400_000, 0)
        seen["nvm past the end"] = _errno_of(lambda: os.pwrite(fd, b"x" * 10, 1 << 20))
    finally:
        os.close(fd)
    return seen


def test_data_path_and_pyfuse3_alone_answer_bit_for_bit_alike(tmp_path: Path) -> None:
    runs = {}
    logs = {}
    for label, threads in (("pyfuse3", 0), ("data-path", 3)):
        mounted = _mount(tmp_path, label, threads)
        try:
            runs[label] = _session(mounted.mountpoint)
        finally:
            logs[label] = _unmount_and_log(mounted)
    assert runs["data-path"] == runs["pyfuse3"]
    seen = runs["data-path"]
    assert [seen[f"step {i}"] for i in range(1, 5)] == ["1\n", "2\n", "2\n", "3\n"]
    assert seen["misaligned"] == errno.EINVAL and seen["duplicate"] != 0 and seen["sealed master"] != 0
    assert seen["past the end"] != 0 and seen["nvm past the end"] != 0
    assert seen["read at the end"] == b"" and seen["stat missing"] == errno.ENOENT
    # The data path served the reads, writes, lookups and getattrs; opens and the rest went to pyfuse3.
    served = SERVED.search(logs["data-path"])
    assert served and int(served.group(1)) > 1000 and int(served.group(2)) > 20, logs["data-path"][-2000:]
    assert not SERVED.search(logs["pyfuse3"])


def test_reads_stay_whole_while_steps_commit(tmp_path: Path) -> None:
    """Writers on several threads, readers on others, all O_DIRECT: every read returns one
    committed step's bytes (equal gradients keep all elements equal, so a read that mixed two
    steps would show two values), and the result tracks torch."""
    numel = 1 << 21  # 8 blocks, 4 MiB of FP16 gradient
    mounted = _mount(tmp_path, "concurrent", 8)
    mp = mounted.mountpoint
    try:
        create_namespace(mp, "c", [("w", numel)], lr=1e-2)
        initial = np.ones(numel, dtype=np.float32)
        pwrite_all(tensor_dir(mp, "c", "w") / "master", initial.tobytes())
        reference = TorchReference({"w": initial}, mode="adamw", lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                   weight_decay=0.01)
        stop = threading.Event()
        torn: list[tuple[str, int]] = []
        reads = [0]

        def read_forever(role: str) -> None:
            buffer = mmap.mmap(-1, 1 << 20)
            fd = os.open(tensor_dir(mp, "c", "w") / role, os.O_RDONLY | os.O_DIRECT)
            dtype = np.float32 if role == "master" else np.float16
            size = numel * np.dtype(dtype).itemsize
            try:
                offset = 3 << 18  # reads straddle block boundaries (a block is 2^18 elements)
                while not stop.is_set():
                    count = os.preadv(fd, [buffer], offset)
                    values = np.frombuffer(buffer, dtype=dtype)[: count // np.dtype(dtype).itemsize]
                    if len(np.unique(values)) != 1:
                        torn.append((role, offset))
                    reads[0] += 1
                    offset = (offset + count) % size
            finally:
                os.close(fd)

        readers = [threading.Thread(target=read_forever, args=(role,)) for role in ("master", "param", "master")]
        for reader in readers:
            reader.start()
        try:
            pieces = 4
            part = 2 * numel // pieces
            for step in range(1, 25):
                value = np.float16(0.25 * (1 + step % 5) * (-1) ** step)
                raw = mmap.mmap(-1, 2 * numel)
                raw.write(np.full(numel, value, dtype=np.float16).tobytes())

                def write(index: int) -> None:
                    fd = os.open(tensor_dir(mp, "c", "w") / "grad", os.O_WRONLY | os.O_DIRECT)
                    try:
                        os.pwrite(fd, memoryview(raw)[index * part:(index + 1) * part], index * part)
                    finally:
                        os.close(fd)

                writers = [threading.Thread(target=write, args=(i,)) for i in range(pieces)]
                for writer in writers:
                    writer.start()
                for writer in writers:
                    writer.join()
                reference.step({"w": torch.full((numel,), float(value))})
                assert (mp / "ns/c/step").read_text() == f"{step}\n"
        finally:
            stop.set()
            for reader in readers:
                reader.join()
        assert not torn, torn[:5]
        assert reads[0] > 24
        master = np.frombuffer(pread_all(tensor_dir(mp, "c", "w") / "master"), dtype=np.float32)
        expected = reference.master("w")
        assert np.abs(master - expected).max() <= 1e-6 * np.abs(expected).max()
    finally:
        log = _unmount_and_log(mounted)
    assert SERVED.search(log)


def test_sigterm_ends_the_data_path_and_unmounts(tmp_path: Path) -> None:
    mounted = _mount(tmp_path, "term", 2)
    mp = mounted.mountpoint
    try:
        create_namespace(mp, "t", [("w", 1000)])
        raw, _ = random_half(np.random.default_rng(1), 1000, "fp16")
        pwrite_all(tensor_dir(mp, "t", "w") / "grad", raw)
        os.kill(mounted.pid, signal.SIGTERM)
        wait_for_exit(mounted.pid, 30)
        assert not is_mounted(mp)
    finally:
        if is_mounted(mp):
            force_unmount(mp)
    log = (mounted.backing / "daemon.log").read_text()
    assert SERVED.search(log) and "closed cleanly" in log
    mounted.restart()  # the step it served is the committed one
    try:
        assert (mp / "ns/t/step").read_text() == "1\n"
    finally:
        mounted.unmount()


def test_the_data_path_stays_off_where_sockets_cannot_hold_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datapath, "_size_buffers", lambda sock: False)
    reader, writer = os.pipe()
    before = os.fstat(reader)
    try:
        assert datapath.DataPath.attach(object(), reader) is None  # type: ignore[arg-type]
        after = os.fstat(reader)
        assert (after.st_ino, after.st_dev) == (before.st_ino, before.st_dev)  # not swapped
    finally:
        os.close(reader)
        os.close(writer)


def test_socket_buffers_hold_the_largest_request() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        assert datapath._size_buffers(ours)
        message = os.urandom(datapath.DEVICE_BUFFER)
        ours.send(message)
        assert theirs.recv(datapath.DEVICE_BUFFER) == message  # one message, whole


def test_io_threads_option_is_checked(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "cossd.tools.cli", "mount", "--io-threads", "100",
                             str(tmp_path), str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "not a thread count" in result.stderr


def test_the_fuse_page_limit_is_raised_only_for_the_mount_call(mount: Mount) -> None:
    """The daemon asks for 2 MiB requests: where root may, it raises fs.fuse.max_pages_limit
    around its mount call alone and puts it back, so the machine's setting is unchanged after
    (fs/fuse_limits.py); a tensor of several requests then still steps and reads back whole."""
    from cossd.fs import fuse_limits

    log = (mount.backing / "daemon.log").read_text()
    if fuse_limits.LIMIT_PATH.exists() and os.access(fuse_limits.LIMIT_PATH, os.W_OK):
        before = int(re.search(r"raised \S+ from (\d+) to 512 pages for this mount", log).group(1)) \
            if "for this mount" in log else fuse_limits.max_pages_limit()
        assert fuse_limits.max_pages_limit() == before
    numel = 3 << 20  # 6 MiB of FP16: one 4 MiB piece and a tail
    create_namespace(mount.mountpoint, "big", [("w", numel)])
    grads = (np.arange(numel) % 7 - 3).astype(np.float16).tobytes()
    pwrite_all(tensor_dir(mount.mountpoint, "big", "w") / "grad", grads)
    assert (mount.mountpoint / "ns" / "big" / "step").read_text() == "1\n"
    assert len(pread_all(tensor_dir(mount.mountpoint, "big", "w") / "param")) == 2 * numel
