"""Timing tier: the device timing model's arithmetic, the profiles, `cossd model` (Smart-Infinity's
traffic table included), and the model's accounting and timed mode on a real mount."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from conftest import Mount, force_unmount, is_mounted, wait_for_exit
from cossd.emulator import Device, DeviceConfig, Namespace, NamespaceSpec
from cossd.protocol.status import DeviceError, Status
from cossd.model.profiles import (
    PROFILES,
    DeviceProfile,
    load_profile,
    pcie_bytes_per_s,
)
from cossd.protocol.entries import IdentifyCns, Opcode
from cossd.emulator.accounting import LinkTiming
from cossd.model.links import LINKS, LinkModel, LinkProfile, ethernet_payload_bytes_per_s, load_link, wire_ns
from cossd.model.timing import (
    TimingModel,
    Traffic,
    pipeline_ns,
    step_traffic,
    transfer_ns,
)
from cossd.fs import daemon
from cossd.client import AdminClient
from cossd.model.step_model import StepSetup, predict_all, smart_infinity_table
from helpers import create_namespace, run_cli, tensor_dir

GB = 1_000_000_000


def toy_profile(**changes: object) -> DeviceProfile:
    """Round numbers, so every modeled time below can be worked out by hand."""
    fields: dict[str, object] = {
        "name": "toy", "summary": "round numbers", "host_link_bytes_per_s": GB,
        "host_link_latency_ns": 500, "nand_channels": 2, "channel_bytes_per_s": GB,
        "dies_per_channel": 1, "planes_per_die": 1, "page_bytes": 1000, "read_latency_ns": 1000,
        "program_latency_ns": 4000, "dram_bytes": 1 << 30, "dram_bytes_per_s": 56 * GB,
        "updater": "2 cores", "updater_units": 2, "unit_elements_per_s": 250_000_000}
    fields.update(changes)
    return DeviceProfile(**fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the model, unit by unit


def test_link_time_is_bytes_over_bandwidth_rounded_up() -> None:
    model = TimingModel(toy_profile())
    assert model.link_ns(GB) == 1_000_000_000
    assert model.link_ns(1) == 1
    assert model.link_ns(0) == 0
    assert transfer_ns(1, 3) == 333_333_334  # 1/3 s, rounded up to the next nanosecond
    # PCIe payload rates after 128b/130b coding, per direction.
    assert pcie_bytes_per_s(8, 4) == 3_938_461_538
    assert pcie_bytes_per_s(16, 4) == 7_876_923_076
    assert pcie_bytes_per_s(32, 4) == 15_753_846_153


def test_media_rates_from_channels_dies_and_nand_latencies() -> None:
    profile = toy_profile()
    # A die reads one 1000-byte page per 1 us: 1 GB/s, which its 1 GB/s channel can carry.
    assert profile.die_read_bytes_per_s == GB
    assert profile.media_read_bytes_per_s == 2 * GB
    # Programming takes 4 us per page: 0.25 GB/s per die, so writes are die-bound.
    assert profile.die_program_bytes_per_s == 250_000_000
    assert profile.media_write_bytes_per_s == 500_000_000
    model = TimingModel(profile)
    # Reads and writes share the channels: their times add.
    assert model.media_ns(2 * GB, GB) == 1_000_000_000 + 2_000_000_000
    # More dies per channel: the channel bus binds reads, the dies still bind writes.
    wide = toy_profile(dies_per_channel=3)
    assert wide.media_read_bytes_per_s == 2 * GB
    assert wide.media_write_bytes_per_s == 1_500_000_000
    # An internal link between the updater and the NAND (SmartSSD's P2P path) caps both.
    capped = toy_profile(internal_link_bytes_per_s=400_000_000)
    assert capped.media_read_bytes_per_s == capped.media_write_bytes_per_s == 400_000_000


def test_compute_rate_is_the_units_or_the_dram_whichever_binds() -> None:
    assert toy_profile().adam_elements_per_s == 500_000_000  # 2 units x 0.25 G/s; DRAM allows 1 G/s
    assert TimingModel(toy_profile()).compute_ns(500_000_000) == 1_000_000_000
    starved = toy_profile(dram_bytes_per_s=14 * GB)  # 14 GB/s over 56 B per element: 0.25 G/s
    assert starved.adam_elements_per_s == 250_000_000
    # Another updater for the same drive (the host CPU of ZeRO-style offload).
    assert TimingModel(toy_profile(), adam_elements_per_s=GB).compute_ns(GB) == 1_000_000_000


def test_pipeline_overlaps_stages_across_chunks() -> None:
    assert pipeline_ns([4, 2, 1], 1) == 7  # one chunk: nothing overlaps
    assert pipeline_ns([4, 2, 1], 4) == 5  # (7 + 3 x 4) / 4 = 4.75, rounded up
    assert pipeline_ns([400, 200, 100], 100) == 403  # (700 + 99 x 400) / 100
    # Many chunks: the bottleneck, plus the fill and drain of one chunk of the others.
    assert pipeline_ns([4000, 2000, 1000], 1000) == 4003
    assert pipeline_ns([0, 0], 10) == 0
    assert pipeline_ns([6, 0, 0], 3) == 6  # idle stages take no part


def test_command_time_is_latency_plus_pipelined_stages() -> None:
    model = TimingModel(toy_profile())
    assert toy_profile().chunk_bytes == 1000  # one page, one plane
    # A 4000-byte write: 4 us on the link, 8 us of programming (0.5 GB/s over both channels),
    # in 4 chunks of 1000 bytes: (4000 + 8000 + 3 x 8000) / 4 = 9000 ns, plus the link
    # latency. A write completes in DRAM: no tPROG in the fixed part.
    write = model.command(Traffic(host_in=4000, media_write=4000))
    assert (write.host_in_ns, write.media_ns, write.chunks) == (4000, 8000, 4)
    assert write.fixed_ns == 500 and write.device_ns == 500 + 9000
    assert write.bottleneck == "media"
    # A 2000-byte read: one tR before the first page, then 1 us of media and 2 us of link in
    # 2 chunks: (1000 + 2000 + 2000) / 2 = 2500.
    read = model.command(Traffic(host_out=2000, media_read=2000))
    assert read.fixed_ns == 500 + 1000 and read.device_ns == 1500 + 2500
    # An update of 1000 elements: 2 us of compute at 0.5 G/s; a flush pays one tPROG.
    update = model.command(Traffic(media_read=12_000, media_write=14_000, elements=1000, flushes=1))
    assert update.compute_ns == 2000
    assert update.media_ns == 6000 + 28_000
    assert update.fixed_ns == 500 + 1000 + 4000
    assert update.chunks == 14  # 14 000 media bytes written, 1000 per chunk
    assert update.device_ns == 5500 + 34_143  # (34 000 + 2000 + 13 x 34 000) / 14, rounded up
    # Device-internal work pays no host link latency.
    assert model.command(Traffic(media_write=1000), host_command=False).fixed_ns == 0
    assert model.command(Traffic()).device_ns == 500  # an empty command: the latency only


def test_step_traffic_is_what_the_emulator_moves() -> None:
    p = 1000
    assert step_traffic(p) == Traffic(host_in=2 * p, host_out=2 * p, media_read=14 * p,
                                      media_write=14 * p, elements=p)
    # BF16 moments: 4 + 2 + 2 bytes of state per element.
    assert step_traffic(p, moment_bytes=2).media_write == 10 * p
    # An FP32 param is the master: no separate copy written, the master read back.
    fp32 = step_traffic(p, grad_bytes=4, param_bytes=4)
    assert (fp32.host_in, fp32.host_out, fp32.media_read, fp32.media_write) == (4 * p, 4 * p, 16 * p, 12 * p)
    with pytest.raises(ValueError):
        Traffic(host_in=-1)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_each_builtin_profile_is_valid_and_sourced(name: str) -> None:
    profile = PROFILES[name]
    assert profile.validate() is profile and load_profile(name) is profile
    assert profile.media_read_bytes_per_s > 0 and profile.media_write_bytes_per_s > 0
    assert 0 < profile.chunk_bytes <= profile.dram_bytes // 2
    assert profile.adam_elements_per_s > 0
    cited = {"host_link_bytes_per_s", "host_link_latency_ns", "nand_channels", "channel_bytes_per_s",
             "dies_per_channel", "planes_per_die", "page_bytes", "read_latency_ns", "program_latency_ns",
             "dram_bytes", "dram_bytes_per_s", "unit_elements_per_s"}
    assert cited <= set(profile.sources), cited - set(profile.sources)
    round_trip = DeviceProfile.from_json(json.loads(json.dumps(profile.to_json())))
    assert round_trip == profile


def test_builtin_profiles_match_the_figures_the_docs_quote() -> None:
    gen4, gen5, smart = PROFILES["gen4-arm4"], PROFILES["gen5-arm8"], PROFILES["smartssd-fpga"]
    assert (gen4.host_link_bytes_per_s, gen4.media_read_bytes_per_s, gen4.media_write_bytes_per_s,
            gen4.adam_elements_per_s) == (7_876_923_076, 11_200_000_000, 3_495_253_320, 228_571_428)
    assert (gen5.host_link_bytes_per_s, gen5.media_read_bytes_per_s, gen5.media_write_bytes_per_s,
            gen5.adam_elements_per_s) == (15_753_846_153, 16_000_000_000, 6_990_506_640, 457_142_857)
    assert (smart.host_link_bytes_per_s, smart.media_read_bytes_per_s, smart.media_write_bytes_per_s,
            smart.adam_elements_per_s) == (3_938_461_538, 3_250_000_000, 2_097_152_000, 342_857_142)
    assert (gen4.updater_units, gen5.updater_units, smart.updater) == (4, 8, "FPGA (KU15P)")


def test_bad_profiles_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(DeviceError) as caught:
        load_profile("gen9-nope")
    assert caught.value.status == Status.INVALID_FIELD and "gen4-arm4" in caught.value.message
    with pytest.raises(DeviceError, match="nand_channels must be a positive integer"):
        toy_profile(nand_channels=0).validate()
    with pytest.raises(DeviceError, match="unknown profile field"):
        DeviceProfile.from_json(toy_profile().to_json() | {"warp_drive": 1})
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DeviceError, match="broken.json"):
        load_profile(str(broken))
    # A device refuses to open with an unknown profile, before it takes the backing's lock.
    Device.format(tmp_path / "dev", capacity_bytes=1 << 26)
    with pytest.raises(DeviceError, match="unknown profile"):
        Device.open(tmp_path / "dev", DeviceConfig(profile="gen9-nope"))
    with Device.open(tmp_path / "dev"):
        pass


# ---------------------------------------------------------------------- accounting in the emulator


def make_namespace(device: Device, name: str = "n", numel: int = 1000) -> Namespace:
    return device.create_namespace(NamespaceSpec.from_json({"name": name, "tensors": [["w", numel]]}))


def test_each_command_is_accounted_once_and_refusals_not_at_all(backing: Path) -> None:
    with Device.open(backing, DeviceConfig(profile="smartssd-fpga")) as device:
        ns = make_namespace(device)
        model = TimingModel(PROFILES["smartssd-fpga"])
        # A refused write (misaligned) moves nothing and is not a command.
        with pytest.raises(DeviceError):
            ns.write_grad("w", 1, b"\0\0")
        assert ns.statistics()["model"]["commands"] == 0
        ns.begin_step()  # seals the loading namespace: one superblock written
        sealed = ns.statistics()["model"]
        superblock = sealed["media_write_bytes"]
        assert sealed["by_command"] == {"begin_step": {"commands": 1, "device_ns": sealed["device_ns"]}}
        assert sealed["device_ns"] == model.command(Traffic(media_write=superblock)).device_ns
        # The write completes the only block. It is acknowledged once staged (its command
        # carries the host transfer); the block's update is the device's own work, which
        # the commit waits for.
        ns.write_grad("w", 0, bytes(2000))
        ns.commit_step()
        wrote = ns.statistics()["model"]
        assert wrote["by_command"]["write_grad"] == {
            "commands": 1, "device_ns": model.command(Traffic(host_in=2000)).device_ns}
        update = Traffic(media_read=12_000, media_write=14_000, elements=1000)
        assert wrote["by_command"]["kernel_block"] == {
            "commands": 1, "device_ns": model.command(update, host_command=False).device_ns}
        ns.flush()
        done = ns.statistics()["model"]
        assert done["by_command"]["commit_step"]["device_ns"] == model.command(
            Traffic(media_write=superblock)).device_ns
        assert done["flushes"] == 1  # the flush synced the committed step: one tPROG
        assert done["by_command"]["flush"]["device_ns"] == model.command(Traffic(flushes=1)).device_ns
        assert (done["commands"], done["media_write_bytes"]) == (4, 14_000 + 2 * superblock)
        assert done["profile"] == "smartssd-fpga" and done["timed"] is False
        assert device.describe()["timing"] == {"profile": "smartssd-fpga", "timed": False}


def test_timed_device_waits_for_the_model(backing: Path, tmp_path: Path) -> None:
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(toy_profile(name="slow", host_link_bytes_per_s=1_000_000).to_json()))
    with Device.open(backing, DeviceConfig(profile=str(path), timed=True)) as device:
        ns = make_namespace(device, numel=50_000)
        ns.write_grad("w", 0, bytes(100_000))  # 0.1 s on a 1 MB/s link, by the model
        model = ns.statistics()["model"]
    assert model["timed"] is True and model["timed_commands"] == 1
    assert model["timed_waits"] + model["timed_late"] == 1
    assert 0 <= model["timed_wait_ns"] <= model["device_ns"]
    assert model["device_ns"] >= 100_000_000


# ---------------------------------------------------------------------- schemes, Smart-Infinity


def test_smart_infinity_table_reproduced() -> None:
    params = 4_000_000_000  # GPT-2 4B, Smart-Infinity's headline model
    table = smart_infinity_table(params, grad_bytes=2, param_bytes=2)
    m = table["M_bytes"]
    assert m == 8 * GB  # M: the FP16 model, 2 bytes per parameter
    zero, smart, cossd = (table["rows"][k] for k in ("zero_infinity", "smart_infinity", "cossd"))
    assert zero["in_M"] == {"gradient_write": 2, "gradient_read": 2, "optimizer_read": 6, "optimizer_write": 6}
    assert zero["total_bytes"] == 16 * m == 128 * GB
    assert smart["in_M"] == {"gradient_write": 2, "param_read": 2} and smart["total_bytes"] == 4 * m
    assert cossd["bytes"] == {"gradient_write": 2 * params, "param_read": 2 * params}
    assert cossd["total_M"] == 2 and table["zero_over_smart_infinity"] == 4 and table["zero_over_cossd"] == 8


def test_schemes_agree_with_the_table_and_each_other() -> None:
    setup = StepSetup(params=1_000_000, compute_s=0.5, profile=PROFILES["gen4-arm4"])
    cossd, zero, checkpoint = predict_all(setup)
    table = smart_infinity_table(setup.params)
    # ZeRO-Infinity-style offload moves Table I's 16M over the host link.
    assert zero.traffic.host_link == table["rows"]["zero_infinity"]["total_bytes"] == 32 * setup.params
    assert cossd.traffic == step_traffic(setup.params)
    assert cossd.traffic.host_link == 4 * setup.params
    assert checkpoint.traffic == Traffic(host_in=14 * setup.params, media_write=14 * setup.params)
    # Smart-Infinity's setting (FP32 gradients and params) makes cossd's traffic its 2M + 2M.
    fp32 = predict_all(dataclasses.replace(setup, grad_bytes=4, param_bytes=4))[0]
    assert fp32.traffic.host_link == table["rows"]["smart_infinity"]["total_bytes"]
    # cossd's step: compute, then the step's device time (nothing overlaps compute).
    device = TimingModel(setup.profile).command(step_traffic(setup.params)).device_ns
    assert cossd.io_ns == device and cossd.step_ns == setup.compute_ns + device
    # The checkpoint row: the GPU update, then the checkpoint write.
    assert checkpoint.step_ns == setup.compute_ns + checkpoint.phases["gpu_update"] + checkpoint.phases["checkpoint_write"]
    # ZeRO: the gradient swap-out hides behind compute as far as it lasts.
    assert zero.step_ns == max(setup.compute_ns, zero.phases["gradient_swap_out"]) + zero.phases["update"]


def test_drives_split_the_work_and_a_shared_uplink_can_bind() -> None:
    one = StepSetup(params=8_000_000, compute_s=0, profile=PROFILES["smartssd-fpga"])
    ten = dataclasses.replace(one, drives=10)
    assert predict_all(ten)[0].io_ns < predict_all(one)[0].io_ns
    narrow = dataclasses.replace(ten, uplink_bytes_per_s=100_000_000)  # 0.1 GB/s shared
    zero = predict_all(narrow)[1]
    assert zero.bottleneck == "shared uplink"
    # The update reads 16 B/param (state and FP32 gradients) up through the uplink.
    assert zero.phases["update"] == transfer_ns(16 * one.params, 100_000_000)


# ---------------------------------------------------------------------- cossd model (CLI)


def test_cossd_model_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "model", "--params", "7B", "--compute-s", "1.5", "-o", "json")
    assert code == 0 and err == ""
    value = json.loads(out)
    p = 7 * GB
    assert value["setup"]["params"] == p and value["profile"]["name"] == "gen4-arm4"
    cossd = value["schemes"]["cossd"]
    assert (cossd["host_link_bytes"], cossd["host_link_bytes_per_param"]) == (4 * p, 4)
    assert (cossd["media_read_bytes"], cossd["media_write_bytes"]) == (14 * p, 14 * p)
    zero = value["schemes"]["zero_infinity"]
    assert zero["host_link_bytes"] == 32 * p
    assert value["schemes"]["checkpoint"]["media_write_bytes"] == 14 * p
    for scheme in value["schemes"].values():
        assert scheme["step_s"] == pytest.approx(1.5 + scheme["io_s"])
        assert scheme["slowdown"] == pytest.approx(scheme["step_s"] / 1.5)
    table = value["smart_infinity_table"]
    assert table["M_bytes"] == 2 * p and table["rows"]["zero_infinity"]["total_bytes"] == 16 * 2 * p
    assert table["rows"]["smart_infinity"]["total_bytes"] == 4 * 2 * p


def test_cossd_model_normal_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "model", "--params", "350M", "--profile", "smartssd-fpga",
                             "--grad-dtype", "fp32", "--param-dtype", "fp32", "--drives", "10",
                             "--uplink-gbs", "15.75", "--compute-s", "1")
    assert code == 0 and err == ""
    assert "350,000,000 params" in out and "10 x smartssd-fpga" in out and "15.75 GB/s" in out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if "  " in line}
    assert {"cossd (Adam in the drive)", "ZeRO-Infinity-style NVMe offload",
            "GPU Adam + per-step checkpoint"} <= set(rows)
    assert rows["cossd (Adam in the drive)"].split()[5] == "8"  # link B/param: FP32 in and out
    zero = rows["ZeRO-Infinity"].split()
    assert zero[1:7] == ["2M", "2M", "6M", "6M", "-", "16M"] and zero[7] == "11.20"
    smart = rows["Smart-Infinity (FP32 grad/param)"].split()
    assert smart[-7:] == ["2M", "-", "-", "-", "2M", "4M", "2.80"]
    assert "ZeRO-Infinity / Smart-Infinity = 4x" in out


def test_cossd_model_lists_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "model", "--list-profiles")
    assert code == 0 and all(name in out for name in PROFILES)
    code, out, _ = run_cli(capsys, "model", "--list-profiles", "-o", "json")
    listed = json.loads(out)["profiles"]
    assert [p["name"] for p in listed] == list(PROFILES)
    assert listed[0]["derived"]["adam_elements_per_s"] == PROFILES[listed[0]["name"]].adam_elements_per_s
    code, out, _ = run_cli(capsys, "model", "--help")
    assert code == 0 and all(name in out.replace("\n", " ") for name in PROFILES)


def test_cossd_model_profile_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(toy_profile(name="mine").to_json()))
    code, out, _ = run_cli(capsys, "model", "--params", "1000", "--profile", str(path), "-o", "json")
    assert code == 0 and json.loads(out)["profile"]["name"] == "mine"


@pytest.mark.parametrize("argv, message", [
    (["--params", "7B", "--profile", "gen9-nope"], "unknown profile 'gen9-nope'"),
    (["--params=-7B"], "--params must be a positive whole number"),
    (["--params", "0"], "--params must be a positive whole number"),
    (["--params", "seven"], "--params must be a positive whole number"),
    (["--params", "7B", "--compute-s=-1"], "--compute-s must be a finite number >= 0"),
    (["--params", "7B", "--drives", "0"], "--drives must be a positive whole number"),
    (["--params", "7B", "--host-adam-rate", "0"], "--host-adam-rate must be a finite number > 0"),
    ([], "give --params"),
])
def test_cossd_model_bad_input(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = run_cli(capsys, "model", *argv)
    assert code != 0 and out == ""
    assert err.strip().splitlines() == [err.strip()] and err.startswith("cossd model: ") and message in err


# ---------------------------------------------------------------------- on a real mount

PIECE = 60_000  # bytes per pwrite/pread: one FUSE request each (see test_admin.py)
W_NUMEL, B_NUMEL = 300_000, 100


@contextlib.contextmanager
def mounted(backing: Path, mountpoint: Path, **options: object) -> Iterator[Mount]:
    mountpoint.mkdir(exist_ok=True)
    pid = daemon.start_background(backing, mountpoint, **options)  # type: ignore[arg-type]
    mount = Mount(backing, mountpoint, pid)
    try:
        yield mount
    finally:
        if is_mounted(mountpoint):
            force_unmount(mountpoint)
        try:
            wait_for_exit(pid, 30)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)


def pwrite_pieces(path: Path, data: bytes) -> int:
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset in range(0, len(data), PIECE):
            os.pwrite(fd, data[offset : offset + PIECE], offset)
    finally:
        os.close(fd)
    return -(-len(data) // PIECE)


def pread_pieces(path: Path, size: int) -> list[int]:
    """Read `size` bytes without an EOF request; returns each read's length."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return [len(os.pread(fd, min(PIECE, size - offset), offset)) for offset in range(0, size, PIECE)]
    finally:
        os.close(fd)


def one_step(mp: Path, name: str) -> tuple[int, list[int]]:
    """Gradients of every tensor (the last write commits), then every param read back."""
    rng = np.random.default_rng(7)
    writes, reads = 0, []
    for tensor, numel in (("w", W_NUMEL), ("b", B_NUMEL)):
        grad = (rng.standard_normal(numel, dtype=np.float32) * 1e-3).astype(np.float16).tobytes()
        writes += pwrite_pieces(tensor_dir(mp, name, tensor) / "grad", grad)
    for tensor, numel in (("w", W_NUMEL), ("b", B_NUMEL)):
        reads += pread_pieces(tensor_dir(mp, name, tensor) / "param", 2 * numel)
    return writes, reads


def test_c0h_model_bytes_match_the_model(backing: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    with mounted(backing, tmp_path / "mnt", profile="gen5-arm8") as mount:
        mp = mount.mountpoint
        create_namespace(mp, "m", [("w", W_NUMEL), ("b", B_NUMEL)])
        writes, reads = one_step(mp, "m")
        with AdminClient(mp) as client:
            stats = client.optimizer_log()["m"]
            page = client.call(Opcode.IDENTIFY, cdw10=int(IdentifyCns.CONTROLLER)).data
        model = stats["model"]
        assert stats["committed_step"] == 1
        params = W_NUMEL + B_NUMEL
        expected = step_traffic(params)
        superblock = (backing / "ns" / "m" / "sb.0").stat().st_size  # the seal's and the commit's
        assert model["profile"] == "gen5-arm8" and model["timed"] is False
        assert model["host_in_bytes"] == expected.host_in == stats["grad_bytes_in"]
        assert model["host_out_bytes"] == expected.host_out == stats["param_bytes_out"]
        assert model["host_link_bytes"] == 4 * params
        assert model["media_read_bytes"] == expected.media_read
        assert model["media_write_bytes"] == expected.media_write + 2 * superblock
        assert model["elements_updated"] == params
        assert model["by_command"]["write_grad"]["commands"] == writes
        assert model["by_command"]["read"]["commands"] == len(reads)
        # Each read's modeled time is the model's for its bytes, summed.
        timing = TimingModel(PROFILES["gen5-arm8"])
        assert model["by_command"]["read"]["device_ns"] == sum(
            timing.command(Traffic(host_out=n, media_read=n)).device_ns for n in reads)
        assert model["device_ns"] == sum(entry["device_ns"] for entry in model["by_command"].values())
        assert model["device_ns"] > 0 and model["busy_ns"]["media"] > 0 and model["busy_ns"]["compute"] > 0
        assert model["timed_commands"] == model["timed_waits"] == 0  # not timed
        # Identify names the profile in its vendor area.
        vendor = json.loads(page[3072:].rstrip(b"\0"))
        assert vendor["profile"] == "gen5-arm8" and vendor["timed"] is False
        code, out, _ = run_cli(capsys, "id-ctrl", str(mp))
        assert code == 0 and "timing    : profile gen5-arm8" in out


def test_timed_mode_counts_its_waits(backing: Path, tmp_path: Path) -> None:
    # A deliberately slow drive (a 1 MB/s link): a 100 kB gradient write is modeled at 0.1 s,
    # far longer than the emulator takes, so completions must wait for the model.
    slow = toy_profile(name="slow-link", host_link_bytes_per_s=1_000_000, dram_bytes=1 << 20)
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(slow.to_json()))
    with mounted(backing, tmp_path / "mnt", profile=str(path), timed=True) as mount:
        mp = mount.mountpoint
        create_namespace(mp, "t", [("w", 50_000), ("b", 100)])
        for tensor, numel in (("w", 50_000), ("b", 100)):
            pwrite_pieces(tensor_dir(mp, "t", tensor) / "grad", bytes(2 * numel))
        pread_pieces(tensor_dir(mp, "t", "w") / "param", 100_000)
        with AdminClient(mp) as client:
            model = client.optimizer_log()["t"]["model"]
    assert model["profile"] == "slow-link" and model["timed"] is True
    assert model["timed_waits"] >= 1 and model["timed_wait_ns"] > 0
    # Every timed command either waited or was already late; waits never exceed the model.
    assert model["timed_waits"] + model["timed_late"] == model["timed_commands"] <= model["commands"]
    assert model["timed_wait_ns"] <= model["device_ns"]
    assert model["by_command"]["write_grad"]["commands"] == 2 + 1  # w in two pieces, b in one


def test_mount_refuses_an_unknown_profile(backing: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "mnt").mkdir()
    code, out, err = run_cli(capsys, "mount", str(backing), str(tmp_path / "mnt"), "--profile", "gen9-nope")
    assert code == 1 and out == ""
    assert err.strip().startswith("cossd mount: unknown profile 'gen9-nope'") and len(err.strip().splitlines()) == 1
    assert not is_mounted(tmp_path / "mnt")


# ---------------------------------------------------------------------- the network: link profiles


def toy_link(**changes: object) -> LinkProfile:
    """Round numbers: 1 GB/s, 1 us one way, 10 ns and 24 bytes per message."""
    fields: dict[str, object] = {"name": "toy-link", "summary": "round numbers", "bytes_per_s": GB,
                                 "latency_ns": 1000, "message_ns": 10, "message_bytes": 24}
    fields.update(changes)
    return LinkProfile(**fields)  # type: ignore[arg-type]


def test_link_wire_time_is_latency_plus_bytes_over_bandwidth_per_direction() -> None:
    model = LinkModel(toy_link())
    # A 1000-byte write: the request is 1 us + 10 ns + (1000 + 24) B at 1 GB/s; the response
    # (its completion) 1 us + 10 ns + 24 B. The response leaves after the request is in.
    write = model.command(1000, 0)
    assert (write.in_ns, write.out_ns, write.wire_ns) == (2034, 1034, 3068)
    assert (write.in_transfer_ns, write.out_transfer_ns) == (1024, 24)
    # Three messages in: the latency once, each message's work and header.
    assert model.command(3000, 0, messages_in=3).in_ns == 1000 + 30 + 3072
    # A command is at least one message each way, whatever the caller says.
    assert model.command(0, 0, messages_in=0, messages_out=0).wire_ns == 2 * 1034
    assert wire_ns(toy_link(), 1000, 0) == 3068
    assert model.direction_ns(0, 0) == 0
    with pytest.raises(ValueError):
        model.command(-1, 0)
    # Payload rates after per-packet framing: RoCEv2 at 4 KiB over 100GbE, InfiniBand HDR,
    # TCP at MTU 1500 over 25GbE.
    assert ethernet_payload_bytes_per_s(100, 4096, 82) == 12_254_667_304
    assert ethernet_payload_bytes_per_s(200, 4096, 26) == 24_842_309_558
    assert ethernet_payload_bytes_per_s(25, 1448, 90) == 2_942_132_639


def test_builtin_links_are_valid_and_sourced() -> None:
    assert {"100g-rdma", "200g-rdma", "25gbe-tcp", "loopback"} <= set(LINKS)
    for name, link in LINKS.items():
        assert load_link(name) is link and link.validate() is link
        assert {"bytes_per_s", "latency_ns", "message_ns", "message_bytes"} <= set(link.sources), name
        assert LinkProfile.from_json(json.loads(json.dumps(link.to_json()))) == link
    # The RDMA links are an order of magnitude quicker to reach than kernel TCP.
    assert LINKS["200g-rdma"].bytes_per_s > LINKS["100g-rdma"].bytes_per_s > 4 * LINKS["25gbe-tcp"].bytes_per_s
    assert LINKS["200g-rdma"].latency_ns < LINKS["25gbe-tcp"].latency_ns / 10


def test_link_json_profiles_and_bad_links(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(toy_link(name="mine").to_json()))
    assert load_link(str(path)) == toy_link(name="mine")
    minimal = tmp_path / "minimal.json"
    minimal.write_text(json.dumps({"name": "m", "bytes_per_s": 1000, "latency_ns": 0}))
    assert load_link(str(minimal)).message_bytes == 0 and load_link(str(minimal)).summary == "user link"
    with pytest.raises(DeviceError) as caught:
        load_link("9000g-warp")
    assert caught.value.status == Status.INVALID_FIELD and "200g-rdma" in caught.value.message
    with pytest.raises(DeviceError, match="bytes_per_s must be a positive integer"):
        toy_link(bytes_per_s=0).validate()
    with pytest.raises(DeviceError, match="latency_ns must be an integer >= 0"):
        toy_link(latency_ns=-1).validate()
    with pytest.raises(DeviceError, match="unknown link field"):
        LinkProfile.from_json(toy_link().to_json() | {"warp": 1})
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(DeviceError, match="broken.json"):
        load_link(str(broken))


def test_link_timing_accounts_each_command_and_holds_it_in_timed_mode() -> None:
    slow = LinkModel(toy_link(bytes_per_s=1_000_000, latency_ns=0, message_ns=0, message_bytes=0))
    modeled = slow.command(100_000, 16).wire_ns  # 0.1 s of gradients in, a 16-byte completion out
    timed = LinkTiming(slow, timed=True)
    started = time.monotonic_ns()
    with timed.command("write"):
        timed.add(net_in=100_000, net_out=16)
    held = time.monotonic_ns() - started
    assert held >= modeled >= 100_000_000  # the completion waited for the modeled wire time
    stats = timed.snapshot()
    assert (stats["commands"], stats["net_in_bytes"], stats["net_out_bytes"]) == (1, 100_000, 16)
    assert (stats["messages_in"], stats["messages_out"]) == (0, 0)  # the minimum of one each is the model's
    assert stats["wire_ns"] == modeled == stats["by_command"]["write"]["wire_ns"]
    assert stats["timed_waits"] + stats["timed_late"] == stats["timed_commands"] == 1
    assert 0 < stats["timed_wait_ns"] <= stats["wire_ns"]
    assert stats["link"] == "toy-link" and stats["timed"] is True
    # Not timed: the same command is accounted alike and returns at once.
    untimed = LinkTiming(slow)
    started = time.monotonic_ns()
    with untimed.command("write"):
        untimed.add(net_in=1_000_000)  # a second, by the model
    assert time.monotonic_ns() - started < 500_000_000
    assert untimed.snapshot()["wire_ns"] >= 1_000_000_000 and untimed.snapshot()["timed_commands"] == 0


def test_link_timing_shares_the_server_nic_and_refuses_misuse() -> None:
    link = LinkTiming(LinkModel(toy_link(bytes_per_s=1_000_000, latency_ns=0, message_ns=0, message_bytes=0)),
                      timed=True)
    # Two trainers send 50 kB each at once over one 1 MB/s server NIC: the second transfer
    # queues behind the first, so the last completion comes 0.1 s after they started, not 0.05.
    barrier = threading.Barrier(2)

    def write() -> None:
        barrier.wait()
        with link.command("write"):
            link.add(net_in=50_000)

    started = time.monotonic_ns()
    threads = [threading.Thread(target=write) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert time.monotonic_ns() - started >= 100_000_000
    assert link.snapshot()["commands"] == 2
    # A command inside another on the same thread joins it: one command, the bytes of both.
    with link.command("outer"):
        link.add(net_in=1)
        with link.command("inner"):
            link.add(net_out=1)
    stats = link.snapshot()
    assert stats["commands"] == 3 and "inner" not in stats["by_command"] and stats["net_out_bytes"] == 1
    # A command that failed before moving anything is not counted, and not held.
    with pytest.raises(ConnectionError):
        with link.command("read"):
            raise ConnectionError("the peer went")
    assert link.snapshot()["commands"] == 3
    with pytest.raises(RuntimeError, match="outside a command"):
        link.add(net_in=1)
    with pytest.raises(ValueError):
        with link.command("write"):
            link.add(net_in=-5)


# ---------------------------------------------------------------------- cossd model --topology server


def topology(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run_cli(capsys, "model", "--topology", "server", *argv, "-o", "json")
    assert code == 0 and err == "", err
    return json.loads(out)


def test_cossd_model_server_topology_bytes_and_times(capsys: pytest.CaptureFixture[str]) -> None:
    value = topology(capsys, "--drives", "4", "--nodes", "8", "--link", "200g-rdma", "--params", "7e9",
                     "--compute-s", "2")
    p = 7 * GB
    cycle = value["bytes_per_cycle"]
    # Each node sends its 1/8 of the FP16 gradients and reads every FP16 param.
    assert (cycle["node_out_bytes"], cycle["node_in_bytes"]) == (2 * p // 8, 2 * p)
    assert (cycle["server_in_bytes"], cycle["server_out_bytes"]) == (2 * p, 8 * 2 * p)
    # The drives send the params up once; the server's cache serves the other seven copies.
    assert cycle["drive_link_out_bytes"] == 2 * p and cycle["param_cache_hit_bytes"] == 7 * 2 * p
    assert (cycle["media_read_bytes"], cycle["media_write_bytes"]) == (14 * p, 14 * p)
    assert value["network_bytes_per_param"] == 2 + 16
    resources = value["resources"]
    assert resources["drive media"]["count"] == 4 and resources["node NIC in"]["count"] == 8
    # The server NIC's busy time: the bytes with a 16-byte header per 1 MiB message, and 5 ns each.
    out = cycle["server_out_bytes"]
    messages = -(-out // (1 << 20))
    assert resources["server NIC out"]["busy_ns"] == LinkModel(LINKS["200g-rdma"]).transfer_ns(out, messages) + 5 * messages
    per_drive = TimingModel(PROFILES["gen4-arm4"]).command(step_traffic(p // 4))
    assert resources["drive media"]["busy_ns"] == per_drive.media_ns
    assert resources["drive controller"]["elements"] == p // 4
    # On gen4 drives at 200 Gb/s the NAND binds; the step is its time plus fill, drain, latencies.
    assert value["bottleneck"] == "drive media"
    busiest = max(r["busy_s"] for r in resources.values())
    assert busiest <= value["io_s"] <= busiest * 1.01
    assert value["step_s"] == pytest.approx(2 + value["io_s"])
    assert value["link"]["name"] == "200g-rdma" and value["setup"]["nodes"] == 8


def test_cossd_model_server_topology_finds_each_bottleneck(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    base = ("--drives", "4", "--nodes", "8", "--params", "7e9")
    # Kernel TCP at 25 GbE: eight nodes reading every param saturate the server's NIC.
    assert topology(capsys, *base, "--link", "25gbe-tcp")["bottleneck"] == "server NIC out"
    # With each node reading only its shard, or eight server NICs, the drives bind again.
    assert topology(capsys, *base, "--link", "25gbe-tcp", "--param-reads", "shard")["bottleneck"] == "drive media"
    assert topology(capsys, *base, "--link", "25gbe-tcp", "--server-nics", "8")["bottleneck"] == "drive media"
    # One node reading FP32 params from a server with two NICs and many drives: the node's
    # own NIC binds (28 GB in through it, 14 GB through each server NIC).
    assert topology(capsys, "--drives", "32", "--nodes", "1", "--server-nics", "2", "--params", "7e9",
                    "--param-dtype", "fp32", "--link", "25gbe-tcp")["bottleneck"] == "node NIC in"
    # Drives whose controller is slow: the updater binds.
    path = tmp_path / "slow-cores.json"
    path.write_text(json.dumps(PROFILES["gen4-arm4"].to_json() | {"name": "slow-cores", "unit_elements_per_s": 1_000_000}))
    assert topology(capsys, *base, "--profile", str(path))["bottleneck"] == "drive controller"


def test_cossd_model_server_topology_text_and_links(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "model", "--topology", "server", "--drives", "4", "--nodes", "8",
                             "--link", "200g-rdma", "--params", "7e9")
    assert code == 0 and err == ""
    assert "4 x gen4-arm4" in out and "8 trainer node(s)" in out and "200g-rdma" in out
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines() if "  " in line}
    assert {"drive media", "drive controller", "server NIC in", "server NIC out", "node NIC in",
            "node NIC out"} <= set(rows)
    assert rows["server NIC out"][-1] == "112.00" and rows["node NIC out"][-1] == "1.75"
    assert "bound by drive media" in out and "bytes per cycle" in out and "98.00 GB from the param cache" in out
    code, out, _ = run_cli(capsys, "model", "--list-links")
    assert code == 0 and all(name in out for name in ("100g-rdma", "200g-rdma", "25gbe-tcp", "loopback"))
    code, out, _ = run_cli(capsys, "model", "--list-links", "-o", "json")
    assert {link["name"] for link in json.loads(out)["links"]} >= {"100g-rdma", "200g-rdma"}


@pytest.mark.parametrize("argv, message", [
    (["--params", "7B", "--nodes", "8"], "--nodes only apply with --topology server"),
    (["--topology", "server", "--params", "7B", "--nodes", "0"], "--nodes must be a positive whole number"),
    (["--topology", "server", "--params", "7B", "--server-nics", "0"], "--server-nics must be a positive whole number"),
    (["--topology", "server", "--params", "7B", "--link", "9000g-warp"], "unknown link '9000g-warp'"),
    (["--topology", "server"], "give --params"),
])
def test_cossd_model_server_topology_bad_input(capsys: pytest.CaptureFixture[str], argv: list[str],
                                               message: str) -> None:
    code, out, err = run_cli(capsys, "model", *argv)
    assert code != 0 and out == ""
    assert err.startswith("cossd model: ") and message in err and len(err.strip().splitlines()) == 1
