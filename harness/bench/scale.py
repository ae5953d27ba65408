"""`cossd bench --sections scale`: one step through the CMB and through the files at growing sizes, with the daemon's memory and the disk's own speed."""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...client import AdminClient
from ...emulator import Device
from ...emulator.cmb import parallel_copy
from ...emulator.layout import BLOCK_ELEMS
from ...emulator.workers import KernelWorkers
from ...fs import daemon

from .device import BenchDevice, filesystem_of
from ..measure import say

# Bytes of gradient (and of params) the bench holds at once: the client never holds a whole
# tensor, so its own memory stays flat while the state grows past RAM.
CLIENT_CHUNK = 128 << 20
FILE_PIECE = 4 << 20  # the file path's pwrite/pread size, as mount.py's
# Room on the disk left beside the state (the daemon's logs, the dd probe, other users).
DISK_MARGIN = 4 << 30
# State bytes per element of one copy (FP32 master and moments, FP16 param: media-format.md).
STATE_BYTES_PER_ELEMENT = 14


def turns_for(n: int) -> int:
    """Timed steps per transport: enough to take a median where a step is quick, few where
    each one moves tens of GB through the disk."""
    return 15 if n <= 1 << 24 else 5 if n <= 1 << 28 else 3


def memory_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def _status_kib(pid: int) -> dict[str, int]:
    """VmHWM and the resident set's parts of `pid`, in bytes (from /proc/PID/status)."""
    found = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                found[key] = int(value.split()[0]) * 1024
    return found


class RssSampler:
    """Polls the daemon's /proc status while it works: VmHWM is the peak of the whole resident
    set, and the peaks of its parts say what made it (anonymous memory, mapped state files, the
    CMB's shared pages). Each sample also counts towards the phase running then (`phase`: the
    transport stepping), since the two transports step one daemon, one after the other."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.phase = "setup"
        self.peaks: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        """One reading now (also called at the end of each step: a quick step may fall
        between two of the poller's)."""
        try:
            values = _status_kib(self.pid)
        except OSError:
            return
        with self._lock:
            for phase in ("all", self.phase):
                peaks = self.peaks.setdefault(phase, {})
                for key, value in values.items():
                    peaks[key] = max(peaks.get(key, 0), value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    @staticmethod
    def _named(peaks: dict[str, int]) -> dict[str, int]:
        return {"peak_rss": peaks.get("VmRSS", 0), "peak_anon": peaks.get("RssAnon", 0),
                "peak_file": peaks.get("RssFile", 0), "peak_shmem": peaks.get("RssShmem", 0)}

    def stop(self, phases: tuple[str, ...]) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        self.sample()  # VmHWM is the kernel's own peak: the last reading holds it
        overall = self.peaks.get("all", {})
        return {"vm_hwm": overall.get("VmHWM", 0), **self._named(overall),
                "by_transport": {phase: self._named(self.peaks.get(phase, {})) for phase in phases}}


class ScaleDevice(BenchDevice):
    """A bench device whose set-up is timed in parts: the daemon's start-up until the mount is
    ready (on a freshly formatted, empty device), then creating the namespace (which
    preallocates both state copies)."""

    def __init__(self, workdir: Path, n: int) -> None:
        self.backing, self.mountpoint = workdir / "backing", workdir / "mnt"
        self.mountpoint.mkdir()
        Device.format(self.backing)
        started = time.perf_counter()
        self.pid = daemon.start_background(self.backing, self.mountpoint)
        self.mount_seconds = time.perf_counter() - started
        self.front_end = f"data path, {daemon.io_threads_from_env()} threads"
        started = time.perf_counter()
        try:
            with AdminClient(self.mountpoint) as admin:
                admin.create_namespace({"name": "bench", "tensors": [["w", n]]})
        except BaseException:
            self.stop()  # no daemon left mounted behind a failed set-up
            raise
        self.create_seconds = time.perf_counter() - started
        self.tensor = self.mountpoint / "ns" / "bench" / "tensors" / "w"
        self.n = n


def _gradients(elements: int) -> np.ndarray:
    """FP16 gradients of one client chunk, as bytes (reused for every chunk of the tensor)."""
    values = np.random.default_rng(1).standard_normal(elements, dtype=np.float32) * np.float32(0.01)
    return values.astype(np.float16).view(np.uint8)


def file_step(device: BenchDevice) -> tuple[Callable[[], None], Callable[[], None]]:
    """O_DIRECT pwrites of the FP16 gradients in 4 MiB pieces (the last commits the step),
    then preads of the FP16 params, through one page-aligned chunk buffer each way."""
    size = 2 * device.n
    chunk = min(size, CLIENT_CHUNK)
    grads, params = mmap.mmap(-1, chunk), mmap.mmap(-1, chunk)  # page aligned, as O_DIRECT wants
    grads.write(_gradients(chunk // 2).tobytes())
    grad_view, param_view = memoryview(grads), memoryview(params)

    def step() -> None:
        fd = os.open(device.tensor / "grad", os.O_WRONLY | os.O_DIRECT)
        try:
            for offset in range(0, size, FILE_PIECE):
                length = min(FILE_PIECE, size - offset)
                at = offset % chunk
                os.pwrite(fd, grad_view[at : at + length], offset)
        finally:
            os.close(fd)
        fd = os.open(device.tensor / "param", os.O_RDONLY | os.O_DIRECT)
        try:
            offset = 0
            while offset < size:
                at = offset % chunk
                got = os.preadv(fd, [param_view[at : at + min(FILE_PIECE, size - offset)]], offset)
                if got <= 0:
                    raise OSError(f"{device.tensor / 'param'}: short read at {offset}")
                offset += got
        finally:
            os.close(fd)

    def close() -> None:
        grad_view.release()
        param_view.release()
        grads.close()
        params.close()

    return step, close


def cmb_step(device: BenchDevice) -> tuple[Callable[[], None], Callable[[], None]]:
    """cossd.trainer's path: per CMB-sized chunk, the client copies its gradients into the
    CMB, one CMB_WRITE (with param_cmb_offset: the kernel puts the new params in the CMB as it
    computes them) and the client copies the params out. The last chunk's command commits
    the step."""
    size = 2 * device.n
    admin = AdminClient(device.mountpoint)
    cmb = admin.cmb()
    if cmb is None:
        admin.close()
        raise RuntimeError(f"{device.mountpoint}: the device has no controller memory buffer")
    # Whole 256K-element blocks per command, so every block's kernel runs within one command.
    chunk = min(size, CLIENT_CHUNK, (cmb.size // 2) // (2 * BLOCK_ELEMS) * (2 * BLOCK_ELEMS))
    nsid = admin.nsid("bench")
    grads = _gradients(chunk // 2)
    params = np.empty(chunk, dtype=np.uint8)
    workers = KernelWorkers("cossd-bench-scale-copy")

    def step() -> None:
        for offset in range(0, size, chunk):
            length = min(chunk, size - offset)
            parallel_copy(cmb.array[:length], grads[:length], workers)
            admin.cmb_write(nsid, [{"tensor": "w", "offset": offset, "length": length, "cmb_offset": 0,
                                    "param_cmb_offset": chunk}])
            parallel_copy(params[:length], cmb.array[chunk : chunk + length], workers)

    def close() -> None:
        workers.shutdown()
        cmb.close()
        admin.close()

    return step, close


def _counters(device: BenchDevice) -> dict[str, int]:
    stats = json.loads((device.mountpoint / "ns" / "bench" / "stats.json").read_text())
    return {"host_in": stats["grad_bytes_in"], "host_out": stats["param_bytes_out"],
            "media_written": stats["media_bytes_written"], "media_read": stats["model"]["media_read_bytes"],
            "committed": stats["steps_committed"]}


def _transport_row(seconds: list[float], moved: dict[str, int], n: int, turns: int) -> dict[str, Any]:
    median = float(np.median(seconds))
    per_step = {key: value / turns for key, value in moved.items()}
    return {"seconds": median, "min_seconds": min(seconds), "max_seconds": max(seconds), "gels": n / median / 1e9,
            "host_bytes_per_step": per_step["host_in"] + per_step["host_out"],
            "host_in_bytes_per_step": per_step["host_in"], "host_out_bytes_per_step": per_step["host_out"],
            "media_written_bytes_per_step": per_step["media_written"],
            "media_read_bytes_per_step": per_step["media_read"],
            "steps_committed": moved["committed"]}


def measure_size(workdir: Path, n: int, turns: int) -> tuple[dict[str, Any], ScaleDevice]:
    """A fresh device (a new daemon) with one n-element namespace: the mount's start-up, then
    the CMB steps, then the file steps, the bytes the device counted for each, and the daemon's
    peak memory. Returns the row and the device, still mounted (the restore runs on it)."""
    device = ScaleDevice(workdir, n)
    try:
        return _measure(device, n, turns), device
    except BaseException:
        device.stop()  # the caller gets no device to stop
        raise


def _measure(device: ScaleDevice, n: int, turns: int) -> dict[str, Any]:
    sampler = RssSampler(device.pid)
    steps: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}
    try:
        steps = {"cmb": cmb_step(device), "files": file_step(device)}
        seconds: dict[str, list[float]] = {name: [] for name in steps}
        first: dict[str, float] = {}
        moved = {name: {"host_in": 0, "host_out": 0, "media_written": 0, "media_read": 0, "committed": 0}
                 for name in steps}
        # One transport's steps after the other's, not in turns: what the daemon's allocator
        # keeps from the file path's requests would otherwise count as the CMB path's memory.
        # The CMB first, so its peak is its own.
        for name, (step, _) in steps.items():
            sampler.sample()
            sampler.phase = name
            begun = time.perf_counter()
            step()  # untimed in the median: the first step also finds the state's pages cold
            first[name] = time.perf_counter() - begun
            for _ in range(turns):
                before = _counters(device)
                begun = time.perf_counter()
                step()
                seconds[name].append(time.perf_counter() - begun)
                sampler.sample()
                after = _counters(device)
                for key in moved[name]:
                    moved[name][key] += after[key] - before[key]
    finally:
        for _, close in steps.values():
            close()
        rss = sampler.stop(tuple(steps))
    row: dict[str, Any] = {"elements": n, "measured": True, "turns": turns, "mount_seconds": device.mount_seconds,
           "create_seconds": device.create_seconds,
           "state_bytes": 2 * STATE_BYTES_PER_ELEMENT * n, "rss": rss,
           **{name: _transport_row(seconds[name], moved[name], n, turns) | {"first_step_seconds": first[name]}
              for name in steps}}
    for name in steps:
        say(f"  scale {n:,}: {name} {row[name]['seconds']:.3f} s/step = {row[name]['gels']:.3f} G el/s, "
            f"host {row[name]['host_bytes_per_step'] / n:.1f} B/el, media written "
            f"{row[name]['media_written_bytes_per_step'] / n:.1f} B/el")
    say(f"  scale {n:,}: mount ready in {device.mount_seconds:.2f} s, namespace created in "
        f"{device.create_seconds:.2f} s; daemon peak RSS "
        f"{rss['vm_hwm'] / 2**20:.0f} MiB (anon {rss['peak_anon'] / 2**20:.0f}, files "
        f"{rss['peak_file'] / 2**20:.0f}, shared {rss['peak_shmem'] / 2**20:.0f}); anonymous while stepping "
        f"through the CMB {rss['by_transport']['cmb']['peak_anon'] / 2**20:.0f} MiB, through the files "
        f"{rss['by_transport']['files']['peak_anon'] / 2**20:.0f} MiB")
    return row


def disk_throughput(workdir: Path, nbytes: int) -> dict[str, Any]:
    """`dd` O_DIRECT writes of `nbytes` (4 MiB blocks, then an fsync) into the same disk:
    what it sustains, and so how many elements a second at the 12 B of new state each needs."""
    target = workdir / "dd.probe"
    count = max(1, nbytes // (4 << 20))
    started = time.perf_counter()
    done = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={count}", "oflag=direct",
                           "conv=fsync"], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    target.unlink(missing_ok=True)
    if done.returncode != 0:
        return {"measured": False, "why": f"not measured: dd failed: {done.stderr.strip()[-200:]}"}
    written = count * (4 << 20)
    match = re.search(r"([\d.,]+) ([kMG]?B)/s", done.stderr)
    return {"measured": True, "bytes": written, "seconds": seconds, "bytes_per_second": written / seconds,
            "dd_says": match.group(0) if match else None,
            "gels_at_12_bytes": written / seconds / 12 / 1e9}


def exponent(sizes: list[int], values: list[float]) -> float | None:
    """The least-squares slope of log(value) against log(size): 1 is linear growth, 0 flat."""
    pairs = [(math.log(s), math.log(v)) for s, v in zip(sizes, values) if v > 0]
    if len(pairs) < 2:
        return None
    xs, ys = zip(*pairs)
    return float(np.polyfit(xs, ys, 1)[0])


def scale_costs(root: Path, sizes: list[int], restore_sizes: set[int],
                dd_bytes: int | None = None) -> dict[str, Any]:
    """Each size on a fresh device under `root` (deleted as soon as it is measured), the
    restore where asked, the disk's own write speed, and the growth exponents."""
    from .restore import restore_costs, startup_imports  # its own module: the restore breakdown

    ram = memory_total()
    report: dict[str, Any] = {"media": filesystem_of(root), "ram_bytes": ram, "client_chunk_bytes": CLIENT_CHUNK,
                              "sizes": [], "restore": []}
    dd_bytes = dd_bytes or max(64 << 20, min(4 << 30, 12 * max(sizes)))
    report["disk"] = disk_throughput(root, dd_bytes)
    if report["disk"]["measured"]:
        say(f"  scale: dd O_DIRECT into {report['media']}: {report['disk']['bytes_per_second'] / 1e9:.2f} GB/s "
            f"= {report['disk']['gels_at_12_bytes']:.3f} G el/s at 12 B/element")
    if restore_sizes & set(sizes):
        report["startup_imports"] = startup_imports()
    for n in sizes:
        state = 2 * STATE_BYTES_PER_ELEMENT * n
        free = shutil.disk_usage(root).free
        if state + DISK_MARGIN > free:
            why = (f"not measured: the A/B state ({state / 1e9:.1f} GB) and a {DISK_MARGIN >> 30} GiB margin "
                   f"do not fit the {free / 1e9:.1f} GB free on {report['media']}")
            say(f"  scale {n:,}: {why}")
            report["sizes"].append({"elements": n, "measured": False, "why": why, "state_bytes": state})
            continue
        workdir = root / f"n{n}"
        workdir.mkdir()
        device: BenchDevice | None = None
        try:
            row, device = measure_size(workdir, n, turns_for(n))
            row["exceeds_ram"] = state > ram
            if report["disk"]["measured"]:
                for name in ("cmb", "files"):
                    row[name]["vs_disk"] = row[name]["gels"] / report["disk"]["gels_at_12_bytes"]
            report["sizes"].append(row)
            if n in restore_sizes:
                report["restore"].append(restore_costs(device, workdir, n))
                device = None  # restore_costs leaves it stopped
        finally:
            if device is not None:
                device.stop()
            shutil.rmtree(workdir, ignore_errors=True)
    measured = [row for row in report["sizes"] if row["measured"]]
    ns = [row["elements"] for row in measured]
    report["exponents"] = {
        "cmb_step_seconds": exponent(ns, [row["cmb"]["seconds"] for row in measured]),
        "files_step_seconds": exponent(ns, [row["files"]["seconds"] for row in measured]),
        "daemon_peak_rss": exponent(ns, [row["rss"]["vm_hwm"] for row in measured]),
        "daemon_peak_anon": exponent(ns, [row["rss"]["peak_anon"] for row in measured]),
        "daemon_peak_anon_cmb": exponent(ns, [row["rss"]["by_transport"]["cmb"]["peak_anon"] for row in measured]),
        "daemon_peak_anon_files": exponent(ns, [row["rss"]["by_transport"]["files"]["peak_anon"]
                                                for row in measured]),
    }
    largest = max(measured, key=lambda row: row["elements"], default=None)
    report["largest_state_bytes"] = largest["state_bytes"] if largest else 0
    report["state_exceeded_ram"] = bool(largest and largest["state_bytes"] > ram)
    say(f"  scale: growth exponents {', '.join(f'{k} {v:.2f}' for k, v in report['exponents'].items() if v is not None)}"
        f"; largest A/B state {report['largest_state_bytes'] / 1e9:.1f} GB "
        f"{'exceeds' if report['state_exceeded_ram'] else 'fits in'} {ram / 2**30:.1f} GiB of RAM")
    return report
