"""Get/Set Features (09h/0Ah), error injection (D0h, log page C3h) and their CLI verbs, through a
real mount: every feature's get, set, refused set and saved value across a remount."""
from __future__ import annotations

import errno
import hashlib
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import Mount
from cossd.protocol.status import DeviceError, Status
from cossd.protocol.features import ALL_GROUPS, SAVE_BIT, FeatureId
from cossd.emulator.health import WARNING_TEMP_KELVIN
from cossd.emulator.injection import MAX_ARMED
from cossd.protocol.entries import IoOpcode
from cossd.protocol.logpages import DATA_PATH_SQID
from cossd.protocol.logpages import WARN_TEMPERATURE
from cossd.protocol.entries import NSID_ALL, Opcode
from cossd.tools.cli import main
from cossd.client import AdminClient
from cossd.tools.verbs.features import get_feature, set_feature
from cossd.tools.verbs.inject import arm_injection, clear_injections, corrupt_block, injection_log
from helpers import create_namespace, pread_all, pwrite_all, run_cli, tensor_dir
from waiting import wait_until

pytestmark = pytest.mark.mount

W_NUMEL, B_NUMEL = 3000, 10
THSEL_UNDER = 1 << 20


def sealed_namespace(mp: Path, name: str = "net") -> int:
    """A namespace (w: 3000, b: 10) with step 1 committed."""
    nsid = create_namespace(mp, name, [("w", W_NUMEL), ("b", B_NUMEL)])
    pwrite_all(tensor_dir(mp, name, "w") / "grad", np.full(W_NUMEL, 0.5, np.float16).tobytes())
    pwrite_all(tensor_dir(mp, name, "b") / "grad", np.ones(B_NUMEL, np.float16).tobytes())
    assert (mp / "ns" / name / "step").read_text() == "1\n"
    return nsid


def digest(mount: Mount, name: str = "net") -> tuple[str, str, int | None]:
    """What a failed command must not change: the state bytes (read through the mount and
    on the backing media), the committed step and the open step."""
    mp = mount.mountpoint
    seen = hashlib.sha256()
    for tensor in ("w", "b"):
        for role in ("param", "master", "exp_avg", "exp_avg_sq"):
            seen.update(pread_all(tensor_dir(mp, name, tensor) / role))
    for file in ("state.A", "state.B", "sb.0", "sb.1"):
        seen.update((mount.backing / "ns" / name / file).read_bytes())
    stats = json.loads((mp / "ns" / name / "stats.json").read_text())
    return seen.hexdigest(), (mp / "ns" / name / "step").read_text(), stats["step_open"]


def saved_features(mount: Mount) -> dict[str, object]:
    return json.loads((mount.backing / "superblock.json").read_text()).get("features", {})


# ---------------------------------------------------------------------- 04h, 07h


def test_temperature_threshold_drives_the_smart_warning_and_survives_remount(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = create_namespace(mp, "net", [("b", B_NUMEL)])
    fid = FeatureId.TEMPERATURE_THRESHOLD
    with AdminClient(mp) as admin:
        assert get_feature(admin, fid).result == WARNING_TEMP_KELVIN  # TMPSEL 0, THSEL 0 (over)
        assert get_feature(admin, fid, cdw11=THSEL_UNDER).result == THSEL_UNDER | 0
        assert get_feature(admin, fid, select=1).result == WARNING_TEMP_KELVIN
        assert get_feature(admin, fid, select=2).result == WARNING_TEMP_KELVIN  # nothing saved
        assert get_feature(admin, fid, select=3).result == 0b101  # saveable, changeable
        assert not admin.smart_log()["critical_warning"] & WARN_TEMPERATURE

        # The idle device sits at 300 K: an over threshold of 300 K raises the warning bit.
        assert set_feature(admin, fid, value=300).result == 300
        assert get_feature(admin, fid).result == 300
        assert admin.smart_log()["critical_warning"] & WARN_TEMPERATURE
        assert get_feature(admin, fid, select=2).result == WARNING_TEMP_KELVIN  # not saved

        # Refused sets change nothing: a sensor the device lacks, a reserved THSEL, an nsid.
        for cdw11, nsid_field, status in ((1 << 16 | 250, 0, Status.INVALID_FIELD),
                                          (2 << 20 | 250, 0, Status.INVALID_FIELD),
                                          (250, nsid, Status.FEATURE_NOT_NAMESPACE_SPECIFIC)):
            completion = admin.submit(Opcode.SET_FEATURES, nsid=nsid_field, cdw10=fid | SAVE_BIT, cdw11=cdw11)
            assert completion.status == status, completion.data
            assert admin.error_log()[0]["cmdid"] == completion.cid
        assert get_feature(admin, fid).result == 300 and saved_features(mount) == {}
        assert admin.submit(Opcode.GET_FEATURES, cdw10=fid, cdw11=1 << 16).status == Status.INVALID_FIELD
        assert admin.submit(Opcode.GET_FEATURES, cdw10=fid | 5 << 8).status == Status.INVALID_FIELD  # SEL 5

        assert set_feature(admin, fid, value=WARNING_TEMP_KELVIN).result == WARNING_TEMP_KELVIN
        assert not admin.smart_log()["critical_warning"] & WARN_TEMPERATURE
        # The under threshold: at or above the temperature, the warning is set too.
        set_feature(admin, fid, value=THSEL_UNDER | 310)
        assert admin.smart_log()["critical_warning"] & WARN_TEMPERATURE
        set_feature(admin, fid, value=THSEL_UNDER | 5, save=True)
        set_feature(admin, fid, value=0xF << 16 | 330, save=True)  # TMPSEL Fh: every sensor
    assert saved_features(mount) == {"04h": {"over": 330, "under": 5}}

    mount.unmount()
    mount.restart()
    with AdminClient(mp) as admin:
        assert get_feature(admin, fid).result == 330
        assert get_feature(admin, fid, cdw11=THSEL_UNDER).result == THSEL_UNDER | 5
        assert get_feature(admin, fid, select=2).result == 330
        assert get_feature(admin, fid, select=1).result == WARNING_TEMP_KELVIN


def test_number_of_queues_is_reported_and_not_changeable(mount: Mount) -> None:
    with AdminClient(mount.mountpoint) as admin:
        assert get_feature(admin, FeatureId.NUMBER_OF_QUEUES).result == 0xFFFEFFFE
        assert get_feature(admin, FeatureId.NUMBER_OF_QUEUES, select=3).result == 0
        for cdw10 in (FeatureId.NUMBER_OF_QUEUES, FeatureId.NUMBER_OF_QUEUES | SAVE_BIT):
            completion = admin.submit(Opcode.SET_FEATURES, cdw10=cdw10, cdw11=0x00030003)
            assert completion.status == Status.FEATURE_NOT_CHANGEABLE
        unknown = admin.submit(Opcode.GET_FEATURES, cdw10=0x42)
        assert unknown.status == Status.INVALID_FIELD and b"0x42" in unknown.data
        assert admin.submit(Opcode.SET_FEATURES, cdw10=0x42).status == Status.INVALID_FIELD
        assert get_feature(admin, FeatureId.NUMBER_OF_QUEUES).result == 0xFFFEFFFE


# ---------------------------------------------------------------------- C0h, C1h


def test_hyperparameter_feature_per_group_and_persisted_by_the_next_commit(mount: Mount) -> None:
    mp = mount.mountpoint
    fid = FeatureId.HYPERPARAMETERS
    with AdminClient(mp) as admin:
        nsid = admin.create_namespace({"name": "net", "tensors": [["w", W_NUMEL], ["b", B_NUMEL, 1]],
                                       "hyperparameters": {"lr": 0.01}, "groups": [{}, {"weight_decay": 0.0}]})
        got = get_feature(admin, fid, nsid=nsid)
        groups = json.loads(got.data)["groups"]
        assert got.result == 2 and [g["lr"] for g in groups] == [0.01, 0.01]
        assert get_feature(admin, fid, nsid=nsid, select=3).result == 0b110  # namespace specific, changeable

        changed = set_feature(admin, fid, nsid=nsid, value=1, data={"lr": 0.5})
        assert [g["lr"] for g in json.loads(changed.data)["groups"]] == [0.01, 0.5]
        set_feature(admin, fid, nsid=nsid, value=ALL_GROUPS, data={"beta1": 0.8})
        current = json.loads(get_feature(admin, fid, nsid=nsid).data)["groups"]
        assert [(g["lr"], g["beta1"], g["weight_decay"]) for g in current] == [(0.01, 0.8, 0.01), (0.5, 0.8, 0.0)]
        # Default and saved (not saveable: the default) are the values it was created with.
        for select in (1, 2):
            assert json.loads(get_feature(admin, fid, nsid=nsid, select=select).data)["groups"] == groups

        refused = [
            (dict(nsid=nsid, cdw11=ALL_GROUPS, payload=b'{"lr": -1}'), Status.INVALID_FIELD),
            (dict(nsid=nsid, cdw11=ALL_GROUPS, payload=b'{"lr": 0.1, "eps": 0}'), Status.INVALID_FIELD),
            (dict(nsid=nsid, cdw11=2, payload=b'{"lr": 0.1}'), Status.INVALID_FIELD),  # no group 2
            (dict(nsid=nsid, cdw11=ALL_GROUPS, payload=b'{"mode": "adam"}'), Status.INVALID_FIELD),
            (dict(nsid=nsid, cdw11=ALL_GROUPS, payload=b'{"momentum": 0.9}'), Status.INVALID_FIELD),
            (dict(nsid=nsid, cdw11=ALL_GROUPS, payload=b'{}'), Status.INVALID_FIELD),
            (dict(nsid=nsid, cdw11=ALL_GROUPS, payload=b'not json'), Status.INVALID_FIELD),
            (dict(nsid=0, cdw11=ALL_GROUPS, payload=b'{"lr": 0.1}'), Status.INVALID_NAMESPACE),
            (dict(nsid=77, cdw11=ALL_GROUPS, payload=b'{"lr": 0.1}'), Status.INVALID_NAMESPACE),
        ]
        for fields, status in refused:
            assert admin.submit(Opcode.SET_FEATURES, cdw10=fid, **fields).status == status, fields
        saved = admin.submit(Opcode.SET_FEATURES, nsid=nsid, cdw10=fid | SAVE_BIT, cdw11=0, payload=b'{"lr": 0.1}')
        assert saved.status == Status.FEATURE_ID_NOT_SAVEABLE
        assert json.loads(get_feature(admin, fid, nsid=nsid).data)["groups"] == current

    # The change is stored with the next committed step, so it survives a remount from then on.
    pwrite_all(tensor_dir(mp, "net", "w") / "grad", np.ones(W_NUMEL, np.float16).tobytes())
    pwrite_all(tensor_dir(mp, "net", "b") / "grad", np.ones(B_NUMEL, np.float16).tobytes())
    mount.unmount()
    mount.restart()
    with AdminClient(mp) as admin:
        assert json.loads(get_feature(admin, fid, nsid=nsid).data)["groups"] == current


def test_device_settings_durability_and_kernel_saved_across_remount(mount: Mount) -> None:
    mp = mount.mountpoint
    fid = FeatureId.DEVICE_SETTINGS
    sealed_namespace(mp)
    with AdminClient(mp) as admin:
        current = json.loads(get_feature(admin, fid).data)
        assert (current["durability"], current["kernel"]) == ("plp", "auto")
        assert current["kernel_in_use"] == current["kernels_available"][-1]
        assert get_feature(admin, fid, select=3).result == 0b101

        set_feature(admin, fid, data={"durability": "sync"})
        assert admin.describe()["durability"] == "sync"
        assert json.loads((mp / "ns/net/config.json").read_text())["durability"] == "sync"
        set_feature(admin, fid, data={"kernel": "scalar"})
        assert json.loads(get_feature(admin, fid).data)["kernel_in_use"] == "scalar"

        for payload in (b'{"durability": "fast"}', b'{"kernel": "sse9"}', b'{"durability": "plp", "bogus": 1}',
                        b'{"kernel": "avx2", "durability": 1}', b"{}", b"[]"):
            completion = admin.submit(Opcode.SET_FEATURES, cdw10=fid | SAVE_BIT, payload=payload)
            assert completion.status == Status.INVALID_FIELD, payload
        assert admin.submit(Opcode.SET_FEATURES, nsid=1, cdw10=fid, payload=b'{"kernel": "auto"}').status \
            == Status.FEATURE_NOT_NAMESPACE_SPECIFIC
        after = json.loads(get_feature(admin, fid).data)
        assert (after["durability"], after["kernel"], after["kernel_in_use"]) == ("sync", "scalar", "scalar")
        assert saved_features(mount) == {}

        # In sync mode every commit is durable before it is acknowledged.
        pwrite_all(tensor_dir(mp, "net", "w") / "grad", np.ones(W_NUMEL, np.float16).tobytes())
        pwrite_all(tensor_dir(mp, "net", "b") / "grad", np.ones(B_NUMEL, np.float16).tobytes())
        stats = json.loads((mp / "ns/net/stats.json").read_text())
        assert stats["committed_step"] == stats["durable_step"] == 2
        set_feature(admin, fid, data={"durability": "sync", "kernel": "scalar"}, save=True)
    assert saved_features(mount) == {"c1h": {"durability": "sync", "kernel": "scalar"}}

    mount.unmount()
    mount.restart()  # without --sync: the saved value makes it sync
    with AdminClient(mp) as admin:
        value = json.loads(get_feature(admin, fid).data)
        assert (value["durability"], value["kernel"], value["kernel_in_use"]) == ("sync", "scalar", "scalar")
        assert admin.describe()["durability"] == "sync"
        assert json.loads(get_feature(admin, fid, select=1).data) == {"durability": "plp", "kernel": "auto"}
        set_feature(admin, fid, data={"durability": "plp", "kernel": "auto"}, save=True)
    mount.unmount()
    mount.restart()
    with AdminClient(mp) as admin:
        assert json.loads(get_feature(admin, fid, select=2).data) == {"durability": "plp", "kernel": "auto"}
        assert admin.describe()["durability"] == "plp"


# ---------------------------------------------------------------------- error injection


def test_injected_command_failures_fire_n_times_and_change_nothing(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = sealed_namespace(mp)
    other = create_namespace(mp, "aux", [("b", B_NUMEL)])
    before = digest(mount)
    with AdminClient(mp) as admin:
        armed = arm_injection(admin, Opcode.BEGIN_STEP, "WRITE_FAULT", count=2, nsid=nsid)
        assert (armed["remaining"], armed["nsid"], armed["status"]) == (2, nsid, "WRITE_FAULT")
        assert admin.begin_step(other) == 1  # another namespace: not armed for it
        admin.abort_step(other)
        errors_before = admin.smart_log()["num_err_log_entries"]
        failed = [admin.submit(Opcode.BEGIN_STEP, nsid=nsid) for _ in range(2)]
        assert [c.status for c in failed] == [Status.WRITE_FAULT] * 2
        assert b"injected error" in failed[0].data
        assert digest(mount) == before  # the command did not run: no step open, no byte changed
        newest = admin.error_log()[:2]
        assert [(e["cmdid"], e["status_field"] & 0x7FF, e["nsid"], e["cs"]) for e in newest] == [
            (c.cid, Status.WRITE_FAULT, nsid, Opcode.BEGIN_STEP) for c in reversed(failed)]
        assert admin.smart_log()["num_err_log_entries"] == errors_before + 2
        assert admin.begin_step(nsid) == 2  # the third one runs
        admin.abort_step(nsid)

        page = injection_log(admin)
        assert page["armed"] == [] and page["fired_total"] == 2
        assert [(f["id"], f["opcode"], f["nsid"], f["cid"]) for f in page["fired"]] == [
            (armed["id"], Opcode.BEGIN_STEP, nsid, c.cid) for c in reversed(failed)]

        # Any namespace, several armed; clear disarms them all.
        arm_injection(admin, Opcode.NAMESPACE_STATISTICS, Status.INVALID_FIELD.value, count=5)
        arm_injection(admin, Opcode.FLUSH, "CAPACITY_EXCEEDED")
        assert admin.submit(Opcode.NAMESPACE_STATISTICS, nsid=other).status == Status.INVALID_FIELD
        assert clear_injections(admin) == 2
        assert admin.statistics(other)["nsid"] == other and admin.flush(nsid) >= 0
        assert injection_log(admin)["armed"] == []

        # At most 64 armed at once; the 65th is refused and arms nothing.
        for _ in range(MAX_ARMED):
            arm_injection(admin, Opcode.SCRUB, "WRITE_FAULT")
        refused = admin.submit(Opcode.INJECT_ERROR, payload=b'{"opcode": 202, "status": "WRITE_FAULT"}')
        assert refused.status == Status.LIMIT_EXCEEDED and len(injection_log(admin)["armed"]) == MAX_ARMED
        assert clear_injections(admin) == MAX_ARMED


def test_inject_refuses_bad_input_and_arms_nothing(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = sealed_namespace(mp)
    create_namespace(mp, "fresh", [("b", B_NUMEL)])  # still loading: nothing to corrupt
    before = digest(mount)
    refused = [
        (dict(payload=b'{"opcode": 197, "status": "SUCCESS"}'), Status.INVALID_FIELD),
        (dict(payload=b'{"opcode": 197, "status": "STEP_SKIPPED_NONFINITE"}'), Status.INVALID_FIELD),
        (dict(payload=b'{"opcode": 197, "status": "NO_SUCH_STATUS"}'), Status.INVALID_FIELD),
        (dict(payload=b'{"opcode": 197, "status": 4095}'), Status.INVALID_FIELD),
        (dict(payload=b'{"opcode": 208, "status": "WRITE_FAULT"}'), Status.INVALID_FIELD),  # D0h itself
        (dict(payload=b'{"opcode": 127, "status": "WRITE_FAULT"}'), Status.INVALID_FIELD),  # not a command
        (dict(payload=b'{"opcode": 5, "queue": "io", "status": "WRITE_FAULT"}'), Status.INVALID_FIELD),
        (dict(payload=b'{"opcode": 1, "queue": "nvme", "status": "WRITE_FAULT"}'), Status.INVALID_FIELD),
        (dict(payload=b'{"opcode": 197, "status": "WRITE_FAULT", "count": 0}'), Status.INVALID_FIELD),
        (dict(payload=b'{"opcode": 197, "status": "WRITE_FAULT", "when": 3}'), Status.INVALID_FIELD),
        (dict(payload=b'{"status": "WRITE_FAULT"}'), Status.INVALID_FIELD),
        (dict(payload=b'[1]'), Status.INVALID_FIELD),
        (dict(nsid=99, payload=b'{"opcode": 197, "status": "WRITE_FAULT"}'), Status.INVALID_NAMESPACE),
        (dict(cdw10=7), Status.INVALID_FIELD),  # no action 07h
        (dict(cdw10=1, nsid=nsid, payload=b'{"tensor": "zz", "block": 0}'), Status.INVALID_NAMESPACE),
        (dict(cdw10=1, nsid=nsid, payload=b'{"tensor": "w", "block": 9}'), Status.INVALID_FIELD),
        (dict(cdw10=1, nsid=nsid, payload=b'{"tensor": "w", "block": -1}'), Status.INVALID_FIELD),
        (dict(cdw10=1, nsid=nsid, payload=b'{"block": 0}'), Status.INVALID_FIELD),
        (dict(cdw10=1, nsid=nsid + 1, payload=b'{"tensor": "b"}'), Status.INVALID_FIELD),  # loading
        (dict(cdw10=1, nsid=42, payload=b'{"tensor": "w"}'), Status.INVALID_NAMESPACE),
    ]
    with AdminClient(mp) as admin:
        for fields, status in refused:
            completion = admin.submit(Opcode.INJECT_ERROR, **fields)
            assert completion.status == status, (fields, completion.data)
        page = injection_log(admin)
        assert page["armed"] == [] and page["corrupted"] == [] and page["fired_total"] == 0
        assert admin.scrub(NSID_ALL)["net"]["bad"] == []
    assert digest(mount) == before


def test_injected_io_failures_on_the_tensor_files(mount: Mount) -> None:
    mp = mount.mountpoint
    nsid = sealed_namespace(mp)
    grad_w = tensor_dir(mp, "net", "w") / "grad"
    param_b = tensor_dir(mp, "net", "b") / "param"
    before = digest(mount)
    with AdminClient(mp) as admin:
        arm_injection(admin, IoOpcode.WRITE, "WRITE_FAULT", queue="io", nsid=nsid)
        with pytest.raises(OSError) as info:
            pwrite_all(grad_w, np.ones(W_NUMEL, np.float16).tobytes())
        assert info.value.errno == errno.EIO  # WRITE_FAULT's errno
        assert digest(mount) == before  # no gradient taken, no step opened
        assert admin.statistics(nsid)["grad_bytes_in"] == 2 * (W_NUMEL + B_NUMEL)  # step 1's only
        entry = admin.error_log()[0]
        assert (entry["sqid"], entry["cmdid"], entry["nsid"], entry["cs"]) == (DATA_PATH_SQID, 0xFFFF, nsid, 1)
        assert entry["status_field"] & 0x7FF == Status.WRITE_FAULT

        arm_injection(admin, IoOpcode.READ, "INVALID_NAMESPACE", queue="io", count=2)
        for _ in range(2):
            with pytest.raises(OSError) as info:
                pread_all(param_b)
            assert info.value.errno == errno.ENOENT  # INVALID_NAMESPACE's errno
        assert len(pread_all(param_b)) == 2 * B_NUMEL  # the third read is served
        page = injection_log(admin)
        assert page["armed"] == [] and page["fired_total"] == 3
        assert [(f["opcode_name"], f["queue"], f["nsid"]) for f in page["fired"]] == [
            ("READ", "io", nsid), ("READ", "io", nsid), ("WRITE", "io", nsid)]
        pwrite_all(grad_w, np.ones(W_NUMEL, np.float16).tobytes())  # writes are served again
        assert admin.statistics(nsid)["step_open"] == 2
    assert digest(mount)[1] == "1\n"


def test_corrupted_block_is_found_by_scrub_and_counted_as_a_media_error(mount: Mount,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    mp = mount.mountpoint
    nsid = sealed_namespace(mp)
    with AdminClient(mp) as admin:
        before = admin.smart_log()
        assert admin.scrub(nsid)["net"]["bad"] == []
        where = corrupt_block(admin, nsid, "w", 0)
        assert (where["tensor"], where["block"], where["lba"], where["namespace"]) == ("w", 0, 0, "net")
        assert admin.scrub(nsid)["net"]["bad"] == [["w", 0]]
        after = admin.smart_log()
        assert after["media_errors"] == before["media_errors"] + 1
        assert injection_log(admin)["corrupted"] == [where | {"nsid": nsid}]
    code, out, _ = run_cli(capsys, "inject-error", str(mp), "--corrupt", "net", "--tensor", "b", "-o", "json")
    assert code == 0 and json.loads(out)["tensor"] == "b"
    code, out, _ = run_cli(capsys, "scrub", str(mp), "net", "-o", "json")
    assert code == 1 and json.loads(out) == {"net": {"blocks": 2, "bad": [["w", 0], ["b", 0]]}}
    # The next mount's recovery refuses the corrupted copy and falls back to step 0.
    mount.unmount()
    mount.restart(verify="open")
    assert (mp / "ns/net/step").read_text() == "0\n"


def test_a_restart_serves_params_at_once_and_a_bad_moment_found_later_stops_the_namespace(mount: Mount) -> None:
    """`cossd mount` verifies in the background: the params of the newest step are served at
    once (each block checked on its own; tests/unit/test_verify_background.py holds the pass
    back to show it), a corrupted master found by the background pass stops the namespace
    loudly, and the remount serves the step before."""
    mp = mount.mountpoint
    nsid = sealed_namespace(mp)
    params = pread_all(tensor_dir(mp, "net", "w") / "param")
    with AdminClient(mp) as admin:
        corrupt_block(admin, nsid, "w", 0)  # a master byte of step 1's copy
        errors_before = admin.smart_log()["media_errors"]
    mount.unmount()
    mount.restart()  # --verify background, the default
    assert (mp / "ns/net/step").read_text() == "1\n"
    try:  # served, its own checksums passing, unless the pass (a few ms here) already failed step 1
        assert pread_all(tensor_dir(mp, "net", "w") / "param") == params
    except OSError as exc:
        assert exc.errno == errno.EIO
    with AdminClient(mp) as admin:
        with pytest.raises(DeviceError) as refused:
            admin.begin_step(nsid, 2)  # waits for the background pass, which fails step 1
        assert refused.value.status == Status.UNRECOVERED_READ_ERROR
        assert "step 1 fails" in refused.value.message and "remount" in refused.value.message
        assert admin.statistics(nsid)["verification"]["verifying"] is False
        assert admin.smart_log()["media_errors"] > errors_before
    with pytest.raises(OSError) as failed:  # nothing is served any more, not even params
        pread_all(tensor_dir(mp, "net", "w") / "param")
    assert failed.value.errno == errno.EIO
    mount.unmount()
    mount.restart()
    assert (mp / "ns/net/step").read_text() == "0\n"
    pwrite_all(tensor_dir(mp, "net", "w") / "grad", np.full(W_NUMEL, 0.5, np.float16).tobytes())
    pwrite_all(tensor_dir(mp, "net", "b") / "grad", np.ones(B_NUMEL, np.float16).tobytes())
    assert (mp / "ns/net/step").read_text() == "1\n"
    assert pread_all(tensor_dir(mp, "net", "w") / "param") == params  # the same step 1 again


def test_a_restart_reads_the_params_ahead_and_logs_where_its_start_up_went(mount: Mount) -> None:
    """The daemon reads the committed params ahead while it imports (emulator/prefetch.py):
    its log says how much it asked for, and once ready where the start-up went; the params
    served after it are the step's own."""
    mp = mount.mountpoint
    sealed_namespace(mp)
    params = pread_all(tensor_dir(mp, "net", "w") / "param")
    mount.unmount()
    log_path = mount.backing / "daemon.log"
    before = log_path.read_text() if log_path.exists() else ""
    mount.restart()
    assert pread_all(tensor_dir(mp, "net", "w") / "param") == params
    # Both lines come after the daemon says ready (the read-ahead from a detached child): wait.
    read_ahead_line = r"asked the kernel to read (\d+) MiB of committed params ahead"
    ready_line = (r"ready [\d.]+ s after the daemon's entry: imports [\d.]+ s, device open [\d.]+ s, "
                  r"mount [\d.]+ s")

    def logged() -> str | None:
        text = log_path.read_text()[len(before):]
        return text if re.search(read_ahead_line, text) and re.search(ready_line, text) else None

    text = wait_until(logged) or log_path.read_text()[len(before):]
    assert re.search(read_ahead_line, text) is not None, text
    assert re.search(ready_line, text), text


# ---------------------------------------------------------------------- the CLI verbs


def test_cli_get_and_set_feature(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = str(mount.mountpoint)
    sealed_namespace(mount.mountpoint)
    code, out, _ = run_cli(capsys, "get-feature", mp, "-f", "4")
    assert code == 0 and out == "get-feature:0x04 (Temperature Threshold), Current value:0x00000157\n"
    code, out, _ = run_cli(capsys, "get-feature", mp, "-f", "4", "-H")
    assert "(TMPTH): 70 °C (343 K)" in out and "Over Temperature Threshold" in out
    code, out, _ = run_cli(capsys, "get-feature", mp, "-f", "7", "-H", "-o", "json")
    value = json.loads(out)
    assert value["value"] == 0xFFFEFFFE and value["fields"] == {"nsqa": 0xFFFE, "ncqa": 0xFFFE}
    code, out, _ = run_cli(capsys, "get-feature", mp, "-f", "0xc1", "-s", "3", "-H")
    assert "Supported capabilities value:0x00000005" in out and "Feature is saveable" in out
    assert "Feature is not namespace specific" in out

    code, out, _ = run_cli(capsys, "set-feature", mp, "-f", "4", "-v", "320", "--save")
    assert code == 0 and out.startswith("set-feature:0x04 (Temperature Threshold), value:0x00000140, save:1")
    code, out, _ = run_cli(capsys, "get-feature", mp, "-f", "4", "-s", "2", "-o", "json")
    assert json.loads(out)["value"] == 320 and json.loads(out)["sel"] == "saved"

    code, out, _ = run_cli(capsys, "set-feature", mp, "-f", "0xc0", "-n", "net", "--lr", "0.25", "-o", "json")
    assert code == 0 and json.loads(out)["data"]["groups"][0]["lr"] == 0.25 and json.loads(out)["value"] == ALL_GROUPS
    code, out, _ = run_cli(capsys, "get-feature", mp, "-f", "0xc0", "-n", "net")
    assert '"lr": 0.25' in out and "Current value:0x00000001" in out
    code, out, _ = run_cli(capsys, "set-feature", mp, "-f", "0xc1", "--kernel", "avx2")
    assert code == 0 and '"kernel": "avx2"' in out
    code, out, _ = run_cli(capsys, "set-feature", mp, "-f", "0xc1", "--data", '{"kernel": "auto"}', "-o", "json")
    assert json.loads(out)["data"] == {"durability": "plp", "kernel": "auto"}

    # Refusals: one line on stderr, exit 1, nothing changed.
    code, out, err = run_cli(capsys, "set-feature", mp, "-f", "0xc0", "-n", "net", "--lr", "-3")
    assert code == 1 and out == "" and err.startswith("cossd set-feature: ") and err.endswith("[INVALID_FIELD]\n")
    code, _, err = run_cli(capsys, "set-feature", mp, "-f", "7", "-v", "3")
    assert code == 1 and "[FEATURE_NOT_CHANGEABLE]" in err and err.count("\n") == 1
    code, _, err = run_cli(capsys, "get-feature", mp, "-f", "4", "-n", "net")
    assert code == 1 and "[FEATURE_NOT_NAMESPACE_SPECIFIC]" in err
    with pytest.raises(SystemExit, match="needs -v VALUE"):
        main(["set-feature", mp, "-f", "4"])
    with pytest.raises(SystemExit, match="not both"):
        main(["set-feature", mp, "-f", "0xc1", "--data", "{}", "--kernel", "auto"])
    code, out, _ = run_cli(capsys, "get-feature", mp, "-f", "0xc0", "-n", "net", "-o", "json")
    assert json.loads(out)["data"]["groups"][0]["lr"] == 0.25


def test_cli_get_feature_binary(mount: Mount, capsysbinary: pytest.CaptureFixture[bytes]) -> None:
    assert main(["get-feature", str(mount.mountpoint), "-f", "4", "-o", "binary"]) == 0
    assert capsysbinary.readouterr().out == struct.pack("<I", WARNING_TEMP_KELVIN)
    assert main(["get-feature", str(mount.mountpoint), "-f", "0xc1", "-s", "1", "-o", "binary"]) == 0
    assert json.loads(capsysbinary.readouterr().out) == {"durability": "plp", "kernel": "auto"}


def test_cli_inject_error(mount: Mount, capsys: pytest.CaptureFixture[str]) -> None:
    mp = str(mount.mountpoint)
    nsid = sealed_namespace(mount.mountpoint)
    code, out, _ = run_cli(capsys, "inject-error", mp, "--opcode", "commit-step", "--status", "write-fault",
                           "--count", "2", "-n", "net")
    assert code == 0 and out == (f"armed injection 1: COMMIT_STEP (admin, nsid {nsid}) fails with WRITE_FAULT, "
                                 "2 more, fired 0\n")
    code, out, _ = run_cli(capsys, "inject-error", mp, "--opcode", "write", "--status", "0x280", "-o", "json")
    assert code == 0 and json.loads(out) | {"id": 0} == {
        "id": 0, "queue": "io", "opcode": 1, "opcode_name": "WRITE", "status": "WRITE_FAULT", "nsid": None,
        "remaining": 1, "fired": 0}
    with pytest.raises(OSError):
        pwrite_all(tensor_dir(mount.mountpoint, "net", "b") / "grad", np.ones(B_NUMEL, np.float16).tobytes())
    code, out, _ = run_cli(capsys, "error-log", mp)  # logged as from I/O queue 1, opcode Write
    assert code == 0 and "cs              : 0x1 (opcode WRITE)" in out and "sqid            : 1" in out
    code, out, _ = run_cli(capsys, "inject-error", mp, "--list")
    assert code == 0 and "armed: 1" in out and "fired: 1 (latest first)" in out
    assert "injection 2: WRITE (io, nsid 1) -> WRITE_FAULT" in out
    code, out, _ = run_cli(capsys, "inject-error", mp, "--list", "-o", "json")
    assert [entry["opcode_name"] for entry in json.loads(out)["armed"]] == ["COMMIT_STEP"]
    code, out, _ = run_cli(capsys, "inject-error", mp, "--clear")
    assert code == 0 and out == "cleared 1 armed injection(s)\n"
    code, out, _ = run_cli(capsys, "inject-error", mp, "--clear", "-o", "json")
    assert json.loads(out) == {"cleared": 0}
    code, out, _ = run_cli(capsys, "inject-error", mp, "--corrupt", "net", "--tensor", "w", "--block", "0")
    assert code == 0 and out.startswith("corrupted net/w block 0 (lba 0) in copy ")

    code, _, err = run_cli(capsys, "inject-error", mp, "--opcode", "0xc5", "--status", "success")
    assert code == 1 and err.startswith("cossd inject-error: ") and "[INVALID_FIELD]" in err
    code, _, err = run_cli(capsys, "inject-error", mp, "--corrupt", "nope", "--tensor", "w")
    assert code == 1 and "[INVALID_NAMESPACE]" in err
    with pytest.raises(SystemExit, match="needs --status"):
        main(["inject-error", mp, "--opcode", "0xc5"])
    with pytest.raises(SystemExit):
        main(["inject-error", mp, "--opcode", "not-an-opcode", "--status", "write-fault"])
    assert json.loads(run_cli(capsys, "inject-error", mp, "--list", "-o", "json")[1])["armed"] == []
