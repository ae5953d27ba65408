"""The peers section's model check: the timing model's cossd / ZeRO-Infinity ratio on this host's measured rates against the measured ratio, and the model's projection to Smart-Infinity's setup (A100, 10 SmartSSDs)."""
from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Any

from ...model.offload import measured_profile, zero_infinity_serial
from ...model.profiles import load_profile
from ...model.step_model import StepSetup, predict_cossd, predict_zero_infinity

PROBE_BYTES = 256 << 20
BLOCK = 1 << 20

# Smart-Infinity (Jang et al., HPCA 2024): up to 2.11x over ZeRO-Infinity with 10 SmartSSDs on
# an A100 box; 1.6x is the low end the paper reports across its models.
SMART_INFINITY_PUBLISHED = (1.6, 2.11)
# The projection's assumptions (docs/timing-model.md): the SmartSSDs behind one PCIe Gen3 x16
# uplink, FP32 gradients and params as in Smart-Infinity's evaluation, and an A100's compute
# at 40% of its 312 TFLOPS (BF16) on 8 sequences of 1,024 tokens per step.
PROJECTION_UPLINK_BYTES_PER_S = 15_750_000_000
A100_FLOPS = 312e12 * 0.4
PROJECTION_TOKENS = 8 * 1024
PROJECTION_SIZES = (1_500_000_000, 4_000_000_000, 13_000_000_000)


def disk_rates(directory: Path) -> dict[str, float]:
    """The disk's rates as ZeRO-Infinity's swap meets them, bytes per second each way:
    PROBE_BYTES in 1 MiB O_DIRECT requests into a file already written, then fsync
    (`write_bytes_per_s`), and read back (`read_bytes_per_s`).

    DeepSpeed's aio opens a swap file O_WRONLY | O_CREAT | O_DIRECT, without O_TRUNC, so from
    the second step on it rewrites blocks ext4 has already allocated. Writing a fresh file
    (allocating its extents as it goes) ran 1.5-1.7x slower on this VM's disk; the check used
    that rate until 2026-12-06, and the model then put ZeRO-Infinity's 100M step 20-30% above
    the measured one. The first write is still timed and reported (`first_write_bytes_per_s`)."""
    path = directory / "disk-probe"
    buffer = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buffer.write(os.urandom(BLOCK))
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)

    def write_all() -> float:
        started = time.perf_counter()
        for offset in range(0, PROBE_BYTES, BLOCK):
            os.pwritev(fd, [buffer], offset)
        os.fsync(fd)
        return time.perf_counter() - started

    try:
        first = write_all()
        rewrote = write_all()
        started = time.perf_counter()
        for offset in range(0, PROBE_BYTES, BLOCK):
            os.preadv(fd, [buffer], offset)
        read = time.perf_counter() - started
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"write_bytes_per_s": PROBE_BYTES / rewrote, "read_bytes_per_s": PROBE_BYTES / read,
            "first_write_bytes_per_s": PROBE_BYTES / first}


def copy_rate() -> float:
    """Bytes per second of a large in-memory copy: the CMB's "link" on this host."""
    import torch

    source, target = torch.ones(PROBE_BYTES // 4), torch.empty(PROBE_BYTES // 4)
    target.copy_(source)
    started = time.perf_counter()
    for _ in range(4):
        target.copy_(source)
    return 4 * PROBE_BYTES / (time.perf_counter() - started)


def device_rate_of(cossd: dict[str, Any]) -> tuple[float, str]:
    """The device's updater rate in elements per second (its whole step: Adam and the media
    path around it), and which measurement gave it.

    The daemon's CPU time per step over the cores it had, where the run measured it. The
    block updates' wall clocks summed over the device's threads (the fallback) count the time
    a thread waits for the core while another runs: pinned to one core, they overstated the
    device's time per step about 2x, and the model came out 37-63% pessimistic for cossd."""
    params = cossd["parameters"]
    device = cossd.get("device_seconds_per_step", {})
    if device.get("cpu"):
        return params * device.get("cores", 1) / device["cpu"], "the daemon's CPU time per step over its cores"
    if device.get("block_updates"):
        return params / device["block_updates"], "the block updates' wall time, summed over the device's threads"
    return params / cossd["phases_s"]["optimizer_s"], "the trainer's optimizer phase"


def _check_one(rows: dict[str, Any], rates: dict[str, float]) -> dict[str, Any] | None:
    """The model's ratio for one size and placement, where cossd, ZeRO-Infinity (disk) and
    ZeRO-Offload (the host Adam rate) all ran."""
    cossd, zero, offload = (rows.get(p) or {} for p in ("cossd", "zero_infinity_disk", "zero_offload"))
    if not (cossd.get("ok") and zero.get("ok") and offload.get("ok")):
        return None
    params = cossd["parameters"]
    device_rate, device_rate_source = device_rate_of(cossd)
    host_adam_rate = zero["parameters"] / offload["phases_s"]["optimizer_s"]
    cossd_profile = measured_profile("this host, cossd's device", link_bytes_per_s=rates["copy_bytes_per_s"],
                                     read_bytes_per_s=rates["copy_bytes_per_s"],
                                     write_bytes_per_s=rates["copy_bytes_per_s"], adam_elements_per_s=device_rate)
    disk_profile = measured_profile("this host's disk", link_bytes_per_s=rates["copy_bytes_per_s"],
                                    read_bytes_per_s=rates["read_bytes_per_s"],
                                    write_bytes_per_s=rates["write_bytes_per_s"], adam_elements_per_s=host_adam_rate)
    cossd_compute, zero_compute = cossd["phases_s"]["forward_backward_s"], zero["phases_s"]["forward_backward_s"]
    predicted_cossd = predict_cossd(StepSetup(params=params, compute_s=cossd_compute, profile=cossd_profile))
    predicted_zero = predict_zero_infinity(StepSetup(params=zero["parameters"], compute_s=zero_compute,
                                                     profile=disk_profile, host_adam_elements_per_s=int(host_adam_rate)))
    serial_zero = zero_infinity_serial(zero["parameters"], round(zero_compute * 1e9), disk_profile,
                                       host_adam_elements_per_s=int(host_adam_rate))
    measured = cossd["step_s"]["median"] / zero["step_s"]["median"]
    predicted = predicted_cossd.step_ns / serial_zero.step_ns
    pipelined = predicted_cossd.step_ns / predicted_zero.step_ns
    return {
        "inputs": {"device_adam_elements_per_s": device_rate, "device_rate_source": device_rate_source,
                   "host_adam_elements_per_s": host_adam_rate,
                   "cossd_forward_backward_s": cossd_compute, "zero_forward_backward_s": zero_compute},
        "predicted_step_s": {"cossd": predicted_cossd.step_ns / 1e9, "zero_infinity": serial_zero.step_ns / 1e9,
                             "zero_infinity_pipelined": predicted_zero.step_ns / 1e9},
        "zero_infinity_phases_s": {"gradient_swap_out": serial_zero.gradient_swap_out_ns / 1e9,
                                   "swap_in": serial_zero.swap_in_ns / 1e9, "adam": serial_zero.adam_ns / 1e9,
                                   "swap_out": serial_zero.swap_out_ns / 1e9},
        "measured_step_s": {"cossd": cossd["step_s"]["median"], "zero_infinity": zero["step_s"]["median"]},
        "predicted_ratio": predicted, "measured_ratio": measured, "error": predicted / measured - 1,
        "pipelined_ratio": pipelined, "pipelined_error": pipelined / measured - 1,
    }


def smart_infinity_projection() -> list[dict[str, Any]]:
    """cossd's speedup over ZeRO-Infinity in the model, on 10 SmartSSD-like drives behind one
    Gen3 x16 uplink with an A100's compute, beside Smart-Infinity's published range."""
    profile = load_profile("smartssd-fpga")
    rows = []
    for params in PROJECTION_SIZES:
        compute_s = 6 * params * PROJECTION_TOKENS / A100_FLOPS
        setup = StepSetup(params=params, compute_s=compute_s, profile=profile, grad_bytes=4, param_bytes=4,
                          drives=10, uplink_bytes_per_s=PROJECTION_UPLINK_BYTES_PER_S)
        cossd, pipelined = predict_cossd(setup), predict_zero_infinity(setup)
        serial = zero_infinity_serial(params, round(compute_s * 1e9), profile, drives=10,
                                      uplink_bytes_per_s=PROJECTION_UPLINK_BYTES_PER_S,
                                      host_adam_elements_per_s=setup.host_adam_elements_per_s)
        rows.append({"params": params, "compute_s": compute_s, "cossd_step_s": cossd.step_ns / 1e9,
                     "zero_infinity_step_s": serial.step_ns / 1e9, "speedup": serial.step_ns / cossd.step_ns,
                     "zero_infinity_pipelined_step_s": pipelined.step_ns / 1e9,
                     "speedup_if_zero_pipelined": pipelined.step_ns / cossd.step_ns,
                     "cossd_bottleneck": cossd.bottleneck})
    return rows


def model_check(report: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The check for every size and placement the run measured, the rates it used, the projection."""
    rates = disk_rates(workdir) | {"copy_bytes_per_s": copy_rate()}
    checks = {}
    for size, section in report["sizes"].items():
        for placement, rows in section["placements"].items():
            check = _check_one(rows, rates)
            checks[f"{size} {placement}"] = check or {"why": "cossd, ZeRO-Infinity (disk) and ZeRO-Offload "
                                                              "did not all run"}
    return {"rates": rates, "checks": checks, "projection": smart_infinity_projection(),
            "smart_infinity_published_speedup": list(SMART_INFINITY_PUBLISHED),
            "projection_assumptions": {"drives": 10, "profile": "smartssd-fpga", "uplink_bytes_per_s":
                                       PROJECTION_UPLINK_BYTES_PER_S, "grad_and_param_dtype": "fp32",
                                       "gpu_flops": A100_FLOPS, "tokens_per_step": PROJECTION_TOKENS}}
