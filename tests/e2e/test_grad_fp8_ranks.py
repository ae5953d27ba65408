"""FP8 gradients beyond one process on one device: two gloo ranks sharing one namespace (each slice scaled by its own amax) and one process over two devices, each equal bit for bit to one process stepping the same slices' FP8 values as FP32 gradients; the C6h counters and /metrics after those steps; a rank's bad scale refused with nothing changed."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from cossd.client import AdminClient
from cossd.emulator.geometry import BLOCK_ELEMS
from cossd.protocol.logpages import LogId
from cossd.protocol.status import DeviceError, Status
from cossd.trainer import AdamW
from cossd.trainer.grads import fp8_encode_counted
from cossd.trainer.shard import plan_shards

from conftest import Mount
from ranks import finished, mounted_device, spawn_ranks

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("fp8_ranks_job.py")
FSDP_JOB = Path(__file__).with_name("fsdp_job.py")
sys.path.insert(0, str(JOB.parent))
import fp8_ranks_job as job  # noqa: E402  (the gradients, shared with the ranks)
from multirank_job import Net  # noqa: E402

STEPS, INF_STEP = 6, 4
FP8 = ("fp8_e4m3", torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Mount]]:
    """Two devices for the module's jobs (each job on namespaces of its own)."""
    root = tmp_path_factory.mktemp("fp8ranks")
    with mounted_device(root / "a", "FP8RANKS0001", 4 << 30) as first, \
            mounted_device(root / "b", "FP8RANKS0002", 4 << 30) as second:
        yield [first, second]


def params_of_the_job() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return list(Net().to(torch.bfloat16).parameters())


def fp8_values(grad: torch.Tensor, slices: list[tuple[int, int]]) -> tuple[torch.Tensor, list[dict[str, Any]]]:
    """The FP32 values the device steps for `grad` sent as FP8 slices (each encoded from its own
    amax; code / scale is exact in FP32, a power-of-two scale), and each slice's encoding."""
    flat = grad.detach().reshape(-1).to(torch.float32)
    values = torch.empty_like(flat)
    encodings = []
    for start, stop in slices:
        encoded = fp8_encode_counted(flat[start:stop], FP8[0], FP8[1])
        values[start:stop] = encoded.codes.view(FP8[1]).to(torch.float32) / encoded.scale
        encodings.append({"scale": encoded.scale, "underflow": encoded.underflow, "start": start})
    return values.view(grad.shape), encodings


def reference(mount: Mount, namespace: str, slices: list[list[tuple[int, int]]]) -> dict[str, Any]:
    """One process, one device, FP32 gradients: the job's model (its BF16 values, as FP32 masters)
    stepped on the job's gradients as the device decodes their FP8 slices. Its masters, and
    per tensor the last step's scales and the underflow summed over the steps."""
    model_params = [torch.nn.Parameter(p.detach().to(torch.float32)) for p in params_of_the_job()]
    optimizer = AdamW(model_params, lr=3e-3, mount=mount.mountpoint, namespace=namespace, dtype=torch.bfloat16,
                      grad_dtype="fp32")
    underflow = [0] * len(model_params)
    last: list[list[dict[str, Any]]] = [[] for _ in model_params]
    try:
        for step in range(1, STEPS + 1):
            grads = job.gradients(step, params_of_the_job(), INF_STEP)
            for index, (param, grad) in enumerate(zip(model_params, grads)):
                param.grad, last[index] = fp8_values(grad, slices[index])
                underflow[index] += sum(encoding["underflow"] for encoding in last[index])
            optimizer.step()
        names = [entry.name for entry in optimizer.entries]
        return {"masters": optimizer.master_weights(), "names": names, "underflow": underflow, "last": last,
                "committed_step": optimizer.committed_step}
    finally:
        optimizer.close()


def counters_page(mount: Mount, namespace: str) -> dict[str, Any]:
    with AdminClient(mount.mountpoint) as admin:
        return json.loads(admin.get_log_page(LogId.STATE_COUNTERS, admin.nsid(namespace)))[namespace]


def check_counters(figures: dict[str, Any], expected: dict[str, Any]) -> None:
    """C6h's grad_fp8 after the job, against what the reference's encoding of the same slices
    counted: the last step's scales (scale_min the least: the tensor's whole current scale),
    the underflow of every step, and the one inf element the device saw (as a NaN code)."""
    assert figures["grad_dtype"] == "fp8_e4m3"
    tensors = figures["grad_fp8"]
    for index, name in enumerate(expected["names"]):
        mine = tensors[name]
        scales = [encoding["scale"] for encoding in expected["last"][index]]
        # The step skipped at INF_STEP is sent again under the same number: the last is STEPS - 1.
        assert mine["step"] == STEPS - 1 and mine["slices"] == len(scales)
        assert mine["scale_min"] == min(scales) and mine["scale_max"] == max(scales)
        assert mine["underflow"] == expected["underflow"][index] > 0  # the tiny elements, every step
        assert mine["saturated"] == 0
        assert mine["nonfinite"] == (1 if index == 0 else 0)  # fc1.weight's inf at INF_STEP


def test_two_ranks_step_fp8_slices_as_one_process_steps_their_values(devices: list[Mount], tmp_path: Path) -> None:
    """Two gloo ranks, one namespace, E4M3: fc1.weight is cut between the ranks at a device
    block, each rank's slice scaled by its own amax. The device's masters equal, bit for bit,
    one process stepping those slices' decoded values as FP32 gradients (so each slice was
    stepped with its own scale); the step with an inf in rank 1's slice is skipped by both."""
    mount = devices[0]
    out = tmp_path / "job"
    codes = spawn_ranks(JOB, {"mount": str(mount.mountpoint), "namespace": "fp8two", "last": STEPS,
                              "out": str(out), "inf_step": INF_STEP}, 2, out, 240)
    ranks = finished(out, 2, codes)
    assert all(r["result"] == {"committed_step": STEPS - 1, "skipped": [INF_STEP]} for r in ranks)
    params = params_of_the_job()
    shards = plan_shards([(f"t{i}", p.numel()) for i, p in enumerate(params)], 2, BLOCK_ELEMS)
    slices: list[list[tuple[int, int]]] = [[] for _ in params]
    for shard in shards:
        for piece in shard:
            slices[piece.index].append((piece.start, piece.stop))
    assert len(slices[0]) == 2  # fc1.weight is split between the ranks
    expected = reference(mount, "fp8two-ref", slices)
    # Its two slices have scales of their own: a device that stepped both with one would differ.
    assert len({encoding["scale"] for encoding in expected["last"][0]}) == 2
    assert expected["committed_step"] == STEPS - 1
    for rank in ranks:
        assert all(torch.equal(a, b) for a, b in zip(rank["masters"], expected["masters"]))
        assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(rank["params"], expected["masters"]))
    check_counters(counters_page(mount, "fp8two"), expected)


def test_fp8_over_two_devices_steps_each_piece_with_its_own_scale(devices: list[Mount]) -> None:
    """One process, mount=[two devices], E4M3: a tensor split across the devices is two pieces,
    each scaled by its own amax; the group's masters equal one process stepping the pieces'
    decoded values as FP32 gradients on one device, bit for bit; each device's C6h counts its
    own pieces."""
    params = params_of_the_job()
    optimizer = AdamW(params, lr=3e-3, mount=[d.mountpoint for d in devices], namespace="fp8group",
                      grad_dtype="fp8_e4m3")
    try:
        for step in range(1, STEPS + 1):
            for param, grad in zip(params, job.gradients(step, params, INF_STEP)):
                param.grad = grad
            optimizer.step()
        assert optimizer.committed_step == STEPS - 1
        masters = optimizer.master_weights()
        names = [entry.name for entry in optimizer.entries]
    finally:
        optimizer.close()
    # Each device's pieces, in element order of their tensor (devices hold consecutive runs).
    slices: list[list[tuple[int, int]]] = [[] for _ in params]
    at = [0] * len(params)
    held: list[list[tuple[int, int]]] = []  # per device: (tensor index, first element) of its pieces
    for device in devices:
        config = json.loads((Path(device.mountpoint) / "ns" / "fp8group" / "config.json").read_text())
        held.append([])
        for tensor in config["tensors"]:
            index = names.index(tensor["name"])
            held[-1].append((index, at[index]))
            slices[index].append((at[index], at[index] + int(tensor["numel"])))
            at[index] += int(tensor["numel"])
    assert at == [p.numel() for p in params]
    assert any(len(pieces) > 1 for pieces in slices), slices  # some tensor is split across the devices
    expected = reference(devices[0], "fp8group-ref", slices)
    split = next(index for index, pieces in enumerate(slices) if len(pieces) > 1)
    assert len({encoding["scale"] for encoding in expected["last"][split]}) > 1  # its pieces' own scales
    assert all(torch.equal(a, b) for a, b in zip(masters, expected["masters"]))
    # Each device's C6h: its own pieces' last scales. No device saw the inf: the group skips a
    # step whose gradients are not finite before any device is sent one (group.py).
    for device, pieces in zip(devices, held):
        figures = counters_page(device, "fp8group")["grad_fp8"]
        for index, start in pieces:
            encoding = next(e for e in expected["last"][index] if e["start"] == start)
            mine = figures[names[index]]
            assert (mine["step"], mine["slices"], mine["scale_min"]) == (STEPS - 1, 1, encoding["scale"])
            assert mine["nonfinite"] == 0 and mine["underflow"] > 0


def test_two_ranks_over_two_devices_send_their_shards_of_each_devices_pieces(devices: list[Mount],
                                                                            tmp_path: Path) -> None:
    """Two gloo ranks, mount=[two devices]: each device's namespace is sharded over the ranks,
    so a slice is a rank's part of a device's piece, scaled by its own amax; the masters equal
    one process stepping those slices' decoded values as FP32 gradients, bit for bit."""
    out = tmp_path / "job"
    codes = spawn_ranks(JOB, {"mounts": [str(d.mountpoint) for d in devices], "namespace": "fp8twotwo",
                              "last": STEPS, "out": str(out), "inf_step": INF_STEP}, 2, out, 240)
    ranks = finished(out, 2, codes)
    assert all(r["result"] == {"committed_step": STEPS - 1, "skipped": [INF_STEP]} for r in ranks)
    params = params_of_the_job()
    names = [f"g0.p{index}" for index in range(len(params))]  # the plan's names of one group's params
    slices: list[list[tuple[int, int]]] = [[] for _ in params]
    at = [0] * len(params)
    for device in devices:
        config = json.loads((Path(device.mountpoint) / "ns" / "fp8twotwo" / "config.json").read_text())
        pieces = [(names.index(t["name"]), int(t["numel"])) for t in config["tensors"]]
        starts = []
        for index, numel in pieces:
            starts.append(at[index])
            at[index] += numel
        # The ranks' shards of this device's tensors, in the piece's own elements.
        for shard in plan_shards([(str(position), numel) for position, (_, numel) in enumerate(pieces)], 2,
                                 BLOCK_ELEMS):
            for part in shard:
                index, base = pieces[part.index][0], starts[part.index]
                slices[index].append((base + part.start, base + part.stop))
    assert at == [p.numel() for p in params]
    slices = [sorted(parts) for parts in slices]
    assert max(len(parts) for parts in slices) >= 2
    expected = reference(devices[0], "fp8twotwo-ref", slices)
    for rank in ranks:
        assert all(torch.equal(a, b) for a, b in zip(rank["masters"], expected["masters"]))


def test_a_ranks_bad_scale_is_refused_and_changes_nothing(devices: list[Mount]) -> None:
    """A shared step opened by rank 0 with its slice's scale: rank 1's join with a scale for
    rank 0's slice (an overlap), with a slice not at a block boundary, or with a scale that is
    not a finite number > 0 is refused (INVALID_FIELD), and rank 1 stays out of the step; its
    good join then goes in, and aborting leaves the namespace where it was."""
    mount = devices[0]
    params = params_of_the_job()
    optimizer = AdamW(params, lr=3e-3, mount=mount.mountpoint, namespace="fp8badrank", grad_dtype="fp8_e4m3")
    name = optimizer.entries[0].name  # fc1.weight: two blocks
    optimizer.close()
    with AdminClient(mount.mountpoint) as admin:
        nsid = admin.nsid("fp8badrank")
        before = admin.statistics(nsid)
        job_id = {"job": 77, "seq": 1, "ranks": 2}
        admin.begin_shared_step(nsid, 1, 1.0, rank=0, grad_scales={name: {"scale": 64.0, "start": 0,
                                                                             "stop": BLOCK_ELEMS}}, **job_id)
        for bad in ({"scale": 32.0, "start": 0, "stop": BLOCK_ELEMS},  # rank 0's blocks
                    {"scale": 32.0, "start": BLOCK_ELEMS + 8, "stop": params[0].numel()},  # mid-block
                    {"scale": 0.0, "start": BLOCK_ELEMS, "stop": params[0].numel()},
                    {"scale": 32.0, "start": BLOCK_ELEMS, "stop": params[0].numel(), "extra": 1}):
            with pytest.raises(DeviceError) as refused:
                admin.begin_shared_step(nsid, 1, 1.0, rank=1, grad_scales={name: bad}, **job_id)
            assert refused.value.status == Status.INVALID_FIELD
            assert admin.statistics(nsid)["shared_step"]["joined"] == [0]
        admin.begin_shared_step(nsid, 1, 1.0, rank=1, grad_scales={name: {"scale": 32.0, "start": BLOCK_ELEMS,
                                                                             "stop": params[0].numel()}}, **job_id)
        assert admin.statistics(nsid)["shared_step"]["joined"] == [0, 1]
        admin.abort_shared_step(nsid, 1, rank=0, reason="test", **job_id)
        after = admin.statistics(nsid)
        assert after["committed_step"] == before["committed_step"] == 0 and after.get("step_open") is None


def test_fp8_under_fsdp2_is_refused_at_construction(devices: list[Mount], tmp_path: Path) -> None:
    """FSDP2's rows start anywhere in a device block and an FP8 scale covers whole blocks: every
    rank fails at construction saying so, and no namespace is made."""
    out = tmp_path / "job"
    codes = spawn_ranks(FSDP_JOB, {"mount": str(devices[0].mountpoint), "namespace": "fp8fsdp", "last": 2,
                                   "out": str(out), "mode": "fsdp", "grad_dtype": "fp8_e4m3"}, 2, out, 240)
    assert codes == [4, 4], (codes, (out / "logs.txt").read_text()[-4000:])
    for rank in range(2):
        message = (out / f"error{rank}.txt").read_text()
        assert "not supported where FSDP2 holds the params" in message, message
    with AdminClient(devices[0].mountpoint) as admin:
        assert "fp8fsdp" not in [entry["name"] for entry in admin.describe()["namespaces"]]
