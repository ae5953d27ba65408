"""DeepSpeed ZeRO 1/2 with a DeepSpeed MoE layer and a cossd AdamW at 2 ranks: at ep_size 1 it learns like torch's AdamW and restarts from the device; at ep_size 2 (experts partitioned over their own expert data-parallel group) it is refused at deepspeed.initialize."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (the optional framework tier: `make frameworks`)")

from ranks import finished, mounted_device, spawn_ranks  # noqa: E402

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("deepspeed_moe_job.py")
STEPS, RESTART_AFTER = 4, 2
# The flat groups of the job's model: dense weights (fc1, the gate, fc2), dense biases, then
# DeepSpeed's MoE groups of both experts' weights and biases (ep_size 1: every rank holds both).
NAMES = [("zero.g0", 1088), ("zero.g1", 48), ("zero.g2", 2048), ("zero.g3", 64)]


@pytest.fixture(scope="module")
def device(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with mounted_device(tmp_path_factory.mktemp("dsmoe"), "TESTSERIALDSMOE", capacity_bytes=1 << 30) as mounted:
        yield mounted


def run(device: Any, out: Path, **config: Any) -> list[int]:
    config = {"mount": str(device.mountpoint), "out": str(out), "last": STEPS} | config
    return spawn_ranks(JOB, config, 2, out, timeout_s=300)


def stages(fast: int) -> list[Any]:
    """ZeRO 1 and 2, each slow but `fast` (the sample `make test` runs)."""
    return [pytest.param(stage, id=f"zero{stage}", marks=() if stage == fast else pytest.mark.slow) for stage in (1, 2)]


@pytest.mark.parametrize("stage", stages(2))
def test_moe_ep_size_1_learns_like_torch_adamw_and_restores(device: Any, tmp_path: Path, stage: int) -> None:
    """ep_size 1: DeepSpeed partitions the MoE groups over the data-parallel ranks, as the
    dense ones. The job stopped after step 2 and started again on its namespace resumes
    from the device at step 3 (every expert's masters read back where they were), and its
    losses and params follow torch's AdamW under the same DeepSpeed config."""
    expected = finished(tmp_path / "torch", 2, run(device, tmp_path / "torch", stage=stage, ep_size=1, torch=True))
    name = f"ds-moe-ep1-z{stage}"
    first = finished(tmp_path / "first", 2, run(device, tmp_path / "first", stage=stage, ep_size=1, namespace=name,
                                                last=RESTART_AFTER))
    again = finished(tmp_path / "again", 2, run(device, tmp_path / "again", stage=stage, ep_size=1, namespace=name))
    for rank in range(2):
        before, after = first[rank]["result"], again[rank]["result"]
        assert before["names"] == NAMES and after["names"] == NAMES
        assert after["first"] == RESTART_AFTER + 1 and after["restored"] and after["committed_step"] == STEPS
        losses = before["losses"] | after["losses"]
        theirs = expected[rank]["result"]["losses"]
        assert losses.keys() == theirs.keys()
        # BF16 gradients on the wire: within the ZeRO matrix's bound (test_deepspeed_zero.py).
        assert max(abs(losses[step] - theirs[step]) for step in losses) < 1e-3, (losses, theirs)
        ours, reference = again[rank]["params"], expected[rank]["params"]
        assert ours.keys() == reference.keys()
        # A bf16 rounding or two apart at most; another expert's weights differ by ~0.2.
        worst = {key: float((ours[key].float() - reference[key].float()).abs().max()) for key in ours}
        assert max(worst.values()) < 1e-2, worst


@pytest.mark.parametrize("stage", stages(2))
def test_moe_ep_size_2_refused_at_initialize(device: Any, tmp_path: Path, stage: int) -> None:
    """ep_size 2 at 2 ranks: each rank holds one expert, and DeepSpeed partitions the MoE
    groups over an expert data-parallel group of 1 rank, which a namespace of one partition
    per data-parallel rank cannot place (the binding put rank 1's partition past the group
    and crashed after the first commit). Refused by deepspeed.initialize on every rank,
    naming the group, its partition count and the data-parallel world; no namespace made."""
    from cossd.trainer.namespace.files import NamespaceFiles

    namespace = f"ds-moe-ep2-z{stage}"
    codes = run(device, tmp_path, stage=stage, ep_size=2, namespace=namespace, step_timeout_s=10.0)
    assert codes == [4, 4], (codes, (tmp_path / "logs.txt").read_text()[-3000:])
    for rank in range(2):
        error = (tmp_path / f"error{rank}.txt").read_text()
        assert error.startswith("NotImplementedError: ")
        assert f"ZeRO stage {stage} partitions param group 2 ('ep_size_2') over 1 rank" in error
        assert "not the 2 data-parallel ranks" in error and "ep_size=1" in error
    probe = NamespaceFiles(device.mountpoint, namespace, 30.0, use_cmb=False)
    try:
        assert not probe.exists()
    finally:
        probe.close()
