"""CLI tier: every integer a verb puts in a command field is refused out of that field's width
and sign, at parse time (argparse's usage error, exit 2), never cut to fit and never a
traceback; the clients refuse the same values with a ValueError before anything is sent, and
the CLI turns such an error (or an OverflowError) into its one line, exit 1."""
from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import pytest

import cossd.client
from conftest import Mount
from cossd.client import AdminClient
from cossd.client.computational import ComputationalClient
from cossd.emulator import Device
from cossd.emulator.controller import Controller
from cossd.protocol.features import FeatureId
from cossd.protocol.logpages import LogId
from cossd.tools import arguments
from cossd.tools.verbs.features import get_feature, set_feature
from helpers import InProcessTransport, run_cli

MP = "MP"  # stands for the device in the cases below

# (verb and its options, the option refused): each out of its field's width or sign.
REFUSED: list[tuple[list[str], str]] = [
    # The reviewer's truncations: the value was cut, the CLI printed the one given.
    (["get-feature", MP, "-f", "0x104"], "-f/--feature-id"),
    (["get-log", MP, "-i", "0x102", "-o", "json"], "-i/--log-id"),
    (["set-feature", MP, "-f", "4", "-v", "0x100000154"], "-v/--value"),
    (["cp-activate", MP, "cp", "--index", "65536", "--deactivate"], "--index"),
    # The reviewer's tracebacks (OverflowError on the way to the wire).
    (["begin-step", MP, "a", "--step", "-1"], "--step"),
    (["revert-step", MP, "a", "--step", "-1"], "--step"),
    (["admin-passthru", MP, "--opcode", "0x1ff"], "--opcode"),
    (["admin-passthru", MP, "--opcode", "6", "--namespace-id", "-1"], "--namespace-id"),
    (["admin-passthru", MP, "--opcode", "6", "--cdw10", "0x100000000"], "--cdw10"),
    (["get-feature", MP, "-f", "4", "-c", "-1"], "-c/--cdw11"),
    (["id-ns", MP, "-n", "-1"], "-n/--namespace-id"),
    (["cp-activate", MP, "cp", "--index", "-1"], "--index"),
    (["cp-exec", MP, "cp", "--range-set", "1", "--step", "-1"], "--step"),
    (["cp-exec", MP, "cp", "--range-set", "-1"], "--range-set"),
    (["cp-exec", MP, "cp", "--range-set", "70000"], "--range-set"),
    (["cp-exec", MP, "cp", "--range-set", "1", "--index", "-1"], "--index"),
    (["slm-read", MP, "mem", "--length", "8", "--offset", "-4"], "--offset"),
    (["slm-read", MP, "mem", "--length", "-8"], "--length"),
    (["slm-write", MP, "mem", "--input-file", "/dev/null", "--offset", "-4"], "--offset"),
    # The other integer options of the verbs.
    (["begin-step", MP, "a", "--step", str(1 << 64)], "--step"),
    (["admin-passthru", MP, "--opcode", "6", "--cdw15", "-1"], "--cdw15"),
    (["set-feature", MP, "-f", "0x100", "-v", "1"], "-f/--feature-id"),
    (["set-feature", MP, "-f", "4", "-v", "-1"], "-v/--value"),
    (["cp-exec", MP, "cp", "--range", f"{1 << 32}:0:4"], "--range"),
    (["cp-exec", MP, "cp", "--range", "1:-4:4"], "--range"),
    (["cp-exec", MP, "cp", "--range", f"1:0:{1 << 32}"], "--range"),
    (["slm-read", MP, "mem", "--length", str(1 << 32)], "--length"),
    (["inject-error", MP, "--opcode", "0x100", "--status", "write-fault"], "--opcode"),
    (["inject-error", MP, "--opcode", "6", "--status", "0x800"], "--status"),
    (["inject-error", MP, "--opcode", "6", "--status", "write-fault", "--count", "0"], "--count"),
    (["inject-error", MP, "--corrupt", "a", "--tensor", "w", "--block", "-1"], "--block"),
    (["create-ns", MP, "a", "--tensor", "w:0"], "--tensor"),
    (["archive", MP, "a", "--every", "0", "--to", "s3://b/p"], "--every"),
    (["archive", MP, "a", "--every", "1", "--keep-local", "-1", "--to", "s3://b/p"], "--keep-local"),
    (["top", MP, "-n", "0"], "-n/--iterations"),
]


class Recording:
    """A transport into an in-process controller that keeps every entry it was given."""

    location = "in-process"

    def __init__(self, controller: Controller) -> None:
        self.inner = InProcessTransport(controller)
        self.sent: list[bytes] = []

    def exchange(self, raw: bytes) -> Any:
        self.sent.append(raw)
        return self.inner.exchange(raw)

    def close(self) -> None:
        pass


@pytest.fixture
def rig(device: Device) -> Iterator[tuple[Recording, AdminClient]]:
    controller = Controller(device, 1 << 20)
    transport = Recording(controller)
    try:
        yield transport, AdminClient(transport)  # type: ignore[arg-type]
    finally:
        controller.close()


@pytest.fixture
def cli_device(rig: tuple[Recording, AdminClient], monkeypatch: pytest.MonkeyPatch) -> Recording:
    """The CLI's verbs reach the rig's device, whatever DEVICE they are given (open_client
    makes its AdminClient from cossd.client's)."""
    transport, _ = rig
    monkeypatch.setattr(cossd.client, "AdminClient", lambda *_args, **_options: AdminClient(transport))  # type: ignore[arg-type]
    return transport


def _usage_error(code: int, err: str, verb: str, flag: str) -> str:
    """The one error line of argparse's usage error (exit 2), naming the flag; no traceback."""
    assert code == 2, err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith(f"cossd {verb}: error: ")]
    assert len(errors) == 1, err
    assert f"argument {flag}: " in errors[0], err
    return errors[0]


@pytest.mark.parametrize("argv,flag", REFUSED, ids=[" ".join(argv[:1] + argv[2:]) for argv, _ in REFUSED])
def test_an_integer_out_of_its_field_is_a_usage_error_and_sends_nothing(
        argv: list[str], flag: str, cli_device: Recording, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *argv)
    line = _usage_error(code, err, argv[0], flag)
    assert "out of range" in line and out == ""
    assert cli_device.sent == []  # refused before a client was even opened


def test_the_message_gives_the_range_in_the_base_it_was_asked_in(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "cp-activate", "/nowhere", "cp", "--index", "65536")
    assert _usage_error(code, err, "cp-activate", "--index").endswith("argument --index: 65536 is out of range 0..65535")
    code, _, err = run_cli(capsys, "get-feature", "/nowhere", "-f", "0x104")
    assert _usage_error(code, err, "get-feature", "-f/--feature-id").endswith("0x104 is out of range 0..0xff")


def test_the_bounds_themselves_pass() -> None:
    for parse, low, high in ((arguments.parse_u8, "0", "0xff"), (arguments.parse_u16, "0", "65535"),
                             (arguments.parse_u32, "0", "0xffffffff"), (arguments.parse_u64, "0", str((1 << 64) - 1))):
        assert parse(low) == 0 and parse(high) == int(high, 0)
    assert arguments.parse_positive("1") == 1


def _program_0_activated(client: AdminClient, nsid: int) -> bool:
    return bool(ComputationalClient(client).identify(nsid)["programs"][0]["activated"])


def test_a_refused_index_leaves_program_0_as_it_was(
        rig: tuple[Recording, AdminClient], cli_device: Recording, capsys: pytest.CaptureFixture[str]) -> None:
    """The reviewer's case: --index 65536 --deactivate activated program 0 (its bit 16 fell
    into SEL). Now refused; program 0 stays deactivated, and then activated."""
    _, client = rig
    compute = ComputationalClient(client).ensure_namespace("cp", "compute")
    for active in (False, True):
        flags = [] if active else ["--deactivate"]
        assert run_cli(capsys, "cp-activate", MP, "cp", "--index", "0", *flags)[0] == 0
        assert _program_0_activated(client, compute) is active
        sent = len(cli_device.sent)
        code, _, err = run_cli(capsys, "cp-activate", MP, "cp", "--index", "65536", "--deactivate")
        _usage_error(code, err, "cp-activate", "--index")
        assert len(cli_device.sent) == sent and _program_0_activated(client, compute) is active


def test_a_refused_feature_value_leaves_the_feature_as_it_was(
        cli_device: Recording, capsys: pytest.CaptureFixture[str]) -> None:
    """-v 0x100000154 set 0x154 (and printed 0x100000154); -f 0x104 read feature 04h."""
    code, out, _ = run_cli(capsys, "get-feature", MP, "-f", "4", "-o", "json")
    before = json.loads(out)["value"]
    assert code == 0 and before != 0x154
    code, _, err = run_cli(capsys, "set-feature", MP, "-f", "4", "-v", "0x100000154")
    _usage_error(code, err, "set-feature", "-v/--value")
    code, out, _ = run_cli(capsys, "get-feature", MP, "-f", "4", "-o", "json")
    assert code == 0 and json.loads(out)["value"] == before


# Each client call with a field out of its width: a ValueError naming it, nothing sent.
CLIENT_REFUSALS: list[tuple[str, Callable[[AdminClient, ComputationalClient], object], str]] = [
    ("begin_step -1", lambda a, c: a.begin_step(1, -1), "step"),
    ("begin_step 2**64", lambda a, c: a.begin_step(1, 1 << 64), "step"),
    ("revert_step -1", lambda a, c: a.revert_step(1, -1), "step"),
    ("begin_shared_step -1", lambda a, c: a.begin_shared_step(1, -1, 1.0, job=1, seq=1, ranks=1, rank=0), "step"),
    ("get_log_page 0x102", lambda a, c: a.get_log_page(0x102), "log page identifier"),
    ("submit opcode 0x1ff", lambda a, c: a.submit(0x1FF), "opcode"),
    ("submit nsid -1", lambda a, c: a.submit(6, nsid=-1), "nsid"),
    ("submit cdw10 2**32", lambda a, c: a.submit(6, cdw10=1 << 32), "cdw10"),
    ("get_feature 0x104", lambda a, c: get_feature(a, 0x104), "feature identifier"),
    ("get_feature select 8", lambda a, c: get_feature(a, 4, select=8), "select"),
    ("get_feature cdw11 -1", lambda a, c: get_feature(a, 4, cdw11=-1), "cdw11"),
    ("set_feature value 2**32+0x154", lambda a, c: set_feature(a, 4, value=0x100000154), "value"),
    ("activate 65536", lambda a, c: c.activate(1, 65536, active=False), "program index"),
    ("activate -1", lambda a, c: c.activate(1, -1), "program index"),
    ("delete_range_set 65536", lambda a, c: c.delete_range_set(1, 65536), "memory range set ID"),
    ("execute range_set 70000", lambda a, c: c.execute(1, range_set=70000), "memory range set ID"),
    ("execute index -1", lambda a, c: c.execute(1, range_set=1, index=-1), "program index"),
    ("execute step -1", lambda a, c: c.execute(1, range_set=1, step=-1), "step"),
    ("execute range mnsid 2**32", lambda a, c: c.execute(1, ranges=[(1 << 32, 0, 4)]), "range MNSID"),
    ("create_range_set length -4", lambda a, c: c.create_range_set(1, [(1, 0, -4)]), "range length"),
    ("read offset -4", lambda a, c: c.read(1, -4, 8), "offset"),
    ("read length -8", lambda a, c: c.read(1, 0, -8), "length"),
    ("write offset -4", lambda a, c: c.write(1, -4, b"abcd"), "offset"),
    ("fill pattern 2**32", lambda a, c: c.fill(1, 0, 4, 1 << 32), "pattern"),
    ("copy_from_memory saddr -1", lambda a, c: c.copy_from_memory(1, 0, [(1, -1, 4)]), "source address"),
    ("copy_from_nvm slba -1", lambda a, c: c.copy_from_nvm(1, 0, [(1, -1, 1)]), "source LBA"),
]


@pytest.mark.parametrize("why,call,field", CLIENT_REFUSALS, ids=[why for why, _, _ in CLIENT_REFUSALS])
def test_the_clients_refuse_a_field_out_of_its_width_and_send_nothing(
        rig: tuple[Recording, AdminClient], why: str, call: Callable[[AdminClient, ComputationalClient], object],
        field: str) -> None:
    transport, client = rig
    with pytest.raises(ValueError, match=f"^{field} .*out of range 0\\.\\.") as caught:
        call(client, ComputationalClient(client))
    assert transport.sent == [], why
    assert "\n" not in str(caught.value)


def test_the_clients_still_send_the_bounds(rig: tuple[Recording, AdminClient]) -> None:
    transport, client = rig
    assert client.get_log_page(LogId.SMART, length=4)  # 8-bit log id, unchanged
    assert get_feature(client, FeatureId.TEMPERATURE_THRESHOLD).result > 0
    assert len(transport.sent) == 2


def test_a_value_the_client_refuses_is_the_cli_one_line_error(
        cli_device: Recording, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Past a parser that let it through, the client's ValueError is the CLI's one line
    (`cossd VERB: message`, exit 1), and nothing was sent but the lookup of the name."""
    import cossd.tools.verbs.admin as admin_verbs

    ComputationalClient(AdminClient(cli_device)).ensure_namespace("cp", "compute")  # type: ignore[arg-type]
    monkeypatch.setattr(admin_verbs, "parse_u64", arguments.parse_int)  # a parser without the bound
    sent = len(cli_device.sent)
    code, out, err = run_cli(capsys, "revert-step", MP, "cp", "--step", "-1")
    assert code == 1 and out == "" and "Traceback" not in err
    assert err == "cossd revert-step: step -1 is out of range 0..18446744073709551615 (64 bits)\n"
    assert len(cli_device.sent) == sent + 1  # VENDOR_IDENTIFY for the name, no REVERT_STEP


def test_an_overflow_on_the_way_to_the_wire_is_the_cli_one_line_error(
        cli_device: Recording, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The reviewer's traceback (protocol/entries.py: OverflowError) with both bounds gone:
    still one line, exit 1."""
    import cossd.client.admin as admin_client
    import cossd.tools.verbs.admin as admin_verbs

    ComputationalClient(AdminClient(cli_device)).ensure_namespace("cp", "compute")  # type: ignore[arg-type]
    monkeypatch.setattr(admin_verbs, "parse_u64", arguments.parse_int)
    monkeypatch.setattr(admin_client, "split_u64", lambda _what, value: (value & 0xFFFF_FFFF, value >> 32))
    monkeypatch.setattr(admin_client, "SUBMISSION_FIELD_BITS", {})
    code, out, err = run_cli(capsys, "revert-step", MP, "cp", "--step", "-1")
    assert code == 1 and out == "" and "Traceback" not in err
    assert err.startswith("cossd revert-step: ") and err.count("\n") == 1


@pytest.mark.mount
def test_on_a_mount_a_refused_index_changes_no_program(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    """The reviewer's repro on a real mount: cp-activate --index 65536 --deactivate."""
    mp = str(mount.mountpoint)
    with AdminClient(mount.mountpoint) as client:
        compute = ComputationalClient(client).ensure_namespace("cp", "compute")
    assert run_cli(capsys, "cp-activate", mp, "cp", "--deactivate")[0] == 0
    code, _, err = run_cli(capsys, "cp-activate", mp, "cp", "--index", "65536", "--deactivate")
    _usage_error(code, err, "cp-activate", "--index")
    with AdminClient(mount.mountpoint) as client:
        assert not _program_0_activated(client, compute)
    code, _, err = run_cli(capsys, "begin-step", mp, "cp", "--step", "-1")
    _usage_error(code, err, "begin-step", "--step")


def test_every_verbs_integer_options_are_bounded() -> None:
    """No verb takes a plain int (or an unbounded parse_int) for an option: each has its range.
    Not the tools' own: demo's and bench's (cossd.trainer.options, their own ValueErrors) and
    serve's hidden --ready-fd (server/command.py, the daemon's pipe, given by cossd itself)."""
    import argparse

    from cossd.tools.cli import build_parser

    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    plain = [f"{verb} {action.dest}" for verb, sub in verbs.choices.items() for action in sub._actions
             if action.type in (int, arguments.parse_int) and verb not in ("demo", "bench")
             and (verb, action.dest) != ("serve", "ready_fd")]
    assert plain == []
