"""The checkpoint figures of the plain torch loop and HF's Trainer, torch.optim.AdamW against cossd's AdamW on a real mount (rows of harness/bench/frameworks.py's table in docs/trainer.md)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.nn.functional as F

from cossd.trainer import AdamW

from ranks import bits_equal, mounted_device

pytestmark = [pytest.mark.mount, pytest.mark.slow]

HIDDEN = 16384  # 16 -> HIDDEN -> 16: 540,688 params, the DeepSpeed rows' MLP
SAVE_AT = 3


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with mounted_device(tmp_path_factory.mktemp("figures"), "TESTSERIALFIG", capacity_bytes=1 << 30) as mounted:
        yield mounted


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 16))


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    teacher = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
    for step in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        F.cross_entropy(model(x), (x @ teacher).argmax(dim=1)).backward()
        optimizer.step()
        optimizer.zero_grad()


def figure(what: str, params: int, kind: str, written: int, save_s: float, restore_s: float,
           optim: int | None = None) -> str:
    """One line in harness/bench/frameworks.py's FIGURE form."""
    detail = f" (optimizer files {optim} B)" if optim is not None else ""
    return (f"{what} {params} params, {kind}: checkpoint {written} B{detail}, save {save_s:.2f} s, "
            f"restore {restore_s:.2f} s")


def test_plain_loop_checkpoint_against_torch_adamw(device: Any, tmp_path: Path, figures: list[str]) -> None:
    """A plain loop's checkpoint after step 3: torch.save of the model's and torch AdamW's
    state dicts, restored by torch.load and load_state_dict into a new model and optimizer;
    with cossd no checkpoint at all (every step is committed on the device), restored by
    making the optimizer again on the namespace (it reads the committed params into the
    model). Both restored runs then step on bit for bit as the ones that never stopped."""
    model = mlp()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, optimizer, range(1, SAVE_AT + 1))
    path = tmp_path / "checkpoint.pt"
    started = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    torch_save_s = time.perf_counter() - started
    started = time.perf_counter()
    restored_model = mlp()
    restored = torch.optim.AdamW(restored_model.parameters(), lr=1e-3)
    saved = torch.load(path)
    restored_model.load_state_dict(saved["model"])
    restored.load_state_dict(saved["optimizer"])
    torch_restore_s = time.perf_counter() - started
    train(model, optimizer, range(SAVE_AT + 1, SAVE_AT + 2))
    train(restored_model, restored, range(SAVE_AT + 1, SAVE_AT + 2))
    assert bits_equal(list(model.parameters()), list(restored_model.parameters()))
    figures.append(figure("plain torch loop, FP32, torch.save of model and optimizer", params, "torch",
                          path.stat().st_size, torch_save_s, torch_restore_s, optim=None))

    model = mlp()
    optimizer = AdamW(model.parameters(), lr=1e-3, mount=device.mountpoint, namespace="plain-figures")
    train(model, optimizer, range(1, SAVE_AT + 1))
    optimizer.close()  # the job ends (or dies) here: nothing is saved
    started = time.perf_counter()
    restored_model = mlp()
    restored = AdamW(restored_model.parameters(), lr=1e-3, mount=device.mountpoint, namespace="plain-figures")
    cossd_restore_s = time.perf_counter() - started
    assert restored.restored and restored.committed_step == SAVE_AT
    assert bits_equal(list(model.parameters()), list(restored_model.parameters()))
    restored.close()
    figures.append(figure("plain torch loop, FP32, no checkpoint (the restart reads the device's step)", params,
                          "cossd", 0, 0.0, cossd_restore_s))


def _gpt2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers", reason="HF Trainer tier: transformers is not installed")
    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=128, vocab_size=1024, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 1024, (32,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def _hf_run(device: Any, out: Path, kind: str, max_steps: int, resume: str | None = None) -> dict[str, Any]:
    """HF's Trainer with save_steps=3 (torch's AdamW, or cossd's through optimizers=), timing
    its own checkpoint save and its resume's loads (model, then optimizer and scheduler)."""
    import transformers

    timings: dict[str, float] = {"save_s": 0.0, "restore_s": 0.0}

    class Timed(transformers.Trainer):  # type: ignore[misc]
        def _save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return super()._save_checkpoint(*args, **kwargs)
            finally:
                timings["save_s"] += time.perf_counter() - started

        def _load_from_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return super()._load_from_checkpoint(*args, **kwargs)
            finally:
                timings["restore_s"] += time.perf_counter() - started

        def _load_optimizer_and_scheduler(self, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return super()._load_optimizer_and_scheduler(*args, **kwargs)
            finally:
                timings["restore_s"] += time.perf_counter() - started

    model = _gpt2()
    optimizers: tuple[Any, Any] = (None, None)
    optimizer = None
    if kind == "cossd":
        optimizer = AdamW(model.parameters(), mount=device.mountpoint, namespace="hf-figures", lr=3e-3,
                          weight_decay=0.1)
        optimizers = (optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, save_strategy="steps",
        save_steps=SAVE_AT, logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True, learning_rate=3e-3, weight_decay=0.1,
        lr_scheduler_type="constant", optim="adamw_torch")
    try:
        trainer = Timed(model=model, args=args, train_dataset=_Tokens(), optimizers=optimizers)
        trainer.train(resume_from_checkpoint=resume)
        return {"timings": timings, "params": sum(p.numel() for p in model.parameters())}
    finally:
        if optimizer is not None:
            optimizer.close()


def test_hf_trainer_checkpoint_against_torch_adamw(device: Any, tmp_path: Path, figures: list[str]) -> None:
    """HF's Trainer (a 2-layer GPT-2, FP32) saving checkpoint-3 by save_steps, with torch's
    AdamW and with cossd's, and a new Trainer resuming from it (resume_from_checkpoint)."""
    pytest.importorskip("transformers", reason="HF Trainer tier: transformers is not installed")
    for kind in ("torch", "cossd"):
        out = tmp_path / kind
        first = _hf_run(device, out, kind, max_steps=SAVE_AT + 1)
        checkpoint = out / f"checkpoint-{SAVE_AT}"
        files = [p for p in checkpoint.rglob("*") if p.is_file()]
        written = sum(p.stat().st_size for p in files)
        optim = sum(p.stat().st_size for p in files if p.name == "optimizer.pt")
        again = _hf_run(device, tmp_path / f"{kind}-again", kind, max_steps=SAVE_AT + 1, resume=str(checkpoint))
        assert again["timings"]["restore_s"] > 0
        figures.append(figure("HF Trainer, GPT-2 2 layers FP32, save_steps checkpoint", first["params"], kind,
                              written, first["timings"]["save_s"], again["timings"]["restore_s"], optim=optim))
