"""The faults the mount daemon injects into itself for tests, all behind one knob: COSSD_FAULT_HOOKS.

The product never arms one: with the knob unset, FaultHooks.from_environment() is NONE and the
daemon's only cost is a test of two attributes. Tests set the knob to comma-separated hooks:

- `hang-before-ready`: the daemon mounts, then sleeps instead of telling its launcher it is
  ready (a start-up that hangs with the mount in place; tests/mount/test_launch.py).
- `fail-handler=OP[:N]`: the Nth call (default the first) of the FUSE handler OP raises
  InjectedFault, to show that a handler's failure never takes the mount down
  (tests/mount/test_mount_errno.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from .. import settings

log = logging.getLogger("cossd.fs.daemon")

HANG_BEFORE_READY = "hang-before-ready"
FAIL_HANDLER = "fail-handler"


class InjectedFault(RuntimeError):
    """Raised by the fail-handler hook to prove a handler failure cannot take the mount down."""


@dataclass(frozen=True)
class FaultHooks:
    """Which test faults this daemon injects (none unless COSSD_FAULT_HOOKS names some)."""

    hang_before_ready: bool = False
    failing_handler: str | None = None  # the FUSE handler (Operations method) that raises
    failing_call: int = 1  # which of its calls, counted from 1

    @classmethod
    def parse(cls, spec: str) -> FaultHooks:
        """The hooks a COSSD_FAULT_HOOKS value names; ValueError for anything else."""
        hang, handler, call = False, None, 1
        for entry in filter(None, (part.strip() for part in spec.split(","))):
            name, _, value = entry.partition("=")
            if name == HANG_BEFORE_READY and not value:
                hang = True
            elif name == FAIL_HANDLER and value:
                handler, _, nth = value.partition(":")
                call = int(nth) if nth else 1
                if not handler or call < 1:
                    raise ValueError(f"{FAIL_HANDLER}=OP[:N] needs a handler name and N >= 1, got {value!r}")
            else:
                raise ValueError(f"unknown fault hook {entry!r} (known: {HANG_BEFORE_READY}, {FAIL_HANDLER}=OP[:N])")
        return cls(hang, handler, call)

    @classmethod
    def from_environment(cls) -> FaultHooks:
        """The hooks COSSD_FAULT_HOOKS arms; NONE where it is unset."""
        spec = settings.FAULT_HOOKS.read()
        try:
            hooks = cls.parse(spec)
        except ValueError as exc:
            raise settings.SettingError(f"{settings.FAULT_HOOKS.name}={spec!r}: {exc}") from None
        if hooks != NONE:
            log.warning("fault injection armed (tests only): %s", spec)
        return hooks

    def handler_fault(self) -> Callable[[str], None] | None:
        """Operations.fault_hook: called with each handler's name, it raises on the chosen call."""
        if self.failing_handler is None:
            return None
        target, op = self.failing_call, self.failing_handler
        calls = 0

        def hook(name: str) -> None:
            nonlocal calls
            if name == op:
                calls += 1
                if calls == target:
                    raise InjectedFault(f"injected failure in {op} (call {target})")

        return hook


NONE = FaultHooks()
