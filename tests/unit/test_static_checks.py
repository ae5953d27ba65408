"""The static checks: ruff over the repository and mypy over the packages kept clean ([tool.ruff], [tool.mypy])."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import REPO_ROOT, package_tree

# The packages mypy must find clean: every one (trainer module by module, below), and the
# cossd package's own modules (settings, lazy).
TYPED_PACKAGES = ["protocol", "kernels", "model", "client", "integrations", "tools", "server", "fs", "harness",
                  "emulator", "trainer.checkpoint"]
# trainer's own modules are gated one by one, every one but these (a new module is gated as it comes).
UNTYPED_TRAINER_MODULES = {"group", "deepspeed_zero"}


def _trainer_modules() -> list[str]:
    return [f"cossd.trainer.{path.stem}" if path.stem != "__init__" else "cossd.trainer"
            for path in sorted((REPO_ROOT / "trainer").glob("*.py")) if path.stem not in UNTYPED_TRAINER_MODULES]


def _tool(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def test_ruff_finds_nothing() -> None:
    """Every file of the repository passes ruff's rule set ([tool.ruff] in pyproject.toml)."""
    result = subprocess.run([_tool("ruff"), "check", "--no-cache", "--output-format", "concise", "."],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_the_typed_packages_clean(tmp_path: Path) -> None:
    """mypy, on the linked tree the package installs as, reports no error in TYPED_PACKAGES
    nor in trainer's modules but UNTYPED_TRAINER_MODULES."""
    tree = package_tree(tmp_path)
    packages = [argument for name in TYPED_PACKAGES for argument in ("-p", f"cossd.{name}")]
    packages += [argument for module in _trainer_modules() for argument in ("-m", module)]
    result = subprocess.run([_tool("mypy"), "--config-file", str(REPO_ROOT / "pyproject.toml"),
                             "--cache-dir", str(tmp_path / "mypy-cache"), *packages],
                            cwd=tree, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
