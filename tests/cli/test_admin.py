"""Admin tier: log pages (SMART, error, effects, C0h), scrub and the nvme-cli shaped verbs, with
every SMART counter proven exact through a real mount."""
from __future__ import annotations

import json
import os
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import Mount, wait_for_exit
from cossd.protocol import logpages
from cossd.protocol.status import Status
from cossd.emulator.health import (
    AMBIENT_KELVIN,
    CRITICAL_TEMP_KELVIN,
    DATA_UNIT_BYTES,
    ENDURANCE_DRIVE_WRITES,
    Health,
)
from cossd.emulator.layout import SUPERBLOCK_HEADER
from cossd.protocol.logpages import LogId
from cossd.emulator.namespace import NamespaceCounters
from cossd.protocol.entries import NSID_ALL, Opcode
from cossd.protocol.computational import CpAdminOpcode
from cossd.tools.cli import main
from cossd.client import AdminClient, mounted_devices
from helpers import create_namespace, run_cli, tensor_dir

pytestmark = pytest.mark.mount

# Every transfer below is at most 60 000 bytes: one FUSE request each, even from an unaligned
# buffer (at most 16 pages), so the request counts are known exactly.
PIECE = 60_000
W_NUMEL = 300_000  # 600 000 bytes of fp16 gradient: 10 pieces, more than one data unit
B_NUMEL = 100


def units(nbytes: int) -> int:
    """NVMe data units: thousands of 512-byte units, rounded up."""
    return -(-nbytes // (512 * 1000))


def pwrite_pieces(path: Path, data: bytes) -> int:
    """Write `data` in PIECE-byte pwrites; returns how many writes were made."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset in range(0, len(data), PIECE):
            assert os.pwrite(fd, data[offset : offset + PIECE], offset) == min(PIECE, len(data) - offset)
    finally:
        os.close(fd)
    return -(-len(data) // PIECE)


def pread_pieces(path: Path, size: int) -> tuple[bytes, int]:
    """Read `size` bytes in PIECE-byte preads that never reach past the end (no EOF request)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = [os.pread(fd, min(PIECE, size - offset), offset) for offset in range(0, size, PIECE)]
    finally:
        os.close(fd)
    return b"".join(chunks), len(chunks)


def smart(mp: Path) -> dict[str, int]:
    with AdminClient(mp) as admin:
        return admin.smart_log()


def committed_copy(backing: Path, name: str) -> str:
    """The copy (A or B) the newest valid superblock slot of namespace `name` names."""
    headers = []
    for slot in ("sb.0", "sb.1"):
        raw = (backing / "ns" / name / slot).read_bytes()
        headers.append(np.frombuffer(raw, dtype=SUPERBLOCK_HEADER, count=1)[0])
    newest = max(headers, key=lambda header: int(header["seq"]))
    return "AB"[int(newest["committed_copy"]) & 1]


def flip_byte(backing: Path, name: str, offset: int) -> None:
    path = backing / "ns" / name / f"state.{committed_copy(backing, name)}"
    with open(path, "r+b") as stream:
        stream.seek(offset)
        byte = stream.read(1)
        stream.seek(offset)
        stream.write(bytes([byte[0] ^ 0x10]))


# ---------------------------------------------------------------------- exact counters


def test_smart_and_c0h_count_exactly_what_the_host_did(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = create_namespace(mp, "net", [("w", W_NUMEL), ("b", B_NUMEL)])
    before = smart(mp)
    assert before["power_cycles"] == 1 and before["unsafe_shutdowns"] == 0
    assert before["host_write_commands"] == 0 and before["data_units_written"] == 0

    # Initial weights of b (one write), then one implicit step: w in 10 pieces, b in one.
    master = np.linspace(-1, 1, B_NUMEL, dtype=np.float32).tobytes()
    writes = pwrite_pieces(tensor_dir(mp, "net", "b") / "master", master)
    grad_w = (np.ones(W_NUMEL) * 0.01).astype(np.float16).tobytes()
    grad_b = np.ones(B_NUMEL, np.float16).tobytes()
    writes += pwrite_pieces(tensor_dir(mp, "net", "w") / "grad", grad_w)
    writes += pwrite_pieces(tensor_dir(mp, "net", "b") / "grad", grad_b)
    assert (mp / "ns/net/step").read_text() == "1\n" and writes == 12
    written = len(master) + len(grad_w) + len(grad_b)

    param_w, reads_w = pread_pieces(tensor_dir(mp, "net", "w") / "param", 2 * W_NUMEL)
    param_b, reads_b = pread_pieces(tensor_dir(mp, "net", "b") / "param", 2 * B_NUMEL)
    read = len(param_w) + len(param_b)
    assert read == 2 * (W_NUMEL + B_NUMEL) and reads_w + reads_b == 11

    after = smart(mp)
    assert after["host_write_commands"] == writes
    assert after["host_read_commands"] == reads_w + reads_b
    assert written > DATA_UNIT_BYTES and after["data_units_written"] == units(written) == 2
    assert read > DATA_UNIT_BYTES and after["data_units_read"] == units(read) == 2
    assert after["media_errors"] == 0 and after["critical_warning"] == 0
    assert after["temperature"] >= AMBIENT_KELVIN and after["avail_spare"] == 100

    with AdminClient(mp) as admin:
        page = admin.optimizer_log(nsid)["net"]
        everything = admin.optimizer_log()
        raw = admin.get_log_page(LogId.SMART)
    assert page["grad_bytes_in"] == len(grad_w) + len(grad_b)
    assert page["state_bytes_loaded"] == len(master)
    assert page["param_bytes_out"] == read and page["bytes_read"] == read
    assert page["write_commands"] == writes and page["read_commands"] == reads_w + reads_b
    assert page["steps_committed"] == 1 and page["steps_skipped"] == 0
    assert page["committed_step"] == 1 and page["durable_step"] in (0, 1)
    assert page["kernel_ns"] > 0 and page["kernel_blocks"] == 3
    assert set(everything) == {"net"} and everything["net"]["grad_bytes_in"] == page["grad_bytes_in"]

    # The raw page holds the same figures at the NVMe byte offsets (128-bit little endian).
    def u128(offset: int) -> int:
        low, high = struct.unpack_from("<QQ", raw, offset)
        return low | high << 64

    assert len(raw) == 512
    assert struct.unpack_from("<H", raw, 1)[0] == after["temperature"]
    assert (raw[3], raw[4]) == (100, 10)
    assert u128(32) == 2 and u128(48) == 2
    assert u128(64) == reads_w + reads_b and u128(80) == writes
    assert u128(112) == 1 and u128(144) == 0 and u128(160) == 0

    # One more read request of each kind moves each count by exactly one.
    _, extra = pread_pieces(tensor_dir(mp, "net", "b") / "param", 2 * B_NUMEL)
    assert smart(mp)["host_read_commands"] == after["host_read_commands"] + extra == after["host_read_commands"] + 1


def test_power_cycles_and_unsafe_shutdowns(mount: Mount) -> None:
    mp = mount.mountpoint
    create_namespace(mp, "net", [("b", B_NUMEL)])
    writes = pwrite_pieces(tensor_dir(mp, "net", "b") / "grad", np.ones(B_NUMEL, np.float16).tobytes())
    first = smart(mp)
    assert (first["power_cycles"], first["unsafe_shutdowns"], first["host_write_commands"]) == (1, 0, writes)

    mount.unmount()  # clean: the counters are saved and survive
    mount.restart()
    second = smart(mp)
    assert (second["power_cycles"], second["unsafe_shutdowns"]) == (2, 0)
    assert second["host_write_commands"] == writes and second["data_units_written"] == first["data_units_written"]

    mount.kill()  # kill -9: the next open finds the device was never closed
    # The daemon marks the device in use with an empty file at once (its record in
    # superblock.json follows, on a thread): a kill at any point while serving is counted.
    assert (mount.backing / "in-use").is_file()
    mount.restart()
    third = smart(mp)
    assert (third["power_cycles"], third["unsafe_shutdowns"]) == (3, 1)
    assert third["host_write_commands"] >= writes  # saved at the clean unmount at least

    mount.unmount()
    mount.restart()
    fourth = smart(mp)
    assert (fourth["power_cycles"], fourth["unsafe_shutdowns"]) == (4, 1)
    assert (mount.backing / "in-use").is_file()  # marked in use while open
    deadline = time.monotonic() + 30  # the mark's durable record, written by a thread
    while (health := json.loads((mount.backing / "superblock.json").read_text())["health"])["clean"]:
        assert time.monotonic() < deadline, "superblock.json never recorded the device in use"
        time.sleep(0.05)
    assert health["power_cycles"] == 4
    mount.unmount()
    health = json.loads((mount.backing / "superblock.json").read_text())["health"]
    assert health["clean"] is True and health["unsafe_shutdowns"] == 1
    assert not (mount.backing / "in-use").exists()


# ---------------------------------------------------------------------- scrub and media errors


def test_scrub_finds_a_flipped_byte_and_recovery_counts_it(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    nsid = create_namespace(mp, "net", [("w", 2000), ("b", B_NUMEL)])
    pwrite_pieces(tensor_dir(mp, "net", "w") / "grad", np.ones(2000, np.float16).tobytes())
    pwrite_pieces(tensor_dir(mp, "net", "b") / "grad", np.ones(B_NUMEL, np.float16).tobytes())
    code, out, _ = run_cli(capsys, "scrub", str(mp))
    assert code == 0 and "net: 2 blocks verified, 0 bad" in out
    before = smart(mp)

    flip_byte(mount.backing, "net", 4 * 1000)  # w's master (first region of the copy), block 0
    code, out, _ = run_cli(capsys, "scrub", str(mp), "net")
    assert code == 1 and "1 bad" in out and "bad block: tensor w block 0" in out
    code, out, _ = run_cli(capsys, "scrub", str(mp), "net", "-o", "json")
    assert code == 1 and json.loads(out) == {"net": {"blocks": 2, "bad": [["w", 0]]}}

    after = smart(mp)
    assert after["media_errors"] == before["media_errors"] + 2  # each scrub found it
    assert after["num_err_log_entries"] == before["num_err_log_entries"] + 2
    with AdminClient(mp) as admin:
        newest = admin.error_log()[0]
        assert admin.optimizer_log(nsid)["net"]["checksum_failures"] == 2
    assert newest["error_count"] == after["num_err_log_entries"]
    assert newest["status_field"] & 0x7FF == Status.UNRECOVERED_READ_ERROR
    assert (newest["nsid"], newest["lba"], newest["cs"]) == (nsid, 0, Opcode.SCRUB)

    # At the next mount, recovery finds step 1's copy bad and falls back to step 0: one more
    # media error, logged with no command (sqid and cmdid FFFFh).
    mount.unmount()
    mount.restart(verify="open")
    assert (mp / "ns/net/step").read_text() == "0\n"
    recovered = smart(mp)
    assert recovered["media_errors"] == after["media_errors"] + 1
    assert recovered["num_err_log_entries"] == after["num_err_log_entries"] + 1
    with AdminClient(mp) as admin:
        (entry,) = admin.error_log()
    assert (entry["sqid"], entry["cmdid"], entry["nsid"], entry["lba"]) == (0xFFFF, 0xFFFF, nsid, 0)
    assert entry["status_field"] & 0x7FF == Status.UNRECOVERED_READ_ERROR


# ---------------------------------------------------------------------- log pages through .admin


def test_every_log_id_answers_and_the_error_log_keeps_the_latest_64(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = create_namespace(mp, "net", [("b", B_NUMEL)])
    # Every page but a storage server's own (C5h), which only `cossd serve` answers.
    supported = {int(lid) for lid in LogId} - {int(LogId.SERVER)}
    with AdminClient(mp) as admin:
        for lid in range(256):
            # Bits above 7:0 (LSP, RAE, NUMDL) do not change which page is returned.
            completion = admin.submit(Opcode.GET_LOG_PAGE, nsid=NSID_ALL, cdw10=lid | 0xFFFF0000)
            if lid in supported:
                assert completion.status == Status.SUCCESS, (lid, completion.data)
            else:
                assert completion.status == Status.INVALID_LOG_PAGE, lid
                assert completion.data.decode() == f"invalid log page {lid:#04x}"
        failures = 256 - len(supported)
        entries = admin.error_log()
        assert len(entries) == logpages.ERROR_LOG_ENTRIES
        assert [e["error_count"] for e in entries] == list(range(failures, failures - 64, -1))
        newest = entries[0]
        assert newest["status_field"] & 0x7FF == Status.INVALID_LOG_PAGE
        assert newest["parm_error_location"] == 40 and newest["cs"] == Opcode.GET_LOG_PAGE
        assert newest["status_field"] >> 14 == 1  # DNR, as in the completion

        # SMART is controller wide; C0h is per namespace or for all.
        assert admin.submit(Opcode.GET_LOG_PAGE, nsid=nsid, cdw10=LogId.SMART).status == Status.INVALID_FIELD
        assert len(admin.get_log_page(LogId.SMART, 0)) == 512
        assert admin.submit(Opcode.GET_LOG_PAGE, nsid=99, cdw10=LogId.OPTIMIZER_STATISTICS).status \
            == Status.INVALID_NAMESPACE
        assert set(admin.optimizer_log(0)) == {"net"}
        assert admin.smart_log()["num_err_log_entries"] == failures + 2

        effects = np.frombuffer(admin.get_log_page(LogId.COMMANDS_SUPPORTED_AND_EFFECTS), dtype="<u4")
        assert effects.size == 1024
        # The vendor opcodes and the Computational Programs admin commands (85h, 88h, 89h).
        supported_opcodes = {int(op) for op in Opcode} | {int(op) for op in CpAdminOpcode}
        assert {op for op in range(256) if effects[op] & logpages.CSUPP} == supported_opcodes
        # The I/O dwords: the compute and memory namespaces' I/O commands (Execute Program and
        # Memory Copy 01h, Memory Read 02h, Fill 04h, Write 05h); a tensor file's I/O has none.
        assert {op for op in range(256) if effects[256 + op] & logpages.CSUPP} == {0x01, 0x02, 0x04, 0x05}
        assert effects[Opcode.CREATE_NAMESPACE] & logpages.NIC and effects[Opcode.COMMIT_STEP] & logpages.LBCC

        # Identify advertises the pages: LPA (effects page), ELPE, and the temperature thresholds.
        page = admin.call(Opcode.IDENTIFY, cdw10=1).data
        assert page[261] & 0x02 and page[262] == 63
        assert struct.unpack_from("<HH", page, 266) == (343, 358)
        assert admin.describe()["identity"]["model"]  # still serving


def test_get_log_page_reads_the_part_numd_and_the_offset_ask_for(mount: Mount) -> None:
    """NUMD (zero's based dwords, cdw10 31:16 and cdw11 15:0) and LPO (cdw12-13) select a part
    of a page, as NVMe has it; past the page's end the data is shorter (data_len). A
    misaligned or out-of-page offset is INVALID_FIELD, logged at byte 48, and changes nothing."""
    mp = mount.mountpoint
    create_namespace(mp, "net", [("b", B_NUMEL)])
    with AdminClient(mp) as admin:
        smart = admin.get_log_page(LogId.SMART)
        assert len(smart) == 512

        def part(cdw10: int, cdw11: int = 0, offset: int = 0):
            return admin.submit(Opcode.GET_LOG_PAGE, nsid=NSID_ALL, cdw10=LogId.SMART | cdw10 << 16, cdw11=cdw11,
                                cdw12=offset & 0xFFFFFFFF, cdw13=offset >> 32)

        assert part(0).data == smart[:4]  # NUMD 0: one dword
        assert part(127).data == smart and part(0xFFFF, 0xFFFF).data == smart
        assert part(1, offset=8).data == smart[8:16]
        assert part(0xFFFF, offset=500).data == smart[500:]  # the page ends first: 12 bytes
        assert part(3, offset=512).data == b""  # at the very end: nothing
        assert part(0, 1).data == smart  # NUMDU counts 64K dwords
        assert admin.get_log_page(LogId.SMART, length=16, offset=496) == smart[496:]
        assert admin.get_log_page(LogId.OPTIMIZER_STATISTICS, length=4, offset=0) == b'{"ne'
        with pytest.raises(ValueError, match="multiple of 4"):
            admin.get_log_page(LogId.SMART, length=6)
        failures = [part(3, offset=2), part(3, offset=516), part(3, offset=1 << 40)]
        assert [c.status for c in failures] == [Status.INVALID_FIELD] * 3
        assert failures[0].data == b"log page offset 2 is not a multiple of 4"
        assert failures[1].data == b"log page offset 516 is past the page's end (512 bytes)"
        entries = admin.error_log()[:3]
        # LPOL (byte 48) is at fault but for the last offset, past the end by its LPOU (byte 52).
        assert [(e["cmdid"], e["parm_error_location"]) for e in entries] == [
            (c.cid, at) for c, at in reversed(list(zip(failures, (48, 48, 52))))]
        # Past the end through LPOU names cdw13 (byte 52); an index offset (cdw14 bit 23, OT) is
        # refused at byte 56.
        upper = admin.submit(Opcode.GET_LOG_PAGE, nsid=NSID_ALL, cdw10=LogId.SMART | 3 << 16, cdw13=1)
        index = admin.submit(Opcode.GET_LOG_PAGE, nsid=NSID_ALL, cdw10=LogId.SMART | 3 << 16, cdw14=1 << 23)
        assert (upper.status, index.status) == (Status.INVALID_FIELD, Status.INVALID_FIELD)
        assert index.data == b"log page offset type 1 (an index) is not supported"
        assert [e["parm_error_location"] for e in admin.error_log()[:2]] == [56, 52]
        # The SMART page's own nsid refusal still names the nsid (byte 4).
        wrong = admin.submit(Opcode.GET_LOG_PAGE, nsid=7, cdw10=LogId.SMART | 127 << 16)
        assert wrong.status == Status.INVALID_FIELD and admin.error_log()[0]["parm_error_location"] == 4


def test_failed_commands_are_logged_with_their_command(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = create_namespace(mp, "net", [("b", B_NUMEL)])
    with AdminClient(mp) as admin:
        failed = [admin.submit(Opcode.BEGIN_STEP, nsid=nsid, cdw10=7), admin.submit(0x7F, nsid=5),
                  admin.submit(Opcode.SCRUB, nsid=42)]
        assert [c.status for c in failed] == [Status.STEP_NUMBER_MISMATCH, Status.INVALID_OPCODE,
                                              Status.INVALID_NAMESPACE]
        begin, unknown, scrub = (c.cid for c in failed)
        skipped = admin.begin_step(nsid)  # a skip is a completion, not an error
        poisoned = np.ones(B_NUMEL, np.float16)
        poisoned[3] = np.inf
        pwrite_pieces(tensor_dir(mp, "net", "b") / "grad", poisoned.tobytes())
        assert admin.commit_step(nsid)["skipped"] and skipped == 1
        entries = admin.error_log()
    assert [(e["cmdid"], e["status_field"] & 0x7FF, e["nsid"], e["parm_error_location"], e["cs"]) for e in entries] == [
        (scrub, Status.INVALID_NAMESPACE, 42, 4, Opcode.SCRUB),
        (unknown, Status.INVALID_OPCODE, 5, 0, 0x7F),
        (begin, Status.STEP_NUMBER_MISMATCH, nsid, 40, Opcode.BEGIN_STEP),
    ]


# ---------------------------------------------------------------------- CLI verbs


def test_cli_smart_log_error_log_and_get_log(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = str(mount.mountpoint)
    create_namespace(mount.mountpoint, "net", [("b", B_NUMEL)])
    code, out, _ = run_cli(capsys, "smart-log", mp)
    assert code == 0 and out.startswith(f"Smart Log for NVME device:{mp} namespace-id:ffffffff")
    assert "temperature                             : 27 °C (300 K)" in out
    assert "power_cycles                            : 1" in out and "Data Units Read" in out
    code, out, _ = run_cli(capsys, "smart-log", mp, "-o", "json")
    value = json.loads(out)
    assert list(value)[:18] == list(logpages.SMART_FIELDS)  # nvme-cli's keys, in its order
    # 128-bit counters are strings in nvme-cli 2.3's JSON (tests/cli/test_nvme_cli.py)
    assert value["temperature"] >= 300 and value["power_cycles"] == "1"
    code, out, _ = run_cli(capsys, "smart-log", mp, "-H")
    assert code == 0 and "Temp. Threshold[1]" in out
    code, out, _ = run_cli(capsys, "smart-log", mp, "-H", "-o", "json")
    assert json.loads(out)["critical_warning"] == {"value": 0, "available_spare": 0, "temp_threshold": 0,
                                                   "reliability_degraded": 0, "ro": 0, "vmbu_failed": 0,
                                                   "pmr_ro": 0}

    code, out, _ = run_cli(capsys, "error-log", mp, "-o", "json")
    # No errors yet: nvme-cli prints ELPE + 1 entries all the same, each empty (error_count 0).
    assert code == 0 and [entry["error_count"] for entry in json.loads(out)["errors"]] == [0] * 64
    code, _, err = run_cli(capsys, "get-log", mp, "--log-id", "0x42")
    assert code == 1 and err == "cossd get-log: invalid log page 0x42 [INVALID_LOG_PAGE]\n"
    code, out, _ = run_cli(capsys, "error-log", mp)
    assert code == 0 and "entries:1" in out and "(INVALID_LOG_PAGE)" in out and "GET_LOG_PAGE" in out
    code, out, _ = run_cli(capsys, "error-log", mp, "-o", "json")
    entry, *empty = json.loads(out)["errors"]
    assert entry["error_count"] == 1 and all(e["error_count"] == 0 for e in empty)
    assert list(entry) == ["error_count", "sqid", "cmdid", "status_field", "phase_tag", "parm_error_location",
                           "lba", "nsid", "vs", "trtype", "cs", "trtype_spec_info"]
    assert entry["status_field"] == 0x4000 | Status.INVALID_LOG_PAGE  # DNR | SCT 1 | SC 09h

    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "2")
    assert code == 0 and out.startswith(f"Device:{mp} log-id:0x02 namespace-id:0xffffffff")
    assert "0000: 00 2c 01 64 0a" in out  # warning 0, 300 K, spare 100 %, threshold 10 %
    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "2", "-o", "json")
    assert json.loads(out)["power_cycles"] == 1
    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "1", "-o", "json")
    assert json.loads(out)["errors"][0]["error_count"] == 1
    # nvme-cli's --log-len and --lpo: a part of the page, dumped at its offsets.
    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "2", "-l", "16", "-L", "0x10")
    assert code == 0 and out.startswith(f"Device:{mp} log-id:0x02 namespace-id:0xffffffff offset:16 length:16\n")
    assert out.splitlines()[2].startswith("0010: ") and len(out.splitlines()) == 3
    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "2", "--log-len", "8", "-o", "json")
    assert json.loads(out) == {"log_id": 2, "offset": 0, "length": 8, "data": "002c01640a000000"}
    with pytest.raises(SystemExit) as refused:
        main(["get-log", mp, "-i", "2", "-l", "6"])
    assert refused.value.code == 2 and "a log length is a positive multiple of 4" in capsys.readouterr().err
    code, _, err = run_cli(capsys, "get-log", mp, "-i", "2", "-L", "6")
    assert code == 1 and err == "cossd get-log: log page offset 6 is not a multiple of 4 [INVALID_FIELD]\n"
    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "5", "-o", "json")
    assert "ACS_202 (SCRUB)" in json.loads(out)["admin_cmd_set"]
    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "0xc0", "--namespace", "net")
    assert code == 0 and json.loads(out.split("\n", 1)[1])["net"]["steps_committed"] == 0
    code, out, _ = run_cli(capsys, "get-log", mp, "-i", "0xc0", "-o", "json")
    assert json.loads(out)["net"]["nsid"] == 1
    code, _, err = run_cli(capsys, "get-log", mp, "-i", "0xc0", "--namespace", "nope")
    assert code == 1 and "INVALID_NAMESPACE" in err


def test_cli_get_log_binary(mount: Mount, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    mp = str(mount.mountpoint)
    assert main(["get-log", mp, "--log-id", "2", "-o", "binary"]) == 0
    raw = capsysbinary.readouterr().out
    assert len(raw) == 512 and logpages.decode_smart(raw)["power_cycles"] == 1
    assert main(["get-log", mp, "--log-id", "5", "-o", "binary"]) == 0
    assert len(capsysbinary.readouterr().out) == 4096
    # The nvme-cli shaped verbs give the same raw pages with -o binary.
    assert main(["smart-log", mp, "-o", "binary"]) == 0
    raw = capsysbinary.readouterr().out
    assert len(raw) == 512 and logpages.decode_smart(raw)["power_cycles"] == 1
    with AdminClient(mount.mountpoint) as admin:
        assert admin.submit(0x7F).status == Status.INVALID_OPCODE  # one error log entry
    assert main(["error-log", mp, "-o", "binary"]) == 0
    raw = capsysbinary.readouterr().out
    assert len(raw) == 64 * 64 and logpages.decode_error_log(raw)[0]["status_field"] & 0x7FF == Status.INVALID_OPCODE
    assert main(["id-ctrl", mp, "-o", "binary"]) == 0
    page = capsysbinary.readouterr().out
    assert len(page) == 4096 and struct.unpack_from("<H", page, 0)[0] == 0x1D1D
    assert page[4:24].decode().strip() == "TESTSERIAL0001"


def test_cli_scrub_and_list(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = str(mount.mountpoint)
    create_namespace(mount.mountpoint, "net", [("b", B_NUMEL)])
    code, out, _ = run_cli(capsys, "scrub", mp)
    assert code == 0 and out == "net: 0 blocks verified (still loading: no checksums yet), 0 bad\n"
    pwrite_pieces(tensor_dir(mount.mountpoint, "net", "b") / "grad", np.ones(B_NUMEL, np.float16).tobytes())
    code, out, _ = run_cli(capsys, "scrub", mp, "-o", "json")
    assert code == 0 and json.loads(out) == {"net": {"blocks": 1, "bad": []}}
    code, _, err = run_cli(capsys, "scrub", mp, "nope")
    assert code == 1 and "no namespace named 'nope'" in err

    # flush: the step the implicit write above committed is durable once it returns.
    code, out, _ = run_cli(capsys, "flush", mp, "net")
    assert code == 0 and out == "NVMe Flush: success (namespace net, durable step 1)\n"
    with AdminClient(mount.mountpoint) as admin:
        assert admin.statistics(admin.nsid("net"))["durable_step"] == 1
        admin.create_namespace({"name": "raw", "kind": "nvm", "capacity_bytes": 1 << 20})
    code, out, _ = run_cli(capsys, "flush", mp, "raw", "-o", "json")
    assert code == 0 and json.loads(out) == {"namespace": "raw", "nsid": 2, "durable_step": None}
    code, out, _ = run_cli(capsys, "flush", mp)
    assert code == 0 and out == "NVMe Flush: success (every namespace)\n"
    code, _, err = run_cli(capsys, "flush", mp, "nope")
    assert code == 1 and "no namespace named 'nope'" in err
    with AdminClient(mount.mountpoint) as admin:
        admin.delete_namespace(admin.nsid("raw"))

    assert (mount.mountpoint.resolve(), mount.backing.resolve()) in mounted_devices()
    code, out, _ = run_cli(capsys, "list")
    line = next(row for row in out.splitlines() if row.startswith(mp))
    assert code == 0 and str(mount.backing) in line and "TESTSERIAL0001" in line and "net(1)" in line
    code, out, _ = run_cli(capsys, "list", "-o", "json")
    # cossd's per-device view rides under "cossd" (nvme-cli's own layout: tests/cli/test_nvme_cli.py)
    (device,) = [d for d in json.loads(out)["cossd"]["Devices"] if d["DevicePath"] == mp]
    assert device["Backing"] == str(mount.backing) and device["SerialNumber"] == "TESTSERIAL0001"
    assert device["State"] == "live" and device["Pid"] == mount.pid
    assert device["Namespaces"] == [{"NameSpace": 1, "Name": "net"}]
    assert device["PhysicalSize"] == 8 << 30

    # A crashed daemon whose mount is still attached is listed from its backing directory.
    os.kill(mount.pid, signal.SIGKILL)
    wait_for_exit(mount.pid)
    code, out, _ = run_cli(capsys, "list", "-o", "json")
    listed = json.loads(out)
    (device,) = [d for d in listed["cossd"]["Devices"] if d["DevicePath"] == mp]
    assert code == 0 and device["State"].startswith("not answering")
    # Without identify pages to answer with, it is not in nvme-cli's part of the list.
    assert not [d for d in listed["Devices"] if d["cossd"]["mountpoint"] == mp]
    assert device["SerialNumber"] == "TESTSERIAL0001" and device["Namespaces"] == [{"NameSpace": 1, "Name": "net"}]
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and "[not answering" in out


def test_list_reads_mountinfo_escapes(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        "42 27 0:39 / /mnt/with\\040space rw,nosuid,nodev,relatime - fuse.cossd cossd:/data/dev\\0400 rw,user_id=0\n"
        "43 27 0:40 / /mnt/other rw shared:1 - fuse.sshfs host:/x rw\n"
    )
    assert mounted_devices(mountinfo) == [(Path("/mnt/with space"), Path("/data/dev 0"))]


# ---------------------------------------------------------------------- modeled figures


def test_modeled_temperature_and_wear() -> None:
    health = Health(None)
    capacity = 1 << 30
    cool = health.smart([], capacity, degraded=False)
    assert cool["temperature"] == AMBIENT_KELVIN and cool["critical_warning"] == 0
    # 10 busy minutes at once: 600 busy seconds over a 60 s time constant = 10 busy threads.
    hot = health.smart([NamespaceCounters(kernel_ns=600 * 10**9)], capacity, degraded=True)
    assert hot["temperature"] == AMBIENT_KELVIN + 100 >= CRITICAL_TEMP_KELVIN
    assert hot["critical_warning"] == logpages.WARN_TEMPERATURE | logpages.WARN_RELIABILITY
    assert hot["controller_busy_time"] == 10
    worn = health.smart([NamespaceCounters(media_bytes_written=ENDURANCE_DRIVE_WRITES * capacity // 4)],
                        capacity, degraded=False)
    assert worn["percent_used"] == 25


def test_id_ns_and_admin_passthru(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    create_namespace(mp, "n", [("t", 1 << 20)])
    code, out, _ = run_cli(capsys, "id-ns", str(mp), "n", "-o", "json")
    assert code == 0
    ns = json.loads(out)
    with AdminClient(mp) as admin:
        size = admin.statistics(admin.nsid("n"))["state_bytes_per_copy"]
    # NSZE counts both state copies in 4 KiB blocks; LBA format 0 has 2^12-byte blocks.
    assert ns["nsze"] == ns["ncap"] == ns["nuse"] == 2 * size // 4096 and ns["lbafs"][0]["ds"] == 12
    code, out, _ = run_cli(capsys, "id-ns", str(mp), "n")
    assert code == 0 and "nsze" in out and "lbads:12" in out
    # A raw Identify Controller (CNS 01h) through admin-passthru: the serial at bytes 4-23.
    code, out, _ = run_cli(capsys, "admin-passthru", str(mp), "--opcode", "0x06", "--cdw10", "1", "-o", "json")
    assert code == 0
    page = bytes.fromhex(json.loads(out)["data"])
    assert len(page) == 4096 and page[4:24].decode().strip() == "TESTSERIAL0001"
    code, out, _ = run_cli(capsys, "admin-passthru", str(mp), "--opcode", "0x7f")
    assert code == 1 and "INVALID_OPCODE" in out
    code, out, err = run_cli(capsys, "id-ns", str(mp), "missing")
    assert code == 1 and "INVALID_NAMESPACE" in err
