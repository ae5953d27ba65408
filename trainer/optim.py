"""Drop-in torch optimizers (AdamW, Adam) whose FP32 master weights and moments live on a cossd device."""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import time
import warnings
from collections.abc import Iterable
from typing import Any, Callable

import torch

from cossd.emulator.errors import DeviceError

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


class _DeviceAdam(torch.optim.Optimizer):
    """The Adam family with its state on a cossd namespace; see AdamW and Adam."""

    _torch_class: type[torch.optim.Optimizer]
    # GradScaler hands a custom-scaling optimizer its scale and found_inf instead of
    # unscaling FP16 gradients itself (which it refuses to do).
    _step_supports_amp_scaling = True

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

    def _load_masters(self, masters: list[torch.Tensor] | None) -> None:
        loads = []
        for entry in self.entries:
            source = masters[entry.index] if masters is not None else entry.param
            master = source.detach().to("cpu", torch.float32).reshape(-1)
            if master.numel() != entry.numel:
                raise ValueError(f"master weights for {entry.name} have {master.numel()} elements, "
                                 f"not {entry.numel}")
            loads.append((entry.name, "master", master))
        self.files.write_many(loads)
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
        if stats["loading"]:
            # A previous job died before its first step: load the initial weights again.
            self._load_masters(None)
        else:
            # Quick restore: params only; master weights and moments never leave the device.
            self._read_params()
            self.restored = True
        self.committed_step = int(stats["committed_step"])
        self.steps_skipped = int(stats["steps_skipped"])

    def close(self) -> None:
        """Release the namespace's files (the device keeps its state)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        self.files.close()

    # ------------------------------------------------------------------ transfers

    def _wire_grad(self, entry: _Entry, on_host: bool = True) -> torch.Tensor:
        """The gradient in the wire dtype, flat: on the host, or (on_host=False, for the
        memory buffer, which takes it straight from the GPU) wherever it is."""
        grad = entry.param.grad
        if grad is None:
            # The device needs every gradient of a step; a parameter without one gets zeros
            # (its moments decay), unlike torch, which leaves such a parameter alone.
            return torch.zeros(entry.numel, dtype=self.dtype)
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
            if (any_device or param.device.type == "cpu") and param.dtype == self.dtype and param.is_contiguous():
                reads.append((entry.name, "param", param.view(-1)))
            else:
                values = torch.empty(entry.numel, dtype=self.dtype)
                reads.append((entry.name, "param", values))
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

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step on the device: send gradients, commit, copy params back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch.optim.AdamW's format, read from the device; loads into the stock optimizer.

        The extra key "cossd_master" holds the FP32 master weights by param index (torch
        ignores it; a stock mixed-precision setup loads them into its FP32 copies).
        """
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
        return {"state": state, "param_groups": groups, "cossd_master": masters}

    def load_state_dict(  # type: ignore[override]
        self, state_dict: dict[str, Any], master: list[torch.Tensor] | None = None
    ) -> None:
        """Replace the device's state with a torch Adam(W) state_dict.

        Master weights come from `master`, else the dict's "cossd_master", else the current
        params. The namespace is re-created at the dict's step, so a running namespace's
        state is replaced.
        """
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
        if master is None and "cossd_master" in state_dict:
            master = [state_dict["cossd_master"][i] for i in order]
        for saved, group in zip(saved_groups, self.param_groups):
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    group[key] = value
        self._abort()
        self.files.delete()
        self._create(initial_step=step, masters=master)
        if step > 0:
            loads = []
            for entry, index in zip(self.entries, order):
                entry_state = saved_state.get(index)
                if entry_state is None:
                    raise ValueError(f"state for param {index} ({entry.name}) is missing")
                for role in ("exp_avg", "exp_avg_sq"):
                    values = entry_state[role].detach().to("cpu", torch.float32).reshape(-1)
                    if self.state_dtype == "bf16":
                        values = values.to(torch.bfloat16)
                    loads.append((entry.name, role, values))
            self.files.write_many(loads)


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
