"""A cossd optimizer's device session: begin, gradients out (at once or streamed), commit, abort, params back."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..protocol.status import DeviceError

from . import grads as grad_rules
from . import param_fp8
from .namespace.files import GRAD_TORCH_DTYPES, DeviceLostError, NamespaceFiles
from .grad_buckets import GradBuckets
from .plan import FP8_GRAD_DTYPES, Entry, group_hyper

# A streamed gradient: its values, the CUDA event its copy waits for, and its FP8 scale entry.
StreamedGrad = tuple[torch.Tensor, "torch.cuda.Event | None", "dict[str, Any] | None"]


class InconsistentStateError(RuntimeError):
    """A step() failed where the devices, the optimizer's step and the model's params may no
    longer be one step's state (a group commit that some devices made and others did not, a
    read-back of the committed params that failed): step(), state_dict(), master_weights() and
    DCP's saves refuse with this until they are one step's again. A new optimizer on the same
    mount(s) (a restart) brings every device to one committed step."""


class DeviceSession:
    """One namespace's step transaction, as a part of the optimizer (a mixin: GradScaler,
    DeepSpeed and the tests set and read these attributes on the optimizer itself)."""

    # Set by the optimizer (optim._DeviceAdam.__init__, and again where _rebind moves it).
    files: NamespaceFiles
    entries: list[Entry]
    param_groups: list[dict[str, Any]]
    dtype: torch.dtype
    grad_dtype: str | None  # the gradients' wire format; None: dtype's (plan.GRAD_DTYPES)
    param_wire_dtype: str | None  # FP8 params out (param_fp8.py); None: params in dtype
    streaming: bool
    scaler: torch.amp.GradScaler | None
    max_grad_norm: float | None
    last_grad_norm: float | None
    committed_step: int
    before_grad_write: Callable[[int], None] | None
    _sent_hypers: list[dict[str, float]]
    _step_open: bool
    _step_begun: bool  # a BEGIN went to the device in this step() (optim.step)
    _streamed: set[int]
    # Streaming: each streamed gradient's tensor and its version counter when it was sent; a
    # change since (clip_grad_norm_ after backward, say) is refused at step().
    _streamed_grads: dict[int, tuple[torch.Tensor, int]]
    _stream_scale: float
    _entry_of: dict[int, Entry]
    _buckets: GradBuckets[tuple[Entry, StreamedGrad]] | None  # where streaming: the gradients' sender
    # The group's and the sharded job's aborts (group.py, sharded.py), declared here only: a
    # class-level annotation makes no attribute, the MRO finds theirs.
    _abort_group: Callable[[str], None]
    _abort_shared: Callable[[str], None]

    # ------------------------------------------------------------------ gradients out

    @property
    def grad_wire(self) -> torch.dtype:
        """The torch dtype the gradients cross in: grad_dtype's, else the params' wire dtype.
        FP8 codes need their scale (_send_grads): any other path that asks is refused."""
        if self.grad_dtype in FP8_GRAD_DTYPES:
            raise RuntimeError(f"grad_dtype={self.grad_dtype!r}: FP8 gradients carry a per-tensor scale that "
                               "the optimizer's own steps send (one process or its ranks, streaming, several "
                               "devices); DeepSpeed's and FSDP2's bindings do not send it")
        return GRAD_TORCH_DTYPES[self.grad_dtype] if self.grad_dtype is not None else self.dtype

    def _wire_grad(self, entry: Entry, on_host: bool = True) -> torch.Tensor:
        return grad_rules.wire_grad(entry, self.grad_wire, on_host)

    def _write_grad_bucket(self, bucket: list[tuple[Entry, StreamedGrad]]) -> int:
        """A bucket of streamed gradients in one command (on the writer thread); FP8 codes
        after their scales, which join the open step (BEGIN_STEP of it again with them)."""
        if self.before_grad_write is not None:
            for entry, _ in bucket:
                self.before_grad_write(entry.index)
        scales = {entry.name: scale for entry, (_, _, scale) in bucket if scale is not None}
        if scales:
            self.files.command(self.files.admin.begin_step, self.files.nsid, self.committed_step + 1,
                               1.0 / self._stream_scale, scales)
        return self.files.write_streamed([(entry.name, values, ready) for entry, (values, ready, _) in bucket])

    def _streamed_grad(self, entry: Entry) -> StreamedGrad:
        """The gradient to stream, and for one on a GPU an event the writer thread waits for:
        where it goes through the CMB it stays on its device (the writer copies it straight
        into the CMB, after backward's stream has made it), else it comes to the host here.
        FP8: its codes, encoded here from this tensor's amax, and their grad_scales entry."""
        on_host = self.files.stream_slots() is None
        scale = None
        if self.grad_dtype in FP8_GRAD_DTYPES:
            encoded = grad_rules.fp8_encode_counted(grad_rules.wire_grad(entry, torch.float32, on_host),
                                                    self.grad_dtype, GRAD_TORCH_DTYPES[self.grad_dtype])
            grad, scale = encoded.codes, encoded.wire()
        else:
            grad = self._wire_grad(entry, on_host=on_host)
        ready = None
        if grad.is_cuda:
            ready = torch.cuda.Event()
            ready.record()  # on this thread's current stream: the one backward made it on
        return grad, ready, scale

    def _write_grads(self, grads: list[torch.Tensor]) -> None:
        """Every gradient of the step at once: through the device's memory buffer when it
        has one (a command per buffer-full), else a file write per tensor."""
        if self.before_grad_write is not None:
            for entry in self.entries:
                self.before_grad_write(entry.index)
        self.files.write_many([(entry.name, "grad", grad) for entry, grad in zip(self.entries, grads)],
                              params_back=True)

    def _send_grads(self, grad_scale: float) -> float:
        """Every gradient of the step to the device: the ones not streamed yet where the step
        is streaming, else all at once after BEGIN_STEP (with the clip coefficient in its
        scale). Returns the seconds spent in begin."""
        if self._step_open and self.streaming:
            if grad_scale != self._stream_scale:
                raise RuntimeError(
                    f"gradients were streamed at scale {self._stream_scale} but the step "
                    f"has scale {grad_scale}: pass the GradScaler as scaler=, and with streaming=True do not "
                    "call scaler.unscale_ (the gradients left scaled during backward; the device unscales them)"
                )
            self._check_streamed_step()
            # A streaming optimizer has its buckets from construction to close().
            assert self._buckets is not None
            for entry in self.entries:
                if entry.index not in self._streamed:
                    self._buckets.put((entry, self._streamed_grad(entry)))
            self._buckets.wait()
            return 0.0
        # Through the memory buffer a GPU's gradients go there directly (one copy).
        on_host = not self.files.step_transport().reaches_device_memory
        fp8 = self.grad_dtype in FP8_GRAD_DTYPES
        # FP8: the gradients in FP32 first (the norm is theirs), then encoded with their scales.
        grads = [grad_rules.wire_grad(entry, torch.float32, on_host) if fp8 else self._wire_grad(entry, on_host)
                 for entry in self.entries]
        coefficient = 1.0
        if self.max_grad_norm is not None:
            self.last_grad_norm = grad_rules.global_norm(grads, grad_scale)
            coefficient = grad_rules.clip_coefficient(self.last_grad_norm, self.max_grad_norm)
        scales: dict[str, Any] | None = None
        if fp8:
            assert self.grad_dtype is not None
            encoded = [grad_rules.fp8_encode_counted(grad, self.grad_dtype, GRAD_TORCH_DTYPES[self.grad_dtype])
                       for grad in grads]
            grads = [codes.codes for codes in encoded]
            # Each scale with its encoding's counts (log page C6h).
            scales = {entry.name: codes.wire() for entry, codes in zip(self.entries, encoded)}
        began = time.perf_counter()
        # The device multiplies each gradient by the step's combined scale (and an FP8 tensor's
        # by the inverse of its own).
        self._begin(coefficient / grad_scale, scales)
        begin_s = time.perf_counter() - began
        self._write_grads(grads)
        return begin_s

    def _check_streamed_step(self) -> None:
        """Streaming: what the device took during backward must still be what step() finds.
        A streamed gradient changed since it was sent (torch.nn.utils.clip_grad_norm_ or any
        in-place change between backward() and step() that counts in its version, or .grad is
        another tensor; GradScaler.unscale_'s kernel does not count, and is caught by the
        scale check instead, grads.py), or a group's hyperparameters changed since the
        step began (an lr set after backward()), is refused: the device would step the old
        values. The step() that raises drops the streamed step."""
        changed = [entry.name for entry in self.entries if entry.index in self._streamed_grads
                   and (entry.param.grad is not self._streamed_grads[entry.index][0]
                        or entry.param.grad._version != self._streamed_grads[entry.index][1])]
        if changed:
            names = ", ".join(changed[:4]) + (", ..." if len(changed) > 4 else "")
            raise RuntimeError(
                f"cossd: the gradients of {len(changed)} param(s) ({names}) changed after backward() had streamed "
                "them to the device (streaming=True sends each gradient as backward makes it; a "
                "torch.nn.utils.clip_grad_norm_ or any in-place change of the gradients before step() comes too "
                "late). This step was not taken. To clip, pass max_grad_norm= to the optimizer (or call "
                "optimizer.clip_grad_norm_) with streaming=False; to change gradients after backward, use "
                "streaming=False")
        for index, group in enumerate(self.param_groups):
            began = self._sent_hypers[index]
            moved = {key: (began.get(key), value) for key, value in group_hyper(group).items()
                     if began.get(key) != value}
            if moved:
                what = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in moved.items())
                raise RuntimeError(
                    f"cossd: param group {index}'s hyperparameters changed ({what}) after backward() began "
                    "streaming this step's gradients: the device took the group's hyperparameters when the step "
                    "began. This step was not taken. Set them before backward() (a scheduler.step() after "
                    "optimizer.step(), the usual order, does), or use streaming=False")

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Streaming: backward made this param's gradient; send it while backward goes on."""
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
        sent = entry.param.grad
        assert sent is not None  # autograd calls this hook once the gradient is accumulated
        self._streamed_grads[entry.index] = (sent, sent._version)
        assert self._buckets is not None
        self._buckets.put((entry, grad))

    # ------------------------------------------------------------------ params back

    def _read_params(self) -> None:
        """Copy the committed params into the model (in place where the dtype allows)."""
        wire = getattr(self, "param_wire_dtype", None)  # unset on a wrapper's optimizer made without __init__
        if wire is not None:
            # FP8 codes with their step and scale, decoded; from the CMB where the step that
            # just ended put them there (step() names it in _fresh_step, recorded as committed
            # before the read-back; elsewhere committed_step + 1, which no place names).
            param_fp8.read_params(self.files, self.entries, wire,
                                  self.__dict__.get("_fresh_step", self.committed_step + 1))
            return
        reads, staged = [], []
        # Through the memory buffer the params go straight to their device (a GPU's
        # included); through the files they go to the host first.
        any_device = self.files.step_transport().reaches_device_memory
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

    def _pin_cmb_for_gpu(self) -> bool:
        """Page-lock this optimizer's part of the CMB where a param is on a GPU: each crossing
        between the GPU and the CMB is then one DMA instead of a copy through CUDA's staging."""
        gpu = next((entry.param.device for entry in self.entries if entry.param.device.type == "cuda"), None)
        return gpu is not None and self.files.pin_cmb_for_cuda(gpu)

    # ------------------------------------------------------------------ the transaction

    def _sync_hyperparameters(self) -> None:
        """Send the groups' changed hyperparameters (an lr schedule) before a step begins."""
        for index, group in enumerate(self.param_groups):
            current = group_hyper(group)
            changed = {k: v for k, v in current.items() if self._sent_hypers[index].get(k) != v}
            if changed:
                self.files.command(
                    self.files.admin.set_hyperparameters, self.files.nsid, group=index, **changed
                )
                self._sent_hypers[index] = current

    def _begin(self, grad_scale: float, grad_scales: dict[str, Any] | None = None) -> None:
        self._sync_hyperparameters()
        self._step_begun = True  # from here a failed step() is checked (optim._ensure_consistent)
        self.files.step_began()
        self.files.command(
            self.files.admin.begin_step, self.files.nsid, self.committed_step + 1, grad_scale, grad_scales
        )
        self._step_open = True

    def _commit(self) -> dict[str, Any]:
        """COMMIT_STEP of the open step; the device's result (committed_step, skipped)."""
        result = self.files.command(self.files.admin.commit_step, self.files.nsid)
        self._step_open = False
        self._streamed.clear()
        self._streamed_grads.clear()
        return result

    def _abort(self, why: str = "the step failed on this rank") -> None:
        """Drop a step that failed halfway, so the next one can begin (best effort). A
        sharded job's step is aborted for every rank, which then hear `why`."""
        if getattr(self, "_group", None) is not None:
            self._abort_group(why)
            return
        if getattr(self, "_ranks", None) is not None:
            self._abort_shared(why)
            return
        if self._buckets is not None:
            self._buckets.cancel()
        self._streamed.clear()
        self._streamed_grads.clear()
        if self._step_open:
            self._step_open = False
            try:
                self.files.command(self.files.admin.abort_step, self.files.nsid)
            except (DeviceError, DeviceLostError, OSError):
                pass
