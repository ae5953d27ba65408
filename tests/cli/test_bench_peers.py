"""`cossd bench --sections peers` at a tiny size (~1M params, 2 steps): the report's structure, a figure or a reason in every row; no timing assertions."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from cossd.harness import bench
from cossd.harness.bench import matmul_probe, peers as bench_peers
from cossd.harness.bench.peers import PeersSettings, run_worker, summarize
from cossd.harness.bench.peers_report import markdown, markdown_rows
from cossd.trainer.options import add_bench_arguments
from helpers import run_cli

pytestmark = pytest.mark.mount

TINY = 1 << 20


def _args(output: Path, settings: PeersSettings) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--sections", "peers", "--output", str(output)])
    args.peers = settings
    return args


def _check_row(peer: str, row: dict) -> None:
    """A row that ran has every figure; one that did not says why."""
    if not row["ok"]:
        assert isinstance(row["why"], str) and row["why"], peer
        return
    assert row["parameters"] > 0.5 * TINY
    step = row["step_s"]
    assert 0 < step["min"] <= step["p25"] <= step["median"] <= step["p75"] <= step["max"], peer
    assert row["storage_bytes_per_step"] is not None and row["storage_bytes_per_step"] >= 0, peer
    assert set(row["checkpoint"]) >= {"stall_s", "bytes", "note", "storage_bytes"}, peer
    assert row["trainer_peak_rss_bytes"] > 0
    assert (row["storage_peak_rss_bytes"] is None) == (peer == "zero_infinity_disk"), peer
    restore = row["restore"]
    assert restore["ok"] == (peer != "resident"), (peer, restore)
    if restore["ok"]:
        assert restore["seconds"] > 0 and restore["storage_bytes"] is not None, peer


@pytest.mark.slow  # a device, an ext4 volume and four worker processes: over a minute on 2 cores
def test_cossd_and_floor_rows(tmp_path: Path) -> None:
    """cossd through the CMB (gradients at once, streamed, streamed with BF16 moments, and
    streamed into a device whose media is in RAM) and the resident floor, one pinned turn: the
    device counted each cossd step's 4 B/param on its link and its 14 (10 with BF16 moments)
    on its media, and the restore after the kill -9 read the params."""
    settings = PeersSettings(sizes=(TINY,), steps=2, warmup=1, turns=1, placements=("pinned",),
                             peers=("cossd", "cossd_streaming", "cossd_streaming_ram", "cossd_streaming_bf16",
                                    "resident"))
    report = bench_peers.peers_costs(tmp_path, settings)
    rows = report["sizes"][str(TINY)]["placements"]["pinned"]
    for peer, row in rows.items():
        assert row["ok"], row
        _check_row(peer, row)
    for peer in ("cossd", "cossd_streaming", "cossd_streaming_ram", "cossd_streaming_bf16"):
        cossd = rows[peer]
        params = cossd["parameters"]
        # The device's media, per step: the FP32 master, both moments and the param (14 B an
        # element with FP32 moments, 10 with BF16), and a superblock.
        per_param = 10 if peer == "cossd_streaming_bf16" else 14
        assert cossd["state_dtype"] == ("bf16" if peer == "cossd_streaming_bf16" else "fp32"), peer
        assert per_param * params <= cossd["media_bytes_per_step"] < (per_param + 0.5) * params, peer
        assert cossd["transport"] == "cmb", peer
        # The RAM row's device keeps its state on tmpfs, mapped; the others on the disk's ext4.
        assert cossd["state_writes"] == ("mapped" if peer == "cossd_streaming_ram" else "pwrite"), peer
        # BF16 gradients out and BF16 params back: 4 B per parameter over the device's link.
        assert cossd["storage_bytes_per_step"] == pytest.approx(4 * params, rel=0.01), peer
        assert cossd["checkpoint"]["bytes"] == 0 and cossd["checkpoint"]["storage_bytes"] == 0
        assert cossd["restore"]["storage_bytes"] >= 2 * params  # the params, read back
        breakdown = report["sizes"][str(TINY)]["breakdown"]["pinned"][peer]
        assert breakdown["device_block_updates_s"] > 0 and breakdown["params_back_and_copies_s"] > 0
        # The daemon's CPU time over the timed steps, and the cores pinned gives it.
        assert breakdown["device_cpu_s"] > 0
        assert cossd["device_seconds_per_step"]["cores"] == len(bench_peers.placements("pinned")[1])
    assert report["sizes"][str(TINY)]["breakdown"]["pinned"]["cossd"]["grads_out_and_device_step_s"] > 0
    assert rows["resident"]["storage_bytes_per_step"] == 0
    # ZeRO-Infinity did not run: the model check says so instead of inventing a ratio.
    assert "why" in report["model_check"]["checks"][f"{TINY} pinned"]
    assert 1.0 < report["model_check"]["projection"][0]["speedup"]
    assert any("cossd" in line for line in markdown_rows(report))


def test_a_peer_that_cannot_run_gets_its_reason(tmp_path: Path) -> None:
    """A worker that fails reports why, and the row and the table carry it; nothing raises."""
    job = {"peer": "no-such-peer", "mode": "train", "job_id": "x-1", "params": TINY, "threads": 1,
           "steps": 1, "warmup": 0}
    result = run_worker(job, sorted(bench_peers.placements("unpinned")[0]), tmp_path / "log", 120)
    assert result == {"ok": False, "job_id": "x-1", "why": "ValueError: unknown peer 'no-such-peer'"}
    row = summarize("zero_offload", [result])
    assert row == {"ok": False, "why": result["why"]}
    section = {"labels": {"zero_offload": "(c)"}, "sizes": {str(TINY): {"placements": {"pinned": {"zero_offload": row}}}}}
    assert "did not run: ValueError" in markdown_rows(section)[-1]


def test_tmpfs_folder(tmp_path: Path) -> None:
    """The RAM row's media goes on tmpfs only: /dev/shm here, never a disk's folder."""
    assert bench_peers.tmpfs_folder() == Path("/dev/shm")
    assert bench_peers.tmpfs_folder((tmp_path, Path("/no/such/folder"))) is None


def test_the_ram_row_says_why_it_cannot_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tmpfs, or a RAM device that does not start: its row carries the reason and the run
    goes on with the device on the disk; nothing is left in /dev/shm."""
    settings = PeersSettings(sizes=(TINY,), steps=1, warmup=0, turns=1, placements=("pinned",),
                             peers=("cossd_streaming_ram",))
    monkeypatch.setattr(bench_peers, "tmpfs_folder", lambda: None)
    (tmp_path / "a").mkdir()
    run = bench_peers.PeersRun(tmp_path / "a", settings)
    try:
        assert run.ram_missing is not None and "no writable tmpfs folder" in run.ram_missing
        assert run.turn("cossd_streaming_ram", TINY, "pinned", 0, restore=False) == {"ok": False,
                                                                                    "why": run.ram_missing}
    finally:
        run.close()
    monkeypatch.undo()
    made: list[Path] = []
    real_init = bench_peers.PeersDevice.__init__

    def full_shm(device: bench_peers.PeersDevice, backing: Path, mountpoint: Path) -> None:
        if backing.parent.parent == Path("/dev/shm"):
            made.append(backing.parent)
            raise OSError(28, "No space left on device")
        real_init(device, backing, mountpoint)

    monkeypatch.setattr(bench_peers.PeersDevice, "__init__", full_shm)
    (tmp_path / "b").mkdir()
    run = bench_peers.PeersRun(tmp_path / "b", settings)
    try:
        assert run.ram_device is None and run.ram_missing is not None
        assert "did not start: OSError" in run.ram_missing and "No space left" in run.ram_missing
        assert made and not made[0].exists()  # its folder in RAM removed at once
    finally:
        run.close()


def test_disk_probe_rewrites_a_written_file_as_deepspeeds_swap_does(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's disk rates: the write is a rewrite of blocks already written, in O_DIRECT
    1 MiB requests (DeepSpeed never truncates its swap files), the read reads them back; the
    first write is reported too. Only the requests are checked, not their speed."""
    from cossd.harness.bench import peers_model

    monkeypatch.setattr(peers_model, "PROBE_BYTES", 4 << 20)
    calls: list[tuple[str, int]] = []
    real_write, real_read = peers_model.os.pwritev, peers_model.os.preadv
    monkeypatch.setattr(peers_model.os, "pwritev",
                        lambda fd, buffers, offset: calls.append(("w", offset)) or real_write(fd, buffers, offset))
    monkeypatch.setattr(peers_model.os, "preadv",
                        lambda fd, buffers, offset: calls.append(("r", offset)) or real_read(fd, buffers, offset))
    rates = peers_model.disk_rates(tmp_path)
    blocks = [i << 20 for i in range(4)]
    assert calls == [("w", o) for o in blocks] * 2 + [("r", o) for o in blocks]
    assert set(rates) == {"write_bytes_per_s", "read_bytes_per_s", "first_write_bytes_per_s"}
    assert all(rate > 0 for rate in rates.values()) and not list(tmp_path.iterdir())


def test_volume_fits_and_is_whole_mib() -> None:
    """25M params x 48 B is not a multiple of 4 KiB: the namespace would be refused."""
    for sizes in ((TINY,), (25_000_000,), (25_000_000, 100_000_000)):
        size = bench_peers.volume_bytes(sizes)
        assert size % (1 << 20) == 0 and size >= 48 * max(sizes)


def test_bench_cli_refuses_a_bad_size(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "bench", "--sections", "peers", "--peers-params", "0")
    assert code != 0 and "sizes are counts" in out + err


@pytest.mark.slow
def test_peers_section_tiny(tmp_path: Path) -> None:
    """Every peer (the DeepSpeed ones where DeepSpeed and libaio are here; each its reason if
    not) at ~1M params, pinned and unpinned, through `cossd bench`'s own run()."""
    output = tmp_path / "out"
    settings = PeersSettings(sizes=(TINY,), steps=2, warmup=1, turns=1)
    assert bench.run(_args(output, settings)) == 0
    peers = json.loads((output / "bench.json").read_text())["peers"]
    assert (output / "peers.png").stat().st_size > 0
    # bench.md (also printed) carries the table and the model check's lines.
    markdown = (output / "bench.md").read_text()
    assert bench_peers.PEERS["resident"] in markdown and "- model check, 1M pinned:" in markdown
    for placement in ("pinned", "unpinned"):
        rows = peers["sizes"][str(TINY)]["placements"][placement]
        assert set(rows) == set(bench_peers.PEERS)
        for peer, row in rows.items():
            _check_row(peer, row)
        assert rows["cossd"]["ok"] and rows["resident"]["ok"] and rows["dcp_async"]["ok"]
        if bench_peers.deepspeed_missing() is None:
            assert rows["zero_infinity_disk"]["ok"], rows["zero_infinity_disk"]
            check = peers["model_check"]["checks"][f"{TINY} {placement}"]
            assert check["measured_ratio"] > 0 and "error" in check
            assert check["inputs"]["device_rate_source"].startswith("the daemon's CPU time"), check
        else:
            assert rows["zero_offload"]["why"] == bench_peers.deepspeed_missing()


def test_a_cpu_whose_bf16_matmul_is_slow_is_named_in_the_report() -> None:
    """Where torch's BF16 matmul runs far below FP32 (a CPU without BF16 matrix instructions),
    every row's step is its BF16 forward and backward: the section's report says so, above its
    table, rather than print ratios that look like a result. The probe measures both rates."""
    rates = matmul_probe.matmul_rates()
    assert rates["fp32_gflops"] > 0 and rates["bf16_gflops"] > 0 and rates["cpu_capability"]
    assert (rates["warning"] is None) == (rates["bf16_gflops"] * matmul_probe.SLOW_FACTOR > rates["fp32_gflops"])
    slow = {"fp32_gflops": 60.0, "bf16_gflops": 1.0, "cpu_capability": "AVX2"}
    warning = matmul_probe.slow_bf16_warning(slow)
    assert warning is not None and "60x slower" in warning and "AVX2" in warning
    assert matmul_probe.slow_bf16_warning({"fp32_gflops": 60.0, "bf16_gflops": 40.0}) is None
    section = {"settings": {"steps": 1, "warmup": 0, "turns": 1}, "placements": {}, "disk": "vda",
               "labels": {}, "sizes": {}, "compute": slow | {"warning": warning}}
    assert f"**{warning}.**" in markdown(section)


def test_a_build_lock_left_by_a_killed_jit_build_refuses_the_deepspeed_rows(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A DeepSpeed JIT build killed part way leaves torch's lock file, and every later build
    waits on it for ever (a peers run then hung until its worker's 30-minute timeout): an old
    lock gives the DeepSpeed rows a reason naming it; a fresh one (a build running) does not."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / "async_io").mkdir()
    lock = tmp_path / "async_io" / "lock"
    lock.touch()
    assert bench_peers.stale_build_locks() == []
    now = lock.stat().st_mtime + bench_peers.STALE_LOCK_S + 1
    assert bench_peers.stale_build_locks(now) == [lock]
    monkeypatch.setattr(bench_peers, "stale_build_locks", lambda: [lock])
    why = bench_peers.deepspeed_missing()
    if why is not None and str(lock) not in why:  # DeepSpeed or libaio missing here: that reason comes first
        assert "DeepSpeed is not installed" in why or "libaio-dev" in why
    else:
        assert why is not None and str(lock) in why and "Delete it" in why
