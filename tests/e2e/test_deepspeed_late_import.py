"""A cossd AdamW made before deepspeed is imported, then handed to deepspeed.initialize under ZeRO: bound as if deepspeed had come first at one rank, refused by name at several."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the optional framework tier: `make frameworks`)")

from ranks import bits_equal, finished, mounted_device, spawn_ranks  # noqa: E402

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("deepspeed_late_job.py")


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with mounted_device(tmp_path_factory.mktemp("dslate"), "TESTSERIALDSL", capacity_bytes=1 << 30) as mounted:
        yield mounted


def run(device: Any, out: Path, world: int, namespace: str, stage: int, last: int, **config: Any) -> list[int]:
    config = {"mount": str(device.mountpoint), "out": str(out), "namespace": namespace, "stage": stage,
              "last": last} | config
    return spawn_ranks(JOB, config, world, out, timeout_s=240)


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_optimizer_made_before_import_deepspeed_binds_at_one_rank(device: Any, tmp_path: Path, stage: int) -> None:
    """Made before `import deepspeed`, the optimizer is bound by deepspeed.initialize as one
    made after it: the namespace holds ZeRO's flat group (not the model's params, as the
    generic one-rank rebind made it before), the losses and params are the usual order's
    bit for bit, and the same script restarted on the trained namespace resumes from it.
    DeepSpeed holds no process group once the job destroyed its own."""
    usual = finished(tmp_path / "usual", 1, run(device, tmp_path / "usual", 1, f"late-usual-{stage}", stage, 3,
                                                 deepspeed_first=True))
    late = finished(tmp_path / "late", 1, run(device, tmp_path / "late", 1, f"late-{stage}", stage, 3))
    assert late[0]["names"] == usual[0]["names"] == [("zero.g0", 2128)]
    assert late[0]["losses"] == usual[0]["losses"] and late[0]["committed_step"] == 3
    assert bits_equal(late[0]["params"], usual[0]["params"])
    # A job that ran to its end no longer holds the process group it made before `import
    # deepspeed` either (install() drops DeepSpeed's captured default, as a refusal does).
    assert (tmp_path / "late" / "held0.txt").read_text() == ""
    again = finished(tmp_path / "again", 1, run(device, tmp_path / "again", 1, f"late-{stage}", stage, 5))
    assert again[0]["first"] == 4 and again[0]["committed_step"] == 5


def test_optimizer_made_before_import_deepspeed_is_refused_at_two_ranks(device: Any, tmp_path: Path) -> None:
    """At 2 ranks the optimizer made before `import deepspeed` opened a namespace of the
    model's params for both ranks: deepspeed.initialize refuses it on every rank, naming the
    import order, and nothing is stepped (before, the first step failed with a message about
    torch.distributed sharding). Each refused rank exits with its own code: DeepSpeed no
    longer holds the process group the job made before `import deepspeed` (a default argument
    of its TorchBackend kept it, and its gloo threads, alive into exit(), where a rank aborted
    under load, exit -6)."""
    from cossd.client import AdminClient

    codes = run(device, tmp_path, 2, "late-two", 2, 3)
    assert codes == [4, 4], (tmp_path / "logs.txt").read_text()[-3000:]
    for rank in range(2):
        error = (tmp_path / f"error{rank}.txt").read_text()
        assert "made before `import deepspeed`" in error and "2 ranks" in error, error
        assert (tmp_path / f"held{rank}.txt").read_text() == ""
    with AdminClient(device.mountpoint) as admin:
        assert int(admin.statistics(admin.nsid("late-two"))["committed_step"]) == 0
