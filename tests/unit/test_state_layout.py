"""protocol/state_layout.py (what the timing model reads) agrees with the kernels' own formats."""
from __future__ import annotations

import pytest

from cossd.kernels.state_formats import state_bytes_per_element
from cossd.kernels.validation import STATE_BLOCK, StateFormat
from cossd.model.step_model import STATE_DTYPE_BYTES
from cossd.protocol import state_layout


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "int8"])
def test_the_table_matches_the_kernels(name: str) -> None:
    assert state_layout.moment_bytes_per_element(name) == state_bytes_per_element(StateFormat[name.upper()])
    assert STATE_DTYPE_BYTES[name] == state_layout.moment_bytes_per_element(name)


def test_every_kernel_format_is_in_the_table_and_the_block_agrees() -> None:
    assert {f.name.lower() for f in StateFormat} == set(state_layout.MOMENT_CODE_BYTES)
    assert state_layout.STATE_BLOCK == STATE_BLOCK


def test_an_unknown_format_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="fp8"):
        state_layout.moment_bytes_per_element("fp8")
