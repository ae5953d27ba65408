"""load_state_dict sees every edit of a handed-out state dict (by content, not torch's _version) and refuses bad state with a ValueError, changing nothing."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from cossd.trainer import AdamW

from conftest import Mount

pytestmark = pytest.mark.mount


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16)).to(torch.bfloat16)


def train(model: torch.nn.Module, optimizer: AdamW, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=generator).to(torch.bfloat16)
        optimizer.zero_grad()
        F.mse_loss(model(x).float(), torch.zeros(8, 16)).backward()
        optimizer.step()


def device_bits(optimizer: AdamW) -> list[torch.Tensor]:
    """What the device holds (masters and both moments) and the params, as exact bits."""
    state = optimizer.state_dict()
    tensors = [t for entry in state["state"].values() for t in (entry["exp_avg"], entry["exp_avg_sq"])]
    tensors += list(state["cossd_master"].values()) + [e.param.detach().clone() for e in optimizer.entries]
    return [t.reshape(-1).view(torch.uint8).clone() for t in tensors]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# Edits that torch's _version counter never sees: the old code took each dict for its own
# state and loaded nothing.
SILENT_EDITS: dict[str, Callable[[dict[str, Any]], torch.Tensor]] = {
    "numpy moment": lambda sd: _zero_numpy(sd["state"][0]["exp_avg"]),
    "data moment": lambda sd: sd["state"][2]["exp_avg_sq"].data.zero_(),
    "numpy master": lambda sd: _zero_numpy(sd["cossd_master"][1]),
}


def _zero_numpy(tensor: torch.Tensor) -> torch.Tensor:
    tensor.numpy()[...] = 0
    return tensor


@pytest.mark.parametrize("edit", list(SILENT_EDITS))
def test_an_edit_that_torch_does_not_count_is_loaded(mount: Mount, edit: str) -> None:
    model = make_model()
    optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace="silent", lr=1e-3)
    try:
        train(model, optimizer, range(1, 4))
        state = optimizer.state_dict()
        edited = SILENT_EDITS[edit](state)
        version = edited._version
        nsid = optimizer.files.nsid
        optimizer.load_state_dict(state)
        assert edited._version == version  # the edit really was invisible to _version
        assert optimizer.files.nsid != nsid, "the edited dict was taken for the device's own state"
        after = optimizer.state_dict()
        loaded = {"numpy moment": after["state"][0]["exp_avg"], "data moment": after["state"][2]["exp_avg_sq"],
                  "numpy master": after["cossd_master"][1]}[edit]
        assert torch.equal(loaded, torch.zeros_like(loaded))
        assert optimizer.committed_step == 3
    finally:
        optimizer.close()


def test_the_dict_handed_back_unchanged_is_still_a_no_op(mount: Mount) -> None:
    model = make_model()
    optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace="own", lr=1e-3)
    try:
        train(model, optimizer, range(1, 3))
        state = optimizer.state_dict()
        before = optimizer.files.statistics()
        optimizer.load_state_dict(state)
        after = optimizer.files.statistics()
        assert after["nsid"] == before["nsid"] and after["write_commands"] == before["write_commands"]
        # A dict with an entry dropped is not the one handed out: it is checked (and refused).
        del state["state"][1]
        with pytest.raises(ValueError, match="state for param 1"):
            optimizer.load_state_dict(state)
        assert optimizer.files.nsid == before["nsid"]
    finally:
        optimizer.close()


def _nan_moment(sd: dict[str, Any]) -> None:
    sd["state"][0]["exp_avg"].view(-1)[3] = float("nan")


def _inf_master(sd: dict[str, Any]) -> None:
    sd["cossd_master"][2].view(-1)[0] = float("inf")


def _negative_square(sd: dict[str, Any]) -> None:
    sd["state"][1]["exp_avg_sq"][0] = -1.0


def _bad_index(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["params"][-1] = 7


def _master_missing(sd: dict[str, Any]) -> None:
    del sd["cossd_master"][2]


def _stray_state(sd: dict[str, Any]) -> None:
    sd["state"][9] = sd["state"][0]


def _negative_step(sd: dict[str, Any]) -> None:
    for entry in sd["state"].values():
        entry["step"] = torch.tensor(-2.0)


def _fractional_step(sd: dict[str, Any]) -> None:
    for entry in sd["state"].values():
        entry["step"] = torch.tensor(2.5)


def _no_step(sd: dict[str, Any]) -> None:
    del sd["state"][0]["step"]


def _no_moment(sd: dict[str, Any]) -> None:
    del sd["state"][3]["exp_avg"]


def _no_state_key(sd: dict[str, Any]) -> None:
    del sd["state"]


BAD_STATE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "NaN moment": (_nan_moment, r"exp_avg for param 0 \(.*\) holds 1 non-finite"),
    "inf master": (_inf_master, r"master weights of .* holds 1 non-finite"),
    "negative exp_avg_sq": (_negative_square, r"exp_avg_sq for param 1 .* negative"),
    "bad param index": (_bad_index, r"state holds param index\(es\) \[3\] that no param group lists"),
    "master index missing": (_master_missing, r"cossd_master has no master weights for param index\(es\) \[2\]"),
    "stray state index": (_stray_state, r"param index\(es\) \[9\] that no param group lists"),
    "negative step": (_negative_step, r"step -2.0: a step is a whole number >= 0"),
    "fractional step": (_fractional_step, r"step 2.5"),
    "no step": (_no_step, r"state for param 0 has no 'step'"),
    "no exp_avg": (_no_moment, r"state for param 3 .* has no exp_avg tensor"),
    "no state": (_no_state_key, r"a dict 'state' and a list 'param_groups'"),
}


@pytest.mark.parametrize("case", list(BAD_STATE))
def test_bad_state_is_a_value_error_and_changes_nothing(mount: Mount, case: str) -> None:
    model = make_model()
    optimizer = AdamW(model.parameters(), mount=mount.mountpoint, namespace="bad", lr=1e-3)
    try:
        train(model, optimizer, range(1, 3))
        before, nsid = device_bits(optimizer), optimizer.files.nsid
        state = optimizer.state_dict()
        edit, message = BAD_STATE[case]
        edit(state)
        with pytest.raises(ValueError, match=message):
            optimizer.load_state_dict(state)
        assert optimizer.files.nsid == nsid and optimizer.committed_step == 2
        assert same(device_bits(optimizer), before)
        train(model, optimizer, range(3, 4))  # the run goes on
        assert optimizer.committed_step == 3
    finally:
        optimizer.close()
