"""A cossd optimizer's state_dict and load_state_dict: torch's AdamW format, read from and loaded onto the device."""
from __future__ import annotations

import collections
import hashlib
import math
import weakref
from typing import Any, Callable

import torch

from .dcp import reference as dcp
from .namespace import swap as namespace_swap
from .namespace.files import NamespaceFiles
from .session import InconsistentStateError
from .plan import Entry, check_group_options, group_hyper


class StateDict:
    """torch's state_dict/load_state_dict for an optimizer whose state is on the device (a
    mixin of optim._DeviceAdam, ahead of torch.optim.Optimizer, whose own they replace)."""

    # Set by the optimizer (optim._DeviceAdam); the methods named here are its own.
    files: NamespaceFiles
    entries: list[Entry]
    param_groups: list[dict[str, Any]]
    state_dtype: str
    committed_step: int
    steps_skipped: int
    last_step_skipped: bool
    load_hook: Callable[[str], None] | None
    _bound: dict[int, Any]
    _sent_hypers: list[dict[str, float]]
    # The optimizer's methods these call (optim.py, session.py, sharded.py, rebind.py),
    # declared here only: a class-level annotation makes no attribute, the MRO finds theirs.
    _abort: Callable[..., None]
    _description: Callable[[int], dict[str, Any]]
    _read_params: Callable[[], None]
    _master_loads: Callable[[list[torch.Tensor] | None], list[tuple[str, str, torch.Tensor]]]
    _params_moved: Callable[[], bool]
    _rebind: Callable[[], None]
    _load_sharded_state: Callable[[int, list[tuple[str, str, torch.Tensor]]], None]
    # A group of devices' (group.py), called where the optimizer has one (`_group`).
    _group_master_weights: Callable[[], list[torch.Tensor]]
    _group_read_state: Callable[[Entry, str], torch.Tensor]
    _group_identity: Callable[[], dict[str, Any]]
    _load_group_state: Callable[[int, list[tuple[str, str, torch.Tensor]]], None]
    # After a failed step() (optim.py): None, or why the state may mix steps (raised, or the text).
    _ensure_consistent: Callable[..., None]
    _inconsistency: Callable[..., str | None]

    # Which form state_dict() gives DCP's get_state_dict family: "reference" (a device
    # snapshot's name, dcp.py) or "full" (the moments and masters, as any other caller gets).
    dcp_form: str = "reference"
    # How many of the snapshots that DCP saves take to keep (the oldest go first); None: all.
    dcp_keep: int | None = None

    @property
    def state(self) -> collections.defaultdict[torch.Tensor, Any]:  # torch's type; a dcp.DeviceStateView
        """torch's per-param state: empty, the state is on the device (see dcp.DeviceStateView)."""
        return self.__dict__["_device_state_view"]

    @state.setter
    def state(self, value: Any) -> None:  # torch.optim.Optimizer.__init__ sets a defaultdict
        self.__dict__["_device_state_view"] = dcp.DeviceStateView(self, value)

    def master_weights(self) -> list[torch.Tensor]:
        """The FP32 master weights, read from the device, shaped like the params."""
        # Refused where a failed step() may have left the devices at different steps.
        self._ensure_consistent("master_weights()", check_devices=True)
        return self._read_master_weights()

    def _read_master_weights(self) -> list[torch.Tensor]:
        if getattr(self, "_group", None) is not None:
            return self._group_master_weights()
        return [
            self.files.read(e.name, "master", torch.float32, e.numel).view(e.param.shape)
            for e in self.entries
        ]

    def _read_state(self, entry: Entry, role: str) -> torch.Tensor:
        if getattr(self, "_group", None) is not None:
            return self._group_read_state(entry, role)
        values = self.files.read(entry.name, role, moment_file_dtype(self.state_dtype), entry.numel)
        return values.to(torch.float32).view(entry.param.shape)

    def _identity(self) -> dict[str, Any]:
        """Which state the namespace holds now, cheap to read at any size: the device (its
        serial), the namespace (nsids are never reused), its committed step, and the step
        counters its superblock carries over its life (a commit or a skip moves them)."""
        if getattr(self, "_group", None) is not None:
            return self._group_identity()
        if getattr(self, "_device_serial", None) is None:
            self._device_serial = str(self.files.command(self.files.admin.describe)["identity"]["serial"])
        stats = self.files.statistics()
        identity = {"device": self._device_serial, "name": self.files.name, "nsid": self.files.nsid}
        for key in ("committed_step", "loading", "steps_committed", "steps_skipped",
                    "last_skipped_step", "seq"):
            if key in stats:  # seq: the superblock's, where the device reports it
                identity[key] = stats[key]
        return identity

    def _unchanged_since_handed_out(self, state_dict: dict[str, Any]) -> bool:
        """Whether the tensors of `state_dict` are exactly those the latest state_dict() call
        handed out, every one of them, each holding the bytes it held then. A tensor it did
        not hand out (a replaced entry, a deep copy, a file's, an older call's) could hold
        anything, so it makes the load a real one: a no-op is only ever taken for the very
        dict handed out, as accelerate hands it back. Content is what counts: writes through
        `.numpy()` or `.data` never move torch's `_version`, so each tensor's bytes are
        hashed again and compared with their digest at hand-out (a pass over host memory;
        nothing is read from the device)."""
        handed_out = getattr(self, "_handed_out", {})
        tensors = [value for entry in state_dict["state"].values() for value in entry.values()]
        tensors += list(state_dict.get("cossd_master", {}).values())
        tensors = [tensor for tensor in tensors if isinstance(tensor, torch.Tensor)]
        if {id(tensor) for tensor in tensors} != set(handed_out) or len(tensors) != len(handed_out):
            return False  # one replaced, added or dropped
        for tensor in tensors:
            ref, version, digest = handed_out[id(tensor)]
            if ref() is not tensor or tensor._version != version:  # the cheap test first
                return False
        return all(_digest(tensor) == handed_out[id(tensor)][2] for tensor in tensors)

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format, read from the device; loads into the stock optimizer.

        The extra key "cossd_master" holds the FP32 master weights by param index (torch
        ignores it; a stock mixed-precision setup loads them into its FP32 copies), and
        "cossd_namespace" says which namespace state it is, so that loading it back into
        that state is a no-op.
        """
        if self.dcp_form not in ("reference", "full"):
            raise ValueError(f"dcp_form must be 'reference' or 'full', got {self.dcp_form!r}")
        # A failed step() may have left the devices at different steps, or the label behind
        # them: what this would record is refused then (no state mixing steps under one label).
        self._ensure_consistent("state_dict()" if not dcp.called_by_dcp() else "a DCP save or load template "
                                "(get_state_dict)", check_devices=True)
        if self.dcp_form == "reference" and dcp.called_by_dcp():
            return dcp.reference_state_dict(self)
        identity = self._identity()
        state: dict[int, dict[str, torch.Tensor]] = {}
        if self.committed_step > 0:
            for entry in self.entries:
                state[entry.index] = {
                    "step": torch.tensor(float(self.committed_step), dtype=torch.float32),
                    "exp_avg": self._read_state(entry, "exp_avg"),
                    "exp_avg_sq": self._read_state(entry, "exp_avg_sq"),
                }
        groups = []
        for group_index, group in enumerate(self.param_groups):
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = [e.index for e in self.entries if e.group == group_index]
            groups.append(packed)
        masters = {index: values for index, values in enumerate(self._read_master_weights())}
        handed = [t for entry in state.values() for t in entry.values()] + list(masters.values())
        self._handed_out = {id(t): (weakref.ref(t), t._version, _digest(t)) for t in handed}
        return {"state": state, "param_groups": groups, "cossd_master": masters,
                "cossd_namespace": identity}

    def load_state_dict(
        self, state_dict: dict[str, Any], master: list[torch.Tensor] | None = None
    ) -> None:
        """Replace the device's state with a torch Adam(W) state_dict.

        Master weights come from `master`, else the dict's "cossd_master", else the current
        params. A dict that state_dict() returned for the state the namespace still holds
        loads as a no-op (only the param groups' options are taken). Any other state goes
        into a staging namespace first and replaces the namespace atomically
        (namespace_swap.replace): a kill at any instant leaves the old run or the new one.
        """
        # DeepSpeed's load_checkpoint comes before the first step: follow its tensors first,
        # or the masters would be checked against the model's, not its partitions.
        if not self._bound and self._params_moved():
            self._rebind()
        # After a failed step() that left the devices apart (or the label behind them): only a
        # full state replaces every device's (below); a DCP reference and the no-op are refused.
        inconsistent = self._inconsistency("load_state_dict()")
        if dcp.is_reference(state_dict):
            if inconsistent is not None:
                raise InconsistentStateError(inconsistent + " (a DCP reference is loaded by a new optimizer)")
            dcp.load_reference(self, state_dict)
            return
        if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
                or not isinstance(state_dict.get("param_groups"), list):
            raise ValueError("an optimizer state dict has a dict 'state' and a list 'param_groups'")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
        order = [index for saved in saved_groups for index in saved["params"]]
        saved_state = state_dict["state"]
        step = _checked_step(order, saved_state, state_dict.get("cossd_master"))
        noop = (inconsistent is None and master is None and state_dict.get("cossd_namespace") is not None
                and state_dict["cossd_namespace"] == self._identity()
                and self._unchanged_since_handed_out(state_dict))
        if master is None and "cossd_master" in state_dict:
            master = [state_dict["cossd_master"][i] for i in order]
        # Everything is checked before anything changes: bad input leaves the run as it was.
        loads = [] if noop else self._master_loads(master)
        for name, _role, values in loads:
            _refuse_non_finite(values, f"master weights of {name}")
        if step > 0 and not noop:
            for entry, index in zip(self.entries, order):
                entry_state = saved_state.get(index)
                if entry_state is None:
                    raise ValueError(f"state for param {index} ({entry.name}) is missing")
                for role in ("exp_avg", "exp_avg_sq"):
                    if not isinstance(entry_state.get(role), torch.Tensor):
                        raise ValueError(f"state for param {index} ({entry.name}) has no {role} tensor")
                    values = entry_state[role].detach().to("cpu", torch.float32).reshape(-1)
                    if values.numel() != entry.numel:
                        raise ValueError(f"{role} for param {index} ({entry.name}) has "
                                         f"{values.numel()} elements, not {entry.numel}")
                    _refuse_non_finite(values, f"{role} for param {index} ({entry.name})")
                    if role == "exp_avg_sq" and bool((values < 0).any()):
                        raise ValueError(f"{role} for param {index} ({entry.name}) has negative "
                                         "elements: a mean of squares is never below zero")
                    # fp16/int8 files take FP32 values, which the device encodes per block.
                    values = values.to(moment_file_dtype(self.state_dtype))
                    # A finite FP32 moment past BF16's largest (about 3.39e38) rounds to inf.
                    _refuse_non_finite(values, f"{role} for param {index} ({entry.name}), as {self.state_dtype}")
                    loads.append((entry.name, role, values))
        before = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    group[key] = value
        try:  # options every later step() would refuse (amsgrad, another decay mode): refused now, nothing loaded
            mode = self.__dict__.get("_mode")
            if mode is not None:
                check_group_options(self.param_groups, mode, " (in the state dict being loaded; nothing was loaded)")
        except ValueError:
            for group, options in zip(self.param_groups, before):
                group.update(options)
                for key in [k for k in group if k not in options and k != "params"]:
                    del group[key]
            raise
        if noop:
            return  # the groups' changed options go to the device with the next step
        if getattr(self, "_group", None) is not None:
            try:  # every device's pieces, replaced atomically for the group (group.py)
                self._load_group_state(step, loads)
            except BaseException:
                for group, options in zip(self.param_groups, before):  # the old run goes on as it was
                    group.update(options)
                raise
            self.__dict__["_inconsistent"] = self.__dict__["_masters_half_loaded"] = None  # every device holds the loaded state, the model its params
            return
        if getattr(self, "_ranks", None) is not None:
            try:  # rank 0 replaces the one namespace atomically, every rank reads its params (sharded.py)
                self._load_sharded_state(step, loads)
            except BaseException:
                for group, options in zip(self.param_groups, before):  # the old run goes on as it was
                    group.update(options)
                raise
            self.__dict__["_inconsistent"] = self.__dict__["_masters_half_loaded"] = None  # the device holds the loaded state, the model its params
            return
        self._abort()
        hook = self.load_hook or (lambda stage: None)
        try:
            namespace_swap.replace(self.files, self._description(step),
                                   lambda: self.files.write_many(loads), hook)
        except BaseException:
            for group, options in zip(self.param_groups, before):  # the old run goes on as it was
                group.update(options)
            raise
        self._sent_hypers = [group_hyper(group) for group in self.param_groups]
        self.committed_step = step
        self.steps_skipped = 0
        self.last_step_skipped = False
        # The device rounds the masters to the wire dtype; the model continues from that.
        self._read_params()
        self.__dict__["_inconsistent"] = self.__dict__["_masters_half_loaded"] = None  # the device holds the loaded state, the model its params


def moment_file_dtype(state_dtype: str) -> torch.dtype:
    """The dtype of a moment file's elements: bf16 moments read and load as their own bits;
    fp32 ones, and block-scaled fp16/int8 ones (decoded on read, encoded on load by the
    device, docs/media-format.md#block-scaled-moments-fp16-and-int8), as FP32."""
    return torch.bfloat16 if state_dtype == "bf16" else torch.float32


def _digest(tensor: torch.Tensor) -> bytes:
    """A digest of a CPU tensor's bytes (what load_state_dict compares a handed-out tensor by)."""
    flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
    return hashlib.blake2b(flat.numpy().data, digest_size=16).digest()


def _refuse_non_finite(values: torch.Tensor, what: str) -> None:
    """A ValueError naming `what` where it holds a NaN or an infinity: the device would step
    from it, and every later step of that tensor would be NaN."""
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        bad = int(values.numel() - finite.sum())
        raise ValueError(f"{what} holds {bad} non-finite element(s) (NaN or inf); nothing was loaded")


def _checked_step(order: list[Any], saved_state: dict[Any, Any], masters: Any) -> int:
    """The one step of a torch Adam(W) state dict's params, after checking its indices (each
    param group lists distinct integer indices; `state` and `cossd_master` are keyed by
    those) and steps (present, equal, a whole number >= 0): a ValueError saying what is
    wrong otherwise."""
    if any(not isinstance(index, int) or isinstance(index, bool) for index in order):
        raise ValueError(f"param groups list param indices {order}: each must be an int")
    if len(set(order)) != len(order):
        raise ValueError(f"param groups list a param index twice: {order}")
    stray = sorted((key for key in saved_state if key not in set(order)), key=str)
    if stray:
        raise ValueError(f"state holds param index(es) {stray} that no param group lists ({order})")
    if isinstance(masters, dict):
        missing = [index for index in order if index not in masters]
        if missing:
            raise ValueError(f"cossd_master has no master weights for param index(es) {missing}")
    steps = set()
    for index in order:
        entry_state = saved_state.get(index)
        if entry_state is None:
            continue
        if not isinstance(entry_state, dict) or "step" not in entry_state:
            raise ValueError(f"state for param {index} has no 'step'")
        value = float(entry_state["step"])
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise ValueError(f"state for param {index} is at step {value}: a step is a whole number >= 0")
        steps.add(int(value))
    if len(steps) > 1:
        raise ValueError(f"params are at different steps {sorted(steps)}; the device "
                         "steps a namespace as a whole")
    return steps.pop() if steps else 0
