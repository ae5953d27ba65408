"""DeepSpeed ZeRO 1/2 jobs of several ranks with a cossd AdamW: one namespace, one atomic step across ranks, a rank killed before the commit, the quick restore."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the optional framework tier: `make frameworks`)")

from ranks import bits_equal, finished, mounted_device, spawn_ranks  # noqa: E402

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("deepspeed_job.py")
STEPS = 6


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with mounted_device(tmp_path_factory.mktemp("dszero"), "TESTSERIALDSZ", capacity_bytes=1 << 30) as mounted:
        yield mounted


def run(device: Any, out: Path, world: int, **config: Any) -> list[int]:
    config = {"mount": str(device.mountpoint), "out": str(out), "stage": 2, "precision": "bf16",
              "last": STEPS} | config
    return spawn_ranks(JOB, config, world, out, timeout_s=300)


def test_zero2_two_ranks_rank_killed_before_commit(device: Any, tmp_path: Path) -> None:
    """BF16 ZeRO-2 at 2 ranks with two param groups: both ranks' partitions of both groups on
    one namespace. Rank 1 killed (SIGKILL) in step 4 once its partition of group 0 is on the
    device, before its partition of group 1 and the commit: nothing of step 4 is committed (rank 0 is told, the device stays at step 3),
    and the restarted job resumes at step 4 and ends bit for bit as the uninterrupted one."""
    reference = finished(tmp_path / "ref", 2, run(device, tmp_path / "ref", 2, namespace="ds-z2-ref"))
    assert reference[0]["result"]["names"] == [("zero.g0", 2048), ("zero.g1", 80)]
    assert [r["result"]["committed_step"] for r in reference] == [STEPS, STEPS]
    assert bits_equal(reference[0]["params"], reference[1]["params"])

    killed = tmp_path / "killed"
    codes = run(device, killed, 2, namespace="ds-z2-kill", kill={"rank": 1, "step": 4}, step_timeout_s=3.0)
    assert codes[1] == -9 and codes[0] == 3, (codes, (killed / "logs.txt").read_text()[-3000:])
    assert json.loads((killed / "kill1.json").read_text())["committed_step"] == 3
    error = (killed / "error0.txt").read_text()
    assert "step 4" in error and "was not committed" in error and "committed_step=3" in error

    again = finished(tmp_path / "again", 2, run(device, tmp_path / "again", 2, namespace="ds-z2-kill"))
    for rank in range(2):
        result = again[rank]["result"]
        assert result["first"] == 4 and result["restored"] and result["committed_step"] == STEPS
        assert [result["losses"][step] for step in range(4, STEPS + 1)] == \
            [reference[rank]["result"]["losses"][step] for step in range(4, STEPS + 1)]
        assert bits_equal(again[rank]["params"], reference[rank]["params"])
    assert bits_equal(again[0]["masters"], reference[0]["masters"])


MATRIX = [(stage, precision, world) for stage in (1, 2) for precision in ("bf16", "fp16") for world in (1, 2, 3)]


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "precision", "world"), MATRIX,
                         ids=[f"zero{s}-{p}-{w}ranks" for s, p, w in MATRIX])
def test_zero_matrix_learns_like_torch_adamw(device: Any, tmp_path: Path, stage: int, precision: str,
                                             world: int) -> None:
    """ZeRO 1/2 x BF16/FP16 x 1-3 ranks, two param groups: every rank ends with the same
    params, the namespace holds the two flat groups, and the loss follows torch's AdamW under
    the same DeepSpeed config (the gradients reach the device in BF16)."""
    common = {"stage": stage, "precision": precision}
    expected = finished(tmp_path / "torch", world, run(device, tmp_path / "torch", world, namespace="-",
                                                       torch=True, **common))
    got = finished(tmp_path / "cossd", world, run(device, tmp_path / "cossd", world,
                                                  namespace=f"ds-m-{stage}-{precision}-{world}", **common))
    assert got[0]["result"]["names"] == [("zero.g0", 2048), ("zero.g1", 80)]
    for rank in range(world):
        assert bits_equal(got[rank]["params"], got[0]["params"])
        ours, theirs = got[rank]["result"]["losses"], expected[rank]["result"]["losses"]
        assert ours.keys() == theirs.keys()
        assert max(abs(ours[step] - theirs[step]) for step in ours) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "precision", "match"), [
    (3, "bf16", "ZeRO stage 3, BF16, 2 ranks"), (3, "fp16", "ZeRO stage 3, FP16, 2 ranks"),
    (0, "bf16", "ZeRO stage 0, BF16, 2 ranks")])
def test_unsupported_combinations_refused_at_initialize(device: Any, tmp_path: Path, stage: int, precision: str,
                                                        match: str) -> None:
    """Refused by deepspeed.initialize on every rank, naming the combination; the namespace
    is never made."""
    from cossd.trainer.namespace_files import NamespaceFiles

    namespace = f"ds-refused-{stage}-{precision}"
    codes = run(device, tmp_path, 2, namespace=namespace, stage=stage, precision=precision)
    assert codes == [4, 4], (tmp_path / "logs.txt").read_text()[-3000:]
    for rank in range(2):
        assert match in (tmp_path / f"error{rank}.txt").read_text()
    probe = NamespaceFiles(device.mountpoint, namespace, 30.0, use_cmb=False)
    try:
        assert not probe.exists()
    finally:
        probe.close()
