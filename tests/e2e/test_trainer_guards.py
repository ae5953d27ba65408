"""What the device does not compute is refused, never ignored: a param group's unsupported
options, a streamed step changed after backward, FSDP1's flat shards, and weights loaded into
the model after the optimizer was made (taken as the masters before the first step, refused
after). Each against torch.optim.AdamW where cossd now trains as it does."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from cossd.trainer import Adam, AdamW

from conftest import Mount
from ranks import mounted_device

pytestmark = pytest.mark.mount

X = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def backward(net: torch.nn.Module) -> None:
    (net(X) ** 2).mean().backward()


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))


# FP32 params with FP32 gradients on the wire: torch's AdamW to within its rounding.
TOLERANCE = 1e-6


@pytest.mark.parametrize("cls,group,match", [
    (AdamW, {"maximize": True}, "param group 0: maximize=True"),
    (AdamW, {"amsgrad": True}, "param group 0: amsgrad=True"),
    (AdamW, {"decoupled_weight_decay": False}, "decoupled_weight_decay=False"),
    (Adam, {"decoupled_weight_decay": True, "weight_decay": 0.1}, "decoupled_weight_decay=True"),
], ids=["maximize", "amsgrad", "adamw-l2-group", "adam-decoupled-group"])
def test_a_group_option_the_device_does_not_compute_is_refused(mount: Mount, cls: Any, group: dict[str, Any],
                                                               match: str) -> None:
    net = model()
    with pytest.raises(ValueError, match=match):
        cls([{"params": list(net.parameters()), **group}], mount=mount.mountpoint, namespace="grp")


def test_a_state_dict_whose_group_options_steps_would_refuse_loads_nothing(mount: Mount) -> None:
    """load_state_dict copies the saved groups' options: one that every later step() would
    refuse (amsgrad) is refused at the load, and the run goes on as it was. A stock Adam's
    state dict (decoupled_weight_decay=False, no weight decay) loads into an AdamW and steps
    as torch's AdamW does from it: with no decay the two modes are one step."""
    net, reference = model(), model()
    stock = torch.optim.Adam(reference.parameters(), lr=1e-2)
    backward(reference)
    stock.step()
    saved = stock.state_dict()
    optimizer = AdamW(net.parameters(), lr=1e-2, weight_decay=0.0, mount=mount.mountpoint, namespace="loadopts",
                      grad_dtype="fp32")
    try:
        bad = {**saved, "param_groups": [{**saved["param_groups"][0], "amsgrad": True}]}
        with pytest.raises(ValueError, match="amsgrad=True .*nothing was loaded"):
            optimizer.load_state_dict(bad)
        assert optimizer.param_groups[0]["amsgrad"] is False and optimizer.committed_step == 0
        optimizer.load_state_dict(saved, master=[p.detach() for p in reference.parameters()])
        for step_net, step_optimizer in ((net, optimizer), (reference, stock)):
            step_optimizer.zero_grad(set_to_none=True)
            backward(step_net)
            step_optimizer.step()
        assert optimizer.committed_step == 2
        assert largest_difference(list(net.parameters()), list(reference.parameters())) < TOLERANCE
    finally:
        optimizer.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["at-once", "streaming"])
def test_a_group_option_set_after_construction_is_refused_at_step(mount: Mount, streaming: bool) -> None:
    net = model()
    optimizer = AdamW(net.parameters(), lr=1e-2, mount=mount.mountpoint, namespace="late", grad_dtype="fp32",
                      streaming=streaming)
    try:
        backward(net)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer.param_groups[0]["maximize"] = True
        backward(net)
        with pytest.raises(ValueError, match="maximize=True .*found at step"):
            optimizer.step()
        assert optimizer.committed_step == 1
        # Put back, the run goes on from where it was (the refused step was dropped).
        optimizer.param_groups[0]["maximize"] = False
        optimizer.zero_grad(set_to_none=True)
        backward(net)
        optimizer.step()
        assert optimizer.committed_step == 2
    finally:
        optimizer.close()


def streamed_run(mount: Mount, namespace: str, case: str, steps: int = 3) -> tuple[AdamW, torch.nn.Module]:
    net = model()
    optimizer = AdamW(net.parameters(), lr=1e-2, mount=mount.mountpoint, namespace=namespace, grad_dtype="fp32",
                      streaming=True)
    for step in range(steps):
        backward(net)
        if case == "clip":
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.01)
        if case == "lr":
            optimizer.param_groups[0]["lr"] = 1e-2 * (step + 1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return optimizer, net


def test_streaming_refuses_gradients_clipped_after_backward(mount: Mount) -> None:
    with pytest.raises(RuntimeError, match="changed after backward.*max_grad_norm=.*streaming=False"):
        streamed_run(mount, "clip", "clip")


def test_streaming_refuses_an_lr_set_between_backward_and_step(mount: Mount) -> None:
    # Step 1 sets the lr it already had; step 2 changes it after backward: refused.
    with pytest.raises(RuntimeError, match=r"lr 0.01 -> 0.02.*before backward\(\)"):
        streamed_run(mount, "lr", "lr")


def test_streaming_with_a_scheduler_after_step_tracks_torch(mount: Mount) -> None:
    """The usual order (scheduler.step() after optimizer.step()) keeps working with streaming,
    and a refused step leaves the optimizer usable."""
    nets = [model(), model()]
    optimizer = AdamW(nets[0].parameters(), lr=1e-2, mount=mount.mountpoint, namespace="sched", grad_dtype="fp32",
                      streaming=True)
    reference = torch.optim.AdamW(nets[1].parameters(), lr=1e-2)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in (optimizer, reference)]
    try:
        for _ in range(4):
            for net, opt, scheduler in zip(nets, (optimizer, reference), schedulers):
                backward(net)
                opt.step()
                scheduler.step()
                opt.zero_grad(set_to_none=True)
        assert largest_difference(list(nets[0].parameters()), list(nets[1].parameters())) < TOLERANCE
        backward(nets[0])
        for param in nets[0].parameters():
            param.grad.mul_(0.5)
        with pytest.raises(RuntimeError, match="changed after backward"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        backward(nets[0])
        optimizer.step()
        assert optimizer.committed_step == 5
    finally:
        optimizer.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["at-once", "streaming"])
def test_weights_loaded_after_the_optimizer_are_trained_from(mount: Mount, streaming: bool) -> None:
    """model.load_state_dict after the optimizer is made and before its first step: the
    loaded weights become the masters, as torch's AdamW trains from them."""
    pretrained = model(seed=7).state_dict()
    nets = [model(), model()]
    optimizer = AdamW(nets[0].parameters(), lr=1e-2, mount=mount.mountpoint, namespace="loaded", grad_dtype="fp32",
                      streaming=streaming)
    reference = torch.optim.AdamW(nets[1].parameters(), lr=1e-2)
    try:
        for net, opt in zip(nets, (optimizer, reference)):
            net.load_state_dict(pretrained)
            for _ in range(3):
                backward(net)
                opt.step()
                opt.zero_grad(set_to_none=True)
        assert largest_difference(list(nets[0].parameters()), list(nets[1].parameters())) < TOLERANCE
        masters = optimizer.master_weights()
        assert largest_difference(masters, list(nets[1].parameters())) < TOLERANCE
        assert optimizer.committed_step == 3
    finally:
        optimizer.close()


def test_weights_loaded_after_a_step_are_refused_and_kept(mount: Mount) -> None:
    net = model()
    optimizer = AdamW(net.parameters(), lr=1e-2, mount=mount.mountpoint, namespace="after", grad_dtype="fp32")
    try:
        backward(net)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pretrained = model(seed=7).state_dict()
        net.load_state_dict(pretrained)
        backward(net)
        with pytest.raises(RuntimeError, match="written outside the optimizer.*load them before making the optimizer"):
            optimizer.step()
        # Never silently overwritten: the model still holds what was loaded.
        assert all(torch.equal(param, pretrained[name]) for name, param in net.state_dict().items())
        assert optimizer.committed_step == 1
        # load_state_dict with the loaded weights as the masters (master=) is the way: it then steps from them.
        optimizer.load_state_dict(optimizer.state_dict(), master=[param.detach().clone() for param in net.parameters()])
        assert all(torch.equal(param, pretrained[name]) for name, param in net.state_dict().items())
        optimizer.step()
        assert optimizer.committed_step == 2
    finally:
        optimizer.close()


def test_the_same_weights_written_again_change_nothing(mount: Mount) -> None:
    """A write of the values the device holds (a DDP broadcast, a load of the same weights)
    is not a load: a trained run goes on."""
    net = model()
    optimizer = AdamW(net.parameters(), lr=1e-2, mount=mount.mountpoint, namespace="same", grad_dtype="fp32")
    try:
        backward(net)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        net.load_state_dict({name: value.clone() for name, value in net.state_dict().items()})
        backward(net)
        optimizer.step()
        assert optimizer.committed_step == 2
    finally:
        optimizer.close()


def test_weights_loaded_after_the_optimizer_over_two_devices(mount: Mount, tmp_path: Path) -> None:
    pretrained = model(seed=7).state_dict()
    nets = [model(), model()]
    with mounted_device(tmp_path / "second", "GUARDSTEST002") as second:
        optimizer = AdamW(nets[0].parameters(), lr=1e-2, mount=[mount.mountpoint, second.mountpoint],
                          namespace="two", grad_dtype="fp32")
        reference = torch.optim.AdamW(nets[1].parameters(), lr=1e-2)
        try:
            for net, opt in zip(nets, (optimizer, reference)):
                net.load_state_dict(pretrained)
                for _ in range(2):
                    backward(net)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            assert largest_difference(list(nets[0].parameters()), list(nets[1].parameters())) < TOLERANCE
        finally:
            optimizer.close()


JOB = textwrap.dedent("""
    import json, os, socket, sys, warnings
    import torch, torch.distributed as dist
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from cossd.trainer import AdamW
    mount, case = sys.argv[1], sys.argv[2]
    X = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
    def net(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    out = {}
    if case == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        for orig in (False, True):
            m = FSDP(net(0), device_id=torch.device("cpu"), use_orig_params=orig)
            try:
                AdamW(m.parameters(), lr=1e-2, mount=mount, namespace=f"fsdp1{int(orig)}").close()
                out[str(orig)] = "accepted"
            except ValueError as exc:
                out[str(orig)] = str(exc)
    else:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             set_model_state_dict)
        pre = net(7).state_dict()
        full = StateDictOptions(full_state_dict=True)
        results = []
        for kind in ("torch", "cossd"):
            m = net(0)
            fully_shard(m)
            if kind == "torch":
                opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
            else:
                opt = AdamW(m.parameters(), lr=1e-2, mount=mount, namespace="fsdp2", grad_dtype="fp32")
            set_model_state_dict(m, {k: v.clone() for k, v in pre.items()}, options=full)
            for _ in range(3):
                (m(X) ** 2).mean().backward(); opt.step(); opt.zero_grad(set_to_none=True)
            sd = get_model_state_dict(m, options=full)
            results.append({k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()})
            if kind == "cossd":
                opt.close()
        out["difference"] = max(float((results[0][k] - results[1][k]).abs().max()) for k in results[0])
        out["moved"] = max(float((results[0][k] - pre[k]).abs().max()) for k in pre)
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out))
""")


def run_job(mount: Mount, tmp_path: Path, case: str) -> dict[str, Any]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    done = subprocess.run([sys.executable, str(script), str(mount.mountpoint), case], capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_fsdp1_is_refused_naming_fsdp2(mount: Mount, tmp_path: Path) -> None:
    """FullyShardedDataParallel's FlatParameter shards (and its use_orig_params=True views)
    would be stepped as plain replicated tensors: refused at construction, naming FSDP2."""
    result = run_job(mount, tmp_path, "fsdp1")
    for orig in ("False", "True"):
        assert "FSDP1" in result[orig] and "fully_shard" in result[orig], result


def test_fsdp2_weights_loaded_after_the_optimizer_are_trained_from(mount: Mount, tmp_path: Path) -> None:
    """FSDP2 on a mesh of one, DCP's set_model_state_dict after the optimizer (torchtitan's
    initial load of a model only): trained from the loaded weights, as torch's AdamW."""
    result = run_job(mount, tmp_path, "fsdp2")
    assert result["moved"] > 1e-3 and result["difference"] < TOLERANCE, result
