"""FP8 gradients streamed during backward (each tensor's scale added to the open step before its codes) equal the step sent at once, bit for bit; an inf gradient skips an E4M3 step; a scale after its gradients, or with another grad scale, is refused."""
from __future__ import annotations

import pytest
import torch

from cossd.protocol.status import DeviceError, Status
from cossd.trainer import AdamW

from conftest import Mount
from test_trainer import bits, loss_of, make_model, opened  # noqa: F401 - opened is a fixture

pytestmark = pytest.mark.mount

STEPS = 6


def _run(opened, mount: Mount, namespace: str, grad_dtype: str, streaming: bool, use_cmb: bool) -> list[torch.Tensor]:
    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace=namespace, lr=3e-3,
                       grad_dtype=grad_dtype, streaming=streaming, use_cmb=use_cmb)
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        loss_of(model, step, torch.bfloat16).backward()
        optimizer.step()
    assert optimizer.committed_step == STEPS
    return bits(model) + [master.view(torch.int32) for master in optimizer.master_weights()]


@pytest.mark.parametrize("grad_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("use_cmb", [True, False], ids=["cmb", "files"])
def test_streamed_fp8_equals_fp8_sent_at_once(opened, mount: Mount, grad_dtype: str, use_cmb: bool) -> None:
    """Streaming sends each tensor as backward makes it, its scale (from its own amax, as the
    step sent at once computes it) added to the open step just before: the params and masters
    after 6 steps are the same bits."""
    at_once = _run(opened, mount, f"once-{grad_dtype}-{use_cmb}", grad_dtype, False, use_cmb)
    streamed = _run(opened, mount, f"stream-{grad_dtype}-{use_cmb}", grad_dtype, True, use_cmb)
    assert all(torch.equal(a, b) for a, b in zip(at_once, streamed))


@pytest.mark.parametrize("streaming", [False, True])
def test_an_inf_gradient_skips_an_e4m3_step(opened, mount: Mount, streaming: bool) -> None:
    """An inf in one gradient becomes a NaN code, so the device skips the step (torch's cast alone
    makes E4M3's finite 448 of it, and the step would have committed a huge update)."""
    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace=f"inf-{streaming}",
                       grad_dtype="fp8_e4m3", streaming=streaming)
    before = bits(model)

    def with_inf(grad: torch.Tensor) -> torch.Tensor:
        # In backward itself, so that streaming sends it too.
        grad = grad.clone()
        grad.view(-1)[3] = float("inf")
        return grad

    next(model.parameters()).register_hook(with_inf)
    loss_of(model, 1, torch.bfloat16).backward()
    optimizer.step()
    assert optimizer.last_step_skipped and optimizer.committed_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, bits(model)))
    stats = optimizer.files.statistics()
    assert stats["steps_skipped"] == 1 and stats["nonfinite_elements"] == 1


def test_a_scale_after_its_gradients_or_with_another_grad_scale_is_refused(opened, mount: Mount) -> None:
    """BEGIN_STEP naming the open step adds scales only for tensors none of whose gradients
    arrived, and only with the step's own grad scale; refused (INVALID_FIELD) otherwise, with
    the step as it was: it still commits with what it has."""
    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="addscale",
                       grad_dtype="fp8_e4m3")
    files, admin = optimizer.files, optimizer.files.admin
    first, second = optimizer.entries[0], optimizer.entries[1]
    admin.begin_step(files.nsid, 1, 1.0, {first.name: 4.0})
    with pytest.raises(DeviceError) as refused:  # first has a scale already
        admin.begin_step(files.nsid, 1, 1.0, {first.name: 8.0})
    assert refused.value.status == Status.INVALID_FIELD
    with pytest.raises(DeviceError, match="same") as refused:
        admin.begin_step(files.nsid, 1, 0.5, {second.name: 8.0})
    files.write(second.name, "grad", torch.zeros(second.numel, dtype=torch.uint8))
    with pytest.raises(DeviceError, match="after some of their gradients") as refused:
        admin.begin_step(files.nsid, 1, 1.0, {second.name: 8.0})
    assert refused.value.status == Status.INVALID_FIELD
    for entry in optimizer.entries[2:]:
        admin.begin_step(files.nsid, 1, 1.0, {entry.name: 2.0})  # added: nothing of theirs arrived yet
    for entry in [first, *optimizer.entries[2:]]:
        files.write(entry.name, "grad", torch.zeros(entry.numel, dtype=torch.uint8))
    assert admin.commit_step(files.nsid)["committed_step"] == 1
