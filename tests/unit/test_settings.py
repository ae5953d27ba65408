"""The COSSD_* environment knobs (cossd/settings.py): read in that module alone, each documented once, bad values refused by name; the daemon's test faults behind COSSD_FAULT_HOOKS."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cossd import settings
from cossd.fs.fault_hooks import NONE, FaultHooks, InjectedFault
from helpers import REPO_ROOT

KNOB_NAME = re.compile(r"COSSD_[A-Z0-9_]+")


def test_an_unset_or_empty_knob_means_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for knob in settings.KNOBS:
        monkeypatch.delenv(knob.name, raising=False)
        assert knob.read() == knob.default, knob.name
        monkeypatch.setenv(knob.name, "  ")
        assert knob.read() == knob.default, knob.name


def test_knobs_read_their_values_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COSSD_IO_THREADS", " 3 ")
    assert settings.IO_THREADS.read() == 3
    monkeypatch.setenv("COSSD_IO_THREADS", "0")
    assert settings.IO_THREADS.read() == 0
    monkeypatch.setenv("COSSD_STATE_WRITES", "PWrite")
    assert settings.STATE_WRITES.read() == "pwrite"
    monkeypatch.setenv("COSSD_PREFETCH", "0")
    assert settings.PREFETCH.read() is False
    monkeypatch.setenv("COSSD_PREFETCH", "1")
    assert settings.PREFETCH.read() is True


@pytest.mark.parametrize("knob, value", [(settings.IO_THREADS, "four"), (settings.IO_THREADS, "-1"),
                                         (settings.FUSE_REQUEST_PAGES, "1M")])
def test_a_count_knob_set_to_nonsense_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                                         knob: settings.Knob[int], value: str) -> None:
    monkeypatch.setenv(knob.name, value)
    with pytest.raises(settings.SettingError, match=f"{knob.name}='{re.escape(value)}'"):
        knob.read()


def test_no_module_reads_a_knob_but_settings() -> None:
    """Every read of a COSSD_* variable goes through cossd/settings.py: no other module of the
    package names one beside os.environ or os.getenv."""
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    offenders = []
    for name in setuptools["packages"]:
        for module in sorted((REPO_ROOT / setuptools["package-dir"][name]).glob("*.py")):
            if module == REPO_ROOT / "cossd_pkg/settings.py":
                continue
            for number, line in enumerate(module.read_text().splitlines(), 1):
                if re.search(r"\b(environ|getenv)\b", line) and KNOB_NAME.search(line):
                    offenders.append(f"{module.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
    assert not offenders, "COSSD_* read outside cossd/settings.py:\n" + "\n".join(offenders)


def test_docs_configuration_lists_every_knob_once() -> None:
    """docs/configuration.md's table has a row for each knob and none for a knob that is gone."""
    table = (REPO_ROOT / "docs/configuration.md").read_text()
    rows = [name for line in table.splitlines() if line.startswith("| `COSSD_")
            for name in KNOB_NAME.findall(line)[:1]]
    assert rows == [knob.name for knob in settings.KNOBS]


@pytest.mark.parametrize("spec, hooks", [
    ("", NONE),
    ("hang-before-ready", FaultHooks(hang_before_ready=True)),
    ("fail-handler=read", FaultHooks(failing_handler="read")),
    (" fail-handler=lookup:3 , hang-before-ready", FaultHooks(True, "lookup", 3)),
])
def test_fault_hooks_parse(spec: str, hooks: FaultHooks) -> None:
    assert FaultHooks.parse(spec) == hooks


@pytest.mark.parametrize("spec", ["hang", "fail-handler", "fail-handler=:2", "fail-handler=read:0",
                                  "fail-handler=read:x", "hang-before-ready=1"])
def test_a_fault_hook_spec_that_means_nothing_is_refused(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv("COSSD_FAULT_HOOKS", spec)
    with pytest.raises(settings.SettingError, match="COSSD_FAULT_HOOKS"):
        FaultHooks.from_environment()


def test_the_product_arms_no_fault_and_a_test_arms_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COSSD_FAULT_HOOKS", raising=False)
    assert FaultHooks.from_environment() == NONE and NONE.handler_fault() is None
    monkeypatch.setenv("COSSD_FAULT_HOOKS", "fail-handler=read:2")
    hook = FaultHooks.from_environment().handler_fault()
    assert hook is not None
    hook("read")
    hook("lookup")
    with pytest.raises(InjectedFault, match="read"):
        hook("read")
    hook("read")  # the Nth call alone


def test_a_bad_knob_under_a_foreground_mount_is_one_line_and_mounts_nothing(tmp_path: Path) -> None:
    """`cossd mount --foreground` with COSSD_IO_THREADS set to nonsense: exit 1 with one line
    naming the knob (it was a traceback: SettingError is a ValueError, which the CLI let by)."""
    from cossd.emulator import Device

    backing, mountpoint = tmp_path / "backing", tmp_path / "mnt"
    Device.format(backing)
    mountpoint.mkdir()
    result = subprocess.run([sys.executable, "-m", "cossd.tools.cli", "mount", "--foreground", str(backing),
                             str(mountpoint)], env=os.environ | {"COSSD_IO_THREADS": "x"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "COSSD_IO_THREADS" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not os.path.ismount(mountpoint)
