"""Mount tier: FP8 params out through the CMB step (param_cmb_offset of a param_wire_dtype namespace) and the param_fp8 files: the places carry the step they belong to, however the step ends, and bad transfers are refused changing nothing."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import Mount
from cossd.client import AdminClient
from cossd.protocol import param_fp8 as wire
from cossd.protocol.status import DeviceError, Status
from helpers import pread_all, pwrite_all, random_half, run_cli, tensor_dir

pytestmark = pytest.mark.mount

TENSORS = [("odd", 300_007), ("big", 600_000)]
GRAD_BYTES = 2 * sum(numel for _, numel in TENSORS)
PARAMS = 64 << 20  # where the test puts the param places in the CMB
PLACES = [wire.out_bytes(numel) for _, numel in TENSORS]


def _namespace(mp: os.PathLike[str]) -> None:
    with AdminClient(mp) as client:
        client.create_namespace({"name": "f8", "tensors": [[t, n] for t, n in TENSORS], "grad_dtype": "fp16",
                                 "param_wire_dtype": "fp8_e4m3"})
    rng = np.random.default_rng(3)
    for name, numel in TENSORS:
        pwrite_all(tensor_dir(mp, "f8", name) / "master", (rng.standard_normal(numel) * 0.02).astype(np.float32).tobytes())


def test_cmb_places_carry_their_step_however_it_ends(mount: Mount) -> None:
    mp = mount.mountpoint
    _namespace(mp)
    assert sorted(os.listdir(tensor_dir(mp, "f8", "odd"))) == ["exp_avg", "exp_avg_sq", "grad", "master", "param",
                                                                "param_fp8"]
    rng = np.random.default_rng(4)
    with AdminClient(mp) as client:
        nsid, cmb = client.nsid("f8"), client.cmb()
        assert cmb is not None
        transfers = [{"tensor": "odd", "length": 600_014, "cmb_offset": 0, "param_cmb_offset": PARAMS},
                     {"tensor": "big", "length": 1_200_000, "cmb_offset": 600_014,
                      "param_cmb_offset": PARAMS + 4096 + PLACES[0]}]
        starts = [PARAMS, PARAMS + 4096 + PLACES[0]]

        def place(index: int) -> bytes:
            return cmb.array[starts[index] : starts[index] + PLACES[index]].tobytes()

        for ending in ("commit", "nan", "abort", "commit"):
            grads = random_half(rng, GRAD_BYTES // 2, "fp16")[0]
            if ending == "nan":
                grads = grads[:1000] + np.float16(np.inf).tobytes() + grads[1002:]
            cmb.array[: len(grads)] = np.frombuffer(grads, dtype=np.uint8)
            for start, size in zip(starts, PLACES):
                cmb.array[start : start + size] = 0xEE
            before = client.statistics(nsid)
            client.begin_step(nsid)
            if ending == "abort":  # the second tensor only, then the step is dropped
                client.cmb_write(nsid, transfers[1:])
                client.abort_step(nsid)
                # Its place holds the step that never committed, and says so.
                assert wire.parse_header(place(1))[0] == before["committed_step"] + 1
                assert set(place(0)) == {0xEE}
                continue
            client.cmb_write(nsid, transfers)
            assert client.commit_step(nsid)["skipped"] == (ending == "nan")
            after = client.statistics(nsid)
            for index, (name, _) in enumerate(TENSORS):
                # Committed: the new step's; skipped: the committed step's, labelled so.
                assert wire.parse_header(place(index))[0] == after["committed_step"]
                assert place(index) == pread_all(tensor_dir(mp, "f8", name) / "param_fp8"), (ending, name)
            assert after["param_bytes_out"] - before["param_bytes_out"] == sum(PLACES)  # the places, read or not
        assert client.statistics(nsid)["committed_step"] == 2
        cmb.close()


def test_a_part_of_a_gradient_with_a_param_place_is_refused_changing_nothing(mount: Mount) -> None:
    mp = mount.mountpoint
    _namespace(mp)
    with AdminClient(mp) as client:
        nsid, cmb = client.nsid("f8"), client.cmb()
        assert cmb is not None
        cmb.array[:GRAD_BYTES] = 0
        before = client.statistics(nsid)
        with pytest.raises(DeviceError, match="whole gradient") as refused:
            client.cmb_write(nsid, [{"tensor": "odd", "length": 1024, "cmb_offset": 0, "param_cmb_offset": PARAMS},
                                    {"tensor": "big", "cmb_offset": 4096, "param_cmb_offset": PARAMS + (4 << 20)}])
        assert refused.value.status == Status.INVALID_FIELD
        after = client.statistics(nsid)
        assert (after["committed_step"], after["step_open"], after["grad_bytes_in"]) == (
            before["committed_step"], before["step_open"], before["grad_bytes_in"])
        # Places overlap by the header's 16 bytes (300_007 codes from PARAMS, the next at + 300_010).
        with pytest.raises(DeviceError, match="overlap") as refused:
            client.cmb_write(nsid, [{"tensor": "odd", "length": 600_014, "cmb_offset": 0, "param_cmb_offset": PARAMS},
                                    {"tensor": "big", "cmb_offset": 600_014, "param_cmb_offset": PARAMS + 300_010}])
        assert client.statistics(nsid)["grad_bytes_in"] == before["grad_bytes_in"]
        cmb.close()


def test_create_ns_flag_makes_the_param_fp8_files(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    code, _, _ = run_cli(capsys, "create-ns", str(mp), "cli8", "--tensor", "w:1000", "--param-wire-dtype", "fp8_e5m2")
    assert code == 0
    config = json.loads((mp / "ns/cli8/config.json").read_text())
    assert config["param_wire_dtype"] == "fp8_e5m2"
    assert os.path.getsize(tensor_dir(mp, "cli8", "w") / "param_fp8") == wire.out_bytes(1000)
    pwrite_all(tensor_dir(mp, "cli8", "w") / "master", np.full(1000, 0.5, dtype=np.float32).tobytes())
    step, scale = wire.parse_header(pread_all(tensor_dir(mp, "cli8", "w") / "param_fp8"))
    assert (step, scale) == (0, 2.0 ** 16)  # 57344 / 0.5 = 2^16.8: the scale is 2^16
    code, _, err = run_cli(capsys, "create-ns", str(mp), "cli9", "--tensor", "w:1", "--param-wire-dtype", "fp16")
    assert code != 0 and "invalid choice" in err and not (mp / "ns/cli9").exists()
