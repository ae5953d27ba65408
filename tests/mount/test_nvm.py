"""Plain NVM namespaces: a raw data file on the real mount, its counters, its bad input, its
durability, and conventional checkpoints (torch.save, DCP) written through ext4 on it."""
from __future__ import annotations

import errno
import json
import os
import random
import stat
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import Mount, is_mounted
from cossd.emulator import Device, DeviceConfig, DeviceError, Status
from cossd.emulator import media
from cossd.emulator.kinds import spec_from_payload
from cossd.protocol.entries import NSID_ALL, Opcode
from cossd.tools.cli import main
from cossd.client import AdminClient
from cossd.harness.nvm_volume import NvmVolume, loop_devices_of
from helpers import create_namespace, pread_all, run_cli
from powerloss import PowerLossRecorder

pytestmark = pytest.mark.mount

MiB = 1 << 20
DATA_UNIT = 512_000


def create_nvm(mountpoint: Path, name: str, size: int) -> int:
    with AdminClient(mountpoint) as admin:
        return admin.create_namespace({"name": name, "kind": "nvm", "capacity_bytes": size})


def pwrite(path: Path, data: bytes, offset: int, *, fsync: bool = False) -> int:
    fd = os.open(path, os.O_WRONLY)
    try:
        written = os.pwrite(fd, data, offset)
        if fsync:
            os.fsync(fd)
        return written
    finally:
        os.close(fd)


def pread(path: Path, size: int, offset: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- the namespace itself


def test_create_write_read_remount_delete(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    code, out, _ = run_cli(capsys, "create-ns", str(mp), "raw", "--nvm", "--size", "1M", "-o", "json")
    assert code == 0 and json.loads(out)["nsid"] == 1
    root = mp / "ns" / "raw"
    assert sorted(os.listdir(root)) == ["config.json", "data", "stats.json"]
    info = os.stat(root / "data")
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o644 and info.st_size == MiB
    config = json.loads((root / "config.json").read_text())
    assert config["kind"] == "nvm" and config["capacity_bytes"] == MiB and config["blocks"] == 256
    assert not (root / "step").exists() and not (root / "tensors").exists()
    assert (mount.backing / "ns/raw/data").stat().st_size == MiB  # preallocated backing file

    # A fresh namespace reads as zeros; writes at aligned and unaligned offsets read back.
    assert pread_all(root / "data") == bytes(MiB)
    rng = np.random.default_rng(7)
    expected = bytearray(MiB)
    for offset, length in ((0, 4096), (4096 * 10, 65536), (12345, 777), (MiB - 100, 100)):
        piece = rng.integers(0, 256, length, dtype=np.uint8).tobytes()
        assert pwrite(root / "data", piece, offset) == length
        expected[offset:offset + length] = piece
    assert pread(root / "data", 5000, 12000) == bytes(expected[12000:17000])
    assert pread(root / "data", 4096, MiB - 50) == bytes(expected[MiB - 50:])  # short at the end
    assert pread(root / "data", 10, MiB) == b""
    fd = os.open(root / "data", os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    assert json.loads((root / "stats.json").read_text())["dirty"] is False

    # identify, id-ctrl, list
    code, out, _ = run_cli(capsys, "id-ns", str(mp), "raw", "-o", "json")
    page = json.loads(out)
    assert code == 0 and page["nsze"] == page["ncap"] == page["nuse"] == 256 and page["lbafs"][0]["ds"] == 12
    code, out, _ = run_cli(capsys, "id-ctrl", str(mp))
    assert code == 0 and "raw" in out and "nvm" in out and f"({MiB} allocated)" in out
    ours = mp.parent / "mountinfo"  # only this test's mount: others on the machine may hang
    ours.write_text("".join(line for line in open("/proc/self/mountinfo") if f" {mp} " in line))
    code, out, _ = run_cli(capsys, "list", "--mountinfo", str(ours), "-o", "json")
    assert code == 0 and json.loads(out)["cossd"]["Devices"][0]["Namespaces"] == [{"NameSpace": 1, "Name": "raw"}]

    # A clean remount: the same bytes, bit for bit.
    mount.unmount()
    mount.restart()
    assert pread_all(root / "data") == bytes(expected)
    with AdminClient(mp) as admin:
        assert admin.describe()["namespaces"][0]["kind"] == "nvm"

    # Delete frees the capacity and the backing files.
    code, _, _ = run_cli(capsys, "delete-ns", str(mp), "raw")
    assert code == 0 and not root.exists() and not (mount.backing / "ns/raw").exists()
    with AdminClient(mp) as admin:
        assert admin.describe()["allocated_bytes"] == 0


def test_smart_and_c0h_count_the_data_file_exactly(mount: Mount) -> None:
    """Fresh device: every byte and request on `data` shows in C0h and SMART, nothing else does."""
    mp = mount.mountpoint
    nsid = create_nvm(mp, "raw", 4 * MiB)
    data = mp / "ns/raw/data"
    sizes = [65536] * 20 + [4096, 100, 1]
    offset = 0
    for size in sizes:  # each pwrite of at most 64 KiB is one FUSE request
        pwrite(data, b"\xab" * size, offset)
        offset += size
    reads = [(0, 65536), (65536, 4096), (3 * MiB, 1000), (4 * MiB, 10)]  # the last one is empty
    read_bytes = sum(len(pread(data, size, at)) for at, size in reads)
    written = sum(sizes)
    assert read_bytes == 65536 + 4096 + 1000
    with AdminClient(mp) as admin:
        page = admin.optimizer_log(nsid)["raw"]
        smart = admin.smart_log()
        everything = admin.optimizer_log(NSID_ALL)
    assert page["bytes_written"] == written and page["write_commands"] == len(sizes)
    assert page["bytes_read"] == read_bytes and page["read_commands"] == len(reads)
    assert everything["raw"]["bytes_written"] == written
    assert smart["data_units_written"] == -(-written // DATA_UNIT) == 3
    assert smart["data_units_read"] == 1
    assert smart["host_write_commands"] == len(sizes) and smart["host_read_commands"] == len(reads)
    # The figures persist: after a clean remount SMART still holds them.
    mount.unmount()
    mount.restart()
    with AdminClient(mp) as admin:
        again = admin.smart_log()
    assert again["data_units_written"] == 3 and again["host_write_commands"] == len(sizes)


# ---------------------------------------------------------------------- bad input


def test_bad_input_is_refused_and_changes_nothing(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    nsid = create_nvm(mp, "raw", 64 * 1024)
    data = mp / "ns/raw/data"
    pwrite(data, b"\x11" * 65536, 0)
    with AdminClient(mp) as admin:
        before = admin.describe()
        stats_before = admin.statistics(nsid)

    # A write past the end, or straddling it, fails whole.
    for offset, length in ((65536, 1), (65536 - 10, 11), (1 << 40, 4096)):
        with pytest.raises(OSError) as info:
            pwrite(data, b"\x22" * length, offset)
        assert info.value.errno == errno.EFBIG
    assert pread_all(data) == b"\x11" * 65536

    # Creates that cannot be: status, and no namespace, no capacity taken.
    bad = [
        ({"name": "odd", "kind": "nvm", "capacity_bytes": 4097}, Status.INVALID_FIELD),
        ({"name": "zero", "kind": "nvm", "capacity_bytes": 0}, Status.INVALID_FIELD),
        ({"name": "text", "kind": "nvm", "capacity_bytes": "4096"}, Status.INVALID_FIELD),
        ({"name": "none", "kind": "nvm"}, Status.INVALID_FIELD),
        ({"name": "mixed", "kind": "nvm", "capacity_bytes": 4096, "tensors": [["w", 1]]}, Status.INVALID_FIELD),
        ({"name": "what", "kind": "zns", "capacity_bytes": 4096}, Status.INVALID_FIELD),
        ({"name": "huge", "kind": "nvm", "capacity_bytes": 16 << 30}, Status.NAMESPACE_INSUFFICIENT_CAPACITY),
        ({"name": "raw", "kind": "nvm", "capacity_bytes": 4096}, Status.NAMESPACE_EXISTS),
        ({"name": "bad/name", "kind": "nvm", "capacity_bytes": 4096}, Status.INVALID_NAME),
    ]
    with AdminClient(mp) as admin:
        for payload, status in bad:
            completion = admin.submit(Opcode.CREATE_NAMESPACE, payload=json.dumps(payload).encode())
            assert completion.status == status, (payload, completion.data)
        # Optimizer commands on an nvm namespace: the reserved status, never a crash.
        for opcode in (Opcode.BEGIN_STEP, Opcode.COMMIT_STEP, Opcode.ABORT_STEP, Opcode.SCRUB):
            completion = admin.submit(opcode, nsid=nsid)
            assert completion.status == Status.NAMESPACE_KIND_MISMATCH, (opcode, completion.data)
            assert b"plain nvm namespace" in completion.data
        completion = admin.submit(Opcode.SET_HYPERPARAMETERS, nsid=nsid, payload=b'{"lr": 0.1}')
        assert completion.status == Status.NAMESPACE_KIND_MISMATCH
        assert admin.error_log()[0]["parm_error_location"] == 4  # the nsid is at fault
        assert admin.scrub(NSID_ALL) == {}  # scrub of everything passes over nvm namespaces
        assert admin.describe()["namespaces"] == before["namespaces"]
        assert admin.describe()["allocated_bytes"] == before["allocated_bytes"]
        stats_after = admin.statistics(nsid)
    assert {k: stats_after[k] for k in ("bytes_written", "write_commands")} == \
        {k: stats_before[k] for k in ("bytes_written", "write_commands")}
    assert sorted(os.listdir(mount.backing / "ns")) == ["raw"]

    # The CLI's share of it: one line each.
    code, _, err = run_cli(capsys, "create-ns", str(mp), "odd", "--nvm", "--size", "5000")
    assert code == 1 and "INVALID_FIELD" in err and err.count("\n") == 1
    with pytest.raises(SystemExit, match="--nvm takes --size"):
        main(["create-ns", str(mp), "nosize", "--nvm"])
    with pytest.raises(SystemExit, match="--tensor"):
        main(["create-ns", str(mp), "neither"])
    code, _, err = run_cli(capsys, "begin-step", str(mp), "raw")
    assert code == 1 and "NAMESPACE_KIND_MISMATCH" in err


def test_optimizer_namespaces_are_untouched_by_the_kind_field(mount: Mount) -> None:
    """"kind": "optimizer" is the default; the optimizer's meta.json keeps its format."""
    mp = mount.mountpoint
    with AdminClient(mp) as admin:
        nsid = admin.create_namespace({"name": "opt", "kind": "optimizer", "tensors": [["w", 8]]})
        assert admin.describe()["namespaces"][0]["kind"] == "optimizer"
        admin.begin_step(nsid)  # an optimizer command still works
        admin.abort_step(nsid)
    meta = json.loads((mount.backing / "ns/opt/meta.json").read_text())
    assert set(meta) == {"nsid", "spec", "copy_bytes"}
    create_namespace(mp, "opt2", [("w", 8)])
    assert sorted(os.listdir(mp / "ns")) == ["opt", "opt2"]


# ---------------------------------------------------------------------- durability


def test_kill_9_after_fsync_keeps_the_data(mount: Mount) -> None:
    mp = mount.mountpoint
    create_nvm(mp, "raw", MiB)
    data = mp / "ns/raw/data"
    payload = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    pwrite(data, payload, 4096, fsync=True)
    mount.kill()
    mount.restart()
    assert pread(data, len(payload), 4096) == payload
    with AdminClient(mp) as admin:
        assert admin.smart_log()["unsafe_shutdowns"] == 1


def test_volatile_write_cache_and_power_loss(tmp_path: Path) -> None:
    """At the emulator tier: a power cut keeps what was flushed and may drop what was not;
    a --sync device writes through."""
    backing = tmp_path / "dev"
    Device.format(backing, capacity_bytes=1 << 30)
    with Device.open(backing) as device:
        namespace = device.create_namespace(spec_from_payload(
            {"name": "raw", "kind": "nvm", "capacity_bytes": 64 * 1024}))
        recorder = PowerLossRecorder(backing, lambda label: None)
        previous = media.install_hooks(recorder)
        try:
            namespace.write(0, b"A" * 8192)
            assert namespace.flush() == 0 and not namespace.statistics()["dirty"]
            namespace.write(8192, b"B" * 4096)  # acknowledged, still in the write cache
            assert namespace.statistics()["dirty"]
            image = tmp_path / "after-cut"
            recorder.build_image(image, "drop", rng=random.Random(0))
        finally:
            media.install_hooks(previous)
    with Device.open(image) as device:
        survivor = device.namespace("raw")
        assert survivor.read(0, 8192) == b"A" * 8192
        assert survivor.read(8192, 4096) == bytes(4096)  # the unflushed write was lost
    with Device.open(backing, DeviceConfig(sync=True)) as device:
        namespace = device.namespace("raw")
        assert namespace.config()["write_cache"] == "write-through"
        namespace.write(100, b"C")
        assert not namespace.statistics()["dirty"] and namespace.statistics()["flushes"] == 1


def test_media_failure_stops_writes(tmp_path: Path) -> None:
    """A failed fsync of the data file: WRITE_FAULT, and no further writes until reopened."""
    backing = tmp_path / "dev"
    Device.format(backing, capacity_bytes=1 << 30)

    class FailingSync(media.MediaHooks):
        def before_sync(self, path: Path) -> None:
            if path.name == "data":
                raise OSError(errno.EIO, "injected")

    with Device.open(backing) as device:
        namespace = device.create_namespace(spec_from_payload(
            {"name": "raw", "kind": "nvm", "capacity_bytes": 8192}))
        namespace.write(0, b"x")
        previous = media.install_hooks(FailingSync())
        try:
            with pytest.raises(DeviceError) as info:
                namespace.flush()
            assert info.value.status == Status.WRITE_FAULT
        finally:
            media.install_hooks(previous)
        with pytest.raises(DeviceError) as info:
            namespace.write(0, b"y")
        assert info.value.status == Status.WRITE_FAULT
        assert namespace.read(0, 1) == b"x"
        assert device.smart()["critical_warning"] & 0x04  # reliability degraded


# ---------------------------------------------------------------------- checkpoints through ext4


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"master": torch.randn(300_000, generator=generator),
            "exp_avg": torch.randn(300_000, generator=generator),
            "param": torch.randn(300_000, generator=generator).to(torch.bfloat16),
            "step": torch.tensor(17)}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_save_and_dcp_on_ext4_on_an_nvm_namespace(mount: Mount, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    mp = mount.mountpoint
    state = _state(1)
    with NvmVolume(mp, "ckpt", 64 * MiB, tmp_path / "ext4") as volume:
        assert volume.loop_device in loop_devices_of(volume.data_file)
        before = volume.settle()
        with open(volume.path / "state.pt", "wb") as stream:
            torch.save(state, stream)
            stream.flush()
            os.fsync(stream.fileno())
        future = dcp.async_save(state, checkpoint_id=str(volume.path / "dcp"))
        future.result()
        after = volume.settle()
        files = [volume.path / "state.pt", *(p for p in (volume.path / "dcp").iterdir())]
        # The drive saw at least every byte of both checkpoints (plus ext4's metadata).
        assert after["bytes_written"] - before["bytes_written"] >= sum(f.stat().st_size for f in files)
        loaded = torch.load(volume.path / "state.pt", weights_only=True)
        template = {key: torch.zeros_like(value) for key, value in state.items()}
        dcp.load(template, checkpoint_id=str(volume.path / "dcp"))
        data_file = volume.data_file
    for restored in (loaded, template):
        assert all(torch.equal(restored[key], state[key]) for key in state)
    # Left: unmounted, loop device detached, namespace deleted.
    assert not is_mounted(tmp_path / "ext4") and loop_devices_of(data_file) == []
    with AdminClient(mp) as admin:
        assert admin.describe()["namespaces"] == []

    # A checkpoint on the ext4 survives a remount of the volume (the namespace kept).
    with NvmVolume(mp, "keep", 64 * MiB, tmp_path / "ext4", keep_namespace=True) as volume:
        torch.save(state, volume.path / "state.pt")
    subprocess.run(["mount", "-o", "loop,ro", str(mp / "ns/keep/data"), str(tmp_path / "ext4")], check=True)
    try:
        again = torch.load(tmp_path / "ext4/state.pt", weights_only=True)
        assert all(torch.equal(again[key], state[key]) for key in state)
    finally:
        subprocess.run(["umount", str(tmp_path / "ext4")], check=True)
    assert loop_devices_of(mp / "ns/keep/data") == []  # mount -o loop detaches on umount


def test_volume_cleans_up_when_the_run_fails(mount: Mount, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    mp = mount.mountpoint
    with pytest.raises(RuntimeError, match="a failing run"):
        with NvmVolume(mp, "ckpt", 32 * MiB, tmp_path / "ext4") as volume:
            data_file = volume.data_file
            busy = open(volume.path / "open-file", "wb")  # keeps the filesystem busy
            busy.write(b"x" * 4096)
            raise RuntimeError("a failing run")
    assert not is_mounted(tmp_path / "ext4") and "unmounting lazily" in caplog.text
    busy.close()  # the lazily unmounted filesystem goes, and with it the loop device (autoclear)
    deadline = time.monotonic() + 60
    while loop_devices_of(data_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert loop_devices_of(data_file) == []
    with AdminClient(mp) as admin:
        assert admin.describe()["namespaces"] == []
    # Nothing holds the FUSE mount: it unmounts cleanly.
    mount.unmount()
    assert not is_mounted(mp)
