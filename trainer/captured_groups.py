"""Drop the process groups that libraries hold as default arguments, so destroy_process_group frees them."""
from __future__ import annotations

import inspect
import sys
from typing import Any

# Modules whose functions take `group=<the WORLD group>` as a default argument. Python
# evaluates a default once, when the module is imported: imported after init_process_group,
# the default holds the job's group for the life of the process. torch imports the first one
# lazily, the first time any torch optimizer is built (torch._dynamo pulls it in), which a
# job does after making its group.
CAPTURING_MODULES = (
    "torch.distributed.nn.functional",
    "torch.distributed.optim.zero_redundancy_optimizer",
    "torch.distributed.fsdp.sharded_grad_scaler",
    "deepspeed.comm.torch",
)


def release_captured_groups() -> int:
    """Replace each process group a loaded CAPTURING_MODULES function holds as a default by
    None; the number replaced.

    Why: a group so held outlives destroy_process_group and Python's shutdown, so its gloo
    threads (gloo_tcp_loop, pt_gloo_runloop) still run while exit() tears the runtime down. A
    worker thread that drops the last reference to a finished collective then needs the GIL
    of an interpreter that is finalizing, and the process aborts ("terminate called without
    an active exception", exit -6) instead of exiting with its own code. A rank that fails
    right after the ranks' exchange was seen to do so, about one run in ten on 2 cores.
    Every function listed reads None as "the default group", so None is the same default
    without the stale reference."""
    from torch.distributed import ProcessGroup

    replaced = 0
    for name in CAPTURING_MODULES:
        module = sys.modules.get(name)
        if module is None:
            continue  # not imported: nothing captured
        for function in _functions_of(module):
            defaults = function.__defaults__
            if defaults and any(isinstance(value, ProcessGroup) for value in defaults):
                replaced += sum(isinstance(value, ProcessGroup) for value in defaults)
                function.__defaults__ = tuple(None if isinstance(value, ProcessGroup) else value
                                              for value in defaults)
    return replaced


def _functions_of(module: Any) -> list[Any]:
    """The plain functions a module defines, at its top level and in its classes (methods,
    static and class methods), unwrapped from their decorators."""
    found = []
    for value in vars(module).values():
        members = list(vars(value).values()) if inspect.isclass(value) and value.__module__ == module.__name__ else [value]
        for member in members:
            member = getattr(member, "__func__", member)  # staticmethod, classmethod
            if callable(member):
                member = inspect.unwrap(member)
            if inspect.isfunction(member) and member.__module__ == module.__name__:
                found.append(member)
    return found
