"""One trainer of the OOM bench (harness/bench/oom.py), checkpointing every step: DCP async_save, the tiered checkpointer, or cossd offload.

Run as `python -m cossd.harness.oom.worker CONFIG_JSON`. It speaks JSON lines on stdout and
waits for a line on stdin three times: before anything is allocated (the bench puts it into
its cgroups then, so every page it touches is charged there), after a first warm-up step (the
bench resets the group's peak), and after a second one, training alone (the bench takes that
step's peak as the trainer's own footprint and sets the memory cap above it).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def _wait_for_go() -> None:
    if sys.stdin.readline().strip() != "go":
        sys.exit(3)  # the bench went away before the run began


def main(config: dict[str, Any]) -> int:
    _wait_for_go()  # in its cgroups from here on: torch's own pages are charged there too
    import torch

    from ..checkpointing import pin_malloc_to_mmap
    from ..gpt import GPT, GPTConfig, StdlibCorpus, parameter_count

    # As the project's other host-memory figures: freed large buffers go back to the system,
    # so the group's memory is live data, not glibc's arenas holding what threads freed.
    pin_malloc_to_mmap()
    torch.set_num_threads(int(config.get("threads", 1)))
    model_config = GPTConfig(**config["model"])
    torch.manual_seed(config.get("seed", 0))
    model = GPT(model_config)
    corpus = StdlibCorpus(max_bytes=1 << 20)  # a step's batch is tiny: no need for the default 8 MiB
    method = config["method"]
    checkpoint, optimizer, finish = _method(method, config, model)
    if method == "cossd":
        model.to(torch.bfloat16)  # the device keeps the FP32 masters: the model itself is half precision

    def train(step: int) -> float:
        started = time.perf_counter()
        tokens, targets = corpus.batch(step, config["batch"], model_config.context, config.get("seed", 0))
        model.loss(tokens, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the grads allocated: the footprint is steady from step 0
        return time.perf_counter() - started

    train(0)  # warm-up, not checkpointed: grads and optimizer state exist once it is done
    _emit("warm")
    _wait_for_go()  # the bench takes the group's peak from here: one step of training alone
    train(0)
    state_bytes = (sum(t.numel() * t.element_size() for t in model.state_dict().values())
                   + sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                         if torch.is_tensor(v))) if method != "cossd" else 0
    _emit("ready", parameters=parameter_count(model), state_bytes=state_bytes)
    _wait_for_go()  # the cap is set now
    for step in range(1, config["steps"] + 1):
        step_s = train(step)
        stall_s = checkpoint(step)
        _emit("step", step=step, step_s=step_s, stall_s=stall_s)
    _emit("done", **finish())
    return 0


def _method(method: str, config: dict[str, Any], model: Any) -> tuple[Callable[[int], float], Any,
                                                                       Callable[[], dict[str, Any]]]:
    """(checkpoint(step) -> the stall it caused, the optimizer, finish() -> what it wrote)."""
    import torch

    if method == "cossd":
        from ...trainer import AdamW

        optimizer = AdamW(model.parameters(), lr=1e-4, mount=config["mount"], namespace=config["namespace"],
                          dtype=torch.bfloat16)
        before = optimizer.files.statistics()

        def cossd_checkpoint(step: int) -> float:
            # The step committed on the device is the checkpoint: what the trainer waited
            # for beyond the update itself is the begin and commit commands.
            timing = optimizer.last_timing
            return float(timing.get("begin_s", 0.0) + timing.get("commit_s", 0.0))

        def cossd_finish() -> dict[str, Any]:
            stats = optimizer.files.statistics()
            optimizer.close()
            return {"host_link_bytes": stats["grad_bytes_in"] - before["grad_bytes_in"]
                    + stats["bytes_read"] - before["bytes_read"],
                    "steps_committed": stats["steps_committed"] - before["steps_committed"]}

        return cossd_checkpoint, optimizer, cossd_finish
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if method == "dcp":
        return _dcp(config, model, optimizer)
    if method == "tiered":
        return _tiered(config, model, optimizer)
    raise ValueError(f"unknown method {method!r}")


def _dcp(config: dict[str, Any], model: Any, optimizer: Any) -> tuple[Callable[[int], float], Any,
                                                                       Callable[[], dict[str, Any]]]:
    import warnings

    import torch.distributed.checkpoint as dcp

    # DCP notes on every call, and from its writer threads, that it runs in one process.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    sink = Path(config["sink"])
    pending: list[tuple[int, Any]] = []
    completed: list[int] = []

    def dcp_checkpoint(step: int) -> float:
        # As a user who wants no stall would: a save per step, never waiting for the last one.
        # Each call stages a full copy of the state and writes it on a thread of its own.
        started = time.perf_counter()
        future = dcp.async_save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                                checkpoint_id=str(sink / f"step-{step}"))
        stall = time.perf_counter() - started
        pending.append((step, future))
        for entry in [entry for entry in pending if entry[1].done()]:
            entry[1].result()  # a failed save fails the run: it is never counted as written
            completed.append(entry[0])
            pending.remove(entry)
        return stall

    def dcp_finish() -> dict[str, Any]:
        for step, future in pending:
            future.result()
            completed.append(step)
        return {"saves_completed": len(completed)}

    return dcp_checkpoint, optimizer, dcp_finish


def _tiered(config: dict[str, Any], model: Any, optimizer: Any) -> tuple[Callable[[int], float], Any,
                                                                          Callable[[], dict[str, Any]]]:
    from ...trainer import TieredCheckpointer

    options = config["tiered"]
    checkpointer = TieredCheckpointer(config["store_url"], endpoint_url=config["endpoint"],
                                      memory_bytes=options["memory_bytes"], spill_dir=config["sink"],
                                      spill_bytes=options["spill_bytes"], chunk_bytes=options["chunk_bytes"],
                                      max_concurrency=options["max_concurrency"],
                                      initial_concurrency=min(2, options["max_concurrency"]),
                                      max_stall_s=options["max_stall_s"])

    version_bytes = [0]

    def tiered_checkpoint(step: int) -> float:
        started = time.perf_counter()
        version_bytes[0] = checkpointer.save(model, optimizer, step)["bytes"]
        return time.perf_counter() - started

    def tiered_finish() -> dict[str, Any]:
        report = checkpointer.close(drain=True, timeout_s=options["drain_s"])
        return {"statement": report["statement"], "stats": _plain(report["stats"]), "version_bytes": version_bytes[0]}

    return tiered_checkpoint, optimizer, tiered_finish


def _plain(value: Any) -> Any:
    """The checkpointer's stats as JSON can carry them."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(json.loads(sys.argv[1])))
