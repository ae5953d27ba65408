"""torchtitan's llama3 debug model with cossd's AdamW, sized for a 2-core CPU (tests/e2e/test_torchtitan.py); run in the torchtitan virtualenv.

As a torchtitan config module: `--module titan_config --config tiny_llama` (this folder on
PYTHONPATH), reading TITAN_ASSETS (what `assets` wrote), TITAN_STEPS and, for the kill
tests, TITAN_KILL_AFTER (every rank SIGKILLs itself after that many optimizer steps of its
process), TITAN_KILL_RANK with TITAN_KILL_STEP and TITAN_KILL_NOTE (that rank SIGKILLs
itself in that device step, one gradient piece of its partition sent) or TITAN_STALL_AFTER
with TITAN_STALL_DIR (every rank stops there, for the test to kill the device daemon); TITAN_OPTIMIZER=torch steps torchtitan's own AdamW instead (the
checkpoint figures' stock run). As a script: `python titan_config.py assets DIR` writes a byte-level BPE
tokenizer and a synthetic text data set (nothing is downloaded); `python titan_config.py
losses DUMP_FOLDER` prints, as JSON, each step's loss from torchtitan's TensorBoard events.
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

WORDS = ("the drive runs adam on its own media and every step is a checkpoint while the host sends "
         "gradients and reads params back after a crash the job resumes from the snapshot").split()


def tiny_llama() -> Any:
    """llama3_debugmodel (dim 256, 6 layers, vocab 2048) with cossd's AdamW, adapted to CPU
    and gloo, on sequences of 64 tokens, batches of 2, checkpoints every 3 steps."""
    from cossd.trainer.torchtitan import llama3_debugmodel_cossd
    from cossd.integrations.torchtitan_cpu import for_cpu

    assets = Path(os.environ["TITAN_ASSETS"])
    config = for_cpu(llama3_debugmodel_cossd())
    config.hf_assets_path = str(assets / "tokenizer")
    config.dataloader.dataset_path = str(assets / "data")
    config.training.seq_len = 64
    config.training.local_batch_size = 2
    config.training.steps = int(os.environ.get("TITAN_STEPS", "7"))
    config.validator.enable = False
    config.checkpoint.enable = True
    config.checkpoint.interval = 3
    config.metrics.enable_tensorboard = True
    config.debug.seed = 0
    if os.environ.get("TITAN_OPTIMIZER") == "torch":
        # The same group stepped by torchtitan's own AdamW (the container steps any other
        # optimizer_name as torchtitan does): the stock run of the checkpoint figures.
        for group in config.optimizer.param_groups:
            group.optimizer_name = "AdamW"
    kill_after = os.environ.get("TITAN_KILL_AFTER")
    if kill_after:
        config.model_spec.post_optimizer_build_fn = _killer(int(kill_after), config.model_spec.post_optimizer_build_fn)
    kill_rank = os.environ.get("TITAN_KILL_RANK")
    if kill_rank is not None and kill_rank == os.environ.get("RANK", "0"):
        config.model_spec.post_optimizer_build_fn = _partition_killer(int(os.environ["TITAN_KILL_STEP"]),
                                                                      Path(os.environ["TITAN_KILL_NOTE"]),
                                                                      config.model_spec.post_optimizer_build_fn)
    stall_after = os.environ.get("TITAN_STALL_AFTER")
    if stall_after:
        config.model_spec.post_optimizer_build_fn = _staller(int(stall_after), Path(os.environ["TITAN_STALL_DIR"]),
                                                             config.model_spec.post_optimizer_build_fn)
    return config


def _staller(steps: int, marks: Path, then: Any) -> Any:
    """After `steps` optimizer steps each rank writes marks/stalled<RANK> and sleeps: the
    test kills the device daemon, then the job (the daemon-kill test)."""
    def register(optimizers: Any, model_parts: Any, parallel_dims: Any) -> None:
        if then is not None:
            then(optimizers, model_parts, parallel_dims)
        taken = [0]

        def after_step(*_: Any) -> None:
            taken[0] += 1
            if taken[0] == steps:
                import time

                # The pid: torchrun starts each rank in a session of its own, so the test kills them by it.
                (marks / f"stalled{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
                time.sleep(3600)

        optimizers.register_step_post_hook(after_step)

    return register


def _killer(steps: int, then: Any) -> Any:
    def register(optimizers: Any, model_parts: Any, parallel_dims: Any) -> None:
        if then is not None:
            then(optimizers, model_parts, parallel_dims)
        taken = [0]

        def after_step(*_: Any) -> None:
            taken[0] += 1
            if taken[0] == steps:
                os.kill(os.getpid(), signal.SIGKILL)  # the device has committed that step; no save since

        optimizers.register_step_post_hook(after_step)

    return register


def _partition_killer(step: int, note: Path, then: Any) -> Any:
    """This rank SIGKILLs itself in device step `step`, once the first of its gradient pieces
    is on the device and before the rest of its partition and the commit (the FSDP2 shard
    it sends; `note` gets the committed step first, for the test)."""
    def register(optimizers: Any, model_parts: Any, parallel_dims: Any) -> None:
        from cossd.trainer import AdamW

        if then is not None:
            then(optimizers, model_parts, parallel_dims)
        for optimizer in optimizers.optimizers:
            if not isinstance(optimizer, AdamW):
                continue
            write = optimizer.files.write_pieces

            def partial(items: list[Any], role: str = "grad", optimizer: Any = optimizer, write: Any = write) -> int:
                if role == "grad" and optimizer.committed_step + 1 == step and len(items) > 1:
                    write(items[:1], role)  # it returns once the device holds the piece
                    note.write_text(json.dumps({"committed_step": optimizer.committed_step,
                                                "pieces": len(items), "sent": 1}))
                    os.kill(os.getpid(), signal.SIGKILL)
                return write(items, role)

            optimizer.files.write_pieces = partial

    return register


def write_assets(root: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + "." for _ in range(400)]
    (root / "data").mkdir(parents=True, exist_ok=True)
    with open(root / "data" / "data.json", "w") as out:
        for text in texts:
            out.write(json.dumps({"text": text}) + "\n")
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": specials[0], "eos_token": specials[1]}))


def read_losses(dump: Path) -> dict[int, float]:
    """Every step's global_avg_loss that torchtitan wrote to TensorBoard under `dump` (all runs
    into it; a step logged twice keeps the later run's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses: dict[int, float] = {}
    for events in sorted(dump.rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        if "loss_metrics/global_avg_loss" in accumulator.Tags().get("scalars", []):
            for event in accumulator.Scalars("loss_metrics/global_avg_loss"):
                losses[event.step] = event.value
    return losses


if __name__ == "__main__":
    if sys.argv[1] == "assets":
        write_assets(Path(sys.argv[2]))
    elif sys.argv[1] == "losses":
        print(json.dumps(read_losses(Path(sys.argv[2]))))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}: assets DIR | losses DUMP_FOLDER")
