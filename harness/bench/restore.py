"""The scale section's restore: params only from a restarted device against torch.load of the full state, cold cache, with the mount's start-up taken apart."""
from __future__ import annotations

import json
import mmap
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ...emulator import Device, DeviceConfig
from ...fs import daemon

from .device import BenchDevice
from ..checkpointing import drop_from_page_cache, files_under
from ..measure import say

# What the mount daemon imports before it serves (python -m cossd.fs.mount_main, which
# start_background runs): the daemon with FUSE, the emulator and the kernels.
MOUNT_IMPORTS = "import cossd.fs.mount_main, cossd.fs.daemon"
# What `cossd mount` imports before it starts that daemon: the command line's mount verb
# alone and the daemon's launcher (tools/cli.py, fs/launch.py), not the daemon.
CLI_MOUNT_IMPORTS = ("from cossd.tools import cli; cli.build_parser(only='mount').parse_args(['mount', 'b', 'm']); "
                     "import cossd.fs.launch")

# A torch.save of the same model as FP32 with torch's AdamW state (param, exp_avg,
# exp_avg_sq, step: 12 B/element), written and fsynced in a child so that the bench process
# never holds the state.
_TORCH_SAVE = """
import os, sys, torch
n, path = int(sys.argv[1]), sys.argv[2]
weight = torch.nn.Parameter(torch.full((n,), 0.5))
optimizer = torch.optim.AdamW([weight], lr=1e-3, fused=True)
weight.grad = torch.full((n,), 0.01)
optimizer.step()
weight.grad = None
with open(path, "wb") as stream:
    torch.save({"model": {"w": weight.detach()}, "optimizer": optimizer.state_dict()}, stream)
    stream.flush()
    os.fsync(stream.fileno())
"""

# torch.load in a child whose torch is imported before the clock starts: the restore a
# resuming trainer pays, not its interpreter's start.
_TORCH_LOAD = """
import json, sys, time, torch
started = time.perf_counter()
state = torch.load(sys.argv[1], weights_only=True)
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "tensors": len(state["optimizer"]["state"][0]) + len(state["model"])}))
"""


RESTORE_RUNS = 3  # cold restarts (and cold torch.loads) a size is measured with: the median counts


def _python_seconds(code: str, runs: int = 3) -> float:
    """The fastest of `runs` wall times of a fresh interpreter running `code`."""
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        best = min(best, time.perf_counter() - started)
    return best


def startup_imports() -> dict[str, Any]:
    """A bare interpreter's start, and one importing what the mount imports; with the
    packages whose own module code takes longest to import (python -X importtime's self
    times, summed per top-level package: they add up to the whole import)."""
    bare = _python_seconds("pass")
    with_imports = _python_seconds(MOUNT_IMPORTS)
    through_cli = _python_seconds(CLI_MOUNT_IMPORTS)
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", MOUNT_IMPORTS], capture_output=True, text=True)
    heaviest: dict[str, int] = {}
    for line in done.stderr.splitlines():
        parts = line.split("|")  # "import time: self [us] | cumulative | imported package"
        self_us = parts[0].rsplit(":", 1)[-1].strip() if len(parts) == 3 else ""
        if not self_us.isdigit():
            continue
        package = parts[2].strip().split(".")[0]
        heaviest[package] = heaviest.get(package, 0) + int(self_us)
    top = sorted(heaviest.items(), key=lambda item: -item[1])[:6]
    say(f"  restore: interpreter start {bare:.3f} s, with the mount's imports {with_imports:.3f} s "
        f"({', '.join(f'{name} {us / 1e6:.2f}' for name, us in top)}); `cossd mount`'s own, before it "
        f"starts the daemon, {through_cli:.3f} s")
    return {"interpreter_seconds": bare, "with_imports_seconds": with_imports,
            "through_cli_seconds": through_cli,
            "imports_seconds": with_imports - bare,
            "heaviest_imports": [{"package": name, "seconds": us / 1e6} for name, us in top]}


def _drop(paths: list[Path]) -> None:
    """Cold cache for these files: written back, then dropped (posix_fadvise DONTNEED), which
    leaves the rest of a shared machine's page cache alone."""
    drop_from_page_cache(paths)


def _device_open(backing: Path, verify: str) -> dict[str, float]:
    """Device.open in this process on the stopped device's backing, cold cache, with the time
    the namespaces spent verifying whole copies' checksums (their copy_verify_ns counters,
    which start at the open) counted apart from the rest. With verify="background" (what the
    mount does) the open verifies nothing: the device is closed at once, stopping the
    background pass."""
    _drop(files_under(backing))
    started = time.perf_counter()
    device = Device.open(backing, DeviceConfig(verify=verify))
    seconds = time.perf_counter() - started
    try:
        optimizers = (namespace.as_optimizer() for namespace in device.namespaces.values())
        verify_seconds = sum(optimizer.counters.copy_verify_ns for optimizer in optimizers
                             if optimizer is not None) / 1e9
    finally:
        device.close()
    return {"open_seconds": seconds, "verify_seconds": verify_seconds,
            "recovery_seconds": seconds - verify_seconds}


def _read_params(device: BenchDevice) -> float:
    """Seconds to read the committed FP16 params (2 B/element) through the mount, in 4 MiB
    O_DIRECT preads into one buffer (the bench never holds the whole tensor)."""
    size, piece = 2 * device.n, 4 << 20
    buffer = mmap.mmap(-1, min(size, piece))
    view = memoryview(buffer)
    started = time.perf_counter()
    fd = os.open(device.tensor / "param", os.O_RDONLY | os.O_DIRECT)
    try:
        offset = 0
        while offset < size:
            got = os.preadv(fd, [view[: min(piece, size - offset)]], offset)
            if got <= 0:
                raise OSError(f"{device.tensor / 'param'}: short read at {offset}")
            offset += got
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    view.release()
    buffer.close()
    return seconds


def _verified_seconds(device: BenchDevice, started: float, timeout_s: float = 600.0) -> float:
    """Seconds from `started` until the mount's namespace reports its background verification
    over (stats.json, polled every 10 ms)."""
    stats = device.tensor.parent.parent / "stats.json"
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if not json.loads(stats.read_text())["verification"]["verifying"]:
            return time.perf_counter() - started
        time.sleep(0.01)
    raise TimeoutError(f"{stats}: still verifying after {timeout_s:.0f} s")


# The line the daemon logs once ready (fs/daemon.py, _log_startup).
_READY_LINE = re.compile(r"ready ([\d.]+) s after the daemon's entry: imports ([\d.]+) s, "
                         r"device open ([\d.]+) s, mount ([\d.]+) s")


def _daemon_startup(device: BenchDevice, mount_seconds: float) -> dict[str, float]:
    """The newest start-up the daemon logged, taken apart: the process start (exec and the
    interpreter, before the daemon's own code: the rest of `mount_seconds`), imports,
    Device.open, and the FUSE mount with its threads. Empty where the log has no such line."""
    try:
        text = (device.backing / "daemon.log").read_text(errors="replace")
    except OSError:
        return {}
    found = _READY_LINE.findall(text)
    if not found:
        return {}
    ready, imports, opened, mount = (float(value) for value in found[-1])
    return {"process_start_seconds": max(0.0, mount_seconds - ready), "imports_seconds": imports,
            "device_open_seconds": opened, "fuse_mount_seconds": mount}


def _mount_and_read(device: BenchDevice, state_files: list[Path], verify: str) -> dict[str, Any]:
    """From a cold cache: a new daemon (`cossd mount --verify VERIFY`) until its mount is
    ready, then the params read through it; with background verification, also the seconds
    until that is over (the first step waits for it). Leaves the device stopped."""
    _drop(state_files)
    started = time.perf_counter()
    device.pid = daemon.start_background(device.backing, device.mountpoint, verify=verify)
    mount_seconds = time.perf_counter() - started
    read_seconds = _read_params(device)
    verified = _verified_seconds(device, started) if verify == "background" else mount_seconds
    # A trainer restarted against this device, which keeps running: the params are in the
    # page cache now (warm), as they are on a device that has been stepping.
    warm_read_seconds = _read_params(device)
    device.stop()
    return {"mount_seconds": mount_seconds, "read_seconds": read_seconds,
            "seconds": mount_seconds + read_seconds, "verified_after_seconds": verified,
            "warm_read_seconds": warm_read_seconds, "startup": _daemon_startup(device, mount_seconds)}


def _cossd_command() -> list[str]:
    """The `cossd` command beside this interpreter (the console script), else the module."""
    script = Path(sys.executable).with_name("cossd")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "cossd.tools.cli"]


def _mount_through_cli_and_read(device: BenchDevice, state_files: list[Path]) -> float:
    """From a cold cache: `cossd mount BACKING MNT` run as a shell runs it (the command line's
    own process and imports, then the daemon's), then the params read. Leaves it stopped."""
    _drop(state_files)
    started = time.perf_counter()
    done = subprocess.run([*_cossd_command(), "mount", "-o", "json", str(device.backing), str(device.mountpoint)],
                          check=True, capture_output=True, text=True)
    device.pid = int(json.loads(done.stdout)["pid"])
    seconds = time.perf_counter() - started + _read_params(device)
    device.stop()
    return seconds


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose total is the median (of an odd count: one of the runs, whole)."""
    return sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]


def _torch_load_cold(checkpoint: Path) -> dict[str, Any]:
    _drop([checkpoint])
    done = subprocess.run([sys.executable, "-c", _TORCH_LOAD, str(checkpoint)], check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def restore_costs(device: BenchDevice, workdir: Path, n: int) -> dict[str, Any]:
    """On the device the scale steps left (state committed on the disk): stop it, then, each
    from a cold cache, Device.open in process (recovery and verification, both ways), a new
    daemon mounting it and the params read through it (as `cossd mount` does by default,
    params verified as read and the rest in the background; and with --verify open, every
    block checked first), and torch.load of an equivalent full state saved beside it. Leaves
    the device stopped."""
    device.stop()
    state_files = files_under(device.backing / "ns")
    opened = _device_open(device.backing, "open")
    opened_background = _device_open(device.backing, "background")
    at_open = _mount_and_read(device, state_files, "open")
    # Each cold restart and each cold torch.load RESTORE_RUNS times, the median of each: one
    # cold read on a shared VM's disk varies by a factor of two from one run to the next.
    background_runs = [_mount_and_read(device, state_files, "background") for _ in range(RESTORE_RUNS)]
    background = _median_run(background_runs)
    mount_seconds, read_seconds = background["mount_seconds"], background["read_seconds"]
    through_cli = [_mount_through_cli_and_read(device, state_files) for _ in range(RESTORE_RUNS)]
    checkpoint = workdir / "full_state.pt"
    subprocess.run([sys.executable, "-c", _TORCH_SAVE, str(n), str(checkpoint)], check=True, capture_output=True)
    loads = [_torch_load_cold(checkpoint) for _ in range(RESTORE_RUNS)]
    loaded = sorted(loads, key=lambda run: run["seconds"])[len(loads) // 2]
    # Again with the file in the page cache: the warm counterpart of the params read above.
    again = subprocess.run([sys.executable, "-c", _TORCH_LOAD, str(checkpoint)], check=True, capture_output=True,
                           text=True)
    warm = json.loads(again.stdout.strip().splitlines()[-1])
    file_bytes = checkpoint.stat().st_size
    checkpoint.unlink()
    cossd_seconds = mount_seconds + read_seconds
    row = {"elements": n, "cache": "posix_fadvise DONTNEED on each file, after an fsync",
           "cossd": {"seconds": cossd_seconds, "mount_seconds": mount_seconds, "read_seconds": read_seconds,
                     "bytes": 2 * n, "verified_after_seconds": background["verified_after_seconds"],
                     "open_background_seconds": opened_background["open_seconds"], **opened,
                     "startup": background["startup"], "runs": [run["seconds"] for run in background_runs]},
           "cossd_verify_at_open": at_open,
           "cossd_through_cli": {"seconds": sorted(through_cli)[len(through_cli) // 2], "runs": through_cli},
           "torch_load": {"seconds": loaded["seconds"], "bytes": file_bytes, "warm_seconds": warm["seconds"],
                          "runs": [run["seconds"] for run in loads]},
           "torch_vs_cossd": loaded["seconds"] / cossd_seconds,
           "warm": {"cossd_params_seconds": background["warm_read_seconds"], "torch_load_seconds": warm["seconds"],
                    "torch_vs_cossd": warm["seconds"] / background["warm_read_seconds"]}}
    parts = background["startup"]
    say(f"  restore {n:,}: cossd params only {cossd_seconds:.3f} s, median of "
        f"{', '.join(f'{run:.3f}' for run in row['cossd']['runs'])} (mount {mount_seconds:.3f}"
        + (f": process start {parts['process_start_seconds']:.3f}, imports {parts['imports_seconds']:.3f}, "
           f"Device.open {parts['device_open_seconds']:.3f}, FUSE mount {parts['fuse_mount_seconds']:.3f}"
           if parts else "") + f"; Device.open in process "
        f"{opened_background['open_seconds']:.3f}; params {read_seconds:.3f}; the rest verified "
        f"{background['verified_after_seconds']:.2f} s after the start; warm, from the running device "
        f"{background['warm_read_seconds']:.3f} s against torch.load {warm['seconds']:.3f} s) against torch.load "
        f"of the full state "
        f"{loaded['seconds']:.3f} s, median of {', '.join(f'{run:.3f}' for run in row['torch_load']['runs'])} "
        f"({file_bytes / 1e9:.2f} GB): {row['torch_vs_cossd']:.1f}x; started by `cossd mount` from a shell "
        f"{row['cossd_through_cli']['seconds']:.3f} s, median of {', '.join(f'{run:.3f}' for run in through_cli)}"
        f" ({loaded['seconds'] / row['cossd_through_cli']['seconds']:.1f}x); with --verify open "
        f"{at_open['seconds']:.3f} s (Device.open {opened['open_seconds']:.3f}, of which verification "
        f"{opened['verify_seconds']:.3f})")
    return row
