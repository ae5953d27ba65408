"""FP8 params out (param_wire_dtype): the demo's GPT trained with FP8 gradients in and FP8 params out against BF16 through a real mount, the link's bytes a step (CMB and files), a restart, and the refusals."""
from __future__ import annotations

import math
import os

import pytest
import torch

from cossd.harness.gpt import GPTConfig, StdlibCorpus, build_model
from cossd.protocol import param_fp8 as wire
from cossd.trainer import AdamW, param_fp8

from conftest import Mount
from test_trainer import loss_of, make_model, opened  # noqa: F401 - opened is a fixture

pytestmark = pytest.mark.mount

STEPS = 40


def _train_gpt(opened, mount: Mount, corpus: StdlibCorpus, namespace: str, **options: object
               ) -> tuple[list[float], AdamW, torch.nn.Module, list[dict]]:
    """The demo's GPT ("tiny" preset, BF16) for STEPS steps; the device's counters after each step."""
    config = GPTConfig.named("tiny")
    model = build_model(config, seed=0, dtype=torch.bfloat16, device="cpu")
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace=namespace, lr=3e-3, **options)
    losses, stats = [], [optimizer.files.statistics()]
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        tokens, targets = corpus.batch(step, 8, config.context)
        loss = model.loss(tokens, targets)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        stats.append(optimizer.files.statistics())
    return losses, optimizer, model, stats


def _device_params(optimizer: AdamW) -> list[torch.Tensor]:
    """Each param as the device's param_fp8 file gives it, decoded independently of the trainer."""
    out = []
    for entry in optimizer.entries:
        data = optimizer.files.read(entry.name, wire.ROLE, torch.uint8, wire.out_bytes(entry.numel))
        step, scale = wire.parse_header(data[: wire.HEADER_BYTES].numpy())
        assert step == optimizer.committed_step
        assert math.frexp(scale)[0] == 0.5  # a power of two
        fp8 = torch.float8_e4m3fn if optimizer.param_wire_dtype == "fp8_e4m3" else torch.float8_e5m2
        out.append(data[wire.HEADER_BYTES:].view(fp8).float() / scale)
    return out


@pytest.mark.parametrize("use_cmb", [True, False], ids=["cmb", "files"])
def test_fp8_grads_and_fp8_params_train_the_demo_gpt_near_bf16(opened, mount: Mount, use_cmb: bool) -> None:
    """40 steps: FP8 gradients in and FP8 params out (E4M3) against BF16 both ways: the last-5
    mean loss is finite and within 10% (measured: printed); 1 B/param each way a step."""
    corpus = StdlibCorpus(max_bytes=1 << 20)
    reference, _, _, _ = _train_gpt(opened, mount, corpus, f"bf16-{use_cmb}", use_cmb=use_cmb)
    losses, optimizer, model, stats = _train_gpt(opened, mount, corpus, f"fp8-{use_cmb}", use_cmb=use_cmb,
                                                 grad_dtype="fp8_e4m3", param_wire_dtype="fp8_e4m3")
    assert optimizer.files.step_transport().kind == ("cmb" if use_cmb else "files")
    tail, ref_tail = sum(losses[-5:]) / 5, sum(reference[-5:]) / 5
    print(f"cmb={use_cmb}: FP8 grads + FP8 params last-5 mean loss {tail:.4f} against bf16 {ref_tail:.4f} "
          f"({(tail - ref_tail) / ref_tail:+.2%})")
    assert math.isfinite(tail) and losses[-1] < losses[0] - 0.5
    assert math.isclose(tail, ref_tail, rel_tol=0.10)
    # The link a step: 1 B/param of gradients in; 1 B/param of params out (and a 16-byte
    # header per tensor), the same every step, through the CMB places or the param_fp8 files.
    numel = sum(entry.numel for entry in optimizer.entries)
    headers = wire.HEADER_BYTES * len(optimizer.entries)
    for before, after in zip(stats, stats[1:]):
        assert after["grad_bytes_in"] - before["grad_bytes_in"] == numel
        assert after["param_bytes_out"] - before["param_bytes_out"] == numel + headers
        if use_cmb:  # the params came back in the CMB with the step: no read command
            assert after["read_commands"] == before["read_commands"]
    assert stats[-1]["param_fp8_overflows"] == 0
    # The model holds exactly the device's FP8 params of the last step, decoded.
    for param, device in zip(model.parameters(), _device_params(optimizer)):
        assert torch.equal(param.detach().float().reshape(-1), device.to(torch.bfloat16).float())


def test_restart_reads_the_fp8_params_of_the_committed_step(opened, mount: Mount) -> None:
    """A new optimizer on the namespace restores the params the running one held."""
    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="fp8restart",
                       param_wire_dtype="fp8_e5m2")
    for step in range(1, 4):
        optimizer.zero_grad()
        loss_of(model, step, torch.bfloat16).backward()
        optimizer.step()
    held = [param.detach().clone() for param in model.parameters()]
    optimizer.close()
    again = make_model(torch.bfloat16)
    restored = opened(AdamW, again.parameters(), mount=mount.mountpoint, namespace="fp8restart",
                      param_wire_dtype="fp8_e5m2")
    assert restored.restored and restored.committed_step == 3
    for before, after in zip(held, again.parameters()):
        assert torch.equal(before, after.detach())
    # The same namespace without the option is refused, naming it.
    with pytest.raises(ValueError, match="param_wire_dtype='fp8_e5m2'"):
        opened(AdamW, make_model(torch.bfloat16).parameters(), mount=mount.mountpoint, namespace="fp8restart")


@pytest.mark.parametrize("options,named", [
    ({"param_wire_dtype": "fp16"}, "param_wire_dtype must be"),
    ({"param_wire_dtype": "fp8_e4m3", "streaming": True}, "not with streaming=True"),
    ({"param_wire_dtype": "fp8_e4m3", "transport": "cp"}, r"not with transport='cp'"),
])
def test_unsupported_combinations_are_refused_and_create_nothing(mount: Mount, options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named) as refused:
        AdamW(make_model(torch.bfloat16).parameters(), mount=mount.mountpoint, namespace="refused", **options)
    assert "param_wire_dtype" in str(refused.value)
    assert not os.path.exists(mount.mountpoint / "ns" / "refused")


def test_a_storage_server_is_refused(mount: Mount) -> None:
    # Several devices are not refused: tests/e2e/test_param_fp8_devices.py.
    with pytest.raises(ValueError, match=r"param_wire_dtype='fp8_e4m3'.*not with a storage server"):
        AdamW(make_model(torch.bfloat16).parameters(), mount="cossd://127.0.0.1:9", namespace="refused",
              param_wire_dtype="fp8_e4m3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_an_fp32_or_fp16_model_holds_the_decoded_fp8_params(opened, mount: Mount, dtype: torch.dtype) -> None:
    """Whatever the model's dtype, its params are the device's FP8 params decoded (an FP32
    model gets them exactly, not the FP32 masters)."""
    model = make_model(dtype)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace=f"fp8-{str(dtype)[6:]}",
                       param_wire_dtype="fp8_e4m3")
    for step in range(1, 4):
        optimizer.zero_grad()
        loss_of(model, step, dtype).backward()
        optimizer.step()
    for param, device in zip(model.parameters(), _device_params(optimizer)):
        assert torch.equal(param.detach().reshape(-1), device.to(dtype))
    masters = [optimizer.files.read(entry.name, "master", torch.float32, entry.numel) for entry in optimizer.entries]
    assert any(not torch.equal(param.detach().float().reshape(-1), master)
               for param, master in zip(model.parameters(), masters))


def test_cmb_places_of_another_step_are_not_taken(opened, mount: Mount) -> None:
    """Places whose header names a step other than the one committed (a step skipped or aborted
    after the device filled them) are passed over: the params are read from param_fp8."""
    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="fp8places",
                       param_wire_dtype="fp8_e4m3")
    loss_of(model, 1, torch.bfloat16).backward()
    optimizer.step()
    transport = optimizer.files.step_transport()
    slots = transport.slots()
    assert transport.cmb is not None and slots is not None
    # The places as the step left them, then one header relabelled and its codes spoilt.
    window = transport.cmb.array
    first = optimizer.entries[0]
    at, size = slots[first.name][1], slots[first.name][3]
    window[at : at + wire.HEADER_BYTES] = list(wire.header(7, 1.0))
    window[at + wire.HEADER_BYTES : at + size] = 0x7E
    transport._params_back = {name: (slot[1], slot[3]) for name, slot in slots.items()}
    reads_before = optimizer.files.statistics()["read_commands"]
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    step = param_fp8.read_params(optimizer.files, optimizer.entries, "fp8_e4m3", optimizer.committed_step)
    assert step == optimizer.committed_step == 1
    assert optimizer.files.statistics()["read_commands"] > reads_before  # read from the device instead
    for param, device in zip(model.parameters(), _device_params(optimizer)):
        assert torch.equal(param.detach().float().reshape(-1), device.to(torch.bfloat16).float())
