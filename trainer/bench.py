"""`cossd bench`: cossd's kernel, file path, checkpoint and restore, measured beside their peers in one run."""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
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
from typing import Any, Callable, Iterator

import numpy as np
import torch

from cossd import kernels
from cossd.emulator import Device
from cossd.emulator.cmb import parallel_copy
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.fs import daemon
from ..client import AdminClient

from . import bench_trainer
from .checkpointing import drop_from_page_cache, files_under
from .nvm_volume import NvmVolume
from .options import BENCH_SECTIONS, add_bench_arguments

BYTES_PER_ELEMENT = 28  # every kernel contender moves 28 bytes per element (BYTES_MOVED)
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
# Like for like. On this class of machine (a VM) where a large array's pages land moves one
# contender's speed by up to a third from one allocation to the next, whatever the code.
# So in each round every contender steps on the very same memory (KernelBuffers), and the
# rounds use fresh allocations, so no contender keeps a lucky or unlucky set of pages.
# Within a round the contenders take turns, in an order that rotates every repetition, so
# drift in the shared machine's memory bandwidth hits them alike; before each timed step a
# read-only sweep of twice the L3 evicts (and writes back) what the previous one left dirty.
# Each builder returns one step as a callable.

# What one step of each contender moves per element, in bytes (read, written). All move 28;
# they differ in which streams carry them.
BYTES_MOVED: dict[str, tuple[int, int]] = {
    # FP16 grad + FP32 master and moments in; FP32 master and moments + FP16 param out. The
    # param is written with streaming stores (docs/kernels.md), so its lines are not read first.
    "cossd": (14, 14),
    # Ordinary stores: the param lines are read before they are overwritten, 2 bytes more.
    "cossd_ordinary_stores": (16, 14),
    # The device's block update: the same streams, out of place (all outputs streamed).
    "cossd_device": (14, 14),
    # FP32 grad, param and moments in; param and moments out (torch's fused step has no FP16
    # param, and it refuses an FP16 grad for an FP32 param).
    "torch_fused": (16, 12),
    # The same 28 at least; the foreach path makes a pass over memory per operation.
    "torch_foreach": (16, 12),
    "deepspeed": (16, 12),
    # The FP16 grad/param stream and the three FP32 streams, in place, trivial arithmetic.
    "roofline": (14, 14),
}
SWEEP_BYTES = 64 << 20  # twice this machine class's 32 MiB L3


def _moderate(count: int, generator: torch.Generator) -> torch.Tensor:
    """count FP32 values of magnitude 0.5 to 2: exact in FP16, far from subnormal and overflow."""
    return torch.rand(count, generator=generator) * 1.5 + 0.5


class KernelBuffers:
    """The memory all the kernel contenders of one round step on.

    `master` (torch's param, cossd's FP32 master), `exp_avg`, `exp_avg_sq`: n FP32 each.
    `grad`: n FP32, torch's gradient; cossd reads its FP16 gradient from the first 2n bytes of
    it (`grad16`) and writes its FP16 params into the last 2n bytes (`param16`). Every 16-bit
    half holds an FP16 value of magnitude 0.5 to 2, or a param of a master that stays positive
    and at least 0.5, so no FP32 value torch reads there is below 2^-15 in magnitude, and no
    square of one underflows: no contender can land on a subnormal slow path (some x86 cores
    take a microcode assist there), whichever way it reads the bytes.
    """

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.n = n
        self.master = _moderate(n, generator)
        self.exp_avg, self.exp_avg_sq = torch.zeros(n), torch.zeros(n)
        self.grad = torch.empty(n)
        halves = self.grad.view(torch.float16)
        halves.copy_(_moderate(2 * n, generator).to(torch.float16)
                     * (torch.randint(0, 2, (2 * n,), generator=generator, dtype=torch.int8) * 2 - 1))
        halves[n:].copy_(self.master.to(torch.float16))  # the params of the current masters
        as_u16 = self.grad.view(torch.int16).numpy().view(np.uint16)
        self.grad16, self.param16 = as_u16[:n], as_u16[n:]
        self.master_np = self.master.numpy()
        self.exp_avg_np, self.exp_avg_sq_np = self.exp_avg.numpy(), self.exp_avg_sq.numpy()


def roofline_probe(buffers: KernelBuffers, threads: int) -> Callable[[], None]:
    """What memory allows for the Adam step's access pattern: the same streams (28 bytes per
    element, in place) with trivial arithmetic, in C."""
    b = buffers

    def probe(start: int, stop: int) -> None:
        s = slice(start, stop)
        kernels.stream_probe(b.grad16[s], b.master_np[s], b.exp_avg_np[s], b.exp_avg_sq_np[s])

    return lambda: split_run(probe, b.n, threads)


def cossd_kernel(buffers: KernelBuffers, threads: int) -> Callable[[], None]:
    """cossd's step in place (master and moments updated where they are), FP16 grad and param."""
    b = buffers
    scalars = kernels.adam_scalars(HYPER, 1)

    def step(start: int, stop: int) -> None:
        s = slice(start, stop)
        kernels.adam_step(b.grad16[s], b.master_np[s], b.exp_avg_np[s], b.exp_avg_sq_np[s],
                          b.master_np[s], b.exp_avg_np[s], b.exp_avg_sq_np[s], b.param16[s],
                          grad_format=kernels.HalfFormat.FP16, param_format=kernels.HalfFormat.FP16,
                          state_format=kernels.StateFormat.FP32, scalars=scalars)

    return lambda: split_run(step, b.n, threads)


def cossd_device_update(buffers: KernelBuffers, threads: int) -> Callable[[], None]:
    """What the device does with each complete gradient block, in memory: the step out of
    place (the committed copy in, the shadow copy out) with the block's checksum, one call per
    BLOCK_ELEMS elements, through the same kernels.BlockUpdate as Namespace._run_block. It
    moves what the in-place step moves (the outputs go out with streaming stores) plus the
    checksum's arithmetic."""
    b = buffers
    scalars = kernels.adam_scalars(HYPER, 1)
    shadow = [np.empty(b.n, np.float32) for _ in range(3)] + [np.empty(b.n, np.uint16)]
    block_update = kernels.BlockUpdate(b.master_np, b.exp_avg_np, b.exp_avg_sq_np, *shadow,
                                       grad_format=kernels.HalfFormat.FP16, param_format=kernels.HalfFormat.FP16,
                                       state_format=kernels.StateFormat.FP32)

    def update(start: int, stop: int) -> None:
        for low in range(start, stop, BLOCK_ELEMS):
            block_update(b.grad16[low:min(stop, low + BLOCK_ELEMS)], low, scalars)  # (crc, non-finite)

    return lambda: split_run(update, b.n, threads)


def cossd_ordinary_stores(buffers: KernelBuffers, threads: int) -> Callable[[], None]:
    """The same step with streaming stores switched off: what they are worth, measured alongside."""
    step = cossd_kernel(buffers, threads)

    def without_streaming() -> None:
        before = kernels.stream_threshold()
        kernels.set_stream_threshold(None)
        try:
            step()
        finally:
            kernels.set_stream_threshold(before)

    return without_streaming


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


def _shared_param(buffers: KernelBuffers) -> torch.nn.Parameter:
    param = torch.nn.Parameter(buffers.master)
    param.grad = buffers.grad
    return param


def torch_adamw(buffers: KernelBuffers, threads: int, **options: Any) -> Callable[[], None]:
    """torch's AdamW whose param, grad and moments are the shared buffers."""
    param = _shared_param(buffers)
    optimizer = torch.optim.AdamW([param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                  weight_decay=HYPER.weight_decay, **options)
    # The state torch would create lazily, handed the shared moments instead.
    optimizer.state[param] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": buffers.exp_avg,
                              "exp_avg_sq": buffers.exp_avg_sq}
    return _stepping(optimizer, threads)


DEEPSPEED_INSTALL = "pip install ninja, then pip install --no-build-isolation deepspeed==0.19.8"
# Why DeepSpeed's CPUAdam has no figures, where it has none (the same for every row).
_deepspeed_missing: str | None = None


def deepspeed_cpuadam(buffers: KernelBuffers, threads: int) -> Callable[[], None] | None:
    """DeepSpeed's CPUAdam (its AVX C++ op, JIT-built on first use) on the shared buffers;
    None, with the reason in _deepspeed_missing, where deepspeed is absent or its op fails."""
    global _deepspeed_missing
    if importlib.util.find_spec("deepspeed") is None:
        _deepspeed_missing = f"not installed ({DEEPSPEED_INSTALL})"
        return None
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        param = _shared_param(buffers)
        optimizer = DeepSpeedCPUAdam([param], lr=HYPER.lr, betas=(HYPER.beta1, HYPER.beta2), eps=HYPER.eps,
                                     weight_decay=HYPER.weight_decay, adamw_mode=True)
    except Exception as exc:  # noqa: BLE001 - an optional peer whose op can fail to build in many ways
        _deepspeed_missing = f"its CPUAdam op did not build or load: {type(exc).__name__}: {exc}"[:300]
        return None
    _deepspeed_missing = None
    optimizer.state[param] = {"step": 0, "exp_avg": buffers.exp_avg, "exp_avg_sq": buffers.exp_avg_sq}
    return _stepping(optimizer, threads)


def _sweep(scratch: np.ndarray) -> None:
    """Read `scratch` end to end (a C loop that only reads): the caches then hold clean lines."""
    kernels.count_nonfinite(scratch, kernels.HalfFormat.FP16)


def kernel_row(n: int, repeat: int, threads: int, rounds: int = 3) -> dict[str, Any]:
    """Each contender's median rate over `rounds` fresh allocations x `repeat` turns, and the
    median of cossd's per-turn ratios to the others."""
    scratch = np.ones(SWEEP_BYTES // 2, np.uint16)
    samples: dict[str, list[float]] = {}
    round_ratios: dict[str, list[float]] = {}
    for round_index in range(rounds):
        buffers = KernelBuffers(n, seed=round_index)
        contenders: dict[str, Callable[[], None] | None] = {
            "roofline": roofline_probe(buffers, threads),
            "cossd": cossd_kernel(buffers, threads),
            "cossd_ordinary_stores": cossd_ordinary_stores(buffers, threads),
            "cossd_device": cossd_device_update(buffers, threads),
            "torch_fused": torch_adamw(buffers, threads, fused=True),
            "torch_foreach": torch_adamw(buffers, threads, foreach=True),
            "deepspeed": deepspeed_cpuadam(buffers, threads),
        }
        present = {name: step for name, step in contenders.items() if step is not None}
        first = slice(0, n // threads)  # the first thread's call, as split_run makes them
        state = [array[first] for array in (buffers.master_np, buffers.exp_avg_np, buffers.exp_avg_sq_np)]
        streamed = kernels.stream_plan(*state, *state, buffers.param16[first],  # in place
                                       state_format=kernels.StateFormat.FP32)
        for step in present.values():
            step()  # warm up: lazy initialisation, code paths
        names = list(present)
        times: dict[str, list[float]] = {name: [] for name in names}
        for turn in range(repeat):
            shift = (round_index + turn) % len(names)
            for name in names[shift:] + names[:shift]:
                _sweep(scratch)
                started = time.perf_counter()
                present[name]()
                times[name].append(time.perf_counter() - started)
        for name, values in times.items():
            samples.setdefault(name, []).extend(values)
            if name != "cossd":
                ratios = [theirs / ours for theirs, ours in zip(values, times["cossd"])]
                round_ratios.setdefault(name, []).append(statistics.median(ratios))
        del contenders, present, buffers
    rate = {name: n / statistics.median(times) / 1e9 for name, times in samples.items()}
    # cossd's speed over another's, paired turn by turn (the same moment, the same pages).
    ratio = {name: statistics.median(theirs / ours for theirs, ours in zip(samples[name], samples["cossd"]))
             for name in samples if name != "cossd"}
    spread = {name: [min(values), max(values)] for name, values in round_ratios.items()}
    return {
        "threads": threads,
        "rounds": rounds,
        "turns_per_round": repeat,
        "streaming_stores": sorted(streamed),  # the outputs cossd's calls wrote with streaming stores
        "bytes_per_element": {name: {"read": read + (2 if name == "cossd" and "param_out" not in streamed else 0),
                                     "written": written}
                              for name, (read, written) in BYTES_MOVED.items() if name in samples},
        "bandwidth_gbs": rate["roofline"] * sum(BYTES_MOVED["roofline"]),
        "adam_roofline_gels": rate["roofline"],
        "cossd_gels": rate["cossd"],
        "cossd_ordinary_stores_gels": rate["cossd_ordinary_stores"],
        "streaming_gain": ratio["cossd_ordinary_stores"],
        # The device's block update (out of place, with its checksum) over the plain step.
        "cossd_device_gels": rate["cossd_device"],
        "device_update_vs_kernel": 1 / ratio["cossd_device"],
        "torch_fused_gels": rate["torch_fused"],
        "torch_foreach_gels": rate["torch_foreach"],
        "deepspeed_gels": rate.get("deepspeed"),
        "deepspeed_missing": _deepspeed_missing if "deepspeed" not in rate else None,
        "cossd_vs_fused": ratio["torch_fused"],
        "cossd_vs_fused_round_range": spread["torch_fused"],
        "cossd_vs_deepspeed": ratio.get("deepspeed"),
        "cossd_vs_roofline": ratio["roofline"],
        "cossd_vs_roofline_round_range": spread["roofline"],
    }


# ---------------------------------------------------------------------- through a mount

class BenchDevice:
    """A temporary device, mounted, with one namespace of a single n-element tensor."""

    def __init__(self, workdir: Path, n: int, io_threads: int | None = None) -> None:
        self.backing, self.mountpoint = workdir / "backing", workdir / "mnt"
        self.mountpoint.mkdir()
        Device.format(self.backing)
        self.pid = daemon.start_background(self.backing, self.mountpoint, io_threads=io_threads)
        self.front_end = ("pyfuse3 alone" if io_threads == 0
                          else f"data path, {io_threads or daemon.io_threads_from_env()} threads")
        with AdminClient(self.mountpoint) as admin:
            admin.create_namespace({"name": "bench", "tensors": [["w", n]]})
        self.tensor = self.mountpoint / "ns" / "bench" / "tensors" / "w"
        self.n = n

    def stop(self) -> None:
        daemon.stop_background(self.mountpoint, self.pid)


def _aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)  # page aligned, as O_DIRECT wants


def file_path_step(device: BenchDevice, o_direct: bool, chunk: int = 4 << 20,
                   nonfinite: bool = False) -> Callable[[], None]:
    """One step through the files: write fp16 grads in `chunk`-byte pieces, read fp16 params.
    nonfinite=True writes NaN gradients: every step is skipped, so no kernel runs and the
    time is what the mount and the request path alone cost."""
    size = 2 * device.n
    grads = _aligned(size)
    values = (np.full(device.n, np.nan) if nonfinite
              else np.random.default_rng(1).standard_normal(device.n) * 0.01)
    grads.write(values.astype(np.float16).tobytes())
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


def cmb_step(device: BenchDevice, in_place: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """One step through the controller memory buffer: one CMB_WRITE of the fp16 grads, through
    the mount's control file, that also has the device put the new fp16 params in the CMB
    (param_cmb_offset) as its kernel computes them. in_place=False also copies the grads
    from the client's own buffer into the CMB and the params back out (what a CPU trainer
    does); in_place=True leaves them there, as a GPU's DMA straight into and out of the
    buffer would. Returns (step, close)."""
    size = 2 * device.n
    admin = AdminClient(device.mountpoint)
    cmb = admin.cmb()
    if cmb is None:
        admin.close()
        raise RuntimeError(f"{device.mountpoint}: the device has no controller memory buffer")
    nsid = admin.nsid("bench")
    grads = (np.random.default_rng(1).standard_normal(device.n) * 0.01).astype(np.float16).view(np.uint8)
    params = np.empty(size, dtype=np.uint8)
    grad_window, param_window = cmb.array[:size], cmb.array[size : 2 * size]
    grad_window[:] = grads
    write = [{"tensor": "w", "length": size, "cmb_offset": 0, "param_cmb_offset": size}]

    def step() -> None:
        if not in_place:
            parallel_copy(grad_window, grads)
        admin.cmb_write(nsid, write)  # an implicit step: committed when this returns
        if not in_place:
            parallel_copy(params, param_window)

    def close() -> None:
        cmb.close()
        admin.close()

    return step, close


def cmb_rows(device: BenchDevice, workdir: Path, n: int, repeat: int, in_memory: float | None,
             device_update: float | None) -> list[dict[str, Any]]:
    """The O_DIRECT file step and the two CMB steps on the same device, in turns: each CMB
    row carries its turn-by-turn ratio to the file step."""
    media = filesystem_of(workdir)
    contenders = {"file": file_path_step(device, True)}
    closers = []
    for in_place in (False, True):
        step, close = cmb_step(device, in_place)
        contenders[f"cmb{'_in_place' if in_place else ''}"] = step
        closers.append(close)
    try:
        for step in contenders.values():
            step()  # warm-up
        seconds: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(repeat):
            for name, step in contenders.items():
                seconds[name] += timed(step, 1, warmup=0)
    finally:
        for close in closers:
            close()
    rows = []
    for name, what in (("cmb", "CMB_WRITE, params back in the CMB; the client copying grads in and params out"),
                       ("cmb_in_place", "CMB_WRITE, params back in the CMB; grads and params left there (as DMA)")):
        row = _file_path_row(device, media, True, False, seconds[name], n, in_memory, device_update, what=what)
        row["transport"] = name
        row["vs_file_path"] = statistics.median(f / c for c, f in zip(seconds[name], seconds["file"]))
        _say(f"    {row['vs_file_path']:.2f}x the O_DIRECT file step, turn by turn")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------- checkpoint, restore

CHECKPOINT_NAMESPACE = "bench-checkpoints"  # the plain NVM namespace torch.save and DCP write to


def checkpoint_volume(device: BenchDevice, workdir: Path, *, create: bool,
                      name: str = CHECKPOINT_NAMESPACE) -> NvmVolume:
    """ext4 on a plain NVM namespace of the bench's own device: the peers' checkpoints go
    through the same drive and its counters, as cossd's do. The checkpoint section's is kept
    between checkpoint and restore; any other is deleted when it closes."""
    size = -(-(32 * device.n + (128 << 20)) // (1 << 20)) * (1 << 20)  # two 14 B/element checkpoints
    return NvmVolume(device.mountpoint, name, size, workdir / f"ext4-{name}",
                     keep_namespace=name == CHECKPOINT_NAMESPACE, create=create)


@contextlib.contextmanager
def trainer_checkpoint_target(device: BenchDevice, workdir: Path) -> Iterator[NvmVolume | bench_trainer.LocalCheckpointDir]:
    """The trainer section's checkpoint volume; where this machine cannot make one (no loop
    devices, no mkfs.ext4: a container), a plain directory beside the backing, said so."""
    try:
        volume = checkpoint_volume(device, workdir, create=True,
                                   name=bench_trainer.TRAINER_NAMESPACE + "-checkpoints").open()
    except (RuntimeError, OSError) as exc:
        reason = f"no ext4 on the device here: {exc}"
    else:
        reason = None
    if reason is not None:
        _say(f"  trainer checkpoints go to a plain directory on {filesystem_of(workdir)} ({reason})")
        yield bench_trainer.LocalCheckpointDir(workdir / "trainer-checkpoints", reason)
        return
    try:
        yield volume
    finally:
        volume.close()


def checkpoint_costs(device: BenchDevice, volume: NvmVolume, n: int) -> dict[str, dict[str, float]]:
    """Seconds to make one step's state durable, and the bytes the drive took for it."""
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
    path = volume.path / "ckpt.pt"
    before = volume.settle()
    started = time.perf_counter()
    with open(path, "wb") as stream:
        torch.save(state, stream)
        stream.flush()
        os.fsync(stream.fileno())
    seconds = time.perf_counter() - started
    results["torch.save + fsync"] = {"seconds": seconds, "file_bytes": path.stat().st_size,
                                     "bytes_over_link": volume.settle()["bytes_written"] - before["bytes_written"]}
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    before = volume.settle()
    started = time.perf_counter()
    future = dcp.async_save(state, checkpoint_id=str(volume.path / "dcp"))
    blocking = time.perf_counter() - started
    future.result()
    seconds = time.perf_counter() - started
    results["DCP async_save"] = {"seconds": seconds, "blocking_seconds": blocking,
                                 "file_bytes": sum(p.stat().st_size for p in files_under(volume.path / "dcp")),
                                 "bytes_over_link": volume.settle()["bytes_written"] - before["bytes_written"]}
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
    # The filesystem is mounted afresh on the restarted device: nothing of the file is cached.
    with checkpoint_volume(device, workdir, create=False) as volume:
        before = volume.statistics()
        started = time.perf_counter()
        torch.load(volume.path / "ckpt.pt", weights_only=True)
        seconds = time.perf_counter() - started
        results["torch.load full state"] = {
            "seconds": seconds, "bytes": volume.statistics()["bytes_read"] - before["bytes_read"]}
    return results


# ---------------------------------------------------------------------- report

def run(args: argparse.Namespace) -> int:
    if "trainer" in getattr(args, "sections", BENCH_SECTIONS):
        bench_trainer.resolve_device(getattr(args, "device", "cpu"))  # no CUDA: say so before any work
    n, repeat = args.elements, args.repeat
    report: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpu": _cpu_name(), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
                    "simd": kernels.simd_level(), "python": platform.python_version()},
        "elements": n, "repeat": repeat, "bytes_per_element": BYTES_PER_ELEMENT,
    }
    _say(f"cossd bench: {n:,} elements, median of {repeat}, kernel path {kernels.simd_level()}, "
         f"{report['machine']['cores']} cores")
    sections = getattr(args, "sections", BENCH_SECTIONS)
    rounds = getattr(args, "rounds", 3)
    kernel_rows = []
    for threads in args.threads if "kernel" in sections else ():
        row = kernel_row(n, repeat, threads, rounds)
        kernel_rows.append(row)
        low, high = row["cossd_vs_fused_round_range"]
        _say(f"  kernel, {threads} thread(s), same buffers for all: cossd {row['cossd_gels']:.2f} G el/s = "
             f"{row['cossd_vs_fused']:.2f}x torch fused ({row['torch_fused_gels']:.2f}; rounds {low:.2f}-{high:.2f}), "
             f"{row['cossd_vs_roofline']:.0%} of the {row['adam_roofline_gels']:.2f} G el/s roofline")
    if kernel_rows:
        report["kernel"] = kernel_rows
        report["rounds"] = rounds
    if not sections & {"mount", "trainer"}:
        _write_report(report, args.output)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="cossd-bench-"))
    device = BenchDevice(workdir, args.file_elements)
    try:
        if "mount" in sections:
            _mount_sections(report, args, device, workdir, kernel_rows)
        if "trainer" in sections:
            ram = ram_workdir()
            ram_device = BenchDevice(ram, BLOCK_ELEMS) if ram is not None else None
            try:
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
                    _say(f"  trainer on {report['trainer']['device']}, {name}: {row['seconds']:.3f} s per step, "
                         f"{row['bytes_over_link'] / 1e6:.0f} MB over the link")
            for name, row in report["trainer"]["iterations"].items():
                if isinstance(row, dict):
                    _say(f"  iteration on {report['trainer']['device']}, {name}: {row['seconds']:.3f} s")
    finally:
        device.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    _write_report(report, args.output)
    return 0


MOUNT_TURNS = 15


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
            devices.append(BenchDevice(ram, args.file_elements))
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
        _say(f"  checkpoint, {name}: {row['seconds']:.3f} s, {row['bytes_over_link'] / 1e6:.0f} MB over the link")
    report["restore"] = restore_costs(device, workdir, args.file_elements)
    for name, row in report["restore"].items():
        _say(f"  restore, {name}: {row['seconds']:.3f} s, {row['bytes'] / 1e6:.0f} MB read")


def filesystem_of(path: Path) -> str:
    """The filesystem type and source that hold `path` ('ext4 /dev/vda'), from /proc/mounts."""
    best, found = "", "unknown"
    target = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            source, point, kind = line.split()[:3]
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, found = point, f"{kind} {source}"
    return found


def ram_workdir_available() -> bool:
    """Whether /dev/shm is a writable tmpfs here (ram_workdir can make a directory)."""
    shm = Path("/dev/shm")
    return shm.is_dir() and filesystem_of(shm).startswith("tmpfs") and os.access(shm, os.W_OK)


def ram_workdir() -> Path | None:
    """A fresh directory on /dev/shm (tmpfs), where this machine has one."""
    if not ram_workdir_available():
        return None
    return Path(tempfile.mkdtemp(prefix="cossd-bench-ram-", dir="/dev/shm"))


# (O_DIRECT, NaN gradients): buffered; O_DIRECT; O_DIRECT with every step skipped.
FILE_PATH_VARIANTS = ((False, False), (True, False), (True, True))


def _file_path_row(device: BenchDevice, media: str, o_direct: bool, nonfinite: bool, seconds: list[float],
                   n: int, in_memory: float | None, device_update: float | None,
                   what: str | None = None) -> dict[str, Any]:
    rate = n / statistics.median(seconds) / 1e9
    share = rate / in_memory if in_memory else None
    what = what or ("O_DIRECT, NaN gradients: every step skipped, no kernel (the mount alone)" if nonfinite
                    else "O_DIRECT" if o_direct else "buffered")
    _say(f"  through the mount ({what}, backing on {media}, {device.front_end}): {rate:.3f} G el/s"
         + (f" = {share:.0%} of the kernel in memory" if share else ""))
    return {"o_direct": o_direct, "media": media, "gels": rate, "vs_kernel_in_memory": share,
            "vs_device_update_in_memory": rate / device_update if device_update else None,
            "skipped_steps": nonfinite, "front_end": device.front_end, "what": what,
            "transport": "files"}


def file_path_rows(device: BenchDevice, workdir: Path, n: int, repeat: int,
                   in_memory: float | None, device_update: float | None = None,
                   pyfuse3_alone: BenchDevice | None = None) -> list[dict[str, Any]]:
    """One step through the mount, buffered and O_DIRECT, with the backing store named; then
    the same O_DIRECT step with every gradient non-finite (skipped: the mount alone).

    With `pyfuse3_alone` (a second device on the same backing, mounted with --io-threads 0),
    each O_DIRECT step takes turns with the same step there; that row follows, with the data
    path's speed-up as the median of the turn-by-turn ratios."""
    media = filesystem_of(workdir)
    rows = []
    for o_direct, nonfinite in FILE_PATH_VARIANTS:
        step = file_path_step(device, o_direct, nonfinite=nonfinite)
        if pyfuse3_alone is None or not o_direct:
            rows.append(_file_path_row(device, media, o_direct, nonfinite, timed(step, repeat), n,
                                       in_memory, device_update))
            continue
        other = file_path_step(pyfuse3_alone, o_direct, nonfinite=nonfinite)
        step()  # warm-up, both
        other()
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(repeat):
            ours += timed(step, 1, warmup=0)
            theirs += timed(other, 1, warmup=0)
        rows.append(_file_path_row(device, media, o_direct, nonfinite, ours, n, in_memory, device_update))
        alone = _file_path_row(pyfuse3_alone, media, o_direct, nonfinite, theirs, n, in_memory, device_update)
        alone["data_path_speedup"] = statistics.median(t / o for o, t in zip(ours, theirs))
        _say(f"    the data path: {alone['data_path_speedup']:.2f}x pyfuse3 alone, turn by turn")
        rows.append(alone)
    return rows


def _write_report(report: dict[str, Any], output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    (output / "bench.md").write_text(markdown(report) + "\n")
    written = [output / "bench.json", output / "bench.md"]
    try:
        chart(report, output / "bench.png")
        written.append(output / "bench.png")
        drawn = ""
    except ImportError as exc:  # matplotlib comes with the trainer extra
        drawn = (f"\nbench.png not drawn: {exc.name or 'matplotlib'} is not installed "
                 "(pip install 'cossd[trainer]', or pip install matplotlib); the figures are in the files above")
    _say("")
    _say(markdown(report))
    _say(f"\nwritten: {', '.join(str(path) for path in written)}{drawn}")


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
             f"{report['elements']:,} elements, median of {report['repeat']}"
             + (f" turns in each of {report['rounds']} rounds" if "rounds" in report else "") + "."]
    if report.get("kernel"):
        lines += ["", "Kernel, in memory: every contender steps on the same buffers, in turns; G el/s are medians, "
                  "the ratios are medians of turn-by-turn ratios, with the range of the round medians.", "",
                  "| threads | memory bandwidth | roofline (28 B/el) | cossd kernel | torch fused | torch foreach "
                  "| DeepSpeed CPUAdam (cossd / it) | cossd / fused | cossd / roofline | device block update |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report.get("kernel", []):
        deepspeed = (f"{row['deepspeed_gels']:.2f} ({row['cossd_vs_deepspeed']:.2f}x)" if row["deepspeed_gels"]
                     else "not installed" if (row.get("deepspeed_missing") or "").startswith("not installed")
                     else "did not build")
        fused_low, fused_high = row["cossd_vs_fused_round_range"]
        roof_low, roof_high = row["cossd_vs_roofline_round_range"]
        lines.append(f"| {row['threads']} | {row['bandwidth_gbs']:.1f} GB/s | {row['adam_roofline_gels']:.2f} G el/s "
                     f"| {row['cossd_gels']:.2f} | {row['torch_fused_gels']:.2f} | {row['torch_foreach_gels']:.2f} "
                     f"| {deepspeed} | {row['cossd_vs_fused']:.2f}x ({fused_low:.2f}-{fused_high:.2f}) "
                     f"| {row['cossd_vs_roofline']:.0%} ({roof_low:.0%}-{roof_high:.0%}) "
                     f"| {row['cossd_device_gels']:.2f} ({row['device_update_vs_kernel']:.0%} of the kernel) |")
    missing = next((row["deepspeed_missing"] for row in report.get("kernel", []) if row.get("deepspeed_missing")), None)
    if missing:
        lines += ["", f"DeepSpeed CPUAdam: {missing}."]
    if report.get("kernel"):
        moved = report["kernel"][0]["bytes_per_element"]
        lines += ["", "Bytes per element, read + written: " + "; ".join(
            f"{name} {b['read']} + {b['written']}" for name, b in moved.items())
            + (" (torch foreach: at least; it makes a pass per operation)" if "torch_foreach" in moved else "")
            + ". cossd's outputs written with streaming stores: "
            + (", ".join(report["kernel"][0]["streaming_stores"])
               + "; cossd / cossd with ordinary stores: "
               + ", ".join(f"{row['streaming_gain']:.2f}x" for row in report["kernel"]) + " (by thread count)."
               if report["kernel"][0]["streaming_stores"] else
               "none, the call is below kernels.stream_threshold() (the param lines are read first: +2 B).")]
    if "trainer" in report:
        lines += bench_trainer.markdown_rows(report["trainer"])
    if "file_path" not in report:  # no mount section
        return "\n".join(lines)
    lines += ["", f"Through the mount: medians of {report.get('mount_turns', report['repeat'])} steps each; "
              "rows measured in turns say so.", "",
              "| through the mount (FP16 grads in, FP16 params out) | backing store | front end | G el/s "
              "| of the kernel in memory | of the device block update in memory |",
              "|---|---|---|---|---|---|"]
    for row in report.get("file_path", []):
        share = f"{row['vs_kernel_in_memory']:.0%}" if row["vs_kernel_in_memory"] else "kernel not run"
        device_share = (f"{row['vs_device_update_in_memory']:.0%}" if row.get("vs_device_update_in_memory")
                        else "kernel not run")
        what = row["what"]
        if row.get("data_path_speedup"):
            what += f" (the data path is {row['data_path_speedup']:.2f}x this, turn by turn)"
        if row.get("vs_file_path"):
            what += f" ({row['vs_file_path']:.2f}x the O_DIRECT file step, turn by turn)"
        lines.append(f"| {what} | {row.get('media', '')} | {row.get('front_end', '')} | {row['gels']:.3f} "
                     f"| {share} | {device_share} |")
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

    trainer = report.get("trainer")
    # Steps through the mount with the media in RAM: files and the memory buffer.
    mount_rows = [row for row in report.get("file_path", [])
                  if row["media"].startswith("tmpfs") and row["o_direct"] and not row["skipped_steps"]]
    panels = 3 + bool(trainer) + bool(mount_rows)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    rows = report.get("kernel", [])
    labels = [f"{r['threads']} thr" for r in rows]
    bars = [("cossd_gels", "cossd"), ("cossd_device_gels", "device update"), ("torch_fused_gels", "torch fused"),
            ("torch_foreach_gels", "torch foreach"), ("deepspeed_gels", "DeepSpeed CPUAdam"),
            ("adam_roofline_gels", "roofline")]
    bars = [(key, name) for key, name in bars if all(r.get(key) for r in rows)]
    width = 0.8 / max(1, len(bars))
    for offset, (key, name) in enumerate(bars):
        axes[0].bar([i + offset * width for i in range(len(rows))], [r[key] for r in rows], width, label=name)
    axes[0].set_xticks([i + (len(bars) - 1) * width / 2 for i in range(len(rows))], labels)
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
    if trainer:
        rows = {name.split(" (")[0]: row for name, row in trainer.items()
                if isinstance(row, dict) and name != "iterations"}
        axes[3].bar(list(rows), [row["seconds"] for row in rows.values()], color="#1b9e77")
        axes[3].set(title=f"one durable step, trainer on {trainer['device']}", ylabel="seconds")
        axes[3].tick_params(axis="x", labelsize=7)
    if mount_rows:
        labels = {"files": "files", "cmb": "CMB,\nclient copies", "cmb_in_place": "CMB,\nin place"}
        names = [labels[row.get("transport", "files")] + ("\n(pyfuse3 alone)" if row["front_end"] == "pyfuse3 alone"
                                                          else "") for row in mount_rows]
        ax = axes[panels - 1]
        ax.bar(names, [row["gels"] for row in mount_rows], color="#e7298a")
        kernel = max((row["cossd_gels"] for row in report.get("kernel", [])), default=None)
        if kernel:
            ax.axhline(0.6 * kernel, color="gray", linestyle="--", label="60% of the kernel")
            ax.legend(fontsize=8)
        ax.set(title="one step through the mount (tmpfs)", ylabel="G elements/s")
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    cli = argparse.ArgumentParser(prog="python -m cossd.trainer.bench", description=__doc__)
    add_bench_arguments(cli)
    sys.exit(run(cli.parse_args()))
