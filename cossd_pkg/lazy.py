"""Names a package exports but imports only when first used (PEP 562's module __getattr__).

Why: the mount daemon and `cossd mount` import cossd.emulator, cossd.protocol and
cossd.client for a few light modules (the layout arithmetic, the statuses, the mount table)
before numpy; importing every name a package exports would import numpy with them and cost
the restart its head start.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, homes: Mapping[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of package `package`, whose exported names live in the
    modules `homes` gives (relative to the package, as `from .x import name` would name them);
    `namespace` is the package's globals(), where each name is kept once imported."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, package), name)
        namespace[name] = value  # once: later lookups find it without this hook
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(homes))

    return __getattr__, __dir__
