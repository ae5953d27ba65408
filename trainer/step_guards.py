"""What keeps an optimizer's step from using or recording a state the device does not hold: params written into the model outside the optimizer, and the devices, the step and the params left apart by a step that failed part way."""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import torch

from . import distributed, fsdp
from .distributed import Ranks
from .namespace.files import committed_steps
from .plan import Entry
from .session import InconsistentStateError


class StepGuards:
    """A mixin of optim._DeviceAdam (its state is the optimizer's own attributes): step(),
    state_dict() and the DCP paths call it before they use or record the device's state."""

    entries: list[Entry]
    files: Any  # NamespaceFiles, or a group's files (group.py)
    param_groups: list[dict[str, Any]]
    committed_step: int
    _group: Any  # the group's member optimizers, or None (group.py)
    _ranks: Ranks | None
    _step_open: bool
    _params_behind: bool
    _inconsistent: str | None
    _param_versions: list[int | tuple[int, int]]
    _read_params: Callable[[], None]
    _read_group_params: Callable[[], None]
    _read_params_alone: Callable[[], None]
    _abort: Callable[..., None]
    _refresh_pieces: Callable[..., None]  # group.py: split tensors' pieces pointed at the params
    load_state_dict: Callable[..., None]

    @property
    def _step_ranks(self) -> Ranks | None:
        """The ranks this optimizer's steps span: a group's (group.py), else its own (None:
        one process)."""
        return self.__dict__.get("_group_ranks") if self._group is not None else self._ranks

    # ------------------------------------------------------------------ params changed outside

    def _note_params(self) -> None:
        """Each param's version counter as cossd's last write left it (for FSDP2's DTensors
        the wrapper's, which a load through it moves, and the local shard's, which a write
        into the shard moves)."""
        self._param_versions = [_version_of(entry.param) for entry in self.entries]

    def _changed_params(self) -> list[Entry]:
        """The entries whose param was written since cossd last wrote it (its version moved)."""
        noted = self.__dict__.get("_param_versions")
        if noted is None or len(noted) != len(self.entries):
            return []
        return [entry for entry, version in zip(self.entries, noted) if _version_of(entry.param) != version]

    def _follow_changed_params(self) -> None:
        """Params written outside the optimizer since the device last wrote them (weights
        loaded into the model after the optimizer was made): the device holds their masters
        and would write its own values over them at this step. Where the values differ from
        the device's: before any step has committed (zero moments) they become the masters
        (the namespace replaced as load_state_dict does, with no moments), as torch's AdamW
        would train from them; after that, refused. Written values equal to the device's
        (a DDP broadcast, a load of the same weights) change nothing. One process (FSDP2 on a
        mesh of one and several devices included); a job of several ranks:
        _check_changed_params_of_ranks."""
        changed = self._changed_params()
        if not changed:
            return
        if self._step_open:
            # A streamed step began from the device's masters: dropped, and its gradients
            # are sent again at once by this step() (session.py, _send_grads).
            self._abort("params changed outside the optimizer")
        differing = self._differing_from_device(changed, self._read_group_params if self._group is not None
                                                else self._read_params)
        if not differing:
            self._note_params()
            return
        names = _listed(differing)
        if self.committed_step > 0:
            raise RuntimeError(
                f"cossd: {len(differing)} param(s) ({names}) were written outside the optimizer (model.load_state_dict, "
                f"say) after namespace {self.files.name!r} reached step {self.committed_step}: the device keeps the "
                "FP32 master weights and moments and would write its own values over them at this step. Nothing was "
                "sent. To train from other weights, load them before making the optimizer (on a new namespace), or "
                "load a checkpoint of the optimizer itself (optimizer.load_state_dict(state), whose cossd_master or "
                "master= carry the weights; or the device's own checkpoint)")
        groups = [{key: value for key, value in group.items() if key != "params"}
                  | {"params": [entry.index for entry in self.entries if entry.group == index]}
                  for index, group in enumerate(self.param_groups)]
        # No step committed: the loaded values are the masters of a fresh step 0, as torch's AdamW starts.
        self.load_state_dict({"state": {}, "param_groups": groups},
                             master=[_local_of(entry.param) for entry in self.entries])

    def _check_changed_params_of_ranks(self) -> None:
        """_follow_changed_params for a job of several ranks. Called after the step's
        collectives and before its begin (sharded.py, group.py), so no step is open yet.
        Before the first commit every rank takes part (_agree_on_changed_params); after it,
        each rank checks its own params (_refuse_changed_params_of_ranks)."""
        if self.committed_step == 0:
            self._agree_on_changed_params()
        else:
            self._refuse_changed_params_of_ranks()

    def _agree_on_changed_params(self) -> None:
        """Before the first commit, every rank (one exchange a step() until then): where some
        rank's params were written outside the optimizer and differ from the device's (weights
        loaded after the optimizer was made: torchtitan's seed checkpoint, Hugging Face
        weights), they become the masters, as in one process, once every rank agrees: the
        namespace still loads (no step began: each rank then writes its own shard's masters,
        sharded.py), and the ranks that hold the same elements (every rank of a model held
        whole, DDP or ZeRO-1; the replicas of HSDP) hold the same values. Else every rank's
        step() refuses, saying why, and nothing is sent. Every rank then reads the params
        back (the device rounds the masters to the wire dtype). Each exchange carries every
        rank's failure (distributed.together), so a rank that fails between two leaves no
        other waiting, and every rank raises it. Where an earlier write of the masters failed
        part way, they are written again whatever the device's params now say."""
        ranks = self._step_ranks
        assert ranks is not None
        changed = self._changed_params()
        half = self.__dict__.get("_masters_half_loaded") is not None
        if not any(ranks.gather(bool(changed) or half)):
            return
        # Every rank reads the device's values here, so a read that is a collective
        # (param_gather="allgather") runs on every rank alike.
        read = self._read_group_params if self._group is not None else self._read_params
        members: list[Any] = self._group if self._group is not None else [self]
        checking = ("cossd: checking the params written outside the optimizer before the first step failed, "
                    "nothing was sent")
        def view() -> dict[str, Any]:
            return {"differing": self._differing_from_device(changed, read), "half": half,
                    "loading": all(bool(member.files.statistics()["loading"]) for member in members)}

        views = distributed.together(ranks, view, checking)
        loaded = [rank for rank, theirs in enumerate(views) if theirs["differing"]]
        if not loaded and not any(theirs["half"] for theirs in views):
            self._note_params()  # the values written are the device's (a DDP broadcast, say)
            return
        names = _listed(sorted({name for theirs in views for name in theirs["differing"]}))
        what = (f"the params of rank(s) {', '.join(map(str, loaded))} ({names}) were written outside the optimizer "
                f"(model.load_state_dict, say) before the first step of namespace {self.files.name!r}" if loaded else
                f"the weights loaded before the first step of namespace {self.files.name!r} (an earlier write of them "
                "as the masters failed part way)")
        if not all(theirs["loading"] for theirs in views):
            raise RuntimeError(
                f"cossd: {what}, but a step began on the device already (a skipped step), so they cannot become the "
                "masters in place. Nothing was sent from any rank. Load them with optimizer.load_state_dict(state, "
                "master=params) on every rank, or load them before making the optimizer")
        def holding() -> dict[str, Any]:
            return {"rows": [_rows_key(entry.param) for entry in self.entries],
                    "digest": _digest_of([_local_of(entry.param) for entry in self.entries])}

        held = distributed.together(ranks, holding, checking)
        holders: dict[str, list[tuple[int, str]]] = {}
        for rank, theirs in enumerate(held):
            holders.setdefault(repr(theirs["rows"]), []).append((rank, theirs["digest"]))
        apart = [[rank for rank, _ in same] for same in holders.values() if len({d for _, d in same}) > 1]
        if apart:
            raise RuntimeError(
                f"cossd: {what}, and ranks that hold the same elements hold different values (ranks "
                f"{'; '.join(', '.join(map(str, group)) for group in apart)}): a model held whole on every rank "
                "(DDP, ZeRO-1), or each replica of an HSDP shard, trains from one set of master weights, so those "
                "ranks must load the same weights. Nothing was sent from any rank, nothing changed on the device. "
                "Load the same weights on every rank, or load them before making the optimizer")

        def write_masters() -> None:
            if self._group is not None:
                self._refresh_pieces()  # the pieces of split tensors: views of the params as they are now
            for member in members:
                member._write_shard_masters()

        # No rank begins a step (which seals the loading) before every rank's masters are in.
        # A failure leaves the namespace loading, part of its masters new, and the params as
        # loaded: the next step() writes them again (or a restarted job's open loads its
        # model's weights again); until then what would record the masters refuses
        # (_inconsistency).
        try:
            distributed.together(ranks, write_masters,
                                 f"cossd: {what}; writing them as the masters failed, nothing was sent")
        except BaseException as exc:  # an interrupt on this rank too: the others wrote theirs
            self.__dict__["_masters_half_loaded"] = f"{type(exc).__name__}: {exc}"
            raise
        self.__dict__["_masters_half_loaded"] = None
        read()  # the params the device holds now (rounded to the wire dtype), each version noted

    def _refuse_changed_params_of_ranks(self) -> None:
        """_follow_changed_params for a job of several ranks after the first commit, on this
        rank's own params: where they differ from the device's, this step is refused on this
        rank (the device's moments belong to its masters). No step is open yet: the other
        ranks' step is aborted at their step_timeout_s. The device's values are read by this
        rank alone; where that is a collective (several devices with param_gather="allgather")
        nothing is checked (docs/trainer.md says so)."""
        changed = self._changed_params()
        if not changed:
            return
        ranks = self._step_ranks
        assert ranks is not None
        if self._group is not None:
            if not self._reads_alone():
                return
            read: Callable[[], None] = self._read_group_params
        else:
            read = self._read_params_alone
        differing = self._differing_from_device(changed, read)
        if not differing:
            self._note_params()
            return
        why = (f"rank {ranks.rank}: {len(differing)} param(s) ({_listed(differing)}) were written outside the "
               "optimizer (model.load_state_dict, say) and differ from the device's")
        raise RuntimeError(
            f"cossd: {why} (namespace {self.files.name!r}, step {self.committed_step}): the device keeps the FP32 "
            "master weights and moments and would write its own values over them at this step. Nothing was sent "
            f"from this rank, and the other {ranks.world - 1} rank(s)' step is not committed. In a job of several "
            "ranks, load the weights before making the optimizer (on a new namespace), or load a checkpoint of the "
            "optimizer itself (optimizer.load_state_dict(state), whose cossd_master or master= carry the weights; "
            "or the device's own checkpoint)")

    def _differing_from_device(self, changed: list[Entry], read: Callable[[], None]) -> list[str]:
        """The names of the `changed` entries whose values are not the device's: the device's
        values read into the params (`read`, as a read-back does), compared, and the loaded
        values put back whatever happens. The loaded values wait in host memory: a GPU need
        not hold a second copy of every changed param (a whole model's, after a load)."""
        loaded = [_local_of(entry.param).detach().to("cpu", copy=True) for entry in changed]
        behind = self._params_behind
        try:
            read()
        except BaseException:
            # The loaded values back (a re-read later must not write over them); nothing was sent.
            for entry, values in zip(changed, loaded):
                _local_of(entry.param).detach().copy_(values)
            self._params_behind = behind
            raise
        differing = [entry.name for entry, values in zip(changed, loaded)
                     if not torch.equal(_local_of(entry.param).detach().cpu(), values)]
        for entry, values in zip(changed, loaded):
            _local_of(entry.param).detach().copy_(values)
        return differing

    # ------------------------------------------------------------------ after a failed step

    def _mark_inconsistent(self, what: str) -> None:
        """A step() failed where the devices, the optimizer's step and the model's params may no
        longer be one step's state: until _ensure_consistent finds them so again, what would
        record or use them refuses."""
        self.__dict__["_inconsistent"] = what

    def _device_steps(self) -> list[int]:
        """Each device's committed step, as the device says now (one small command each)."""
        members = self._group if self._group is not None else [self]
        return committed_steps([member.files for member in members])

    def _reads_alone(self) -> bool:
        """Whether this rank can read the params back by itself (no collective of the ranks)."""
        ranks = self._step_ranks
        if ranks is None or ranks.world == 1:
            return True
        members = self._group if self._group is not None else [self]
        return all(getattr(member, "_param_gather", "device") != "allgather" for member in members)

    def _inconsistency(self, doing: str, check_devices: bool = False) -> str | None:
        """None where the devices, the optimizer's step and the model's params are one step's
        state (after re-reading the params where every device is at the optimizer's step and
        only they may be behind: a read-back that failed); else the refusal's text. With
        `check_devices` a group's devices are asked even where no step() failed."""
        half = self.__dict__.get("_masters_half_loaded")
        if half is not None and doing != "step()":
            return (f"cossd: namespace {self.files.name!r}: {doing} refused: weights loaded before the first step "
                    f"were being written as the masters, and that failed part way ({half}), so the device's masters "
                    "are partly the loaded ones. The next step() writes them all again; or restart the job (its open "
                    "loads the model's weights again)")
        what = self.__dict__.get("_inconsistent")
        behind = bool(self.__dict__.get("_params_behind"))
        if what is None and not behind and not (check_devices and self.__dict__.get("_group") is not None):
            return None
        name = self.files.name
        found = ""
        try:
            steps = self._device_steps()
        except Exception as exc:
            steps = None
            found = f"asking the devices for their committed step failed ({type(exc).__name__}: {str(exc)[:200]})"
        if steps is not None and all(step == self.committed_step for step in steps):
            if not behind:
                self._inconsistent = None
                return None
            if self._reads_alone():
                try:
                    self._read_group_params() if self._group is not None else self._read_params()
                except Exception as exc:
                    found = (f"reading the params of step {self.committed_step} back failed again ({type(exc).__name__}: "
                             f"{str(exc)[:200]})")
                else:
                    self._inconsistent = None
                    return None
            else:
                found = "reading the params back is a collective of the ranks (param_gather='allgather')"
        elif steps is not None:
            mounts = self.files.mounts if self._group is not None else [self.files.mountpoint]
            found = ("the devices' committed steps are " + ", ".join(f"{step} ({mount})" for step, mount in zip(steps, mounts))
                     + f", the optimizer's {self.committed_step}")
        if what is None and steps is None and not behind:
            # Nothing failed here before: the devices could not be asked (a network blip), so
            # this call is refused, and the next one asks again (nothing is marked).
            what = "the devices' committed steps could not be checked"
        elif what is None:
            what = "the model's params were not read back" if behind else "the devices moved outside this optimizer"
            self._mark_inconsistent(what)
        return (f"cossd: namespace {name!r}: {doing} refused: {what}; {found}. The devices, the optimizer's step and the "
                "model's params are not one step's state, and what would be saved, loaded or trained from them now "
                "would mix steps. Make a new optimizer on the same mount(s) (restart the job): opening the namespace "
                "brings every device to one committed step (a device one step ahead is reverted) and reads its params; "
                "then load a checkpoint if you want an earlier state (optimizer.load_state_dict of a full torch-format "
                "state dict also replaces every device's state here)")

    def _ensure_consistent(self, doing: str, check_devices: bool = False) -> None:
        """_inconsistency's refusal raised (InconsistentStateError), where there is one."""
        text = self._inconsistency(doing, check_devices)
        if text is not None:
            raise InconsistentStateError(text)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _rows_key(param: torch.Tensor) -> tuple[int, ...]:
    """Which elements of `param` this rank holds, as comparable across ranks: an FSDP2/HSDP
    DTensor's coordinates on its mesh's sharded dimensions (HSDP's replicas of a shard share
    them), () for a param held whole."""
    if not fsdp.is_dtensor(param):
        return ()
    coordinate: Sequence[int] = param.device_mesh.get_coordinate() or ()
    return tuple(at for at, placement in zip(coordinate, param.placements) if placement.is_shard())


def _digest_of(tensors: list[torch.Tensor]) -> str:
    """A digest of the tensors' bytes, to tell whether the ranks hold the same values."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in tensors:
        digest.update(tensor.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _local_of(param: torch.Tensor) -> torch.Tensor:
    """The tensor holding a param's values here: an FSDP2 DTensor's local shard, else the param."""
    return param.to_local() if fsdp.is_dtensor(param) else param


def _version_of(param: torch.Tensor) -> int | tuple[int, int]:
    """A param's version counter; an FSDP2 DTensor's and its local shard's."""
    if fsdp.is_dtensor(param):
        return (param._version, param.to_local()._version)
    return param._version
