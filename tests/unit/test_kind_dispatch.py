"""No module outside the namespace kinds' own tells the kinds apart by class (issue 35): each asks the kind itself."""
from __future__ import annotations

import ast
import importlib
import json
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

from helpers import InProcessTransport, REPO_ROOT

from cossd.client import AdminClient
from cossd.emulator import Device
from cossd.emulator.controller import Controller
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.emulator.namespace import Namespace
from cossd.emulator.nvm import NvmNamespace
from cossd.protocol.entries import Opcode
from cossd.protocol.features import FeatureId
from cossd.protocol.status import Status

# The kinds' own modules: where the kind classes are defined, and may know each other. Every
# other module narrows with the kinds' methods (as_optimizer, as_nvm, as_plain_nvm,
# as_compute, as_memory) or calls the io_* methods each kind has.
KIND_MODULES = frozenset({
    "cossd.emulator.namespace.core",
    "cossd.emulator.nvm",
    "cossd.emulator.computational.namespaces",
})
# Every kind is one of these or a subclass (the compute and memory kinds are NvmNamespaces).
KIND_BASES = (Namespace, NvmNamespace)


def package_modules(root: Path) -> Iterator[tuple[str, str, Path]]:
    """(module name, the package its relative imports start from, file) of each module of
    the package, as pyproject.toml maps its folders."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package in setuptools["packages"]:
        for path in sorted((root / setuptools["package-dir"][package]).glob("*.py")):
            yield (package if path.stem == "__init__" else f"{package}.{path.stem}"), package, path


def _imported_names(tree: ast.Module, package: str) -> dict[str, tuple[str, str | None]]:
    """Each name an import binds: (the module it comes from, the attribute of it or None)."""
    names: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                parts = package.split(".")
                source = ".".join(parts[: len(parts) - node.level + 1] + ([source] if source else []))
            for alias in node.names:
                names[alias.asname or alias.name] = (source, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    names[alias.asname] = (alias.name, None)
                else:
                    top = alias.name.partition(".")[0]
                    names[top] = (top, None)
    return names


def _attribute(value: Any, name: str) -> Any:
    """value.name, or the submodule `name` of a package not imported yet (cossd.emulator
    exports lazily)."""
    found = getattr(value, name, None)
    if found is None and isinstance(value, ModuleType):
        try:
            found = importlib.import_module(f"{value.__name__}.{name}")
        except ImportError:
            return None
    return found


def _resolve(expression: ast.expr, names: dict[str, tuple[str, str | None]]) -> Any:
    """The object a class expression names, where it comes from the package; None otherwise."""
    attributes: list[str] = []
    while isinstance(expression, ast.Attribute):
        attributes.insert(0, expression.attr)
        expression = expression.value
    if not isinstance(expression, ast.Name) or expression.id not in names:
        return None
    source, attribute = names[expression.id]
    if source.partition(".")[0] != "cossd":
        return None  # a kind comes from the package: argparse.Namespace is none
    value: Any = importlib.import_module(source)
    for name in ([attribute] if attribute else []) + attributes:
        value = _attribute(value, name)
    return value


def _is_kind(expression: ast.expr, names: dict[str, tuple[str, str | None]]) -> bool:
    """Whether `expression` names a kind class, or a tuple holds one."""
    if isinstance(expression, ast.Tuple):
        return any(_is_kind(element, names) for element in expression.elts)
    value = _resolve(expression, names)
    return isinstance(value, type) and issubclass(value, KIND_BASES)


def _is_type_of(expression: ast.expr) -> bool:
    """`type(x)` or `x.__class__`."""
    if isinstance(expression, ast.Call) and isinstance(expression.func, ast.Name):
        return expression.func.id == "type" and len(expression.args) == 1
    return isinstance(expression, ast.Attribute) and expression.attr == "__class__"


def kind_checks(source: str, package: str) -> list[int]:
    """The lines of `source` (a module of `package`) that tell namespace kinds apart by class:
    isinstance or issubclass against a kind, `type(x) is Kind` (or ==, is not, !=), or a
    class pattern of a kind in a match statement."""
    tree = ast.parse(source)
    names = _imported_names(tree, package)
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("isinstance", "issubclass") and len(node.args) == 2
                and _is_kind(node.args[1], names)):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_type_of(side) for side in sides) and any(_is_kind(side, names) for side in sides):
                lines.append(node.lineno)
        elif isinstance(node, ast.MatchClass) and _is_kind(node.cls, names):
            lines.append(node.lineno)
    return lines


def test_no_kind_checks_outside_the_kinds() -> None:
    """Every module but the kinds' own dispatches through the kind (issue 35: no
    `isinstance` of a namespace kind outside the kinds)."""
    found = [f"{path.relative_to(REPO_ROOT)}:{line}"
             for module, package, path in package_modules(REPO_ROOT) if module not in KIND_MODULES
             for line in kind_checks(path.read_text(), package)]
    assert found == [], "namespace kinds told apart by class; ask the kind (as_optimizer(), as_memory(), ...):\n" \
        + "\n".join(found)


def test_the_walk_covers_the_device_and_its_front_ends() -> None:
    """The walk reads every package folder, the kinds' modules among them (a missed folder
    would pass unchecked)."""
    modules = {module for module, _, _ in package_modules(REPO_ROOT)}
    assert KIND_MODULES <= modules
    for expected in ("cossd.emulator.computational.commands", "cossd.emulator.features", "cossd.fs.operations",
                     "cossd.server.writes", "cossd.harness.bench.restore", "cossd.emulator.archive.policy"):
        assert expected in modules, expected


def test_the_check_finds_each_form_of_a_kind_check() -> None:
    """Each way of telling the kinds apart by class is found, through absolute, relative and
    module imports; a check of another class named Namespace is not."""
    found = kind_checks(
        "import argparse\n"                                                   # 1
        "import cossd.emulator.nvm as nvm\n"                                  # 2
        "from ..namespace import Namespace as Optimizer\n"                    # 3
        "from cossd.emulator.computational.namespaces import MemoryNamespace\n"  # 4
        "from .. import kinds\n"                                              # 5
        "isinstance(a, Optimizer)\n"                                          # 6
        "isinstance(a, (int, nvm.NvmNamespace))\n"                            # 7
        "type(a) is not MemoryNamespace\n"                                    # 8
        "a.__class__ == kinds.ComputeNamespace\n"                             # 9
        "isinstance(a, argparse.Namespace)\n"                                 # 10
        "isinstance(a, int)\n"                                                # 11
        "match a:\n"                                                          # 12
        "    case MemoryNamespace():\n"                                       # 13
        "        pass\n",
        "cossd.emulator.snapshots")
    assert found == [6, 7, 8, 9, 13]


def test_the_kinds_answer_their_narrowing() -> None:
    """Each kind answers the narrowing that names it with itself and every other with None,
    so that dispatching through it picks the same kind an isinstance check did."""
    from cossd.emulator.computational.namespaces import ComputeNamespace, MemoryNamespace

    narrowings = ("as_optimizer", "as_nvm", "as_plain_nvm", "as_compute", "as_memory")
    answers = {Namespace: {"as_optimizer"}, NvmNamespace: {"as_nvm", "as_plain_nvm"},
               ComputeNamespace: {"as_nvm", "as_compute"}, MemoryNamespace: {"as_nvm", "as_memory"}}
    for kind, itself in answers.items():
        namespace = object.__new__(kind)  # the narrowing reads no state: no files needed
        for narrowing in narrowings:
            expected = namespace if narrowing in itself else None
            assert getattr(kind, narrowing)(namespace) is expected, (kind.__name__, narrowing)


def test_durability_reaches_each_kind_through_its_narrowing(device: Device) -> None:
    """The device setting's durability ("sync" or "plp") switches an optimizer namespace's
    fsync at commit and every NVM namespace's write cache (the computational kinds are NVM
    namespaces to the device), each found through as_optimizer() / as_nvm(); and back."""
    controller = Controller(device, 0)
    try:
        admin = AdminClient(InProcessTransport(controller))  # type: ignore[arg-type]
        admin.create_namespace({"name": "opt", "tensors": [["w", BLOCK_ELEMS]]})
        admin.create_namespace({"name": "raw", "kind": "nvm", "capacity_bytes": 1 << 20})
        admin.create_namespace({"name": "cp", "kind": "compute"})
        admin.create_namespace({"name": "slm", "kind": "memory", "capacity_bytes": 4096})
        for durability, sync in (("sync", True), ("plp", False)):
            completion = admin.submit(Opcode.SET_FEATURES, cdw10=FeatureId.DEVICE_SETTINGS,
                                      payload=json.dumps({"durability": durability}).encode())
            assert completion.status == Status.SUCCESS
            namespaces = device.namespaces
            assert namespaces["opt"].sync_commits is sync  # type: ignore[union-attr]
            assert [namespaces[name].write_through for name in ("raw", "cp", "slm")] == [sync] * 3  # type: ignore[union-attr]
    finally:
        controller.close()
