"""The fp16/int8 moments' counters through a real mount: a crafted gradient whose underflows are known gives those counts in log page C6h (`cossd get-log -i 0xc6`) and in /metrics; a skipped step adds nothing."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Mount
from cossd.kernels import STATE_BLOCK
from helpers import create_namespace, run_cli, tensor_dir
from test_ops import metrics_mount, scrape, value, write  # noqa: F401 (metrics_mount: a fixture)

pytestmark = pytest.mark.mount

W_NUMEL = 3 * STATE_BLOCK + 10  # three whole scale blocks and a short one
B_NUMEL = 7
TINY = 37  # elements of each scale block of w whose moments no format keeps
# Each block's scales after step 1 (largest exp_avg 0.1, exp_avg_sq 1e-3):
# fp16 2^-k with the largest k that keeps amax * 2^k <= 65504; int8 the absmax.
W_SCALES = {"fp16": {"exp_avg": 2.0**-19, "exp_avg_sq": 2.0**-25},
            "int8": {"exp_avg": float(np.float32(0.1)), "exp_avg_sq": float(np.float32(1e-3))}}


def bf16(values: np.ndarray) -> bytes:
    """float32 to bf16 bytes by truncation (every value here is exact or far from a tie)."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def crafted_w() -> tuple[bytes, int]:
    """w's gradient: each scale block holds 1.0, then TINY elements of 1e-15 (1e-15 and 1e-30
    of the block's largest moments: below both formats' reach), then zeros. Also the count of
    elements that must underflow, per moment."""
    g = np.zeros(W_NUMEL, np.float32)
    expected = 0
    for start in range(0, W_NUMEL, STATE_BLOCK):
        stop = min(start + STATE_BLOCK, W_NUMEL)
        g[start] = 1.0
        g[start + 1:min(start + 1 + TINY, stop)] = 1e-15
        expected += min(TINY, stop - start - 1)
    return bf16(g), expected


def state_log(capsys: pytest.CaptureFixture[str], mp: Path, *options: str) -> dict[str, Any]:
    code, out, err = run_cli(capsys, "get-log", str(mp), "-i", "0xc6", "-o", "json", *options)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("state_dtype", ["fp16", "int8"])
def test_crafted_underflow_in_log_page_and_metrics(metrics_mount: tuple[Mount, int],  # noqa: F811
                                                   capsys: pytest.CaptureFixture[str], state_dtype: str) -> None:
    mount, port = metrics_mount
    mp = mount.mountpoint
    create_namespace(mp, "q", [("w", W_NUMEL), ("b", B_NUMEL)], grad_dtype="bf16", param_dtype="bf16",
                     state_dtype=state_dtype)
    assert state_log(capsys, mp) == {"q": {"state_dtype": state_dtype, "last_step": 0, "tensors": {}}}

    grad_w, expected = crafted_w()
    assert expected == 3 * TINY + 9
    write(tensor_dir(mp, "q", "w") / "grad", grad_w)
    write(tensor_dir(mp, "q", "b") / "grad", bf16(np.full(B_NUMEL, 0.5)))  # completes step 1
    # Step 2 has a NaN: skipped, so it adds nothing (its blocks may have run).
    write(tensor_dir(mp, "q", "w") / "grad", grad_w)
    write(tensor_dir(mp, "q", "b") / "grad", bf16(np.array([0.5] * (B_NUMEL - 1) + [np.nan])))

    page = state_log(capsys, mp)["q"]
    assert page["state_dtype"] == state_dtype and page["last_step"] == 1
    w, b = page["tensors"]["w"], page["tensors"]["b"]
    for moment in ("exp_avg", "exp_avg_sq"):
        assert w[moment]["underflow_total"] == w[moment]["last_step_underflow"] == expected
        assert w[moment]["overflow_total"] == 0
        assert w[moment]["scaled_blocks"] == 4
        assert w[moment]["scale_min"] == w[moment]["scale_max"] == W_SCALES[state_dtype][moment]
        assert b[moment]["underflow_total"] == b[moment]["overflow_total"] == 0
    # The page of one namespace (-n), and the default output (a header, then the JSON).
    assert state_log(capsys, mp, "-n", "q") == {"q": page}
    code, out, err = run_cli(capsys, "get-log", str(mp), "-i", "0xc6")
    assert code == 0, err
    assert json.loads(out.split("\n", 1)[1])["q"] == page

    families = scrape(port)
    for moment in ("exp_avg", "exp_avg_sq"):
        labels = {"namespace": "q", "tensor": "w", "moment": moment}
        assert value(families, "cossd_state_underflow_total", **labels) == expected
        assert value(families, "cossd_state_overflow_total", **labels) == 0
        assert value(families, "cossd_state_scale_min", **labels) == W_SCALES[state_dtype][moment]
        assert value(families, "cossd_state_scale_max", **labels) == W_SCALES[state_dtype][moment]
        assert value(families, "cossd_state_underflow_total", namespace="q", tensor="b", moment=moment) == 0
