"""What a sharded optimizer asks of torch.distributed: the ranks, the job's id, a DDP wrapper or not, gradient averaging, the global norm."""
from __future__ import annotations

import dataclasses
import gc
import math
import secrets
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process's place in the job: its rank, the world size, the process group."""

    rank: int
    world: int
    group: Any = None  # None: the default process group

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value, group=self.group)
        return values

    def from_rank0(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (each rank passes its own; only rank 0's counts)."""
        box = [value]
        # src is a global rank: the group's rank 0, where the optimizer shards over a subgroup.
        source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=source, group=self.group)
        return box[0]


T = TypeVar("T")


class RanksFailedError(RuntimeError):
    """Work that every rank did together failed on some of them: raised on every rank,
    naming each failed rank and its error (`failures`: (rank, "Type: message") pairs)."""

    def __init__(self, doing: str, failures: list[tuple[int, str]]) -> None:
        self.doing, self.failures = doing, failures
        super().__init__(f"{doing}: " + "; ".join(f"rank {rank}: {why}" for rank, why in failures))

    def __reduce__(self) -> tuple[type[RanksFailedError], tuple[str, list[tuple[int, str]]]]:
        return (RanksFailedError, (self.doing, self.failures))  # picklable: two arguments, not one


def together(ranks: Ranks, work: Callable[[], T], doing: str, *, reraise_own: bool = False) -> list[T]:
    """`work()` on this rank, then every rank's result, in rank order, on every rank. The
    exchange is a barrier that carries each rank's failure: no rank goes on before every
    rank's work is done, and where some rank's raised, every rank raises RanksFailedError
    ("`doing`: rank 1: OSError: ..."), chained from its own error where it failed. A failing
    rank still takes part, so no other is left waiting in a collective for it. A rank whose
    work failed only because another's did (a RanksFailedError of an inner collective) is
    left out of the list where some rank failed for a reason of its own. `reraise_own`: a rank
    whose work failed for a reason of its own raises that error itself (its type, for callers
    that catch it), the others RanksFailedError."""
    own: BaseException | None = None
    try:
        outcome: dict[str, Any] = {"value": work()}
    except BaseException as exc:  # KeyboardInterrupt too: the other ranks must not wait for ever
        own = exc
        outcome = _failed(exc)
    outcomes = ranks.gather(outcome)
    if own is not None and not isinstance(own, Exception):
        raise own  # an interrupt stays one here; the other ranks raise it as this rank's failure
    if own is not None and reraise_own and not isinstance(own, RanksFailedError):
        raise own
    failed = [(rank, theirs) for rank, theirs in enumerate(outcomes) if "error" in theirs]
    own_reasons = [(rank, theirs) for rank, theirs in failed if not theirs["knock_on"]]
    failures = [(rank, theirs["error"]) for rank, theirs in (own_reasons or failed)]
    if failures:
        raise RanksFailedError(doing, failures) from own
    return [theirs["value"] for theirs in outcomes]


def _failed(exc: BaseException) -> dict[str, Any]:
    """A rank's failed outcome in a `together` exchange: its error's text, and whether it
    failed only because another rank did."""
    return {"error": f"{type(exc).__name__}: {exc}", "knock_on": isinstance(exc, RanksFailedError)}


def current(group: Any = None) -> Ranks | None:
    """The job's ranks where torch.distributed is initialized with more than one, else None
    (one process: the optimizer is not sharded)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size(group)
    if world < 2:
        return None
    return Ranks(dist.get_rank(group), world, group)


def new_job_id() -> int:
    """A 63-bit id for one job's shared steps (rank 0 draws it, the others take it)."""
    return secrets.randbits(63)


def ddp_wraps(params: list[torch.Tensor]) -> bool | None:
    """Whether a DistributedDataParallel module holds these params: True for all of them,
    False for none; None for some (a setup the optimizer refuses). Looked up once, among the
    live DDP modules (DDP marks nothing on the params themselves)."""
    wrapper = torch.nn.parallel.DistributedDataParallel
    wrapped: set[int] = set()
    for candidate in gc.get_objects():
        if issubclass(type(candidate), wrapper):  # type(): no __instancecheck__ (deprecated objects warn)
            wrapped.update(id(param) for param in candidate.module.parameters())
    hits = sum(id(param) in wrapped for param in params)
    if hits == 0:
        return False
    return True if hits == len(params) else None


def average(grads: list[torch.Tensor], ranks: Ranks) -> list[torch.Tensor]:
    """The mean of every rank's gradients, on every rank: one all-reduce (a sum, in FP32,
    whatever the gradients' dtype), then a division by the world size. Each rank then
    sends only its shard of the result."""
    # On the gradients' own device: NCCL reduces GPU tensors only, gloo either.
    device = grads[0].device if grads else torch.device("cpu")
    flat = torch.cat([grad.detach().reshape(-1).to(device, torch.float32) for grad in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ranks.group)
    flat.div_(ranks.world)
    means, offset = [], 0
    for grad in grads:
        means.append(flat[offset : offset + grad.numel()])
        offset += grad.numel()
    return means


def global_norm(local_squares: float, ranks: Ranks) -> float:
    """sqrt of the sum of every rank's sum of squared gradient elements. The sums are
    gathered and added in rank order on each rank, so every rank gets the same bits (and so
    the same clip coefficient in its BEGIN_STEP, which the device checks)."""
    return math.sqrt(math.fsum(ranks.gather(float(local_squares))))


PARAM_GATHERS = ("device", "allgather")


def param_gather_option(value: str) -> str:
    """The param_gather= option, checked: how a ZeRO-1 rank gets the params back after a
    step. "device": every rank reads every param from the device (the device sends each
    param once per rank). "allgather": each rank reads its shard's params, then one
    all-gather over torch.distributed gives every rank all of them (the device sends each
    param once; the ranks' own network carries the rest)."""
    if value not in PARAM_GATHERS:
        raise ValueError(f"param_gather must be one of {', '.join(map(repr, PARAM_GATHERS))}, got {value!r}")
    return value


FLAG_BYTES = 8  # all_gather_bytes's failure flag and its padding, after each rank's bytes


def gather_buffers(sizes: list[int], ranks: Ranks, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """all_gather_bytes's buffers on `device`: this rank's part (zeros: its bytes go at the
    front, its failure flag after the largest part) and every rank's, in rank order. A
    collective takes equal parts; shards cut at device blocks are rarely equal, so each is
    padded to the largest. The flag's 8 bytes keep every rank's part 8-byte aligned, as its
    bytes are laid out (the caller views them as FP32 and 16-bit params)."""
    width = max(sizes) + FLAG_BYTES
    return (torch.zeros(width, dtype=torch.uint8, device=device),
            torch.empty(width * ranks.world, dtype=torch.uint8, device=device))


def all_gather_bytes(send: torch.Tensor, received: torch.Tensor, sizes: list[int], ranks: Ranks,
                     failed: bool = False) -> tuple[list[torch.Tensor], list[int]]:
    """Every rank's bytes (`sizes[r]` of them for rank r, each at the front of its part of
    gather_buffers' `send`), in rank order, on every rank, in one all_gather_into_tensor; and
    the ranks whose bytes are not there. `failed`: this rank has no bytes to send (its read
    failed); it sends a flag in the same collective rather than leave the others waiting in it."""
    width = send.numel()
    flag_at = width - FLAG_BYTES
    if failed:
        send[flag_at] = 1
    dist.all_gather_into_tensor(received, send, group=ranks.group)
    missing = [rank for rank, flag in enumerate(received.view(ranks.world, width)[:, flag_at].tolist()) if flag]
    return [received[rank * width : rank * width + size] for rank, size in enumerate(sizes)], missing
