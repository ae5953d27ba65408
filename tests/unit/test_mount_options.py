"""MountOptions (fs/mount_options.py): one options object from `cossd mount` to the daemon, its defaults declared once."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from cossd.emulator.geometry import DEFAULT_CMB_BYTES
from cossd.emulator.namespace.verify import VERIFY_BACKGROUND, VERIFY_MODES
from cossd.fs import mount_main
from cossd.fs.mount_options import VERIFY_CHOICES, MountOptions
from cossd.model.profiles import DEFAULT_PROFILE
from cossd.tools import cli


def _mount_args(*words: str) -> argparse.Namespace:
    return cli.build_parser(only="mount").parse_args(["mount", *words])


def test_the_daemon_reads_back_every_field_the_launcher_writes(tmp_path: Path) -> None:
    """Every field crosses the JSON unchanged, whatever its type, so a new field needs no
    launcher or entry code of its own; the daemon's entry parses it as its --options."""
    options = MountOptions(tmp_path / "b", tmp_path / "m", allow_other=True, debug=True, sync=True,
                           metrics_port=9100, metrics_addr="::1", metrics_token_file=str(tmp_path / "t"),
                           profile="gen5-arm8", timed=True, io_threads=0, cmb_bytes=0, verify="open")
    assert options.backing == str(tmp_path / "b")  # a Path is kept as the string the JSON holds
    assert MountOptions.from_json(options.to_json()) == options
    parsed = mount_main._parser().parse_args(["--ready-fd", "7", "--options", options.to_json()])
    assert parsed.options == options and parsed.ready_fd == 7
    # Every field differs from its default above: none is left out of the round trip.
    defaults = MountOptions("b", "m")
    assert all(getattr(options, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(MountOptions))


@pytest.mark.parametrize("text, why", [
    ('{"backing": "b"}', "mountpoint"),
    ('["b", "m"]', "JSON object"),
    ('{"backing": "b", "mountpoint": "m", "sycn": true}', "unknown mount options: sycn"),
    ('{"backing": "b", "mountpoint": "m", "sync": 1}', "sync must be bool"),
    ('{"backing": "b", "mountpoint": "m", "io_threads": true}', "io_threads must be int or None"),
    ('{"backing": "b", "mountpoint": "m", "cmb_bytes": "1G"}', "cmb_bytes must be int"),
    ('{"backing": "b", "mountpoint": "m", "verify": "never"}', "verify must be one of background, open"),
    ('{"backing": 3, "mountpoint": "m"}', "backing must be str"),
])
def test_options_that_cannot_mean_a_mount_are_refused_by_name(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        MountOptions.from_json(text)


def test_the_daemon_entry_refuses_bad_options_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        mount_main._parser().parse_args(["--options", '{"backing": "b", "mountpoint": "m", "sycn": true}'])
    assert "unknown mount options: sycn" in capsys.readouterr().err


def test_the_defaults_live_in_mount_options() -> None:
    """`cossd mount` with no option builds the dataclass's defaults, which are the device's."""
    options = MountOptions.from_args(_mount_args("/b", "/m"))
    assert options == MountOptions("/b", "/m")
    assert (options.profile, options.cmb_bytes, options.verify) == (DEFAULT_PROFILE, DEFAULT_CMB_BYTES,
                                                                    VERIFY_BACKGROUND)
    assert options.io_threads is None and options.metrics_addr is None
    # The mount's verify choices are the device's (kept apart only for the daemon's light imports).
    assert set(VERIFY_CHOICES) == set(VERIFY_MODES)


def test_the_command_line_fills_each_field_from_its_flag() -> None:
    args = _mount_args("/b", "/m", "--sync", "--allow-other", "--debug", "--metrics-port", "9100",
                       "--metrics-addr", "::1", "--profile", "gen5-arm8", "--timed", "--io-threads", "3",
                       "--cmb-size", "64M", "--verify", "open")
    assert MountOptions.from_args(args) == MountOptions(
        "/b", "/m", sync=True, allow_other=True, debug=True, metrics_port=9100, metrics_addr="::1",
        profile="gen5-arm8", timed=True, io_threads=3, cmb_bytes=64 << 20, verify="open")


def test_a_remote_mount_refuses_exactly_the_device_options_changed() -> None:
    """The device's own options are the server's for cossd://: those set away from their
    defaults are named, with their flags; the mount's own (allow-other, debug) pass."""
    assert MountOptions.from_args(_mount_args("cossd://h:1", "/m", "--allow-other", "--debug",
                                              "--verify", "background")).device_options_given() == []
    given = MountOptions.from_args(_mount_args("cossd://h:1", "/m", "--sync", "--cmb-size", "0",
                                               "--io-threads", "2", "--profile", "gen5-arm8"))
    assert given.device_options_given() == ["--sync", "--profile", "--io-threads", "--cmb-size"]


def test_the_launcher_passes_the_files_named_as_absolute_paths(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    options = MountOptions("b", "m", profile="mine.json", metrics_token_file="token").for_daemon()
    assert (options.profile, options.metrics_token_file) == (str(tmp_path / "mine.json"), str(tmp_path / "token"))
    assert (options.backing, options.mountpoint) == ("b", "m")  # as given, for the daemon's log
    assert MountOptions("b", "m").for_daemon().profile == DEFAULT_PROFILE  # a profile's name stays a name
