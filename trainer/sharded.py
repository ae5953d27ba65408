"""A sharded optimizer (ZeRO-1 over torch.distributed, or FSDP2's DTensor params): the namespace opened by rank 0 for every rank, its shard's gradients out, one shared step per iteration, the params back."""
from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable

import torch

from ..protocol.status import DeviceError, Status
from . import distributed, fsdp
from . import grads as grad_rules
from .namespace import swap as namespace_swap
from .distributed import Ranks
from .namespace.files import GRAD_TORCH_DTYPES, DeviceLostError, NamespaceFiles
from .plan import FP8_GRAD_DTYPES, HYPER_FIELDS, Entry, group_hyper
from .shard import Piece, plan_shards


class StepAbortedError(RuntimeError):
    """A shared step that did not commit on any rank (a rank died or stopped sending, or one
    rank's step failed); the device stays at the step before it, for every rank."""


class ShardedSession:
    """The multi-rank half of the device session (a mixin of optim._DeviceAdam: where
    torch.distributed runs more than one rank, `_ranks` is set and step() comes here)."""

    # Set by the optimizer (optim._DeviceAdam.__init__); the methods named here are its own.
    files: NamespaceFiles
    entries: list[Entry]
    param_groups: list[dict[str, Any]]
    dtype: torch.dtype
    grad_wire: torch.dtype  # the gradients' wire dtype (session.DeviceSession.grad_wire)
    grad_dtype: str | None  # FP8: the pieces go out as codes with their slices' scales (_begin_shared)
    max_grad_norm: float | None
    last_grad_norm: float | None
    committed_step: int
    steps_skipped: int
    restored: bool
    before_grad_write: Callable[[int], None] | None
    _ranks: Ranks | None
    _sent_hypers: list[dict[str, float]]
    _step_open: bool
    _step_begun: bool  # a BEGIN went to the device in this step() (optim.step)
    last_step_skipped: bool
    load_hook: Callable[[str], None] | None
    # The optimizer's methods these call (optim.py), declared here only: a class-level
    # annotation makes no attribute, the MRO finds theirs.
    _check_config: Callable[[dict[str, Any]], None]
    _attach: Callable[[], None]
    _create: Callable[..., None]
    _description: Callable[[int], dict[str, Any]]
    # The job's id on the device (rank 0 draws it), this rank's pieces, the bound on the
    # wait for the other ranks, and whether the optimizer averages the gradients (None:
    # decided at the first step, when a DDP wrapper made after the optimizer exists).
    _job: int
    _seq: int  # the job's shared steps begun so far (the same count on every rank)
    _shard: list[Piece]
    step_timeout_s: float
    _check_changed_params_of_ranks: Callable[[], None]  # step_guards.StepGuards
    _average: bool | None
    # How a ZeRO-1 rank gets the params back (distributed.param_gather_option); every rank's
    # shard, for the all-gather (None until the shards are planned: reads before then are
    # whole); whether FSDP2 holds the params (DTensors: each rank's shard is its own rows).
    _param_gather: str = "device"
    _shards: list[list[Piece]] | None = None
    _fsdp: bool = False
    # A group's device under FSDP2 (group.py): this rank's rows of the device's pieces, and
    # where their local elements are (fsdp.Views), given before opening; None elsewhere.
    _fsdp_rows: list[Piece] | None = None
    _fsdp_views: fsdp.Views | None = None
    # Whether this rank sends its rows (HSDP: only replica 0's ranks do), and the rows it
    # reads back (every rank, its own).
    _fsdp_sends: bool = True
    _read_rows: list[Piece] | None = None
    # The bytes this rank's last read of the params moved: from the device, and through the
    # all-gather (sent, received); for the bench.
    last_param_bytes: dict[str, int] | None = None

    # ------------------------------------------------------------------ opening

    def _open_sharded(self) -> None:
        """Every rank opens the one namespace: rank 0 attaches or creates it (and drops a
        step an earlier job left open) while the others wait, then each takes its shard
        and the committed params. Bad setups fail on every rank, with the same message."""
        ranks = self._ranks
        assert ranks is not None
        layout = [(entry.name, entry.numel, entry.group) for entry in self.entries]
        rows: list[Piece] = []

        def local_layout() -> dict[str, Any]:
            # FSDP2's params (DTensors): the namespace holds the global tensors (their names and
            # sizes are the layout), each rank's part is its own rows; an unsupported placement
            # fails here, on this rank with its reason and on the others with this rank's.
            nonlocal rows
            if self._fsdp_rows is not None:
                on_fsdp, rows = True, self._fsdp_rows
            else:
                on_fsdp = fsdp.uses_fsdp(self.entries)
                rows = fsdp.local_pieces(self.entries, ranks) if on_fsdp else []
                self._fsdp_sends = fsdp.sends_rows(self.entries) if on_fsdp else True
            if on_fsdp and self.grad_dtype in FP8_GRAD_DTYPES:
                # A rank's FSDP2 rows start anywhere in a device block; a slice's scale covers
                # whole blocks (docs/command-set.md, "FP8 gradients and their scales").
                raise ValueError(f"grad_dtype={self.grad_dtype!r} is not supported where FSDP2 holds the params "
                                 "(its rows cut device blocks, and an FP8 scale covers whole blocks); use "
                                 "grad_dtype=None or 'fp32'")
            return {"layout": layout, "fsdp": on_fsdp}

        # A rank's own failure stays its own (its type) on it; the others name it.
        opened = distributed.together(ranks, local_layout, "cossd: a rank could not open the optimizer",
                                      reraise_own=True)
        on_fsdp = bool(opened[ranks.rank]["fsdp"])
        kinds = [theirs["fsdp"] for theirs in opened]
        layouts = [theirs["layout"] for theirs in opened]
        differing = [rank for rank, theirs in enumerate(layouts) if theirs != layouts[0]]
        if differing:
            raise ValueError(f"ranks {differing} hold other params than rank 0 (names, sizes or "
                             "param groups differ); every rank must build the same model and groups")
        if len(set(kinds)) > 1:
            raise ValueError(f"FSDP2 holds the params on ranks {[r for r, k in enumerate(kinds) if k]} and not "
                             f"on ranks {[r for r, k in enumerate(kinds) if not k]}; shard the model alike on every rank")
        if on_fsdp:
            self._open_fsdp(rows)
            return
        setup = self._setup_from_rank0(on_fsdp=False)
        if ranks.rank != 0:
            self._read_params()
            self.restored = bool(setup["restored"])
            self.committed_step = int(setup["committed_step"])
            self.steps_skipped = int(setup["steps_skipped"])
        self._job = int(setup["job"])
        block = self.files.config().get("block_elems")
        if not isinstance(block, int) or block < 1:
            raise RuntimeError(f"the device at {self.files.mountpoint} does not report its block size "
                               "(config.json block_elems); a sharded optimizer cuts shards at its blocks")
        shards = plan_shards([(entry.name, entry.numel) for entry in self.entries], ranks.world, block)
        self._shard = shards[ranks.rank]
        self._shards = shards

    def _setup_from_rank0(self, on_fsdp: bool) -> dict[str, Any]:
        """Rank 0 opens the namespace (_open_on_rank0) while the others wait; each other rank
        then checks the namespace rank 0 opened is there and this model's. Rank 0's setup
        (or its failure, raised on every rank)."""
        ranks = self._ranks
        assert ranks is not None
        if ranks.rank == 0:
            try:
                setup = self._open_on_rank0(on_fsdp=on_fsdp)
            except BaseException as exc:
                ranks.from_rank0({"error": f"{type(exc).__name__}: {exc}"})
                raise
            ranks.from_rank0(setup)
            return setup
        setup = ranks.from_rank0(None)
        if "error" in setup:
            raise RuntimeError(f"rank 0 could not open namespace {self.files.name!r}: {setup['error']}")
        if not self.files.exists():  # looks its nsid up
            raise RuntimeError(f"namespace {self.files.name!r} that rank 0 opened is gone")
        self._check_config(self.files.config())
        self._sent_hypers = [group_hyper(group) for group in self.param_groups]
        return setup

    def _open_fsdp(self, rows: list[Piece]) -> None:
        """Opening where FSDP2 holds the params: rank 0 attaches or creates the namespace of
        the global tensors (creating loads no masters: it holds only its own rows), the others
        wait; where the namespace is still loading, every rank writes its own rows' FP32
        masters, and no rank goes on (to its first BEGIN, which seals the loading) before
        all have; then each reads back the params of its rows, into its local shards."""
        ranks = self._ranks
        assert ranks is not None
        setup = self._setup_from_rank0(on_fsdp=True)
        self._fsdp = True
        self._read_rows = rows
        rows = rows if self._fsdp_sends else []  # HSDP: replica 0 sends, its copies send nothing
        self._shard = rows
        self._job = int(setup["job"])
        self.restored = bool(setup["restored"])
        self.committed_step = int(setup["committed_step"])
        self.steps_skipped = int(setup["steps_skipped"])
        if setup["loading"]:
            # No rank goes on (to its first BEGIN, which seals the loading) before every rank's
            # masters are in: a rank whose write failed fails every rank here.
            distributed.together(ranks, self._write_shard_masters,
                                 f"cossd: loading the master weights of namespace {self.files.name!r} failed")
        self._read_params()

    def _open_on_rank0(self, on_fsdp: bool = False) -> dict[str, Any]:
        """Rank 0's part of opening: as one process opens a namespace, then a step an
        earlier job left open (its ranks killed mid-step) is aborted, before any rank of
        this job begins one. With FSDP2 (`on_fsdp`) the masters are not loaded here: every
        rank loads its own rows after (setup["loading"] says whether)."""
        done = namespace_swap.resolve_interrupted(self.files)
        if done is not None:
            warnings.warn(f"cossd: {done}", RuntimeWarning, stacklevel=4)
        loading = False
        if on_fsdp:
            loading = self._attach_or_create_global()
        elif self.files.exists():
            self._attach()
        else:
            self._create(initial_step=0, masters=None)
        left = self.files.statistics().get("step_open")
        if left is not None:
            self.files.command(self.files.admin.abort_step, self.files.nsid)
            warnings.warn(f"cossd: namespace {self.files.name!r} had step {left} open, left by an earlier "
                          "job; aborted it (the job resumes from step "
                          f"{self.committed_step})", RuntimeWarning, stacklevel=4)
        return {"job": distributed.new_job_id(), "committed_step": self.committed_step,
                "steps_skipped": self.steps_skipped, "restored": self.restored, "loading": loading}

    def _attach_or_create_global(self) -> bool:
        """Rank 0's attach or create for FSDP2, where no rank holds whole params: as
        _attach and _create, less the loading and reading of params (each rank does its
        own rows). Returns whether the namespace waits for its masters."""
        if not self.files.exists():
            self.files.create(self._description(0))
            self._sent_hypers = [group_hyper(group) for group in self.param_groups]
            self.committed_step = 0
            return True
        config = self.files.config()
        self._check_config(config)
        self._sent_hypers = [{field: float(group[field]) for field in HYPER_FIELDS} for group in config["groups"]]
        stats = self.files.statistics()
        if stats["loading"] and int(stats["committed_step"]) != 0:
            raise RuntimeError(
                f"namespace {self.files.name!r} is still loading state for step {stats['committed_step']}: "
                "an import of optimizer state was interrupted and its master weights and moments are "
                f"incomplete. Delete it with `cossd delete-ns {self.files.name}` and load the checkpoint again")
        # A job that died before its first step left it loading: its masters are loaded again.
        self.restored = not stats["loading"]
        self.committed_step = int(stats["committed_step"])
        self.steps_skipped = int(stats["steps_skipped"])
        return bool(stats["loading"])

    # ------------------------------------------------------------------ the step

    def _averaging(self) -> bool:
        """Whether this optimizer averages the gradients (decided once, at the first step,
        the same on every rank): not where DistributedDataParallel holds the params (its
        backward averaged them already), else yes (one all-reduce per step), with a warning
        saying so. `average_grads=` decides instead where given."""
        ranks = self._ranks
        assert ranks is not None
        if self._average is None:
            wrapped = distributed.ddp_wraps([entry.param for entry in self.entries])
            if wrapped is None:
                raise ValueError("a DistributedDataParallel module holds some of this optimizer's params "
                                 "but not all: its gradients would be averaged for some and not others")
            average = not wrapped
            rules = ranks.gather(average)
            if len(set(rules)) > 1:
                raise ValueError(f"ranks disagree on whether a DDP module holds the params ({rules}); "
                                 "wrap the model with DDP on every rank or on none")
            if average and ranks.rank == 0:
                warnings.warn(
                    f"cossd: no DistributedDataParallel holds the params: the optimizer averages the "
                    f"gradients of the {ranks.world} ranks itself (one all-reduce per step). Pass "
                    "average_grads=False where they are averaged already", RuntimeWarning, stacklevel=4)
            self._average = average
        return self._average

    def _shard_grads(self) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's pieces of the step's (averaged) gradients, in the wire dtype (FP32 where
        it is FP8: _begin_shared encodes them after the norm is taken)."""
        ranks = self._ranks
        assert ranks is not None
        if self._fsdp:
            # FSDP2's reduce-scatter left each rank its rows of the averaged gradients.
            return fsdp.local_grads(self.entries, self._shard, self.grad_wire, self._fsdp_views)
        full: list[torch.Tensor | None] = [entry.param.grad for entry in self.entries]
        if self._averaging():
            present = [grad for grad in full if grad is not None]
            assert len(present) == len(full)  # step() refused a step with missing gradients
            full = list(distributed.average(present, ranks))
        pieces = []
        for piece in self._shard:
            grad = full[piece.index]
            assert grad is not None  # step() refused a step with missing gradients
            flat = grad.detach().reshape(-1)[piece.start : piece.stop]
            pieces.append((piece.name, piece.start, flat.to("cpu", self._piece_dtype)))
        return pieces

    @property
    def _piece_dtype(self) -> torch.dtype:
        return torch.float32 if self.grad_dtype in FP8_GRAD_DTYPES else self.grad_wire

    def _fp8_pieces(self, pieces: list[tuple[str, int, torch.Tensor]]
                    ) -> tuple[list[tuple[str, int, torch.Tensor]], dict[str, Any] | None]:
        """FP8: each piece as codes of its own amax's scale, and the grad_scales entries of the
        slices (each piece starts at a device block and stops at one or at its tensor's end:
        shard.plan_shards). Else the pieces as they are, no scales."""
        if self.grad_dtype not in FP8_GRAD_DTYPES:
            return pieces, None
        fp8_dtype = GRAD_TORCH_DTYPES[self.grad_dtype]
        numel = {entry.name: entry.numel for entry in self.entries}
        codes, scales = [], {}
        for name, start, values in pieces:
            encoded = grad_rules.fp8_encode_counted(values, self.grad_dtype, fp8_dtype)
            codes.append((name, start, encoded.codes))
            whole = start == 0 and values.numel() == numel[name]
            scales[name] = encoded.wire() if whole else encoded.wire(start, start + values.numel())
        return codes, scales

    def _step_sharded(self, loss_scale: float, timing: dict[str, float]) -> dict[str, Any]:
        """One shared step: this rank's gradient pieces sent under the job's BEGIN_STEP
        (every rank with the same scale and hyperparameters), then the commit that the
        device makes once every rank's pieces are in."""
        ranks = self._ranks
        assert ranks is not None
        clock = time.perf_counter
        started = clock()
        pieces = self._shard_grads()
        coefficient = 1.0
        if self.max_grad_norm is not None:
            self.last_grad_norm = distributed.global_norm(self._squares(pieces), ranks) / loss_scale
            coefficient = grad_rules.clip_coefficient(self.last_grad_norm, self.max_grad_norm)
        # After this step's collectives, before its begin: params written outside the
        # optimizer become the masters before the first commit, where every rank agrees (one
        # exchange of every rank), else are refused here (after it, by this rank alone: the
        # others' step is aborted at its bound).
        self._check_changed_params_of_ranks()
        timing["begin_s"] = self._begin_shared(pieces, coefficient / loss_scale)
        committing = clock()
        timing["grads_s"] = committing - started - timing["begin_s"]
        result = self._wait_for_commit(self.committed_step + 1)
        timing["commit_s"] = clock() - committing
        self._step_open = False
        return result

    # ------------------------------------------------------------------ params back

    def _read_params(self) -> None:
        """The committed params into the model: FSDP2's rows of this rank, or with
        param_gather="allgather" this rank's shard then an all-gather, else (one process,
        param_gather="device", or before the shards are planned) every param from the
        device (session.DeviceSession)."""
        if self._fsdp:
            fsdp.read_local_params(self.files, self.entries, self._read_rows or [], self.dtype, self._fsdp_views)
            return
        if self._ranks is None:
            fsdp.refuse_one_rank(self.entries)  # an attach at one rank reads before any load
        if self._ranks is not None and self._param_gather == "allgather" and self._shards is not None:
            self._read_and_gather()
        else:
            # DeviceSession's, next in optim._DeviceAdam's order (not a base of this mixin).
            super()._read_params()  # type: ignore[misc]

    def _write_shard_masters(self) -> None:
        """This rank's shard of the FP32 master weights, from the params as they are now, into
        the namespace while it still loads (before the first BEGIN seals it): FSDP2's rows of
        this rank (HSDP: replica 0's), else the pieces this rank sends gradients for. Every
        element is some rank's (shard.plan_shards). The device rounds each master to the wire
        dtype's param as it is written. (step_guards: weights loaded before the first step.)"""
        if self._fsdp:
            items = fsdp.local_masters(self.entries, self._shard, self._fsdp_views)
        else:
            items = [(piece.name, piece.start, self.entries[piece.index].param.detach().reshape(-1)
                      [piece.start : piece.stop].to("cpu", torch.float32)) for piece in self._shard]
        if items:
            self.files.write_pieces(items, role="master")

    def _read_params_alone(self) -> None:
        """_read_params with no collective of the ranks: FSDP2's rows of this rank, else every
        param from the device (also where param_gather="allgather")."""
        if self._fsdp:
            fsdp.read_local_params(self.files, self.entries, self._read_rows or [], self.dtype, self._fsdp_views)
        else:
            super()._read_params()  # type: ignore[misc]  # DeviceSession's, next in the MRO

    def _read_and_gather(self) -> None:
        """This rank's shard of the committed params read from the device into a flat byte
        buffer, then one all-gather of every rank's buffer; each rank unpacks every shard
        into its params. The bytes are the device's, so the params are those every rank
        reading all of them would get, bit for bit."""
        ranks, shards = self._ranks, self._shards
        assert ranks is not None and shards is not None
        # What the device holds for each param: an FP32 param gets its master (as
        # DeviceSession._read_params gives it), a 16-bit one the param in the wire dtype.
        kinds = [("master", torch.float32) if entry.param.dtype == torch.float32 else ("param", self.dtype)
                 for entry in self.entries]

        def placed(shard: list[Piece]) -> tuple[list[int], int]:
            # Each piece at an 8-byte boundary of its rank's buffer, so that it views as its dtype.
            offsets, at = [], 0
            for piece in shard:
                offsets.append(at)
                at += -(-piece.numel * kinds[piece.index][1].itemsize // 8) * 8
            return offsets, at

        layouts = [placed(shard) for shard in shards]
        mine, (offsets, size) = shards[ranks.rank], layouts[ranks.rank]
        device = self.entries[0].param.device
        sizes = [total for _, total in layouts]
        # Out of memory for the gather's own buffers, a rank cannot take part at all: the
        # others then wait in it until the backend's timeout (docs/trainer.md).
        send, received = distributed.gather_buffers(sizes, ranks, device)
        own: BaseException | None = None
        try:
            # Through the CMB the read lands wherever the params are (a GPU's, for NCCL), so
            # straight into this rank's part of the gather; through the files it lands on the
            # host, then crosses.
            on_host = self.files.cmb() is None and send.device.type != "cpu"
            target = torch.empty(size, dtype=torch.uint8) if on_host else send[:size]
            reads = []
            for piece, at in zip(mine, offsets):
                role, dtype = kinds[piece.index]
                reads.append((piece.name, role, piece.start,
                              target[at : at + piece.numel * dtype.itemsize].view(dtype)))
            if reads:
                self.files.read_pieces_into(reads)
            if on_host:
                send[:size].copy_(target)
        except BaseException as exc:  # the read, the memory, an interrupt: none may leave the others waiting
            own = exc  # still in the all-gather, flagged: no other rank is left waiting in it
        parts, missing = distributed.all_gather_bytes(send, received, sizes, ranks, failed=own is not None)
        if missing:
            # Every rank saw the same flags, so every rank takes part in this one exchange of why.
            reasons = ranks.gather(None if own is None else f"{type(own).__name__}: {own}")
            if own is not None:
                raise own  # its own type (DeviceLostError, an OSError, an interrupt), as a read of its own would
            raise distributed.RanksFailedError(
                "cossd: reading the params back (param_gather='allgather') failed on another rank",
                [(rank, str(reasons[rank])) for rank in missing])
        flats: dict[int, torch.Tensor] = {}
        for shard, (shard_offsets, _), part in zip(shards, layouts, parts):
            for piece, at in zip(shard, shard_offsets):
                entry = self.entries[piece.index]
                flat = flats.get(piece.index)
                if flat is None:
                    param = entry.param.detach()
                    flat = param.view(-1) if param.is_contiguous() else torch.empty(entry.numel, dtype=param.dtype,
                                                                                   device=param.device)
                    flats[piece.index] = flat
                dtype = kinds[piece.index][1]
                flat[piece.start : piece.stop].copy_(part[at : at + piece.numel * dtype.itemsize].view(dtype))
        for index, flat in flats.items():
            param = self.entries[index].param.detach()
            if not param.is_contiguous():
                param.copy_(flat.view(param.shape))
        width = max(sizes) + distributed.FLAG_BYTES
        self.last_param_bytes = {"device": size, "allgather_sent": width, "allgather_received": width * (ranks.world - 1)}

    @staticmethod
    def _squares(pieces: list[tuple[str, int, torch.Tensor]]) -> float:
        """The sum of the squared gradient elements of these pieces (inf or NaN where one is)."""
        return math.fsum(float(torch.linalg.vector_norm(values, dtype=torch.float32)) ** 2
                         for _, _, values in pieces)

    def _begin_shared(self, pieces: list[tuple[str, int, torch.Tensor]], grad_scale: float) -> float:
        """BEGIN_STEP of the job's next shared step with `grad_scale` (the clip coefficient
        over the loss scale), then this rank's gradient pieces (FP8: their codes, the slices'
        scales in the begin). Returns the seconds in begin."""
        pieces, scales = self._fp8_pieces(pieces)
        step = self.committed_step + 1
        groups = [group_hyper(group) for group in self.param_groups]
        began = time.perf_counter()
        self._step_begun = True  # from here a failed step() is checked (optim._ensure_consistent)
        self.files.step_began()
        # The hyperparameters ride in the begin itself: the rank that opens the step sets
        # them for it, and each joining rank's must equal them, so a schedule reaches every
        # shard with no race between a SET_HYPERPARAMETERS and another rank's begin.
        self._seq += 1
        self.files.command(self.files.admin.begin_shared_step, self.files.nsid, step, grad_scale,
                           groups=groups, grad_scales=scales, **self._shared())
        self._step_open = True
        self._sent_hypers = groups
        begin_s = time.perf_counter() - began
        if self.before_grad_write is not None:
            for piece in self._shard:
                self.before_grad_write(piece.index)
        if pieces:
            self.files.write_pieces(pieces)
        return begin_s

    def _shared(self) -> dict[str, int]:
        ranks = self._ranks
        assert ranks is not None
        return {"job": self._job, "seq": self._seq, "ranks": ranks.world, "rank": ranks.rank}

    def _aborted(self, step: int, why: str) -> StepAbortedError:
        return StepAbortedError(
            f"cossd: step {step} of namespace {self.files.name!r} was not committed: {why}. The "
            f"device stays at step {step - 1} for every rank; restart the job to resume from there")

    def _wait_for_commit(self, step: int) -> dict[str, Any]:
        """Ask the device for the step's result until every rank's gradients are in (it
        commits then, once, and each rank reads the same result), for at most
        step_timeout_s; past it, abort the step for every rank and say why."""
        admin, nsid = self.files.admin, self.files.nsid
        deadline = time.monotonic() + self.step_timeout_s
        pause = 0.0002  # doubling to 10 ms: a rank that is just behind is caught quickly
        try:
            while True:
                answer = self.files.command(admin.commit_shared_step, nsid, step, **self._shared())
                if "waiting" not in answer:
                    return answer
                if time.monotonic() >= deadline:
                    break
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
            reason = (f"rank {self._shared()['rank']} waited {self.step_timeout_s:g} s for the other "
                      f"ranks ({answer['waiting']})")
            try:
                self.files.command(admin.abort_shared_step, nsid, step, reason=reason, **self._shared())
            except DeviceError as exc:
                if exc.status != Status.NO_STEP_OPEN:
                    raise
            # Another rank may have completed the step just before the abort: the device's
            # recorded outcome says which, the same for every rank.
            answer = self.files.command(admin.commit_shared_step, nsid, step, **self._shared())
        except DeviceError as exc:
            if exc.status == Status.NO_STEP_OPEN:
                self._step_open = False
                raise self._aborted(step, exc.message) from None
            raise
        if "waiting" in answer:
            raise self._aborted(step, answer["waiting"])
        return answer

    def _abort_shared(self, why: str) -> None:
        """Abort this job's open step for every rank (best effort: a step() that failed)."""
        if not self._step_open:
            return
        self._step_open = False
        try:
            self.files.command(self.files.admin.abort_shared_step, self.files.nsid, self.committed_step + 1,
                               reason=why, **self._shared())
        except (DeviceError, DeviceLostError, OSError):
            pass

    # ------------------------------------------------------------------ load_state_dict

    def _load_sharded_state(self, step: int, loads: list[tuple[str, str, torch.Tensor]]) -> None:
        """load_state_dict of another state on the one namespace of a sharded job (state_dict.py
        has checked it all; every rank holds the same whole state): rank 0 replaces the
        namespace atomically (namespace_swap.replace: a kill at any instant leaves the old run
        or the new one), every rank then follows it and reads its params back."""
        ranks = self._ranks
        assert ranks is not None
        hook = self.load_hook or (lambda stage: None)

        def replace() -> None:
            namespace_swap.replace(self.files, self._description(step),
                                   lambda: self.files.write_many(loads), hook)

        follow_rank0_load([self], ranks, replace)
        self.committed_step, self.steps_skipped, self.last_step_skipped = step, 0, False
        # The device rounds the masters to the wire dtype; every rank continues from that.
        self._read_params()


def follow_rank0_load(members: list[Any], ranks: Ranks, replace: Callable[[], None]) -> None:
    """Rank 0 runs `replace` (a load that switches each member's namespace to a new one);
    every rank learns its outcome, the others' files follow the switch (the new nsid looked
    up), and every member's groups count as sent (the loaded namespace holds them). Rank 0's
    failure is raised on every rank, naming rank 0 on the others."""
    error = None
    if ranks.rank == 0:
        try:
            replace()
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
    error = ranks.from_rank0(error)
    for member in members:
        if ranks.rank != 0:  # rank 0's files followed the switch; the others look the new nsid up
            member.files.retarget(member.files.name, None)
            if not member.files.exists():
                raise RuntimeError(f"namespace {member.files.name!r} is gone from {member.files.mountpoint} "
                                   f"after rank 0's load ({error})")
        member._sent_hypers = [group_hyper(group) for group in member.param_groups]
    if error is not None:
        if ranks.rank == 0 or error.startswith("RuntimeError: the new state"):
            raise RuntimeError(error.removeprefix("RuntimeError: "))
        raise RuntimeError(f"rank 0 could not load the state: {error}")
