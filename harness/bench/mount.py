"""`cossd bench`'s mount section: one step through the tensor files (buffered, O_DIRECT) and through the CMB."""
from __future__ import annotations

import mmap
import os
import statistics
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ...client import AdminClient, CmbMapping
from ...client.computational import CmbProgram
from ...emulator.cmb import parallel_copy
from ...emulator.workers import KernelWorkers

from .device import BenchDevice, filesystem_of
from .scale import disk_throughput
from ..measure import say, timed


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


def _bench_cmb(device: BenchDevice) -> tuple[AdminClient, CmbMapping, int, np.ndarray]:
    """A client of the bench device, its CMB mapping, the bench namespace's nsid, and the
    step's fp16 gradients as bytes (the same for every CMB contender)."""
    admin = AdminClient(device.mountpoint)
    cmb = admin.cmb()
    if cmb is None:
        admin.close()
        raise RuntimeError(f"{device.mountpoint}: the device has no controller memory buffer")
    grads = (np.random.default_rng(1).standard_normal(device.n) * 0.01).astype(np.float16).view(np.uint8)
    return admin, cmb, admin.nsid("bench"), grads


def cmb_step(device: BenchDevice, in_place: bool) -> tuple[Callable[[], None], Callable[[], None]]:
    """One step through the controller memory buffer: one CMB_WRITE of the fp16 grads, through
    the mount's control file, that also has the device put the new fp16 params in the CMB
    (param_cmb_offset) as its kernel computes them. in_place=False also copies the grads
    from the client's own buffer into the CMB and the params back out (what a CPU trainer
    does); in_place=True leaves them there, as a GPU's DMA straight into and out of the
    buffer would. Returns (step, close)."""
    size = 2 * device.n
    admin, cmb, nsid, grads = _bench_cmb(device)
    params = np.empty(size, dtype=np.uint8)
    grad_window, param_window = cmb.array[:size], cmb.array[size : 2 * size]
    grad_window[:] = grads
    write = [{"tensor": "w", "length": size, "cmb_offset": 0, "param_cmb_offset": size}]
    # The client's copies split across cores as the device's own are (a pool of its own:
    # the device's kernel workers live in the daemon).
    workers = KernelWorkers("cossd-bench-copy")

    def step() -> None:
        if not in_place:
            parallel_copy(grad_window, grads, workers)
        admin.cmb_write(nsid, write)  # an implicit step: committed when this returns
        if not in_place:
            parallel_copy(params, param_window, workers)

    def close() -> None:
        workers.shutdown()
        cmb.close()
        admin.close()

    return step, close


def execute_program_step(device: BenchDevice) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """The in-place CMB step through the standard face instead: one Execute Program of the
    built-in adamw_step (NVMe Computational Programs, I/O 01h) over the gradients and params
    left in the CMB, naming the step it opens and commits, as CMB_WRITE's implicit step does.
    Returns (prepare, step, close): prepare, untimed before each step, reads the step to name
    (the bench's other rows step the same namespace in between). Timed with the step, that
    read of the mount's `step` file (lookups, open, read, close) cost 1.0-1.5 ms on an idle
    2-core VM, which the Execute itself does not."""
    size = 2 * device.n
    admin, cmb, nsid, grads = _bench_cmb(device)
    cmb.array[:size] = grads
    program = CmbProgram(admin)
    # One tensor over the whole namespace: element 0 on, its grads at 0 and params after them.
    spans = [(0, device.n, 0, size)]
    step_file = device.mountpoint / "ns" / "bench" / "step"
    named = [0]

    def prepare() -> None:
        named[0] = int(step_file.read_text()) + 1

    def step() -> None:
        program.adamw_step(nsid, spans, step=named[0])

    def close() -> None:
        cmb.close()
        admin.close()

    return prepare, step, close


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
    prepare, step, close = execute_program_step(device)
    contenders["execute_program"] = step
    closers.append(close)
    try:
        for name, step in contenders.items():
            if name == "execute_program":
                prepare()  # untimed, right before its step
            step()  # warm-up
        seconds: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(repeat):
            for name, step in contenders.items():
                if name == "execute_program":
                    prepare()
                seconds[name] += timed(step, 1, warmup=0)
    finally:
        for close in closers:
            close()
    rows = []
    for name, what in (("cmb", "CMB_WRITE, params back in the CMB; the client copying grads in and params out"),
                       ("cmb_in_place", "CMB_WRITE, params back in the CMB; grads and params left there (as DMA)"),
                       ("execute_program", "Execute Program (NVMe Computational Programs, adamw_step) over "
                                           "grads and params left in the CMB")):
        row = _file_path_row(device, media, True, False, seconds[name], n, in_memory, device_update, what=what)
        row["transport"] = name
        row["vs_file_path"] = statistics.median(f / c for c, f in zip(seconds[name], seconds["file"]))
        say(f"    {row['vs_file_path']:.2f}x the O_DIRECT file step, turn by turn")
        if name == "execute_program":  # the standard face beside the vendor command, turn by turn
            row["vs_cmb_in_place"] = statistics.median(
                c / e for e, c in zip(seconds[name], seconds["cmb_in_place"]))
            say(f"    {row['vs_cmb_in_place']:.2f}x the in-place CMB_WRITE step's rate, turn by turn")
        rows.append(row)
    return rows


# (O_DIRECT, NaN gradients): buffered; O_DIRECT; O_DIRECT with every step skipped.
FILE_PATH_VARIANTS = ((False, False), (True, False), (True, True))


def _file_path_row(device: BenchDevice, media: str, o_direct: bool, nonfinite: bool, seconds: list[float],
                   n: int, in_memory: float | None, device_update: float | None,
                   what: str | None = None, disk_gels: float | None = None) -> dict[str, Any]:
    rate = n / statistics.median(seconds) / 1e9
    share = rate / in_memory if in_memory else None
    disk_share = rate / disk_gels if disk_gels and not nonfinite else None
    what = what or ("O_DIRECT, NaN gradients: every step skipped, no kernel (the mount alone)" if nonfinite
                    else "O_DIRECT" if o_direct else "buffered")
    say(f"  through the mount ({what}, backing on {media}, {device.front_end}): {rate:.3f} G el/s"
         + (f" = {share:.0%} of the kernel in memory" if share else "")
         + (f", {disk_share:.2f}x what the disk sustains at 12 B/element" if disk_share else ""))
    return {"o_direct": o_direct, "media": media, "gels": rate, "vs_kernel_in_memory": share,
            "vs_disk_at_12_bytes": disk_share,
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
    path's speed-up as the median of the turn-by-turn ratios.

    On a disk (not tmpfs), `dd` O_DIRECT into the same directory first (1 GiB, as the scale
    section's probe): each row then also says how it compares with what the disk sustains
    at the 12 B of new state an element needs per durable step."""
    media = filesystem_of(workdir)
    disk = None if media.startswith("tmpfs") else disk_throughput(workdir, 1 << 30)
    disk_gels = disk["gels_at_12_bytes"] if disk and disk["measured"] else None
    if disk is not None and disk_gels:
        say(f"  the disk under {media}: dd O_DIRECT {disk['bytes_per_second'] / 1e9:.2f} GB/s = "
            f"{disk_gels:.3f} G el/s at 12 B/element")
    rows = []
    for o_direct, nonfinite in FILE_PATH_VARIANTS:
        step = file_path_step(device, o_direct, nonfinite=nonfinite)
        if pyfuse3_alone is None or not o_direct:
            rows.append(_file_path_row(device, media, o_direct, nonfinite, timed(step, repeat), n,
                                       in_memory, device_update, disk_gels=disk_gels))
            continue
        other = file_path_step(pyfuse3_alone, o_direct, nonfinite=nonfinite)
        step()  # warm-up, both
        other()
        ours: list[float] = []
        theirs: list[float] = []
        for _ in range(repeat):
            ours += timed(step, 1, warmup=0)
            theirs += timed(other, 1, warmup=0)
        rows.append(_file_path_row(device, media, o_direct, nonfinite, ours, n, in_memory, device_update,
                                   disk_gels=disk_gels))
        alone = _file_path_row(pyfuse3_alone, media, o_direct, nonfinite, theirs, n, in_memory, device_update,
                               disk_gels=disk_gels)
        alone["data_path_speedup"] = statistics.median(t / o for o, t in zip(ours, theirs))
        say(f"    the data path: {alone['data_path_speedup']:.2f}x pyfuse3 alone, turn by turn")
        rows.append(alone)
    return rows
