"""`cossd bench`'s kernel section: cossd's Adam kernel beside torch's and DeepSpeed's, in memory, like for like."""
from __future__ import annotations

import importlib.util
import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

from ... import kernels
from ...emulator.layout import BLOCK_ELEMS

from ..measure import split_run

BYTES_PER_ELEMENT = 28  # every kernel contender moves 28 bytes per element (BYTES_MOVED)
HYPER = kernels.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, mode="adamw")


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
    # The block update's streams with trivial arithmetic: the roofline of an A/B update.
    "roofline_out_of_place": (14, 14),
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
PAGE = 4096
OPENMP_CONTENDERS = frozenset({"torch_fused", "torch_foreach", "deepspeed"})  # their threads spin once done
OPENMP_IDLE_S = 0.05  # longer than an idle OpenMP worker spins before it sleeps


def _moderate(count: int, generator: torch.Generator) -> torch.Tensor:
    """count FP32 values of magnitude 0.5 to 2: exact in FP16, far from subnormal and overflow."""
    return torch.rand(count, generator=generator) * 1.5 + 0.5


def _page_aligned(count: int, dtype: type) -> np.ndarray:
    """An array of `count` elements starting on a page boundary, its pages touched."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(count * itemsize + PAGE, np.uint8)
    skip = -raw.ctypes.data % PAGE
    return raw[skip:skip + count * itemsize].view(dtype)


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
        # The second set the out-of-place contenders write (master, moments, param), as the
        # device writes its shadow copy: both write the very same pages. Page-aligned like the
        # device's mapped state regions: numpy's large arrays start 16 bytes into a page, where
        # the block update cannot use streaming stores and measured a third slower.
        self.shadow = [_page_aligned(n, np.float32) for _ in range(3)] + [_page_aligned(n, np.uint16)]


def roofline_probe(buffers: KernelBuffers, threads: int) -> Callable[[], None]:
    """What memory allows for the Adam step's access pattern: the same streams (28 bytes per
    element, in place) with trivial arithmetic, in C."""
    b = buffers

    def probe(start: int, stop: int) -> None:
        s = slice(start, stop)
        kernels.stream_probe(b.grad16[s], b.master_np[s], b.exp_avg_np[s], b.exp_avg_sq_np[s])

    return lambda: split_run(probe, b.n, threads)


def out_of_place_probe(buffers: KernelBuffers, threads: int) -> Callable[[], None]:
    """What memory allows the device's block update: its streams (the committed copy in, the
    shadow out with streaming stores) with trivial arithmetic, in C, in one call per thread.
    An A/B update writes lines it has not read; an in-place step writes back the ones it has,
    and on some machines memory is markedly slower at the former (docs/benchmarks.md)."""
    b = buffers

    def probe(start: int, stop: int) -> None:
        s = slice(start, stop)
        kernels.stream_probe_out_of_place(b.grad16[s], b.master_np[s], b.exp_avg_np[s], b.exp_avg_sq_np[s],
                                          *(array[s] for array in b.shadow))

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
    block_update = kernels.BlockUpdate(b.master_np, b.exp_avg_np, b.exp_avg_sq_np, *b.shadow,
                                       grad_format=kernels.HalfFormat.FP16, param_format=kernels.HalfFormat.FP16,
                                       state_format=kernels.StateFormat.FP32)

    def update(start: int, stop: int) -> None:
        for low in range(start, stop, BLOCK_ELEMS):
            block_update(b.grad16[low:min(stop, low + BLOCK_ELEMS)], low, scalars)  # (crc, non-finite, param crc)

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
        from deepspeed.ops.adam import DeepSpeedCPUAdam

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
            "roofline_out_of_place": out_of_place_probe(buffers, threads),
            "torch_fused": torch_adamw(buffers, threads, fused=True),
            "torch_foreach": torch_adamw(buffers, threads, foreach=True),
            "deepspeed": deepspeed_cpuadam(buffers, threads),
        }
        present = {name: step for name, step in contenders.items() if step is not None}
        first = slice(0, n // threads)  # the first thread's call, as split_run makes them
        master, exp_avg, exp_avg_sq = (array[first] for array in (buffers.master_np, buffers.exp_avg_np,
                                                                    buffers.exp_avg_sq_np))
        streamed = kernels.stream_plan(master, exp_avg, exp_avg_sq, master, exp_avg, exp_avg_sq,  # in place
                                       buffers.param16[first], state_format=kernels.StateFormat.FP32)
        for step in present.values():
            step()  # warm up: lazy initialisation, code paths
        names = list(present)
        times: dict[str, list[float]] = {name: [] for name in names}
        previous = None
        for turn in range(repeat):
            shift = (round_index + turn) % len(names)
            for name in names[shift:] + names[:shift]:
                # torch's and DeepSpeed's OpenMP threads spin a while after their step; the
                # rotation keeps the same contender right behind each of them, and on 2 cores
                # that one lost up to a fifth of its speed to the spinning (the roofline probe,
                # behind DeepSpeed). A pause lets them sleep first.
                if previous in OPENMP_CONTENDERS:
                    time.sleep(OPENMP_IDLE_S)
                previous = name
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

    def speed_over(name: str, other: str) -> float:
        """name's speed over other's, paired turn by turn (the same moment, the same pages):
        the median of their time ratios."""
        return statistics.median(theirs / ours for ours, theirs in zip(samples[name], samples[other]))

    ratio = {name: speed_over("cossd", name) for name in samples if name != "cossd"}  # cossd over each
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
        # What memory allows the block update (its streams, trivial arithmetic), over what it
        # allows a step in place; and the block update over its own roofline.
        "out_of_place_roofline_gels": rate["roofline_out_of_place"],
        "out_of_place_vs_in_place_roofline": speed_over("roofline_out_of_place", "roofline"),
        "device_update_vs_out_of_place_roofline": speed_over("cossd_device", "roofline_out_of_place"),
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
