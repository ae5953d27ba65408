"""FP8 params out over several devices (mount=[...]) in one process: each device hands back its own pieces as FP8 with each piece's own scale, the model holds them decoded, each device's C6h has its pieces' scales, and a reopened group reads the same; a job of several ranks is still refused."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from cossd.client import AdminClient
from cossd.protocol import param_fp8 as wire
from cossd.protocol.logpages import LogId
from cossd.trainer import AdamW, param_fp8

from conftest import Mount
from ranks import mounted_device

pytestmark = pytest.mark.mount

sys.path.insert(0, str(Path(__file__).parent))
from multirank_job import Net  # noqa: E402  (fc1.weight is more than one placement block: it is split)

STEPS = 4
E4M3_MAX = 448.0


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Mount]]:
    root = tmp_path_factory.mktemp("p8devices")
    with mounted_device(root / "a", "P8DEVICES0001", 2 << 30) as first, \
            mounted_device(root / "b", "P8DEVICES0002", 2 << 30) as second:
        yield [first, second]


def graded_model() -> torch.nn.Module:
    """Net in BF16 with each param's magnitudes rising 64-fold along its elements, so that the
    two pieces of a split tensor have amaxes far apart (and so scales of their own)."""
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            flat = param.view(-1)
            flat.copy_(flat.float() * 64.0 ** torch.linspace(0, 1, flat.numel()))
    return model


def pieces_of(device: Mount, namespace: str) -> list[tuple[str, int]]:
    """The device's tensors (name, numel) in its namespace's order."""
    config = json.loads((Path(device.mountpoint) / "ns" / namespace / "config.json").read_text())
    return [(tensor["name"], int(tensor["numel"])) for tensor in config["tensors"]]


def read_file(device: Mount, namespace: str, tensor: str, role: str) -> bytes:
    return (Path(device.mountpoint) / "ns" / namespace / "tensors" / tensor / role).read_bytes()


def expected_encoding(master: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The scale and codes of a piece's masters, by torch's cast (not the device's kernel)."""
    amax = float(master.abs().max())
    scale = 2.0 ** max(-64, min(64, math.floor(math.log2(E4M3_MAX / amax))))
    codes = (master * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return scale, codes


def check_model_against_devices(optimizer: AdamW, devices: list[Mount], namespace: str,
                                step: int) -> dict[str, list[float]]:
    """Every param equals its pieces' param_fp8 codes decoded with each piece's own scale, and
    those are the pieces' masters encoded; returns each tensor's pieces' scales, in order."""
    params = {entry.name: entry.param for entry in optimizer.entries}  # a piece bears its tensor's name
    at = {name: 0 for name in params}
    scales: dict[str, list[float]] = {name: [] for name in params}
    for device in devices:
        for name, numel in pieces_of(device, namespace):
            data = read_file(device, namespace, name, wire.ROLE)
            got_step, scale = wire.parse_header(data[: wire.HEADER_BYTES])
            codes = torch.frombuffer(bytearray(data[wire.HEADER_BYTES:]), dtype=torch.uint8)
            master = torch.frombuffer(bytearray(read_file(device, namespace, name, "master")), dtype=torch.float32)
            want_scale, want_codes = expected_encoding(master)
            assert (got_step, scale) == (step, want_scale), name
            assert torch.equal(codes, want_codes), name
            decoded = param_fp8.decode(codes, scale, "fp8_e4m3").to(torch.bfloat16)
            mine = params[name].detach().reshape(-1)[at[name] : at[name] + numel]
            assert torch.equal(mine, decoded), name
            at[name] += numel
            scales[name].append(scale)
    assert at == {name: param.numel() for name, param in params.items()}  # every element is some device's
    return scales


def statistics(device: Mount, namespace: str) -> dict[str, Any]:
    with AdminClient(device.mountpoint) as admin:
        return admin.statistics(admin.nsid(namespace))


def state_page(device: Mount, namespace: str) -> dict[str, Any]:
    with AdminClient(device.mountpoint) as admin:
        return json.loads(admin.get_log_page(LogId.STATE_COUNTERS, admin.nsid(namespace)))[namespace]


def test_fp8_params_over_two_devices_each_piece_with_its_own_scale(devices: list[Mount]) -> None:
    model = graded_model()
    mounts = [device.mountpoint for device in devices]
    optimizer = AdamW(model.parameters(), lr=3e-3, mount=mounts, namespace="p8group", grad_dtype="fp8_e4m3",
                      param_wire_dtype="fp8_e4m3")
    try:
        # The initial load: the model holds the device's step-0 FP8 params already.
        check_model_against_devices(optimizer, devices, "p8group", 0)
        before = [statistics(device, "p8group") for device in devices]
        generator = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            for param in model.parameters():
                param.grad = (torch.randn(param.shape, generator=generator) * 0.01).to(torch.bfloat16)
            optimizer.step()
        assert optimizer.committed_step == STEPS
        # The link: each device's pieces, 1 B/param and a 16-byte header per piece a step, once.
        for device, earlier in zip(devices, before):
            later = statistics(device, "p8group")
            pieces = pieces_of(device, "p8group")
            assert later["param_bytes_out"] - earlier["param_bytes_out"] == STEPS * sum(
                numel + wire.HEADER_BYTES for _, numel in pieces)
        scales = check_model_against_devices(optimizer, devices, "p8group", STEPS)
    finally:
        optimizer.close()
    fc1 = scales["g0.p0"]  # fc1.weight
    assert len(fc1) == 2 and fc1[0] != fc1[1]  # split over the devices, each piece with its own scale
    # Each device's C6h: its own pieces' last scale and step.
    for device in devices:
        figures = state_page(device, "p8group")["param_fp8"]
        for tensor, _ in pieces_of(device, "p8group"):
            header = wire.parse_header(read_file(device, "p8group", tensor, wire.ROLE)[: wire.HEADER_BYTES])
            assert (figures[tensor]["step"], figures[tensor]["scale"]) == header
    # Reopened with another model's values: it reads the same FP8 params back.
    fresh = graded_model()
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()
    reopened = AdamW(fresh.parameters(), lr=3e-3, mount=mounts, namespace="p8group", grad_dtype="fp8_e4m3",
                     param_wire_dtype="fp8_e4m3")
    try:
        assert reopened.committed_step == STEPS
        for mine, theirs in zip(fresh.parameters(), model.parameters()):
            assert torch.equal(mine, theirs)
    finally:
        reopened.close()


def test_a_job_of_several_ranks_is_still_refused() -> None:
    with pytest.raises(ValueError, match=r"param_wire_dtype='fp8_e4m3'.*not with a sharded job"):
        param_fp8.check_option("fp8_e4m3", streaming=False, sharded=True, transport="vendor", remote=False)
