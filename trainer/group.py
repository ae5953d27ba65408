"""An optimizer over several devices (mount=[...]): whole tensors spread over one namespace per device, each step a group commit that every device recovers to together."""
from __future__ import annotations

import math
import os
import time
import warnings
from typing import Any, Callable

import torch

from ..protocol.group_commit import GroupDisagreementError, common_step
from . import fsdp
from .dcp import group as dcp_group
from .namespace import swap as namespace_swap
from . import grads as grad_rules
from .distributed import Ranks, together
from .device_fanout import DeviceFanout, Outcome
from .namespace.files import DeviceLostError, NamespaceFiles
from .plan import Entry
from .placement import PLACEMENT_BLOCK_ELEMS, place_on_devices, recorded_placement
from .shard import Piece
from .sharded import StepAbortedError, follow_rank0_load


class SoloRanks(Ranks):
    """The ranks of a job of one process: the group's namespaces still run shared steps (a
    job of one rank), so one code path serves one process and many."""

    def __init__(self) -> None:
        super().__init__(0, 1, None)

    def gather(self, value: Any) -> list[Any]:
        return [value]

    def from_rank0(self, value: Any) -> Any:
        return value


class _GroupFiles:
    """In place of the one namespace's files of an optimizer over several devices: its
    name and mounts, and what needs one namespace says why there is none."""

    def __init__(self, name: str, mounts: list[str]) -> None:
        self.name, self.mounts = name, mounts
        self.mountpoint = ", ".join(mounts)

    def close(self) -> None:
        pass

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__"):  # copy, pickle and friends probe for these
            raise AttributeError(attribute)
        raise RuntimeError(f"namespace {self.name!r} is spread over {len(self.mounts)} devices "
                           f"({self.mountpoint}); `{attribute}` needs a single device")


def mount_list(mount: Any) -> list[str] | None:
    """The devices of `mount=`: None for one mount (a path or a URL), else the list, checked."""
    if isinstance(mount, (str, os.PathLike)):
        return None
    if not isinstance(mount, (list, tuple)) or not mount:
        raise ValueError(f"mount must be a path, a cossd:// URL or a non-empty list of them, got {mount!r}")
    mounts = []
    for item in mount:
        if not isinstance(item, (str, os.PathLike)):
            raise ValueError(f"mount= lists paths or cossd:// URLs, got {item!r}")
        text = os.fspath(item)
        mounts.append(text if "://" in text else os.path.realpath(text))
    repeated = sorted({item for item in mounts if mounts.count(item) > 1})
    if repeated:
        raise ValueError(f"mount= names {', '.join(repeated)} more than once; each device once")
    return mounts


class DeviceGroup:
    """The several-devices half of the optimizer (a mixin of optim._DeviceAdam, first in its
    order): where mount= lists devices, `_group` holds one optimizer per device (its
    children, each a sharded optimizer of the job's ranks on that device's namespace) and
    step() comes here. The protocol and why it is safe: docs/architecture.md, "Several
    devices: one group commit"."""

    # Set by the optimizer (optim._DeviceAdam.__init__).
    entries: list[Entry]
    param_groups: list[dict[str, Any]]
    max_grad_norm: float | None
    last_grad_norm: float | None
    committed_step: int
    steps_skipped: int
    restored: bool
    param_wire_dtype: str | None  # FP8 params out: each device's child reads its pieces' param_fp8
    files: Any
    _group: list[Any] | None
    _group_ranks: Ranks | None
    _group_fsdp: bool  # FSDP2 holds the params: each child reaches this rank's rows through views
    _average: bool | None
    _child_groups: list[list[int]]  # per child: the parent group index of each of its groups
    # Per parent entry index: the (child, the child's entry) holding its pieces, in element order.
    _owner: dict[int, list[tuple[Any, Entry]]]
    # The pieces of split tensors: (the child's 1-D param, the parent's entry, start, stop).
    _pieces: list[tuple[torch.Tensor, Entry, int, int]]
    _fanout: DeviceFanout  # runs each phase of a step on every device at once
    # Notes each param's version after the params are read back (optim.py), declared here only.
    _note_params: Callable[[], None]
    _check_changed_params_of_ranks: Callable[[], None]
    _params_behind: bool  # the model's params may not be the committed step's (optim._ensure_consistent)
    _step_begun: bool  # a BEGIN went to some device in this step() (optim.step)

    # ------------------------------------------------------------------ opening

    def _open_group(self, mounts: list[str], namespace: str, ranks: Ranks | None,
                    make_child: Any) -> None:
        """Open (or create) the namespace on every device, each child sharded over the job's
        ranks, then bring the devices to one common step. `make_child(groups, mount, ranks)`
        builds one child optimizer."""
        group_ranks = ranks if ranks is not None else SoloRanks()
        self._group_ranks = group_ranks
        self.files = _GroupFiles(namespace, mounts)
        self._pieces = []
        # FSDP2: this rank's rows of each global tensor (ValueError for what FSDP2 layouts
        # fsdp.local_pieces refuses, HSDP's 2-D mesh among them), the same on every rank.
        self._group_fsdp = fsdp.uses_fsdp(self.entries)
        rows: dict[int, Piece] = {}

        def local_rows() -> None:
            nonlocal rows
            if self._group_fsdp and self.param_wire_dtype is not None:
                # FSDP2's children read their rows' 16-bit params (fsdp.read_local_params), not param_fp8.
                raise ValueError(f"param_wire_dtype={self.param_wire_dtype!r} (FP8 params out) is not supported "
                                 "with FSDP2 params over several devices")
            if self._group_fsdp:
                rows = {piece.index: piece for piece in fsdp.local_pieces(self.entries, group_ranks)}

        # Through one exchange: a rank whose shards FSDP2 laid out otherwise fails every rank,
        # rather than leave rank 0 waiting for the others in _look_at_devices.
        together(group_ranks, local_rows, "cossd: a rank could not open the optimizer", reraise_own=True)
        layouts = self._look_at_devices(mounts, namespace)
        tensors = [(entry.name, entry.numel) for entry in self.entries]
        if all(layout is not None for layout in layouts):
            placement = recorded_placement(tensors, layouts, mounts)  # type: ignore[arg-type]
        else:
            placement = place_on_devices(tensors, len(mounts))
        children: list[Any] = []
        self._child_groups = []
        owner: dict[int, list[tuple[Any, Entry]]] = {}
        try:
            for mount, shard in zip(mounts, placement):
                # Each param group's tensors on this device, in param order: a whole tensor is
                # the param itself, a piece is a 1-D view of the param's elements (_piece_tensor).
                by_group: dict[int, list[tuple[torch.Tensor, str]]] = {}
                for piece in shard:
                    entry = self.entries[piece.index]
                    whole = piece.start == 0 and piece.stop == entry.numel
                    if self._group_fsdp:
                        tensor = self._fsdp_stand_in(entry, piece)
                    else:
                        tensor = entry.param if whole else self._piece_tensor(entry, piece)
                    by_group.setdefault(entry.group, []).append((tensor, entry.name))
                groups, parents = [], []
                for index, params in sorted(by_group.items()):
                    options = {key: value for key, value in self.param_groups[index].items()
                               if key not in ("params", "param_names")}
                    groups.append(options | {"params": [tensor for tensor, _ in params],
                                             "param_names": [name for _, name in params]})
                    parents.append(index)
                preset = self._fsdp_preset(shard, rows) if self._group_fsdp else None
                child = make_child(groups, mount, group_ranks, preset)
                children.append(child)
                self._child_groups.append(parents)
                for piece, theirs in zip(shard, child.entries):
                    owner.setdefault(piece.index, []).append((child, theirs))
        except BaseException:
            for child in children:
                child.close()
            raise
        self._group = children
        self._owner = owner
        self._fanout = DeviceFanout(len(children))
        try:
            self._recover_group(mounts)
        except BaseException:
            self._close_group()  # refused (devices too far apart): nothing left open
            raise
        self.restored = all(child.restored for child in children)
        self.steps_skipped = sum(child.steps_skipped for child in children)

    @staticmethod
    def _fsdp_stand_in(entry: Entry, piece: Piece) -> torch.Tensor:
        """Under FSDP2 a device's child holds no elements of its pieces itself (each rank's
        rows are in its local shards, reached through the child's views): its param for a
        piece only gives the piece's size, an expanded one-element tensor (no memory)."""
        local = fsdp.as_dtensor(entry).to_local()
        return torch.zeros(1, dtype=local.dtype, device=local.device).expand(piece.numel)

    def _fsdp_preset(self, shard: list[Piece], rows: dict[int, Piece]) -> dict[str, Any]:
        """A device's child under FSDP2: this rank's rows of each of the device's pieces (the
        part of its local shard that falls in the piece, in the piece's own elements), and
        views of those elements in the local shards of the params and their gradients."""
        mine: list[Piece] = []
        where: dict[int, tuple[Entry, int]] = {}  # child entry -> (the param's entry, local offset of its start)
        for position, piece in enumerate(shard):
            local = rows.get(piece.index)
            if local is None:
                continue  # this rank holds no rows of this tensor (more ranks than rows)
            low, high = max(piece.start, local.start), min(piece.stop, local.stop)
            if low < high:
                mine.append(Piece(position, piece.name, low - piece.start, high - piece.start))
                where[position] = (self.entries[piece.index], piece.start - local.start)

        def flat(tensor: torch.Tensor, name: str) -> torch.Tensor:
            if not tensor.is_contiguous():
                raise ValueError(f"param {name}: its FSDP2 local shard is not contiguous")
            return tensor.view(-1)

        def param(row: Piece) -> torch.Tensor:
            entry, offset = where[row.index]
            return flat(fsdp.as_dtensor(entry).to_local(), entry.name)[offset + row.start : offset + row.stop]

        def grad(row: Piece) -> torch.Tensor | None:
            entry, offset = where[row.index]
            gradient = entry.param.grad
            if gradient is None:
                return None
            local = gradient.to_local() if fsdp.is_dtensor(gradient) else gradient
            return flat(local, entry.name)[offset + row.start : offset + row.stop]

        return {"_fsdp_rows": mine, "_fsdp_views": (param, grad), "_fsdp_sends": fsdp.sends_rows(self.entries)}

    def _piece_tensor(self, entry: Entry, piece: Piece) -> torch.Tensor:
        """The child's param for elements piece.start..stop-1 of `entry`'s param: a 1-D view of
        them, so that the child reads the committed params straight into the model's param.
        Made again before each use (_refresh_pieces): a model moved or cast after the
        optimizer was made (model.to(bfloat16)) holds new storage under the same param."""
        tensor = self._flat_range(entry, piece.start, piece.stop)
        self._pieces.append((tensor, entry, piece.start, piece.stop))
        return tensor

    @staticmethod
    def _flat_range(entry: Entry, start: int, stop: int) -> torch.Tensor:
        param = entry.param.detach()
        if not param.is_contiguous():
            raise ValueError(f"param {entry.name} is split across devices but is not contiguous: its "
                             "pieces are views of its elements in order; make it contiguous")
        return param.view(-1)[start:stop]

    def _refresh_pieces(self, with_grads: bool = False) -> None:
        """Point every piece at its param's elements now, and (`with_grads`) its .grad at the
        same elements of the param's gradient, for the children to send."""
        for tensor, entry, start, stop in self._pieces:
            tensor.data = self._flat_range(entry, start, stop)
            if with_grads:
                grad = entry.param.grad
                assert grad is not None  # step() refused a step with missing gradients
                tensor.grad = grad.detach().reshape(-1)[start:stop]

    def _drop_piece_grads(self) -> None:
        for tensor, _, _, _ in self._pieces:
            tensor.grad = None

    def _look_at_devices(self, mounts: list[str], namespace: str) -> list[list[tuple[str, int]] | None]:
        """Each device's tensors (name, numel) where it holds the namespace, else None. Refuse
        a group whose namespace lies on some devices past step 0 and is missing on others (a
        device replaced or added): creating it there would join a fresh start to a trained
        state. Rank 0 looks; every rank gets the same answer or raises the same."""
        def look() -> list[list[tuple[str, int]] | None]:
            found: dict[str, int | None] = {}
            layouts: list[list[tuple[str, int]] | None] = []
            probes = [NamespaceFiles(mount, namespace, 30.0, use_cmb=False,
                                     credentials=self._credentials)  # type: ignore[attr-defined]
                      for mount in mounts]
            try:
                # A load_state_dict over the group that a killed job left half done: undone or
                # finished on every device alike, before any device is looked at alone.
                done = namespace_swap.resolve_group(probes)
                if done is not None:
                    warnings.warn(f"cossd: {done}", RuntimeWarning, stacklevel=6)
                # A DCP load (a rollback to a snapshot on every device) that a killed job left
                # half done: finished or undone on every device alike (dcp/group.py).
                if all(probe.exists() for probe in probes):
                    done = dcp_group.resolve(probes)
                    if done is not None:
                        warnings.warn(f"cossd: {done}", RuntimeWarning, stacklevel=6)
            except BaseException:
                for probe in probes:
                    probe.close()
                raise
            for mount, probe in zip(mounts, probes):
                try:
                    if probe.exists():
                        found[mount] = int(probe.statistics()["committed_step"])
                        layouts.append([(t["name"], int(t["numel"])) for t in probe.config()["tensors"]])
                    else:
                        found[mount] = None
                        layouts.append(None)
                finally:
                    probe.close()
            missing = [mount for mount, step in found.items() if step is None]
            trained = {mount: step for mount, step in found.items() if step}
            if missing and trained:
                raise RuntimeError(
                    f"namespace {namespace!r} is missing on {', '.join(missing)} but holds trained state "
                    f"on {', '.join(f'{mount} (step {step})' for mount, step in trained.items())}: the "
                    "group's devices are not the ones it was trained on. Nothing was created; name the "
                    "same devices in the same order, or delete the namespace everywhere to start anew")
            return layouts

        ranks = self._group_ranks
        assert ranks is not None
        answer: dict[str, Any] = {}
        interrupted: BaseException | None = None
        if ranks.rank == 0:
            try:
                answer["layouts"] = look()
            except BaseException as exc:
                answer["error"] = f"{type(exc).__name__}: {exc}"
                interrupted = None if isinstance(exc, Exception) else exc
        answer = ranks.from_rank0(answer)
        if interrupted is not None:
            raise interrupted  # rank 0's own Ctrl-C or SIGTERM stays what it is; the others get its text
        if "error" in answer:
            raise RuntimeError(answer["error"].removeprefix("RuntimeError: "))
        return [None if layout is None else [(name, numel) for name, numel in layout]
                for layout in answer["layouts"]]

    def _on_rank0(self, action: Any) -> str | None:
        """Run `action` on rank 0 only; every rank gets its failure (the text) or None, so
        every rank raises alike, and none goes on before rank 0 is done."""
        ranks = self._group_ranks
        assert ranks is not None
        error = None
        interrupted: BaseException | None = None
        if ranks.rank == 0:
            try:
                action()
            except BaseException as exc:
                error = f"{type(exc).__name__}: {exc}"
                interrupted = None if isinstance(exc, Exception) else exc
        error = ranks.from_rank0(error)
        if interrupted is not None:
            raise interrupted  # as in _look_at_devices: an interrupt is not turned into a text
        return error

    def _revert(self, indices: Any, step: int) -> str | None:
        """REVERT_STEP of `step` on the children at `indices`, by rank 0 (see _on_rank0)."""
        children = self._group
        assert children is not None

        def revert() -> None:
            for index in indices:
                child = children[index]
                child.files.command(child.files.admin.revert_step, child.files.nsid, step)
        return self._on_rank0(revert)

    def _recover_group(self, mounts: list[str]) -> None:
        """Bring every device to one common step: a crash between the devices' commits of a
        step leaves some at N + 1 and the rest at N; rank 0 reverts those at N + 1 (each
        still holds step N in its other copy), every rank then reads the params again."""
        children = self._group
        ranks = self._group_ranks
        assert children is not None and ranks is not None
        steps = [child.committed_step for child in children]
        plan = common_step(steps, mounts)  # GroupDisagreementError on every rank alike
        if plan.revert:
            error = self._revert(plan.revert, plan.step + 1)
            if error is not None:
                raise GroupDisagreementError(
                    f"devices {[mounts[index] for index in plan.revert]} are at step {plan.step + 1} and the "
                    f"others at {plan.step}; reverting them failed: {error}")
            self._refresh_pieces()
            for index in plan.revert:
                children[index].committed_step = plan.step
                children[index]._read_params()
            if ranks.rank == 0:
                warnings.warn(
                    f"cossd: namespace {self.files.name!r}: {', '.join(mounts[index] for index in plan.revert)} "
                    f"had committed step {plan.step + 1} and the other devices had not (a crash between the "
                    f"devices' commits); reverted to step {plan.step}, where the job resumes",
                    RuntimeWarning, stacklevel=5)
        self.committed_step = plan.step

    # ------------------------------------------------------------------ the step

    def _sync_group_options(self) -> None:
        """The parent's param-group options (a schedule's lr, say) into every child's groups."""
        assert self._group is not None
        for child, parents in zip(self._group, self._child_groups):
            for group, parent in zip(child.param_groups, parents):
                for key, value in self.param_groups[parent].items():
                    if key not in ("params", "param_names"):
                        group[key] = value

    def _step_group(self, loss_scale: float, timing: dict[str, float]) -> dict[str, Any]:
        """One step of the group: every rank's pieces for every device, one gather of their
        squared norms (the global norm, and whether any rank holds an inf or NaN: then the
        step is skipped by every rank before any device sees it), BEGIN and gradients on every
        device, every commit, every device's commit made durable, and only then params back.
        No rank begins the next step anywhere before all of this, which is what makes a crash
        at any point recoverable to one common step (docs/architecture.md)."""
        children, ranks = self._group, self._group_ranks
        assert children is not None and ranks is not None
        clock = time.perf_counter
        started = clock()
        self._sync_group_options()
        step = self.committed_step + 1
        if ranks.world > 1 and self._average is None and not self._group_fsdp:
            # Decided once over the whole params (a piece of a split tensor is no param of the
            # DDP module), then the same for every child.
            average = self._averaging()  # type: ignore[attr-defined]
            for child in children:
                child._average = average
        self._refresh_pieces(with_grads=True)
        try:
            pieces = [child._shard_grads() for child in children]
        finally:
            self._drop_piece_grads()  # each child has its pieces' gradients on the host now
        squares = math.fsum(child._squares(mine) for child, mine in zip(children, pieces))
        total = math.fsum(ranks.gather(squares))
        if not math.isfinite(total):
            timing["grads_s"] = clock() - started
            return {"step": step, "committed_step": self.committed_step, "skipped": True}
        coefficient = 1.0
        if self.max_grad_norm is not None:
            self.last_grad_norm = math.sqrt(total) / loss_scale
            coefficient = grad_rules.clip_coefficient(self.last_grad_norm, self.max_grad_norm)
        # Each phase runs on every device at once (a thread per device), and the next phase
        # starts only once every device has finished this one: BEGIN and gradients
        # everywhere, then every commit, then every flush (params back come after, in
        # step()). So the protocol's order across devices is the one sequential calls gave,
        # and the step takes about the slowest device's time, not the sum of theirs.
        fanout = self._fanout
        if ranks.world > 1:
            # After the step's collectives (the norms' gather), before any begin: params written
            # outside the optimizer are taken as the masters before the first commit or refused
            # (step_guards.py).
            self._check_changed_params_of_ranks()
        self._step_begun = True  # from here a failed step() is checked (optim._ensure_consistent)
        began = fanout.run(lambda at: children[at]._begin_shared(pieces[at], coefficient / loss_scale),
                           range(len(children)))
        self._raise_first(began, f"step {step} was not committed: sending it failed")
        timing["begin_s"] = max(outcome.value for outcome in began)  # the longest device's
        committing = clock()
        timing["grads_s"] = committing - started - timing["begin_s"]

        def commit(child: Any) -> dict[str, Any]:
            result: dict[str, Any] = child._wait_for_commit(step)
            child._step_open = False
            return result

        waited = fanout.run(commit, children)
        ahead = [self.files.mounts[index] for index, outcome in enumerate(waited)
                 if outcome.error is None and not outcome.value["skipped"]]
        if any(outcome.error is not None for outcome in waited):
            raise self._first_error(waited, (
                f"{', '.join(ahead)} committed step {step}; restarting the job reverts "
                f"{'them' if len(ahead) > 1 else 'it'} (every device resumes from step {step - 1})")
                if ahead else f"no device committed step {step} (every device stays at step {step - 1})")
        committed = [index for index, outcome in enumerate(waited) if not outcome.value["skipped"]]
        if len(committed) < len(children):
            # A device skipped what the gather found finite (its own check saw an overflow
            # that ours did not): the step is skipped by the group, the others go back.
            self._revert_after_skip(step, committed)
            timing["commit_s"] = clock() - committing
            return {"step": step, "committed_step": self.committed_step, "skipped": True}

        def flush(child: Any) -> None:
            # The next begin anywhere must find this step durable on every device (in plp
            # mode a commit is acknowledged before it is on the media); with sync commits
            # this finds nothing to do.
            child.files.command(child.files.admin.flush, child.files.nsid)
            child.committed_step = step

        self._raise_first(fanout.run(flush, children),
                          f"every device committed step {step}; making it durable failed")
        timing["commit_s"] = clock() - committing
        return {"step": step, "committed_step": step, "skipped": False}

    def _first_error(self, outcomes: list[Outcome], context: str) -> BaseException:
        """The one error a phase of the step raises where devices failed: the first failed
        device's (its type kept, so a caller's `except DeviceLostError` still holds), naming
        that device, every other failed device and what `context` says of the group."""
        mounts = self.files.mounts
        failed = [(mounts[index], outcome.error) for index, outcome in enumerate(outcomes)
                  if outcome.error is not None]
        where, first = failed[0]
        others = "".join(f" Also on {mount}: {type(error).__name__}: {error}." for mount, error in failed[1:])
        text = f"on {where}: {str(first).rstrip('.')}.{others} {context}"
        if isinstance(first, (StepAbortedError, DeviceLostError)):
            combined = type(first)(text)
            combined.__cause__ = first.__cause__
            return combined
        assert first is not None
        first.add_note(f"cossd: {text}")  # an error whose type takes more than a message
        return first

    def _raise_first(self, outcomes: list[Outcome], context: str) -> None:
        if any(outcome.error is not None for outcome in outcomes):
            raise self._first_error(outcomes, context)

    def _revert_after_skip(self, step: int, committed: list[int]) -> None:
        """Rank 0 reverts the devices that committed `step` while another skipped it; every
        rank waits for it, so none begins the step again before the group is back at one."""
        error = self._revert(committed, step)
        if error is not None:
            raise GroupDisagreementError(
                f"step {step} was skipped by some devices and committed by others; reverting those "
                f"failed ({error}); restart the job: it brings every device to one step")

    def _read_group_params(self) -> None:
        """Every device's committed params into the model, the devices at once (each writes
        its own elements: whole params, or its piece's range of a split one), unless a
        child's read is a collective of the ranks (param_gather="allgather" at several
        ranks): collectives must run in one order on every rank, so those go one by one."""
        children, ranks = self._group, self._group_ranks
        assert children is not None and ranks is not None
        self._params_behind = True  # until every device's are in (a failure leaves it: re-read later)
        self._refresh_pieces()
        if ranks.world > 1 and any(getattr(child, "_param_gather", "device") == "allgather" for child in children):
            for child in children:
                child._read_params()
            self._params_behind = False
            self._note_params()
            return
        self._raise_first(self._fanout.run(lambda child: child._read_params(), children),
                          f"reading the params of committed step {self.committed_step} back failed: the model's "
                          "params may be partly the step before's (the devices hold the committed ones: the next "
                          "step(), state_dict() or master_weights() reads them again, or a restart does)")
        self._params_behind = False
        self._note_params()

    def _abort_group(self, why: str) -> None:
        """Abort the open step on every device (best effort: a step() that failed). Devices
        that committed it already stay there until the job's restart reverts them."""
        for child in self._group or []:
            child._abort(why)

    def _close_group(self) -> None:
        fanout = getattr(self, "_fanout", None)
        if fanout is not None:
            fanout.close()
        for child in self._group or []:
            child.close()

    # ------------------------------------------------------------------ state_dict's reads

    def _group_read_state(self, entry: Entry, role: str) -> torch.Tensor:
        parts = [child._read_state(theirs, role).reshape(-1) for child, theirs in self._owner[entry.index]]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).view(entry.param.shape)

    def _group_master_weights(self) -> list[torch.Tensor]:
        masters = []
        for entry in self.entries:
            parts = [child.files.read(theirs.name, "master", torch.float32, theirs.numel)
                     for child, theirs in self._owner[entry.index]]
            masters.append((parts[0] if len(parts) == 1 else torch.cat(parts)).view(entry.param.shape))
        return masters

    def _load_group_state(self, step: int, loads: list[tuple[str, str, torch.Tensor]]) -> None:
        """load_state_dict of another state over the group (state_dict.py has checked it all):
        each device gets its pieces of `loads` (name, role, flat values) in a staging
        namespace, and rank 0 switches every device to them atomically for the group
        (namespace_swap.replace_group: after a kill, the next open leaves the old state on
        every device or the new one on every device); every rank then reads the params."""
        children, ranks = self._group, self._group_ranks
        assert children is not None and ranks is not None
        self._sync_group_options()  # the loaded groups' options go into each device's namespace
        entries = {entry.name: entry for entry in self.entries}
        position = {id(child): index for index, child in enumerate(children)}
        per_child: list[list[tuple[str, str, torch.Tensor]]] = [[] for _ in children]
        for name, role, values in loads:
            at = 0
            for child, theirs in self._owner[entries[name].index]:
                per_child[position[id(child)]].append((theirs.name, role, values[at : at + theirs.numel]))
                at += theirs.numel
        hook = self.load_hook or (lambda stage: None)  # type: ignore[attr-defined]

        def writer(child: Any, mine: list[tuple[str, str, torch.Tensor]]) -> Callable[[], Any]:
            return lambda: child.files.write_many(mine)

        def replace() -> None:
            namespace_swap.replace_group(
                [child.files for child in children], [child._description(step) for child in children],
                [writer(child, mine) for child, mine in zip(children, per_child)], hook)

        follow_rank0_load(children, ranks, replace)
        for child in children:
            child.committed_step, child.steps_skipped = step, 0
        self.committed_step, self.steps_skipped, self.last_step_skipped = step, 0, False
        # The device rounds the masters to the wire dtype; the model continues from that.
        self._read_group_params()

    def _group_identity(self) -> dict[str, Any]:
        assert self._group is not None
        return {"devices": [child._identity() for child in self._group]}

    def _group_refusal(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"{what} is not supported for a namespace spread over several devices "
            f"({self.files.mountpoint}) yet")


__all__ = ["DeviceGroup", "GroupDisagreementError", "PLACEMENT_BLOCK_ELEMS", "mount_list", "place_on_devices",
           "recorded_placement"]
