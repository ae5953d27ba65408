"""Default export paths never collide: namespace `a-b` at step 1 and snapshot `b-step1` of
namespace `a` used to share `a-b-step1.safetensors`, the second export silently replacing the
first. Each (namespace, step) and (namespace, tag) now has its own file, and an existing export
is never replaced unless the command asks for it (overwrite)."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import safetensors

from conftest import Mount
from cossd.protocol.status import DeviceError, Status
from cossd.emulator.snapshots.export import default_path
from cossd.client import snapshots as snapshot_calls
from cossd.client import AdminClient
from helpers import create_namespace, pwrite_all, tensor_dir


def train_one_step(mp: Path, name: str, numel: int, value: float) -> None:
    pwrite_all(tensor_dir(mp, name, "w") / "grad", np.full(numel, value, np.float16).tobytes())


def finished(admin: AdminClient, job: dict) -> dict:
    done = snapshot_calls.wait_for_job(admin, job)
    assert done["state"] in ("done", "failed"), done
    return done


def metadata(path: str) -> dict[str, str]:
    with safetensors.safe_open(path, "np") as opened:
        return opened.metadata()


def test_default_paths_are_distinct_for_every_namespace_and_step_or_tag(tmp_path: Path) -> None:
    """Names built to collide under the old '<ns>-<tag>' / '<ns>-step<N>' scheme."""
    names = ["a", "a-b", "a-b-step1", "b-step1", "step1", "step-1", "a.step-1", "snapshot-a", "1"]
    sources = [(ns, step, None) for ns in names for step in (1, 2, 11)] + [
        (ns, 1, tag) for ns, tag in itertools.product(names, names)]
    paths = [default_path(tmp_path, *source) for source in sources]
    assert len(set(paths)) == len(paths)
    # The longest names still fit one file name (255 bytes), the temporary one too.
    longest = default_path(tmp_path, "n" * 128, 1, "t" * 128)
    assert len(f".{longest.name}.4294967295.tmp") <= 255


@pytest.mark.mount
def test_colliding_exports_keep_both_files_and_never_replace(mount: Mount) -> None:
    mp = mount.mountpoint
    for name in ("a-b", "a"):
        create_namespace(mp, name, [("w", 64)])
    train_one_step(mp, "a-b", 64, 0.5)
    train_one_step(mp, "a", 64, -0.5)
    with AdminClient(mp) as admin:
        nsid_ab, nsid_a = admin.nsid("a-b"), admin.nsid("a")
        snapshot_calls.create_snapshot(admin, nsid_a, "b-step1")
        snapshot_calls.create_snapshot(admin, nsid_a, "step-1")  # against a's own step 1
        first = finished(admin, snapshot_calls.export(admin, nsid_ab))
        second = finished(admin, snapshot_calls.export(admin, nsid_a, tag="b-step1"))
        third = finished(admin, snapshot_calls.export(admin, nsid_a, tag="step-1"))
        fourth = finished(admin, snapshot_calls.export(admin, nsid_a))
        jobs = [first, second, third, fourth]
        assert [job["state"] for job in jobs] == ["done"] * 4, jobs
        paths = [job["path"] for job in jobs]
        assert len(set(paths)) == 4, paths
        assert paths[0] == str(mount.backing / "exports/a-b/step-1.safetensors")
        assert paths[1] == str(mount.backing / "exports/a/snapshot-b-step1.safetensors")
        assert [(metadata(p)["cossd.namespace"], metadata(p)["cossd.snapshot"]) for p in paths] == [
            ("a-b", ""), ("a", "b-step1"), ("a", "step-1"), ("a", "")]
        ab_bytes = Path(paths[0]).read_bytes()

        # Again without overwrite: refused before anything starts, the file untouched.
        with pytest.raises(DeviceError) as refused:
            snapshot_calls.export(admin, nsid_ab)
        assert refused.value.status == Status.INVALID_FIELD and "exists" in refused.value.message
        assert Path(paths[0]).read_bytes() == ab_bytes
        # The namespace trains on: its step 2 gets a file of its own; step 1's stays.
        train_one_step(mp, "a-b", 64, 0.25)
        step2 = finished(admin, snapshot_calls.export(admin, nsid_ab))
        assert step2["state"] == "done" and step2["path"] == str(mount.backing / "exports/a-b/step-2.safetensors")
        assert Path(paths[0]).read_bytes() == ab_bytes
        # With overwrite the caller asked for it.
        snapshot_calls.create_snapshot(admin, nsid_ab, "late")
        again = finished(admin, snapshot_calls.export(admin, nsid_ab, tag="late", overwrite=True))
        assert again["state"] == "done"
        replaced = finished(admin, snapshot_calls.export(admin, nsid_ab, tag="late", overwrite=True))
        assert replaced["state"] == "done" and replaced["path"] == again["path"]
    leftovers = [p for p in (mount.backing / "exports").rglob(".*")]
    assert leftovers == []


@pytest.mark.mount
def test_a_race_to_the_same_name_never_replaces(mount: Mount) -> None:
    """Two exports of one step started before either finishes: one file, never replaced; the
    other job fails naming the file (or is refused at once if the first already finished)."""
    mp = mount.mountpoint
    create_namespace(mp, "big", [("w", 1 << 20)])
    train_one_step(mp, "big", 1 << 20, 0.5)
    with AdminClient(mp) as admin:
        nsid = admin.nsid("big")
        jobs = []
        for _ in range(2):
            try:
                jobs.append(snapshot_calls.export(admin, nsid, optimizer_state=True))
            except DeviceError as exc:
                assert exc.status == Status.INVALID_FIELD and "exists" in exc.message
        results = [finished(admin, job) for job in jobs]
    states = sorted(result["state"] for result in results)
    assert states in (["done"], ["done", "failed"]), results
    for result in results:
        if result["state"] == "failed":
            assert result["status"] == "INVALID_FIELD" and "nothing replaced" in result["error"]
    target = mount.backing / "exports/big/step-1.safetensors"
    assert target.is_file() and not list(target.parent.glob(".*"))
