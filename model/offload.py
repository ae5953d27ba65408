"""ZeRO-Infinity's optimizer step as DeepSpeed runs it by default (swap-in, Adam, swap-out in series), and a device profile made from rates measured on a host, so the model can be checked against a run there."""
from __future__ import annotations

import dataclasses

from .profiles import NS_PER_S, DeviceProfile
from .timing import TimingModel, Traffic, state_media_bytes, transfer_ns

ZERO_GRAD_BYTES = 4  # DeepSpeed's CPU Adam steps FP32 gradients, swapped out during backward

PAGE_BYTES = 1 << 20  # one "page" of 1 MiB: the pipeline's chunk, as DeepSpeed's aio block_size


def measured_profile(name: str, *, link_bytes_per_s: float, read_bytes_per_s: float, write_bytes_per_s: float,
                     adam_elements_per_s: float, latency_ns: int = 10_000) -> DeviceProfile:
    """A profile whose derived rates are the measured ones: one channel of one die whose
    page time gives the read and write rates, one updater unit at the Adam rate, and DRAM
    that never binds. `latency_ns` stands for a command's fixed cost (a system call, a FUSE
    or ioctl round trip: about 10 us here)."""
    rates = {"link": link_bytes_per_s, "read": read_bytes_per_s, "write": write_bytes_per_s,
             "adam": adam_elements_per_s}
    bad = [key for key, value in rates.items() if not value > 0]
    if bad:
        raise ValueError(f"measured rates must be > 0: {', '.join(bad)}")
    fastest = int(max(link_bytes_per_s, read_bytes_per_s, write_bytes_per_s)) * 4
    return DeviceProfile(
        name=name, summary="rates measured on this host", host_link_bytes_per_s=int(link_bytes_per_s),
        host_link_latency_ns=latency_ns, nand_channels=1, channel_bytes_per_s=fastest, dies_per_channel=1,
        planes_per_die=1, page_bytes=PAGE_BYTES,
        read_latency_ns=max(1, round(PAGE_BYTES * NS_PER_S / read_bytes_per_s)),
        program_latency_ns=max(1, round(PAGE_BYTES * NS_PER_S / write_bytes_per_s)),
        dram_bytes=1 << 40, dram_bytes_per_s=fastest * 1000, updater="measured", updater_units=1,
        unit_elements_per_s=int(adam_elements_per_s), sources={"all": "measured by cossd bench --sections peers"},
    ).validate()


@dataclasses.dataclass(frozen=True)
class SerialOffloadStep:
    """ZeRO-Infinity's step, phase by phase (ns): the FP32 gradients swapped out during
    backward (hidden behind compute as far as it lasts), then for the update the state and
    gradients swapped in, Adam on the host CPU, the state swapped out, one after the other."""

    gradient_swap_out_ns: int
    swap_in_ns: int
    adam_ns: int
    swap_out_ns: int
    compute_ns: int

    @property
    def update_ns(self) -> int:
        return self.swap_in_ns + self.adam_ns + self.swap_out_ns

    @property
    def step_ns(self) -> int:
        return max(self.compute_ns, self.gradient_swap_out_ns) + self.update_ns


def zero_infinity_serial(params: int, compute_ns: int, profile: DeviceProfile, *, drives: int = 1,
                         uplink_bytes_per_s: int = 0, host_adam_elements_per_s: int,
                         moment_bytes: float = 4) -> SerialOffloadStep:
    """DeepSpeed's optimizer swapper with its defaults (offload_optimizer pipeline_read and
    pipeline_write false) reads a sub-group's state and gradients, steps it, then writes it:
    nothing of the three overlaps. Each transfer is striped over `drives` of `profile` and,
    where they share an uplink, takes at least the uplink's time for all of it."""
    if params < 1 or drives < 1 or host_adam_elements_per_s <= 0 or compute_ns < 0:
        raise ValueError("params and drives must be >= 1, the Adam rate > 0, compute >= 0")
    model = TimingModel(profile)
    state = state_media_bytes(params, moment_bytes)
    grads = params * ZERO_GRAD_BYTES

    def striped(traffic_of_total: Traffic) -> int:
        share = Traffic(*(-(-getattr(traffic_of_total, f) // drives) for f in
                          ("host_in", "host_out", "media_read", "media_write", "elements", "flushes")))
        device_ns = model.command(share).device_ns
        if uplink_bytes_per_s:
            device_ns = max(device_ns, transfer_ns(traffic_of_total.host_in, uplink_bytes_per_s),
                            transfer_ns(traffic_of_total.host_out, uplink_bytes_per_s))
        return device_ns

    return SerialOffloadStep(
        gradient_swap_out_ns=striped(Traffic(host_in=grads, media_write=grads)),
        swap_in_ns=striped(Traffic(host_out=state + grads, media_read=state + grads)),
        adam_ns=transfer_ns(params, host_adam_elements_per_s),
        swap_out_ns=striped(Traffic(host_in=state, media_write=state)),
        compute_ns=compute_ns,
    )
