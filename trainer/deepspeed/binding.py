"""The binding of a cossd optimizer to DeepSpeed's ZeRO 1/2 wrapper (ZeroBinding, which deepspeed/zero3.py's Zero3Binding extends): the namespace of the flat groups, and one shared step over DeepSpeed's per-group step() calls.

deepspeed/zero.py holds the hooks that choose and open a binding; this module is apart so
that both bindings import it and neither imports the hooks (no import cycle).
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ...integrations.deepspeed import checkpoint_tag
from ..dcp import reference as dcp
from ..distributed import Ranks
from ..plan import Entry
from ..shard import Piece


def tensor_name(group: int) -> str:
    """The namespace's tensor of param group `group`'s flat FP32 partitions."""
    return f"zero.g{group}"


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
            pieces.append((piece.name, piece.start, grad.detach().reshape(-1)[: piece.numel].to("cpu", opt.grad_wire)))
        started = time.perf_counter()
        with self._aborting():
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
        self._commit(started)

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
        opt.last_step_skipped = bool(result["skipped"])
        if opt.last_step_skipped:
            opt.steps_skipped += 1
        else:
            reading = clock()
            self._read_masters()
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
