"""`cossd bench`: cossd's kernel, file path, checkpoint and restore, measured beside their peers in one run."""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from cossd import kernels
from cossd.emulator import Device
from cossd.fs import daemon
from cossd.tools.client import AdminClient

from .checkpointing import drop_from_page_cache, files_under
from .options import add_bench_arguments

BYTES_PER_ELEMENT = 28  # fp16 grad in, fp32 master/m/v in and out, fp16 param out
HYPER = kernels.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)


def _say(text: str) -> None:
    print(text, flush=True)


def timed(work: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        work()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        work()
        samples.append(time.perf_counter() - started)
    return samples


def split_run(work: Callable[[int, int], object], n: int, threads: int) -> None:
    """Run work(start, stop) on `threads` disjoint slices at once (cffi and numpy drop the GIL)."""
    if threads == 1:
        work(0, n)
        return
    bounds = [n * i // threads for i in range(threads + 1)]
    pool = [threading.Thread(target=work, args=(bounds[i], bounds[i + 1])) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()


# ---------------------------------------------------------------------- kernels
#
# Every contender gets buffers from torch's allocator (where large arrays land relative to
# each other changes the achievable bandwidth by up to a quarter, docs/kernels.md), and the
# contenders run in turn within each repetition, so drift in a shared machine's memory
# bandwidth hits them all alike. Each builder returns one step as a callable.

def roofline_probe(n: int, threads: int) -> Callable[[], None]:
    """What memory allows for the Adam step's access pattern: the same streams (28 bytes per
    element, in place) with trivial arithmetic, in C."""
    grad_param = torch.zeros(n, dtype=torch.int16).numpy().view(np.uint16)
    master, m, v = torch.zeros(n).numpy(), torch.zeros(n).numpy(), torch.zeros(n).numpy()

    def probe(start: int, stop: int) -> None:
        s = slice(start, stop)
        kernels.stream_probe(grad_param[s], master[s], m[s], v[s])

    return lambda: split_run(probe, n, threads)


def cossd_kernel(n: int, threads: int) -> Callable[[], None]:
    master = torch.randn(n).numpy()
    m, v = torch.zeros(n).numpy(), torch.zeros(n).numpy()
    grad = (torch.randn(n) * 0.01).to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    param = torch.empty(n, dtype=torch.int16).numpy().view(np.uint16)
    scalars = kernels.adam_scalars(HYPER, 1)

    def step(start: int, stop: int) -> None:
        s = slice(start, stop)
        kernels.adam_step(grad[s], master[s], m[s], v[s], master[s], m[s], v[s], param[s],
                          grad_format=kernels.HalfFormat.FP16, param_format=kernels.HalfFormat.FP16,
                          state_format=kernels.StateFormat.FP32, scalars=scalars)

    return lambda: split_run(step, n, threads)


def _stepping(optimizer: torch.optim.Optimizer, threads: int) -> Callable[[], None]:
    """optimizer.step, run with torch using `threads` threads."""

    def step() -> None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            optimizer.step()
        finally:
            torch.set_num_threads(previous)

    return step


def _one_param(n: int) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n) * 0.01
    return param


def torch_adamw(n: int, threads: int, **options: Any) -> Callable[[], None]:
    return _stepping(torch.optim.AdamW([_one_param(n)], lr=1e-3, **options), threads)


def deepspeed_cpuadam(n: int, threads: int) -> Callable[[], None] | None:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - optional peer: absent, or its extension fails to build
        return None
    return _stepping(DeepSpeedCPUAdam([_one_param(n)], lr=1e-3, adamw_mode=True), threads)


def kernel_row(n: int, repeat: int, threads: int) -> dict[str, Any]:
    contenders: dict[str, Callable[[], None] | None] = {
        "roofline": roofline_probe(n, threads),
        "cossd": cossd_kernel(n, threads),
        "torch_fused": torch_adamw(n, threads, fused=True),
        "torch_foreach": torch_adamw(n, threads, foreach=True),
        "deepspeed": deepspeed_cpuadam(n, threads),
    }
    present = {name: step for name, step in contenders.items() if step is not None}
    samples: dict[str, list[float]] = {name: [] for name in present}
    for step in present.values():
        step()  # warm up: first touch of every page, lazy state allocation
    for _ in range(repeat):
        for name, step in present.items():
            started = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - started)
    rate = {name: n / statistics.median(times) / 1e9 for name, times in samples.items()}
    return {
        "threads": threads,
        "bandwidth_gbs": rate["roofline"] * BYTES_PER_ELEMENT,
        "adam_roofline_gels": rate["roofline"],
        "cossd_gels": rate["cossd"],
        "torch_fused_gels": rate["torch_fused"],
        "torch_foreach_gels": rate["torch_foreach"],
        "deepspeed_gels": rate.get("deepspeed"),
        "cossd_vs_fused": rate["cossd"] / rate["torch_fused"],
        "cossd_vs_deepspeed": rate["cossd"] / rate["deepspeed"] if "deepspeed" in rate else None,
        "cossd_vs_roofline": rate["cossd"] / rate["roofline"],
    }


# ---------------------------------------------------------------------- through a mount

class BenchDevice:
    """A temporary device, mounted, with one namespace of a single n-element tensor."""

    def __init__(self, workdir: Path, n: int) -> None:
        self.backing, self.mountpoint = workdir / "backing", workdir / "mnt"
        self.mountpoint.mkdir()
        Device.format(self.backing)
        self.pid = daemon.start_background(self.backing, self.mountpoint)
        with AdminClient(self.mountpoint) as admin:
            admin.create_namespace({"name": "bench", "tensors": [["w", n]]})
        self.tensor = self.mountpoint / "ns" / "bench" / "tensors" / "w"
        self.n = n

    def stop(self) -> None:
        daemon.stop_background(self.mountpoint, self.pid)


def _aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)  # page aligned, as O_DIRECT wants


def file_path_step(device: BenchDevice, o_direct: bool, chunk: int = 4 << 20) -> Callable[[], None]:
    """One step through the files: write fp16 grads in `chunk`-byte pieces, read fp16 params."""
    size = 2 * device.n
    grads = _aligned(size)
    grads.write((np.random.default_rng(1).standard_normal(device.n) * 0.01).astype(np.float16).tobytes())
    params = _aligned(size)
    flags = os.O_DIRECT if o_direct else 0

    def step() -> None:
        fd = os.open(device.tensor / "grad", os.O_WRONLY | flags)
        try:
            view = memoryview(grads)
            for offset in range(0, size, chunk):
                os.pwrite(fd, view[offset:offset + chunk], offset)
        finally:
            os.close(fd)
        fd = os.open(device.tensor / "param", os.O_RDONLY | flags)
        try:
            view = memoryview(params)
            offset = 0
            while offset < size:
                offset += os.preadv(fd, [view[offset:offset + chunk]], offset)
        finally:
            os.close(fd)

    return step


# ---------------------------------------------------------------------- checkpoint, restore

def checkpoint_costs(device: BenchDevice, workdir: Path, n: int) -> dict[str, dict[str, float]]:
    """Seconds to make one step's state durable, and the bytes written for it."""
    import torch.distributed.checkpoint as dcp

    results: dict[str, dict[str, float]] = {}
    with AdminClient(device.mountpoint) as admin:
        nsid = admin.nsid("bench")
        before = admin.statistics(nsid)
        # An explicit step: what the trainer waits for is begin (which waits until the last
        # step is durable) and commit (one superblock write); the device's fsync of the new
        # copy runs in the background and is timed by the device itself.
        began = time.perf_counter()
        admin.begin_step(nsid)
        stall = time.perf_counter() - began
        fd = os.open(device.tensor / "grad", os.O_WRONLY)
        try:
            os.pwrite(fd, np.zeros(n, np.float16).tobytes(), 0)
        finally:
            os.close(fd)
        committing = time.perf_counter()
        admin.commit_step(nsid)
        stall += time.perf_counter() - committing
        admin.flush(nsid)
        after = admin.statistics(nsid)
        flushes = max(1, after["flushes"] - before["flushes"])
        results["cossd commit (device flushes in background)"] = {
            "seconds": stall,
            "device_flush_seconds": (after["flush_ns"] - before["flush_ns"]) / 1e9 / flushes,
            "bytes_over_link": 0,
            "device_media_bytes": after["state_bytes_per_copy"],
        }
    state = {"master": torch.randn(n), "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n),
             "param": torch.zeros(n, dtype=torch.float16)}
    path = workdir / "ckpt.pt"
    started = time.perf_counter()
    with open(path, "wb") as stream:
        torch.save(state, stream)
        stream.flush()
        os.fsync(stream.fileno())
    results["torch.save + fsync"] = {"seconds": time.perf_counter() - started,
                                     "bytes_over_link": path.stat().st_size}
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    started = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(workdir / "dcp"))
    blocking = time.perf_counter() - started
    future.result()
    results["DCP async_save"] = {"seconds": time.perf_counter() - started, "blocking_seconds": blocking,
                                 "bytes_over_link": sum(p.stat().st_size for p in files_under(workdir / "dcp"))}
    return results


def restore_costs(device: BenchDevice, workdir: Path, n: int) -> dict[str, dict[str, float]]:
    results: dict[str, dict[str, float]] = {}
    device.stop()
    drop_from_page_cache(files_under(device.backing / "ns"))
    started = time.perf_counter()
    device.pid = daemon.start_background(device.backing, device.mountpoint)
    mounted = time.perf_counter()
    params = bytearray(2 * n)
    with open(device.tensor / "param", "rb", buffering=0) as stream:
        view, offset = memoryview(params), 0
        while offset < len(params):
            offset += stream.readinto(view[offset:])
    done = time.perf_counter()
    results["cossd params only"] = {"seconds": done - started, "mount_seconds": mounted - started,
                                    "read_seconds": done - mounted, "bytes": 2 * n}
    drop_from_page_cache([workdir / "ckpt.pt"])
    started = time.perf_counter()
    torch.load(workdir / "ckpt.pt", weights_only=True)
    results["torch.load full state"] = {"seconds": time.perf_counter() - started,
                                        "bytes": (workdir / "ckpt.pt").stat().st_size}
    return results


# ---------------------------------------------------------------------- report

def run(args: argparse.Namespace) -> int:
    n, repeat = args.elements, args.repeat
    report: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": _cpu_name(), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
                    "simd": kernels.simd_level(), "python": platform.python_version()},
        "elements": n, "repeat": repeat, "bytes_per_element": BYTES_PER_ELEMENT,
    }
    _say(f"cossd bench: {n:,} elements, median of {repeat}, kernel path {kernels.simd_level()}, "
         f"{report['machine']['cores']} cores")
    kernel_rows = []
    for threads in args.threads:
        row = kernel_row(n, repeat, threads)
        kernel_rows.append(row)
        _say(f"  kernel, {threads} thread(s): cossd {row['cossd_gels']:.2f} G el/s = "
             f"{row['cossd_vs_fused']:.2f}x torch fused ({row['torch_fused_gels']:.2f}), "
             f"{row['cossd_vs_roofline']:.0%} of the {row['adam_roofline_gels']:.2f} G el/s roofline")
    report["kernel"] = kernel_rows
    workdir = Path(tempfile.mkdtemp(prefix="cossd-bench-"))
    device = BenchDevice(workdir, args.file_elements)
    try:
        in_memory = max(row["cossd_gels"] for row in kernel_rows)
        file_rows = []
        for o_direct in (False, True):
            step = file_path_step(device, o_direct)
            rate = args.file_elements / statistics.median(timed(step, repeat)) / 1e9
            file_rows.append({"o_direct": o_direct, "gels": rate, "vs_kernel_in_memory": rate / in_memory})
            _say(f"  file path ({'O_DIRECT' if o_direct else 'buffered'}): {rate:.3f} G el/s = "
                 f"{rate / in_memory:.0%} of the kernel in memory")
        report["file_path"] = file_rows
        report["checkpoint"] = checkpoint_costs(device, workdir, args.file_elements)
        for name, row in report["checkpoint"].items():
            _say(f"  checkpoint, {name}: {row['seconds']:.3f} s, {row['bytes_over_link'] / 1e6:.0f} MB over the link")
        report["restore"] = restore_costs(device, workdir, args.file_elements)
        for name, row in report["restore"].items():
            _say(f"  restore, {name}: {row['seconds']:.3f} s, {row['bytes'] / 1e6:.0f} MB read")
    finally:
        device.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.output / "bench.md").write_text(markdown(report) + "\n")
    chart(report, args.output / "bench.png")
    _say("")
    _say(markdown(report))
    _say(f"\nwritten: {args.output / 'bench.json'}, {args.output / 'bench.md'}, {args.output / 'bench.png'}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, torch "
             f"{report['machine']['torch']}, kernel path {report['machine']['simd']}; "
             f"{report['elements']:,} elements, median of {report['repeat']}.", "",
             "| threads | memory bandwidth | roofline (28 B/el) | cossd kernel | torch fused | torch foreach "
             "| DeepSpeed CPUAdam | cossd / fused | cossd / roofline |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in report["kernel"]:
        deepspeed = f"{row['deepspeed_gels']:.2f}" if row["deepspeed_gels"] else "not installed"
        lines.append(f"| {row['threads']} | {row['bandwidth_gbs']:.1f} GB/s | {row['adam_roofline_gels']:.2f} G el/s "
                     f"| {row['cossd_gels']:.2f} | {row['torch_fused_gels']:.2f} | {row['torch_foreach_gels']:.2f} "
                     f"| {deepspeed} | {row['cossd_vs_fused']:.2f}x | {row['cossd_vs_roofline']:.0%} |")
    lines += ["", "| through the mount (FP16 grads in, FP16 params out) | G el/s | of the kernel in memory |",
              "|---|---|---|"]
    for row in report.get("file_path", []):
        lines.append(f"| {'O_DIRECT' if row['o_direct'] else 'buffered'} | {row['gels']:.3f} | {row['vs_kernel_in_memory']:.0%} |")
    lines += ["", "| checkpoint of one step | seconds | bytes over the link |", "|---|---|---|"]
    for name, row in report.get("checkpoint", {}).items():
        extra = ""
        if "device_flush_seconds" in row:
            extra = (f" (the device's own fsync of {row['device_media_bytes'] / 1e6:.0f} MB took "
                     f"{row['device_flush_seconds']:.3f} s, off the trainer's path)")
        elif "blocking_seconds" in row:
            extra = f" (the call blocked {row['blocking_seconds']:.3f} s; the rest ran in the background)"
        lines.append(f"| {name} | {row['seconds']:.3f}{extra} | {row['bytes_over_link'] / 1e6:.0f} MB |")
    lines += ["", "| restore (cold page cache) | seconds | bytes read |", "|---|---|---|"]
    for name, row in report.get("restore", {}).items():
        detail = ""
        if "mount_seconds" in row:
            detail = f" (device restart {row['mount_seconds']:.3f} + read {row['read_seconds']:.3f})"
        lines.append(f"| {name} | {row['seconds']:.3f}{detail} | {row['bytes'] / 1e6:.0f} MB |")
    return "\n".join(lines)


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    rows = report["kernel"]
    labels = [f"{r['threads']} thr" for r in rows]
    width = 0.2
    for offset, (key, name) in enumerate((("cossd_gels", "cossd"), ("torch_fused_gels", "torch fused"),
                                          ("torch_foreach_gels", "torch foreach"),
                                          ("adam_roofline_gels", "roofline"))):
        axes[0].bar([i + offset * width for i in range(len(rows))], [r[key] for r in rows], width, label=name)
    axes[0].set_xticks([i + 1.5 * width for i in range(len(rows))], labels)
    axes[0].set(title="Adam kernel, in memory", ylabel="G elements/s")
    axes[0].legend(fontsize=8)
    checkpoint = report.get("checkpoint", {})
    axes[1].bar(list(checkpoint), [row["seconds"] for row in checkpoint.values()], color="#d95f02")
    axes[1].set(title="make one step durable", ylabel="seconds")
    axes[1].tick_params(axis="x", labelsize=7)
    restore = report.get("restore", {})
    axes[2].bar(list(restore), [row["seconds"] for row in restore.values()], color="#7570b3")
    axes[2].set(title="restore (cold)", ylabel="seconds")
    axes[2].tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="python -m cossd.trainer.bench", description=__doc__)
    add_bench_arguments(cli)
    sys.exit(run(cli.parse_args()))
