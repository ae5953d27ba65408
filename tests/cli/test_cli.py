"""CLI tier: every verb called in-process through main(argv), against a real mount."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from conftest import Mount, is_mounted, wait_for_exit
from cossd.tools.cli import main
from cossd.harness import bench
from helpers import pwrite_all, run_cli, tensor_dir

pytestmark = pytest.mark.mount


def test_format_mount_create_train_umount(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    backing, mp = tmp_path / "dev", tmp_path / "mnt"
    mp.mkdir()
    code, out, _ = run_cli(capsys, "format", str(backing), "--capacity", "1G", "--serial", "CLI1", "-o", "json")
    assert code == 0 and json.loads(out)["serial"] == "CLI1"
    code, _, err = run_cli(capsys, "format", str(backing))
    assert code == 1 and "already holds" in err
    code, out, _ = run_cli(capsys, "mount", str(backing), str(mp), "-o", "json")
    assert code == 0 and is_mounted(mp)
    pid = json.loads(out)["pid"]
    try:
        code, out, _ = run_cli(capsys, "create-ns", str(mp), "net", "--tensor", "w:1000", "--tensor", "b:10",
                               "--lr", "0.01", "--mode", "adam", "--grad-dtype", "bf16", "--param-dtype", "bf16")
        assert code == 0 and "nsid 1" in out
        config = json.loads((mp / "ns/net/config.json").read_text())
        assert config["hyperparameters"]["lr"] == 0.01 and config["grad_dtype"] == "bf16"
        code, _, err = run_cli(capsys, "create-ns", str(mp), "bad/name", "--tensor", "w:1")
        assert code == 1 and "INVALID_NAME" in err
        code, _, err = run_cli(capsys, "create-ns", str(mp), "net", "--tensor", "w:1")
        assert code == 1 and "NAMESPACE_EXISTS" in err

        code, out, _ = run_cli(capsys, "begin-step", str(mp), "net", "--grad-scale", "0.5", "-o", "json")
        assert code == 0 and json.loads(out)["step"] == 1
        for name, numel in (("w", 1000), ("b", 10)):
            pwrite_all(tensor_dir(mp, "net", name) / "grad", np.ones(numel, np.uint16).tobytes())
        code, out, _ = run_cli(capsys, "commit-step", str(mp), "net", "-o", "json")
        assert code == 0 and json.loads(out)["committed_step"] == 1
        code, _, err = run_cli(capsys, "abort-step", str(mp), "net")
        assert code == 1 and "NO_STEP_OPEN" in err
        # Step 1 undone (back to the loaded weights, step 0), then asked again: already there.
        code, out, _ = run_cli(capsys, "revert-step", str(mp), "net", "--step", "1", "-o", "json")
        assert code == 0 and json.loads(out) == {"committed_step": 0, "reverted": True}
        code, out, _ = run_cli(capsys, "revert-step", str(mp), "net", "--step", "1")
        assert code == 0 and out.strip() == "committed_step=0 reverted=False"
        code, _, err = run_cli(capsys, "revert-step", str(mp), "net", "--step", "3")
        assert code == 1 and "STEP_NUMBER_MISMATCH" in err
        code, out, _ = run_cli(capsys, "begin-step", str(mp), "net", "--grad-scale", "0.5", "-o", "json")
        for name, numel in (("w", 1000), ("b", 10)):
            pwrite_all(tensor_dir(mp, "net", name) / "grad", np.ones(numel, np.uint16).tobytes())
        code, out, _ = run_cli(capsys, "commit-step", str(mp), "net", "-o", "json")
        assert code == 0 and json.loads(out)["committed_step"] == 1

        code, out, _ = run_cli(capsys, "id-ctrl", str(mp))
        assert code == 0 and "CLI1" in out and "net" in out and "step 1" in out
        assert re.search(r"cmb +: 1073741824 bytes at /proc/\d+/fd/\d+", out), out
        code, out, _ = run_cli(capsys, "id-ctrl", str(mp), "-o", "json")
        value = json.loads(out)  # nvme-cli's keys; cossd's own under "cossd"
        assert value["sn"].strip() == "CLI1" and value["cossd"]["namespaces"][0]["committed_step"] == 1
        assert value["cossd"]["cmb"]["size"] == 1 << 30

        code, _, _ = run_cli(capsys, "delete-ns", str(mp), "net")
        assert code == 0 and not (mp / "ns/net").exists()
        code, _, err = run_cli(capsys, "delete-ns", str(mp), "net")
        assert code == 1 and "no namespace" in err
    finally:
        code, _, _ = run_cli(capsys, "umount", str(mp))
    assert code == 0 and not is_mounted(mp)
    wait_for_exit(pid, 10)


def test_namespace_and_step_verbs_in_json(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    """The verbs the walkthrough above prints in normal form, in JSON for scripts."""
    mp = str(mount.mountpoint)
    code, out, _ = run_cli(capsys, "create-ns", mp, "net", "--tensor", "w:1000", "-o", "json")
    assert code == 0 and json.loads(out) == {"name": "net", "nsid": 1}
    code, out, _ = run_cli(capsys, "id-ns", mp, "net", "-o", "json")
    assert code == 0 and json.loads(out)["cossd"]["nsid"] == 1 and json.loads(out)["nsze"] > 0
    code, out, _ = run_cli(capsys, "begin-step", mp, "net", "-o", "json")
    assert code == 0 and json.loads(out) == {"step": 1}
    code, out, _ = run_cli(capsys, "abort-step", mp, "net", "-o", "json")
    assert code == 0 and json.loads(out) == {"aborted_step": 1}
    code, out, _ = run_cli(capsys, "admin-passthru", mp, "--opcode", "0xc8", "--namespace-id", "1", "-o", "json")
    completion = json.loads(out)  # NAMESPACE_STATISTICS: its JSON comes back as hex data
    assert code == 0 and completion["status_name"] == "SUCCESS"
    assert json.loads(bytes.fromhex(completion["data"]))["name"] == "net"
    # cdw14 reaches the device too: GET_LOG_PAGE (02h, SMART) refuses an index offset (its bit 23).
    code, out, _ = run_cli(capsys, "admin-passthru", mp, "--opcode", "0x02", "--namespace-id", "0xffffffff",
                           "--cdw10", str(0x02 | 3 << 16), "--cdw14", str(1 << 23), "-o", "json")
    assert code == 1 and json.loads(out)["status_name"] == "INVALID_FIELD"
    code, out, _ = run_cli(capsys, "delete-ns", mp, "net", "-o", "json")
    assert code == 0 and json.loads(out) == {"deleted": "net"}
    code, out, _ = run_cli(capsys, "umount", mp, "-o", "json")
    assert code == 0 and not is_mounted(mount.mountpoint)


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "create-ns", str(tmp_path), "x", "--tensor", "w:1")
    assert code == 1 and "not a mounted cossd device" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "mount", str(tmp_path / "nothing"), str(tmp_path))
    assert code == 1 and "not a cossd device" in err
    with pytest.raises(SystemExit):
        main(["create-ns", str(tmp_path), "x", "--tensor", "w"])  # argparse: NAME:NUMEL


def test_help_explains(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for verb in ("format", "mount", "umount", "create-ns", "delete-ns", "id-ctrl", "begin-step", "demo"):
        assert verb in text


def test_demo_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A short, tiny-model `cossd demo`: crash mid-step, restore, table, JSON and PNG."""
    out_dir = tmp_path / "out"
    code, out, err = run_cli(capsys, "demo", "--model", "tiny", "--steps", "16", "--crash-at", "9",
                             "--dcp-steps", "6", "--output", str(out_dir))
    assert code == 0, out + err
    assert "device daemon killed (kill -9)" in out and "resuming after committed step 8" in out
    assert "| (a) cossd" in out and "| (b) AdamW on trainer + torch.save/fsync" in out
    report = json.loads((out_dir / "report.json").read_text())
    assert report["checks"]["crash_run_bit_identical"] and report["checks"]["stock_within_tolerance"]
    assert report["crash"]["recovered_step"] == 8
    cossd, saved, dcp = report["methods"]
    # 2 bytes of BF16 gradient in and 2 of param out per parameter, nothing else.
    assert cossd["bytes_per_param_per_step"] == pytest.approx(4.0)
    assert saved["bytes_per_param_per_step"] > 12 and dcp["steps"] == 6
    assert (out_dir / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_trains_through_a_storage_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`cossd demo --remote`: the cossd runs go through `cossd serve` (cossd://, a token), the
    server is the one killed mid-step, and the restored run is still bit-identical."""
    out_dir = tmp_path / "out"
    code, out, err = run_cli(capsys, "demo", "--model", "tiny", "--steps", "12", "--crash-at", "7",
                             "--dcp-steps", "3", "--remote", "--output", str(out_dir))
    assert code == 0, out + err
    assert "serving the device at cossd://127.0.0.1:" in out
    assert "storage server killed (kill -9)" in out and "resuming after committed step 6" in out
    report = json.loads((out_dir / "report.json").read_text())
    assert report["settings"]["remote"] is True
    assert report["checks"]["crash_run_bit_identical"] and report["checks"]["stock_within_tolerance"]
    assert report["crash"]["through"] == "server" and report["crash"]["recovered_step"] == 6
    cossd = report["methods"][0]
    assert "storage server" in cossd["label"]
    assert cossd["bytes_per_param_per_step"] == pytest.approx(4.0)  # as the device counted them


def test_bench_ranks_section_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`cossd bench --sections ranks`: 1, 2 and 4 rank processes on gloo share one namespace;
    the device takes every gradient once (2 B a param, whatever the world size), each rank
    sends its shard's and reads every param (2 B a param a rank)."""
    code, out, err = run_cli(capsys, "bench", "--sections", "ranks", "--rank-elements", "1048576", "--repeat", "1",
                             "--output", str(tmp_path / "b"))
    assert code == 0, out + err
    section = json.loads((tmp_path / "b/bench.json").read_text())["ranks"]
    assert [row["ranks"] for row in section["rows"]] == [1, 2, 4]
    for row in section["rows"]:
        n, world = row["elements"], row["ranks"]
        assert n == 1 << 20 and row["step_seconds"] > 0
        assert row["device_grad_bytes_in_per_step"] == 2 * n
        assert row["device_param_bytes_out_per_step"] == 2 * n * world
        assert sum(rank["shard_elements"] for rank in row["per_rank"]) == n
        assert sum(rank["grad_bytes"] for rank in row["per_rank"]) == 2 * n
    assert "Sharded AdamW (ZeRO-1) on one shared namespace" in (tmp_path / "b/bench.md").read_text()


def test_demo_refuses_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "demo", "--steps", "10", "--crash-at", "11")
    assert code == 2 and "--crash-at must be in 2..10" in err


def test_bench_runs_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`cossd bench` end to end on small sizes: every section measured and written."""
    code, out, err = run_cli(capsys, "bench", "--elements", "65536", "--file-elements", "65536",
                             "--repeat", "1", "--threads", "1", "--output", str(tmp_path / "b"))
    assert code == 0, out + err
    report = json.loads((tmp_path / "b/bench.json").read_text())
    kernel = report["kernel"][0]
    assert kernel["cossd_gels"] > 0 and kernel["torch_fused_gels"] > 0 and kernel["bandwidth_gbs"] > 0
    # Backing on the temporary directory, then on tmpfs where /dev/shm is one (media in RAM).
    # Each: buffered, O_DIRECT, and O_DIRECT with NaN gradients (skipped steps: the mount alone).
    # Then, on tmpfs, the two CMB steps in turns with the O_DIRECT file step.
    rows = [(row["o_direct"], row["media"].split()[0], row["skipped_steps"], row["front_end"].split(",")[0])
            for row in report["file_path"] if row["transport"] == "files"]
    cmb = [(row["transport"], row["media"].split()[0]) for row in report["file_path"] if row["transport"] != "files"]
    assert cmb in ([], [("cmb", "tmpfs"), ("cmb_in_place", "tmpfs"), ("execute_program", "tmpfs")])
    # The standard face's step beside the vendor one, turn by turn, where the CMB rows ran.
    assert all(row["vs_cmb_in_place"] > 0 for row in report["file_path"] if row["transport"] == "execute_program")
    assert all(row["vs_file_path"] > 0 and row["gels"] > 0 for row in report["file_path"] if row["transport"] != "files")
    assert bool(cmb) == (len(rows) > 3) and ("CMB_WRITE" in (tmp_path / "b/bench.md").read_text()) == bool(cmb)
    on_temp = bench.filesystem_of(Path(tempfile.gettempdir())).split()[0]
    path = "data path"
    assert rows[:3] == [(False, on_temp, False, path), (True, on_temp, False, path), (True, on_temp, True, path)]
    alone = "pyfuse3 alone"  # each O_DIRECT row of the data path, then the same in turns with pyfuse3 alone
    assert rows[3:] in ([], [(False, "tmpfs", False, path), (True, "tmpfs", False, path), (True, "tmpfs", False, alone),
                             (True, "tmpfs", True, path), (True, "tmpfs", True, alone)])
    assert all(row["data_path_speedup"] > 0 for row in report["file_path"] if row["front_end"] == alone)
    assert kernel["cossd_device_gels"] > 0 and kernel["device_update_vs_kernel"] > 0
    # The block update's own roofline (its streams out of place, trivial arithmetic).
    assert kernel["out_of_place_roofline_gels"] > 0 and kernel["out_of_place_vs_in_place_roofline"] > 0
    assert kernel["device_update_vs_out_of_place_roofline"] > 0
    assert "of its roofline" in (tmp_path / "b/bench.md").read_text()
    assert all(row["vs_device_update_in_memory"] > 0 for row in report["file_path"])
    assert set(report["checkpoint"]) == {"cossd commit (device flushes in background)",
                                         "torch.save + fsync", "DCP async_save"}
    assert report["restore"]["cossd params only"]["bytes"] == 2 * 65536
    assert (tmp_path / "b/bench.png").exists() and "| threads |" in (tmp_path / "b/bench.md").read_text()
    # The trainer side (on CPU here): resident AdamW with a per-step checkpoint vs offload.
    trainer = report["trainer"]
    assert trainer["device"] == "cpu" and trainer["elements"] == 65536
    resident = trainer["resident fused AdamW + torch.save checkpoint"]
    offload = trainer["cossd offload (AdamW on the drive)"]
    assert resident["step_seconds"] > 0 and resident["checkpoint_seconds"] > 0
    assert resident["bytes_over_link"] >= 12 * 65536  # master and both moments, through ext4
    assert offload["seconds"] > 0 and offload["bytes_over_link"] == 4 * 65536
    assert {"grads_s", "commit_s"} <= set(offload["phases_seconds"])
    # Through the device's memory buffer, not page-locked (that is for a GPU's copies).
    assert offload["transport"] == "cmb" and offload["cmb_pinned_for_cuda"] is False
    assert trainer["checkpoint_target"].startswith("ext4 on a plain NVM namespace")
    assert "Trainer side, on cpu" in (tmp_path / "b/bench.md").read_text()
    # And the offload again on a device whose media is in RAM, where /dev/shm is tmpfs.
    in_ram = trainer.get("cossd offload, the drive's media in RAM")
    files = trainer.get("cossd offload, media in RAM, through the tensor files")
    assert (in_ram is not None) == (files is not None) == bench.ram_workdir_available()
    assert in_ram is None or (in_ram["seconds"] > 0 and files["seconds"] > 0
                              and in_ram["bytes_over_link"] == files["bytes_over_link"] == 4 * 65536)
    assert in_ram is None or (in_ram["transport"], files["transport"]) == ("cmb", "files")
    # Whole iterations (forward, backward, step) of an MLP of about as many parameters.
    iterations = trainer["iterations"]
    rows = {name: row for name, row in iterations.items() if isinstance(row, dict)}
    assert len(rows) == 4 and all(row["seconds"] > 0 for row in rows.values())
    assert all(row["phases_seconds"]["forward_backward_s"] > 0 for row in rows.values())
    assert rows["resident fused AdamW (BF16 autocast) + torch.save checkpoint"]["phases_seconds"]["checkpoint_s"] > 0
    assert rows["cossd offload, gradients streamed during backward"]["state_on_trainer_bytes"] == 0
    assert "66,304 parameters" in iterations["model"] and "Whole iterations" in (tmp_path / "b/bench.md").read_text()


def test_bench_trainer_without_ext4_checkpoints_into_a_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no ext4 can be made on the bench's device (a container without loop devices; here
    mkfs.ext4 refuses an option), the trainer section still runs, its resident row
    checkpointing into a plain directory, and says so."""
    from cossd.harness import nvm_volume
    monkeypatch.setattr(nvm_volume, "MKFS_OPTIONS", ("--no-such-option",))
    code, out, err = run_cli(capsys, "bench", "--sections", "trainer", "--file-elements", "65536",
                             "--repeat", "1", "--output", str(tmp_path / "b"))
    assert code == 0, out + err
    assert "trainer checkpoints go to a plain directory" in out
    trainer = json.loads((tmp_path / "b/bench.json").read_text())["trainer"]
    assert trainer["checkpoint_target"].startswith("a plain directory (no ext4 on the device here: mkfs.ext4")
    resident = trainer["resident fused AdamW + torch.save checkpoint"]
    # The bytes this process wrote for each checkpoint: master and both moments, at least.
    assert resident["checkpoint_seconds"] > 0 and resident["bytes_over_link"] >= 12 * 65536
    assert "checkpoints go into a plain directory" in (tmp_path / "b/bench.md").read_text()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA device")
def test_bench_device_cuda_without_a_gpu_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "bench", "--sections", "trainer", "--device", "cuda",
                             "--output", str(tmp_path / "b"))
    assert code == 2 and "no CUDA device" in err and not (tmp_path / "b").exists()


def test_bench_net_section_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`cossd bench --sections net` on a tiny tensor: storage servers on loopback, the socket
    pair, the local steps and the I/O-path comparison, each a row in bench.json and bench.md."""
    code, out, err = run_cli(capsys, "bench", "--sections", "net", "--net-elements", "16384", "--repeat", "1",
                             "--output", str(tmp_path / "b"))
    assert code == 0, out + err
    report = json.loads((tmp_path / "b/bench.json").read_text())
    net = report["net"]
    assert net["bytes"] == 2 * 16384 and net["turns"] >= 1
    for name in ("gradient_write", "param_read"):
        assert net[name]["server_gbs"] > 0 and net[name]["tcp_gbs"] > 0 and net[name]["vs_tcp"] > 0
    assert all(net["step"][key] > 0 for key in ("server_seconds", "cmb_seconds", "file_seconds", "vs_cmb", "vs_file"))
    assert net["param_cache"]["measured"] in (True, False)
    fair = net["fairness"]  # eight clients at once: every one made progress
    assert fair["clients"] == 8 and min(fair["steps"]) > 0 and not fair["errors"] and fair["jain_index"] > 0
    assert "Fairness: 8 trainers at once" in (tmp_path / "b/bench.md").read_text()
    veth = net["veth"]  # the same wire across a veth pair between two network namespaces
    if os.geteuid() == 0 and shutil.which("ip"):
        assert veth["measured"], veth
        for name in ("gradient_write", "param_read"):
            assert veth[name]["server_gbs"] > 0 and veth[name]["tcp_gbs"] > 0
        assert veth["step_seconds"] > 0 and "across a real link" in (tmp_path / "b/bench.md").read_text()
    else:
        assert not veth["measured"] and "network namespaces unavailable" in veth["why"]
    iopath = report["iopath"]
    # The offloaded path moves 2 B of gradient in and 2 B of param out per parameter; the
    # conventional one the whole torch.save'd state (12 B per parameter and its framing).
    assert iopath["cossd"]["device_bytes_written"] == 2 * 16384 == iopath["cossd"]["device_bytes_read"]
    assert iopath["conventional"]["device_bytes_written"] == iopath["conventional"]["checkpoint_bytes"] > 12 * 16384
    assert iopath["cossd"]["wire_bytes"] >= 4 * 16384 and iopath["conventional"]["wire_bytes"] >= 12 * 16384
    ext4 = iopath["conventional_ext4"]  # the talk's path: ext4 on an NVM namespace, through the remote mount
    if os.geteuid() == 0:
        assert ext4["measured"] and ext4["device_bytes_written"] > 12 * 16384 and ext4["wire_bytes"] > 12 * 16384
    text = (tmp_path / "b/bench.md").read_text()
    assert "Through a storage server" in text and "I/O-path comparison" in text
