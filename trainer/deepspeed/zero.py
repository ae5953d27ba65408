"""A cossd optimizer under DeepSpeed ZeRO 1/2 (ZeRO-3: deepspeed/zero3.py): every rank's flat FP32 partitions of every param group on one namespace, one shared step per engine.step().

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

The binding itself is deepspeed/binding.py's ZeroBinding. The hooks that get the optimizer there live here (the trainer's side of DeepSpeed): where
deepspeed is imported when a cossd optimizer is made, it leaves its namespace unopened only
where opening it then could not be right (`defers`: a namespace of ZeRO's flat groups, or a
new one in a job of several ranks), and reads nothing but the truth meanwhile
(`deferred_value`); `install` wraps DeepSpeedEngine._configure_optimizer so that
deepspeed.initialize refuses what cossd does not run (cossd.integrations.deepspeed reads
DeepSpeed's config and wrappers for that) before DeepSpeed wraps the optimizer, and `bind`s it
after, converting a namespace the constructor made and never stepped.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types
from typing import Any

import torch

from ...integrations.deepspeed import expected_world_size, refuse_config, world_size
from ..captured_groups import release_captured_groups
from .binding import REFERENCE, SNAPSHOT_PREFIX, ZeroBinding, tensor_name  # noqa: F401  (re-exported)


# ---------------------------------------------------------------------- the hooks

_ENGINE_MODULE = "deepspeed.runtime.engine"  # where DeepSpeedEngine._configure_optimizer lives

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


def defers_before_import(optimizer: torch.optim.Optimizer, streaming: bool, several_devices: bool) -> bool:
    """`defers` for an optimizer made before `import deepspeed`: the hook is installed when
    DeepSpeed's engine module is imported (a one-shot import finder), so that a later
    deepspeed.initialize binds this optimizer as if deepspeed had come first (at one rank),
    or refuses it, naming the import order (at several ranks, where the constructor opened a
    namespace of the model's params for every rank). A namespace of ZeRO's flat groups waits
    for deepspeed.initialize as with deepspeed imported; anything else opens now."""
    if streaming or several_devices:
        return False
    optimizer._ds_before_import = True  # type: ignore[attr-defined]
    if not any(isinstance(finder, _InstallOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallOnImport())
    files = optimizer.files  # type: ignore[attr-defined]
    return files.exists() and holds_zero_groups(files.config())


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Installs the deepspeed.initialize hook right after deepspeed.runtime.engine is imported."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)  # one shot; the real finders find the module
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run_module = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run_module(module)
            install()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _adopt_made_before_import(optimizer: Any) -> None:
    """At deepspeed.initialize, an optimizer made before `import deepspeed`: bound as one
    made after it where one process runs the job; refused at several ranks, before DeepSpeed
    wraps it (nothing was stepped), naming the import order."""
    world = world_size()
    if world > 1 and not optimizer._ds_deferred:
        release_captured_groups()
        raise RuntimeError(
            f"this cossd optimizer was made before `import deepspeed`, and deepspeed.initialize runs ZeRO at "
            f"{world} ranks: it opened namespace {optimizer.files.name!r} for the model's own params, where every "
            "rank's partitions must go to one namespace that deepspeed.initialize opens. Import deepspeed before "
            f"making the optimizer (and delete the never-stepped namespace: `cossd delete-ns {optimizer.files.name}`)")
    optimizer._ds_bindable = True
    if not optimizer._ds_deferred and _never_stepped(optimizer):
        optimizer._ds_fresh = True  # never stepped: a refusal removes it, as for one made after the import


def install() -> None:
    """Wrap DeepSpeedEngine._configure_optimizer once: a cossd client optimizer is checked
    against the engine's config before DeepSpeed wraps it and bound after."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    # A job that made its process group before `import deepspeed` must be able to free it at
    # its end too, not only when refused (trainer/captured_groups.py says why).
    release_captured_groups()
    original = DeepSpeedEngine._configure_optimizer
    if getattr(original, "_cossd_hook", False):
        return

    def _configure_optimizer(engine: Any, client_optimizer: Any, model_parameters: Any) -> Any:
        cossd = client_optimizer if getattr(client_optimizer, "_ds_bindable", False) else None
        if cossd is None and getattr(client_optimizer, "_ds_before_import", False):
            _adopt_made_before_import(client_optimizer)
            cossd = client_optimizer
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
            release_captured_groups()
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
    wraps_it = getattr(wrapper, "optimizer", None) is optimizer  # apart: `is` would narrow `optimizer` to Optional
    if wrapper is not optimizer and getattr(optimizer, "param_wire_dtype", None) is not None:
        # A wrapper makes the model's 16-bit params from the FP32 copies it reads back
        # (ZeRO's partitions, the FP16/BF16 wrapper's masters): the device's FP8 params would
        # never reach the model, and the option would be silently ignored.
        raise ValueError(f"param_wire_dtype={optimizer.param_wire_dtype!r} is not supported under DeepSpeed with "
                         f"a wrapping optimizer ({type(wrapper).__name__}): DeepSpeed makes the model's params from "
                         "the FP32 copies it reads back, so FP8 params would never reach the model. Leave "
                         "param_wire_dtype unset (or train without DeepSpeed, or with its FP32 engine at stage 0)")
    if zero and wraps_it:
        if not optimizer._ds_deferred:
            _convert_for_zero(optimizer)
        if isinstance(wrapper, DeepSpeedZeroOptimizer_Stage3):
            from .zero3 import Zero3Binding
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
        binding.hook_reloads()
        return
    world = world_size()
    if world > 1:
        raise NotImplementedError(
            f"DeepSpeed's {type(wrapper).__name__} with {world} ranks: a cossd optimizer runs "
            "under it in one process only; with several ranks use zero_optimization.stage 1, 2 or 3 "
            "(without data_types.grad_accum_dtype fp32 under BF16)")
    open_deferred(optimizer, f"DeepSpeed without ZeRO 1/2 (its {type(wrapper).__name__}) cannot step it")
    hook_wrapper_reloads(optimizer, wrapper)


# DeepSpeed's methods that set a wrapper's FP32 copies from the model's bit16 params, which
# engine.load_checkpoint calls where it loads the model and not the optimizer's state: the
# first where the wrapper has it (BF16_Optimizer's refresh_fp32_params calls it), else the second.
_RELOADS = ("_restore_from_bit16_weights", "refresh_fp32_params")


def hook_wrapper_reloads(optimizer: Any, wrapper: Any) -> None:
    """At one rank without ZeRO's binding (an FP16/BF16 wrapper at stage 0, BF16_Optimizer):
    DeepSpeed's refresh of the wrapper's FP32 copies (the tensors the device steps) from the
    model, by engine.load_checkpoint(..., load_module_only=True), reaches the device too
    (masters_from_copies). The FP32 engine has no wrapper: the optimizer steps the model's
    params themselves, and follows a load into them on its own (optim.py)."""
    if wrapper is optimizer:
        return
    name = next((name for name in _RELOADS if callable(getattr(type(wrapper), name, None))), None)
    if name is None:
        return
    original = getattr(type(wrapper), name)

    def reload() -> None:
        original(wrapper)
        masters_from_copies(optimizer)

    setattr(wrapper, name, reload)


def masters_from_copies(optimizer: Any) -> None:
    """DeepSpeed has just set the FP32 copies that the optimizer steps from the model's weights
    (a warm start). Where the optimizer has not followed them yet, its first step does, with
    their values as the masters (rebind.py). Where it steps them already (the wrapper's zero-
    gradient step at initialize committed step 1) and their values are not the device's
    masters, the namespace is replaced with them as masters, keeping its step, moments and
    param groups (load_state_dict of its own state with master=: atomic on the device), as
    DeepSpeed replaces torch's AdamW's FP32 copies and keeps its state."""
    if optimizer._bound:
        raise RuntimeError(
            "DeepSpeed loaded new model weights (engine.load_checkpoint with load_module_only=True) into an "
            "engine whose cossd optimizer steps each param group on a namespace of its own; the device cannot "
            "take them there. Load the weights into the model before deepspeed.initialize instead")
    if optimizer._ds_deferred or optimizer._params_moved() or not optimizer.files.exists():
        return
    values = [entry.param.detach() for entry in optimizer.entries]
    device = optimizer.master_weights()
    if all(torch.equal(master.reshape(-1), value.reshape(-1).to("cpu", torch.float32))
           for master, value in zip(device, values)):
        return
    masters: list[torch.Tensor] = [torch.empty(0)] * len(optimizer.entries)
    for entry, value in zip(optimizer.entries, values):
        masters[entry.index] = value.to("cpu", torch.float32).clone()
    optimizer.load_state_dict(optimizer.state_dict(), master=masters)


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
    from ..namespace.files import NamespaceFiles

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
