"""A cossd optimizer under DeepSpeed ZeRO 1/2 (ZeRO-3: deepspeed_zero3.py): every rank's flat FP32 partitions of every param group on one namespace, one shared step per engine.step().

DeepSpeedZeroOptimizer puts one flat FP32 partition per param group in the optimizer's
param groups (this rank's slice of the group's params laid end to end) and calls step() once
per group, with param_groups narrowed to that group. Here the namespace holds, for each
group, the whole flat group (`zero.g<N>`, its params end to end without DeepSpeed's tail
padding, so the layout does not depend on the world size); each rank's partition is one
element range of it. The first group's call begins the job's shared step and sends that
group's gradients, each later call sends its group's, and the last one waits for the commit,
which the device makes only once every rank's every partition has arrived. Nothing is
committed otherwise: a rank that dies between its gradients and the commit leaves the device
at the step before, for every rank.

The hooks that get the optimizer there live here too (the trainer's side of DeepSpeed): where
deepspeed is imported when a cossd optimizer is made, it leaves its namespace unopened only
where opening it then could not be right (`defers`: a namespace of ZeRO's flat groups, or a
new one in a job of several ranks), and reads nothing but the truth meanwhile
(`deferred_value`); `install` wraps DeepSpeedEngine._configure_optimizer so that
deepspeed.initialize refuses what cossd does not run (cossd.integrations.deepspeed reads
DeepSpeed's config and wrappers for that) before DeepSpeed wraps the optimizer, and `bind`s it
after, converting a namespace the constructor made and never stepped.
"""
from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ..integrations.deepspeed import checkpoint_tag, expected_world_size, refuse_config, world_size
from . import dcp
from .distributed import Ranks
from .plan import Entry
from .shard import Piece


def tensor_name(group: int) -> str:
    """The namespace's tensor of param group `group`'s flat FP32 partitions."""
    return f"zero.g{group}"


# ---------------------------------------------------------------------- the hooks

def holds_zero_groups(config: dict[str, Any]) -> bool:
    """Whether a namespace's config is DeepSpeed ZeRO's flat groups (`zero.g<N>` only)."""
    names = [tensor["name"] for tensor in config["tensors"]]
    return bool(names) and all(name.startswith("zero.g") for name in names)


def defers(optimizer: torch.optim.Optimizer, streaming: bool, several_devices: bool) -> bool:
    """Whether `optimizer`, made where deepspeed is imported, leaves its namespace unopened
    until deepspeed.initialize (or its first step) shows which tensors it steps. Only where
    the constructor cannot open it truthfully for every use: the namespace holds DeepSpeed
    ZeRO's flat groups (an earlier ZeRO job's; the model's params cannot attach to them), or
    it is new and the job has several ranks (one namespace for all, which deepspeed.initialize
    makes once). Anything else is opened at construction as without DeepSpeed, so that every
    read is true at once; `bind` converts a namespace made so and never stepped for ZeRO.
    Installs the hook, for one device and no streaming (neither runs under DeepSpeed's
    wrappers)."""
    if "deepspeed" not in sys.modules or streaming or several_devices:
        return False
    install()
    optimizer._ds_bindable = True  # type: ignore[attr-defined]
    files = optimizer.files  # type: ignore[attr-defined]
    if files.exists():
        return holds_zero_groups(files.config())
    optimizer._ds_fresh = True  # type: ignore[attr-defined]  # made by this optimizer, if anyone
    return expected_world_size() > 1


def install() -> None:
    """Wrap DeepSpeedEngine._configure_optimizer once: a cossd client optimizer is checked
    against the engine's config before DeepSpeed wraps it and bound after."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_optimizer
    if getattr(original, "_cossd_hook", False):
        return

    def _configure_optimizer(engine: Any, client_optimizer: Any, model_parameters: Any) -> Any:
        cossd = client_optimizer if getattr(client_optimizer, "_ds_bindable", False) else None
        if cossd is None:
            return original(engine, client_optimizer, model_parameters)
        try:
            if cossd._deepspeed is not None:
                raise RuntimeError(
                    "this cossd optimizer steps under a DeepSpeed engine already (an earlier "
                    "deepspeed.initialize): make a new optimizer for each engine")
            refuse_config(engine)
            answer = original(engine, client_optimizer, model_parameters)
        except BaseException:
            # Refused (by cossd or by DeepSpeed) before anything was stepped: the device is
            # left as before the optimizer was made. Best effort: the refusal is what is raised.
            try:
                release_unstepped(cossd)
            except Exception:  # a never-stepped namespace left behind is reattached or converted later
                pass
            raise
        bind(cossd, engine.optimizer)
        return answer

    _configure_optimizer._cossd_hook = True  # type: ignore[attr-defined]
    DeepSpeedEngine._configure_optimizer = _configure_optimizer


def bind(optimizer: Any, wrapper: Any) -> None:
    """After DeepSpeed wrapped `optimizer` (or not, at FP32 stage 0): open its namespace for
    the tensors it steps. ZeRO 1/2: every rank's flat partitions, one namespace, now (the
    quick restore of a trained one included; a namespace the constructor opened for the
    model's params and never stepped is converted at one rank). Any other wrapper at one
    rank: the namespace of the model's params as before, which the first step moves to the
    wrapper's tensors."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = isinstance(wrapper, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3))
    if zero and getattr(wrapper, "optimizer", None) is optimizer:
        if not optimizer._ds_deferred:
            _convert_for_zero(optimizer)
        if isinstance(wrapper, DeepSpeedZeroOptimizer_Stage3):
            from .deepspeed_zero3 import Zero3Binding
            binding: ZeroBinding = Zero3Binding(optimizer, wrapper)
        else:
            binding = ZeroBinding(optimizer, wrapper)
        optimizer._ds_deferred = False
        try:
            binding.open()
        except BaseException:
            optimizer._ds_deferred = True  # nothing was opened for a step to use
            raise
        optimizer._deepspeed = binding
        return
    world = world_size()
    if world > 1:
        raise NotImplementedError(
            f"DeepSpeed's {type(wrapper).__name__} with {world} ranks: a cossd optimizer runs "
            "under it in one process only; with several ranks use zero_optimization.stage 1, 2 or 3 "
            "(without data_types.grad_accum_dtype fp32 under BF16)")
    open_deferred(optimizer, f"DeepSpeed without ZeRO 1/2 (its {type(wrapper).__name__}) cannot step it")


def _never_stepped(optimizer: Any) -> bool:
    """Whether the namespace the optimizer opened holds only its initial weights (still
    loading: no step has sealed it), as the optimizer also believes."""
    if optimizer.restored or optimizer.committed_step != 0:
        return False
    return bool(optimizer.files.statistics()["loading"])


def _convert_for_zero(optimizer: Any) -> None:
    """The namespace the constructor opened for the model's own params goes, so that the
    ZeRO binding makes the one of the flat groups under the same name: only where it never
    stepped and one process runs the job. Else refused, naming why, with nothing changed."""
    files = optimizer.files
    name = files.name
    if not _never_stepped(optimizer):
        stats = files.statistics()
        raise RuntimeError(
            f"namespace {name!r} holds this model's own params at committed step {stats['committed_step']} "
            "(trained without DeepSpeed ZeRO, or at stage 0), where under ZeRO a namespace holds DeepSpeed's "
            "flat groups (zero.g0, ...): it cannot move to them. Use a new namespace name for the ZeRO job "
            f"(or delete this one with `cossd delete-ns {name}`); the device keeps it as it is")
    world = world_size()
    if world > 1:
        how = ("it was new and neither a process group nor a launcher's WORLD_SIZE said there would be "
               "several ranks" if getattr(optimizer, "_ds_fresh", False) else "it existed already")
        raise RuntimeError(
            f"deepspeed.initialize runs ZeRO at {world} ranks, but this optimizer opened namespace {name!r} "
            f"for the model's own params when it was made ({how}), where every rank's partitions must go to "
            "one namespace that deepspeed.initialize opens. Delete it (`cossd delete-ns "
            f"{name}`; it never stepped) and make the optimizer under torchrun or the deepspeed launcher, "
            "or after deepspeed.init_distributed()")
    _reopen_empty(optimizer)


def release_unstepped(optimizer: Any) -> None:
    """Where a refused deepspeed.initialize leaves an optimizer that made its namespace at
    construction and never stepped it: the namespace goes and the optimizer defers again
    (its first step makes it anew), so the refusal changes nothing on the device."""
    if (optimizer._ds_deferred or optimizer._deepspeed is not None or not getattr(optimizer, "_ds_fresh", False)
            or world_size() > 1 or not optimizer.files.exists() or not _never_stepped(optimizer)):
        return
    _reopen_empty(optimizer)
    optimizer._ds_deferred = True


def _reopen_empty(optimizer: Any) -> None:
    """Delete the optimizer's never-stepped namespace; its files point at the name again,
    with no namespace behind it (the binding or the first step makes one)."""
    from .namespace_files import NamespaceFiles

    old = optimizer.files
    if old.exists():
        old.delete()
    old.close()
    options = optimizer._state_options
    optimizer.files = NamespaceFiles(old.mountpoint, old.name, options["timeout_s"], use_cmb=options["use_cmb"],
                                     credentials=old.credentials, command_set=old.command_set)
    optimizer.cmb_pinned = False  # the old files' pinning went with them


def open_deferred(optimizer: Any,
                  refusal: str = "step(), state_dict() and load_state_dict() cannot open it without it") -> None:
    """Open the namespace a deferring optimizer left unopened, as its construction would have
    (at its first use where DeepSpeed never bound it). A namespace of DeepSpeed ZeRO's flat
    groups is refused (only deepspeed.initialize with ZeRO can open it), saying `refusal`."""
    if not getattr(optimizer, "_ds_deferred", False):
        return
    files = optimizer.files
    if files.exists() and holds_zero_groups(files.config()):
        raise ValueError(zero_layout_message(optimizer, refusal))
    optimizer._ds_deferred = False
    if optimizer._params_moved() and not files.exists():
        # A wrapper (DeepSpeed at stage 0) put its FP32 copies in the param groups: the first
        # step makes the namespace for them (Rebind._rebind), none for the model's params.
        return
    optimizer._open_namespace()


def zero_layout_message(optimizer: Any, clause: str) -> str:
    """Why a deferring optimizer whose namespace holds ZeRO's flat groups refuses a use (`clause`)."""
    name = optimizer.files.name
    return (f"namespace {name!r} holds DeepSpeed ZeRO's flat param groups (zero.g0, ...), from an earlier ZeRO "
            f"job: only deepspeed.initialize with ZeRO stage 1, 2 or 3 opens it (and reads the model's params back "
            f"from it); {clause}. Without DeepSpeed ZeRO this optimizer needs a namespace of the model's own "
            f"params: use another name, or delete it with `cossd delete-ns {name}`")


def deferred_value(optimizer: Any, what: str, kept: Any) -> Any:
    """What `what` (committed_step, steps_skipped or restored) truthfully reads while the
    namespace waits for deepspeed.initialize: `kept` (the constructor's) where there is no
    namespace yet (nothing has trained); the device's count where there is one; `restored`
    there only once its answer is known (False for a namespace that never stepped), else
    RuntimeError: the params are read back at deepspeed.initialize, not yet."""
    files = optimizer.files
    if not files.exists():
        return kept
    stats = files.statistics()
    if what == "restored":
        if stats["loading"]:
            return False
        raise RuntimeError(
            f"restored is not known yet: namespace {files.name!r} has trained (committed step "
            f"{stats['committed_step']}) and deepspeed.initialize reads its params back into the model. Read "
            "restored after deepspeed.initialize (committed_step already reads the device's step)")
    return int(stats[what])


# ---------------------------------------------------------------------- the binding

class ZeroBinding:
    """What a cossd optimizer does under DeepSpeedZeroOptimizer: opens the namespace of the
    flat groups (at deepspeed.initialize) and runs one shared step over DeepSpeed's
    per-group step() calls."""

    def __init__(self, optimizer: Any, wrapper: Any) -> None:
        self.optimizer, self.wrapper = optimizer, wrapper
        group = wrapper.dp_process_group
        world = dist.get_world_size(group=group)
        self.ranks = Ranks(dist.get_rank(group=group), world, None if world == dist.get_world_size() else group)
        # The groups as the optimizer was made with (DeepSpeed narrows param_groups per call).
        self.groups: list[dict[str, Any]] = list(optimizer.param_groups)
        self.partitions: list[torch.Tensor] = list(wrapper.single_partition_of_fp32_groups)
        if len(self.partitions) != len(self.groups):
            raise RuntimeError(f"DeepSpeed made {len(self.partitions)} flat partitions for "
                               f"{len(self.groups)} param groups; cossd cannot tell which is whose")
        # Each rank's partition of a group starts at rank * partition_size of the flat group;
        # its last elements may be DeepSpeed's tail padding (none of the model's params).
        sizes = [int(size) for size in wrapper.partition_size]
        valid = [size - int(padding) for size, padding in zip(sizes, wrapper.groups_padding)]
        every = self.ranks.gather(valid)
        totals = [sum(theirs[index] for theirs in every) for index in range(len(self.groups))]
        self.valid = valid
        self.pieces: list[Piece] = []
        for index, (size, length) in enumerate(zip(sizes, valid)):
            start = self.ranks.rank * size
            if length > 0:
                if start + length > totals[index]:
                    raise RuntimeError(f"DeepSpeed's partition of group {index} on rank {self.ranks.rank} "
                                       "is not where cossd expects it (padding inside the flat group)")
                self.pieces.append(Piece(index, tensor_name(index), start, start + length))
        self.entries = [Entry(index, tensor_name(index), index, torch.empty(total, device="meta"))
                        for index, total in enumerate(totals)]
        self._next_group = 0

    # ------------------------------------------------------------------ opening

    def open(self) -> None:
        """Rank 0 attaches or creates the namespace of the flat groups, the others wait (the
        sharded optimizer's opening); a new namespace gets every rank's masters before any
        rank goes on; a namespace that has trained (the quick restore) gives every rank its
        partitions' masters, and DeepSpeed's all-gather gives the model its params."""
        masters = [(piece.name, piece.start, self.partitions[piece.index][: piece.numel].detach()
                    .to("cpu", torch.float32)) for piece in self.pieces]

        def restore() -> None:
            self._read_masters()
            self.wrapper.update_lp_params()  # each rank's bit16 partition, then the all-gather

        self._open_namespace(masters, restore)

    def _open_namespace(self, masters: list[tuple[str, int, torch.Tensor]], restore: Any) -> None:
        """The opening of every stage: this rank's `masters` loaded where the namespace is
        new (no rank goes on before every rank's are in), else `restore()` (collective)."""
        opt, ranks = self.optimizer, self.ranks
        opt.entries = self.entries
        opt._entry_of = {}
        opt._ranks = ranks
        opt._shard = self.pieces
        opt._shards = None
        opt._average = False  # DeepSpeed reduced the gradients before its step
        # DeepSpeed hands over unscaled FP32 gradients: BF16 on the wire keeps their range.
        opt.dtype = torch.bfloat16
        setup = opt._setup_from_rank0(on_fsdp=True)
        opt._job = int(setup["job"])
        opt.restored = bool(setup["restored"])
        opt.committed_step = int(setup["committed_step"])
        opt.steps_skipped = int(setup["steps_skipped"])
        if setup["loading"]:
            outcome: dict[str, str] = {}
            try:
                if masters:
                    opt.files.write_pieces(masters, role="master")
            except BaseException as exc:
                outcome["error"] = f"{type(exc).__name__}: {exc}"
            # No rank begins a step (which seals the loading) before every rank's masters are in.
            failed = [(rank, theirs["error"]) for rank, theirs in enumerate(ranks.gather(outcome))
                      if "error" in theirs]
            if failed:
                raise RuntimeError("; ".join(f"rank {rank} could not load its master weights: {why}"
                                             for rank, why in failed))
        else:
            restore()

    def _read_masters(self) -> None:
        """The committed masters into this rank's flat FP32 partitions, and their bit16 copies."""
        reads = [(piece.name, "master", piece.start, self.partitions[piece.index][: piece.numel])
                 for piece in self.pieces]
        if reads:
            self.optimizer.files.read_pieces_into(reads)

    # ------------------------------------------------------------------ the step

    def _indices(self, given: list[dict[str, Any]]) -> list[int]:
        indices = []
        for group in given:
            found = [index for index, known in enumerate(self.groups) if known is group]
            if not found:
                raise RuntimeError("step() was given a param group that DeepSpeed's ZeRO optimizer did not make")
            indices.append(found[0])
        if indices != list(range(indices[0], indices[0] + len(indices))):
            raise RuntimeError(f"step() was given param groups {indices} out of order")
        return indices

    def step(self) -> None:
        """The groups of this call: the first begins the shared step, each sends its
        gradients, the last waits for the commit and brings every group's masters back."""
        opt = self.optimizer
        indices = self._indices(list(opt.param_groups))
        if indices[0] == 0 and opt._step_open:
            opt._abort_shared("a new step began before the last one's final param group")
        if indices[0] != (0 if not opt._step_open else self._next_group):
            opt._abort_shared(f"param group {indices[0]} stepped out of turn")
            raise RuntimeError(f"DeepSpeed stepped param group {indices[0]} where cossd expected group "
                               f"{self._next_group}; the step was aborted on the device")
        wanted = set(indices)
        pieces = []
        for piece in self.pieces:
            if piece.index not in wanted:
                continue
            grad = self.partitions[piece.index].grad
            if grad is None:
                opt._abort_shared(f"param group {piece.index} has no gradient")
                raise RuntimeError(f"DeepSpeed's flat partition of param group {piece.index} has no gradient")
            pieces.append((piece.name, piece.start, grad.detach().reshape(-1)[: piece.numel].to("cpu", opt.dtype)))
        clock = time.perf_counter
        started = clock()
        try:
            if indices[0] == 0:
                narrowed = opt.param_groups
                opt.param_groups = self.groups  # every group's hyperparameters ride in the begin
                try:
                    # DeepSpeed unscaled and clipped the gradients already: scale 1.
                    opt.last_timing = {"begin_s": opt._begin_shared(pieces, 1.0)}
                finally:
                    opt.param_groups = narrowed
            elif pieces:
                opt.files.write_pieces(pieces)
            self._next_group = indices[-1] + 1
            if self._next_group < len(self.groups):
                return
            committing = clock()
            opt.last_timing["grads_s"] = committing - started
            result = opt._wait_for_commit(opt.committed_step + 1)
            opt._step_open = False
            opt.last_timing["commit_s"] = clock() - committing
        except BaseException as exc:
            opt._abort_shared(f"{type(exc).__name__}: {exc}"[:300])
            raise
        opt.last_step_skipped = bool(result["skipped"])
        if opt.last_step_skipped:
            opt.steps_skipped += 1
        else:
            reading = clock()
            self._read_masters()
            # DeepSpeed copied each earlier group's partition into its bit16 copy right after
            # that group's call, before the commit brought the new masters: copied again here
            # (the current group's copy DeepSpeed makes after this returns).
            self._masters_to_params()
            opt.last_timing["params_s"] = clock() - reading
        opt.committed_step = int(result["committed_step"])

    # ------------------------------------------------------------------ DeepSpeed's checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What DeepSpeed's save_checkpoint stores as this optimizer's state: no masters and no
        moments, only the param groups' options and a reference to a device snapshot of the
        committed step that rank 0 takes now (dcp.py's; `ds-<step>-<random>`, `dcp_keep`
        bounds how many are kept), with the checkpoint's tag."""
        opt = self.optimizer
        groups = []
        for index, group in enumerate(self.groups):
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = [index]
            groups.append(packed)
        if opt._step_open:
            raise RuntimeError("save_checkpoint in the middle of engine.step() (some param groups stepped, "
                               "not all): save between steps")
        reference = dcp._on_rank0(opt, lambda: dcp._take_snapshot(opt, SNAPSHOT_PREFIX))
        return {"state": {}, "param_groups": groups, REFERENCE: dict(reference, tag=checkpoint_tag())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """DeepSpeed's load_checkpoint: the namespace rolled back to the snapshot that the
        checkpoint's reference names (rank 0, for every rank), then each rank's partitions get
        its masters. A snapshot that is gone, or a checkpoint of another optimizer, is refused
        naming the tag, and nothing changes."""
        opt = self.optimizer
        reference = state_dict.get(REFERENCE) if isinstance(state_dict, dict) else None
        if not isinstance(reference, dict) or "snapshot" not in reference:
            raise ValueError(
                "under DeepSpeed ZeRO the cossd optimizer loads only checkpoints it saved itself (a "
                "reference to a device snapshot); this one holds "
                f"{'an older cossd reference without a snapshot' if isinstance(reference, dict) else 'optimizer state of another optimizer'}. "
                "Load it into a job with that optimizer, or start the cossd run from the device's committed step "
                "(deepspeed.initialize restores it) or from the model's weights")
        saved = state_dict.get("param_groups")
        if not isinstance(saved, list) or len(saved) != len(self.groups):
            raise ValueError(f"the checkpoint has {len(saved) if isinstance(saved, list) else 'no'} param groups, "
                             f"this optimizer {len(self.groups)}")
        tag = reference.get("tag") or checkpoint_tag()
        snapshot = {key: value for key, value in reference.items() if key != "tag"}
        outcome = dcp._on_rank0(opt, lambda: dcp._roll_back(opt, snapshot, f"DeepSpeed checkpoint tag {tag!r}"))
        opt.committed_step = int(outcome["committed_step"])
        opt.steps_skipped = int(outcome["steps_skipped"])
        opt.last_step_skipped = False
        opt.restored = True
        opt._step_open = False
        self._next_group = 0
        for group, theirs in zip(self.groups, saved):
            group.update({key: value for key, value in theirs.items() if key != "params"})
        # The snapshot's masters into this rank's partitions and their bit16 copies. (DeepSpeed
        # then loads its own copy of the FP32 partitions and the model, the same values: both
        # were taken from the device at that step.)
        self._read_masters()
        self._masters_to_params()

    def _masters_to_params(self) -> None:
        """This rank's FP32 partitions into their bit16 copies."""
        for index, bit16 in enumerate(self.wrapper.parallel_partitioned_bit16_groups):
            bit16[self.ranks.rank].data.copy_(self.partitions[index].data)


# The prefix of the device snapshots DeepSpeed's save_checkpoint takes (dcp.py takes them).
SNAPSHOT_PREFIX = "ds-"
# The key of a cossd reference in the optimizer state DeepSpeed saves.
REFERENCE = "cossd_device_state"
