"""Per-step I/O of three ways to train with Adam state off the GPU, on a device profile:
cossd (Adam inside the drive), ZeRO-Infinity-style NVMe offload (Adam on the host CPU, state
swapped over the host link) and GPU-resident Adam with a full checkpoint every step; and
Smart-Infinity's traffic table. The arithmetic behind `cossd model`."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..protocol.state_layout import MOMENT_CODE_BYTES, moment_bytes_per_element
from .profiles import NS_PER_S, DeviceProfile
from .timing import (
    Timing,
    TimingModel,
    Traffic,
    state_media_bytes,
    step_traffic,
    transfer_ns,
)

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
# Bytes per element of one moment on the media, from the kernels' own layouts: fp32 4, bf16 2,
# fp16 2 + 4/256 (a binary16 code, a 4-byte scale per 256-element block), int8 1 + 4/256
# (a code, a 4-byte absmax per block). docs/kernels.md, "Block-scaled moments".
STATE_DTYPE_BYTES: dict[str, float] = {name: moment_bytes_per_element(name) for name in MOMENT_CODE_BYTES}
MASTER_BYTES = 4  # master weights are FP32 in every scheme
# ZeRO-Infinity's CPU Adam works on FP32 gradients, which it swaps to NVMe during backward.
ZERO_GRAD_BYTES = 4
# Measured on the project's H200 machine (docs/performance.md in the shared docs): fused
# AdamW on its 16 CPU cores, and on the GPU.
HOST_ADAM_ELEMENTS_PER_S = 3_700_000_000
GPU_ADAM_ELEMENTS_PER_S = 118_000_000_000


@dataclasses.dataclass(frozen=True)
class StepSetup:
    """A model size, its compute time per step, dtypes, and the drives it trains on."""

    params: int
    compute_s: float
    profile: DeviceProfile
    grad_bytes: int = 2
    param_bytes: int = 2
    moment_bytes: float = 4  # per element, block scales included (STATE_DTYPE_BYTES)
    drives: int = 1  # the work is striped evenly over this many drives of the profile
    uplink_bytes_per_s: int = 0  # a host uplink all drives share (a PCIe switch); 0: none
    host_adam_elements_per_s: int = HOST_ADAM_ELEMENTS_PER_S
    gpu_adam_elements_per_s: int = GPU_ADAM_ELEMENTS_PER_S

    def validate(self) -> "StepSetup":
        checks = (
            (self.params >= 1, f"params must be at least 1, got {self.params}"),
            (self.compute_s >= 0, f"compute time must be >= 0 s, got {self.compute_s}"),
            (self.drives >= 1, f"drives must be at least 1, got {self.drives}"),
            (self.uplink_bytes_per_s >= 0, f"uplink bandwidth must be >= 0, got {self.uplink_bytes_per_s}"),
            (self.host_adam_elements_per_s > 0, "the host Adam rate must be > 0"),
            (self.gpu_adam_elements_per_s > 0, "the GPU Adam rate must be > 0"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.profile.validate()
        return self

    @property
    def compute_ns(self) -> int:
        return round(self.compute_s * NS_PER_S)

    @property
    def state_bytes(self) -> float:
        """FP32 master plus both moments, per parameter (block scales included)."""
        return MASTER_BYTES + 2 * self.moment_bytes


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One scheme's step: what it moves (all drives together) and how long it takes."""

    scheme: str
    label: str
    traffic: Traffic
    io_ns: int  # I/O and update time the step waits for (what compute does not hide)
    step_ns: int
    bottleneck: str
    phases: dict[str, int]  # ns of each phase of the step, before overlap with compute

    def to_json(self, setup: StepSetup) -> dict[str, Any]:
        traffic = self.traffic
        return {
            "label": self.label,
            "host_link_bytes": traffic.host_link,
            "host_link_bytes_per_param": traffic.host_link / setup.params,
            "host_in_bytes": traffic.host_in,
            "host_out_bytes": traffic.host_out,
            "media_read_bytes": traffic.media_read,
            "media_write_bytes": traffic.media_write,
            "io_s": self.io_ns / NS_PER_S,
            "step_s": self.step_ns / NS_PER_S,
            "slowdown": self.step_ns / setup.compute_ns if setup.compute_ns else None,
            "bottleneck": self.bottleneck,
            "phases_s": {name: ns / NS_PER_S for name, ns in self.phases.items()},
        }


def _per_drive(total: int, drives: int) -> int:
    return -(-total // drives)


def _striped(setup: StepSetup, model: TimingModel, traffic_of: Any) -> tuple[int, str]:
    """Time of work striped over the drives (each does 1/drives of the parameters) and, when
    they share an uplink, the uplink's own time; the slower bounds the phase."""
    timing: Timing = model.command(traffic_of(_per_drive(setup.params, setup.drives)))
    total: Traffic = traffic_of(setup.params)
    device_ns, bottleneck = timing.device_ns, timing.bottleneck
    if setup.uplink_bytes_per_s:
        uplink_ns = max(transfer_ns(total.host_in, setup.uplink_bytes_per_s),
                        transfer_ns(total.host_out, setup.uplink_bytes_per_s))
        if uplink_ns > device_ns:
            return uplink_ns, "shared uplink"
    return device_ns, bottleneck


def predict_cossd(setup: StepSetup) -> Prediction:
    """Gradients in, params out; master and moments never leave the drive. The trainer sends
    gradients after backward (the clip coefficient goes out with BEGIN_STEP), so nothing
    overlaps compute: step = compute + device time of the step."""
    def traffic(elements: int) -> Traffic:
        return step_traffic(elements, grad_bytes=setup.grad_bytes, param_bytes=setup.param_bytes,
                            moment_bytes=setup.moment_bytes)

    update_ns, bottleneck = _striped(setup, TimingModel(setup.profile), traffic)
    return Prediction("cossd", "cossd (Adam in the drive)", traffic(setup.params), update_ns,
                      setup.compute_ns + update_ns, bottleneck, {"update": update_ns})


def predict_zero_infinity(setup: StepSetup) -> Prediction:
    """ZeRO-Infinity-style: FP32 gradients swapped out to the drive during backward (hidden
    behind compute as far as it lasts), then the update reads gradients and optimizer state
    over the host link, runs Adam on the host CPU and writes the state back."""
    def backward(elements: int) -> Traffic:
        grads = elements * ZERO_GRAD_BYTES
        return Traffic(host_in=grads, media_write=grads)

    def update(elements: int) -> Traffic:
        grads = elements * ZERO_GRAD_BYTES
        state = state_media_bytes(elements, setup.moment_bytes)
        return Traffic(host_in=state, host_out=state + grads, media_read=state + grads, media_write=state,
                       elements=elements)

    host_model = TimingModel(setup.profile, adam_elements_per_s=setup.host_adam_elements_per_s)
    backward_ns, _ = _striped(setup, host_model, backward)
    update_ns, bottleneck = _striped(setup, host_model, update)
    step_ns = max(setup.compute_ns, backward_ns) + update_ns
    return Prediction("zero_infinity", "ZeRO-Infinity-style NVMe offload",
                      backward(setup.params) + update(setup.params), step_ns - setup.compute_ns,
                      step_ns, bottleneck, {"gradient_swap_out": backward_ns, "update": update_ns})


def predict_checkpoint(setup: StepSetup) -> Prediction:
    """Adam on the GPU, then params, master and moments written to the drive every step,
    synchronously (an async checkpoint hides this only while host memory holds a copy)."""
    def checkpoint(elements: int) -> Traffic:
        written = elements * setup.param_bytes + state_media_bytes(elements, setup.moment_bytes)
        return Traffic(host_in=written, media_write=written)

    write_ns, bottleneck = _striped(setup, TimingModel(setup.profile), checkpoint)
    gpu_ns = transfer_ns(setup.params, setup.gpu_adam_elements_per_s)
    io_ns = gpu_ns + write_ns
    return Prediction("checkpoint", "GPU Adam + per-step checkpoint", checkpoint(setup.params),
                      io_ns, setup.compute_ns + io_ns, bottleneck,
                      {"gpu_update": gpu_ns, "checkpoint_write": write_ns})


def predict_all(setup: StepSetup) -> list[Prediction]:
    setup.validate()
    return [predict_cossd(setup), predict_zero_infinity(setup), predict_checkpoint(setup)]


# Smart-Infinity (Jang et al., HPCA 2024), Table I: storage traffic per iteration in units of
# M, the FP16 model size in bytes (2 bytes x parameters). Their evaluation sends FP32
# gradients and FP32 params (AIS-SNU/Smart-Infinity, hls_smartInfinity/README.md), hence 2M.
SMART_INFINITY_TABLE: dict[str, dict[str, int]] = {
    "zero_infinity": {"gradient_write": 2, "gradient_read": 2, "optimizer_read": 6, "optimizer_write": 6},
    "smart_infinity": {"gradient_write": 2, "param_read": 2},
}


def smart_infinity_table(params: int, *, grad_bytes: int = 2, param_bytes: int = 2) -> dict[str, Any]:
    """Table I in bytes for `params` parameters, beside cossd at the given dtypes (FP16: 1M + 1M)."""
    m = 2 * params
    rows: dict[str, dict[str, Any]] = {}
    for scheme, parts in SMART_INFINITY_TABLE.items():
        rows[scheme] = {"in_M": dict(parts), "bytes": {k: v * m for k, v in parts.items()},
                        "total_M": sum(parts.values()), "total_bytes": sum(parts.values()) * m}
    cossd = {"gradient_write": params * grad_bytes, "param_read": params * param_bytes}
    rows["cossd"] = {"in_M": {k: v / m for k, v in cossd.items()}, "bytes": cossd,
                     "total_M": sum(cossd.values()) / m, "total_bytes": sum(cossd.values())}
    zero, smart = rows["zero_infinity"]["total_bytes"], rows["smart_infinity"]["total_bytes"]
    return {"M_bytes": m, "rows": rows, "zero_over_smart_infinity": zero / smart,
            "zero_over_cossd": zero / rows["cossd"]["total_bytes"]}
