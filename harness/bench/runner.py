"""`cossd bench`: cossd's kernel, file path, checkpoint and restore, measured beside their peers in one run.

The sections live in modules of their own beside this one (kernel, mount, checkpoint, trainer,
net and iopath, oom, scale, ranks, peers), the devices they mount in device.py, the report in
report.py; this module runs them in order and offers their names, which the package
(cossd.harness.bench) exports as `cossd bench` and the tests use them.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ... import kernels
from ...emulator.layout import BLOCK_ELEMS
from ...trainer.options import BENCH_FRAMEWORKS, BENCH_SECTIONS, DEFAULT_BENCH_SECTIONS, add_bench_arguments

from . import net as bench_net, trainer as bench_trainer
from .checkpoint import (CHECKPOINT_NAMESPACE, checkpoint_costs, checkpoint_volume, restore_costs,
                               trainer_checkpoint_target)
from .device import BenchDevice, filesystem_of, ram_workdir, ram_workdir_available
from .interrupt import held, signals_end_the_run
from .kernel import (BYTES_MOVED, BYTES_PER_ELEMENT, DEEPSPEED_INSTALL, HYPER, SWEEP_BYTES, KernelBuffers,
                           cossd_device_update, cossd_kernel, cossd_ordinary_stores, deepspeed_cpuadam,
                           kernel_row, roofline_probe, torch_adamw)
from .mount import FILE_PATH_VARIANTS, cmb_rows, cmb_step, file_path_rows, file_path_step
from .report import chart, cpu_name, markdown, write_report
from ..measure import say, split_run, timed

__all__ = [
    "BENCH_SECTIONS", "BYTES_MOVED", "BYTES_PER_ELEMENT", "CHECKPOINT_NAMESPACE", "DEEPSPEED_INSTALL",
    "FILE_PATH_VARIANTS", "HYPER", "MOUNT_TURNS", "SWEEP_BYTES", "BenchDevice", "KernelBuffers",
    "add_bench_arguments", "chart", "checkpoint_costs", "checkpoint_volume", "cmb_rows", "cmb_step",
    "cossd_device_update", "cossd_kernel", "cossd_ordinary_stores", "deepspeed_cpuadam", "file_path_rows",
    "file_path_step", "filesystem_of", "kernel_row", "markdown", "ram_workdir", "ram_workdir_available",
    "restore_costs", "roofline_probe", "run", "split_run", "timed", "torch_adamw", "trainer_checkpoint_target",
]

_write_report = write_report  # the name the report's writer had here (tests call it)


def run(args: argparse.Namespace) -> int:
    """The sections `args` names, then the report; 0. SIGTERM, SIGHUP or Ctrl-C end the run
    through each section's own teardown (interrupt.py): it says so and returns 128 + the
    signal's number, as a shell reports a process a signal ended."""
    already = {pid for pid, _ in _daemon_children()}  # a caller's own (a test's mounts): not the run's
    with signals_end_the_run() as ended:
        try:
            return _run(args)
        except BaseException:
            # Whatever the interrupt became on its way up (a teardown's error may replace
            # it), a run a signal ended reports that; the sections' teardown has run.
            if not ended:
                raise
    for leftover in stop_leftover_children(already):
        say(f"cossd bench: stopped {leftover}, which its section's teardown left running")
    say(f"cossd bench: interrupted by {ended[0]}: its servers, mounts and temporary folders are removed")
    return 128 + signal.Signals[ended[0]].value


# What the bench's storage servers and mount daemons run: each its own session, so no
# signal to the bench reaches them, and a leftover one would run on (and stay mounted).
_DAEMON_MODULES = ("cossd.server.command", "cossd.fs.mount_main")


def stop_leftover_children(spare: set[int], timeout_s: float = 20.0) -> list[str]:
    """Stop the storage servers and mount daemons this process started (but those in `spare`)
    that still run once an interrupted run's teardown is done (a signal during a start in a
    section that does not hold it off, harness/bench/interrupt.py): SIGTERM (a mount daemon
    unmounts on it), SIGCONT for a stopped one, SIGKILL past `timeout_s`. What each was."""
    stopped = []
    for pid, module in _daemon_children():
        if pid in spare:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + timeout_s
        while not _reaped(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _reaped(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            while not _reaped(pid):
                time.sleep(0.05)
        stopped.append(f"pid {pid} ({module})")
    return stopped


def _daemon_children() -> list[tuple[int, str]]:
    """This process's children running one of _DAEMON_MODULES: (pid, the module)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # State and parent: the 1st and 2nd fields after the command's name (which may
            # hold spaces). A zombie (exited, not yet waited for) is not running: left alone.
            state, parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # gone while looked at
        if int(parent) != os.getpid() or state == "Z":
            continue
        module = next((m for m in _DAEMON_MODULES if m.encode() in words), None)
        if module is not None:
            found.append((int(entry.name), module))
    return found


def _reaped(pid: int) -> bool:
    """Whether child `pid` has exited (reaping it if so)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # already reaped
        return True


def _run(args: argparse.Namespace) -> int:
    if "trainer" in getattr(args, "sections", DEFAULT_BENCH_SECTIONS):
        bench_trainer.resolve_device(getattr(args, "device", "cpu"))  # no CUDA: say so before any work
    n, repeat = args.elements, args.repeat
    report: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
                    "simd": kernels.simd_level(), "python": platform.python_version()},
        "elements": n, "repeat": repeat, "bytes_per_element": BYTES_PER_ELEMENT,
    }
    say(f"cossd bench: {n:,} elements, median of {repeat}, kernel path {kernels.simd_level()}, "
         f"{report['machine']['cores']} cores")
    sections = getattr(args, "sections", DEFAULT_BENCH_SECTIONS)
    rounds = getattr(args, "rounds", 3)
    kernel_rows = []
    for threads in args.threads if "kernel" in sections else ():
        row = kernel_row(n, repeat, threads, rounds)
        kernel_rows.append(row)
        low, high = row["cossd_vs_fused_round_range"]
        say(f"  kernel, {threads} thread(s), same buffers for all: cossd {row['cossd_gels']:.2f} G el/s = "
             f"{row['cossd_vs_fused']:.2f}x torch fused ({row['torch_fused_gels']:.2f}; rounds {low:.2f}-{high:.2f}), "
             f"{row['cossd_vs_roofline']:.0%} of the {row['adam_roofline_gels']:.2f} G el/s roofline; "
             f"device block update {row['cossd_device_gels']:.2f} G el/s, "
             f"{row['device_update_vs_out_of_place_roofline']:.0%} of its out-of-place roofline")
    if kernel_rows:
        report["kernel"] = kernel_rows
        report["rounds"] = rounds
    if "net" in sections:
        _net_section(report, args)
    if "oom" in sections:
        _oom_section(report, args)
    if "ranks" in sections:
        from .ranks import ranks_costs

        workdir = Path(tempfile.mkdtemp(prefix="cossd-bench-ranks-"))
        try:
            report["ranks"] = ranks_costs(workdir, getattr(args, "rank_elements", 1 << 22), max(args.repeat, 5))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if "devices" in sections:
        from .devices import devices_costs

        workdir = Path(tempfile.mkdtemp(prefix="cossd-bench-devices-"))
        try:
            if getattr(args, "devices_link", "daemons") == "netns":  # each device served in a namespace of its own
                from .devices_net import devices_net_costs

                report["devices"] = devices_net_costs(workdir, getattr(args, "device_width", 512),
                                                      getattr(args, "device_layers", 4), max(args.repeat, 5),
                                                      getattr(args, "devices_link_mbit", None))
            else:
                report["devices"] = devices_costs(workdir, getattr(args, "device_width", 512),
                                                  getattr(args, "device_layers", 4), max(args.repeat, 5))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    if "scale" in sections:
        _scale_section(report, args)
    if "peers" in sections:
        _peers_section(report, args)
    if "formats" in sections:
        _formats_section(report, args)
    if "frameworks" in sections:
        import sys

        from .frameworks import frameworks_costs  # the frameworks' figure tests, under pytest

        report["frameworks"] = frameworks_costs(sys.executable, getattr(args, "frameworks", list(BENCH_FRAMEWORKS)))
    if not sections & {"mount", "trainer"}:
        write_report(report, args.output)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="cossd-bench-"))
    # Each device goes into `started` (the teardown's list) in the held block that mounts it:
    # a signal between the mount and its registration would leave it mounted (interrupt.py).
    started: list[BenchDevice] = []
    try:
        with held():
            device = BenchDevice(workdir, args.file_elements)
            started.append(device)
        if "mount" in sections:
            _mount_sections(report, args, device, workdir, kernel_rows)
        if "trainer" in sections:
            ram = ram_workdir()
            ram_device: BenchDevice | None = None
            try:
                with held():  # `ram_device` names it for the finally below once it is mounted
                    ram_device = BenchDevice(ram, BLOCK_ELEMS) if ram is not None else None
                with trainer_checkpoint_target(device, workdir) as volume:
                    report["trainer"] = bench_trainer.trainer_costs(
                        getattr(args, "device", "cpu"), device.mountpoint, volume, args.file_elements, repeat,
                        ram_mountpoint=ram_device.mountpoint if ram_device is not None else None)
            finally:
                if ram_device is not None:
                    ram_device.stop()
                if ram is not None:
                    shutil.rmtree(ram, ignore_errors=True)
            for name, row in report["trainer"].items():
                if isinstance(row, dict) and name != "iterations":
                    say(f"  trainer on {report['trainer']['device']}, {name}: {row['seconds']:.3f} s per step, "
                         f"{row['bytes_over_link'] / 1e6:.0f} MB over the link")
            for name, row in report["trainer"]["iterations"].items():
                if isinstance(row, dict):
                    say(f"  iteration on {report['trainer']['device']}, {name}: {row['seconds']:.3f} s")
    finally:
        for each in reversed(started):
            each.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    write_report(report, args.output)
    return 0


MOUNT_TURNS = 15


def _net_section(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Storage servers on loopback (backing on tmpfs where there is one, as the local steps'):
    the wire against a socket pair and the local steps, then the I/O-path comparison."""
    from .iopath import iopath_costs

    n = getattr(args, "net_elements", 1 << 22)
    ram = ram_workdir()
    workdir = ram if ram is not None else Path(tempfile.mkdtemp(prefix="cossd-bench-net-"))
    try:
        repeat = max(args.repeat, 5)
        report["net"] = bench_net.net_costs(workdir, n, repeat) | {"elements": n, "turns": repeat}
        report["net"]["veth"] = bench_net.veth_costs(workdir, n, repeat)
        report["net"]["fairness"] = bench_net.fairness(workdir, n, repeat)
        report["iopath"] = iopath_costs(workdir, n, repeat)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _oom_section(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Per-step checkpoints under a cgroup memory cap with a throttled sink (oom.py), in
    a temp dir on the disk (the sink's image, the store's and the drive's data). `args.oom` (an
    OomSettings) overrides the model and the sizes: the tests run it tiny."""
    from .oom import OomSettings, oom_costs

    settings = getattr(args, "oom", None) or OomSettings()
    workdir = Path(tempfile.mkdtemp(prefix="cossd-bench-oom-"))
    try:
        report["oom"] = oom_costs(workdir, settings)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if not report["oom"].get("measured"):
        say(f"  oom: {report['oom']['why']}")


def _scale_section(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Growing namespaces on fresh devices backed by the temp dir's disk (scale.py), all
    under one directory deleted at the end; the restore at 16M and 256M where those are among
    the sizes, else at the largest."""
    from .scale import scale_costs

    sizes = getattr(args, "scale_sizes", None) or [1 << 20, 1 << 24, 1 << 28, 1 << 30]
    restore = {1 << 24, 1 << 28} & set(sizes) or {max(sizes)}
    workdir = Path(tempfile.mkdtemp(prefix="cossd-bench-scale-"))
    try:
        report["scale"] = scale_costs(workdir, sizes, restore)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _formats_section(report: dict[str, Any], args: argparse.Namespace) -> None:
    """The four moment formats through the CMB on one device (tmpfs where there is one), at
    --file-elements, and the kernel per format beside the CPU 8-bit AdamWs at --elements
    (`args.formats_peers`, where set, names which of formats.PEERS run: the tests)."""
    from .formats import PEERS, formats_costs

    ram = ram_workdir()
    workdir = ram if ram is not None else Path(tempfile.mkdtemp(prefix="cossd-bench-formats-"))
    try:
        peers = tuple(p for p in PEERS if p[0] in getattr(args, "formats_peers", [name for name, _, _ in PEERS]))
        report["formats"] = formats_costs(workdir, args.file_elements, args.elements, args.repeat, peers)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _peers_section(report: dict[str, Any], args: argparse.Namespace) -> None:
    """cossd beside ZeRO-Infinity, ZeRO-Offload and resident AdamW (peers.py), in a temp
    dir on the disk; `args.peers` (a PeersSettings) overrides everything (the tests), else
    --peers-params the sizes. Writes peers.png beside the report."""
    from .peers import PeersSettings, peers_costs
    from .peers_report import peers_chart

    settings = getattr(args, "peers", None) or PeersSettings()
    if getattr(args, "peers_params", None):
        settings.sizes = tuple(args.peers_params)
    workdir = Path(tempfile.mkdtemp(prefix="cossd-bench-peers-"))
    try:
        report["peers"] = peers_costs(workdir, settings)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    args.output.mkdir(parents=True, exist_ok=True)
    peers_chart(report["peers"], args.output / "peers.png")


def _mount_sections(report: dict[str, Any], args: argparse.Namespace, device: BenchDevice, workdir: Path,
                    kernel_rows: list[dict[str, Any]]) -> None:
    """The file path (backing on the temp dir, then on tmpfs), checkpoint and restore."""
    # A step through the mount takes tens of ms and varies by a third from one to the next
    # on a shared VM: at least MOUNT_TURNS of them, whatever --repeat says.
    repeat = max(args.repeat, MOUNT_TURNS)
    report["mount_turns"] = repeat
    in_memory = max((row["cossd_gels"] for row in kernel_rows), default=None)  # None: kernel not run
    device_update = max((row["cossd_device_gels"] for row in kernel_rows), default=None)
    file_rows = file_path_rows(device, workdir, args.file_elements, repeat, in_memory, device_update)
    # The same path with the media in RAM: what the mount and the device's own work cost
    # without the backing disk's writeback. There, a second device on which pyfuse3 serves
    # every request itself (--io-threads 0), the front end the data path replaced, takes the
    # O_DIRECT steps in turns with the first, so their ratio is measured turn by turn.
    ram, alone_ram = ram_workdir(), ram_workdir()
    devices: list[BenchDevice] = []
    try:
        if ram is not None and alone_ram is not None:
            with held():
                devices.append(BenchDevice(ram, args.file_elements))
            with held():
                devices.append(BenchDevice(alone_ram, args.file_elements, io_threads=0))
            file_rows += file_path_rows(devices[0], ram, args.file_elements, repeat, in_memory,
                                        device_update, pyfuse3_alone=devices[1])
            file_rows += cmb_rows(devices[0], ram, args.file_elements, repeat, in_memory, device_update)
    finally:
        for ram_device in devices:
            ram_device.stop()
        for directory in (ram, alone_ram):
            if directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
    report["file_path"] = file_rows
    with checkpoint_volume(device, workdir, create=True) as volume:
        report["checkpoint"] = checkpoint_costs(device, volume, args.file_elements)
    for name, row in report["checkpoint"].items():
        say(f"  checkpoint, {name}: {row['seconds']:.3f} s, {row['bytes_over_link'] / 1e6:.0f} MB over the link")
    report["restore"] = restore_costs(device, workdir, args.file_elements)
    for name, row in report["restore"].items():
        say(f"  restore, {name}: {row['seconds']:.3f} s, {row['bytes'] / 1e6:.0f} MB read")

