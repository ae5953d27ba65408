"""The FP8 params-out counters through a real mount: each tensor's scale, step and saturated and flushed elements of the device's param_fp8 encoding in log page C6h (`cossd get-log -i 0xc6`) and in /metrics, equal to what torch's FP8 cast of the masters read back gives."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Mount
from cossd.client import AdminClient
from cossd.protocol import param_fp8 as wire
from helpers import pread_all, pwrite_all, run_cli, tensor_dir
from test_ops import metrics_mount, scrape, value, write  # noqa: F401 (metrics_mount: a fixture)

pytestmark = pytest.mark.mount

W_NUMEL, B_NUMEL = 4096, 64
E4M3_MAX = 448.0
SCALE_EXPONENT = 64  # the scale's exponent bound (kernels/fp8_params.py)


def state_log(capsys: pytest.CaptureFixture[str], mp: Path, *options: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "get-log", str(mp), "-i", "0xc6", "-o", "json", *options)
    assert code == 0, err
    return json.loads(out)


def masters() -> dict[str, np.ndarray]:
    """w: magnitudes from 1e-12 to 1: with current scaling (amax 1 -> scale 2^8) nothing
    saturates, and everything below E4M3's smallest subnormal over the scale (2^-9 / 2^8, half
    of it rounding to zero) is flushed. b: a 1e23 master puts the scale at its bound 2^-64, where
    the largest ones pass 448 (saturated) and the small ones vanish."""
    rng = np.random.default_rng(11)
    w = (rng.choice([-1.0, 1.0], W_NUMEL) * 10.0 ** rng.uniform(-12, 0, W_NUMEL)).astype(np.float32)
    w[0] = 1.0
    b = np.concatenate([np.full(8, 1e23), np.full(8, -3e22), np.full(16, 1e21), np.full(16, 1.0),
                        np.zeros(16)]).astype(np.float32)
    return {"w": w, "b": b}


def expected(master: np.ndarray) -> tuple[float, int, int]:
    """(scale, overflow, underflow) of the param encoding of `master`, by numpy and torch's
    cast (the reference of tests/unit/test_kernels_param_fp8.py), not the device's kernel."""
    amax = float(np.abs(master).max())
    exponent = int(np.floor(np.log2(E4M3_MAX / amax)))
    scale = 2.0 ** max(-SCALE_EXPONENT, min(SCALE_EXPONENT, exponent))
    scaled = torch.from_numpy(master.copy()) * scale
    overflow = int((scaled.abs() > E4M3_MAX).sum())
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    underflow = int(np.count_nonzero((master != 0) & ((codes & 0x7F) == 0)))
    return scale, overflow, underflow


def test_param_fp8_scale_and_counts_in_log_page_and_metrics(metrics_mount: tuple[Mount, int],  # noqa: F811
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    mount, port = metrics_mount
    mp = mount.mountpoint
    with AdminClient(mp) as admin:
        admin.create_namespace({"name": "p", "tensors": [["w", W_NUMEL], ["b", B_NUMEL]], "grad_dtype": "fp16",
                                "param_wire_dtype": "fp8_e4m3",
                                "hyperparameters": {"lr": 1e-3, "weight_decay": 0.0}})
        nsid = admin.nsid("p")
    for name, values in masters().items():
        pwrite_all(tensor_dir(mp, "p", name) / "master", values.tobytes())
    # Nothing encoded yet: the namespace is listed with no tensors.
    assert state_log(capsys, mp) == {"p": {"state_dtype": "fp32", "param_wire_dtype": "fp8_e4m3", "param_fp8": {}}}

    rng = np.random.default_rng(12)
    totals = {"w": [0, 0], "b": [0, 0]}
    last: dict[str, dict[str, Any]] = {}
    with AdminClient(mp) as admin:
        for step in (1, 2, 3, 4):
            admin.begin_step(nsid, step)
            for name, numel in (("w", W_NUMEL), ("b", B_NUMEL)):
                grad = (rng.standard_normal(numel) * 0.01).astype(np.float16)
                if step == 4 and name == "b":
                    grad[3] = np.inf  # step 4 is skipped: its params are step 3's, counted already
                write(tensor_dir(mp, "p", name) / "grad", grad.tobytes())
            assert admin.commit_step(nsid)["skipped"] == (step == 4)
            committed = min(step, 3)
            for name in ("w", "b"):
                # The read of the param_fp8 file is what makes the device encode the step.
                got = pread_all(tensor_dir(mp, "p", name) / "param_fp8")
                master = np.frombuffer(pread_all(tensor_dir(mp, "p", name) / "master"), dtype=np.float32)
                scale, overflow, underflow = expected(master)
                assert wire.parse_header(got) == (committed, scale)
                if step != 4:
                    totals[name][0] += overflow
                    totals[name][1] += underflow
                last[name] = {"step": committed, "scale": scale, "last_overflow": overflow,
                              "last_underflow": underflow, "overflow": totals[name][0], "underflow": totals[name][1]}
        stats = admin.statistics(nsid)

    # The masters were chosen so: w flushes some and saturates none; b does both.
    assert last["w"]["underflow"] > 0 and last["w"]["overflow"] == 0
    assert last["b"]["last_overflow"] == 16 and last["b"]["last_underflow"] > 0
    page = state_log(capsys, mp)["p"]
    assert page == {"state_dtype": "fp32", "param_wire_dtype": "fp8_e4m3", "param_fp8": last}
    assert state_log(capsys, mp, "-n", "p") == {"p": page}
    # The default output: nvme-cli's header line, then the page.
    code, out, err = run_cli(capsys, "get-log", str(mp), "-i", "0xc6")
    assert code == 0, err
    assert out.startswith("Device:") and json.loads(out.split("\n", 1)[1])["p"] == page
    # stats.json's namespace totals agree.
    assert stats["param_fp8_overflows"] == sum(t[0] for t in totals.values())
    assert stats["param_fp8_underflows"] == sum(t[1] for t in totals.values())

    families = scrape(port)
    for name in ("w", "b"):
        assert value(families, "cossd_param_fp8_scale", namespace="p", tensor=name) == last[name]["scale"]
        assert value(families, "cossd_param_fp8_step", namespace="p", tensor=name) == 3
        assert value(families, "cossd_param_fp8_overflow_total", namespace="p", tensor=name) == last[name]["overflow"]
        assert value(families, "cossd_param_fp8_underflow_total", namespace="p",
                     tensor=name) == last[name]["underflow"]
