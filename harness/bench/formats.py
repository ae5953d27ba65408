"""`cossd bench --sections formats`: the step through the CMB with fp32, bf16, fp16 and int8 moments in one run (G el/s, media bytes per step from the device's counters), and the kernel beside torchao's and bitsandbytes' 8-bit AdamW on the CPU."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ... import kernels
from ...client import AdminClient
from ...emulator import Device
from ...fs import daemon
from ...kernels.state_formats import state_bytes_per_element, state_scale_count
from ..measure import say, timed

FORMATS = ("fp32", "bf16", "fp16", "int8")
HYPER = kernels.AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, mode="adamw")


def _grads(n: int) -> np.ndarray:
    """The step's fp16 gradients (the same for every format), as bytes."""
    return (np.random.default_rng(1).standard_normal(n) * 0.01).astype(np.float16).view(np.uint8)


def cmb_format_rows(workdir: Path, n: int, repeat: int) -> list[dict[str, Any]]:
    """One device, a namespace of one n-element tensor per format; the in-place CMB step
    (one CMB_WRITE, params back in the CMB) of each, in turns. Media bytes per step are the
    device's own count (log page C0h, media_bytes_written) over the timed steps."""
    backing, mountpoint = workdir / "backing", workdir / "mnt"
    mountpoint.mkdir()
    Device.format(backing)
    pid = daemon.start_background(backing, mountpoint)
    try:
        with AdminClient(mountpoint) as admin:
            for dtype in FORMATS:
                admin.create_namespace({"name": dtype, "tensors": [["w", n]], "state_dtype": dtype})
            cmb = admin.cmb()
            if cmb is None:
                raise RuntimeError(f"{mountpoint}: the device has no controller memory buffer")
            try:
                size = 2 * n
                cmb.array[:size] = _grads(n)  # grads at 0, params after them, for every format
                write = [{"tensor": "w", "length": size, "cmb_offset": 0, "param_cmb_offset": size}]
                nsids = {dtype: admin.nsid(dtype) for dtype in FORMATS}
                steps = {dtype: (lambda nsid=nsid: admin.cmb_write(nsid, write)) for dtype, nsid in nsids.items()}
                for step in steps.values():
                    step()  # warm-up: step 1 of each
                before = admin.optimizer_log()
                seconds: dict[str, list[float]] = {dtype: [] for dtype in FORMATS}
                for _ in range(repeat):
                    for dtype, step in steps.items():
                        seconds[dtype] += timed(step, 1, warmup=0)
                after = admin.optimizer_log()
            finally:
                cmb.close()
    finally:
        daemon.stop_background(mountpoint, pid)
    rows = []
    for dtype in FORMATS:
        median = statistics.median(seconds[dtype])
        media = (after[dtype]["media_bytes_written"] - before[dtype]["media_bytes_written"]) / repeat
        row = {"state_dtype": dtype, "elements": n, "seconds": median, "g_el_per_s": n / median / 1e9,
               "media_bytes_written_per_step": media, "media_bytes_per_element": media / n,
               "state_bytes_per_copy": after[dtype]["state_bytes_per_copy"]}
        say(f"  formats, CMB step, {dtype}: {row['g_el_per_s']:.3f} G el/s, "
            f"{media / 1e6:.1f} MB written to the media per step ({media / n:.2f} B/element)")
        rows.append(row)
    return rows


def _cossd_kernel(dtype: str, n: int) -> Callable[[], None]:
    """One in-place step of the device's kernel over n elements in one thread (adam_step_q)."""
    fmt = kernels.StateFormat[dtype.upper()]
    code = {"fp32": np.float32, "bf16": np.uint16, "fp16": np.uint16, "int8": np.uint8}[dtype]
    master = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    m, v, param = np.zeros(n, code), np.zeros(n, code), np.zeros(n, np.uint16)
    scales = [np.zeros(state_scale_count(n), np.float32) for _ in range(2)]
    grad = _grads(n).view(np.uint16)
    step = [0]

    def run() -> None:
        step[0] += 1
        kernels.adam_step_q(grad, master, m, v, master, m, v, param, exp_avg_scale_in=scales[0],
                            exp_avg_sq_scale_in=scales[1], exp_avg_scale_out=scales[0],
                            exp_avg_sq_scale_out=scales[1], grad_format=kernels.HalfFormat.FP16,
                            param_format=kernels.HalfFormat.FP16, state_format=fmt,
                            scalars=kernels.adam_scalars(HYPER, step[0]))

    return run


def _torch_optimizer(make: Callable[[Any], Any], n: int) -> Callable[[], None]:
    """One step of a torch optimizer over one n-element FP32 parameter with a fixed gradient."""
    import torch

    torch.manual_seed(2)
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.from_numpy(_grads(n).view(np.float16).astype(np.float32))
    optimizer = make(param)
    return lambda: optimizer.step()


def _torchao_adamw8bit(param: Any) -> Any:
    from torchao.optim import AdamW8bit

    return AdamW8bit([param], lr=1e-3, weight_decay=0.01)


def _bitsandbytes_adamw8bit(param: Any) -> Any:
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit([param], lr=1e-3, weight_decay=0.01)


def _torch_fused_adamw(param: Any) -> Any:
    import torch

    return torch.optim.AdamW([param], lr=1e-3, weight_decay=0.01, fused=True)


# (name, moments, make): the CPU peers, each timed where it imports and runs here.
PEERS: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    ("torch.optim.AdamW(fused=True)", "fp32", _torch_fused_adamw),
    ("torchao.optim.AdamW8bit", "8-bit, blocks of 256 + absmax", _torchao_adamw8bit),
    ("bitsandbytes.optim.AdamW8bit", "8-bit, blocks of 256 + absmax", _bitsandbytes_adamw8bit),
)


def kernel_format_rows(n: int, repeat: int, peers: tuple[tuple[str, str, Callable[[Any], Any]], ...] = PEERS,
                       ) -> list[dict[str, Any]]:
    """The device's kernel per format in one thread, then the CPU peers on the same n, in
    this process's torch threads; a peer that does not import or run gets a row saying why."""
    import torch

    rows = []
    for dtype in FORMATS:
        seconds = statistics.median(timed(_cossd_kernel(dtype, n), repeat, warmup=2))
        rows.append({"kernel": f"cossd adam_step_q ({kernels.simd_level()}, 1 thread)", "moments": dtype,
                     "elements": n, "seconds": seconds, "g_el_per_s": n / seconds / 1e9,
                     "moment_bytes_per_element": state_bytes_per_element(kernels.StateFormat[dtype.upper()])})
    for name, moments, make in peers:
        row: dict[str, Any] = {"kernel": f"{name} ({torch.get_num_threads()} torch threads)", "moments": moments,
                               "elements": n}
        try:
            step = _torch_optimizer(make, n)
            started = time.perf_counter()
            step()  # the first step builds the state (torchao compiles its kernel here)
            row["first_step_seconds"] = time.perf_counter() - started
            seconds = statistics.median(timed(step, repeat, warmup=1))
            row |= {"seconds": seconds, "g_el_per_s": n / seconds / 1e9}
        except Exception as exc:  # noqa: BLE001 (any failure of a peer is its row's answer)
            row["unavailable"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        rows.append(row)
    for row in rows:
        if "unavailable" in row:
            say(f"  formats, kernel, {row['kernel']}: not run here ({row['unavailable']})")
        else:
            say(f"  formats, kernel, {row['kernel']}, {row['moments']}: {row['g_el_per_s']:.3f} G el/s")
    return rows


def formats_costs(workdir: Path, cmb_elements: int, kernel_elements: int, repeat: int,
                  peers: tuple[tuple[str, str, Callable[[Any], Any]], ...] = PEERS) -> dict[str, Any]:
    """The section's report: the CMB step per format, and the kernels (`peers`: which CPU
    optimizers run beside them; torchao's compiles its kernel for about 20 s on 2 cores)."""
    return {"cmb": cmb_format_rows(workdir, cmb_elements, repeat),
            "kernel": kernel_format_rows(kernel_elements, repeat, peers)}
