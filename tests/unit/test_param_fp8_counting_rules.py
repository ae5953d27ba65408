"""StateCounters' FP8 params-out figures: each step counted once by its latest encoding, an older step's encoding passed over, and the namespace's figures after reads of its param_fp8 files."""
from __future__ import annotations

import numpy as np

from cossd.emulator import Device, NamespaceSpec, TensorSpec
from cossd.emulator.state_counters import StateCounters, page


def test_a_step_encoded_again_replaces_its_counts_and_an_older_one_adds_nothing() -> None:
    counters = StateCounters()
    assert counters.param_fp8_figures() == {}
    counters.param_fp8_encoded("w", 0, 4.0, 0, 7)  # the initial masters
    counters.param_fp8_encoded("w", 0, 8.0, 0, 5)  # loaded again before the first step: replaces
    counters.param_fp8_encoded("w", 1, 8.0, 2, 3)
    counters.param_fp8_encoded("w", 2, 16.0, 1, 4)  # a place of step 2, which is then aborted
    counters.param_fp8_encoded("w", 1, 8.0, 2, 3)  # the committed step 1's file read after it
    assert counters.param_fp8_figures()["w"] == {"step": 2, "scale": 16.0, "last_overflow": 1, "last_underflow": 4,
                                                 "overflow": 3, "underflow": 12}
    counters.param_fp8_encoded("w", 2, 32.0, 0, 9)  # step 2 run anew and committed: its counts replace
    assert counters.param_fp8_figures()["w"] == {"step": 2, "scale": 32.0, "last_overflow": 0, "last_underflow": 9,
                                                 "overflow": 2, "underflow": 17}


def test_log_page_lists_param_wire_namespaces_only(device: Device) -> None:
    plain = device.create_namespace(NamespaceSpec(name="plain", tensors=(TensorSpec("w", 10),)))
    fp8 = device.create_namespace(NamespaceSpec(name="out8", tensors=(TensorSpec("w", 10),),
                                                param_wire_dtype="fp8_e5m2"))
    fp8.write_state("w", "master", 0, np.full(10, 0.5, dtype=np.float32).tobytes())
    fp8.read("w", "param_fp8", 0, 1 << 20)
    figures = {"step": 0, "scale": 2.0 ** 16, "last_overflow": 0, "last_underflow": 0, "overflow": 0, "underflow": 0}
    assert page(device, None) == {"out8": {"state_dtype": "fp32", "param_wire_dtype": "fp8_e5m2",
                                           "param_fp8": {"w": figures}}}
    assert page(device, plain.nsid) == {}
