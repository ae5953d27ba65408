"""A cossd optimizer following the params a wrapper (DeepSpeed) put in its param groups, to new namespaces, and reading only the truth while DeepSpeed has yet to open its namespace."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch

from .namespace.files import WIRE_DTYPES, NamespaceFiles
from .plan import TENSOR_NAME, Entry
from .state_dict import StateDict


class _SplitIntoGroups:
    """In place of the files of an optimizer whose groups each went to a namespace of their
    own (see Rebind._rebind): what needs the one namespace says why it is gone."""

    def __init__(self, names: list[str], mountpoint: str | os.PathLike[str]) -> None:
        self.names, self.mountpoint, self.name = names, mountpoint, names[0]

    def close(self) -> None:
        pass

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):  # copy, pickle and friends probe for these
            raise AttributeError(attribute)
        raise RuntimeError(
            f"this optimizer's param groups are stepped one at a time (DeepSpeed ZeRO 1/2 with "
            f"{len(self.names)} groups), each on its own namespace ({', '.join(self.names)}); "
            "state_dict() and load_state_dict() of such a split are not supported yet: use one "
            "param group, or ZeRO stage 0, for DeepSpeed checkpoints")


class Rebind(StateDict):
    """The framework rebinding of optim._DeviceAdam (a mixin: DeepSpeed swaps the tensors
    in the optimizer's own param_groups, and step()/load_state_dict() look here first). It
    extends StateDict's state_dict, load_state_dict and master_weights (its super() is that
    mixin, next in _DeviceAdam's order either way)."""

    # Set by the optimizer (optim._DeviceAdam); the methods named here are its own.
    files: NamespaceFiles
    entries: list[Entry]
    param_groups: list[dict[str, Any]]
    streaming: bool
    max_grad_norm: float | None
    _bound: dict[int, Any]
    _groups_at_init: list[dict[str, Any]]
    _state_options: dict[str, Any]
    # The optimizer's methods this calls (optim.py, session.py), declared here only: a
    # class-level annotation makes no attribute, the MRO finds theirs.
    _plan: Callable[[], list[Entry]]
    _create: Callable[..., None]
    _pin_cmb_for_gpu: Callable[[], bool]

    # What the trainer reads of the device's state (docs/trainer.md, "What the optimizer tells
    # you"). While the namespace waits for deepspeed.initialize (deepspeed_zero.defers) the kept
    # values are the constructor's, which are not the device's where the namespace exists: the
    # device answers then (deepspeed_zero.deferred_value), or the read fails saying why.

    @property
    def committed_step(self) -> int:
        """The step the device has committed; the next step() is this + 1."""
        return self._deferred_read("committed_step", self.__dict__.get("_committed_step", 0))

    @committed_step.setter
    def committed_step(self, value: int) -> None:
        self.__dict__["_committed_step"] = value

    @property
    def steps_skipped(self) -> int:
        """Steps the device skipped for inf/NaN gradients, over the namespace's life."""
        return self._deferred_read("steps_skipped", self.__dict__.get("_steps_skipped", 0))

    @steps_skipped.setter
    def steps_skipped(self, value: int) -> None:
        self.__dict__["_steps_skipped"] = value

    @property
    def restored(self) -> bool:
        """Whether the optimizer reattached to a namespace that had trained and read its params back."""
        return self._deferred_read("restored", self.__dict__.get("_restored", False))

    @restored.setter
    def restored(self, value: bool) -> None:
        self.__dict__["_restored"] = value

    def _deferred_read(self, what: str, kept: Any) -> Any:
        if not self.__dict__.get("_ds_deferred", False):
            return kept
        from .deepspeed import zero as deepspeed_zero
        return deepspeed_zero.deferred_value(self, what, kept)

    def master_weights(self) -> list[torch.Tensor]:
        """The FP32 master weights, read from the device (state_dict.py); refused, saying
        why, while the namespace waits for deepspeed.initialize."""
        if self.__dict__.get("_ds_deferred", False):
            from .deepspeed import zero as deepspeed_zero
            if self.files.exists():
                if deepspeed_zero.holds_zero_groups(self.files.config()):
                    raise RuntimeError(deepspeed_zero.zero_layout_message(self, "master_weights() reads it after that"))
                raise RuntimeError(
                    f"namespace {self.files.name!r} was made after this optimizer (by another rank of the job): "
                    "deepspeed.initialize opens it for this rank too, and master_weights() reads it after that")
            raise RuntimeError(
                f"namespace {self.files.name!r} does not exist yet: deepspeed.initialize makes it for every "
                "rank of this job (or this optimizer's first step() does, without DeepSpeed), and "
                "master_weights() reads it after that")
        return super().master_weights()

    def state_dict(self) -> dict[str, Any]:
        """Under DeepSpeed ZeRO (deepspeed/zero.py): a reference to the device's
        state, no tensors; else the optimizer's own (state_dict.py)."""
        binding = getattr(self, "_deepspeed", None)
        if binding is not None:
            return binding.state_dict()
        self._open_if_deferred()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        """Under DeepSpeed ZeRO, DeepSpeed's load_checkpoint (deepspeed/zero.py);
        else the optimizer's own (state_dict.py)."""
        binding = getattr(self, "_deepspeed", None)
        if binding is not None:
            binding.load_state_dict(state_dict)
            return
        self._open_if_deferred()
        super().load_state_dict(state_dict, *args, **kwargs)

    def _open_if_deferred(self) -> None:
        """Open the namespace that a construction beside an imported deepspeed left for
        deepspeed.initialize, where the optimizer is used without it."""
        if getattr(self, "_ds_deferred", False):
            from .deepspeed import zero as deepspeed_zero
            deepspeed_zero.open_deferred(self)

    def _new_child(self, group: dict[str, Any], namespace: str) -> Any:
        """An optimizer of this class for one param group, on a namespace of its own."""
        raise NotImplementedError

    def _params_moved(self) -> bool:
        """Whether the param groups hold other tensors than this namespace was made for
        (DeepSpeed's wrappers put their FP32 copies or flat partitions there)."""
        if any(all(group is not known for known in self._groups_at_init) for group in self.param_groups):
            return True
        current = [param for group in self._groups_at_init for param in group["params"]]
        return len(current) != len(self.entries) or any(
            param is not entry.param for param, entry in zip(current, self.entries))

    def _rebind(self) -> None:
        """Follow the tensors a wrapper put in the param groups, with their values as the
        masters. The model's namespace, made at construction and never stepped, goes, and
        one of the same name holds the new tensors; where a step() call carries only some of
        the groups (ZeRO 1/2 steps one group per call), each group gets a namespace of its
        own instead (`name`, then `name.g1`, ...), for the device steps a namespace whole."""
        groups = [group for group in self._groups_at_init if group["params"]]
        old = [entry.param for entry in self.entries]
        new = [param for group in groups for param in group["params"]]
        if "deepspeed" in sys.modules:
            from ..integrations import deepspeed as ds_support
            assert isinstance(self, torch.optim.Optimizer)  # this mixin is part of optim._DeviceAdam
            ds_support.check_rebind(self, old, new)
        name = self.files.name
        if self.committed_step > 0 or self.restored:
            raise RuntimeError(
                f"the param groups now hold other tensors than namespace {name!r} (at step "
                f"{self.committed_step}) was made for; a namespace that has trained cannot move to "
                "them (resuming a DeepSpeed run from the device is not supported yet: see "
                "docs/trainer.md, DeepSpeed). Create the optimizer for deepspeed.initialize on a "
                "new namespace")
        if self.streaming or self.max_grad_norm is not None:
            raise ValueError(
                "under a wrapper that steps its own copies of the params (DeepSpeed), streaming "
                "and max_grad_norm do not apply: the wrapper hands over unscaled FP32 gradients "
                "after backward. Clip with DeepSpeed's gradient_clipping")
        for param in new:
            if param.dtype not in (torch.float32, *WIRE_DTYPES):
                raise ValueError(f"cannot step {param.dtype} tensors on the device")
        known = {id(group) for group in groups}
        given = [group for group in self.param_groups if group["params"]]
        if not groups or any(id(group) not in known for group in given):
            raise RuntimeError("step() was given param groups this optimizer was not created with")
        self._abort()
        if len(given) == len(groups):
            # Every group in each call (DeepSpeed's FP16/BF16 wrappers, ZeRO with one group):
            # this optimizer moves to the new tensors, one namespace as before (none was made
            # for the model's params where DeepSpeed's import deferred it: optim.py).
            if self.files.exists():
                self.files.delete()
            self.files.close()
            self.files = NamespaceFiles(self.files.mountpoint, name, self._state_options["timeout_s"],
                                        use_cmb=self._state_options["use_cmb"],
                                        credentials=self.files.credentials)
            self._groups_at_init = given
            self.entries = self._plan()
            self._entry_of = {id(entry.param): entry for entry in self.entries}
            self.dtype = torch.bfloat16  # the gradients come unscaled in FP32: BF16 keeps their range
            self._create(initial_step=0, masters=None)
            self.cmb_pinned = self._pin_cmb_for_gpu()
            return
        names = [name] + [f"{name}.g{index}" for index in range(1, len(groups))]
        for other in names[1:]:
            if not TENSOR_NAME.fullmatch(other):
                raise ValueError(f"namespace {name!r} is too long to name its groups' namespaces")
            probe = NamespaceFiles(self.files.mountpoint, other, self._state_options["timeout_s"], use_cmb=False,
                                   credentials=self.files.credentials)
            try:
                if probe.exists():
                    raise RuntimeError(f"namespace {other!r} (for param group {names.index(other)}) "
                                       "exists already; delete it with `cossd delete-ns`")
            finally:
                probe.close()
        if self.files.exists():
            self.files.delete()
        self.files.close()
        # A stand-in, not NamespaceFiles: any use of the one namespace raises saying why it is gone.
        self.files = _SplitIntoGroups(names, self.files.mountpoint)  # type: ignore[assignment]
        for group, child_name in zip(groups, names):
            self._bound[id(group)] = self._new_child(group, child_name)

    def _step_bound(self) -> None:
        """One step() of the groups a wrapper asks for, each on its own namespace."""
        children = []
        for index, group in enumerate(self.param_groups):
            child = self._bound.get(id(group))
            if child is None or child._params_moved():
                raise RuntimeError(
                    f"param group {index} holds other tensors than the namespace cossd made for "
                    "the wrapper's (DeepSpeed's) params; it follows one such change, at the start")
            children.append(child)
        scaling = {key: getattr(self, key) for key in ("grad_scale", "found_inf") if hasattr(self, key)}
        skipped = False
        for child in children:
            child.__dict__.update(scaling)  # a GradScaler's, passed on
            try:
                child.step()
            finally:
                for key in scaling:
                    child.__dict__.pop(key, None)
            skipped |= child.last_step_skipped
        everyone = list(self._bound.values())
        self.last_step_skipped = skipped
        self.committed_step = min(child.committed_step for child in everyone)
        self.steps_skipped = max(child.steps_skipped for child in everyone)
        self.steps_skipped_no_grads = max(child.steps_skipped_no_grads for child in everyone)
        self.last_timing = children[-1].last_timing if children else {}
