"""FP8 gradients (E4M3, E5M2) with a per-tensor scale sent with BEGIN_STEP: parity with BF16 gradients on the demo's GPT, bad scales refused, a daemon kill -9 between steps resumed bit for bit."""
from __future__ import annotations

import math

import pytest
import torch

from cossd.harness.gpt import GPTConfig, StdlibCorpus, build_model
from cossd.protocol.status import DeviceError, Status
from cossd.trainer import AdamW

from conftest import Mount
from test_trainer import bits, loss_of, make_model, opened  # noqa: F401 - opened is a fixture

pytestmark = pytest.mark.mount

STEPS = 40


def _train_gpt(opened, mount: Mount, corpus: StdlibCorpus, grad_dtype: str | None) -> list[float]:
    """The demo's GPT ("tiny" preset, BF16) for STEPS steps with cossd's AdamW and `grad_dtype`."""
    config = GPTConfig.named("tiny")
    model = build_model(config, seed=0, dtype=torch.bfloat16, device="cpu")
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace=f"gpt-{grad_dtype}",
                       lr=3e-3, grad_dtype=grad_dtype)
    losses = []
    for step in range(1, STEPS + 1):
        optimizer.zero_grad()
        tokens, targets = corpus.batch(step, 8, config.context)
        loss = model.loss(tokens, targets)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses


def test_fp8_gradients_train_the_demo_gpt_like_bf16(opened, mount: Mount) -> None:
    """40 steps of the demo's GPT (tiny preset): the mean loss of the last 5 steps with E4M3 and
    with E5M2 gradients is within 1% of the run with BF16 gradients (measured: printed)."""
    corpus = StdlibCorpus(max_bytes=1 << 20)
    reference = _train_gpt(opened, mount, corpus, None)
    assert reference[-1] < reference[0] - 0.5  # it learns
    for grad_dtype in ("fp8_e4m3", "fp8_e5m2"):
        losses = _train_gpt(opened, mount, corpus, grad_dtype)
        tail, ref_tail = sum(losses[-5:]) / 5, sum(reference[-5:]) / 5
        print(f"{grad_dtype}: last-5 mean loss {tail:.4f} against bf16 {ref_tail:.4f} "
              f"({(tail - ref_tail) / ref_tail:+.2%}); largest step difference "
              f"{max(abs(a - b) for a, b in zip(losses, reference)):.3e}")
        assert math.isclose(tail, ref_tail, rel_tol=0.01)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), "2"])
def test_bad_scales_are_refused_and_change_nothing(opened, mount: Mount, bad: object) -> None:
    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="fp8bad", grad_dtype="fp8_e4m3")
    files = optimizer.files
    before = files.statistics()
    name = optimizer.entries[0].name
    with pytest.raises(DeviceError) as refused:
        files.admin.begin_step(files.nsid, 1, 1.0, {name: bad})
    # NaN and inf are not JSON numbers: the payload's decoding refuses them, naming that.
    assert refused.value.status == Status.INVALID_FIELD
    assert "grad_scales" in str(refused.value) or "not a JSON number" in str(refused.value)
    after = files.statistics()
    assert after["committed_step"] == before["committed_step"] == 0 and after.get("step_open") is None
    # The namespace steps on as if nothing was sent.
    loss_of(model, 1, torch.bfloat16).backward()
    optimizer.step()
    assert optimizer.committed_step == 1


def test_scales_for_a_namespace_without_fp8_gradients_or_an_unknown_tensor_are_refused(opened, mount: Mount) -> None:
    plain = opened(AdamW, make_model(torch.bfloat16).parameters(), mount=mount.mountpoint, namespace="plain")
    with pytest.raises(DeviceError, match="per-tensor grad_scales go with FP8 ones"):
        plain.files.admin.begin_step(plain.files.nsid, 1, 1.0, {plain.entries[0].name: 2.0})
    fp8 = opened(AdamW, make_model(torch.bfloat16).parameters(), mount=mount.mountpoint, namespace="fp8name",
                 grad_dtype="fp8_e5m2")
    with pytest.raises(DeviceError, match="no tensor 'nope'"):
        fp8.files.admin.begin_step(fp8.files.nsid, 1, 1.0, {"nope": 2.0})
    assert plain.files.statistics()["committed_step"] == fp8.files.statistics()["committed_step"] == 0


def test_fp8_where_the_scale_cannot_travel_is_refused(opened, mount: Mount) -> None:
    """The wire dtype that DeepSpeed's binding sends its slices in has no FP8 (no scale goes
    with them): asking for it says so. (Streaming, ranks and several devices send scales:
    test_grad_fp8_streaming.py, test_grad_fp8_ranks.py.)"""
    optimizer = opened(AdamW, make_model(torch.bfloat16).parameters(), mount=mount.mountpoint, namespace="fp8s",
                       grad_dtype="fp8_e4m3")
    with pytest.raises(RuntimeError, match="DeepSpeed's and FSDP2's bindings do not send it"):
        _ = optimizer.grad_wire


@pytest.mark.parametrize("grad_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_daemon_killed_between_fp8_steps_resumes_bit_for_bit(opened, mount: Mount, grad_dtype: str) -> None:
    """Through the CMB: kill -9 of the daemon after step 4; remounted, a new job restores the
    params and steps 5-8 end bit for bit as the run that never stopped."""
    straight = make_model(torch.bfloat16)
    straight_opt = opened(AdamW, straight.parameters(), mount=mount.mountpoint, namespace=f"s-{grad_dtype}",
                          grad_dtype=grad_dtype)
    assert straight_opt.files.stream_slots() is not None  # through the CMB
    for step in range(1, 9):
        straight_opt.zero_grad()
        loss_of(straight, step, torch.bfloat16).backward()
        straight_opt.step()
    straight_opt.close()

    model = make_model(torch.bfloat16)
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace=f"k-{grad_dtype}",
                       grad_dtype=grad_dtype)
    for step in range(1, 5):
        optimizer.zero_grad()
        loss_of(model, step, torch.bfloat16).backward()
        optimizer.step()
    mount.kill()
    optimizer.close()
    mount.restart()

    restarted = make_model(torch.bfloat16, seed=99)
    resumed = opened(AdamW, restarted.parameters(), mount=mount.mountpoint, namespace=f"k-{grad_dtype}",
                     grad_dtype=grad_dtype)
    assert resumed.restored and resumed.committed_step == 4
    for step in range(5, 9):
        resumed.zero_grad()
        loss_of(restarted, step, torch.bfloat16).backward()
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(bits(straight), bits(restarted)))
