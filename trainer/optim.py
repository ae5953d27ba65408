"""Drop-in torch optimizers (AdamW, Adam) whose FP32 master weights and moments live on a cossd device."""
from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterable
from typing import Any, Callable

import torch

from . import grads as grad_rules
from . import distributed, fsdp
from .namespace import swap as namespace_swap
from ..client import Credentials
from .distributed import Ranks
from .captured_groups import release_captured_groups
from .namespace.files import WIRE_DTYPES, NamespaceFiles
from . import param_fp8
from ..client.remote import is_remote
from .plan import (GRAD_DTYPES, HYPER_FIELDS, STATE_DTYPES, UNSUPPORTED, Entry, check_group_options, description,
                   group_hyper, infer_dtype, master_loads, plan)
from .group import DeviceGroup, SoloRanks, mount_list
from .rebind import Rebind
from .grad_buckets import GradBuckets
from .session import DeviceSession, InconsistentStateError, StreamedGrad
from .sharded import ShardedSession
from .state_dict import StateDict
from .step_guards import StepGuards


class _DeviceAdam(StepGuards, DeviceGroup, Rebind, StateDict, ShardedSession, DeviceSession, torch.optim.Optimizer):
    """The Adam family with its state on a cossd namespace; see AdamW and Adam.

    Its jobs live in modules of their own, as mixins of this one object (torch, GradScaler,
    DeepSpeed and accelerate all set and read the optimizer's own attributes): the plan of
    entries (plan.py), the gradients' rules (grads.py), the device session (session.py),
    the sharded step of a multi-rank job (sharded.py), a namespace spread over several
    devices (group.py), state_dict (state_dict.py), following a wrapper's params (rebind.py) and
    the guards against a state the device does not hold (step_guards.py). This class holds the construction, the
    attach-or-create of the namespace and step().
    """

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
        mount: str | os.PathLike[str] | list[str | os.PathLike[str]],
        namespace: str,
        dtype: torch.dtype | None = None,
        state_dtype: str = "fp32",
        grad_dtype: str | None = None,
        param_wire_dtype: str | None = None,
        max_grad_norm: float | None = None,
        streaming: bool = False,
        scaler: torch.amp.GradScaler | None = None,
        timeout_s: float | None = 120.0,
        use_cmb: bool = True,
        token_file: str | os.PathLike[str] | None = None,
        ca: str | os.PathLike[str] | None = None,
        cert: str | os.PathLike[str] | None = None,
        key: str | os.PathLike[str] | None = None,
        average_grads: bool | None = None,
        step_timeout_s: float = 300.0,
        process_group: Any = None,
        param_gather: str = "device",
        transport: str = "vendor",
        **torch_options: Any,
    ) -> None:
        # A ZeRO-1 job's params back: every rank reads all ("device") or its shard, then an all-gather.
        self._param_gather = distributed.param_gather_option(param_gather)
        # torch's own class validates every argument and supplies its defaults, so the param
        # groups (and state_dict) look exactly like the stock optimizer's.
        probe = self._torch_class([torch.nn.Parameter(torch.zeros(1))], **torch_options)
        # The first torch optimizer built imports torch.distributed.nn, whose defaults then
        # hold the job's process group for good; a rank that fails from here on would risk
        # aborting at exit instead of raising (captured_groups.py says why).
        release_captured_groups()
        defaults = dict(probe.defaults)
        for option in UNSUPPORTED:
            if defaults.get(option):
                raise ValueError(f"{option}=True is not supported by the cossd device")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
        if streaming and max_grad_norm is not None:
            raise ValueError(
                "streaming sends gradients before the global norm is known; clip with "
                "streaming=False"
            )
        # Several devices (mount=[...]): one namespace on each, stepped as one group.
        mounts = mount_list(mount)
        self._group = None
        if mounts is not None and streaming:
            raise ValueError("streaming=True is not supported over several devices (mount=[...]) yet; "
                             "use streaming=False")
        # A job of several ranks (torch.distributed initialized, world size > 1) shards the
        # optimizer: each rank sends its part of the gradients into the one namespace. (A
        # group's children get the group's Ranks, which may be a job of one process.)
        self._ranks = process_group if isinstance(process_group, Ranks) else distributed.current(process_group)
        if self._ranks is not None and streaming:
            raise ValueError("streaming=True is not supported by a sharded optimizer (torch.distributed "
                             f"with {self._ranks.world} ranks) yet; use streaming=False")
        if not step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {step_timeout_s}")
        if average_grads is not None and not isinstance(average_grads, bool):
            raise ValueError(f"average_grads must be True, False or None, got {average_grads!r}")
        # "cp": each step's gradients through the standard's Execute Program (adamw_step) over
        # the CMB instead of the vendor CMB_WRITE (docs/trainer.md); one device, one process.
        if transport not in ("vendor", "cp"):
            raise ValueError(f"transport must be 'vendor' or 'cp', got {transport!r}")
        if transport == "cp" and (mounts is not None or self._ranks is not None or not use_cmb):
            raise ValueError("transport='cp' runs on one device in one process, through the CMB (use_cmb=True)")
        self.step_timeout_s = float(step_timeout_s)
        self._average = average_grads
        self._job = 0
        self._seq = 0
        self._shard = []
        # fp16 and int8: block-scaled moments on the device (docs/trainer.md#state_dtype).
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype must be one of {', '.join(STATE_DTYPES)}, got {state_dtype!r}")
        # The gradients' format on the wire: None, the params' (dtype); "fp32" for exact parity
        # with an FP32 trainer at 6 B/param (docs/trainer.md#the-gradients-wire-format).
        if grad_dtype is not None and grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype must be None (the params' dtype) or one of {', '.join(GRAD_DTYPES)}, "
                             f"got {grad_dtype!r}")
        # FP8 (codes with a scale per tensor or per rank's slice) goes wherever the optimizer
        # sends its own steps; DeepSpeed's and FSDP2's bindings refuse it (grad_wire, sharded.py).
        self.grad_dtype = grad_dtype
        # FP8 params out: 1 B/param from the device, decoded here (trainer/param_fp8.py).
        # A group's device (process_group: the group's ranks) in one process is a job of one rank.
        param_fp8.check_option(param_wire_dtype, streaming=streaming,
                               sharded=self._ranks is not None and self._ranks.world > 1, transport=transport,
                               remote=mounts is None and is_remote(mount))
        self.param_wire_dtype = param_wire_dtype
        self._mode = "adamw" if defaults.get("decoupled_weight_decay") else "adam"
        self._initialized = False
        super().__init__(params, defaults)
        # A group's own options (given here; at step(), set since): what the kernel does not compute is refused.
        check_group_options(self.param_groups, self._mode)
        # What a namespace for params that a wrapper (DeepSpeed) puts in place of these is
        # made with: see _rebind.
        self._torch_options = dict(torch_options)
        # A storage server's credentials (mount="cossd://..."): each None part is looked up
        # in its environment variable by the client (docs/server.md).
        credentials = Credentials(token_file=token_file, ca=ca, cert=cert, key=key)
        self._credentials = credentials
        self._state_options = {"state_dtype": state_dtype, "grad_dtype": grad_dtype, "timeout_s": timeout_s, "use_cmb": use_cmb,
                               "token_file": token_file, "ca": ca, "cert": cert, "key": key}
        self._groups_at_init = list(self.param_groups)
        self._bound: dict[int, _DeviceAdam] = {}
        self.max_grad_norm = max_grad_norm
        self.streaming = streaming
        self.scaler = scaler
        self.state_dtype = state_dtype
        self.entries = self._plan()
        # FSDP1's FlatParameters (or its use_orig_params views): each rank holds a flat shard
        # that no layout of the namespace describes; refused on every rank before any exchange.
        fsdp.refuse_fsdp1(self.entries)
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
        # After a failed step(): what may have left the devices, the step label or the model's
        # params disagreeing (None: nothing), and whether the model's params may not be the
        # committed step's (a read-back due or failed). See _ensure_consistent.
        self._inconsistent: str | None = None
        self._params_behind = False
        self._step_begun = False
        self._streamed: set[int] = set()
        self._streamed_grads: dict[int, tuple[torch.Tensor, int]] = {}
        self._stream_scale = 1.0
        self._entry_of = {id(entry.param): entry for entry in self.entries}
        self._buckets: GradBuckets[tuple[Entry, StreamedGrad]] | None = None
        # Called with each tensor's index before its gradient is written (fault injection).
        self.before_grad_write: Callable[[int], None] | None = None
        # Set before any return below: step() asks every optimizer whether DeepSpeed binds it.
        self._deepspeed: Any = None
        self._ds_deferred = False
        if mounts is not None:
            self._open_group(mounts, namespace, self._ranks, self._make_group_child)
            self._note_params()
            self._initialized = True
            return
        assert isinstance(mount, (str, os.PathLike))  # mount_list answered None: one path or URL
        opened: list[NamespaceFiles] = []  # closed again where construction fails from here on

        def open_files() -> bool:
            """This rank's mount opened; whether its namespace waits for deepspeed.initialize.
            Where deepspeed is imported, the namespace waits for deepspeed.initialize (or the
            first step()) only where opening it now could not be right: it holds ZeRO's flat
            groups, or it is new and the job has several ranks (one namespace for all);
            meanwhile the reads ask the device (rebind.py). Else it opens now, as without
            DeepSpeed: deepspeed/zero.py."""
            self.files = NamespaceFiles(mount, namespace, timeout_s, use_cmb=use_cmb, credentials=credentials,
                                        command_set=transport)
            opened.append(self.files)
            if process_group is not None:
                return False
            from .deepspeed import zero as deepspeed_zero
            if "deepspeed" in sys.modules:
                return deepspeed_zero.defers(self, streaming, mounts is not None)
            # deepspeed may be imported later: its initialize must still bind this
            return deepspeed_zero.defers_before_import(self, streaming, mounts is not None)

        try:
            if self._ranks is None:
                self._ds_deferred = open_files()
            else:
                # One exchange before any rank goes on: a rank whose mount (or whose device read
                # here) fails fails every rank with its reason, whichever way the others would go
                # on: opening now (_open_sharded's exchanges), or waiting for deepspeed.initialize,
                # whose collectives are DeepSpeed's own.
                deferring = distributed.together(self._ranks, open_files,
                                                 "cossd: a rank could not open the optimizer", reraise_own=True)
                if len(set(deferring)) > 1:
                    raise RuntimeError(
                        f"cossd: ranks {[r for r, d in enumerate(deferring) if d]} would wait for deepspeed.initialize "
                        f"to open namespace {namespace!r} and ranks {[r for r, d in enumerate(deferring) if not d]} "
                        "would open it now (the namespace changed while they looked, or their environments differ: "
                        "WORLD_SIZE, the import of deepspeed); nothing was opened. Construct the optimizer again on "
                        "every rank")
                self._ds_deferred = deferring[self._ranks.rank]
        except BaseException:
            for files in opened:  # a healthy rank's mount too, where another rank's failed
                try:
                    files.close()
                except Exception:  # noqa: BLE001 - the construction's own error is the one to raise
                    pass
            raise
        if self._ds_deferred:
            self.cmb_pinned = False
            self._initialized = True
            return
        self._open_namespace()
        self._initialized = True
        if streaming:
            self.files.stream_slots()  # where streamed gradients go, worked out before any backward
            self._buckets = GradBuckets(self._write_grad_bucket)
            for entry in self.entries:
                entry.param.register_post_accumulate_grad_hook(self._on_grad_ready)

    # ------------------------------------------------------------------ setup

    def _open_namespace(self) -> None:
        """Attach to or create the namespace (where sharded, rank 0 for every rank)."""
        if self._ranks is None:
            self._ranks = distributed.current()  # a deferred open: DeepSpeed may have started the ranks since
        try:
            if self._ranks is None and fsdp.uses_fsdp(self.entries):
                # FSDP2 on a one-member mesh (torchtitan at one rank): the sharded path at world 1,
                # where each DTensor's local shard is the whole tensor (fsdp.local_pieces checks).
                if self.streaming:
                    raise ValueError("streaming=True is not supported with FSDP2 params; use streaming=False")
                self._ranks = SoloRanks()
            if self._ranks is not None:
                self._open_sharded()  # rank 0 opens it as below, then every rank follows
            else:
                # A load_state_dict that a killed job left half done is finished or undone first.
                done = namespace_swap.resolve_interrupted(self.files)
                if done is not None:
                    warnings.warn(f"cossd: {done}", RuntimeWarning, stacklevel=4)
                if self.files.exists():
                    self._attach()
                else:
                    self._create(initial_step=0, masters=None)
        except BaseException:
            self.files.close()
            raise
        # A GPU model's gradients and params cross between the GPU and the CMB: page-locked,
        # each crossing is one DMA instead of a copy through CUDA's staging buffer.
        self.cmb_pinned = self._pin_cmb_for_gpu()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initialized", False):
            raise NotImplementedError(
                "a cossd namespace's tensors are fixed when it is created: pass every param "
                "group to the constructor"
            )
        super().add_param_group(param_group)

    def _plan(self) -> list[Entry]:
        return plan(self.param_groups)

    def _infer_dtype(self) -> torch.dtype:
        return infer_dtype(self.entries)

    def _description(self, initial_step: int) -> dict[str, Any]:
        return description(self.files.name, self.entries, self.param_groups, self._mode, self.dtype,
                           self.state_dtype, initial_step, grad_dtype=self.grad_dtype,
                           param_wire_dtype=self.param_wire_dtype)

    def _create(self, initial_step: int, masters: list[torch.Tensor] | None) -> None:
        """Create the namespace and load the FP32 master weights (the params, or `masters`)."""
        self.files.create(self._description(initial_step))
        self._sent_hypers = [group_hyper(group) for group in self.param_groups]
        self._load_masters(masters)
        self.committed_step = initial_step

    def _master_loads(self, masters: list[torch.Tensor] | None) -> list[tuple[str, str, torch.Tensor]]:
        if masters is None:
            fsdp.refuse_one_rank(self.entries)  # sharded FSDP2 params load their rows elsewhere (sharded.py)
        return master_loads(self.entries, masters)

    def _load_masters(self, masters: list[torch.Tensor] | None) -> None:
        self.files.write_many(self._master_loads(masters))
        # The device rounds the masters to the wire dtype; the model starts from exactly that.
        self._read_params()

    def _read_params(self) -> None:
        """The committed params into the model (sharded.py, session.py), then each param's
        version noted: a later change to a param that is not this optimizer's own write (a
        model.load_state_dict) shows at step() (_follow_changed_params)."""
        self._params_behind = True  # until every param is read (a failure leaves it: re-read later)
        super()._read_params()
        self._params_behind = False
        self._note_params()

    def _check_config(self, config: dict[str, Any]) -> None:
        """Refuse a namespace that is not this model's (tensors, dtype, mode): nothing changes."""
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
        if config["grad_dtype"] != (self.grad_dtype or wire):
            raise ValueError(f"namespace {self.files.name!r} takes {config['grad_dtype']} gradients, this "
                             f"optimizer sends {self.grad_dtype or wire}: pass grad_dtype={config['grad_dtype']!r}")
        if config.get("param_wire_dtype") != self.param_wire_dtype:
            raise ValueError(f"namespace {self.files.name!r} sends params as {config.get('param_wire_dtype') or 'fp16/bf16'}"
                             f", this optimizer was made with param_wire_dtype={self.param_wire_dtype!r}: pass "
                             f"param_wire_dtype={config.get('param_wire_dtype')!r}")
        if config["hyperparameters"]["mode"] != self._mode:
            raise ValueError(f"namespace {self.files.name!r} runs {config['hyperparameters']['mode']}, "
                             f"not {self._mode}")
        # The moments' format decides how state_dict reads them (bf16 bits, or FP32).
        kept = config.get("state_dtype", "fp32")
        if kept != self.state_dtype:
            raise ValueError(f"namespace {self.files.name!r} keeps {kept} moments, this optimizer "
                             f"was made with state_dtype={self.state_dtype!r}: pass state_dtype={kept!r}")

    def _attach(self) -> None:
        """Reattach to an existing namespace: check it is this model's, then restore params."""
        config = self.files.config()
        self._check_config(config)
        self._sent_hypers = [
            {field: float(group[field]) for field in HYPER_FIELDS} for group in config["groups"]
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
        self._close_group()
        if self._buckets is not None:
            self._buckets.close()
            self._buckets = None
        self.files.close()

    def _new_child(self, group: dict[str, Any], namespace: str) -> _DeviceAdam:
        """An optimizer of this class for one param group, on a namespace of its own (Rebind)."""
        child = type(self).__new__(type(self))
        # The gradients come unscaled in FP32: BF16 on the wire keeps their range.
        _DeviceAdam.__init__(child, [group], mount=self.files.mountpoint, namespace=namespace,
                             dtype=torch.bfloat16, **self._state_options, **self._torch_options)
        return child

    def _make_group_child(self, groups: list[dict[str, Any]], mount: str, ranks: Ranks,
                          preset: dict[str, Any] | None = None) -> _DeviceAdam:
        """The optimizer of one device of a group (DeviceGroup): the groups' params on it, a
        shared step of the job's ranks on its namespace of the group's name. `preset`: its
        attributes set before it opens (FSDP2's rows and views, group.py)."""
        child = type(self).__new__(type(self))
        child.__dict__.update(preset or {})
        # One process: no all-reduce to average with (there is nothing to average).
        average = False if ranks.world == 1 else self._average
        _DeviceAdam.__init__(child, groups, mount=mount, namespace=self.files.name, dtype=self.dtype,
                             average_grads=average, step_timeout_s=self.step_timeout_s, process_group=ranks,
                             param_wire_dtype=self.param_wire_dtype, **self._state_options, **self._torch_options)
        return child

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step on the device: send gradients, commit, copy params back."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_options_at_step()
        if self._deepspeed is not None:  # DeepSpeed ZeRO 1/2: one of its per-group calls
            self._deepspeed.step()
            return loss
        if self._ds_deferred:
            from .deepspeed import zero as deepspeed_zero
            deepspeed_zero.open_deferred(self)
        if not self._bound and self._params_moved():
            if self._group is not None:
                raise self._group_refusal("a wrapper's replacement of the params (DeepSpeed)")
            if self._ranks is not None:
                raise NotImplementedError(
                    "the param groups hold other tensors than the sharded optimizer was made for (a "
                    "wrapper such as DeepSpeed's): not supported with torch.distributed sharding yet")
            self._rebind()
        if self._bound:
            self._step_bound()
            return loss
        # An earlier step() that failed past its begin: go on only where every device is at the
        # optimizer's step (the model's params read again where they may not be), else refuse.
        # Where the params were behind, this step's gradients came from a forward on them: the
        # params are read again, and this step refused (its gradients are not the committed
        # params' gradients), so the caller runs forward and backward again.
        stale = bool(self.__dict__.get("_params_behind"))
        try:
            self._ensure_consistent("step()")
            if stale:
                raise InconsistentStateError(
                    f"cossd: namespace {self.files.name!r}: step() refused: the model's params were not all step "
                    f"{self.committed_step}'s when this step's gradients were computed (reading them back after that "
                    "step failed); they are read again now. Run forward and backward again, then step()")
        except BaseException:
            if self._step_open:  # a streamed step began during backward, from those gradients: dropped
                self._abort("the step was refused before it was committed")
            raise
        if not self._check_grads():
            return loss
        loss_scale = grad_rules.loss_scale(self)
        found_inf = grad_rules.scaler_found_inf(self)
        clock = time.perf_counter
        timing = {"begin_s": 0.0}
        started = clock()
        # Set where a BEGIN goes to any device (a streamed step began during backward already):
        # from there on a failure may have moved some device, so it is checked (_ensure_consistent).
        self._step_begun = self._step_open
        try:
            if self._ranks is None or self._ranks.world == 1:
                self._follow_changed_params()
            # Several ranks: _step_sharded and _step_group check after the step's collectives
            # (the gradients' average, the norm), so a rank that refuses leaves none waiting there.
            if self._group is not None:
                result = self._step_group(loss_scale, timing)
            elif self._ranks is not None:
                result = self._step_sharded(loss_scale, timing)
            else:
                timing["begin_s"] = self._send_grads(loss_scale)
                committing = clock()
                timing["grads_s"] = committing - started - timing["begin_s"]
                result = self._commit()
                timing["commit_s"] = clock() - committing
        except BaseException as exc:
            self._abort(f"{type(exc).__name__}: {exc}"[:300])
            if self._step_begun:
                self._mark_inconsistent(f"step {self.committed_step + 1} failed after it was begun on the device(s) "
                                        f"({type(exc).__name__}: {str(exc)[:200]})")
            raise
        # The step is committed (and durable) on every device, or skipped there: its number is
        # recorded before the params are read back, so a failed read leaves no state labelled
        # with the step before.
        self.committed_step = int(result["committed_step"])
        self.last_step_skipped = bool(result["skipped"])
        if self.last_step_skipped:
            self.steps_skipped += 1
            if not found_inf and getattr(self, "found_inf", None) is not None:
                warnings.warn(
                    f"step {result['step']}: the device skipped it for non-finite gradients "
                    "that the GradScaler did not see (an overflow converting to "
                    f"{self.dtype}); use dtype=torch.bfloat16", RuntimeWarning, stacklevel=2)
        else:
            self._fresh_step = self.committed_step  # the step whose params the device just put out (FP8)
            reading = clock()
            try:
                self._read_group_params() if self._group is not None else self._read_params()
            except BaseException as exc:
                self._mark_inconsistent(f"step {self.committed_step} was committed on every device and reading its "
                                        f"params back into the model failed ({type(exc).__name__}: {str(exc)[:200]})")
                exc.add_note(f"cossd: step {self.committed_step} is committed (optimizer.committed_step is "
                             f"{self.committed_step}); the model's params may be partly the step before's. The next "
                             "step(), state_dict() or master_weights() reads them again (or refuses, saying why); a "
                             "step() whose gradients were computed before that is refused; a restart reads them too")
                raise
            finally:
                self.__dict__.pop("_fresh_step", None)
            timing["params_s"] = clock() - reading
        self.last_timing = timing
        return loss

    def _check_options_at_step(self) -> None:
        """The groups' options as step() finds them (a group's amsgrad, maximize or weight
        decay mode set after construction): refused as at construction, a streamed step
        that began dropped."""
        mode = self.__dict__.get("_mode")
        if mode is None:
            return
        try:
            check_group_options(self.param_groups, mode, " (found at step(): the groups' options are read at each "
                                "step, so one set after the optimizer was made counts too)")
        except ValueError:
            if self.__dict__.get("_step_open"):
                self._abort("a param group's options are not supported")
            raise

    # ------------------------------------------------------------------ gradients

    def _check_grads(self) -> bool:
        """True where every param has a gradient. None has one: False, after a warning and
        a count (nothing is sent, no step taken). Only some have: RuntimeError, for the
        device steps every tensor of a namespace, and a zero gradient is not torch's "no
        gradient" (moments would decay and weight decay apply where torch leaves the param
        alone)."""
        missing = grad_rules.missing(self.entries)
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
        raise grad_rules.partial_grads_error(missing, len(self.entries))

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip by global norm at the next steps (the device applies it as part of the scale)."""
        if self.streaming:
            raise ValueError("clipping needs streaming=False")
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        self.max_grad_norm = max_norm


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
