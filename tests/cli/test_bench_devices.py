"""`cossd bench --sections devices`: one optimizer over 1, 2 and 4 devices, each its own daemon, on a GPT-shaped model whose embedding the placement rule splits across devices."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cossd.harness.bench.devices import gpt_shapes
from cossd.trainer.placement import PLACEMENT_BLOCK_ELEMS, place_on_devices
from helpers import run_cli


def test_bench_devices_section_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 2.3M-param GPT (width 256, one layer, its embedding 30%): at 1, 2 and 4 devices every
    device commits every step, its elements add up to the model's, each takes 2 B of gradients
    and gives 2 B of params an element a step (BF16), none holds more than its share plus one
    block, and each holds the placement rule's pieces (the embedding split at 4 devices)."""
    code, out, err = run_cli(capsys, "bench", "--sections", "devices", "--device-width", "256", "--device-layers",
                             "1", "--repeat", "1", "--output", str(tmp_path / "b"))
    assert code == 0, out + err
    section = json.loads((tmp_path / "b/bench.json").read_text())["devices"]
    assert [row["devices"] for row in section["rows"]] == [1, 2, 4]
    assert abs(section["embedding_elements"] / section["rows"][0]["elements"] - 0.3) < 0.01
    for row in section["rows"]:
        total, count = row["elements"], row["devices"]
        assert row["step_seconds"] > 0
        assert sum(device["elements"] for device in row["per_device"]) == total
        for device in row["per_device"]:
            assert device["grad_bytes_in_per_step"] == 2 * device["elements"]
            assert device["param_bytes_out_per_step"] == 2 * device["elements"]
            assert device["elements"] <= total / count + PLACEMENT_BLOCK_ELEMS
        # Where the rule puts each piece: at 4 devices the embedding (1.3 blocks) is split.
        rule = place_on_devices([(name, math.prod(shape)) for name, shape in gpt_shapes(256, 1)], count)
        assert [[tuple(t) for t in device["tensors"]] for device in row["per_device"]] == \
            [[(piece.name, piece.numel) for piece in shard] for shard in rule]
    assert sum(name == "embed" for device in section["rows"][2]["per_device"] for name, _ in device["tensors"]) == 2
    assert "One optimizer over several devices" in (tmp_path / "b/bench.md").read_text()
