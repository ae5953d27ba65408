"""torch.distributed.checkpoint (DCP) and a cossd optimizer: get_state_dict hands out a reference to a device snapshot instead of the moments, set_state_dict rolls the namespace back to it."""
from __future__ import annotations

import collections
import json
import secrets
import sys
import types
import weakref
from typing import Any

import torch

from ...client import snapshots as snapshot_calls
from ...protocol.status import DeviceError, Status
from . import group as dcp_group
from ..plan import HYPER_FIELDS

# The optimizer these functions take is optim._DeviceAdam, not imported here (not even for
# type checking): optim imports state_dict, which imports this module.
_DeviceAdam = Any

# The per-param key of the reference form (on the first param only) and its fixed size: DCP
# loads into a template of the same shape, and a later job's template is made before it
# knows which snapshot the checkpoint names.
REF_KEY = "cossd_ref"
REF_BYTES = 512
# The snapshots a DCP save takes are tagged SNAPSHOT_PREFIX + "<step>-<random>".
SNAPSHOT_PREFIX = "dcp-"
_DCP_MODULE = "torch.distributed.checkpoint.state_dict"


def called_by_dcp(depth: int = 4) -> bool:
    """Whether one of the few callers above is DCP's state_dict module (get_state_dict,
    get_optimizer_state_dict, set_state_dict and the rest): those calls get the reference
    form, every other caller (accelerate, HF, a user's torch.save) torch's full format."""
    frame: types.FrameType | None = sys._getframe(2)  # the caller of the function that asks
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == _DCP_MODULE:
            return True
        frame = frame.f_back
    return False


class DeviceStateView(collections.defaultdict[torch.Tensor, Any]):
    """The optimizer's `state`: torch's defaultdict(dict), left empty (the state is on the
    device). To DCP's functions only, it reads as initialized (so _init_optim_state does not
    take a zero-gradient step on the device) and names each param's keys of the form that
    state_dict() gives DCP (what its unflattening of a flat dict looks up)."""

    def __init__(self, optimizer: Any, *args: Any) -> None:
        super().__init__(dict, *args)
        self._optimizer = weakref.ref(optimizer)

    def __bool__(self) -> bool:
        return len(self) > 0 or called_by_dcp()

    def __missing__(self, key: Any) -> Any:
        optimizer = self._optimizer()
        if optimizer is not None and called_by_dcp():
            names = state_names(optimizer, key)
            if names is not None:
                return dict.fromkeys(names)  # not stored: only its keys are read
        return super().__missing__(key)

    def __reduce__(self) -> Any:  # pickled (deepcopy) as the plain defaultdict it stands for
        return (collections.defaultdict, (dict, dict(self)))


def state_names(optimizer: _DeviceAdam, param: Any) -> tuple[str, ...] | None:
    """The keys of `param`'s state in the form state_dict() gives DCP (None: not this optimizer's)."""
    entries = optimizer.entries
    index = next((entry.index for entry in entries if entry.param is param), None)
    if index is None:
        return None
    if getattr(optimizer, "dcp_form", "reference") == "full":
        return ("step", "exp_avg", "exp_avg_sq")
    return ("step", REF_KEY) if index == entries[0].index else ("step",)


def _encode(reference: dict[str, Any]) -> torch.Tensor:
    data = json.dumps(reference, sort_keys=True).encode()
    if len(data) > REF_BYTES:
        raise ValueError(f"the DCP reference of namespace {reference['namespace']!r} takes {len(data)} bytes, "
                         f"more than {REF_BYTES}: use a shorter namespace name")
    out = torch.zeros(REF_BYTES, dtype=torch.uint8)
    out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _decode(tensor: Any) -> dict[str, Any]:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise ValueError(f"{REF_KEY} must be a 1-D uint8 tensor, got {type(tensor).__name__}")
    raw = bytes(tensor.cpu().numpy()).rstrip(b"\0")
    if not raw:
        raise ValueError(f"{REF_KEY} is empty: the dict is a template that DCP did not load a checkpoint into")
    try:
        reference = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{REF_KEY} does not hold a cossd reference ({exc})") from None
    if not isinstance(reference, dict) or reference.get("cossd") != 1:
        raise ValueError(f"{REF_KEY} does not hold a cossd reference (version 1)")
    return reference


def is_reference(state_dict: Any) -> bool:
    """Whether a state dict is the reference form (what get_state_dict gave DCP)."""
    state = state_dict.get("state") if isinstance(state_dict, dict) else None
    return isinstance(state, dict) and any(isinstance(s, dict) and REF_KEY in s for s in state.values())


def _refuse_group(optimizer: _DeviceAdam) -> None:
    if getattr(optimizer, "_bound", None):
        raise NotImplementedError(
            "DCP checkpoints by reference are not supported with a wrapper that moves the params "
            "(DeepSpeed) yet: set optimizer.dcp_form = 'full' to save the moments themselves")


def _group_members(optimizer: _DeviceAdam) -> list[Any] | None:
    """Each device's files where the optimizer spans several devices (mount=[...]), else None."""
    children = getattr(optimizer, "_group", None)
    return None if children is None else [child.files for child in children]


def _on_rank0(optimizer: _DeviceAdam, work: Any) -> Any:
    """`work()` on rank 0 of a sharded optimizer (or in the one process), its result (or its
    error, raised on every rank) on every rank."""
    ranks = getattr(optimizer, "_ranks", None)
    if ranks is None:
        return work()
    if ranks.rank == 0:
        try:
            result = work()
        except BaseException as exc:
            ranks.from_rank0({"error": f"{type(exc).__name__}: {exc}"})
            raise
        return ranks.from_rank0({"result": result})["result"]
    answer = ranks.from_rank0(None)
    if "error" in answer:
        raise RuntimeError(f"rank 0: {answer['error']}")
    return answer["result"]


def _snapshots(optimizer: _DeviceAdam) -> dict[str, dict[str, Any]]:
    files = optimizer.files
    listed = files.command(snapshot_calls.snapshots, files.admin, files.nsid)
    return {snapshot["tag"]: snapshot for snapshot in listed.get(files.name, [])}


def _take_snapshot(optimizer: _DeviceAdam, prefix: str = SNAPSHOT_PREFIX) -> dict[str, Any]:
    """Rank 0's part of a save: a snapshot of the committed step (or the one the last save
    took, where the namespace has not moved since), then the oldest snapshots of `prefix`
    (the checkpoints of DCP, or of DeepSpeed: deepspeed/zero.py) beyond `dcp_keep` dropped
    (dcp_group.pruned: for DCP, a load template's snapshot does not count).
    Returns the reference."""
    files = optimizer.files
    identity = optimizer._identity()
    last = getattr(optimizer, "_dcp_last", None)
    if (last is not None and last[0] == identity and last[1]["snapshot"].startswith(prefix)
            and last[1]["snapshot"] in _snapshots(optimizer)):
        return last[1]
    step = int(identity["committed_step"]) if "committed_step" in identity else optimizer.committed_step
    tag = f"{prefix}{step}-{secrets.token_hex(4)}"
    files.command(snapshot_calls.create_snapshot, files.admin, files.nsid, tag)
    reference = {"cossd": 1, "device": identity["device"], "namespace": files.name, "nsid": files.nsid,
                 "snapshot": tag, "step": step}
    optimizer._dcp_last = (optimizer._identity(), reference)
    keep = getattr(optimizer, "dcp_keep", None)
    if keep is not None:
        # DCP's load template is a get_state_dict too: its snapshot must not push out the one
        # the checkpoint being loaded names (dcp_group.pruned). DeepSpeed's loads take none.
        listed = list(_snapshots(optimizer).values())
        for old in dcp_group.pruned(listed, prefix, keep, tag, step, templates=prefix == SNAPSHOT_PREFIX):
            files.command(snapshot_calls.delete_snapshot, files.admin, files.nsid, old)
    return reference


def _take_group_snapshot(optimizer: _DeviceAdam, members: list[Any]) -> dict[str, Any]:
    """Rank 0's part of a save over several devices: as _take_snapshot, one tag on every device."""
    identity = optimizer._identity()
    last = getattr(optimizer, "_dcp_last", None)
    if (last is not None and last[0] == identity
            and all(last[1]["snapshot"] in _listed_tags(files) for files in members)):
        return last[1]
    reference = dcp_group.take(members, optimizer.committed_step, SNAPSHOT_PREFIX, getattr(optimizer, "dcp_keep", None))
    optimizer._dcp_last = (optimizer._identity(), reference)
    return reference


def _listed_tags(files: Any) -> set[str]:
    listed = files.command(snapshot_calls.snapshots, files.admin, files.nsid)
    return {snapshot["tag"] for snapshot in listed.get(files.name, [])}


def reference_state_dict(optimizer: _DeviceAdam) -> dict[str, Any]:
    """The reference form of state_dict() (for DCP): torch's layout with, per param, only its
    `step`, and on the first param a fixed-size uint8 tensor naming the device snapshot that
    holds the masters and moments of that step (taken by rank 0; a few hundred bytes in all,
    where the moments and masters are 12 bytes a param)."""
    _refuse_group(optimizer)
    members = _group_members(optimizer)
    if members is not None:  # one tag on every device of the group (dcp/group.py)
        reference = _on_rank0(optimizer, lambda: _take_group_snapshot(optimizer, members))
    else:
        reference = _on_rank0(optimizer, lambda: _take_snapshot(optimizer))
    first = optimizer.entries[0].index
    state: dict[int, dict[str, torch.Tensor]] = {}
    for entry in optimizer.entries:
        state[entry.index] = {"step": torch.tensor(float(reference["step"]), dtype=torch.float32)}
        if entry.index == first:
            state[entry.index][REF_KEY] = _encode(reference)
    groups = []
    for group_index, group in enumerate(optimizer.param_groups):
        packed = {k: v for k, v in group.items() if k != "params"}
        packed["params"] = [e.index for e in optimizer.entries if e.group == group_index]
        groups.append(packed)
    return {"state": state, "param_groups": groups}


def _roll_back(optimizer: _DeviceAdam, reference: dict[str, Any], checkpoint: str = "the DCP checkpoint") -> dict[str, Any]:
    """Rank 0's part of a load: the namespace back at the referenced snapshot (a step an
    earlier job left open aborted first); a RuntimeError naming `checkpoint` (the caller's
    words for it) and the snapshot where it is gone."""
    files = optimizer.files
    identity = optimizer._identity()
    if reference["device"] != identity["device"] or reference["namespace"] != files.name:
        raise ValueError(
            f"{checkpoint}: its optimizer state is namespace {reference['namespace']!r} on the device with "
            f"serial {reference['device']}, not this optimizer's ({files.name!r} on {identity['device']})")
    snapshot = _snapshots(optimizer).get(reference["snapshot"])
    if snapshot is None or snapshot.get("state") != "ready":
        why = "is gone" if snapshot is None else f"is {snapshot.get('state')} ({snapshot.get('error')})"
        raise RuntimeError(
            f"{checkpoint}: its optimizer state, snapshot {reference['snapshot']!r} of namespace "
            f"{files.name!r} (step {reference['step']}), {why} on the device {identity['device']}: this "
            "checkpoint cannot be resumed with its masters and moments. Resume from a later checkpoint, "
            "or from the device's committed step without loading the optimizer's state")
    last = getattr(optimizer, "_dcp_last", None)
    if not (last is not None and last[1] == reference and last[0] == identity):
        if files.statistics().get("step_open") is not None:
            files.command(files.admin.abort_step, files.nsid)
        try:
            files.command(snapshot_calls.rollback, files.admin, files.nsid, reference["snapshot"])
        except DeviceError as exc:
            if exc.status == Status.SNAPSHOT_NOT_FOUND:
                raise RuntimeError(f"{checkpoint}: its optimizer state, snapshot {reference['snapshot']!r} of "
                                   f"namespace {files.name!r}, is gone from the device") from None
            raise
        optimizer._dcp_last = (optimizer._identity(), reference)
    stats = files.statistics()
    return {"committed_step": int(stats["committed_step"]), "steps_skipped": int(stats["steps_skipped"])}


def load_reference(optimizer: _DeviceAdam, state_dict: dict[str, Any]) -> None:
    """load_state_dict of the reference form: the namespace rolled back to the snapshot it
    names (on rank 0; every rank then reads its params back), the param groups' options taken."""
    _refuse_group(optimizer)
    refs = [s[REF_KEY] for s in state_dict["state"].values() if isinstance(s, dict) and REF_KEY in s]
    references = [_decode(ref) for ref in refs]
    if any(other != references[0] for other in references[1:]):
        raise ValueError("the state dict names more than one cossd snapshot")
    reference = references[0]
    saved_groups = state_dict.get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(optimizer.param_groups):
        raise ValueError("loaded state dict has a different number of parameter groups")
    for index, entry_state in state_dict["state"].items():
        if isinstance(entry_state, dict) and "step" in entry_state and float(entry_state["step"]) != reference["step"]:
            raise ValueError(f"state for param {index} is at step {float(entry_state['step'])}, the snapshot "
                             f"{reference['snapshot']!r} at step {reference['step']}")
    members = _group_members(optimizer)
    if members is not None or "devices" in reference:
        _load_group_reference(optimizer, members, reference, saved_groups)
        return
    outcome = _on_rank0(optimizer, lambda: _roll_back(optimizer, reference))
    for saved, group in zip(saved_groups, optimizer.param_groups):
        for key, value in saved.items():
            if key not in ("params", "param_names"):
                group[key] = value
    optimizer.committed_step = outcome["committed_step"]
    optimizer.steps_skipped = outcome["steps_skipped"]
    optimizer.last_step_skipped = False
    optimizer.restored = True
    optimizer._handed_out = {}
    # The device took the snapshot's hyperparameters back; what a one-process step compares
    # its groups against to send changes is what the device now holds.
    config = optimizer.files.config()
    optimizer._sent_hypers = [{field: float(group[field]) for field in HYPER_FIELDS} for group in config["groups"]]
    optimizer._read_params()


def _load_group_reference(optimizer: _DeviceAdam, members: list[Any] | None, reference: dict[str, Any],
                          saved_groups: list[dict[str, Any]]) -> None:
    """load_reference over several devices: rank 0 checks the snapshot on every device, then
    rolls every device back to it atomically for the group (dcp_group.roll_back); every rank
    then takes the devices' step and hyperparameters and reads its params back."""
    if members is None or "devices" not in reference:
        where = "several devices" if members is None else "one device"
        raise ValueError(f"the DCP checkpoint's optimizer state is a snapshot on {where}, and this optimizer's "
                         f"namespace is {'on one device' if members is None else 'spread over several'}: "
                         "load it into an optimizer over the devices it was saved on")
    hook = getattr(optimizer, "load_hook", None) or (lambda stage: None)

    def roll_back() -> None:
        dcp_group.check(members, reference, "the DCP checkpoint")
        last = getattr(optimizer, "_dcp_last", None)
        if last is not None and last[1] == reference and last[0] == optimizer._identity():
            return  # the devices hold the snapshot's state already (saved and not stepped since)
        dcp_group.roll_back(members, reference["snapshot"], hook)
        optimizer._dcp_last = (optimizer._identity(), reference)

    _on_rank0(optimizer, roll_back)
    for saved, group in zip(saved_groups, optimizer.param_groups):
        for key, value in saved.items():
            if key not in ("params", "param_names"):
                group[key] = value
    children = optimizer._group
    for child in children:
        stats = child.files.statistics()
        child.committed_step, child.steps_skipped = int(stats["committed_step"]), int(stats["steps_skipped"])
        config = child.files.config()
        child._sent_hypers = [{field: float(group[field]) for field in HYPER_FIELDS} for group in config["groups"]]
    steps = [child.committed_step for child in children]
    if len(set(steps)) > 1:  # check() refuses such snapshots; a device changed meanwhile, say
        optimizer._mark_inconsistent(f"a DCP load left the devices at different steps ({steps})")
        raise RuntimeError(
            f"the DCP checkpoint's optimizer state left namespace {optimizer.files.name!r} at steps {steps} on its "
            "devices, not one step: nothing here trains on, saves or loads from this (the optimizer refuses); "
            "restart the job, which brings every device to one step or says why it cannot")
    optimizer.committed_step = children[0].committed_step
    optimizer.steps_skipped = sum(child.steps_skipped for child in children)
    optimizer.last_step_skipped = False
    optimizer.restored = True
    optimizer._handed_out = {}
    optimizer._read_group_params()
    optimizer._inconsistent = None  # every device at the snapshot's step, the model its params
