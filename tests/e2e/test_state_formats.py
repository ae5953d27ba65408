"""cossd.trainer with block-scaled moments (state_dtype fp16, int8) through a real mount: state_dict, loads, transports, parity, restart."""
from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cossd.trainer import AdamW, DeviceLostError

from conftest import Mount
from test_trainer import opened  # noqa: F401  (the fixture: optimizers closed before the mount goes)

pytestmark = pytest.mark.mount

SCALED = ["fp16", "int8"]
BLOCK = 256  # elements per scale (kernels.STATE_BLOCK)


class OddNet(torch.nn.Module):
    """Tensors whose sizes are not whole 256-element scale blocks (37, 16 x 37, 37 x 300),
    and one of 300 x 1000 elements, larger than many blocks: each tensor's last block is partial."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 37)
        self.fc2 = torch.nn.Linear(37, 300)
        self.fc3 = torch.nn.Linear(300, 1000, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def odd_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return OddNet().to(torch.bfloat16)


def odd_loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(500 + step)
    x = torch.randn(32, 16, generator=generator).to(torch.bfloat16)
    y = torch.randint(0, 1000, (32,), generator=generator)
    return F.cross_entropy(model(x).float(), y)


def train(model: torch.nn.Module, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = odd_loss(model, step)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    return losses


def param_bits(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone().view(torch.int16) for p in model.parameters()]


def test_unknown_state_dtype_is_refused(mount: Mount) -> None:
    with pytest.raises(ValueError, match="fp32, bf16, fp16, int8"):
        AdamW(odd_model().parameters(), mount=mount.mountpoint, namespace="bad", state_dtype="fp8")


@pytest.mark.parametrize("state_dtype", SCALED)
def test_state_dict_reads_fp32_and_loads_into_another_namespace(opened, mount: Mount, state_dtype: str) -> None:
    """state_dict() gives the device's decoded moments as FP32; loading them into a fresh
    namespace (every tensor's last scale block partial) re-encodes them to the same codes, so
    both runs go on bit for bit."""
    model = odd_model()
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="src", lr=3e-3,
                       state_dtype=state_dtype)
    train(model, optimizer, range(1, 4))
    exported = optimizer.state_dict()
    assert float(exported["state"][0]["step"]) == 3.0
    for index, param in enumerate(model.parameters()):
        for role in ("exp_avg", "exp_avg_sq"):
            moment = exported["state"][index][role]
            assert moment.dtype == torch.float32 and moment.shape == param.shape
            assert bool(moment.abs().sum() > 0), f"{role} of param {index} is all zeros"
        assert bool((exported["state"][index]["exp_avg_sq"] >= 0).all())
    # The reads are what the mount's files hold: FP32, numel x 4 bytes.
    files = optimizer.files
    raw = files.read(optimizer.entries[3].name, "exp_avg", torch.float32, optimizer.entries[3].numel)
    assert torch.equal(raw.view(exported["state"][3]["exp_avg"].shape), exported["state"][3]["exp_avg"])

    copy_model = odd_model(seed=7)  # its own init: everything comes from the state dict
    copied = opened(AdamW, copy_model.parameters(), mount=mount.mountpoint, namespace="dst", lr=3e-3,
                    state_dtype=state_dtype)
    copied.load_state_dict(exported)
    assert copied.committed_step == 3
    assert all(torch.equal(a, b) for a, b in zip(param_bits(model), param_bits(copy_model)))
    reloaded = copied.state_dict()
    for index in exported["state"]:
        for role in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(reloaded["state"][index][role], exported["state"][index][role]), (index, role)
    train(model, optimizer, range(4, 7))
    train(copy_model, copied, range(4, 7))
    assert all(torch.equal(a, b) for a, b in zip(param_bits(model), param_bits(copy_model)))


@pytest.mark.parametrize("state_dtype", SCALED)
def test_stock_state_loads_encoded_within_the_format_error(opened, mount: Mount, state_dtype: str) -> None:
    """A stock torch AdamW state (any values, FP32) loads into a fp16/int8 namespace: what
    reads back is the encoding of what was loaded, within the format's error per block."""
    model = odd_model()
    stock = torch.optim.AdamW([p.detach().float().requires_grad_() for p in model.parameters()], lr=3e-3)
    generator = torch.Generator().manual_seed(3)
    for param in stock.param_groups[0]["params"]:
        param.grad = torch.randn(param.shape, generator=generator) * 10 ** torch.randint(-4, 1, param.shape,
                                                                                         generator=generator)
    stock.step()
    state = stock.state_dict()
    optimizer = opened(AdamW, odd_model(seed=1).parameters(), mount=mount.mountpoint, namespace="stock",
                       state_dtype=state_dtype)
    optimizer.load_state_dict(state, master=[p.detach() for p in stock.param_groups[0]["params"]])
    loaded = optimizer.state_dict()
    # fp16: 11 significant bits with a power-of-two scale per block; int8: a 256-entry map
    # scaled by the block's absmax (coarsest near the top: a step of about 1/64 there).
    tolerance = {"fp16": 2.0 ** -10, "int8": 2.0 ** -5}[state_dtype]
    for index, values in state["state"].items():
        for role in ("exp_avg", "exp_avg_sq"):
            want = values[role].reshape(-1)
            got = loaded["state"][index][role].reshape(-1)
            for start in range(0, want.numel(), BLOCK):
                block, back = want[start:start + BLOCK], got[start:start + BLOCK]
                absmax = float(block.abs().max())
                error = float((block - back).abs().max())
                assert error <= tolerance * absmax, f"{index} {role} block {start // BLOCK}: {error} of {absmax}"


def test_a_moment_past_bf16s_range_is_refused_and_nothing_loads(opened, mount: Mount) -> None:
    """A finite FP32 moment above BF16's largest value (about 3.39e38) would round to inf in a
    bf16 namespace, and every later step of its element would be NaN: refused, naming it, and
    the namespace keeps what it had."""
    model = odd_model()
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="bfbig", state_dtype="bf16")
    train(model, optimizer, range(1, 3))
    state = optimizer.state_dict()
    before = state["state"][0]["exp_avg_sq"].clone()
    state["state"][0]["exp_avg_sq"] = before.clone()
    state["state"][0]["exp_avg_sq"].reshape(-1)[0] = 3.4e38  # finite in FP32, inf in BF16
    with pytest.raises(ValueError, match="exp_avg_sq for param 0 .*, as bf16 holds 1 non-finite"):
        optimizer.load_state_dict(state)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg_sq"], before)


def test_bf16_state_dict_still_reads_its_own_bits(opened, mount: Mount) -> None:
    """bf16 moments read as bf16 (exact in FP32): the fp16/int8 reads did not change them."""
    model = odd_model()
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="bf", state_dtype="bf16")
    train(model, optimizer, range(1, 3))
    moment = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(moment, moment.to(torch.bfloat16).float())
    assert bool(moment.abs().sum() > 0)


@pytest.mark.parametrize("state_dtype", SCALED)
def test_execute_program_transport_steps_like_the_vendor_path(opened, mount: Mount, state_dtype: str) -> None:
    """transport='cp' (Execute Program's adamw_step over the CMB) with block-scaled moments:
    the device's moment ranges are their FP32 view (4 bytes an element), and the steps equal
    the vendor CMB_WRITE path's bit for bit, moments included."""
    models = [odd_model(), odd_model()]
    vendor = opened(AdamW, models[0].parameters(), mount=mount.mountpoint, namespace="vendor", state_dtype=state_dtype)
    program = opened(AdamW, models[1].parameters(), mount=mount.mountpoint, namespace="cp", state_dtype=state_dtype,
                     transport="cp")
    assert train(models[0], vendor, range(1, 5)) == train(models[1], program, range(1, 5))
    assert all(torch.equal(a, b) for a, b in zip(param_bits(models[0]), param_bits(models[1])))
    ours, theirs = vendor.state_dict()["state"], program.state_dict()["state"]
    assert all(torch.equal(ours[i][role], theirs[i][role]) for i in ours for role in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("state_dtype", SCALED)
def test_kill_9_then_the_trainer_resumes_bit_for_bit(opened, mount: Mount, state_dtype: str) -> None:
    """kill -9 of the daemon in the middle of a step of a fp16/int8 namespace; after a
    remount a new job (its own random init) reattaches at the committed step and continues
    bit for bit like a run that was never interrupted: params, and the moments state_dict reads."""
    straight_model = odd_model()
    straight = opened(AdamW, straight_model.parameters(), mount=mount.mountpoint, namespace="straight",
                      state_dtype=state_dtype)
    train(straight_model, straight, range(1, 9))
    expected_state = straight.state_dict()["state"]
    straight.close()

    model = odd_model()
    optimizer = opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="crashy", state_dtype=state_dtype)
    train(model, optimizer, range(1, 5))
    optimizer.zero_grad()
    odd_loss(model, 5).backward()
    optimizer.before_grad_write = lambda index: mount.kill() if index == 2 else None
    with pytest.raises(DeviceLostError, match="remount"):
        optimizer.step()
    optimizer.close()
    mount.restart()

    restarted = odd_model(seed=99)
    resumed = opened(AdamW, restarted.parameters(), mount=mount.mountpoint, namespace="crashy", state_dtype=state_dtype)
    assert resumed.restored and resumed.committed_step == 4
    train(restarted, resumed, range(5, 9))
    assert all(torch.equal(a, b) for a, b in zip(param_bits(straight_model), param_bits(restarted)))
    state = resumed.state_dict()["state"]
    assert all(torch.equal(state[i][role], expected_state[i][role])
               for i in state for role in ("exp_avg", "exp_avg_sq"))


def gpt_run(mount: Mount, state_dtype: str, size: str, steps: int, lr: float = 1e-3) -> tuple[list[float], float]:
    """The demo's byte-level GPT (BF16 params, FP32 masters on the device) trained `steps`
    steps through the mount with `state_dtype` moments: its training losses, and its loss on
    4 held-out batches after the last step (the "final loss")."""
    from cossd.harness.gpt import GPTConfig, StdlibCorpus, build_model

    gpt = GPTConfig.named(size)
    corpus = StdlibCorpus(max_bytes=1 << 20)
    model = build_model(gpt, seed=0, dtype=torch.bfloat16, device="cpu")
    optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace=f"gpt-{size}-{state_dtype}-{steps}-{lr}", lr=lr,
                      weight_decay=0.1, state_dtype=state_dtype)
    try:
        losses = []
        for step in range(1, steps + 1):
            optimizer.zero_grad()
            loss = model.loss(*corpus.batch(step, 8, gpt.context))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        with torch.no_grad():
            held_out = sum(model.loss(*corpus.batch(step, 8, gpt.context, seed=1)).item() for step in range(4)) / 4
    finally:
        optimizer.close()
    return losses, held_out


def assert_parity(mount: Mount, size: str, steps: int, figures: list[str]) -> None:
    runs = {state_dtype: gpt_run(mount, state_dtype, size, steps) for state_dtype in ["fp32", *SCALED]}
    reference = runs["fp32"][1]
    line = [f"GPT {size}, {steps} steps, final held-out loss: fp32 moments {reference:.4f}"]
    for state_dtype in SCALED:
        losses, final = runs[state_dtype]
        assert math.isfinite(final) and losses[-1] < losses[0]
        line.append(f"{state_dtype} {final:.4f} ({(final - reference) / reference:+.2%})")
    figures.append(", ".join(line))
    assert runs["fp32"][0][-1] < runs["fp32"][0][0]
    for state_dtype in SCALED:
        final = runs[state_dtype][1]
        assert abs(final - reference) <= 0.01 * reference, f"{state_dtype}: {final} vs {reference} (fp32 moments)"


def test_gpt_parity_with_fp32_moments(mount: Mount, figures: list[str]) -> None:
    """Issue 33's parity: the demo's GPT (tiny), 40 steps at lr 1e-3 with fp32, fp16 and int8
    moments: the final loss of fp16 and int8 within 1% of fp32's (measured: docs/trainer.md)."""
    assert_parity(mount, "tiny", 40, figures)


@pytest.mark.slow
def test_gpt_small_parity_with_fp32_moments(mount: Mount, figures: list[str]) -> None:
    """The same on the demo's default GPT (small, ~3.3M params), 50 steps."""
    assert_parity(mount, "small", 50, figures)


@pytest.mark.parametrize("state_dtype", SCALED)
def test_state_dict_over_two_devices(tmp_path, state_dtype: str) -> None:
    """Over two devices (mount=[a, b]: each device holds its own pieces, each piece's scale
    blocks its own), state_dict() joins the devices' FP32 moments, and loading them into
    another namespace on the same two devices goes on bit for bit."""
    sys.path.insert(0, str(Path(__file__).parent))
    from ranks import mounted_device

    with contextlib.ExitStack() as stack:
        devices = [stack.enter_context(mounted_device(tmp_path / f"device{i}", f"SCALED00{i}", 2 << 30))
                   for i in range(2)]
        paths = [str(device.mountpoint) for device in devices]
        model, copy_model = odd_model(), odd_model(seed=5)
        optimizer = stack.enter_context(contextlib.closing(
            AdamW(model.parameters(), mount=paths, namespace="two", lr=3e-3, state_dtype=state_dtype)))
        assert all(child.entries for child in optimizer._group)  # both devices hold state
        train(model, optimizer, range(1, 4))
        exported = optimizer.state_dict()
        assert all(exported["state"][i][role].dtype == torch.float32 and bool(exported["state"][i][role].any())
                   for i in exported["state"] for role in ("exp_avg", "exp_avg_sq"))
        copied = stack.enter_context(contextlib.closing(
            AdamW(copy_model.parameters(), mount=paths, namespace="two-copy", lr=3e-3, state_dtype=state_dtype)))
        copied.load_state_dict(exported)
        assert copied.committed_step == 3
        train(model, optimizer, range(4, 7))
        train(copy_model, copied, range(4, 7))
        assert all(torch.equal(a, b) for a, b in zip(param_bits(model), param_bits(copy_model)))


@pytest.mark.parametrize("made, asked", [("int8", "fp32"), ("bf16", "fp32"), ("fp32", "fp16")])
def test_reattach_with_another_state_dtype_is_refused(opened, mount: Mount, made: str, asked: str) -> None:
    """A namespace keeps the moments' format it was made with: reattaching with another
    state_dtype is refused (state_dict would read its moments in the wrong format), and the
    namespace still resumes with its own."""
    model = odd_model()
    train(model, opened(AdamW, model.parameters(), mount=mount.mountpoint, namespace="kept", state_dtype=made), range(1, 3))
    with pytest.raises(ValueError, match=f"keeps {made} moments.*state_dtype='{made}'"):
        AdamW(odd_model().parameters(), mount=mount.mountpoint, namespace="kept", state_dtype=asked)
    resumed = opened(AdamW, odd_model().parameters(), mount=mount.mountpoint, namespace="kept", state_dtype=made)
    assert resumed.committed_step == 2
