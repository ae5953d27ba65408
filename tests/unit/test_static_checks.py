"""The static checks: ruff over the repository and mypy over the whole package ([tool.ruff], [tool.mypy])."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import REPO_ROOT, package_tree


def _tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def test_ruff_finds_nothing() -> None:
    """Every file of the repository passes ruff's rule set ([tool.ruff] in pyproject.toml)."""
    result = subprocess.run([_tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_the_package_clean(tmp_path: Path) -> None:
    """mypy, on the linked tree the package installs as, reports no error anywhere in cossd:
    every subpackage and cossd's own modules, so a new module is checked as it comes."""
    tree = package_tree(tmp_path)
    result = subprocess.run([_tool("mypy"), "--config-file", str(REPO_ROOT / "pyproject.toml"),
                             "--cache-dir", str(tmp_path / "mypy-cache"), "-p", "cossd"],
                            cwd=tree, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
