"""The FP8 gradients' counters through a real mount: the scales and encoding counts BEGIN_STEP brings and a NaN code the device finds show in log page C6h (`cossd get-log -i 0xc6`) and in /metrics."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import Mount
from cossd.client import AdminClient
from cossd.protocol.status import DeviceError, Status
from helpers import create_namespace, run_cli, tensor_dir
from test_ops import metrics_mount, scrape, value, write  # noqa: F401 (metrics_mount: a fixture)

pytestmark = pytest.mark.mount

W_NUMEL, B_NUMEL = 64, 16
ONE, NAN = 0x38, 0x7F  # E4M3 codes of 1.0 and of NaN


def state_log(capsys: pytest.CaptureFixture[str], mp: Path, *options: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "get-log", str(mp), "-i", "0xc6", "-o", "json", *options)
    assert code == 0, err
    return json.loads(out)


def test_fp8_scales_and_counts_in_log_page_and_metrics(metrics_mount: tuple[Mount, int],  # noqa: F811
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    mount, port = metrics_mount
    mp = mount.mountpoint
    create_namespace(mp, "q", [("w", W_NUMEL), ("b", B_NUMEL)], grad_dtype="fp8_e4m3", param_dtype="bf16")
    assert state_log(capsys, mp) == {"q": {"state_dtype": "fp32", "grad_dtype": "fp8_e4m3", "grad_fp8": {}}}
    with AdminClient(mp) as admin:
        nsid = admin.nsid("q")
        # Step 1: w with the trainer's counts, b a bare scale; both commit.
        admin.begin_step(nsid, 1, 1.0, {"w": {"scale": 16.0, "underflow": 3, "saturated": 1}, "b": 2.0})
        write(tensor_dir(mp, "q", "w") / "grad", bytes([ONE]) * W_NUMEL)
        write(tensor_dir(mp, "q", "b") / "grad", bytes([ONE]) * B_NUMEL)
        assert admin.commit_step(nsid)["committed_step"] == 1
        # Counts larger than the slice are refused, and change nothing.
        with pytest.raises(DeviceError) as refused:
            admin.begin_step(nsid, 2, 1.0, {"w": {"scale": 32.0, "underflow": W_NUMEL + 1}})
        assert refused.value.status == Status.INVALID_FIELD
        # Step 2: w's new scale, and one NaN code in w: the device skips the step.
        admin.begin_step(nsid, 2, 1.0, {"w": 32.0})
        write(tensor_dir(mp, "q", "w") / "grad", bytes([NAN]) + bytes([ONE]) * (W_NUMEL - 1))
        write(tensor_dir(mp, "q", "b") / "grad", bytes([ONE]) * B_NUMEL)
        assert admin.commit_step(nsid)["skipped"]

    page = state_log(capsys, mp)["q"]
    w, b = page["grad_fp8"]["w"], page["grad_fp8"]["b"]
    assert w == {"step": 2, "scale_min": 32.0, "scale_max": 32.0, "slices": 1, "last_underflow": 0,
                 "last_saturated": 0, "underflow": 3, "saturated": 1, "nonfinite": 1}
    assert b == {"step": 1, "scale_min": 2.0, "scale_max": 2.0, "slices": 1, "last_underflow": 0,
                 "last_saturated": 0, "underflow": 0, "saturated": 0, "nonfinite": 0}
    assert state_log(capsys, mp, "-n", "q") == {"q": page}

    families = scrape(port)
    assert value(families, "cossd_grad_fp8_scale", namespace="q", tensor="w") == 32.0
    assert value(families, "cossd_grad_fp8_scale", namespace="q", tensor="b") == 2.0
    assert value(families, "cossd_grad_fp8_underflow_total", namespace="q", tensor="w") == 3
    assert value(families, "cossd_grad_fp8_saturated_total", namespace="q", tensor="w") == 1
    assert value(families, "cossd_grad_fp8_nonfinite_total", namespace="q", tensor="w") == 1
    assert value(families, "cossd_grad_fp8_nonfinite_total", namespace="q", tensor="b") == 0
