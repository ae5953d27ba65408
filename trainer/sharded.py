"""A sharded optimizer (ZeRO-1 over torch.distributed): the namespace opened by rank 0 for every rank, its shard's gradients out, one shared step per iteration, every param back."""
from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable

import torch

from ..protocol.status import DeviceError, Status
from . import distributed
from . import grads as grad_rules
from . import namespace_swap
from .distributed import Ranks
from .namespace_files import DeviceLostError, NamespaceFiles
from .plan import Entry, group_hyper
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
    max_grad_norm: float | None
    last_grad_norm: float | None
    committed_step: int
    steps_skipped: int
    restored: bool
    before_grad_write: Callable[[int], None] | None
    _ranks: Ranks | None
    _sent_hypers: list[dict[str, float]]
    _step_open: bool
    # The job's id on the device (rank 0 draws it), this rank's pieces, the bound on the
    # wait for the other ranks, and whether the optimizer averages the gradients (None:
    # decided at the first step, when a DDP wrapper made after the optimizer exists).
    _job: int
    _seq: int  # the job's shared steps begun so far (the same count on every rank)
    _shard: list[Piece]
    step_timeout_s: float
    _average: bool | None

    # ------------------------------------------------------------------ opening

    def _open_sharded(self) -> None:
        """Every rank opens the one namespace: rank 0 attaches or creates it (and drops a
        step an earlier job left open) while the others wait, then each takes its shard
        and the committed params. Bad setups fail on every rank, with the same message."""
        ranks = self._ranks
        assert ranks is not None
        layout = [(entry.name, entry.numel, entry.group) for entry in self.entries]
        layouts = ranks.gather({"layout": layout})
        failed = [(rank, theirs["error"]) for rank, theirs in enumerate(layouts) if "error" in theirs]
        if failed:
            raise RuntimeError("; ".join(f"rank {rank} could not open the optimizer: {why}" for rank, why in failed))
        layouts = [theirs["layout"] for theirs in layouts]
        differing = [rank for rank, theirs in enumerate(layouts) if theirs != layouts[0]]
        if differing:
            raise ValueError(f"ranks {differing} hold other params than rank 0 (names, sizes or "
                             "param groups differ); every rank must build the same model and groups")
        if ranks.rank == 0:
            try:
                setup = self._open_on_rank0()
            except BaseException as exc:
                ranks.from_rank0({"error": f"{type(exc).__name__}: {exc}"})
                raise
            ranks.from_rank0(setup)
        else:
            setup = ranks.from_rank0(None)
            if "error" in setup:
                raise RuntimeError(f"rank 0 could not open namespace {self.files.name!r}: {setup['error']}")
            if not self.files.exists():  # looks its nsid up
                raise RuntimeError(f"namespace {self.files.name!r} that rank 0 opened is gone")
            config = self.files.config()
            self._check_config(config)
            self._sent_hypers = [group_hyper(group) for group in self.param_groups]
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

    def _fail_together(self, exc: BaseException) -> None:
        """This rank failed before the ranks' first exchange (its mount missing, say): it
        takes part in the exchange with its reason, so the others raise it too instead of
        waiting for it."""
        ranks = self._ranks
        assert ranks is not None
        try:
            ranks.gather({"error": f"{type(exc).__name__}: {exc}"})
        except Exception:  # the process group itself is broken: the original error stands
            pass

    def _open_on_rank0(self) -> dict[str, Any]:
        """Rank 0's part of opening: as one process opens a namespace, then a step an
        earlier job left open (its ranks killed mid-step) is aborted, before any rank of
        this job begins one."""
        done = namespace_swap.resolve_interrupted(self.files)
        if done is not None:
            warnings.warn(f"cossd: {done}", RuntimeWarning, stacklevel=4)
        if self.files.exists():
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
                "steps_skipped": self.steps_skipped, "restored": self.restored}

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
        """This rank's pieces of the step's (averaged) gradients, in the wire dtype."""
        ranks = self._ranks
        assert ranks is not None
        full = [entry.param.grad for entry in self.entries]
        if self._averaging():
            full = distributed.average(full, ranks)  # type: ignore[arg-type]
        pieces = []
        for piece in self._shard:
            grad = full[piece.index]
            assert grad is not None  # step() refused a step with missing gradients
            flat = grad.detach().reshape(-1)[piece.start : piece.stop]
            pieces.append((piece.name, piece.start, flat.to("cpu", self.dtype)))
        return pieces

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
        timing["begin_s"] = self._begin_shared(pieces, coefficient / loss_scale)
        committing = clock()
        timing["grads_s"] = committing - started - timing["begin_s"]
        result = self._wait_for_commit(self.committed_step + 1)
        timing["commit_s"] = clock() - committing
        self._step_open = False
        return result

    @staticmethod
    def _squares(pieces: list[tuple[str, int, torch.Tensor]]) -> float:
        """The sum of the squared gradient elements of these pieces (inf or NaN where one is)."""
        return math.fsum(float(torch.linalg.vector_norm(values, dtype=torch.float32)) ** 2
                         for _, _, values in pieces)

    def _begin_shared(self, pieces: list[tuple[str, int, torch.Tensor]], grad_scale: float) -> float:
        """BEGIN_STEP of the job's next shared step with `grad_scale` (the clip coefficient
        over the loss scale), then this rank's gradient pieces. Returns the seconds in begin."""
        step = self.committed_step + 1
        groups = [group_hyper(group) for group in self.param_groups]
        began = time.perf_counter()
        self.files.step_began()
        # The hyperparameters ride in the begin itself: the rank that opens the step sets
        # them for it, and each joining rank's must equal them, so a schedule reaches every
        # shard with no race between a SET_HYPERPARAMETERS and another rank's begin.
        self._seq += 1
        self.files.command(self.files.admin.begin_shared_step, self.files.nsid, step, grad_scale,
                           groups=groups, **self._shared())
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
