"""Operations tier: Prometheus metrics scraped over HTTP, `cossd top`, and `smart-log --media`
with the backing directory mapped to its block device (real loop and tmpfs mounts, synthetic
sysfs trees for NVMe, partitions, dm and md)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Mount, force_unmount, is_mounted, start_mount, wait_for_exit
from cossd.emulator import Device
from cossd.emulator.device import SUPERBLOCK_FILE
from cossd.protocol.logpages import DATA_UNIT_BYTES
from cossd.fs import daemon
from cossd.tools import media_health
from cossd.tools.verbs import top as verbs_top
from cossd.tools.cli import main
from cossd.client import AdminClient
from helpers import create_namespace, free_port, run_cli, tensor_dir

pytestmark = pytest.mark.mount

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
W_NUMEL = 300_000  # two blocks of fp16 gradient: 600 000 bytes
B_NUMEL = 100



def scrape(port: int) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], float]]]:
    """{family name as exposed (counters with _total): (type, {labels: value})}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        name = family.name + "_total" if family.type == "counter" else family.name
        samples = {tuple(sorted(sample.labels.items())): sample.value
                   for sample in family.samples if not sample.name.endswith("_created")}
        families[name] = (family.type, samples)
    return families


def value(families: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return families[name][1][tuple(sorted(labels.items()))]


def write(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        assert os.pwrite(fd, data, 0) == len(data)
    finally:
        os.close(fd)


def read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def stop(mount: Mount) -> None:
    if is_mounted(mount.mountpoint):
        force_unmount(mount.mountpoint)
    try:
        wait_for_exit(mount.pid, 30)
    except TimeoutError:
        os.kill(mount.pid, 9)


@pytest.fixture
def metrics_mount(backing: Path, tmp_path: Path) -> Iterator[tuple[Mount, int]]:
    """A real mount whose daemon serves metrics on a free port."""
    port = free_port()
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    pid = daemon.start_background(backing, mountpoint, metrics_port=port)
    mounted = Mount(backing, mountpoint, pid)
    try:
        yield mounted, port
    finally:
        stop(mounted)


# ---------------------------------------------------------------------- Prometheus metrics


def test_metrics_scraped_over_http_equal_what_was_done(metrics_mount: tuple[Mount, int]) -> None:
    mount, port = metrics_mount
    mp = mount.mountpoint
    create_namespace(mp, "net", [("w", W_NUMEL), ("b", B_NUMEL)])
    master_b = np.linspace(-1, 1, B_NUMEL, dtype=np.float32).tobytes()
    grad_w = np.full(W_NUMEL, 0.01, np.float16).tobytes()
    grad_b = np.ones(B_NUMEL, np.float16).tobytes()
    write(tensor_dir(mp, "net", "b") / "master", master_b)
    write(tensor_dir(mp, "net", "w") / "grad", grad_w)
    write(tensor_dir(mp, "net", "b") / "grad", grad_b)  # completes step 1
    params = read(tensor_dir(mp, "net", "w") / "param") + read(tensor_dir(mp, "net", "b") / "param")
    # Step 2 with one NaN: skipped, visibly.
    nan_b = np.ones(B_NUMEL, np.float16)
    nan_b[3] = np.nan
    write(tensor_dir(mp, "net", "w") / "grad", grad_w)
    write(tensor_dir(mp, "net", "b") / "grad", nan_b.tobytes())
    # A misaligned gradient write (odd length) fails with EINVAL, counted by errno.
    with pytest.raises(OSError) as refused:
        write(tensor_dir(mp, "net", "b") / "grad", b"\x00" * 3)
    assert refused.value.errno == 22
    with AdminClient(mp) as admin:
        admin.flush(admin.nsid("net"))
        smart = admin.smart_log()
        stats = admin.optimizer_log()["net"]

    families = scrape(port)
    net = {"namespace": "net"}
    grad_bytes = 2 * len(grad_w) + 2 * len(grad_b)
    assert value(families, "cossd_grad_bytes_total", **net) == grad_bytes == stats["grad_bytes_in"]
    assert value(families, "cossd_param_bytes_total", **net) == len(params) == 2 * (W_NUMEL + B_NUMEL)
    assert value(families, "cossd_state_loaded_bytes_total", **net) == len(master_b)
    assert value(families, "cossd_steps_committed_total", **net) == 1
    assert value(families, "cossd_steps_skipped_total", **net) == 1
    assert value(families, "cossd_nonfinite_elements_total", **net) == 1
    assert value(families, "cossd_committed_step", **net) == 1
    assert value(families, "cossd_durable_step", **net) == 1
    assert value(families, "cossd_last_skipped_step", **net) == 2
    assert value(families, "cossd_open_step", **net) == 0
    assert value(families, "cossd_parameters", **net) == W_NUMEL + B_NUMEL
    assert value(families, "cossd_kernel_seconds_total", **net) == pytest.approx(stats["kernel_ns"] / 1e9)
    assert value(families, "cossd_kernel_blocks_total", **net) == stats["kernel_blocks"] > 0
    assert value(families, "cossd_fs_errors_total", errno="EINVAL") == 1
    # The data path served every tensor request (the refused one too), and the control
    # file's and text files' reads and writes; pyfuse3 the rest (lookups, opens...).
    assert value(families, "cossd_fs_requests_total", served_by="data_path") > \
        stats["write_commands"] + stats["read_commands"] + 1
    assert value(families, "cossd_fs_requests_total", served_by="pyfuse3") > 0

    # Device-wide: the host bytes exactly, and the same data units as the SMART page.
    host_written = len(master_b) + grad_bytes
    assert value(families, "cossd_host_written_bytes_total") == host_written
    assert value(families, "cossd_host_read_bytes_total") == len(params)
    assert value(families, "cossd_data_units_written_total") == smart["data_units_written"] == \
        -(-host_written // DATA_UNIT_BYTES)
    assert value(families, "cossd_data_units_read_total") == smart["data_units_read"]
    assert value(families, "cossd_host_write_commands_total") == smart["host_write_commands"]
    assert value(families, "cossd_power_cycles_total") == 1
    assert value(families, "cossd_unsafe_shutdowns_total") == 0
    assert value(families, "cossd_media_errors_total") == 0
    assert value(families, "cossd_error_log_entries_total") == smart["num_err_log_entries"]
    assert value(families, "cossd_temperature_celsius") == pytest.approx(smart["temperature"] - 273.15, abs=1)
    assert value(families, "cossd_namespaces") == 1
    info = families["cossd_device_info"][1]
    (labels, one), = info.items()
    assert one == 1 and dict(labels)["serial"] == "TESTSERIAL0001" and dict(labels)["durability"] == "plp"

    # Names and types exactly as docs/metrics.md lists them (the mount's tables: the storage
    # server's own come after, checked by tests/e2e/test_server_metrics.py).
    mounts = DOCS.read_text().split("### The storage server's metrics", 1)[0]
    documented = dict(re.findall(r"^\| `(cossd_[a-z0-9_]+)` \| (counter|gauge) \|", mounts, re.M))
    assert {name: kind for name, (kind, _) in families.items()} == documented


def test_metrics_and_top_with_a_plain_nvm_namespace(
        metrics_mount: tuple[Mount, int], capsys: pytest.CaptureFixture[str]) -> None:
    """An NVM namespace has I/O counters but no steps: both views show what it has."""
    mount, port = metrics_mount
    mp = mount.mountpoint
    with AdminClient(mp) as admin:
        admin.create_namespace({"name": "ckpt", "kind": "nvm", "capacity_bytes": 1 << 20})
    create_namespace(mp, "net", [("w", 1000)])
    (mp / "ns" / "ckpt" / "data").write_bytes(b"x" * 8192)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    samples = {(s.name, s.labels.get("namespace")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("cossd_namespace_media_written_bytes_total", "ckpt")] == 8192
    assert ("cossd_committed_step", "ckpt") not in samples
    assert samples[("cossd_committed_step", "net")] == 0
    assert main(["top", str(mp), "-n", "1", "-d", "0.1"]) == 0
    screen = capsys.readouterr().out
    assert "net" in screen and "ckpt" not in screen.split("NAMESPACE")[1]


def test_second_mount_on_a_busy_metrics_port_fails_cleanly(
        metrics_mount: tuple[Mount, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mount, port = metrics_mount
    other = tmp_path / "other"
    Device.format(other, capacity_bytes=1 << 30, serial="TESTSERIAL0002")
    superblock = (other / SUPERBLOCK_FILE).read_bytes()
    mountpoint = tmp_path / "mnt2"
    mountpoint.mkdir()

    code, out, err = run_cli(capsys, "mount", other, mountpoint, "--metrics-port", port)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and f"cannot serve metrics on 127.0.0.1:{port}: address already in use" in err
    # Nothing started: not mounted, the device never opened (no power cycle written), the
    # backing not locked, and the first daemon still serving.
    assert not is_mounted(mountpoint)
    assert (other / SUPERBLOCK_FILE).read_bytes() == superblock
    Device.open(other).close()
    assert value(scrape(port), "cossd_power_cycles_total") == 1
    assert (mount.mountpoint / ".admin").exists()

    # Ports out of range are refused by the parser, before anything starts.
    for bad in ("0", "65536", "http"):
        with pytest.raises(SystemExit) as usage:
            main(["mount", str(other), str(mountpoint), "--metrics-port", bad])
        assert usage.value.code == 2
    assert "not a TCP port" in capsys.readouterr().err


# ---------------------------------------------------------------------- cossd top


def test_top_shows_rates_that_match_while_a_step_runs(
        mount: Mount, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    mp = mount.mountpoint
    create_namespace(mp, "net", [("w", W_NUMEL), ("b", B_NUMEL)])
    grad_w = np.full(W_NUMEL, 0.01, np.float16).tobytes()
    grad_b = np.ones(B_NUMEL, np.float16).tobytes()
    real_pause = verbs_top.pause
    done: list[int] = []

    def step_between_samples(seconds: float) -> None:
        # Known I/O between each pair of samples: first half a step (w: it stays open), then
        # the rest (b commits it) and the params of w.
        if len(done) % 2 == 0:
            write(tensor_dir(mp, "net", "w") / "grad", grad_w)
            done.append(len(grad_w))
        else:
            write(tensor_dir(mp, "net", "b") / "grad", grad_b)
            done.append(len(grad_b))
            read(tensor_dir(mp, "net", "w") / "param")
        real_pause(seconds)

    monkeypatch.setattr(verbs_top, "pause", step_between_samples)
    code, out, err = run_cli(capsys, "top", mp, "--interval", "0.2", "--iterations", "2", "-o", "json")
    assert code == 0 and err == ""
    first, second = [json.loads(line) for line in out.splitlines()]
    assert [first["refresh"], second["refresh"]] == [1, 2]

    # Refresh 1: step 1 open, w's gradient arrived, nothing committed yet.
    ns = first["namespaces"]["net"]
    assert ns["step_open"] == 1 and ns["committed_step"] == 0 and ns["steps_per_s"] == 0
    assert ns["grad_bytes_in"] == len(grad_w)
    assert ns["grad_bytes_per_s"] == pytest.approx(len(grad_w) / first["interval_s"])
    assert ns["param_bytes_per_s"] == 0
    # Refresh 2: b completed and committed the step; w's params were read.
    ns2 = second["namespaces"]["net"]
    assert ns2["step_open"] is None and ns2["committed_step"] == 1
    assert ns2["steps_per_s"] == pytest.approx(1 / second["interval_s"])
    assert ns2["grad_bytes_per_s"] == pytest.approx(len(grad_b) / second["interval_s"])
    assert ns2["param_bytes_per_s"] == pytest.approx(2 * W_NUMEL / second["interval_s"])
    assert ns2["kernel_busy_percent"] == pytest.approx(
        100 * (ns2["kernel_ns"] - ns["kernel_ns"]) / 1e9 / second["interval_s"])
    assert ns2["kernel_ns"] > 0
    assert second["device"]["steps_per_s"] == ns2["steps_per_s"]
    assert second["device"]["grad_bytes_per_s"] == ns2["grad_bytes_per_s"]
    assert second["device"]["temperature_celsius"] == second["device"]["temperature"] - 273

    # Normal output: the same step seen open, then committed; steps/s x interval = 1 step.
    done.clear()
    create_namespace(mp, "idle", [("x", 10)])
    code, out, err = run_cli(capsys, "top", mp, "-d", "0.5", "-n", "2")
    assert code == 0 and err == ""
    screens = re.split(r"\n(?=cossd top - )", out.strip())
    assert len(screens) == 2 and "\x1b[" not in out  # not a terminal: no escape codes
    for number, screen in enumerate(screens, 1):
        assert f"refresh {number}/2" in screen
        header = next(line for line in screen.splitlines() if line.startswith("NAMESPACE"))
        assert header.split() == ["NAMESPACE", "STEP", "DURABLE", "OPEN", "STEPS/S", "SKIPPED", "SKIP/S",
                                  "GRAD", "IN", "PARAM", "OUT", "KERNEL%"]
    rows = [{line.split()[0]: line.split() for line in screen.splitlines() if line.startswith(("net ", "idle "))}
            for screen in screens]
    assert rows[0]["net"][1:4] == ["1", "1", "2"]  # step 1 durable, step 2 open
    assert rows[1]["net"][1:4] == ["2", "1", "-"] or rows[1]["net"][1:4] == ["2", "2", "-"]
    assert rows[1]["idle"][1:5] == ["0", "L", "0", "-"]  # loading, no step
    interval = float(re.search(r"interval (\d+\.\d+) s", screens[1]).group(1))  # type: ignore[union-attr]
    assert float(rows[1]["net"][4]) * interval == pytest.approx(1, rel=0.03)


def test_top_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "top", tmp_path, "-n", "1")
    assert code == 1 and out == "" and err.strip() == f"cossd top: {tmp_path} is not a mounted cossd device"
    for option in (("--interval", "0"), ("--interval", "-1"), ("--interval", "nan"), ("--iterations", "0")):
        with pytest.raises(SystemExit) as usage:
            main(["top", str(tmp_path), *option])
        assert usage.value.code == 2


# ---------------------------------------------------------------------- block device mapping


def make_node(sysfs: Path, path: str, dev: str, devname: str, *, partition: int | None = None) -> Path:
    """A sysfs block node at devices/PATH with its dev, uevent, slaves/, and /sys/dev/block link."""
    node = sysfs / "devices" / path
    (node / "slaves").mkdir(parents=True)
    (node / "holders").mkdir()
    (node / "dev").write_text(dev + "\n")
    major, minor = dev.split(":")
    kind = "partition" if partition else "disk"
    (node / "uevent").write_text(f"MAJOR={major}\nMINOR={minor}\nDEVNAME={devname}\nDEVTYPE={kind}\n")
    if partition:
        (node / "partition").write_text(f"{partition}\n")
    link = sysfs / "dev" / "block" / dev
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(node, link.parent))
    return node


def enslave(holder: Path, slave: Path) -> None:
    (holder / "slaves" / slave.name).symlink_to(os.path.relpath(slave, holder / "slaves"))


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A sysfs tree laid out like a machine with two NVMe drives and a SATA disk:
    nvme0n1p1 (259:1), nvme0n1p2 (259:2) under LVM dm-0 (253:0), and md0 (9:0) RAID over
    nvme1n1p1 and sda1 under dm-1 (253:1)."""
    root = tmp_path / "sys"
    nvme0 = "pci0000:00/0000:00:1d.0/0000:3d:00.0/nvme/nvme0/nvme0n1"
    nvme1 = "pci0000:00/0000:00:1d.4/0000:3e:00.0/nvme/nvme1/nvme1n1"
    sda = "pci0000:00/0000:00:17.0/ata1/host0/target0:0:0/0:0:0:0/block/sda"
    make_node(root, nvme0, "259:0", "nvme0n1")
    make_node(root, f"{nvme0}/nvme0n1p1", "259:1", "nvme0n1p1", partition=1)
    p2 = make_node(root, f"{nvme0}/nvme0n1p2", "259:2", "nvme0n1p2", partition=2)
    make_node(root, nvme1, "259:3", "nvme1n1")
    nvme1p1 = make_node(root, f"{nvme1}/nvme1n1p1", "259:4", "nvme1n1p1", partition=1)
    make_node(root, sda, "8:0", "sda")
    sda1 = make_node(root, f"{sda}/sda1", "8:1", "sda1", partition=1)
    dm0 = make_node(root, "virtual/block/dm-0", "253:0", "dm-0")
    (dm0 / "dm").mkdir()
    (dm0 / "dm" / "name").write_text("vg-root\n")
    enslave(dm0, p2)
    md0 = make_node(root, "virtual/block/md0", "9:0", "md0")
    enslave(md0, nvme1p1)
    enslave(md0, sda1)
    dm1 = make_node(root, "virtual/block/dm-1", "253:1", "dm-1")
    enslave(dm1, md0)
    return root


def test_mapping_on_a_synthetic_sysfs(sysfs: Path) -> None:
    assert media_health.map_dev(259, 1, sysfs) == ("/dev/nvme0n1p1", ["/dev/nvme0n1"])
    assert media_health.map_dev(259, 0, sysfs) == ("/dev/nvme0n1", ["/dev/nvme0n1"])
    assert media_health.map_dev(253, 0, sysfs) == ("/dev/dm-0", ["/dev/nvme0n1"])
    assert media_health.map_dev(9, 0, sysfs) == ("/dev/md0", ["/dev/nvme1n1", "/dev/sda"])
    assert media_health.map_dev(253, 1, sysfs) == ("/dev/dm-1", ["/dev/nvme1n1", "/dev/sda"])
    assert media_health.map_dev(8, 1, sysfs) == ("/dev/sda1", ["/dev/sda"])
    assert media_health.map_dev(0, 45, sysfs) is None  # anonymous: tmpfs, overlay


def place_here(sysfs: Path, directory: Path, dev: str) -> None:
    """Make the real st_dev of `directory` point at node `dev` of the synthetic tree."""
    st_dev = os.stat(directory).st_dev
    link = sysfs / "dev" / "block" / f"{os.major(st_dev)}:{os.minor(st_dev)}"
    target = (sysfs / "dev" / "block" / dev).resolve()
    if link.is_symlink():
        link.unlink()
    link.symlink_to(os.path.relpath(target, link.parent))


def fake_nvme(tmp_path: Path, script: str) -> str:
    """An `nvme` executable standing in for nvme-cli (this machine has no NVMe drive)."""
    path = tmp_path / "bin" / "nvme"
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return str(path)


def test_nvme_backing_runs_nvme_smart_log(sysfs: Path, tmp_path: Path) -> None:
    backing = tmp_path / "backing"
    backing.mkdir()
    place_here(sysfs, backing, "253:1")  # the directory lies on dm-1: md0 over NVMe and SATA
    nvme = fake_nvme(tmp_path, 'test "$1 $3 $4" = "smart-log -o json" || exit 9\n'
                               'printf \'{"critical_warning":0,"temperature":310,"dev":"%s"}\\n\' "$2"\n')
    report = media_health.media_report(backing, sysfs=sysfs, nvme=nvme)
    assert report["status"] == "nvme" and report["device"] == "/dev/dm-1"
    assert report["disks"] == ["/dev/nvme1n1", "/dev/sda"] and report["nvme_devices"] == ["/dev/nvme1n1"]
    assert report["smart_log"] == {"/dev/nvme1n1": {"critical_warning": 0, "temperature": 310,
                                                    "dev": "/dev/nvme1n1"}}
    assert report["message"] == (f"{backing} is on /dev/dm-1 (over /dev/nvme1n1, /dev/sda): "
                                 "nvme smart-log of /dev/nvme1n1")
    text = media_health.render_media(report)
    assert "Smart Log for NVME device:nvme1n1" in text and re.search(r"^temperature +: 310$", text, re.M)

    # A partition of NVMe: nvme-cli is asked about the namespace, not the partition.
    place_here(sysfs, backing, "259:2")
    report = media_health.media_report(backing, sysfs=sysfs, nvme=nvme)
    assert list(report["smart_log"]) == ["/dev/nvme0n1"] and report["device"] == "/dev/nvme0n1p2"

    # nvme-cli missing, failing, or printing something else: said plainly.
    missing = media_health.media_report(backing, sysfs=sysfs, nvme=str(tmp_path / "no-such-nvme"))
    assert missing["status"] == "nvme_cli_missing" and "nvme-cli is not installed" in missing["message"]
    failing = fake_nvme(tmp_path, 'echo "open: Permission denied" >&2\nexit 1\n')
    failed = media_health.media_report(backing, sysfs=sysfs, nvme=failing)
    assert failed["status"] == "failed" and failed["message"].endswith(
        "nvme smart-log /dev/nvme0n1 failed: open: Permission denied")
    garbage = fake_nvme(tmp_path, "echo not json\n")
    assert "printed no JSON" in media_health.media_report(backing, sysfs=sysfs, nvme=garbage)["message"]


@pytest.fixture
def loop_filesystem(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """An ext4 filesystem on a real loop device, mounted (root only)."""
    if os.geteuid() != 0 or not shutil.which("losetup") or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root, losetup and mkfs.ext4")
    image = tmp_path / "disk.img"
    with open(image, "wb") as stream:
        stream.truncate(64 << 20)
    attached = subprocess.run(["losetup", "-f", "--show", str(image)], capture_output=True, text=True)
    if attached.returncode != 0:
        pytest.skip(f"no loop device: {attached.stderr.strip()}")
    loop = attached.stdout.strip()
    where = tmp_path / "loopfs"
    where.mkdir()
    try:
        subprocess.run(["mkfs.ext4", "-q", loop], check=True, capture_output=True)
        subprocess.run(["mount", loop, str(where)], check=True, capture_output=True)
        try:
            yield loop, where
        finally:
            subprocess.run(["umount", str(where)], capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", loop], capture_output=True)


def test_loop_device_backing_through_the_cli(
        loop_filesystem: tuple[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loop, where = loop_filesystem
    backing = where / "backing"
    Device.format(backing, capacity_bytes=32 << 20, serial="LOOPSERIAL01")
    located = media_health.locate(backing)
    assert located.device == loop and located.disks == [loop] and located.fstype == "ext4"
    assert located.nvme == []

    mounted = start_mount(backing, tmp_path / "loopmnt")
    try:
        code, out, err = run_cli(capsys, "smart-log", mounted.mountpoint, "--media")
        assert code == 0 and err == ""
        assert out.rstrip().endswith(f"\n\nmedia: {backing} is on {loop}, not an NVMe device")
        code, out, err = run_cli(capsys, "smart-log", mounted.mountpoint, "--media", "-o", "json")
        media = json.loads(out)["cossd"]["media"]  # cossd's own, under its vendor key
        assert code == 0 and media["status"] == "not_nvme" and media["device"] == loop
    finally:
        stop(mounted)


def test_tmpfs_backing_has_no_block_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    where = tmp_path / "tmpfs"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], check=True)
    try:
        backing = where / "backing"
        Device.format(backing, capacity_bytes=32 << 20)
        report = media_health.media_report(backing)
        assert report["status"] == "no_block_device" and report["device"] is None
        assert report["message"] == f"{backing} is on tmpfs, no block device"
        mounted = start_mount(backing, tmp_path / "tmpmnt")
        try:
            code, out, _ = run_cli(capsys, "smart-log", mounted.mountpoint, "--media")
            assert code == 0 and out.rstrip().endswith(f"media: {backing} is on tmpfs, no block device")
        finally:
            stop(mounted)
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)


def test_smart_log_media_on_this_machine(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    backing = mount.backing.resolve()
    code, out, err = run_cli(capsys, "smart-log", mount.mountpoint, "--media", "-o", "json")
    assert code == 0 and err == ""
    value = json.loads(out)
    media = value["cossd"]["media"]  # cossd's own, under its vendor key
    assert value["power_cycles"] == "1" and media["backing"] == str(backing)  # nvme-cli 2.3: a string
    # Checked against df, which finds the filesystem's source its own way.
    source = subprocess.run(["df", "--output=source", str(backing)], capture_output=True,
                            text=True, check=True).stdout.split()[-1]
    if media["status"] == "no_block_device":
        assert not source.startswith("/dev/")
        assert media["message"] == f"{backing} is on {media['fstype']}, no block device"
    elif media["status"] == "not_nvme":
        if source.startswith("/dev/") and not source.startswith("/dev/mapper/"):
            assert media["device"] == os.path.realpath(source)
        assert media["message"].startswith(f"{backing} is on {media['device']}")
        assert media["message"].endswith(", not an NVMe device")
    else:  # a machine whose backing is on NVMe: nvme-cli answered, or is said to be missing
        assert media["status"] in ("nvme", "nvme_cli_missing") and media["nvme_devices"]

    code, out, err = run_cli(capsys, "smart-log", mount.mountpoint, "--media")
    assert code == 0 and err == ""
    normal_lines = out.rstrip().splitlines()
    assert normal_lines[0].startswith("Smart Log for NVME device:")
    assert f"media: {media['message']}" in normal_lines
    # Without --media nothing about the drive is printed.
    code, out, _ = run_cli(capsys, "smart-log", mount.mountpoint, "-o", "json")
    assert code == 0 and "cossd" not in json.loads(out) and "media" not in json.loads(out)
