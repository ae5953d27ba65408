"""`cossd export` writes each tensor in the shape the model holds it, recorded on the device at
the namespace's creation, so a model loads the file with no reshaping; namespaces created
without shapes (an older cossd, create-ns --tensor NAME:NUMEL) still open and export flat,
with a note."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F

from conftest import Mount, start_mount, stop_mount
from cossd.client import AdminClient
from cossd.client import snapshots as snapshot_calls
from cossd.protocol.status import DeviceError, Status
from cossd.trainer import AdamW
from helpers import create_namespace, pwrite_all, run_cli, tensor_dir

pytestmark = pytest.mark.mount

# The creation payload's keys before shapes existed: a namespace without shapes is stored
# with exactly these, so an older build still opens it.
KEYS_BEFORE_SHAPES = {"name", "tensors", "hyperparameters", "groups", "initial_step", "grad_dtype",
                      "param_dtype", "state_dtype"}


class Tiny(torch.nn.Module):
    """Parameters of every rank a model has: 2-D weights, 1-D biases and norms, a 0-d scale."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 12)
        self.norm = torch.nn.LayerNorm(12)
        self.head = torch.nn.Linear(12, 16, bias=False)
        self.scale = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.embed(tokens)))) * self.scale


def train_tiny(mp: Path, namespace: str, steps: int) -> Tiny:
    torch.manual_seed(0)
    model = Tiny()
    optimizer = AdamW(model.named_parameters(), lr=1e-2, mount=mp, namespace=namespace)
    model.to(torch.bfloat16)
    for step in range(steps):
        tokens = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step))
        logits = model(tokens).float()
        F.cross_entropy(logits.view(-1, 16), tokens.view(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    optimizer.close()
    return model


def export_file(capsys: pytest.CaptureFixture[str], mp: Path, namespace: str, path: Path,
                *options: str) -> str:
    """`cossd export` to `path`; its stderr (the progress bar, and the note where one is due)."""
    code, _, err = run_cli(capsys, "export", mp, namespace, "--path", path, *options)
    assert code == 0, err
    return err


def test_a_model_trained_through_cossd_loads_its_export_with_no_reshaping(
        mount: Mount, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    trained = train_tiny(mp, "tiny", steps=3)
    config = json.loads((mp / "ns/tiny/config.json").read_text())
    assert {t["name"]: t["shape"] for t in config["tensors"]} == {
        "embed.weight": [16, 8], "proj.weight": [12, 8], "proj.bias": [12], "norm.weight": [12],
        "norm.bias": [12], "head.weight": [16, 12], "scale": []}

    err = export_file(capsys, mp, "tiny", tmp_path / "tiny.safetensors", "--with-state")
    assert "note" not in err  # every tensor has its shape: nothing to warn about
    loaded = safetensors.torch.load_file(tmp_path / "tiny.safetensors")
    fresh = Tiny().to(torch.bfloat16)
    params = {name: values for name, values in loaded.items()
              if not name.endswith((".master", ".exp_avg", ".exp_avg_sq"))}
    fresh.load_state_dict(params)  # strict: every key, every shape
    for name, values in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], values), name
    # The optimizer state has its param's shape too.
    assert loaded["proj.weight.exp_avg"].shape == (12, 8) and loaded["scale.master"].shape == ()
    with safetensors.safe_open(tmp_path / "tiny.safetensors", "pt") as opened:
        assert opened.metadata()["cossd.shapes"] == "recorded"


def test_shapes_survive_a_remount_and_a_clone(mount: Mount, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    code, _, err = run_cli(capsys, "create-ns", mp, "cli", "--tensor", "w:4x3x2", "--tensor", "b:24")
    assert code == 0, err
    meta = json.loads((mount.backing / "ns/cli/meta.json").read_text())
    assert meta["spec"]["shapes"] == {"w": [4, 3, 2]}  # on media; b has none
    pwrite_all(tensor_dir(mp, "cli", "w") / "grad", torch.ones(24, dtype=torch.float16).numpy().tobytes())
    pwrite_all(tensor_dir(mp, "cli", "b") / "grad", torch.ones(24, dtype=torch.float16).numpy().tobytes())
    with AdminClient(mp) as admin:
        snapshot_calls.create_snapshot(admin, admin.nsid("cli"), "one")
        snapshot_calls.clone(admin, admin.nsid("cli"), "one", "copy")
    stop_mount(mount)
    remounted = start_mount(mount.backing, mount.mountpoint)
    try:
        for name in ("cli", "copy"):
            config = json.loads((mp / f"ns/{name}/config.json").read_text())
            assert [t["shape"] for t in config["tensors"]] == [[4, 3, 2], None], name
        err = export_file(capsys, mp, "copy", tmp_path / "copy.safetensors")
        assert "1 of its 2 tensors have no recorded shape" in err
        with safetensors.safe_open(tmp_path / "copy.safetensors", "pt") as opened:
            assert opened.get_slice("w").get_shape() == [4, 3, 2]
            assert opened.get_slice("b").get_shape() == [24]
            assert opened.metadata()["cossd.shapes"] == "partial"
    finally:
        stop_mount(remounted)


def test_a_namespace_without_shapes_is_stored_as_before_and_exports_flat_with_a_note(
        mount: Mount, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The creation payload of an older client (no "shapes"): the same meta.json as before
    shapes existed, config.json says null, the export is 1-D, and the CLI and the daemon's
    log both say why."""
    mp = mount.mountpoint
    create_namespace(mp, "old", [("w", 12)])
    meta = json.loads((mount.backing / "ns/old/meta.json").read_text())
    assert set(meta["spec"]) == KEYS_BEFORE_SHAPES
    pwrite_all(tensor_dir(mp, "old", "w") / "grad", torch.ones(12, dtype=torch.float16).numpy().tobytes())
    config = json.loads((mp / "ns/old/config.json").read_text())
    assert config["tensors"][0]["shape"] is None
    err = export_file(capsys, mp, "old", tmp_path / "old.safetensors")
    assert "its tensors have no recorded shape" in err and "reshape" in err
    with safetensors.safe_open(tmp_path / "old.safetensors", "pt") as opened:
        assert opened.get_slice("w").get_shape() == [12]
        assert opened.metadata()["cossd.shapes"] == "flat"
    code, out, _ = run_cli(capsys, "export", mp, "old", "--path", tmp_path / "old2.safetensors", "-q",
                           "-o", "json")
    assert code == 0 and "no recorded shape" in json.loads(out)["note"]
    logged = [line for line in (mount.backing / "daemon.log").read_text().splitlines()
              if "no recorded shape" in line]
    assert len(logged) == 2 and "'old'" in logged[0], logged


@pytest.mark.parametrize("shapes,why", [
    ({"w": [5, 2]}, "holds 10 elements, not its 12"),
    ({"w": [0, 12]}, "positive integers"),
    ({"x": [12]}, "not among the namespace's tensors"),
    ({"w": "3x4"}, "must be a list"),
])
def test_a_bad_shape_is_refused_and_creates_nothing(mount: Mount, shapes: dict, why: str) -> None:
    with AdminClient(mount.mountpoint) as admin:
        with pytest.raises(DeviceError) as refused:
            admin.create_namespace({"name": "bad", "tensors": [["w", 12]], "shapes": shapes})
        assert refused.value.status == Status.INVALID_FIELD and why in refused.value.message
        assert [ns["name"] for ns in admin.describe()["namespaces"]] == []
    assert not (mount.backing / "ns/bad").exists()


def test_create_ns_reads_a_shape_or_an_element_count(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    code, _, err = run_cli(capsys, "create-ns", mp, "x", "--tensor", "w:3x0")
    assert code != 0 and "at least 1" in err
    code, _, err = run_cli(capsys, "create-ns", mp, "x", "--tensor", "w:3xa")
    assert code != 0 and "neither an element count nor a shape" in err
    assert not (mp / "ns/x").exists()
    code, _, err = run_cli(capsys, "create-ns", mp, "x", "--tensor", "w:768x3072", "--tensor", "b:3072")
    assert code == 0, err
    config = json.loads((mp / "ns/x/config.json").read_text())
    assert [(t["numel"], t["shape"]) for t in config["tensors"]] == [(768 * 3072, [768, 3072]), (3072, None)]


def test_a_hugging_face_model_loads_the_export_with_from_pretrained(mount: Mount, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A GPT-2 trained through cossd: its export, as model.safetensors beside the config,
    is what transformers' from_pretrained loads (tied lm_head included)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = AdamW(model.named_parameters(), lr=1e-2, mount=mount.mountpoint, namespace="gpt2")
    model.to(torch.bfloat16)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    optimizer.close()
    saved = tmp_path / "gpt2"
    saved.mkdir()
    config.save_pretrained(saved)
    export_file(capsys, mount.mountpoint, "gpt2", saved / "model.safetensors")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(saved, dtype=torch.bfloat16)
    expected = dict(model.named_parameters())
    got = dict(loaded.named_parameters())
    assert got.keys() == expected.keys()
    for name, values in expected.items():
        assert torch.equal(got[name], values), name
    assert torch.equal(loaded.lm_head.weight, model.transformer.wte.weight)
