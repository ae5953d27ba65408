"""A cossd optimizer under DeepSpeed ZeRO-3: each rank's slice of every param on the namespace of ZeRO's flat groups, one shared step per engine.step().

DeepSpeedZeroOptimizer_Stage3 cuts every param into one slice per rank (rank r holds
elements r*s .. r*s+s-1 of the flattened param, s = ceil(numel / world), the last rank's
tail padded), lays this rank's slices of a sub-group's params end to end in one flat FP32
tensor (`fp32_partitioned_groups_flat[i]`), and steps the sub-groups one at a time: before
each optimizer.step() it puts that one flat tensor in its param group's params and leaves
every other group's params empty, and after it copies the tensor to the bit16 slices.

The namespace is the one ZeRO 1/2 use (deepspeed/zero.py): `zero.g<N>` holds param group
N's params end to end, without padding, so it does not depend on the world size or the
stage. A rank's part of it is one element range per param (its slice), not one range per
group as at ZeRO 1/2. The first sub-group's call begins the job's shared step, each call
sends its sub-group's slices, and the last waits for the commit, which the device makes
only once every rank has sent all of its slices; then every sub-group's masters come back.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from .binding import ZeroBinding, tensor_name
from ..distributed import Ranks
from ..plan import Entry
from ..shard import Piece


class Zero3Binding(ZeroBinding):
    """What a cossd optimizer does under DeepSpeedZeroOptimizer_Stage3: the namespace of the
    flat groups opened at deepspeed.initialize, one shared step over DeepSpeed's
    per-sub-group step() calls, and DeepSpeed's checkpoints as device snapshots (the
    state_dict and load_state_dict of ZeroBinding)."""

    def __init__(self, optimizer: Any, wrapper: Any) -> None:  # noqa: D107 (ZeroBinding's fields)
        self.optimizer, self.wrapper = optimizer, wrapper
        group = wrapper.dp_process_group
        world = dist.get_world_size(group=group)
        for index in range(len(wrapper.fp16_groups)):
            if wrapper._get_sub_group_partition_count(index) != world:
                raise NotImplementedError(
                    f"DeepSpeed ZeRO-3 partitions sub-group {index} over "
                    f"{wrapper._get_sub_group_partition_count(index)} ranks, not the {world} data-parallel "
                    "ranks (expert or hpZ partitioning): a cossd namespace holds one slice per data-parallel rank")
        self.ranks = Ranks(dist.get_rank(group=group), world, None if world == dist.get_world_size() else group)
        # The groups as the optimizer was made with: ZeRO-3 empties their params and fills
        # one group's with one flat tensor for each step() call, in these same dicts.
        self.groups: list[dict[str, Any]] = list(optimizer.param_groups)
        self.flats: list[torch.Tensor] = list(wrapper.fp32_partitioned_groups_flat)
        self.owner = [int(wrapper.sub_group_to_group_id[index]) for index in range(len(self.flats))]
        stepped = sorted(set(self.owner))
        if stepped != list(range(len(self.groups))) or self.owner != sorted(self.owner):
            raise NotImplementedError(
                f"DeepSpeed ZeRO-3 steps param groups {stepped} (in the order {self.owner}) of the "
                f"{len(self.groups)} the optimizer was made with: cossd needs every group to hold a trainable "
                "param (a group of frozen params only has nothing on the device); leave such groups out")
        rank = self.ranks.rank
        totals = [0] * len(self.groups)
        # Per sub-group: (this rank's offset in the flat tensor, the piece of zero.g<N> it is).
        self.slices: list[list[tuple[int, Piece]]] = []
        for index, params in enumerate(wrapper.fp16_groups):
            owner, offset, mine = self.owner[index], 0, []
            for param in params:
                numel, size = int(param.ds_numel), int(param.partition_numel())
                start, stop = rank * size, min((rank + 1) * size, numel)
                if start < stop:  # a small param may leave the last ranks nothing of it
                    base = totals[owner]
                    mine.append((offset, Piece(owner, tensor_name(owner), base + start, base + stop)))
                offset += size
                totals[owner] += numel
            if offset != self.flats[index].numel():
                raise RuntimeError(f"DeepSpeed's flat FP32 partition of sub-group {index} holds "
                                   f"{self.flats[index].numel()} elements, its params' slices {offset}")
            self.slices.append(mine)
        self.pieces = [piece for mine in self.slices for _, piece in mine]
        self.entries = [Entry(index, tensor_name(index), index, torch.empty(total, device="meta"))
                        for index, total in enumerate(totals)]
        self._next_group = 0  # here: the next sub-group
        self._init_step_state()

    # ------------------------------------------------------------------ masters and params

    def _views(self) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's slices of the namespace's tensors in its flat FP32 partitions (padding left out)."""
        return [(piece.name, piece.start, self.flats[index].detach()[offset: offset + piece.numel])
                for index, mine in enumerate(self.slices) for offset, piece in mine]

    def _bit16_dtype(self) -> torch.dtype:
        return self.wrapper.fp16_partitioned_groups_flat[0].dtype

    def _masters_to_params(self) -> None:
        """Each sub-group's FP32 partition into its bit16 slices (DeepSpeed's own copy after a step)."""
        for index, flat in enumerate(self.flats):
            self.wrapper.fp16_partitioned_groups_flat[index].data.copy_(flat.data)
            self.wrapper._unflatten_partitioned_parameters(index)

    def _refresh_params(self) -> None:
        """The masters read back into the slices, and the params DeepSpeed keeps gathered
        (its persistent ones) gathered again from them: collective, every rank at once."""
        self.wrapper.checkpoint_event_prologue()  # releases the gathered params
        self._read_masters()
        self._masters_to_params()
        self.wrapper.checkpoint_event_epilogue()  # gathers the persistent ones again

    # ------------------------------------------------------------------ opening

    def open(self) -> None:
        """As at ZeRO 1/2 (ZeroBinding.open): rank 0 attaches or creates, a new namespace
        gets every rank's slices of the masters before any rank goes on; one that has
        trained gives every rank its slices, and the model its params."""
        self._open_namespace(self._masters(), self._refresh_params)

    # ------------------------------------------------------------------ the step

    def _sub_group(self) -> int:
        """The sub-group of this step() call: the one flat tensor in the param groups."""
        held = [param for group in self.optimizer.param_groups for param in group["params"]]
        found = [index for index, flat in enumerate(self.flats) if len(held) == 1 and held[0] is flat]
        if not found:
            raise RuntimeError("step() was given other tensors than one of DeepSpeed ZeRO-3's flat FP32 "
                               "partitions, which cossd opened the namespace for")
        return found[0]

    def step(self) -> None:
        """A sub-group's call: the first begins the shared step, each sends its slices, the
        last waits for the commit and brings every sub-group's masters back."""
        opt = self.optimizer
        self._refuse_if_broken()
        index = self._sub_group()
        if index == 0 and opt._step_open:
            opt._abort_shared("a new step began before the last one's final sub-group")
        if index != (0 if not opt._step_open else self._next_group):
            opt._abort_shared(f"sub-group {index} stepped out of turn")
            raise RuntimeError(f"DeepSpeed ZeRO-3 stepped sub-group {index} where cossd expected "
                               f"{self._next_group}; the step was aborted on the device")
        grad = self.flats[index].grad
        if grad is None:
            opt._abort_shared(f"sub-group {index} has no gradient")
            raise RuntimeError(f"DeepSpeed's flat partition of sub-group {index} has no gradient")
        flat = grad.detach().reshape(-1)
        # The gradients cross in the optimizer's grad_wire, as ZeRO 1/2's (FP32 unrounded with
        # grad_dtype="fp32"); the params' dtype here made the namespace's FP32 gradients half-size.
        pieces = [(piece.name, piece.start, flat[offset: offset + piece.numel].to("cpu", opt.grad_wire))
                  for offset, piece in self.slices[index]]
        started = time.perf_counter()
        with self._aborting():
            self._check_found_inf(pieces)
            if index == 0:
                # DeepSpeed unscaled and clipped the gradients already (scale 1), or its
                # torch_autocast GradScaler set grad_scale (ZeroBinding._begin_scale). Every
                # group's hyperparameters ride in the begin (the dicts are the optimizer's own).
                opt.last_timing = {"begin_s": opt._begin_shared(pieces, 1.0 / self._begin_scale())}
            else:
                self._note_scaler()
                if pieces:
                    opt.files.write_pieces(pieces)
        self._next_group = index + 1
        if self._next_group < len(self.flats):
            return
        # The last sub-group's bit16 copy DeepSpeed makes after this returns, then it gathers.
        self._commit(started)
