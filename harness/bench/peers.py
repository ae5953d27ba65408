"""`cossd bench --sections peers`: cossd beside what users run instead (ZeRO-Infinity's NVMe offload, ZeRO-Offload, resident AdamW with and without DCP async_save), on one GPT, one disk, the same threads, in alternating turns.

Each peer trains in a process of its own (peers_worker.py: DeepSpeed's state is
process-global), which is then killed with SIGKILL and followed by a restore process. One
cossd device serves the cossd row through its memory buffer, and a plain NVM namespace of it,
ext4 on a loop device, holds ZeRO-Infinity's second swap folder and the other peers'
checkpoints, so the drive counts their bytes; the first ZeRO-Infinity row swaps into the
backing disk itself, counted by /proc/diskstats. Pinned: the trainer on the first half of the
cores, the device daemon on the other half (on 2 cores: trainer core 0, daemon core 1), as a
computational SSD runs on its own controller cores; unpinned: everyone on every core.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from ...client import AdminClient
from ...emulator import Device
from ...fs import daemon

from .matmul_probe import matmul_rates
from .peers_model import model_check
from .peers_worker import COSSD_PEERS, RESULT_PREFIX, gpt_shape
from ..cgroups import disk_of
from ..measure import say
from ..nvm_volume import NvmVolume

PEERS: dict[str, str] = {
    "cossd": "(a) cossd, through the CMB",
    "cossd_streaming": "(a) cossd, through the CMB, gradients streamed as backward makes them",
    "cossd_streaming_ram": "(a) cossd, streamed, the device's media in RAM (tmpfs): no page-cache copies "
                           "or writeback on its cores",
    "cossd_streaming_bf16": "(a) cossd, streamed, BF16 moments (the talk's 16-bit optimizer state): 10 bytes "
                            "of media an element a step, not 14",
    "zero_infinity_disk": "(b) ZeRO-Infinity NVMe offload, ext4 on the backing disk",
    "zero_infinity_device": "(b) ZeRO-Infinity NVMe offload, ext4 on an NVM namespace of the device",
    "zero_offload": "(c) ZeRO-Offload (optimizer on the CPU)",
    "dcp_async": "(d) resident AdamW + DCP async_save (process) every step",
    "resident": "(e) resident AdamW, no checkpoint (the floor)",
}
DEEPSPEED_PEERS = ("zero_infinity_disk", "zero_infinity_device", "zero_offload")
VOLUME_NAME = "peers-volume"


@dataclasses.dataclass
class PeersSettings:
    """What the section runs; the tests make it tiny (one size of ~1M, 2 steps, one turn)."""

    sizes: tuple[int, ...] = (25_000_000, 100_000_000)
    steps: int = 5
    warmup: int = 2
    turns: int = 2
    placements: tuple[str, ...] = ("pinned", "unpinned")
    peers: tuple[str, ...] = tuple(PEERS)
    restore: bool = True
    worker_timeout_s: float = 1800.0  # DeepSpeed's first run JIT-builds its ops (minutes)


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed rows cannot run here (None: they can try)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (`make frameworks` installs deepspeed==0.19.8)"
    if not Path("/usr/include/libaio.h").exists():
        return "libaio-dev is missing (DeepSpeed's async_io op needs it; `make frameworks` installs it)"
    stale = stale_build_locks()
    if stale:
        return (f"{', '.join(map(str, stale))}: a JIT build of DeepSpeed's ops holds this lock, unchanged for over "
                f"{STALE_LOCK_S // 60} minutes; a build that was interrupted leaves it, and every later build waits "
                "on it for ever. Delete it where no build is running")
    return None


# A JIT build of DeepSpeed's ops takes a few minutes here (async_io about 5 on 2 busy cores); a
# lock untouched for as long as a worker may run at all was left by a build that was killed
# (torch's FileBaton is a bare file: no owner to ask).
STALE_LOCK_S = 1800


def stale_build_locks(now: float | None = None) -> list[Path]:
    """torch's JIT build locks (`lock` in each extension's build folder, under
    $TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/<python>_<build>/) older than STALE_LOCK_S."""
    base = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    now = time.time() if now is None else now
    found = []
    for lock in sorted([*base.glob("*/lock"), *base.glob("*/*/lock")]):
        with contextlib.suppress(OSError):  # gone meanwhile: its build finished
            if now - lock.stat().st_mtime > STALE_LOCK_S:
                found.append(lock)
    return found


def volume_bytes(sizes: tuple[int, ...]) -> int:
    """The NVM volume for the largest size: ZeRO-Infinity's swap (12-16 B/param) and its
    checkpoint's copy of it, or DCP's files; in whole MiB (a namespace's capacity is a multiple
    of 4 KiB, and 25M params x 48 B is not)."""
    return -(-max(256 << 20, 48 * max(sizes)) // (1 << 20)) << 20


def placements(name: str) -> tuple[list[int], list[int]]:
    """The trainer's cores and the device daemon's."""
    cores = sorted(os.sched_getaffinity(0))
    if name == "unpinned" or len(cores) < 2:
        return cores, cores
    half = len(cores) // 2
    return cores[:half], cores[half:]


def pin_process(pid: int, cores: list[int]) -> None:
    """Every thread of `pid` onto `cores` (threads made later inherit their maker's mask)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except ProcessLookupError:
            pass  # a thread that ended meanwhile


def reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: VmHWM back to the current VmRSS


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmHWM")


def disk_name(path: Path) -> str:
    """The /proc/diskstats name of the whole disk holding `path` ('vda')."""
    uevent = Path(f"/sys/dev/block/{disk_of(path)}/uevent").read_text()
    return next(line.split("=", 1)[1] for line in uevent.splitlines() if line.startswith("DEVNAME="))


# ---------------------------------------------------------------------- one worker


def run_worker(job: dict[str, Any], cores: list[int], log: Path, timeout_s: float) -> dict[str, Any]:
    """Start a worker on `cores`, wait for its result line; a train job is then killed with
    SIGKILL (its whole session: DCP's writer process too). Never raises: a worker that failed
    or hung gives {"ok": False, "why": ...}."""
    with open(log, "ab") as output:
        process = subprocess.Popen([sys.executable, "-m", "cossd.harness.bench.peers_worker", json.dumps(job)],
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=lambda: os.sched_setaffinity(0, cores))
    deadline = time.monotonic() + timeout_s
    result: dict[str, Any] | None = None
    try:
        while result is None:
            result = _result_in(log, job)
            if result is not None:
                break
            if process.poll() is not None:
                result = _result_in(log, job) or {"ok": False, "why": f"worker exited {process.returncode}: "
                                                                      + _tail(log)}
            elif time.monotonic() > deadline:
                result = {"ok": False, "why": f"no result in {timeout_s:.0f} s: " + _tail(log)}
            else:
                time.sleep(0.2)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # the kill -9 the restore comes back from
        process.wait()
    return result


def _result_in(log: Path, job: dict[str, Any]) -> dict[str, Any] | None:
    marker = RESULT_PREFIX + "{"
    for line in log.read_text(errors="replace").splitlines()[::-1]:
        if line.startswith(marker) and f'"job_id": "{job["job_id"]}"' in line:
            return json.loads(line[len(RESULT_PREFIX):])
    return None


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT ignored inside (main thread only; elsewhere Python delivers none), then restored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-400:]


# ---------------------------------------------------------------------- the section


class PeersDevice:
    """One cossd device the section mounts: its backing folder, its mount point, its daemon."""

    def __init__(self, backing: Path, mountpoint: Path) -> None:
        self.backing, self.mountpoint = backing, mountpoint
        self.mountpoint.mkdir()
        Device.format(self.backing)
        self.pid = daemon.start_background(self.backing, self.mountpoint)

    def stop(self) -> None:
        # The plain unmount fails while the kernel still holds a file of the mount (a loop
        # device being detached, a killed worker's mapping): then detach lazily, and as a last
        # resort kill the daemon, saying so rather than leaving a mount behind silently.
        if daemon.stop_background(self.mountpoint, self.pid, timeout_s=20):
            return
        say(f"  peers: the device at {self.mountpoint} did not unmount; detaching it lazily")
        if daemon.stop_background(self.mountpoint, self.pid, lazy=True, timeout_s=20):
            return
        say(f"  peers: the device daemon (pid {self.pid}) did not exit; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        daemon.wait_for_exit(self.pid, 10)


def tmpfs_folder(candidates: tuple[Path, ...] = (Path("/dev/shm"),)) -> Path | None:
    """A writable folder on tmpfs (the media of the RAM row's device), or None."""
    mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for folder in candidates:
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            continue
        resolved = str(folder.resolve())
        # The filesystem of a folder is that of the longest mount point above it.
        under = [(point, kind) for point, kind in mounts
                 if resolved == point or resolved.startswith(point.rstrip("/") + "/")]
        if under and max(under, key=lambda mount: len(mount[0]))[1] == "tmpfs":
            return folder
    return None


class PeersRun:
    """The devices, the volume and the directories one run of the section uses.

    The device on the backing disk serves the cossd rows and holds the NVM volume. The RAM
    row ("cossd_streaming_ram") gets a device of its own whose backing is on tmpfs: its state
    copies are then mapped memory, so its core does the step (Adam, checksums, commit) but no
    page-cache copies or writeback, as a drive's flash controller moves the media's bytes
    with DMA, not with the cores that run the kernel.
    """

    def __init__(self, workdir: Path, settings: PeersSettings) -> None:
        self.workdir, self.settings = workdir, settings
        self.logs = workdir / "logs"
        self.logs.mkdir()
        self.device = PeersDevice(workdir / "backing", workdir / "mnt")
        self.mountpoint = self.device.mountpoint
        self.ram_device: PeersDevice | None = None
        self.ram_folder: Path | None = None
        self.ram_missing: str | None = None
        self.volume: NvmVolume | None = None
        self.jobs = 0
        try:
            self.disk = disk_name(workdir)
            if "cossd_streaming_ram" in settings.peers:
                self._start_ram_device()
        except BaseException:
            self.close()
            raise

    def _start_ram_device(self) -> None:
        tmpfs = tmpfs_folder()
        if tmpfs is None:
            self.ram_missing = "no writable tmpfs folder (/dev/shm) for the device's media in RAM"
            return
        self.ram_folder = Path(tempfile.mkdtemp(prefix="cossd-peers-ram-", dir=tmpfs))
        try:
            self.ram_device = PeersDevice(self.ram_folder / "backing", self.workdir / "mnt-ram")
        except Exception as exc:  # noqa: BLE001 - its row says why; the other rows still run
            self.ram_missing = f"the device with its media in RAM did not start: {type(exc).__name__}: {exc}"[:300]
            shutil.rmtree(self.ram_folder, ignore_errors=True)
            self.ram_folder = None

    def device_of(self, peer: str) -> PeersDevice:
        """The device that serves `peer`'s namespace (cossd rows) or its volume (the rest)."""
        if peer == "cossd_streaming_ram" and self.ram_device is not None:
            return self.ram_device
        return self.device

    def open_volume(self) -> NvmVolume:
        self.volume = NvmVolume(self.mountpoint, VOLUME_NAME, volume_bytes(self.settings.sizes),
                                self.workdir / "volume").open()
        return self.volume

    def close(self) -> None:
        """Unmount the volume and the devices and stop their daemons, on every exit path.
        Ctrl-C is held off meanwhile: one interrupting this would leave a device mounted on a
        folder the runner then deletes (the run itself was already interrupted)."""
        with _interrupts_held():
            try:
                if self.volume is not None:
                    self.volume.close()
            finally:
                try:
                    if self.ram_device is not None:
                        self.ram_device.stop()
                finally:
                    if self.ram_folder is not None:
                        shutil.rmtree(self.ram_folder, ignore_errors=True)  # RAM, not disk: never left behind
                    self.device.stop()

    def job(self, peer: str, size: int, threads: int, namespace: str) -> dict[str, Any]:
        """The worker's job for `peer`: where it swaps, checkpoints, and what counts its bytes."""
        assert self.volume is not None
        self.jobs += 1
        on_volume = {"kind": "namespace", "mount": str(self.mountpoint), "namespace": VOLUME_NAME}
        mount = str(self.device_of(peer).mountpoint)
        job: dict[str, Any] = {"peer": peer, "params": size, "threads": threads, "steps": self.settings.steps,
                               "warmup": self.settings.warmup, "job_id": f"{peer}-{self.jobs}",
                               "mount": mount, "namespace": namespace, "counter": on_volume,
                               "checkpoint_dir": str(self.volume.path / "checkpoint")}
        if peer in COSSD_PEERS:
            job["counter"] = {"kind": "namespace", "mount": mount, "namespace": namespace}
        elif peer == "zero_infinity_disk":
            job |= {"nvme_dir": str(self.workdir / "swap"), "checkpoint_dir": str(self.workdir / "checkpoint"),
                    "counter": {"kind": "diskstats", "disk": self.disk}}
        elif peer == "zero_infinity_device":
            job["nvme_dir"] = str(self.volume.path / "swap")
        return job

    def clean(self, job: dict[str, Any]) -> None:
        """What a turn left: its swap and checkpoint folders, its cossd namespace."""
        for key in ("nvme_dir", "checkpoint_dir"):
            if job.get(key):
                shutil.rmtree(job[key], ignore_errors=True)
        if job["peer"] in COSSD_PEERS:
            with AdminClient(Path(job["mount"])) as admin:
                try:
                    admin.delete_namespace(admin.nsid(job["namespace"]))
                except Exception:  # noqa: BLE001 - a worker that failed early made none
                    pass

    def turn(self, peer: str, size: int, placement: str, turn: int, restore: bool) -> dict[str, Any]:
        """One peer's turn: train (timed steps, a save), kill -9, and (if asked) restore."""
        if peer == "cossd_streaming_ram" and self.ram_missing:
            return {"ok": False, "why": self.ram_missing}
        trainer_cores, device_cores = placements(placement)
        device = self.device_of(peer)
        pin_process(device.pid, device_cores)
        namespace = f"peers-{size}-{placement}-{turn}"
        job = self.job(peer, size, len(trainer_cores), namespace)
        if peer in COSSD_PEERS:  # the device's CPU time per step, for the model check
            job |= {"device_pid": device.pid, "device_cores": len(device_cores)}
        log = self.logs / f"{job['job_id']}.log"
        reset_peak_rss(device.pid)
        trained = run_worker(job | {"mode": "train", "wait_for_kill": restore}, trainer_cores, log,
                             self.settings.worker_timeout_s)
        trained["storage_peak_rss_bytes"] = peak_rss(device.pid)
        if restore and trained.get("ok") and peer != "resident":
            reset_peak_rss(device.pid)
            restored = run_worker(job | {"mode": "restore", "job_id": job["job_id"] + "-restore"}, trainer_cores,
                                  log, self.settings.worker_timeout_s)
            restored["storage_peak_rss_bytes"] = peak_rss(device.pid)
            trained["restore"] = restored
        self.clean(job)
        return trained


def peers_costs(workdir: Path, settings: PeersSettings | None = None) -> dict[str, Any]:
    """Every peer at every size and placement, in alternating turns; rows and the model check."""
    settings = settings or PeersSettings()
    missing = deepspeed_missing()
    compute = matmul_rates()
    if compute["warning"]:
        say(f"  peers: {compute['warning']}")
    run = PeersRun(workdir, settings)
    report: dict[str, Any] = {
        "settings": dataclasses.asdict(settings), "labels": {p: PEERS[p] for p in settings.peers},
        "disk": run.disk, "sizes": {}, "cores": sorted(os.sched_getaffinity(0)),
        "placements": {name: dict(zip(("trainer_cores", "device_cores"), placements(name)))
                       for name in settings.placements},
        "compute": compute,
    }
    try:
        run.open_volume()
        for size in settings.sizes:
            by_placement: dict[str, Any] = {}
            for placement in settings.placements:
                turns: dict[str, list[dict[str, Any]]] = {peer: [] for peer in settings.peers}
                for turn in range(settings.turns):
                    # Alternating order: the first peer of one turn is the last of the next, so a
                    # drift of the machine's load does not favour one side.
                    order = settings.peers if turn % 2 == 0 else settings.peers[::-1]
                    for peer in order:
                        if peer in DEEPSPEED_PEERS and missing:
                            turns[peer].append({"ok": False, "why": missing})
                            continue
                        last = turn == settings.turns - 1
                        result = run.turn(peer, size, placement, turn, restore=settings.restore and last)
                        turns[peer].append(result)
                        say(f"  peers {size / 1e6:.0f}M {placement}, {peer}: "
                            + (f"{statistics.median(result['step_seconds']):.3f} s/step" if result.get("ok")
                               else f"could not run: {result.get('why')}"))
                by_placement[placement] = {peer: summarize(peer, runs) for peer, runs in turns.items()}
            report["sizes"][str(size)] = {"shape": gpt_shape(size), "placements": by_placement,
                                          "breakdown": {p: {peer: cossd_breakdown(rows.get(peer))
                                                            for peer in COSSD_PEERS if peer in rows}
                                                        for p, rows in by_placement.items()}}
    finally:
        run.close()
    report["model_check"] = model_check(report, workdir)
    return report


def summarize(peer: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from a peer's turns: pooled step times (median, spread), per-step bytes, the
    last turn's checkpoint and restore; or why it could not run."""
    good = [run for run in runs if run.get("ok")]
    if not good:
        return {"ok": False, "why": runs[-1].get("why", "no turn ran") if runs else "not run"}
    seconds = sorted(s for run in good for s in run["step_seconds"])
    quartiles = statistics.quantiles(seconds, n=4, method="inclusive") if len(seconds) > 1 else [seconds[0]] * 3
    last = good[-1]
    row: dict[str, Any] = {
        "ok": True, "turns": len(good), "parameters": last["parameters"],
        "step_s": {"median": statistics.median(seconds), "p25": quartiles[0], "p75": quartiles[2],
                   "min": seconds[0], "max": seconds[-1], "samples": len(seconds)},
        "phases_s": {key: statistics.median(run["phases_seconds"][key] for run in good)
                     for key in last["phases_seconds"]},
        "storage_bytes_per_step": _median_or_none([run["storage_bytes_per_step"] for run in good]),
        "checkpoint": last["checkpoint"],
        "trainer_peak_rss_bytes": max(run["trainer_peak_rss_bytes"] for run in good),
        "storage_peak_rss_bytes": (max(run["storage_peak_rss_bytes"] for run in good)
                                   if peer != "zero_infinity_disk" else None),
    }
    if peer == "zero_infinity_disk":
        row["storage_side"] = "the kernel's block layer (no process of its own)"
    if "device_seconds_per_step" in last:
        row["device_seconds_per_step"] = {key: statistics.median(run["device_seconds_per_step"][key] for run in good)
                                          for key in last["device_seconds_per_step"]}
        row["transport"] = last.get("transport")
        row["state_writes"] = last.get("state_writes")  # "mapped": the media in RAM (tmpfs)
        row["state_dtype"] = last.get("state_dtype")
        row["media_bytes_per_step"] = _median_or_none([run.get("media_bytes_per_step") for run in good])
    restore = last.get("restore")
    if peer == "resident":
        row["restore"] = {"ok": False, "why": "no checkpoint: nothing to restore"}
    elif restore is not None:
        row["restore"] = restore
    return row


def _median_or_none(values: list[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def cossd_breakdown(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """Where a cossd iteration's time goes, per step (medians), as the trainer's clock and the
    device's own counters see it."""
    if not row or not row.get("ok"):
        return None
    phases, device = row["phases_s"], row.get("device_seconds_per_step", {})
    grads = phases.get("cossd_grads_s", 0.0)
    return {
        "forward_backward_s": phases["forward_backward_s"],
        "optimizer_s": phases["optimizer_s"],
        # BEGIN_STEP, then the gradients into the CMB and CMB_WRITE, which returns once the
        # device has run the step's block updates.
        "begin_s": phases.get("cossd_begin_s"),
        "grads_out_and_device_step_s": grads,
        "device_block_updates_s": device.get("block_updates"),  # Adam + stores into the media, summed over threads
        "device_cpu_s": device.get("cpu"),  # the daemon's CPU time, all its threads
        "device_flushes_s": device.get("flushes"),
        "commit_s": phases.get("cossd_commit_s"),
        "params_back_and_copies_s": phases.get("cossd_params_s"),
        "optimizer_other_s": phases["optimizer_s"] - sum(phases.get(k, 0.0) for k in
                                                          ("cossd_begin_s", "cossd_grads_s", "cossd_commit_s",
                                                           "cossd_params_s")),
    }
