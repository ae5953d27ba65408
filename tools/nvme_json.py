"""nvme-cli shaped JSON: the keys, order and value types nvme-cli 2.3 and 2.11 print, from raw pages."""
from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any, Sequence

from ..protocol.entries import IdentifyCns, Opcode

# Without --verbose the pages are shaped as nvme-cli 2.3 prints them; with it as nvme-cli 2.11,
# whose JSON is always what older versions printed with --verbose (`list`'s Subsystems layout,
# smart-log's critical_warning object). Sources: nvme-print.c (v2.3), nvme-print-json.c (v2.11).
PLAIN_VERSION = "2.3"
VERBOSE_VERSION = "2.11"
VENDOR_KEY = "cossd"  # cossd's own figures ride under this one key, after nvme-cli's
SECTOR_BYTES = 4096  # LBA format 0 (the only one)


def version_for(verbose: bool) -> str:
    return VERBOSE_VERSION if verbose else PLAIN_VERSION


def _u128(value: int, version: str) -> str | int:
    """A 128-bit counter: a JSON string in nvme-cli 2.3 (util/json.c); a plain number from 2.4
    on ("util: Revert JSON output to plain numbers", nvme-cli commit 134ea78)."""
    return str(value) if version == PLAIN_VERSION else value


def _int(page: bytes, offset: int, size: int) -> int:
    return int.from_bytes(page[offset : offset + size], "little")


def _ascii(page: bytes, offset: int, size: int) -> str:
    """An ASCII identify field as nvme-cli copies it: up to its first NUL, padding kept."""
    return page[offset : offset + size].split(b"\0", 1)[0].decode("ascii", "replace")


# Identify Controller (CNS 01h) in nvme-cli's key order: (key, byte offset, size, kind), kind
# "int" (little-endian unsigned), "u128", "ascii", "ieee" (3 bytes), "uuid"; the last field
# says which versions print it ("" all, else the first that does).
ID_CTRL_FIELDS: tuple[tuple[str, int, int, str, str], ...] = (
    ("vid", 0, 2, "int", ""), ("ssvid", 2, 2, "int", ""), ("sn", 4, 20, "ascii", ""),
    ("mn", 24, 40, "ascii", ""), ("fr", 64, 8, "ascii", ""), ("rab", 72, 1, "int", ""),
    ("ieee", 73, 3, "int", ""), ("cmic", 76, 1, "int", ""), ("mdts", 77, 1, "int", ""),
    ("cntlid", 78, 2, "int", ""), ("ver", 80, 4, "int", ""), ("rtd3r", 84, 4, "int", ""),
    ("rtd3e", 88, 4, "int", ""), ("oaes", 92, 4, "int", ""), ("ctratt", 96, 4, "int", ""),
    ("rrls", 100, 2, "int", ""), ("cntrltype", 111, 1, "int", ""), ("fguid", 112, 16, "uuid", ""),
    ("crdt1", 128, 2, "int", ""), ("crdt2", 130, 2, "int", ""), ("crdt3", 132, 2, "int", ""),
    ("nvmsr", 253, 1, "int", ""), ("vwci", 254, 1, "int", ""), ("mec", 255, 1, "int", ""),
    ("oacs", 256, 2, "int", ""), ("acl", 258, 1, "int", ""), ("aerl", 259, 1, "int", ""),
    ("frmw", 260, 1, "int", ""), ("lpa", 261, 1, "int", ""), ("elpe", 262, 1, "int", ""),
    ("npss", 263, 1, "int", ""), ("avscc", 264, 1, "int", ""), ("apsta", 265, 1, "int", ""),
    ("wctemp", 266, 2, "int", ""), ("cctemp", 268, 2, "int", ""), ("mtfa", 270, 2, "int", ""),
    ("hmpre", 272, 4, "int", ""), ("hmmin", 276, 4, "int", ""), ("tnvmcap", 280, 16, "u128", ""),
    ("unvmcap", 296, 16, "u128", ""), ("rpmbs", 312, 4, "int", ""), ("edstt", 316, 2, "int", ""),
    ("dsto", 318, 1, "int", ""), ("fwug", 319, 1, "int", ""), ("kas", 320, 2, "int", ""),
    ("hctma", 322, 2, "int", ""), ("mntmt", 324, 2, "int", ""), ("mxtmt", 326, 2, "int", ""),
    ("sanicap", 328, 4, "int", ""), ("hmminds", 332, 4, "int", ""), ("hmmaxd", 336, 2, "int", ""),
    ("nsetidmax", 338, 2, "int", ""), ("endgidmax", 340, 2, "int", ""), ("anatt", 342, 1, "int", ""),
    ("anacap", 343, 1, "int", ""), ("anagrpmax", 344, 4, "int", ""), ("nanagrpid", 348, 4, "int", ""),
    ("pels", 352, 4, "int", ""), ("domainid", 356, 2, "int", ""), ("megcap", 368, 16, "u128", ""),
    ("tmpthha", 384, 1, "int", VERBOSE_VERSION), ("sqes", 512, 1, "int", ""), ("cqes", 513, 1, "int", ""),
    ("maxcmd", 514, 2, "int", ""), ("nn", 516, 4, "int", ""), ("oncs", 520, 2, "int", ""),
    ("fuses", 522, 2, "int", ""), ("fna", 524, 1, "int", ""), ("vwc", 525, 1, "int", ""),
    ("awun", 526, 2, "int", ""), ("awupf", 528, 2, "int", ""), ("icsvscc", 530, 1, "int", ""),
    ("nwpc", 531, 1, "int", ""), ("acwu", 532, 2, "int", ""), ("ocfs", 534, 2, "int", ""),
    ("sgls", 536, 4, "int", ""), ("mnan", 540, 4, "int", ""), ("maxdna", 544, 16, "u128", ""),
    ("maxcna", 560, 4, "int", ""), ("oaqd", 564, 4, "int", VERBOSE_VERSION),
    ("subnqn", 768, 256, "ascii", ""),  # printed only when set
    ("ioccsz", 1792, 4, "int", ""), ("iorcsz", 1796, 4, "int", ""), ("icdoff", 1800, 2, "int", ""),
    ("fcatt", 1802, 1, "int", ""), ("msdbd", 1803, 1, "int", ""), ("ofcs", 1804, 2, "int", ""),
)
POWER_STATES_AT, POWER_STATE_BYTES = 2048, 32


def _field(page: bytes, offset: int, size: int, kind: str, version: str) -> Any:
    if kind == "ascii":
        return _ascii(page, offset, size)
    if kind == "uuid":
        return str(uuid.UUID(bytes=bytes(page[offset : offset + size])))
    value = _int(page, offset, size)
    return _u128(value, version) if kind == "u128" else value


def _power_state(psd: bytes, version: str) -> dict[str, int]:
    """One power state descriptor; 2.11 splits 2.3's `flags` byte into its two bits."""
    flags = psd[3]
    split = ({"flags": flags} if version == PLAIN_VERSION else
             {"max_power_scale": flags & 1, "non-operational_state": (flags >> 1) & 1})
    return {"max_power": _int(psd, 0, 2)} | split | {
        "entry_lat": _int(psd, 4, 4), "exit_lat": _int(psd, 8, 4),
        "read_tput": psd[12], "read_lat": psd[13], "write_tput": psd[14], "write_lat": psd[15],
        "idle_power": _int(psd, 16, 2), "idle_scale": (psd[18] >> 6) & 3,
        "active_power": _int(psd, 20, 2), "active_power_work": psd[22] & 7,
        "active_scale": (psd[22] >> 6) & 3,
    }


def id_ctrl(page: bytes, version: str) -> dict[str, Any]:
    """`nvme id-ctrl -o json` of a 4096-byte Identify Controller page."""
    value: dict[str, Any] = {}
    for key, offset, size, kind, since in ID_CTRL_FIELDS:
        if since and version == PLAIN_VERSION:
            continue
        field = _field(page, offset, size, kind, version)
        if key == "subnqn" and not field:
            continue
        value[key] = field
    npss = page[263]
    value["psds"] = [_power_state(page[POWER_STATES_AT + POWER_STATE_BYTES * index:][:POWER_STATE_BYTES],
                                  version) for index in range(npss + 1)]
    return value


def id_ns(page: bytes, version: str) -> dict[str, Any]:
    """`nvme id-ns -o json` of a 4096-byte Identify Namespace page (nvme-cli's key order)."""
    nsfeat, nlbaf = page[24], page[25]
    value: dict[str, Any] = {
        "nsze": _int(page, 0, 8), "ncap": _int(page, 8, 8), "nuse": _int(page, 16, 8), "nsfeat": nsfeat,
        "nlbaf": nlbaf, "flbas": page[26], "mc": page[27], "dpc": page[28], "dps": page[29],
        "nmic": page[30], "rescap": page[31], "fpi": page[32], "dlfeat": page[33],
    }
    for key, offset in (("nawun", 34), ("nawupf", 36), ("nacwu", 38), ("nabsn", 40), ("nabo", 42),
                        ("nabspf", 44), ("noiob", 46)):
        value[key] = _int(page, offset, 2)
    value |= {"nvmcap": _u128(_int(page, 48, 16), version), "nsattr": page[99],
              "nvmsetid": _int(page, 100, 2)}
    # The preferred write sizes print only where NSFEAT says they are set (2.3: bit 4;
    # 2.11: bits 4 or 5, and NPDG only with bit 4).
    if nsfeat & (0x10 if version == PLAIN_VERSION else 0x30):
        value |= {"npwg": _int(page, 64, 2), "npwa": _int(page, 66, 2)}
        if nsfeat & 0x10:
            value["npdg"] = _int(page, 68, 2)
        value |= {"npda": _int(page, 70, 2), "nows": _int(page, 72, 2)}
    value |= {"mssrl": _int(page, 74, 2), "mcl": _int(page, 76, 4), "msrc": page[80], "nulbaf": page[82],
              "anagrpid": _int(page, 92, 4), "endgid": _int(page, 102, 2),
              "eui64": page[120:128].hex(), "nguid": page[104:120].hex()}
    value["lbafs"] = [{"ms": _int(page, 128 + 4 * index, 2), "ds": page[130 + 4 * index],
                       "rp": page[131 + 4 * index] & 3} for index in range(min(nlbaf, 63) + 1)]
    if version != PLAIN_VERSION:
        # 2.11: the vendor specific bytes up to their first NUL, as 16-character strings.
        vendor = page[384:].split(b"\0", 1)[0]
        value["vs"] = ["".join(chr(b) if 0x21 <= b <= 0x7E else "." for b in vendor[i : i + 16])
                       for i in range(0, len(vendor), 16)]
    return value


CRITICAL_WARNING_KEYS = ("available_spare", "temp_threshold", "reliability_degraded", "ro",
                         "vmbu_failed", "pmr_ro")
SMART_U128 = (
    ("data_units_read", 32), ("data_units_written", 48), ("host_read_commands", 64),
    ("host_write_commands", 80), ("controller_busy_time", 96), ("power_cycles", 112),
    ("power_on_hours", 128), ("unsafe_shutdowns", 144), ("media_errors", 160),
    ("num_err_log_entries", 176),
)


def smart_log(page: bytes, version: str, *, human: bool = False) -> dict[str, Any]:
    """`nvme smart-log -o json` of a 512-byte SMART / Health page. The critical warning is an
    object of its bits with -H in 2.3, and always in 2.11."""
    warning = page[0]
    value: dict[str, Any] = {}
    if human or version != PLAIN_VERSION:
        value["critical_warning"] = {"value": warning} | {
            key: (warning >> bit) & 1 for bit, key in enumerate(CRITICAL_WARNING_KEYS)}
    else:
        value["critical_warning"] = warning
    value |= {"temperature": _int(page, 1, 2), "avail_spare": page[3], "spare_thresh": page[4],
              "percent_used": page[5], "endurance_grp_critical_warning_summary": page[6]}
    for key, offset in SMART_U128:
        value[key] = _u128(_int(page, offset, 16), version)
    value |= {"warning_temp_time": _int(page, 192, 4), "critical_comp_time": _int(page, 196, 4)}
    for index in range(8):
        kelvin = _int(page, 200 + 2 * index, 2)
        if kelvin:  # 0: no such sensor
            value[f"temperature_sensor_{index + 1}"] = kelvin
    for key, offset in (("thm_temp1_trans_count", 216), ("thm_temp2_trans_count", 220),
                        ("thm_temp1_total_time", 224), ("thm_temp2_total_time", 228)):
        value[key] = _int(page, offset, 4)
    return value


ERROR_ENTRY_BYTES = 64


def error_log(page: bytes, entries: int) -> dict[str, Any]:
    """`nvme error-log -o json`: the first `entries` entries of the page, empty ones included
    (nvme-cli prints as many as it asked for: ELPE + 1 unless -e says fewer). Same in 2.3 and 2.11."""
    errors = []
    for index in range(min(entries, len(page) // ERROR_ENTRY_BYTES)):
        entry = page[ERROR_ENTRY_BYTES * index :][:ERROR_ENTRY_BYTES]
        status = _int(entry, 12, 2)
        errors.append({
            "error_count": _int(entry, 0, 8), "sqid": _int(entry, 8, 2), "cmdid": _int(entry, 10, 2),
            "status_field": status >> 1, "phase_tag": status & 1, "parm_error_location": _int(entry, 14, 2),
            "lba": _int(entry, 16, 8), "nsid": _int(entry, 24, 4), "vs": entry[28], "trtype": entry[29],
            "cs": _int(entry, 32, 8), "trtype_spec_info": _int(entry, 40, 2),
        })
    return {"errors": errors}


# ---------------------------------------------------------------------- nvme list


@dataclasses.dataclass
class ListedNamespace:
    """A namespace as `nvme list` shows one; `path` is its directory, MOUNTPOINT/ns/NAME, which
    stands where nvme-cli has /dev/nvmeXnY (and which every verb here takes as the device)."""

    path: str
    nsid: int
    name: str
    kind: str
    blocks: int  # NSZE, in SECTOR_BYTES blocks
    used_blocks: int  # NUSE
    sector_bytes: int = SECTOR_BYTES


@dataclasses.dataclass
class ListedController:
    """A mounted, answering cossd device: one subsystem with one controller."""

    mountpoint: str
    backing: str
    serial: str  # as the identify page holds them (nvme-cli keeps their padding)
    model: str
    firmware: str
    cntlid: int
    subnqn: str
    namespaces: list[ListedNamespace]


def namespace_blocks(page: bytes) -> tuple[int, int, int]:
    """(NSZE, NUSE, bytes per block) of an Identify Namespace page."""
    ds = page[130 + 4 * (page[26] & 0xF)]
    return _int(page, 0, 8), _int(page, 16, 8), 1 << ds if ds else SECTOR_BYTES


def listed_controller(client: Any, mountpoint: Path, backing: Path,
                      namespaces: Sequence[dict[str, Any]]) -> ListedController:
    """A live device as `nvme list` shows it, from its identify pages (an AdminClient's calls;
    `namespaces` as VENDOR_IDENTIFY describes them)."""
    ctrl = id_ctrl(client.call(Opcode.IDENTIFY, cdw10=IdentifyCns.CONTROLLER).data, VERBOSE_VERSION)
    listed = []
    for ns in namespaces:
        page = client.call(Opcode.IDENTIFY, nsid=ns["nsid"], cdw10=int(IdentifyCns.NAMESPACE)).data
        blocks, used, sector = namespace_blocks(page)
        listed.append(ListedNamespace(str(mountpoint / "ns" / ns["name"]), ns["nsid"], ns["name"],
                                      ns.get("kind", "optimizer"), blocks, used, sector))
    return ListedController(str(mountpoint), str(backing), ctrl["sn"], ctrl["mn"], ctrl["fr"],
                            ctrl["cntlid"], ctrl.get("subnqn", ""), listed)


def simple_list(controllers: Sequence[ListedController]) -> dict[str, Any]:
    """`nvme list -o json` of nvme-cli 2.3 to 2.10: one flat entry per namespace."""
    devices = []
    for ctrl in controllers:
        for ns in ctrl.namespaces:
            devices.append({
                "NameSpace": ns.nsid, "DevicePath": ns.path, "Firmware": ctrl.firmware,
                "ModelNumber": ctrl.model, "SerialNumber": ctrl.serial,
                "UsedBytes": ns.used_blocks * ns.sector_bytes, "MaximumLBA": ns.blocks,
                "PhysicalSize": ns.blocks * ns.sector_bytes, "SectorSize": ns.sector_bytes,
                VENDOR_KEY: {"namespace": ns.name, "kind": ns.kind, "mountpoint": ctrl.mountpoint},
            })
    return {"Devices": devices}


def host_identity(etc: Path = Path("/etc")) -> tuple[str, str | None]:
    """(HostNQN, HostID) as nvme-cli finds them: /etc/nvme/hostnqn and hostid; without a
    hostnqn file, one derived from /etc/machine-id, as libnvme derives one from the machine."""
    def read(path: Path) -> str | None:
        try:
            return path.read_text().strip() or None
        except OSError:
            return None

    nqn = read(etc / "nvme/hostnqn")
    if nqn is None:
        machine = read(etc / "machine-id")
        try:
            nqn = f"nqn.2014-08.org.nvmexpress:uuid:{uuid.UUID(hex=machine or '')}"
        except ValueError:
            nqn = ""
    return nqn, read(etc / "nvme/hostid")


def _detail_namespace(ns: ListedNamespace) -> dict[str, Any]:
    # NameSpace is the namespace's directory, an absolute path: scripts that open
    # os.path.join("/dev", NameSpace) (nvme_metrics.py) land on it.
    return {"NameSpace": ns.path, "Generic": "", "NSID": ns.nsid,
            "UsedBytes": ns.used_blocks * ns.sector_bytes, "MaximumLBA": ns.blocks,
            "PhysicalSize": ns.blocks * ns.sector_bytes, "SectorSize": ns.sector_bytes}


def detail_list(controllers: Sequence[ListedController], host: tuple[str, str | None]) -> dict[str, Any]:
    """`nvme list -v -o json` as nvme-cli 2.11 prints it (and 2.11 `nvme list -o json`):
    hosts, their subsystems, each subsystem's controllers, each controller's namespaces."""
    nqn, host_id = host
    subsystems = []
    for index, ctrl in enumerate(controllers):
        controller = {
            "Controller": ctrl.mountpoint, "Cntlid": str(ctrl.cntlid), "SerialNumber": ctrl.serial,
            "ModelNumber": ctrl.model, "Firmware": ctrl.firmware, "Transport": "cossd",
            "Address": f"backing={ctrl.backing}", "Slot": "",
            "Namespaces": [_detail_namespace(ns) for ns in ctrl.namespaces], "Paths": [],
        }
        # Namespaces sit under their controller (no multipath heads), so the subsystem's
        # own list is empty, as nvme-cli shows a PCIe drive without native multipath.
        subsystems.append({"Subsystem": f"cossd-subsys{index}", "SubsystemNQN": ctrl.subnqn,
                           "Controllers": [controller], "Namespaces": []})
    # One host, this one, as libnvme always has (its Subsystems empty without devices).
    entry: dict[str, Any] = {"HostNQN": nqn} | ({"HostID": host_id} if host_id else {})
    return {"Devices": [entry | {"Subsystems": subsystems}]}


def resolve_device(path: str | os.PathLike[str],
                   mounts: Sequence[tuple[Path, Path]]) -> tuple[Path, str | None]:
    """(mountpoint, namespace name or None) of a device as nvme-cli scripts name one: a
    mountpoint, a namespace's directory MOUNTPOINT/ns/NAME (what `list` reports), or a path
    under either. Anything else comes back as it is, for the client to refuse."""
    def innermost(target: Path) -> Path | None:
        under = [mp for mp, _ in mounts if target == mp or mp in target.parents]
        return max(under, key=lambda mp: len(mp.parts), default=None)

    # Matched by name first: resolving symlinks stats every component, and a hung daemon
    # would hang that stat, before the client's watchdog could time it out.
    target = Path(os.path.abspath(path))
    best = innermost(target)
    if best is None:
        target = Path(os.path.realpath(path))  # a symlink into a mount
        best = innermost(target)
    if best is None:
        return Path(path), None
    parts = target.relative_to(best).parts
    return best, parts[1] if len(parts) >= 2 and parts[0] == "ns" else None
