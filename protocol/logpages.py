"""GET LOG PAGE: the NVMe log page layouts, declared once, with their encoders and decoders."""
from __future__ import annotations

import enum
from typing import Any, Iterable, Mapping

import numpy as np

from .entries import COMPLETION, SUBMISSION, Opcode

# A 128-bit little-endian counter, as (low, high) 64-bit halves: numpy has no u128.
U128 = ("<u8", (2,))

# SMART / Health Information (LID 02h), NVMe base specification, 512 bytes. Field names are
# the keys nvme-cli 2.x prints for `nvme smart-log -o json`, so decoding is a straight copy.
SMART_LOG = np.dtype(
    [
        ("critical_warning", "u1"),
        ("temperature", "<u2"),  # composite temperature, Kelvin (bytes 1-2, unaligned)
        ("avail_spare", "u1"),
        ("spare_thresh", "u1"),
        ("percent_used", "u1"),
        ("endurance_grp_critical_warning_summary", "u1"),
        ("rsvd7", "u1", (25,)),
        ("data_units_read", *U128),
        ("data_units_written", *U128),
        ("host_read_commands", *U128),
        ("host_write_commands", *U128),
        ("controller_busy_time", *U128),
        ("power_cycles", *U128),
        ("power_on_hours", *U128),
        ("unsafe_shutdowns", *U128),
        ("media_errors", *U128),
        ("num_err_log_entries", *U128),
        ("warning_temp_time", "<u4"),
        ("critical_comp_time", "<u4"),
        ("temperature_sensor", "<u2", (8,)),
        ("thm_temp1_trans_count", "<u4"),
        ("thm_temp2_trans_count", "<u4"),
        ("thm_temp1_total_time", "<u4"),
        ("thm_temp2_total_time", "<u4"),
        ("rsvd232", "u1", (280,)),
    ]
)
assert SMART_LOG.itemsize == 512, SMART_LOG.itemsize
assert SMART_LOG.fields is not None
assert SMART_LOG.fields["data_units_read"][1] == 32, "data units read at byte 32"
assert SMART_LOG.fields["warning_temp_time"][1] == 192, "warning temperature time at byte 192"
assert SMART_LOG.fields["temperature_sensor"][1] == 200, "temperature sensors at byte 200"

SMART_U128_FIELDS = (
    "data_units_read", "data_units_written", "host_read_commands", "host_write_commands",
    "controller_busy_time", "power_cycles", "power_on_hours", "unsafe_shutdowns",
    "media_errors", "num_err_log_entries",
)
# The scalar fields in the order nvme-cli prints them (its JSON keys).
SMART_FIELDS = (
    "critical_warning", "temperature", "avail_spare", "spare_thresh", "percent_used",
    "endurance_grp_critical_warning_summary", *SMART_U128_FIELDS,
    "warning_temp_time", "critical_comp_time",
)
SMART_THERMAL_FIELDS = (
    "thm_temp1_trans_count", "thm_temp2_trans_count", "thm_temp1_total_time", "thm_temp2_total_time",
)

# Critical warning bits (SMART byte 0).
WARN_SPARE = 0x01
WARN_TEMPERATURE = 0x02
WARN_RELIABILITY = 0x04
WARN_READ_ONLY = 0x08
WARN_VOLATILE_BACKUP = 0x10
WARN_PMR_READ_ONLY = 0x20

# Error Information (LID 01h): one 64-byte entry per error, newest first.
ERROR_LOG_ENTRY = np.dtype(
    [
        ("error_count", "<u8"),
        ("sqid", "<u2"),
        ("cmdid", "<u2"),
        ("status_field", "<u2"),  # bit 0 phase tag, bits 15:1 the completion's status
        ("parm_error_location", "<u2"),  # bits 7:0 byte, 10:8 bit of the submission; FFFFh: n/a
        ("lba", "<u8"),
        ("nsid", "<u4"),
        ("vs", "u1"),
        ("trtype", "u1"),
        ("rsvd30", "u1", (2,)),
        ("cs", "<u8"),  # command specific information
        ("trtype_spec_info", "<u2"),
        ("rsvd42", "u1", (22,)),
    ]
)
assert ERROR_LOG_ENTRY.itemsize == 64, ERROR_LOG_ENTRY.itemsize
ERROR_LOG_ENTRIES = 64  # kept in memory and returned; identify ELPE = 63 (0's based)
NOT_APPLICABLE = 0xFFFF  # sqid, cmdid or parameter location of an error no command caused
# The data path has no submission queue; its injected failures are logged as from I/O queue 1.
DATA_PATH_SQID = 1
# NVMe's data unit: 1000 x 512 bytes, reported rounded up.
DATA_UNIT_BYTES = 512 * 1000

# Commands Supported and Effects (LID 05h): one dword per admin opcode, then per I/O opcode.
EFFECTS_LOG = np.dtype([("acs", "<u4", (256,)), ("iocs", "<u4", (256,)), ("rsvd2048", "u1", (2048,))])
assert EFFECTS_LOG.itemsize == 4096, EFFECTS_LOG.itemsize
CSUPP = 1 << 0  # command supported
LBCC = 1 << 1  # logical block content change
NCC = 1 << 2  # namespace capability change
NIC = 1 << 3  # namespace inventory change
CCC = 1 << 4  # controller capability change


# Identify Controller (CNS 01h) fields that describe the protocol rather than the device
# (emulator/controller.py fills in the rest). Byte offsets as in the NVMe base specification.
NVME_VERSION = 0x00010400  # VER, byte 80: NVMe 1.4 (major 31:16, minor 15:8, tertiary 7:0)
CONTROLLER_TYPE_IO = 0x01  # CNTRLTYPE, byte 111: an I/O controller
# SQES, byte 512, and CQES, byte 513: log2 of the entry sizes, the maximum in bits 7:4 and
# the required one in bits 3:0; .admin takes one size each (protocol.py: 64 and 16 bytes).
SQES = (SUBMISSION.itemsize.bit_length() - 1) * 0x11
CQES = (COMPLETION.itemsize.bit_length() - 1) * 0x11
assert (SQES, CQES) == (0x66, 0x44), (SQES, CQES)
SUBNQN_AT, SUBNQN_BYTES = 768, 256


def subsystem_nqn(identity: Mapping[str, Any]) -> str:
    """The NVM subsystem's NQN: NVMe's form for a subsystem without an assigned one
    (nqn.2014-08.org.nvmexpress: VID, SSVID, then SN and MN padded to 20 and 40)."""
    vid = int(identity["vid"])
    return (f"nqn.2014-08.org.nvmexpress:{vid:04x}{vid:04x}"
            f"{str(identity['serial']):<20.20}{str(identity['model']):<40.40}")


def fill_identify_controller(page: bytearray, identity: Mapping[str, Any]) -> None:
    """VER, CNTRLTYPE, SQES, CQES and SUBNQN of an Identify Controller page."""
    page[80:84] = NVME_VERSION.to_bytes(4, "little")
    page[111] = CONTROLLER_TYPE_IO
    page[512], page[513] = SQES, CQES
    nqn = subsystem_nqn(identity).encode("ascii", "replace")[: SUBNQN_BYTES - 1]
    page[SUBNQN_AT : SUBNQN_AT + SUBNQN_BYTES] = nqn.ljust(SUBNQN_BYTES, b"\0")  # NUL terminated


class LogId(enum.IntEnum):
    """Log page identifiers (cdw10 bits 7:0): NVMe's own, then the vendor range (C0h-FFh)."""

    ERROR = 0x01
    SMART = 0x02
    COMMANDS_SUPPORTED_AND_EFFECTS = 0x05
    OPTIMIZER_STATISTICS = 0xC0
    SNAPSHOTS = 0xC1  # the snapshots of a namespace (or of all)
    JOBS = 0xC2  # background work (export) and its progress
    INJECTED_ERRORS = 0xC3  # error injections armed and fired
    ARCHIVE = 0xC4  # the archive tier: network bytes and archives per namespace
    SERVER = 0xC5  # a storage server's own figures (cossd serve; served to its connections only)
    STATE_COUNTERS = 0xC6  # fp16/int8 moments', FP8 gradients' and params' underflow, overflow, scales per tensor


def _u128(value: int) -> tuple[int, int]:
    value = max(0, int(value))
    if value >> 128:
        value = (1 << 128) - 1  # saturate, as a counter that cannot wrap
    return value & 0xFFFFFFFFFFFFFFFF, value >> 64


def _from_u128(halves: np.ndarray) -> int:
    return int(halves[0]) | (int(halves[1]) << 64)


def encode_smart(values: Mapping[str, int], sensors: Iterable[int] = ()) -> bytes:
    """The 512-byte SMART page; `values` holds SMART_FIELDS (and optional thermal fields)."""
    page = np.zeros((), dtype=SMART_LOG)
    for name in (*SMART_FIELDS, *SMART_THERMAL_FIELDS):
        if name not in values:
            continue
        if name in SMART_U128_FIELDS:
            page[name] = _u128(values[name])
        else:
            page[name] = values[name]
    for index, kelvin in enumerate(list(sensors)[:8]):
        page["temperature_sensor"][index] = kelvin
    return page.tobytes()


def decode_smart(data: bytes) -> dict[str, int]:
    """A SMART page as nvme-cli's JSON prints it: its keys, its order, sensors only when set."""
    page = np.frombuffer(data, dtype=SMART_LOG, count=1)[0]
    decoded: dict[str, int] = {}
    for name in SMART_FIELDS:
        decoded[name] = _from_u128(page[name]) if name in SMART_U128_FIELDS else int(page[name])
    for index, kelvin in enumerate(page["temperature_sensor"]):
        if kelvin:  # 0: sensor not implemented
            decoded[f"temperature_sensor_{index + 1}"] = int(kelvin)
    for name in SMART_THERMAL_FIELDS:
        decoded[name] = int(page[name])
    return decoded


def encode_error_log(entries: Iterable[Mapping[str, int]]) -> bytes:
    """ERROR_LOG_ENTRIES entries of 64 bytes; unused ones are zero (error_count 0: empty)."""
    page = np.zeros(ERROR_LOG_ENTRIES, dtype=ERROR_LOG_ENTRY)
    for index, entry in enumerate(list(entries)[:ERROR_LOG_ENTRIES]):
        for name, value in entry.items():
            page[index][name] = value
    return page.tobytes()


def decode_error_log(data: bytes) -> list[dict[str, int]]:
    """The valid entries (error_count != 0) with nvme-cli's JSON keys, in page order."""
    count = len(data) // ERROR_LOG_ENTRY.itemsize
    entries = []
    for entry in np.frombuffer(data, dtype=ERROR_LOG_ENTRY, count=count):
        if not int(entry["error_count"]):
            continue
        field = int(entry["status_field"])
        entries.append({
            "error_count": int(entry["error_count"]),
            "sqid": int(entry["sqid"]),
            "cmdid": int(entry["cmdid"]),
            "status_field": field >> 1,  # nvme-cli drops the phase tag
            "phase_tag": field & 1,
            "parm_error_location": int(entry["parm_error_location"]),
            "lba": int(entry["lba"]),
            "nsid": int(entry["nsid"]),
            "vs": int(entry["vs"]),
            "trtype": int(entry["trtype"]),
            "cs": int(entry["cs"]),
            "trtype_spec_info": int(entry["trtype_spec_info"]),
        })
    return entries


def encode_effects(admin: Mapping[int, int], io: Mapping[int, int] | None = None) -> bytes:
    """The 4096-byte effects page: `admin` and `io` map an opcode to its effects dword."""
    page = np.zeros((), dtype=EFFECTS_LOG)
    for opcode, effects in admin.items():
        page["acs"][opcode] = effects
    for opcode, effects in (io or {}).items():
        page["iocs"][opcode] = effects
    return page.tobytes()


def decode_effects(data: bytes) -> dict[str, Any]:
    """Supported opcodes and their effects, keyed like nvme-cli's JSON (ACS_n / IOCS_n)."""
    page = np.frombuffer(data, dtype=EFFECTS_LOG, count=1)[0]

    def name(opcode: int) -> str:
        try:
            return Opcode(opcode).name
        except ValueError:
            return "unknown"

    return {
        "admin_cmd_set": {f"ACS_{op} ({name(op)})": int(v) for op, v in enumerate(page["acs"]) if v & CSUPP},
        "io_cmd_set": {f"IOCS_{op}": int(v) for op, v in enumerate(page["iocs"]) if v & CSUPP},
    }


# Storage server statistics (LID C5h, vendor): what `cossd serve` counts, as little-endian u64
# counters in a fixed 512-byte page (like SMART's, so a partial read by offset means the same
# field every time). Served by a server's controller only; a mount answers INVALID_LOG_PAGE.
# The reasons a server turns a connection away before serving it, each counted on its own.
SERVER_REFUSALS = (
    "no_token",  # CONNECT without a token where the server asks for one
    "wrong_token",  # CONNECT with another token
    "before_connect",  # a command before CONNECT
    "framing",  # a handshake that is not NVMe/TCP's (garbage, a bad PDU)
    "tls",  # the TLS handshake failed (plain TCP to a TLS server, no client certificate)
    "handshake",  # the peer closed or timed out before its CONNECT
    "busy",  # --max-connections reached: CONNECT_CONTROLLER_BUSY
)
SERVER_LOG_VERSION = 1
SERVER_LOG_FIELDS = (
    "version",  # SERVER_LOG_VERSION
    # connections
    "connections_open", "connections_total", "max_connections",  # max: 0 means no limit
    "refused_total", *(f"refused_{reason}" for reason in SERVER_REFUSALS),
    # steps whose client went away
    "leases_open", "leases_expired",
    # the network link (LinkTiming): commands served, payload bytes and PDUs each way
    "link_commands", "link_bytes_in", "link_bytes_out", "link_pdus_in", "link_pdus_out", "link_wire_ns",
    # receive memory (--recv-memory): the budget, held now, the most held, WRITEs that waited,
    # were refused (larger than the budget; no memory within --recv-wait-s), were streamed in
    # bounded pieces; buffers given back by idle connections
    "recv_memory_bytes", "recv_held_bytes", "recv_peak_bytes", "recv_waits", "recv_refused_too_large",
    "recv_refused_timeout", "recv_streamed_writes", "recv_idle_releases",
    # the parameter cache (--param-cache-size)
    "cache_capacity", "cache_bytes", "cache_namespaces", "cache_hits", "cache_misses", "cache_fills",
    "cache_hit_bytes", "cache_fill_bytes", "cache_evictions", "cache_too_large", "cache_invalidated",
    # when the server started (ns since the epoch)
    "started_ns",
    # peers that took no bytes for --send-timeout-s (dropped), and accepts that failed for want
    # of descriptors, memory or a thread (the server backed off and went on)
    "send_timeouts", "accept_errors",
)
SERVER_LOG_BYTES = 512
SERVER_LOG = np.dtype([*((name, "<u8") for name in SERVER_LOG_FIELDS),
                       ("reserved", "u1", (SERVER_LOG_BYTES - 8 * len(SERVER_LOG_FIELDS),))])
assert SERVER_LOG.itemsize == SERVER_LOG_BYTES, SERVER_LOG.itemsize


def encode_server_log(values: Mapping[str, int]) -> bytes:
    """The 512-byte server page; `values` holds SERVER_LOG_FIELDS (a missing one is 0; the
    version is always SERVER_LOG_VERSION; a negative or too large value saturates)."""
    page = np.zeros((), dtype=SERVER_LOG)
    for name in SERVER_LOG_FIELDS:
        page[name] = min(max(0, int(values.get(name, 0))), 0xFFFF_FFFF_FFFF_FFFF)
    page["version"] = SERVER_LOG_VERSION
    return page.tobytes()


def decode_server_log(data: bytes) -> dict[str, int]:
    """A whole server page as its fields, in layout order; ValueError for a short one."""
    if len(data) < SERVER_LOG_BYTES:
        raise ValueError(f"a server log page is {SERVER_LOG_BYTES} bytes, got {len(data)}")
    page = np.frombuffer(data, dtype=SERVER_LOG, count=1)[0]
    return {name: int(page[name]) for name in SERVER_LOG_FIELDS}
