"""The tiered checkpointer's restore: the newest complete version from the memory pool, the spill dir or the store, checked, then loaded."""
from __future__ import annotations

import warnings
from typing import Any

import torch

from . import payload as tier_payload
from .state import TierState
from .store import CorruptVersionError, ObjectStore, StoreError

MEMORY, SPILL, STORE = "memory", "spill", "store"


class RestoreError(RuntimeError):
    """No complete version could be restored; the message lists what was tried and why it failed."""


def restore(state: TierState, store: ObjectStore, listed: list[dict[str, Any]], model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, version: int | None) -> dict[str, Any]:
    """Load `version` (None: the newest of `listed`, the checkpointer's versions()) into
    `model` and `optimizer`; {"step", "tier", "skipped"}. A copy that fails its checks is
    skipped with a warning: the next tier, then (for version=None) older versions."""
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise TypeError(f"version must be an int or None, got {version!r}")
    in_store = {row["step"] for row in listed if STORE in row["tiers"]}
    if version is not None:
        if version not in {row["step"] for row in listed}:
            raise RestoreError(f"no complete version {version}; complete versions: "
                               f"{[row['step'] for row in listed] or 'none'}")
        steps = [version]
    else:
        steps = sorted((row["step"] for row in listed), reverse=True)
    failures: list[str] = []
    for step in steps:
        failed_before = len(failures)
        # Each tier is looked at when its turn comes: a version may move down meanwhile.
        for tier in (MEMORY, SPILL, STORE):
            try:
                loaded = _read(state, store, step, tier, in_store)
            except (CorruptVersionError, tier_payload.PayloadError, StoreError, OSError) as exc:
                failures.append(f"version {step} from the {tier} tier: {exc}")
                warnings.warn(f"TieredCheckpointer: restore skips {failures[-1]}", RuntimeWarning, stacklevel=3)
                continue
            if loaded is None:
                continue
            check_fits(model, optimizer, loaded)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(loaded["optimizer"])
            return {"step": step, "tier": tier, "skipped": failures}
        if len(failures) == failed_before:
            # Listed complete, and in no tier now (not even the store, asked again): dropped
            # meanwhile. Never passed over in silence for an older version.
            failures.append(f"version {step}: complete when listed, and in no tier now (dropped meanwhile)")
            warnings.warn(f"TieredCheckpointer: restore skips {failures[-1]}", RuntimeWarning, stacklevel=3)
    raise RestoreError("no complete version could be restored" +
                       (": " + "; ".join(failures) if failures else ": there is none"))


def _read(state: TierState, store: ObjectStore, step: int, tier: str, in_store: set[int]) -> dict[str, Any] | None:
    """Version `step` from `tier`, checked whole; None where that tier has no copy of it."""
    with state.cv:
        version = state.versions.get(step)
        if version is not None and version.dropped:
            version = None
        if tier == MEMORY:
            if version is None or version.buffer is None:
                return None
            # Copied out under the lock: the buffer stays the pool's.
            got, loaded = tier_payload.read(version.buffer, copy=True)
        record = version.spill if version is not None else None
        archived = version is not None and version.archived
    if tier == SPILL:
        if record is None or state.spill is None:
            return None
        try:
            data = state.spill.read_version(step, record, bytearray(record["payload_bytes"]))
        except FileNotFoundError:
            return None  # uploaded and removed meanwhile: the store tier, next, asks the store again
    elif tier == STORE:
        if step not in in_store and not archived:
            # Not in the store when the versions were listed, and no local tier had it just
            # now: its upload may have ended meanwhile (which removes the local copies and
            # forgets the version), so the store is listed again rather than passed over.
            if step not in store.complete_steps():
                return None
            in_store.add(step)
        _, data = store.read_version(step)
    if tier != MEMORY:
        # Copied out too: an optimizer keeps the tensors it is loaded with (same dtype and
        # device), and views would keep the whole version's buffer alive with them.
        got, loaded = tier_payload.read(torch.frombuffer(data, dtype=torch.uint8), copy=True)
        del data
    if got != step:
        raise CorruptVersionError(f"version {step} holds step {got}")
    return loaded


def check_fits(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """ValueError, before anything is loaded, where the version was not saved from a model and
    optimizer of this form (names, shapes, dtypes, class, param groups)."""
    own = model.state_dict()
    saved = loaded.get("model", {})
    problems = [f"{name}: missing" for name in own if name not in saved]
    problems += [f"{name}: not in the model" for name in saved if name not in own]
    problems += [f"{name}: {tuple(saved[name].shape)} {saved[name].dtype} saved, {tuple(t.shape)} {t.dtype} here"
                 for name, t in own.items() if isinstance(saved.get(name), torch.Tensor)
                 and (saved[name].shape != t.shape or saved[name].dtype != t.dtype)]
    if loaded.get("optimizer_class") != type(optimizer).__qualname__:
        problems.append(f"optimizer {loaded.get('optimizer_class')} saved, {type(optimizer).__qualname__} here")
    groups = loaded.get("optimizer", {}).get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        problems.append("the optimizer's param groups differ in number or size")
    if problems:
        raise ValueError("this version does not fit the model and optimizer (nothing was loaded): " +
                         "; ".join(problems[:8]))
