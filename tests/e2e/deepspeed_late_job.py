"""One rank of a DeepSpeed ZeRO job whose cossd AdamW is made before deepspeed is imported (the import order a script may have); tests/e2e/test_deepspeed_late_import.py runs it."""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cossd.trainer import AdamW

MICRO_BATCH, LR = 8, 1e-2


def groups_held_by_deepspeed() -> list[str]:
    """DeepSpeed's TorchBackend methods whose default arguments hold a process group: one
    captured there at `import deepspeed` outlives destroy_process_group and the interpreter,
    and its gloo threads still run while exit() tears the C++ runtime down."""
    import inspect

    from deepspeed.comm.torch import TorchBackend

    return [name for name, attribute in vars(TorchBackend).items() if callable(attribute)
            and any(isinstance(value, dist.ProcessGroup)
                    for value in getattr(inspect.unwrap(attribute), "__defaults__", None) or ())]


def main() -> int:
    config = json.loads(sys.argv[-1])
    rank = int(os.environ["RANK"])
    os.environ.setdefault("LOCAL_RANK", str(rank))
    out = Path(config["out"])
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))
    dist.init_process_group("gloo")  # the process group first, as torchrun scripts often do
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if config.get("deepspeed_first"):  # the reference: the usual order
        import deepspeed
    # Else the optimizer before `import deepspeed`: the point of this job.
    assert config.get("deepspeed_first") or "deepspeed" not in sys.modules
    optimizer = AdamW(model.parameters(), lr=LR, mount=config["mount"], namespace=config["namespace"])
    import deepspeed

    ds_config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": config["stage"]}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 10**9, "bf16": {"enabled": True}}
    losses = {}
    first = 0
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        teacher = torch.randn(16, 16, generator=torch.Generator().manual_seed(7))
        first = optimizer.committed_step + 1
        for step in range(first, config["last"] + 1):
            x = torch.randn(MICRO_BATCH, 16, generator=torch.Generator().manual_seed(7919 * step + rank))
            loss = F.cross_entropy(engine(x.to(torch.bfloat16)).float(), (x @ teacher).argmax(dim=1))
            engine.backward(loss)
            engine.step()
            losses[step] = loss.item()
    except Exception as exc:
        (out / f"error{rank}.txt").write_text(f"{type(exc).__name__}: {exc}")
        # A process group whose gloo threads still run when the interpreter exits can abort it
        # ("terminate called without an active exception", exit -6 instead of 4).
        dist.destroy_process_group()
        (out / f"held{rank}.txt").write_text("\n".join(groups_held_by_deepspeed()))
        return 4
    names = [(e.name, e.numel) for e in optimizer.entries]
    torch.save({"losses": losses, "first": first, "committed_step": optimizer.committed_step, "names": names,
                "params": [p.detach().clone() for p in model.parameters()] if config["stage"] != 3 else []},
               out / f"rank{rank}.pt")
    optimizer.close()
    dist.barrier()
    dist.destroy_process_group()
    (out / f"held{rank}.txt").write_text("\n".join(groups_held_by_deepspeed()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
