"""The package's import contracts ([tool.importlinter] in pyproject.toml), run with lint-imports."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from helpers import package_tree

ROOT = Path(__file__).resolve().parents[2]


def test_the_import_contracts_hold(tmp_path: Path) -> None:
    """Layers, clients that never import the device, and no cycle anywhere: every
    contract of pyproject.toml is kept (its ignore_imports name what issue 15 leaves)."""
    tree = package_tree(tmp_path)
    lint_imports = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # Run from the linked tree, so the `cossd` that grimp finds is that one.
    result = subprocess.run([str(lint_imports), "--no-cache", str(ROOT / "pyproject.toml")],
                            cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    report = result.stdout + result.stderr
    assert result.returncode == 0, report
    assert "0 broken" in report, report


def test_the_linked_tree_holds_every_module(tmp_path: Path) -> None:
    """The contracts see every module: the tree lint-imports reads has each .py file of
    every package folder that pyproject lists (a missed folder would pass unchecked)."""
    tree = package_tree(tmp_path)
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for name in setuptools["packages"]:
        folder = ROOT / setuptools["package-dir"][name]
        linked = tree / "cossd" / name.removeprefix("cossd").lstrip(".").replace(".", "/")
        assert sorted(p.name for p in folder.glob("*.py")) == sorted(p.name for p in linked.glob("*.py")), name


# Run as plain scripts, not imported as part of the package: their imports are absolute.
PLAIN_SCRIPTS = {"tools/gpu_node_run.py"}
ABSOLUTE_IMPORT = re.compile(r"^\s*(from cossd(\.|\s)|import cossd\b)", re.M)


def test_imports_inside_the_package_are_relative() -> None:
    """Every module of the package imports the package relatively (`from ..emulator import
    Device`), so the import graph and the folder layout agree for any tool that reads the
    tree; only the plain scripts (PLAIN_SCRIPTS) import it by name."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    offenders = []
    for name in setuptools["packages"]:
        for module in sorted((ROOT / setuptools["package-dir"][name]).glob("*.py")):
            relative = str(module.relative_to(ROOT))
            if relative in PLAIN_SCRIPTS:
                continue
            offenders += [f"{relative}: {line.strip()}" for line in module.read_text().splitlines()
                          if ABSOLUTE_IMPORT.match(line)]
    assert not offenders, "absolute imports of cossd inside the package:\n" + "\n".join(offenders)
