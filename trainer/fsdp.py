"""FSDP2 (torch.distributed.fsdp.fully_shard) params in a sharded optimizer: each rank's element ranges of the global tensors, its local gradients out, its masters in, its params back in place."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, TypeGuard, cast

import torch
import torch.distributed as dist

from .distributed import Ranks
from .plan import Entry
from .shard import Piece

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no FSDP2 either
        return None
    return DTensor


def is_dtensor(tensor: Any) -> TypeGuard[DTensor]:
    cls = _dtensor_class()
    return cls is not None and isinstance(tensor, cls)


def as_dtensor(entry: Entry) -> DTensor:
    """An FSDP2 entry's param as the DTensor it is (uses_fsdp found every one of them so).
    Only the type checker's view changes: a tensor that acts as a DTensor passes as one."""
    return cast("DTensor", entry.param)


def uses_fsdp(entries: list[Entry]) -> bool:
    """Whether FSDP2 holds these params (DTensors): all of them, or (ValueError, naming a
    param of each kind) only some: a plain param beside them would be a full replica that
    no one averages."""
    found = [is_dtensor(entry.param) for entry in entries]
    if not any(found):
        return False
    if not all(found):
        plain = next(entry.name for entry, dtensor in zip(entries, found) if not dtensor)
        sharded = next(entry.name for entry, dtensor in zip(entries, found) if dtensor)
        raise ValueError(f"param {plain} is a plain tensor while {sharded} is an FSDP2 DTensor: apply "
                         "fully_shard to every module whose params this optimizer steps")
    return True


def _flat_parameter_class() -> type | None:
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except ImportError:  # a private module: a torch that moved it still marks its params (below)
        return None
    return FlatParameter


def refuse_fsdp1(entries: list[Entry]) -> None:
    """A ValueError naming the param where FSDP1 (FullyShardedDataParallel) holds it: a
    FlatParameter (use_orig_params=False), each rank's flat shard of several params, or one
    of the original params that FSDP1 made views of its shard (use_orig_params=True; FSDP1
    marks both with `_fsdp_flattened`). Neither is a tensor the device's namespace can
    describe alike on every rank: stepped as a plain replicated tensor, every rank would
    train rank 0's shard."""
    flat = _flat_parameter_class()
    for entry in entries:
        if (flat is not None and isinstance(entry.param, flat)) or getattr(entry.param, "_fsdp_flattened", False):
            raise ValueError(
                f"param {entry.name} is held by FSDP1 (FullyShardedDataParallel: a FlatParameter shard, or with "
                "use_orig_params=True a view of one), which the cossd optimizer does not support: use FSDP2 "
                "(torch.distributed.fsdp.fully_shard) and make the optimizer from the sharded model's parameters, "
                "or DistributedDataParallel (docs/trainer.md, FSDP2)")


def refuse_one_rank(entries: list[Entry]) -> None:
    """A ValueError naming the param where FSDP2 DTensors reach a path of the optimizer that
    moves whole plain tensors (the one-process reads and master loads): FSDP2 params take the
    sharded path, a mesh of one included (optim._open_namespace), so this is a guard, met by
    what that path does not cover (master weights taken from the DTensors themselves by a
    load_state_dict without masters)."""
    for entry in entries:
        if is_dtensor(entry.param):
            raise ValueError(f"param {entry.name} is an FSDP2 DTensor, which this path of the optimizer takes "
                             "only as a plain tensor: FSDP2 params are stepped through its sharded path; pass "
                             "the master weights (master=, or the state dict's cossd_master)")


def _rows_of(rows: int, world: int, coordinate: int) -> tuple[int, int]:
    """Rows start..stop-1 of dim 0 that Shard(0) gives mesh coordinate `coordinate` (torch.chunk's
    cut, as FSDP2 makes it: ceil(rows / world) each, the last ones shorter or empty)."""
    chunk = -(-rows // world)
    start = min(coordinate * chunk, rows)
    return start, min(start + chunk, rows)


HSDP = "(Replicate(), Shard(0))"  # HSDP's placements, as fully_shard makes them on a 2-D mesh


def is_hsdp(entries: list[Entry]) -> bool:
    """Whether these FSDP2 params are HSDP's: replicated over mesh dim 0, Shard(0) over dim 1."""
    from torch.distributed.tensor import Replicate, Shard

    return bool(entries) and all(tuple(as_dtensor(entry).placements) == (Replicate(), Shard(0)) for entry in entries)


def sends_rows(entries: list[Entry]) -> bool:
    """Whether this rank sends its rows (gradients, masters): always, but under HSDP only the
    ranks of replica 0, for every replica holds the same averaged rows and each element must
    reach the device once. Every rank reads its own rows back."""
    if not is_hsdp(entries):
        return True
    return as_dtensor(entries[0]).device_mesh.get_local_rank(0) == 0


def _hsdp_rows(entry: Entry, members: list[int]) -> tuple[int, int]:
    """An HSDP param's mesh checked (2-D, every rank of the optimizer's group once): this
    rank's coordinate on the shard dim and that dim's size."""
    mesh = as_dtensor(entry).device_mesh
    if mesh.ndim != 2:
        raise ValueError(f"param {entry.name}: placements {HSDP} on a {mesh.ndim}-D mesh; HSDP's is 2-D")
    spans = sorted(int(rank) for rank in mesh.mesh.flatten().tolist())
    if spans != sorted(members):
        raise ValueError(f"param {entry.name}: its HSDP mesh spans global ranks {spans}, the optimizer's "
                         f"process group {sorted(members)}; pass process_group= the whole mesh's group")
    return mesh.get_local_rank(1), mesh.size(1)


def local_pieces(entries: list[Entry], ranks: Ranks) -> list[Piece]:
    """This rank's element range of each global tensor (the rows of its local shard, laid
    flat), for params FSDP2 sharded as Shard(0) over a 1-D mesh of the optimizer's process
    group, or HSDP's (Replicate(), Shard(0)) over a 2-D mesh of it (the rows of this rank's
    coordinate on the shard dim; sends_rows says whether it sends them). Anything else is a
    ValueError naming the param: the device's namespace holds the global tensors, and a
    rank's part must be one contiguous element range of each."""
    from torch.distributed.tensor import Shard

    group = ranks.group if ranks.group is not None else dist.group.WORLD
    members = dist.get_process_group_ranks(group)
    hsdp = is_hsdp(entries)
    pieces = []
    for entry in entries:
        param = as_dtensor(entry)
        if hsdp:
            if param.dim() == 0:
                raise ValueError(f"param {entry.name}: a 0-dim DTensor has no dim 0 to shard")
            coordinate, shards = _hsdp_rows(entry, members)
            start, stop = _rows_of(param.shape[0], shards, coordinate)
            expected = (stop - start, *param.shape[1:])
            if tuple(param.to_local().shape) != expected:
                raise ValueError(f"param {entry.name}: local shard of shape {tuple(param.to_local().shape)}, where "
                                 f"HSDP's Shard(0) of {tuple(param.shape)} over {shards} gives {expected}")
            row = param.numel() // param.shape[0] if param.shape[0] else 0
            if stop > start:
                pieces.append(Piece(entry.index, entry.name, start * row, stop * row))
            continue
        if tuple(param.placements) != (Shard(0),):
            raise ValueError(f"param {entry.name}: FSDP2 placements {tuple(param.placements)}; the cossd "
                             "optimizer supports Shard(0) over one mesh dimension (fully_shard's default, "
                             f"without shard_placement_fn) and HSDP's {HSDP} on a 2-D mesh, on every param")
        mesh = param.device_mesh
        mesh_members = dist.get_process_group_ranks(mesh.get_group())
        if mesh_members != members:
            raise ValueError(f"param {entry.name}: its DTensor mesh spans global ranks {mesh_members}, the "
                             f"optimizer's process group {members}; pass process_group= the mesh's group")
        coordinate = mesh.get_local_rank()
        if coordinate != ranks.rank:  # the group's order and the mesh's agree (checked above); belt and braces
            raise ValueError(f"param {entry.name}: this rank is {ranks.rank} of the optimizer's group but "
                             f"{coordinate} of the param's mesh")
        if param.dim() == 0:
            raise ValueError(f"param {entry.name}: a 0-dim DTensor has no dim 0 to shard")
        local = param.to_local()
        start, stop = _rows_of(param.shape[0], ranks.world, coordinate)
        expected = (stop - start, *param.shape[1:])
        if tuple(local.shape) != expected:
            raise ValueError(f"param {entry.name}: local shard of shape {tuple(local.shape)} on rank {ranks.rank}, "
                             f"where Shard(0) of {tuple(param.shape)} over {ranks.world} ranks gives {expected}")
        row = param.numel() // param.shape[0] if param.shape[0] else 0
        if stop > start:  # an empty shard (more ranks than rows) has nothing to send or read
            pieces.append(Piece(entry.index, entry.name, start * row, stop * row))
    return pieces


# Where a piece's local elements are: `param(piece)` the tensor holding them (any shape, its
# elements in order are the piece's), `grad(piece)` the same of the gradient. By default each
# piece is a whole local shard of its entry's DTensor; a group of devices (group.py) gives a
# device's pieces the part of the local shard that falls on that device instead.
Views = tuple[Callable[[Piece], torch.Tensor], Callable[[Piece], "torch.Tensor | None"]]


def shard_views(entries: list[Entry]) -> Views:
    """Each piece is its entry's local shard, whole (the optimizer on one device)."""
    def param(piece: Piece) -> torch.Tensor:
        return as_dtensor(entries[piece.index]).to_local()

    def grad(piece: Piece) -> torch.Tensor | None:
        grad = entries[piece.index].param.grad
        return grad.to_local() if is_dtensor(grad) else grad

    return param, grad


def local_grads(entries: list[Entry], pieces: list[Piece], dtype: torch.dtype,
                views: Views | None = None) -> list[tuple[str, int, torch.Tensor]]:
    """This rank's gradient pieces: each param's local gradient shard, which FSDP2's
    reduce-scatter already averaged over the ranks (nothing more is averaged here), in the
    wire dtype on the host."""
    _, grad_of = views or shard_views(entries)
    out = []
    for piece in pieces:
        entry = entries[piece.index]
        local = grad_of(piece)
        assert local is not None  # step() refused a step with missing gradients
        flat = local.detach().reshape(-1)
        if flat.numel() != piece.numel:
            raise RuntimeError(f"param {entry.name}: a local gradient of {flat.numel()} elements, its "
                               f"shard holds {piece.numel} (is the gradient sharded as the param is?)")
        out.append((piece.name, piece.start, flat.to("cpu", dtype)))
    return out


def local_masters(entries: list[Entry], pieces: list[Piece],
                  views: Views | None = None) -> list[tuple[str, int, torch.Tensor]]:
    """This rank's rows of the FP32 master weights to load: its local shards of the params."""
    param_of, _ = views or shard_views(entries)
    return [(piece.name, piece.start, param_of(piece).detach().reshape(-1).to("cpu", torch.float32))
            for piece in pieces]


def read_local_params(files: Any, entries: list[Entry], pieces: list[Piece], dtype: torch.dtype,
                      views: Views | None = None) -> None:
    """The committed params of this rank's rows, straight into each param's local shard
    (in place, where its dtype is what the device holds; an FP32 shard gets the FP32 master
    itself, as a one-process optimizer's FP32 params do)."""
    param_of, _ = views or shard_views(entries)
    reads, staged = [], []
    any_device = files.cmb() is not None
    for piece in pieces:
        local = param_of(piece).detach()
        role, wanted = ("master", torch.float32) if local.dtype == torch.float32 else ("param", dtype)
        if (any_device or local.device.type == "cpu") and local.dtype == wanted and local.is_contiguous():
            reads.append((piece.name, role, piece.start, local.view(-1)))
        else:
            values = torch.empty(piece.numel, dtype=wanted)
            reads.append((piece.name, role, piece.start, values))
            staged.append((local, values))
    if reads:
        files.read_pieces_into(reads)
    for local, values in staged:
        local.copy_(values.view(local.shape))
