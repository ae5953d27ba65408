"""Drop-in torch optimizers (AdamW, Adam) whose FP32 master weights and moments live on a cossd device."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import sys
import time
import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Callable

import torch

from ..protocol.status import DeviceError

from . import namespace_swap
from .namespace_files import WIRE_DTYPES, DeviceLostError, NamespaceFiles

# The constructor options of torch's Adam family that the device's kernel implements
# only at their default value.
_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")
_HYPER_FIELDS = ("lr", "beta1", "beta2", "eps", "weight_decay")
_TENSOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One parameter as the device knows it."""

    index: int  # position in param-group order, as torch's state_dict numbers params
    name: str
    group: int
    param: torch.Tensor

    @property
    def numel(self) -> int:
        return self.param.numel()


def _group_hyper(group: dict[str, Any]) -> dict[str, float]:
    beta1, beta2 = group["betas"]
    return {
        "lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2),
        "eps": float(group["eps"]), "weight_decay": float(group["weight_decay"]),
    }


class _SplitIntoGroups:
    """In place of the files of an optimizer whose groups each went to a namespace of their
    own (see _DeviceAdam._rebind): what needs the one namespace says why it is gone."""

    def __init__(self, names: list[str], mountpoint: os.PathLike[str]) -> None:
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


class _DeviceAdam(torch.optim.Optimizer):
    """The Adam family with its state on a cossd namespace; see AdamW and Adam."""

    _torch_class: type[torch.optim.Optimizer]
    # GradScaler hands a custom-scaling optimizer its scale and found_inf instead of
    # unscaling FP16 gradients itself (which it refuses to do).
    _step_supports_amp_scaling = True
    # Called with each stage of load_state_dict's replace (namespace_swap.STAGES; fault injection).
    load_hook: Callable[[str], None] | None = None

    def __init__(
        self,
        params: Iterable[Any],
        *,
        mount: str | os.PathLike[str],
        namespace: str,
        dtype: torch.dtype | None = None,
        state_dtype: str = "fp32",
        max_grad_norm: float | None = None,
        streaming: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        timeout_s: float | None = 120.0,
        use_cmb: bool = True,
        **torch_options: Any,
    ) -> None:
        # torch's own class validates every argument and supplies its defaults, so the param
        # groups (and state_dict) look exactly like the stock optimizer's.
        probe = self._torch_class([torch.nn.Parameter(torch.zeros(1))], **torch_options)
        defaults = dict(probe.defaults)
        for option in _UNSUPPORTED:
            if defaults.get(option):
                raise ValueError(f"{option}=True is not supported by the cossd device")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        if streaming and max_grad_norm is not None:
            raise ValueError(
                "streaming sends gradients before the global norm is known; clip with "
                "streaming=False"
            )
        if state_dtype not in ("fp32", "bf16"):
            raise ValueError(f"state_dtype must be 'fp32' or 'bf16', got {state_dtype!r}")
        self._mode = "adamw" if defaults.get("decoupled_weight_decay") else "adam"
        self._initialized = False
        super().__init__(params, defaults)
        # What a namespace for params that a wrapper (DeepSpeed) puts in place of these is
        # made with: see _rebind.
        self._torch_options = dict(torch_options)
        self._state_options = {"state_dtype": state_dtype, "timeout_s": timeout_s, "use_cmb": use_cmb}
        self._groups_at_init = list(self.param_groups)
        self._bound: dict[int, _DeviceAdam] = {}
        self.max_grad_norm = max_grad_norm
        self.streaming = streaming
        self.scaler = scaler
        self.state_dtype = state_dtype
        self.entries = self._plan()
        self.dtype = dtype if dtype is not None else self._infer_dtype()
        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {self.dtype}")
        # What the trainer can read: the step the device has committed, how it went.
        self.committed_step = 0
        self.steps_skipped = 0
        # step() calls that found no gradient at all: skipped here with a warning, not sent.
        self.steps_skipped_no_grads = 0
        self.last_step_skipped = False
        self.last_grad_norm: float | None = None
        self.restored = False
        # Seconds the last step spent: sending gradients (the device's kernel runs behind
        # those writes), in begin/commit (where durability waits show), reading params.
        self.last_timing: dict[str, float] = {}
        self._sent_hypers: list[dict[str, float]] = []
        self._step_open = False
        self._streamed: set[int] = set()
        self._stream_scale = 1.0
        self._entry_of = {id(entry.param): entry for entry in self.entries}
        self._pending: list[concurrent.futures.Future[int]] = []
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        # Called with each tensor's index before its gradient is written (fault injection).
        self.before_grad_write: Callable[[int], None] | None = None
        self.files = NamespaceFiles(mount, namespace, timeout_s, use_cmb=use_cmb)
        try:
            # A load_state_dict that a killed job left half done is finished or undone first.
            done = namespace_swap.resolve_interrupted(self.files)
            if done is not None:
                warnings.warn(f"cossd: {done}", RuntimeWarning, stacklevel=3)
            if self.files.exists():
                self._attach()
            else:
                self._create(initial_step=0, masters=None)
        except BaseException:
            self.files.close()
            raise
        self._initialized = True
        # A GPU model's gradients and params cross between the GPU and the CMB: page-locked,
        # each crossing is one DMA instead of a copy through CUDA's staging buffer.
        gpu = next((entry.param.device for entry in self.entries if entry.param.device.type == "cuda"), None)
        self.cmb_pinned = gpu is not None and self.files.pin_cmb_for_cuda(gpu)
        if streaming:
            self.files.stream_slots()  # where streamed gradients go, worked out before any backward
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cossd-grads")
            for entry in self.entries:
                entry.param.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ------------------------------------------------------------------ setup

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initialized", False):
            raise NotImplementedError(
                "a cossd namespace's tensors are fixed when it is created: pass every param "
                "group to the constructor"
            )
        super().add_param_group(param_group)

    def _plan(self) -> list[_Entry]:
        entries = []
        names: set[str] = set()
        for group_index, group in enumerate(self.param_groups):
            given = group.get("param_names") or [None] * len(group["params"])
            for param, given_name in zip(group["params"], given):
                index = len(entries)
                name = given_name if isinstance(given_name, str) else ""
                if not _TENSOR_NAME.fullmatch(name) or name in names:
                    name = f"g{group_index}.p{index}"
                names.add(name)
                entries.append(_Entry(index, name, group_index, param))
        return entries

    def _infer_dtype(self) -> torch.dtype:
        dtypes = {entry.param.dtype for entry in self.entries}
        if len(dtypes) == 1 and next(iter(dtypes)) in WIRE_DTYPES:
            return next(iter(dtypes))
        # FP32 (or mixed) models: BF16 keeps FP32's range, so gradients cannot overflow.
        return torch.bfloat16

    def _description(self, initial_step: int) -> dict[str, Any]:
        hypers = [_group_hyper(group) for group in self.param_groups]
        wire = WIRE_DTYPES[self.dtype]
        return {
            "name": self.files.name,
            "tensors": [[e.name, e.numel, e.group] for e in self.entries],
            "hyperparameters": hypers[0] | {"mode": self._mode},
            "groups": hypers,
            "grad_dtype": wire,
            "param_dtype": wire,
            "state_dtype": self.state_dtype,
            "initial_step": initial_step,
        }

    def _create(self, initial_step: int, masters: list[torch.Tensor] | None) -> None:
        """Create the namespace and load the FP32 master weights (the params, or `masters`)."""
        self.files.create(self._description(initial_step))
        self._sent_hypers = [_group_hyper(group) for group in self.param_groups]
        self._load_masters(masters)
        self.committed_step = initial_step

    def _master_loads(self, masters: list[torch.Tensor] | None) -> list[tuple[str, str, torch.Tensor]]:
        """The FP32 masters to write (from `masters` by entry, else the params), checked."""
        loads = []
        for entry in self.entries:
            source = masters[entry.index] if masters is not None else entry.param
            master = source.detach().to("cpu", torch.float32).reshape(-1)
            if master.numel() != entry.numel:
                raise ValueError(f"master weights for {entry.name} have {master.numel()} elements, "
                                 f"not {entry.numel}")
            loads.append((entry.name, "master", master))
        return loads

    def _load_masters(self, masters: list[torch.Tensor] | None) -> None:
        self.files.write_many(self._master_loads(masters))
        # The device rounds the masters to the wire dtype; the model starts from exactly that.
        self._read_params()

    def _attach(self) -> None:
        """Reattach to an existing namespace: check it is this model's, then restore params."""
        config = self.files.config()
        found = [(t["name"], t["numel"], t.get("group", 0)) for t in config["tensors"]]
        expected = [(e.name, e.numel, e.group) for e in self.entries]
        if found != expected:
            raise ValueError(
                f"namespace {self.files.name!r} holds a different set of tensors "
                f"({len(found)} on the device, {len(expected)} in this optimizer); use another "
                "namespace name or delete it with `cossd delete-ns`"
            )
        wire = WIRE_DTYPES[self.dtype]
        if config["param_dtype"] != wire:
            raise ValueError(f"namespace {self.files.name!r} holds {config['param_dtype']} params, "
                             f"this optimizer sends {wire}")
        if config["hyperparameters"]["mode"] != self._mode:
            raise ValueError(f"namespace {self.files.name!r} runs {config['hyperparameters']['mode']}, "
                             f"not {self._mode}")
        self._sent_hypers = [
            {field: float(group[field]) for field in _HYPER_FIELDS} for group in config["groups"]
        ]
        stats = self.files.statistics()
        if stats["loading"] and int(stats["committed_step"]) != 0:
            # Only an import can load state at a later step (load_state_dict stages its loads
            # elsewhere, so this is an older cossd's, or a CREATE with initial_step): its
            # masters and moments are partly written, and nothing here can tell how far.
            raise RuntimeError(
                f"namespace {self.files.name!r} is still loading state for step "
                f"{stats['committed_step']}: an import of optimizer state was interrupted and "
                "its master weights and moments are incomplete. Delete it with `cossd delete-ns "
                f"{self.files.name}` and load the checkpoint again")
        if stats["loading"]:
            # A previous job died before its first step (this optimizer's own start, which
            # never trained): load the initial weights again.
            self._load_masters(None)
        else:
            # Quick restore: params only; master weights and moments never leave the device.
            self._read_params()
            self.restored = True
        self.committed_step = int(stats["committed_step"])
        self.steps_skipped = int(stats["steps_skipped"])

    def close(self) -> None:
        """Release the namespace's files (the device keeps its state)."""
        for child in self._bound.values():
            child.close()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self.files.close()

    # ------------------------------------------------------------------ transfers

    def _wire_grad(self, entry: _Entry, on_host: bool = True) -> torch.Tensor:
        """The gradient in the wire dtype, flat: on the host, or (on_host=False, for the
        memory buffer, which takes it straight from the GPU) wherever it is."""
        grad = entry.param.grad
        if grad is None:  # _check_grads refuses such a step before anything is sent
            raise RuntimeError(f"{entry.name} has no gradient")
        if grad.is_sparse:
            raise RuntimeError("cossd optimizers do not support sparse gradients")
        return grad.detach().to("cpu" if on_host else grad.device, self.dtype).reshape(-1)

    def _write_grad(self, entry: _Entry, grad: tuple[torch.Tensor, "torch.cuda.Event | None"]) -> int:
        """One tensor's gradients, streamed (on the writer thread)."""
        if self.before_grad_write is not None:
            self.before_grad_write(entry.index)
        return self.files.write_streamed(entry.name, *grad)

    def _streamed_grad(self, entry: _Entry) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """The gradient to stream, and for one on a GPU an event the writer thread waits for:
        where it goes through the CMB it stays on its device (the writer copies it straight
        into the CMB, after backward's stream has made it), else it comes to the host here."""
        grad = self._wire_grad(entry, on_host=self.files.stream_slots() is None)
        ready = None
        if grad.is_cuda:
            ready = torch.cuda.Event()
            ready.record()  # on this thread's current stream: the one backward made it on
        return grad, ready

    def _write_grads(self, grads: list[torch.Tensor]) -> None:
        """Every gradient of the step at once: through the device's memory buffer when it
        has one (a command per buffer-full), else a file write per tensor."""
        if self.before_grad_write is not None:
            for entry in self.entries:
                self.before_grad_write(entry.index)
        self.files.write_many([(entry.name, "grad", grad) for entry, grad in zip(self.entries, grads)],
                              params_back=True)

    def _read_params(self) -> None:
        """Copy the committed params into the model (in place where the dtype allows)."""
        reads, staged = [], []
        # Through the memory buffer the params go straight to their device (a GPU's
        # included); through the files they go to the host first.
        any_device = self.files.cmb() is not None
        for entry in self.entries:
            param = entry.param.detach()
            # An FP32 param (an FP32 model, DeepSpeed's FP32 master partitions) gets the FP32
            # master itself rather than its rounding to the wire dtype: it then holds exactly
            # what torch's AdamW on FP32 params would.
            role, dtype = ("master", torch.float32) if param.dtype == torch.float32 else ("param", self.dtype)
            if (any_device or param.device.type == "cpu") and param.dtype == dtype and param.is_contiguous():
                reads.append((entry.name, role, param.view(-1)))
            else:
                values = torch.empty(entry.numel, dtype=dtype)
                reads.append((entry.name, role, values))
                staged.append((param, values))
        self.files.read_many_into(reads)
        for param, values in staged:
            param.copy_(values.view(param.shape))

    def _sync_hyperparameters(self) -> None:
        """Send the groups' changed hyperparameters (an lr schedule) before a step begins."""
        for index, group in enumerate(self.param_groups):
            current = _group_hyper(group)
            changed = {k: v for k, v in current.items() if self._sent_hypers[index].get(k) != v}
            if changed:
                self.files.command(
                    self.files.admin.set_hyperparameters, self.files.nsid, group=index, **changed
                )
                self._sent_hypers[index] = current

    def _begin(self, grad_scale: float) -> None:
        self._sync_hyperparameters()
        self.files.step_began()
        self.files.command(
            self.files.admin.begin_step, self.files.nsid, self.committed_step + 1, grad_scale
        )
        self._step_open = True

    def _abort(self) -> None:
        """Drop a step that failed halfway, so the next one can begin (best effort)."""
        for future in self._pending:
            future.cancel()
        concurrent.futures.wait(self._pending)
        self._pending.clear()
        self._streamed.clear()
        if self._step_open:
            self._step_open = False
            try:
                self.files.command(self.files.admin.abort_step, self.files.nsid)
            except (DeviceError, DeviceLostError, OSError):
                pass

    # ------------------------------------------------------------------ scaling, clipping

    def _loss_scale(self) -> float:
        """The scale the gradients carry: GradScaler's, if it is stepping this optimizer."""
        scale = getattr(self, "grad_scale", None)
        if scale is None:
            return 1.0
        return float(scale)

    def _scaler_found_inf(self) -> bool:
        found = getattr(self, "found_inf", None)
        return bool(found is not None and float(found) > 0)

    def _clip_coefficient(self, grads: list[torch.Tensor], loss_scale: float) -> float:
        """torch.nn.utils.clip_grad_norm_'s coefficient (<= 1) for this step's gradients."""
        if self.max_grad_norm is None:
            return 1.0
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        total = float(torch.linalg.vector_norm(norms)) / loss_scale
        self.last_grad_norm = total
        if not torch.isfinite(torch.tensor(total)):
            return 1.0  # the device skips a step with non-finite gradients anyway
        return min(1.0, self.max_grad_norm / (total + 1e-6))

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip by global norm at the next steps (the device applies it as part of the scale)."""
        if self.streaming:
            raise ValueError("clipping needs streaming=False")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self.max_grad_norm = max_norm

    # ------------------------------------------------------------------ streaming

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.streaming:
            return
        entry = self._entry_of[id(param)]
        if entry.index in self._streamed:
            raise RuntimeError(
                f"{entry.name}: gradient produced twice in one step; streaming needs one "
                "backward per step (set optimizer.streaming = False to accumulate)"
            )
        if not self._step_open:
            scale = float(self.scaler.get_scale()) if self.scaler is not None and self.scaler.is_enabled() else 1.0
            self._stream_scale = scale
            self._begin(1.0 / scale)
        grad = self._streamed_grad(entry)
        self._streamed.add(entry.index)
        assert self._writer is not None
        self._pending.append(self._writer.submit(self._write_grad, entry, grad))

    # ------------------------------------------------------------------ which gradients

    def _check_grads(self) -> bool:
        """True where every param has a gradient. None has one: False, after a warning and
        a count (nothing is sent, no step taken). Only some have: RuntimeError, for the
        device steps every tensor of a namespace, and a zero gradient is not torch's "no
        gradient" (moments would decay and weight decay apply where torch leaves the param
        alone)."""
        missing = [entry for entry in self.entries if entry.param.grad is None]
        if not missing:
            return True
        if len(missing) == len(self.entries) and not self._step_open:
            self.steps_skipped_no_grads += 1
            self.last_step_skipped = True
            warnings.warn(
                f"cossd: step() found no gradients for namespace {self.files.name!r}: nothing sent, "
                f"step {self.committed_step + 1} not taken ({self.steps_skipped_no_grads} such "
                "steps skipped); call backward() before step()", RuntimeWarning, stacklevel=3)
            return False
        self._abort()
        names = ", ".join(entry.name for entry in missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise RuntimeError(
            f"{len(missing)} of {len(self.entries)} params have no gradient this step ({names}): "
            "the device steps every tensor of a namespace, and a zero gradient would still move "
            "their moments and decay their weights, where torch leaves them alone. Leave frozen "
            "or unused params out of the optimizer, or set p.grad = torch.zeros_like(p) for "
            "them to step them with a zero gradient")

    # ------------------------------------------------------------------ params a wrapper put in place

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
            from cossd.integrations import deepspeed as ds_support
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
            # this optimizer moves to the new tensors, one namespace as before.
            self.files.delete()
            self.files.close()
            self.files = NamespaceFiles(self.files.mountpoint, name, self._state_options["timeout_s"],
                                        use_cmb=self._state_options["use_cmb"])
            self._groups_at_init = given
            self.entries = self._plan()
            self._entry_of = {id(entry.param): entry for entry in self.entries}
            self.dtype = torch.bfloat16  # the gradients come unscaled in FP32: BF16 keeps their range
            self._create(initial_step=0, masters=None)
            gpu = next((entry.param.device for entry in self.entries if entry.param.device.type == "cuda"), None)
            self.cmb_pinned = gpu is not None and self.files.pin_cmb_for_cuda(gpu)
            return
        names = [name] + [f"{name}.g{index}" for index in range(1, len(groups))]
        for other in names[1:]:
            if not _TENSOR_NAME.fullmatch(other):
                raise ValueError(f"namespace {name!r} is too long to name its groups' namespaces")
            probe = NamespaceFiles(self.files.mountpoint, other, self._state_options["timeout_s"], use_cmb=False)
            try:
                if probe.exists():
                    raise RuntimeError(f"namespace {other!r} (for param group {names.index(other)}) "
                                       "exists already; delete it with `cossd delete-ns`")
            finally:
                probe.close()
        self.files.delete()
        self.files.close()
        self.files = _SplitIntoGroups(names, self.files.mountpoint)  # type: ignore[assignment]
        for group, child_name in zip(groups, names):
            child = type(self).__new__(type(self))
            # The gradients come unscaled in FP32: BF16 on the wire keeps their range.
            _DeviceAdam.__init__(child, [group], mount=self.files.mountpoint, namespace=child_name,
                                 dtype=torch.bfloat16, **self._state_options, **self._torch_options)
            self._bound[id(group)] = child

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

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step on the device: send gradients, commit, copy params back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._bound and self._params_moved():
            self._rebind()
        if self._bound:
            self._step_bound()
            return loss
        if not self._check_grads():
            return loss
        loss_scale = self._loss_scale()
        found_inf = self._scaler_found_inf()
        clock = time.perf_counter
        timing = {"begin_s": 0.0}
        started = clock()
        try:
            if self._step_open and self.streaming:
                if loss_scale != self._stream_scale:
                    raise RuntimeError(
                        f"gradients were streamed at scale {self._stream_scale} but the step "
                        f"has scale {loss_scale}: pass the GradScaler as scaler="
                    )
                for entry in self.entries:
                    if entry.index not in self._streamed:
                        self._pending.append(self._writer.submit(  # type: ignore[union-attr]
                            self._write_grad, entry, self._streamed_grad(entry)))
                for future in concurrent.futures.as_completed(self._pending):
                    future.result()
            else:
                # Through the memory buffer a GPU's gradients go there directly (one copy).
                on_host = self.files.cmb() is None
                grads = [self._wire_grad(entry, on_host) for entry in self.entries]
                coefficient = self._clip_coefficient(grads, loss_scale)
                began = clock()
                # The device multiplies each gradient by the step's combined scale.
                self._begin(coefficient / loss_scale)
                timing["begin_s"] = clock() - began
                self._write_grads(grads)
            committing = clock()
            timing["grads_s"] = committing - started - timing["begin_s"]
            result = self.files.command(self.files.admin.commit_step, self.files.nsid)
            timing["commit_s"] = clock() - committing
        except BaseException:
            self._abort()
            raise
        self._step_open = False
        self._pending.clear()
        self._streamed.clear()
        self.last_step_skipped = bool(result["skipped"])
        if self.last_step_skipped:
            self.steps_skipped += 1
            if not found_inf and getattr(self, "found_inf", None) is not None:
                warnings.warn(
                    f"step {result['step']}: the device skipped it for non-finite gradients "
                    "that the GradScaler did not see (an overflow converting to "
                    f"{self.dtype}); use dtype=torch.bfloat16", RuntimeWarning, stacklevel=2)
        else:
            reading = clock()
            self._read_params()
            timing["params_s"] = clock() - reading
        self.committed_step = int(result["committed_step"])
        self.last_timing = timing
        return loss

    # ------------------------------------------------------------------ state_dict

    def master_weights(self) -> list[torch.Tensor]:
        """The FP32 master weights, read from the device, shaped like the params."""
        return [
            self.files.read(e.name, "master", torch.float32, e.numel).view(e.param.shape)
            for e in self.entries
        ]

    def _read_state(self, entry: _Entry, role: str) -> torch.Tensor:
        dtype = torch.float32 if self.state_dtype == "fp32" else torch.bfloat16
        values = self.files.read(entry.name, role, dtype, entry.numel)
        return values.to(torch.float32).view(entry.param.shape)

    def _identity(self) -> dict[str, Any]:
        """Which state the namespace holds now, cheap to read at any size: the device (its
        serial), the namespace (nsids are never reused), its committed step, and the step
        counters its superblock carries over its life (a commit or a skip moves them)."""
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
        """Whether every tensor of `state_dict` is one the latest state_dict() call handed out,
        unchanged in place since (torch counts in-place changes in a tensor's _version). A
        tensor it did not hand out (a replaced entry, a deep copy, a file's, an older call's)
        could hold anything, so it makes the load a real one: a no-op is only ever taken for
        the very dict handed out, as accelerate hands it back."""
        handed_out = getattr(self, "_handed_out", {})
        tensors = [value for entry in state_dict["state"].values() for value in entry.values()]
        tensors += list(state_dict.get("cossd_master", {}).values())
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            known = handed_out.get(id(tensor))
            if known is None or known[0]() is not tensor or tensor._version != known[1]:
                return False
        return True

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch.optim.AdamW's format, read from the device; loads into the stock optimizer.

        The extra key "cossd_master" holds the FP32 master weights by param index (torch
        ignores it; a stock mixed-precision setup loads them into its FP32 copies), and
        "cossd_namespace" says which namespace state it is, so that loading it back into
        that state is a no-op.
        """
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
        masters = {index: values for index, values in enumerate(self.master_weights())}
        handed = [t for entry in state.values() for t in entry.values()] + list(masters.values())
        self._handed_out = {id(t): (weakref.ref(t), t._version) for t in handed}
        return {"state": state, "param_groups": groups, "cossd_master": masters,
                "cossd_namespace": identity}

    def load_state_dict(  # type: ignore[override]
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
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for saved, group in zip(saved_groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't "
                                 "match the size of optimizer's group")
        order = [index for saved in saved_groups for index in saved["params"]]
        saved_state = state_dict["state"]
        steps = {float(saved_state[i]["step"]) for i in order if i in saved_state}
        if len(steps) > 1:
            raise ValueError(f"params are at different steps {sorted(steps)}; the device "
                             "steps a namespace as a whole")
        step = int(steps.pop()) if steps else 0
        noop = (master is None and state_dict.get("cossd_namespace") is not None
                and state_dict["cossd_namespace"] == self._identity()
                and self._unchanged_since_handed_out(state_dict))
        if master is None and "cossd_master" in state_dict:
            master = [state_dict["cossd_master"][i] for i in order]
        # Everything is checked before anything changes: bad input leaves the run as it was.
        loads = [] if noop else self._master_loads(master)
        if step > 0 and not noop:
            for entry, index in zip(self.entries, order):
                entry_state = saved_state.get(index)
                if entry_state is None:
                    raise ValueError(f"state for param {index} ({entry.name}) is missing")
                for role in ("exp_avg", "exp_avg_sq"):
                    values = entry_state[role].detach().to("cpu", torch.float32).reshape(-1)
                    if values.numel() != entry.numel:
                        raise ValueError(f"{role} for param {index} ({entry.name}) has "
                                         f"{values.numel()} elements, not {entry.numel}")
                    if self.state_dtype == "bf16":
                        values = values.to(torch.bfloat16)
                    loads.append((entry.name, role, values))
        before = [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups]
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    group[key] = value
        if noop:
            return  # the groups' changed options go to the device with the next step
        self._abort()
        hook = self.load_hook or (lambda stage: None)
        try:
            namespace_swap.replace(self.files, self._description(step),
                                   lambda: self.files.write_many(loads), hook)
        except BaseException:
            for group, options in zip(self.param_groups, before):  # the old run goes on as it was
                group.update(options)
            raise
        self._sent_hypers = [_group_hyper(group) for group in self.param_groups]
        self.committed_step = step
        self.steps_skipped = 0
        self.last_step_skipped = False
        # The device rounds the masters to the wire dtype; the model continues from that.
        self._read_params()


class AdamW(_DeviceAdam):
    """torch.optim.AdamW with its state on a cossd device (decoupled weight decay)."""

    _torch_class = torch.optim.AdamW

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, **kwargs)


class Adam(_DeviceAdam):
    """torch.optim.Adam with its state on a cossd device (L2 weight decay, or decoupled)."""

    _torch_class = torch.optim.Adam

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, **kwargs: Any) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, **kwargs)
