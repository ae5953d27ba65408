"""nvme-cli compatibility: the JSON of id-ctrl, id-ns, smart-log, error-log and list against the
key lists, order and types of nvme-cli's own printers, cossd answering as `nvme`, and the
community textfile collector nvme_metrics.py run unmodified against a real mount."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import Mount
from cossd.protocol.status import Status
from cossd.protocol.entries import IdentifyCns, Opcode
from cossd.tools import media_health
from cossd.tools.cli import main
from cossd.client import AdminClient
from cossd.tools.nvme_json import resolve_device
from helpers import create_namespace, run_cli

pytestmark = pytest.mark.mount

# ---------------------------------------------------------------------- nvme-cli's printers, as data
#
# Taken from the sources of linux-nvme/nvme-cli at two tags:
#   v2.3  (commit 137fb15a285c060789581fc074ab3b1f6b250188): nvme-print.c, functions
#         json_nvme_id_ctrl, json_nvme_id_ns, json_smart_log, json_error_log, json_list_item /
#         json_simple_list (the flat `list`), json_detail_list (`list -v`); util/json.h, json.c.
#   v2.11 (commit 9f34fcb12e3ab098e9b30e0f31e92cefb497cc42): nvme-print-json.c, the same
#         functions (json_print_list_items always calls json_detail_list); util/json.c.
# Types, as the json-c calls they use print them: *_add_value_int/uint/uint64 a number,
# *_add_value_string a string; *_add_value_uint128 a string in v2.3 (util_json_object_new_uint128:
# json_object_new_string), a plain number from v2.4 on (commit 134ea7807, "util: Revert JSON
# output to plain numbers", sets a serializer that prints the digits unquoted).

ID_CTRL_2_3 = (
    "vid ssvid sn mn fr rab ieee cmic mdts cntlid ver rtd3r rtd3e oaes ctratt rrls cntrltype fguid "
    "crdt1 crdt2 crdt3 nvmsr vwci mec oacs acl aerl frmw lpa elpe npss avscc apsta wctemp cctemp "
    "mtfa hmpre hmmin tnvmcap unvmcap rpmbs edstt dsto fwug kas hctma mntmt mxtmt sanicap hmminds "
    "hmmaxd nsetidmax endgidmax anatt anacap anagrpmax nanagrpid pels domainid megcap sqes cqes "
    "maxcmd nn oncs fuses fna vwc awun awupf icsvscc nwpc acwu ocfs sgls mnan maxdna maxcna subnqn "
    "ioccsz iorcsz icdoff fcatt msdbd ofcs psds").split()  # subnqn only where the page sets it
ID_CTRL_2_11 = (
    "vid ssvid sn mn fr rab ieee cmic mdts cntlid ver rtd3r rtd3e oaes ctratt rrls cntrltype fguid "
    "crdt1 crdt2 crdt3 nvmsr vwci mec oacs acl aerl frmw lpa elpe npss avscc apsta wctemp cctemp "
    "mtfa hmpre hmmin tnvmcap unvmcap rpmbs edstt dsto fwug kas hctma mntmt mxtmt sanicap hmminds "
    "hmmaxd nsetidmax endgidmax anatt anacap anagrpmax nanagrpid pels domainid megcap tmpthha sqes "
    "cqes maxcmd nn oncs fuses fna vwc awun awupf icsvscc nwpc acwu ocfs sgls mnan maxdna maxcna "
    "oaqd subnqn ioccsz iorcsz icdoff fcatt msdbd ofcs psds").split()
ID_CTRL_STRINGS = {"sn", "mn", "fr", "fguid", "subnqn"}
ID_CTRL_U128 = {"tnvmcap", "unvmcap", "megcap", "maxdna"}
PSD_2_3 = ("max_power flags entry_lat exit_lat read_tput read_lat write_tput write_lat idle_power "
           "idle_scale active_power active_power_work active_scale").split()
PSD_2_11 = ("max_power max_power_scale non-operational_state entry_lat exit_lat read_tput read_lat "
            "write_tput write_lat idle_power idle_scale active_power active_power_work active_scale").split()

# json_nvme_id_ns, not cap_only, NSFEAT bit 4 clear (npwg..nows absent); v2.11 adds "vs".
ID_NS_2_3 = ("nsze ncap nuse nsfeat nlbaf flbas mc dpc dps nmic rescap fpi dlfeat nawun nawupf nacwu "
             "nabsn nabo nabspf noiob nvmcap nsattr nvmsetid mssrl mcl msrc nulbaf anagrpid endgid "
             "eui64 nguid lbafs").split()
ID_NS_2_11 = [*ID_NS_2_3, "vs"]
ID_NS_STRINGS, ID_NS_U128 = {"eui64", "nguid"}, {"nvmcap"}
LBAF = ["ms", "ds", "rp"]

# json_smart_log: temperature_sensor_N (N = 1..8) only for sensors that read non-zero, between
# critical_comp_time and thm_temp1_trans_count. critical_warning: a number in v2.3 unless -H
# (then an object), always the object in v2.11.
SMART_HEAD = ("critical_warning temperature avail_spare spare_thresh percent_used "
              "endurance_grp_critical_warning_summary data_units_read data_units_written "
              "host_read_commands host_write_commands controller_busy_time power_cycles "
              "power_on_hours unsafe_shutdowns media_errors num_err_log_entries warning_temp_time "
              "critical_comp_time").split()
SMART_TAIL = "thm_temp1_trans_count thm_temp2_trans_count thm_temp1_total_time thm_temp2_total_time".split()
SMART_U128 = set(SMART_HEAD[6:16])
CRITICAL_WARNING = "value available_spare temp_threshold reliability_degraded ro vmbu_failed pmr_ro".split()

# json_error_log (identical in both): every field a number.
ERROR_ENTRY = ("error_count sqid cmdid status_field phase_tag parm_error_location lba nsid vs trtype cs "
               "trtype_spec_info").split()

# v2.3 json_list_item (the flat `list -o json` of 2.3 to 2.10).
LIST_ITEM_2_3 = [("NameSpace", int), ("DevicePath", str), ("Firmware", str), ("ModelNumber", str),
                 ("SerialNumber", str), ("UsedBytes", int), ("MaximumLBA", int), ("PhysicalSize", int),
                 ("SectorSize", int)]
# v2.11 json_detail_list (`list -o json`, in 2.3 with -v); HostID only where the host has one.
DETAIL_HOST = [("HostNQN", str), ("HostID", str), ("Subsystems", list)]
DETAIL_SUBSYSTEM = [("Subsystem", str), ("SubsystemNQN", str), ("Controllers", list), ("Namespaces", list)]
DETAIL_CONTROLLER_2_11 = [("Controller", str), ("Cntlid", str), ("SerialNumber", str), ("ModelNumber", str),
                          ("Firmware", str), ("Transport", str), ("Address", str), ("Slot", str),
                          ("Namespaces", list), ("Paths", list)]
DETAIL_NAMESPACE_2_11 = [("NameSpace", str), ("Generic", str), ("NSID", int), ("UsedBytes", int),
                         ("MaximumLBA", int), ("PhysicalSize", int), ("SectorSize", int)]
# v2.3 json_detail_list: the same without Cntlid, Slot and Generic.
DETAIL_CONTROLLER_2_3 = ["Controller", "SerialNumber", "ModelNumber", "Firmware", "Transport", "Address",
                         "Namespaces", "Paths"]
DETAIL_NAMESPACE_2_3 = ["NameSpace", "NSID", "UsedBytes", "MaximumLBA", "PhysicalSize", "SectorSize"]

VENDOR = "cossd"  # cossd's own figures: one key, after nvme-cli's
DATA = Path(__file__).resolve().parents[1] / "data" / "nvme_metrics"
NVME_METRICS_SHA256 = "550c2638c18b34c10dfb5af825dff7476f29db77e05be7e07c6cf67076daa1d9"


def run(capsys: pytest.CaptureFixture[str], *argv: str, prog: str | None = None) -> tuple[int, Any]:
    """run_cli, its stdout decoded where the verb was asked for JSON."""
    code, out, _ = run_cli(capsys, *argv, prog=prog)
    return code, json.loads(out) if "-o" in argv and "json" in argv else out


def nvme_keys(value: dict[str, Any]) -> list[str]:
    """The keys before the vendor key, which comes last if at all."""
    keys = list(value)
    assert VENDOR not in keys[:-1], keys
    return keys[:-1] if keys and keys[-1] == VENDOR else keys


def check_types(value: dict[str, Any], spec: list[tuple[str, type]], optional: set[str] = frozenset()) -> None:
    assert nvme_keys(value) == [key for key, _ in spec if key in value or key not in optional]
    for key, kind in spec:
        if key in value:
            assert type(value[key]) is kind, (key, value[key])


def id_ctrl_spec(keys: list[str], u128: type) -> list[tuple[str, type]]:
    return [(key, str if key in ID_CTRL_STRINGS else u128 if key in ID_CTRL_U128 else
             list if key == "psds" else int) for key in keys]


# ---------------------------------------------------------------------- the pages


def test_id_ctrl_json_is_nvme_clis(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = str(mount.mountpoint)
    create_namespace(mount.mountpoint, "net", [("w", 1000)])
    code, value = run(capsys, "id-ctrl", mp, "-o", "json")
    assert code == 0
    check_types(value, id_ctrl_spec(ID_CTRL_2_3, str))  # 86 keys, subnqn set
    assert [list(psd) for psd in value["psds"]] == [PSD_2_3] and len(ID_CTRL_2_3) == 86
    assert value["sn"] == "TESTSERIAL0001".ljust(20)  # nvme-cli keeps the space padding
    assert value["vid"] == value["ssvid"] == 0x1D1D and value["ver"] == 0x10400
    assert (value["sqes"], value["cqes"], value["elpe"], value["nn"]) == (0x66, 0x44, 63, 1024)
    assert value["tnvmcap"] == str(8 << 30) and value["wctemp"] == 343 and value["cctemp"] == 358
    assert value["subnqn"].startswith("nqn.2014-08.org.nvmexpress:1d1d1d1dTESTSERIAL0001")
    assert value["fguid"] == "00000000-0000-0000-0000-000000000000"
    assert value[VENDOR]["namespaces"][0]["name"] == "net"  # cossd's own: describe()

    code, value = run(capsys, "id-ctrl", mp, "-o", "json", "--verbose")
    assert code == 0 and len(ID_CTRL_2_11) == 88
    check_types(value, id_ctrl_spec(ID_CTRL_2_11, int))
    assert [list(psd) for psd in value["psds"]] == [PSD_2_11] and value["tnvmcap"] == 8 << 30


def test_id_ns_json_by_name_nsid_and_device_path(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    nsid = create_namespace(mp, "net", [("w", 1 << 16)])
    code, value = run(capsys, "id-ns", str(mp), "net", "-o", "json")
    assert code == 0 and len(ID_NS_2_3) == 32
    check_types(value, [(k, str if k in ID_NS_STRINGS else str if k in ID_NS_U128 else
                         list if k == "lbafs" else int) for k in ID_NS_2_3])
    assert [list(lbaf) for lbaf in value["lbafs"]] == [LBAF] and value["lbafs"][0]["ds"] == 12
    assert value["nguid"] == "0" * 32 and value["eui64"] == "0" * 16
    assert value[VENDOR] == {"nsid": nsid, "name": "net"}
    # nvme-cli's ways of naming it: -n NSID, or the namespace's own device (its directory).
    assert run(capsys, "id-ns", str(mp), "-n", str(nsid), "-o", "json")[1] == value
    assert run(capsys, "id-ns", str(mp / "ns" / "net"), "-o", "json")[1] == value
    code, value = run(capsys, "id-ns", str(mp), "net", "-o", "json", "-v")
    check_types(value, [(k, str if k in ID_NS_STRINGS else int if k in ID_NS_U128 else list
                         if k in ("lbafs", "vs") else int) for k in ID_NS_2_11])
    assert value["vs"] == []
    with pytest.raises(SystemExit, match="name the namespace"):
        main(["id-ns", str(mp), "-o", "json"])


def test_smart_log_json_counters_are_strings_in_2_3(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = str(mount.mountpoint)
    with AdminClient(mount.mountpoint) as admin:
        smart = admin.smart_log()
    code, value = run(capsys, "smart-log", mp, "-o", "json")
    assert code == 0
    sensors = [key for key in value if key.startswith("temperature_sensor_")]
    spec = [(k, str if k in SMART_U128 else int) for k in SMART_HEAD + sensors + SMART_TAIL]
    check_types(value, spec)
    assert value["power_cycles"] == "1" and value["temperature"] == smart["temperature"]
    assert value["data_units_written"] == str(smart["data_units_written"])
    code, human = run(capsys, "smart-log", mp, "-H", "-o", "json")
    assert list(human["critical_warning"]) == CRITICAL_WARNING and human["power_cycles"] == "1"
    # 2.11: the counters plain numbers, the critical warning always its object.
    code, value = run(capsys, "smart-log", mp, "-o", "json", "--verbose")
    check_types(value, [(k, dict if k == "critical_warning" else int) for k in SMART_HEAD + sensors + SMART_TAIL])
    assert list(value["critical_warning"]) == CRITICAL_WARNING and value["power_cycles"] == 1


def test_error_log_json_prints_elpe_plus_one_entries(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = str(mount.mountpoint)
    code, value = run(capsys, "error-log", mp, "-o", "json")
    assert code == 0 and list(value) == ["errors"] and len(value["errors"]) == 64  # ELPE 63, 0's based
    assert all(list(entry) == ERROR_ENTRY and entry["error_count"] == 0 for entry in value["errors"])
    with AdminClient(mount.mountpoint) as admin:
        assert admin.submit(0x7F).status == Status.INVALID_OPCODE
    code, value = run(capsys, "error-log", mp, "-o", "json")
    first, *rest = value["errors"]
    assert len(rest) == 63 and first["error_count"] == 1 and first["cs"] == 0x7F
    assert all(type(first[key]) is int for key in ERROR_ENTRY)
    code, value = run(capsys, "error-log", mp, "-o", "json", "-e", "2")
    assert [entry["error_count"] for entry in value["errors"]] == [1, 0]
    with pytest.raises(SystemExit):
        main(["error-log", mp, "-e", "0"])  # nvme-cli: a non-zero count is required


def test_list_in_both_layouts(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    create_namespace(mp, "net", [("w", 1 << 16)])
    with AdminClient(mp) as admin:
        admin.create_namespace({"name": "raw", "kind": "nvm", "capacity_bytes": 1 << 20})
        ns_page = admin.call(Opcode.IDENTIFY, nsid=1, cdw10=int(IdentifyCns.NAMESPACE)).data
    nsze, nuse = struct.unpack_from("<QxxxxxxxxQ", ns_page, 0)
    code, value = run(capsys, "list", "-o", "json")
    assert code == 0 and nvme_keys(value) == ["Devices"]
    ours = [d for d in value["Devices"] if d[VENDOR]["mountpoint"] == str(mp)]
    assert [d["DevicePath"] for d in ours] == [str(mp / "ns/net"), str(mp / "ns/raw")]
    for entry in ours:
        check_types(entry, LIST_ITEM_2_3)
    net = ours[0]
    assert (net["NameSpace"], net["SerialNumber"].strip(), net["SectorSize"]) == (1, "TESTSERIAL0001", 4096)
    assert (net["MaximumLBA"], net["PhysicalSize"], net["UsedBytes"]) == (nsze, nsze * 4096, nuse * 4096)
    assert ours[1]["PhysicalSize"] == 1 << 20 and ours[1][VENDOR]["kind"] == "nvm"

    code, value = run(capsys, "list", "-o", "json", "-v")
    assert code == 0 and nvme_keys(value) == ["Devices"] and len(value["Devices"]) == 1
    (host,) = value["Devices"]
    check_types(host, DETAIL_HOST, optional={"HostID"})
    (subsystem,) = [s for s in host["Subsystems"] if s["Controllers"][0]["Controller"] == str(mp)]
    check_types(subsystem, DETAIL_SUBSYSTEM)
    (controller,) = subsystem["Controllers"]
    check_types(controller, DETAIL_CONTROLLER_2_11)
    for namespace in controller["Namespaces"]:
        check_types(namespace, DETAIL_NAMESPACE_2_11)
    # A script written for 2.3's `list -v` finds its keys, in its order.
    assert [k for k in controller if k in DETAIL_CONTROLLER_2_3] == DETAIL_CONTROLLER_2_3
    assert [k for k in controller["Namespaces"][0] if k in DETAIL_NAMESPACE_2_3] == DETAIL_NAMESPACE_2_3
    assert subsystem["SubsystemNQN"].startswith("nqn.2014-08.org.nvmexpress:1d1d1d1dTESTSERIAL0001")
    assert [(n["NameSpace"], n["NSID"], n["PhysicalSize"]) for n in controller["Namespaces"]] == [
        (str(mp / "ns/net"), 1, nsze * 4096), (str(mp / "ns/raw"), 2, 1 << 20)]
    # Every verb takes what list reports as the device.
    code, smart = run(capsys, "smart-log", controller["Namespaces"][0]["NameSpace"], "-o", "json")
    assert code == 0 and smart["power_cycles"] == "1"


def test_raw_identify_page_has_ver_sqes_cqes(mount: Mount, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    assert main(["id-ctrl", str(mount.mountpoint), "-o", "binary"]) == 0
    page = capsysbinary.readouterr().out
    assert len(page) == 4096
    assert struct.unpack_from("<I", page, 80)[0] == 0x00010400  # VER: NVMe 1.4
    assert (page[512], page[513]) == (0x66, 0x44)  # SQES: 64-byte entries; CQES: 16-byte
    assert page[111] == 1 and page[768:].split(b"\0")[0].startswith(b"nqn.2014-08.org.nvmexpress:")
    assert main(["id-ctrl", str(mount.mountpoint), "-b"]) == 0  # nvme-cli's --raw-binary
    assert capsysbinary.readouterr().out == page


def test_device_paths_resolve_to_their_mount_by_name() -> None:
    """The paths need not exist: they are matched by name, so a hung daemon cannot hang this."""
    mounts = [(Path("/no/such/mnt"), Path("/b1")), (Path("/no/such/mnt/inner"), Path("/b2"))]
    assert resolve_device("/no/such/mnt", mounts) == (Path("/no/such/mnt"), None)
    assert resolve_device("/no/such/mnt/ns/net/tensors/w/grad", mounts) == (Path("/no/such/mnt"), "net")
    assert resolve_device("/no/such/mnt/inner/ns/raw", mounts) == (Path("/no/such/mnt/inner"), "raw")
    assert resolve_device("/no/such/mnt2/ns/x", mounts) == (Path("/no/such/mnt2/ns/x"), None)


# ---------------------------------------------------------------------- answering as `nvme`


@pytest.fixture
def nvme_bin(tmp_path: Path) -> Path:
    """A directory holding `nvme`, a symlink to the cossd entry point."""
    cossd = shutil.which("cossd", path=str(Path(sys.executable).parent))
    assert cossd is not None, "the cossd entry point of this virtualenv"
    directory = tmp_path / "bin"
    directory.mkdir()
    (directory / "nvme").symlink_to(cossd)
    return directory


def nvme_env(bin_dir: Path, mount: Mount, tmp_path: Path) -> dict[str, str]:
    """PATH with cossd's `nvme` first; `list` shown only this test's mount (other tests on the
    machine mount and unmount devices of their own meanwhile)."""
    mountinfo = tmp_path / "mountinfo"
    with open("/proc/self/mountinfo") as lines:
        mountinfo.write_text("".join(line for line in lines if line.split(" ")[4] == str(mount.mountpoint)))
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                COSSD_MOUNTINFO=str(mountinfo))


def nvme(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nvme", *argv], capture_output=True, text=True, env=env, timeout=120)


def test_cossd_answers_as_nvme_through_a_symlink(mount: Mount, nvme_bin: Path, tmp_path: Path) -> None:
    create_namespace(mount.mountpoint, "net", [("w", 1000)])
    env = nvme_env(nvme_bin, mount, tmp_path)
    bare = nvme(env)
    assert bare.returncode == 0 and bare.stdout.startswith("usage: nvme")
    version = nvme(env, "version")
    assert version.returncode == 0 and version.stdout.startswith("nvme version 2.3 (git cossd-")
    listed = nvme(env, "list", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    (entry,) = [d for d in json.loads(listed.stdout)["Devices"] if d["DevicePath"].startswith(str(mount.mountpoint))]
    smart = nvme(env, "smart-log", entry["DevicePath"], "--output-format=json")
    assert smart.returncode == 0 and json.loads(smart.stdout)["power_cycles"] == "1"
    ctrl = nvme(env, "id-ctrl", str(mount.mountpoint), "-o", "json")
    assert ctrl.returncode == 0 and json.loads(ctrl.stdout)["sn"].strip() == "TESTSERIAL0001"
    # cossd's own verbs mean other things to nvme-cli (`nvme format` formats a namespace).
    refused = nvme(env, "format", str(mount.mountpoint))
    assert refused.returncode == 1 and "run it as `cossd format`" in refused.stderr
    wrong = nvme(env, "smart-log", "/dev/nvme9n9", "-o", "json")
    assert wrong.returncode == 1 and wrong.stderr.startswith("nvme smart-log: ")
    # And smart-log --media never takes cossd's `nvme` for nvme-cli.
    assert media_health.is_cossd(str(nvme_bin / "nvme"))
    assert media_health.find_nvme_cli(str(nvme_bin / "nvme")) is None


def test_nvme_metrics_collector_runs_unmodified(mount: Mount, nvme_bin: Path, tmp_path: Path) -> None:
    """prometheus-community's nvme_metrics.py (tests/data/nvme_metrics/README.md) against a mount."""
    from prometheus_client.parser import text_string_to_metric_families

    script = DATA / "nvme_metrics.py"
    assert hashlib.sha256(script.read_bytes()).hexdigest() == NVME_METRICS_SHA256  # unmodified
    for name in ("net", "other"):
        create_namespace(mount.mountpoint, name, [("w", 1 << 16)])
    with AdminClient(mount.mountpoint) as admin:
        smart, identity = admin.smart_log(), admin.describe()["identity"]
        nsze = struct.unpack_from("<Q", admin.call(Opcode.IDENTIFY, nsid=1, cdw10=0).data, 0)[0]
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=nvme_env(nvme_bin, mount, tmp_path), timeout=300)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
               for family in text_string_to_metric_families(result.stdout) for sample in family.samples}
    families = {name for name, _ in samples}
    assert {"nvme_nvmecli", "nvme_device_info", "nvme_sector_size_bytes", "nvme_physical_size_bytes",
            "nvme_used_bytes", "nvme_data_units_read_total", "nvme_data_units_written_total",
            "nvme_host_read_commands_total", "nvme_host_write_commands_total", "nvme_available_spare_ratio",
            "nvme_available_spare_threshold_ratio", "nvme_percentage_used_ratio", "nvme_critical_warning",
            "nvme_media_errors_total", "nvme_num_err_log_entries_total", "nvme_power_cycles_total",
            "nvme_power_on_hours_total", "nvme_controller_busy_time_seconds_total",
            "nvme_unsafe_shutdowns_total", "nvme_temperature_celsius"} <= families
    assert samples[("nvme_nvmecli", (("version", "2.3"),))] == 1
    net = str(mount.mountpoint / "ns/net")
    device = (("device", net),)
    assert samples[("nvme_sector_size_bytes", device)] == 4096
    assert samples[("nvme_physical_size_bytes", device)] == nsze * 4096
    assert samples[("nvme_power_cycles_total", device)] == 1
    assert samples[("nvme_available_spare_ratio", device)] == smart["avail_spare"] / 100
    assert samples[("nvme_temperature_celsius", device)] == smart["temperature"] - 273
    # nvme-cli keeps the identify fields' padding; the script strips only the serial.
    info = (("device", net), ("firmware", identity["firmware_revision"].ljust(8)),
            ("model", identity["model"].ljust(40)), ("serial", "TESTSERIAL0001"))
    assert samples[("nvme_device_info", info)] == 1
    assert ("nvme_power_cycles_total", (("device", str(mount.mountpoint / "ns/other")),)) in samples
