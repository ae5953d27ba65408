"""`cossd model --state-dtype`: the moments' bytes on the media per format (block scales included) agree with the emulator's own state layout, and drive every scheme's media bytes."""
from __future__ import annotations

import json

import pytest
from cossd.emulator.geometry import plan_spec_layout
from cossd.model.step_model import STATE_DTYPE_BYTES
from cossd.model.timing import state_media_bytes
from helpers import run_cli

PARAMS = 7_000_000_000


def test_bytes_per_element_come_from_the_layouts() -> None:
    """fp16 and int8 pay 4 bytes of scale per 256 elements; the emulator's copy of one big
    tensor is master + moments + param, within its regions' alignment."""
    assert STATE_DTYPE_BYTES == {"fp32": 4, "bf16": 2, "fp16": 2 + 4 / 256, "int8": 1 + 4 / 256}
    n = 1 << 22
    for dtype, moment in STATE_DTYPE_BYTES.items():
        _, copy_bytes = plan_spec_layout([("w", n)], dtype)
        modeled = state_media_bytes(n, moment) + 2 * n  # the param copy, 2 bytes
        assert modeled <= copy_bytes < modeled + 64 * 1024, dtype


def model_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:  # type: ignore[type-arg]
    code, out, err = run_cli(capsys, "model", "--params", "7B", "--compute-s", "1", "-o", "json", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
def test_7b_media_bytes_per_state_dtype(capsys: pytest.CaptureFixture[str], dtype: str) -> None:
    value = model_json(capsys, "--state-dtype", dtype)
    assert value["setup"]["state_dtype"] == dtype
    state = PARAMS * 4 + 2 * -(-PARAMS * STATE_DTYPE_BYTES[dtype] // 1)
    cossd, zero, checkpoint = (value["schemes"][k] for k in ("cossd", "zero_infinity", "checkpoint"))
    # cossd reads and writes master, moments and the param copy; the host link is unchanged
    assert cossd["media_read_bytes"] == cossd["media_write_bytes"] == state + 2 * PARAMS
    assert cossd["host_link_bytes_per_param"] == 4
    assert zero["media_write_bytes"] == state + 4 * PARAMS  # the state and the FP32 gradients
    assert checkpoint["media_write_bytes"] == state + 2 * PARAMS
    fp32 = model_json(capsys)["schemes"]["cossd"]
    assert cossd["media_read_bytes"] < fp32["media_read_bytes"]


def test_unknown_state_dtype_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "model", "--params", "7B", "--state-dtype", "fp8")
    assert code == 2 and out == ""
    assert "invalid choice: 'fp8'" in err
