"""The binding of a cossd optimizer to DeepSpeed's ZeRO 1/2 wrapper (ZeroBinding, which deepspeed/zero3.py's Zero3Binding extends): the namespace of the flat groups, and one shared step over DeepSpeed's per-group step() calls.

deepspeed/zero.py holds the hooks that choose and open a binding; this module is apart so
that both bindings import it and neither imports the hooks (no import cycle).
"""
from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ...integrations.deepspeed import checkpoint_tag
from ..dcp import reference as dcp
from .. import grads as grad_rules
from .. import distributed
from ..distributed import Ranks
from ..plan import Entry
from ..shard import Piece


def tensor_name(group: int) -> str:
    """The namespace's tensor of param group `group`'s flat FP32 partitions."""
    return f"zero.g{group}"


def refuse_other_partitioning(wrapper: Any, groups: list[dict[str, Any]], dp_group: Any) -> None:
    """NotImplementedError, before anything is made, where DeepSpeed's ZeRO 1/2 partitions a
    param group over other ranks than the data-parallel ones. An MoE group (`moe: True`, as
    DeepSpeed's split_params_into_different_moe_groups_for_optimizer makes) is partitioned
    over its expert data-parallel group (stage_1_and_2.py's _configure_moe_settings), which is
    the data-parallel group only at ep_size 1: there a rank's partition id and the group's
    partition count are not its data-parallel rank and world, and each expert-parallel rank
    holds other experts, where the binding lays data-parallel rank r's partition at
    r * partition_size of one tensor per group (it would mislabel or misplace the experts, and
    index bit16 partitions the group does not have). Every rank sees the same groups, so
    every rank refuses alike, with no collective."""
    dp_ranks = dist.get_process_group_ranks(dp_group if dp_group is not None else dist.group.WORLD)
    for index, partitioned in enumerate(getattr(wrapper, "real_dp_process_group", None) or []):
        if partitioned is dp_group or (partitioned is not None
                                       and dist.get_process_group_ranks(partitioned) == dp_ranks):
            continue
        count = dist.get_world_size(group=partitioned)
        group = groups[index] if index < len(groups) else {}
        label = f"param group {index}" + (f" ({group['name']!r})" if group.get("name") is not None else "")
        stage = 2 if getattr(wrapper, "partition_gradients", False) else 1
        if group.get("moe"):
            over, fix = ("its experts' expert data-parallel group, where each expert-parallel rank holds other "
                         "experts", "Build the MoE layers with ep_size=1 (every rank holds every expert, and "
                         "DeepSpeed partitions their group over the data-parallel ranks, which cossd runs), or "
                         "train this model with another optimizer")
        else:
            over, fix = "a group other than the data-parallel one", "Train this model with another optimizer"
        raise NotImplementedError(
            f"DeepSpeed ZeRO stage {stage} partitions {label} over {count} rank{'s' if count != 1 else ''} "
            f"({over}), not the {len(dp_ranks)} data-parallel ranks: a cossd namespace holds one partition of "
            f"each param group per data-parallel rank, so it cannot place these partitions. {fix}")


class ZeroBinding:
    """What a cossd optimizer does under DeepSpeedZeroOptimizer: opens the namespace of the
    flat groups (at deepspeed.initialize) and runs one shared step over DeepSpeed's
    per-group step() calls."""

    def __init__(self, optimizer: Any, wrapper: Any) -> None:
        self.optimizer, self.wrapper = optimizer, wrapper
        group = wrapper.dp_process_group
        world = dist.get_world_size(group=group)
        # The groups as the optimizer was made with (DeepSpeed narrows param_groups per call).
        self.groups: list[dict[str, Any]] = list(optimizer.param_groups)
        refuse_other_partitioning(wrapper, self.groups, group)
        self.ranks = Ranks(dist.get_rank(group=group), world, None if world == dist.get_world_size() else group)
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
        self._init_step_state()

    def _init_step_state(self) -> None:
        """What a step and DeepSpeed's reloads keep between the calls (each binding's __init__)."""
        # The loss scale of the open step (a GradScaler's, where DeepSpeed's torch_autocast
        # steps the optimizer through one; else 1) and whether its found_inf was set.
        self._scale = 1.0
        self._found_inf = False
        self._scaled = False
        # Set by load_state_dict, cleared by the next step: the device holds the checkpoint's
        # masters, which a later refresh from the bit16 copies must not replace.
        self._rolled_back = False
        # Why this engine cannot step any more (a refused reload of the masters), else None.
        self._refused: str | None = None

    # ------------------------------------------------------------------ opening

    def open(self) -> None:
        """Rank 0 attaches or creates the namespace of the flat groups, the others wait (the
        sharded optimizer's opening); a new namespace gets every rank's masters before any
        rank goes on; a namespace that has trained (the quick restore) gives every rank its
        partitions' masters, and DeepSpeed's all-gather gives the model its params."""
        self._open_namespace(self._masters(), self._refresh_params)

    def _views(self) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's parts of the namespace's tensors: (tensor, first element, the view of
        DeepSpeed's FP32 partition that holds them)."""
        return [(piece.name, piece.start, self.partitions[piece.index].detach()[: piece.numel])
                for piece in self.pieces]

    def _masters(self) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's masters as DeepSpeed's FP32 partitions hold them now."""
        return [(name, start, view.to("cpu", torch.float32)) for name, start, view in self._views()]

    def _bit16_dtype(self) -> torch.dtype:
        """The dtype of DeepSpeed's bit16 copies of the partitions (the model's)."""
        return self.wrapper.parallel_partitioned_bit16_groups[0][self.ranks.rank].dtype

    def _refresh_params(self) -> None:
        """The masters read back into this rank's FP32 partitions and the bit16 copies, and the
        model's params gathered again from them (collective)."""
        self._read_masters()
        self.wrapper.update_lp_params()  # each rank's bit16 partition, then the all-gather

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
            # No rank begins a step (which seals the loading) before every rank's masters are in.
            distributed.together(ranks, lambda: opt.files.write_pieces(masters, role="master") if masters else None,
                                 f"cossd: loading the master weights of namespace {opt.files.name!r} failed")
        else:
            restore()

    def _read_masters(self) -> None:
        """The committed masters into this rank's flat FP32 partitions (padding left as is)."""
        reads = [(name, "master", start, view) for name, start, view in self._views()]
        if reads:
            self.optimizer.files.read_pieces_into(reads)

    # ------------------------------------------------------------------ DeepSpeed's reloads of the masters

    def hook_reloads(self) -> None:
        """Route DeepSpeed's refresh of its FP32 partitions from the bit16 copies (the model's
        weights) to the device too. engine.load_checkpoint calls it where it loads the model
        and not the optimizer's state (load_module_only=True, load_optimizer_states=False, a
        ZeRO checkpoint it cannot read), directly or through refresh_fp32_params; without
        this the device would step its old masters and the next step bring them back over
        the loaded weights."""
        wrapper = self.wrapper
        original = type(wrapper)._restore_from_bit16_weights

        def _restore_from_bit16_weights() -> None:
            original(wrapper)
            self.masters_from_bit16()

        wrapper._restore_from_bit16_weights = _restore_from_bit16_weights

    def masters_from_bit16(self) -> None:
        """DeepSpeed has just set this rank's FP32 partitions from the bit16 copies (every rank
        does, together). The device's masters follow them:

        - after load_state_dict of a cossd checkpoint (a rollback, no step since), the device
          holds the checkpoint's FP32 masters, which the bit16 copies only round: they are
          read back, and nothing changes on the device;
        - a namespace that has not stepped yet (still loading its initial weights, as right
          after deepspeed.initialize on a new namespace) takes them as its masters, every
          rank's before any rank goes on (the warm start);
        - a namespace that has trained cannot take new masters (the device seals them at the
          first step): where the copies are the device's masters rounded, nothing changes;
          else refused on every rank, naming how to warm-start, and the engine refuses to
          step or save from then on (its model holds weights the device does not)."""
        opt = self.optimizer
        self._refuse_if_broken()
        if opt._step_open:
            raise RuntimeError("DeepSpeed reloaded the master weights in the middle of a step")
        if self._rolled_back:
            self._read_masters()
            return
        loading = dcp._on_rank0(opt, lambda: bool(opt.files.statistics()["loading"]))
        if loading:
            distributed.together(self.ranks, lambda: opt.files.write_pieces(self._masters(), role="master"),
                                 f"cossd: loading the master weights of namespace {opt.files.name!r} failed")
            return
        same = distributed.together(self.ranks, self._same_as_device,
                                    f"cossd: reading the master weights of namespace {opt.files.name!r} failed")
        if all(same):
            self._read_masters()  # the device's FP32 masters, which the copies only round
            return
        name = opt.files.name
        self._refused = (
            f"DeepSpeed loaded new model weights (engine.load_checkpoint with load_module_only=True or "
            f"load_optimizer_states=False, or a checkpoint without the optimizer's state) into an engine whose "
            f"cossd namespace {name!r} has trained (committed step {opt.committed_step}): the device takes "
            "master weights only before a namespace's first step, so it cannot train on from them, and this "
            "engine refuses to step or save. To warm-start, call engine.load_checkpoint(..., "
            "load_module_only=True) right after deepspeed.initialize on a new namespace (or one deleted with "
            f"`cossd delete-ns {name}`), or load the weights into the model before deepspeed.initialize; to "
            "resume this run, load a checkpoint with its optimizer state")
        raise RuntimeError(self._refused)

    def _same_as_device(self) -> bool:
        """Whether this rank's FP32 partitions equal the device's masters rounded to the bit16
        copies' dtype (what a refresh from those copies gives where nothing else was loaded)."""
        views = self._views()
        if not views:
            return True
        masters = [(name, "master", start, torch.empty(view.numel(), dtype=torch.float32))
                   for name, start, view in views]
        self.optimizer.files.read_pieces_into(masters)
        dtype = self._bit16_dtype()
        return all(torch.equal(master.to(dtype), view.to("cpu").to(dtype))
                   for (_, _, _, master), (_, _, view) in zip(masters, views))

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
        self._refuse_if_broken()
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
            pieces.append((piece.name, piece.start, grad.detach().reshape(-1)[: piece.numel].to("cpu", opt.grad_wire)))
        started = time.perf_counter()
        with self._aborting():
            self._check_found_inf(pieces)
            if indices[0] == 0:
                narrowed = opt.param_groups
                opt.param_groups = self.groups  # every group's hyperparameters ride in the begin
                try:
                    opt.last_timing = {"begin_s": opt._begin_shared(pieces, 1.0 / self._begin_scale())}
                finally:
                    opt.param_groups = narrowed
            else:
                self._note_scaler()
                if pieces:
                    opt.files.write_pieces(pieces)
        self._next_group = indices[-1] + 1
        if self._next_group < len(self.groups):
            return
        self._commit(started)

    def _begin_scale(self) -> float:
        """The loss scale of the step the first call begins. DeepSpeed unscales (its own loss
        scaler) and clips before it calls step(): 1. Under its `torch_autocast` FP16 mode it
        steps the optimizer through a torch.amp.GradScaler instead, which, since this
        optimizer declares _step_supports_amp_scaling, leaves the gradients scaled and sets
        `grad_scale` (and `found_inf`) on it for the call: the device divides by that scale.
        The first call's scale is the one backward scaled every group's gradients with (DeepSpeed
        calls the scaler's update() after each group, which may change it before a later call
        of the same step), so it is the step's for every group."""
        self._scale = grad_rules.loss_scale(self.optimizer)
        self._scaled = getattr(self.optimizer, "grad_scale", None) is not None
        self._found_inf = False
        self._note_scaler()
        if not (self._scale > 0 and self._scale < float("inf")):
            raise RuntimeError(f"the GradScaler's grad_scale is {self._scale}: the gradients cannot be unscaled")
        return self._scale

    def _note_scaler(self) -> None:
        """A call's found_inf (the GradScaler's verdict on its group's gradients)."""
        self._found_inf |= grad_rules.scaler_found_inf(self.optimizer)
        self._scaled |= getattr(self.optimizer, "grad_scale", None) is not None

    def _check_found_inf(self, pieces: list[tuple[str, int, torch.Tensor]]) -> None:
        """Where the GradScaler found non-finite gradients in this call's group the device must
        skip the step, as torch's optimizer skips it: it does, for it finds them too (the
        scaler looked at these very tensors, and no cast makes inf or NaN finite). Checked,
        so that a step the scaler rejected can never commit: aborted on the device instead."""
        if not grad_rules.scaler_found_inf(self.optimizer):
            return
        if any(not bool(torch.isfinite(values).all()) for _, _, values in pieces):
            return
        self.optimizer._abort_shared("the GradScaler found non-finite gradients the device would not see")
        raise RuntimeError("the GradScaler found non-finite gradients in this param group, but none reach the "
                           "device: the step was aborted on the device (it stays at the step before)")

    def _refuse_if_broken(self) -> None:
        if self._refused is not None:
            raise RuntimeError(self._refused)

    @contextlib.contextmanager
    def _aborting(self) -> Iterator[None]:
        """Any error inside aborts the job's shared step on the device, then propagates."""
        try:
            yield
        except BaseException as exc:
            self.optimizer._abort_shared(f"{type(exc).__name__}: {exc}"[:300])
            raise

    def _commit(self, started: float) -> None:
        """The last call of a step: wait for the device's commit, then bring every group's new
        masters into DeepSpeed's bit16 copies. DeepSpeed copied each earlier group's partition
        right after that group's call, before the commit brought the new masters: copied again
        here (the current group's copy DeepSpeed makes after this returns)."""
        opt, clock = self.optimizer, time.perf_counter
        with self._aborting():
            committing = clock()
            opt.last_timing["grads_s"] = committing - started
            result = opt._wait_for_commit(opt.committed_step + 1)
            opt._step_open = False
            opt.last_timing["commit_s"] = clock() - committing
        # Committed (or skipped) on the device: recorded before the masters are read back, so a
        # failed read leaves no state labelled with the step before (its snapshot would be this step's).
        opt.committed_step = int(result["committed_step"])
        opt.last_step_skipped = bool(result["skipped"])
        if opt.last_step_skipped:
            opt.steps_skipped += 1
            if self._scaled and not self._found_inf:
                warnings.warn(
                    f"step {opt.committed_step + 1}: the device skipped it for non-finite gradients that this "
                    "rank's GradScaler did not see (another rank's, or an overflow converting to "
                    f"{opt.grad_wire}: then use grad_dtype='fp32')", RuntimeWarning, stacklevel=4)
        else:
            self._rolled_back = False
            reading = clock()
            self._read_masters()
            self._masters_to_params()
            opt.last_timing["params_s"] = clock() - reading

    # ------------------------------------------------------------------ DeepSpeed's checkpoints

    def state_dict(self) -> dict[str, Any]:
        """What DeepSpeed's save_checkpoint stores as this optimizer's state: no masters and no
        moments, only the param groups' options and a reference to a device snapshot of the
        committed step that rank 0 takes now (dcp.py's; `ds-<step>-<random>`, `dcp_keep`
        bounds how many are kept), with the checkpoint's tag."""
        opt = self.optimizer
        self._refuse_if_broken()
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
        self._rolled_back = True
        self._refused = None  # the device and the model hold the checkpoint's state again
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
