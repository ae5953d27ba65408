"""The shared step in process: BEGIN_STEP joined by a job's ranks, COMMIT_STEP's one result once every rank's gradients are in, aborts every rank hears."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cossd.client import AdminClient
from cossd.emulator import Device
from cossd.emulator.controller import Controller
from cossd.emulator.layout import BLOCK_ELEMS
from cossd.protocol.entries import Opcode
from cossd.protocol.status import DeviceError, Status
from cossd.trainer.shard import plan_shards
from helpers import InProcessTransport


@pytest.fixture
def setup(device: Device):
    """A namespace of two tensors (one of two blocks) and a client to it; its gradient writes."""
    admin = AdminClient(InProcessTransport(Controller(device)))  # type: ignore[arg-type]
    nsid = admin.create_namespace({"name": "net", "tensors": [["w", BLOCK_ELEMS + 64], ["b", 64, 1]],
                                   "groups": [{}, {"weight_decay": 0.0}], "grad_dtype": "bf16",
                                   "param_dtype": "bf16"})
    namespace = device.namespace_by_id(nsid)

    def grads(tensor: str, start: int, stop: int, value: float = 0.5) -> None:
        namespace.write_grad(tensor, 2 * start, np.full(stop - start, value, np.float32).view(np.uint32)
                             .__rshift__(16).astype(np.uint16).tobytes())

    return admin, nsid, namespace, grads


JOB = {"job": 7, "ranks": 2}
GROUPS = [{"lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1},
          {"lr": 2e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}]


def test_two_ranks_commit_once_and_both_read_the_result(setup) -> None:
    admin, nsid, namespace, grads = setup
    opened = admin.begin_shared_step(nsid, 1, 0.5, seq=1, rank=0, groups=GROUPS, **JOB)
    assert opened["opened"] and opened["joined"] == 1
    grads("w", 0, BLOCK_ELEMS)  # rank 0's shard: the first block of w
    waiting = admin.commit_shared_step(nsid, 1, seq=1, rank=0, **JOB)
    assert "ranks [1] of 2 have not joined" in waiting["waiting"]
    joined = admin.begin_shared_step(nsid, 1, 0.5, seq=1, rank=1, groups=GROUPS, **JOB)
    assert not joined["opened"] and joined["joined"] == 2
    grads("w", BLOCK_ELEMS, BLOCK_ELEMS + 64)
    waiting = admin.commit_shared_step(nsid, 1, seq=1, rank=1, **JOB)["waiting"]
    assert waiting == "step 1: gradients incomplete for b"  # w's blocks are in (their kernels may still run)
    assert namespace.statistics()["committed_step"] == 0  # never with a shard missing
    grads("b", 0, 64)
    first = admin.commit_shared_step(nsid, 1, seq=1, rank=1, **JOB)
    second = admin.commit_shared_step(nsid, 1, seq=1, rank=0, **JOB)
    assert first == second == {"step": 1, "committed_step": 1, "skipped": False, "nonfinite_elements": 0}
    stats = namespace.statistics()
    assert stats["steps_committed"] == 1 and stats["shared_step"] is None
    # The step ran with the groups' hyperparameters from the begin.
    assert [g["lr"] for g in namespace.config()["groups"]] == [1e-3, 2e-3]


def test_disagreeing_ranks_are_refused_and_change_nothing(setup) -> None:
    admin, nsid, namespace, grads = setup
    admin.begin_shared_step(nsid, 1, 0.5, seq=1, rank=0, groups=GROUPS, **JOB)
    cases = [
        (dict(step=1, grad_scale=0.25, groups=GROUPS, rank=1), Status.INVALID_FIELD, "grad scale"),
        (dict(step=1, grad_scale=0.5, groups=[GROUPS[0], GROUPS[0]], rank=1), Status.INVALID_FIELD,
         "hyperparameters differ"),
        (dict(step=1, grad_scale=0.5, groups=GROUPS, rank=0), Status.STEP_ALREADY_OPEN, "joined it already"),
        (dict(step=2, grad_scale=0.5, groups=GROUPS, rank=1), Status.STEP_NUMBER_MISMATCH, "asks for step 2"),
    ]
    for fields, status, words in cases:
        step, scale = fields.pop("step"), fields.pop("grad_scale")
        with pytest.raises(DeviceError) as refused:
            admin.begin_shared_step(nsid, step, scale, seq=1, **JOB | fields)
        assert refused.value.status == status and words in refused.value.message
    with pytest.raises(DeviceError) as other_job:
        admin.begin_shared_step(nsid, 1, 0.5, seq=1, rank=0, groups=GROUPS, job=8, ranks=2)
    assert other_job.value.status == Status.STEP_ALREADY_OPEN and "another job" in other_job.value.message
    assert namespace.statistics()["shared_step"] == {"job": 7, "seq": 1, "ranks": 2, "joined": [0]}


def test_bad_payloads_are_invalid_field(setup) -> None:
    admin, nsid, namespace, _ = setup
    for payload in ({"job": 7, "ranks": 2}, {"job": 7, "seq": 1, "ranks": 2, "rank": 2},
                    {"job": -1, "seq": 1, "ranks": 2, "rank": 0}, {"job": 7, "seq": 1, "ranks": 0, "rank": 0},
                    {"job": 7, "seq": 1, "ranks": 2, "rank": 0, "groups": [{"lr": -1.0}, {}]},
                    {"job": 7, "seq": 1, "ranks": 2, "rank": 0, "groups": [{"mode": "adam"}, {}]},
                    {"job": 7, "seq": 1, "ranks": 2, "rank": 0, "groups": [{}]},
                    {"job": 7, "seq": True, "ranks": 2, "rank": 0}, [1, 2]):
        completion = admin.submit(Opcode.BEGIN_STEP, nsid=nsid, cdw10=1, payload=json.dumps(payload).encode())
        assert completion.status == Status.INVALID_FIELD, (payload, completion)
    completion = admin.submit(Opcode.BEGIN_STEP, nsid=nsid, payload=json.dumps(JOB | {"seq": 1, "rank": 0}).encode())
    assert completion.status == Status.INVALID_FIELD  # a shared step names its step
    assert namespace.statistics()["step_open"] is None
    assert [g["lr"] for g in namespace.config()["groups"]] == [1e-3, 1e-3]


def test_an_abort_reaches_every_rank_and_writes_open_no_implicit_step(setup) -> None:
    admin, nsid, namespace, grads = setup
    admin.begin_shared_step(nsid, 1, 1.0, seq=1, rank=0, **JOB)
    admin.begin_shared_step(nsid, 1, 1.0, seq=1, rank=1, **JOB)
    grads("w", 0, BLOCK_ELEMS)
    admin.abort_shared_step(nsid, 1, seq=1, rank=0, reason="rank 0 waited 3 s", **JOB)
    with pytest.raises(DeviceError) as heard:
        admin.commit_shared_step(nsid, 1, seq=1, rank=1, **JOB)
    assert heard.value.status == Status.NO_STEP_OPEN and "aborted by rank 0: rank 0 waited 3 s" in heard.value.message
    # A late write of the aborted step's rank opens no implicit step (scale 1.0, no job)...
    with pytest.raises(DeviceError) as late:
        grads("w", BLOCK_ELEMS, BLOCK_ELEMS + 64)
    assert late.value.status == Status.NO_STEP_OPEN
    assert namespace.statistics()["step_open"] is None and namespace.statistics()["committed_step"] == 0
    # ... until a single client's BEGIN_STEP; then the plain step works as ever.
    admin.begin_step(nsid, 1)
    admin.abort_step(nsid)
    grads("w", 0, BLOCK_ELEMS + 64)
    grads("b", 0, 64)
    assert namespace.statistics()["committed_step"] == 1


def test_a_skipped_steps_number_comes_again_under_a_new_seq(setup) -> None:
    admin, nsid, namespace, grads = setup
    for seq, value in ((1, float("inf")), (2, 0.5)):
        for rank in (0, 1):
            admin.begin_shared_step(nsid, 1, 1.0, seq=seq, rank=rank, **JOB)
        grads("w", 0, BLOCK_ELEMS + 64, value)
        grads("b", 0, 64)
        result = admin.commit_shared_step(nsid, 1, seq=seq, rank=0, **JOB)
        assert result["skipped"] == (seq == 1)
    # The first attempt's outcome is gone (the device keeps the last only); the second stands.
    assert admin.commit_shared_step(nsid, 1, seq=2, rank=1, **JOB)["committed_step"] == 1
    stats = namespace.statistics()
    assert stats["steps_skipped"] == 1 and stats["steps_committed"] == 1


def test_a_plain_abort_of_a_shared_step_is_heard_by_its_ranks(setup) -> None:
    admin, nsid, namespace, _ = setup
    admin.begin_shared_step(nsid, 1, 1.0, seq=1, rank=0, **JOB)
    assert admin.abort_step(nsid) == 1  # an operator, or a new job's rank 0 clearing a dead job's step
    with pytest.raises(DeviceError) as heard:
        admin.commit_shared_step(nsid, 1, seq=1, rank=0, **JOB)
    assert "was aborted" in heard.value.message


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shards_cover_every_element_once_cut_at_blocks(world: int) -> None:
    block = 1000
    tensors = [("a", 2500), ("b", 10), ("c", 4096), ("d", 1), ("e", 3000)]
    shards = plan_shards(tensors, world, block)
    assert len(shards) == world
    seen = {name: [0] * numel for name, numel in tensors}
    for pieces in shards:
        for piece in pieces:
            assert piece.start % block == 0 and (piece.stop % block == 0 or piece.stop == tensors[piece.index][1])
            for element in range(piece.start, piece.stop):
                seen[piece.name][element] += 1
    assert all(count == 1 for counts in seen.values() for count in counts)
    # Balanced: each rank within a block (or a small tensor) of the ideal share.
    total = sum(numel for _, numel in tensors)
    for pieces in shards:
        assert abs(sum(p.numel for p in pieces) - total / world) <= 2 * block


def test_fewer_blocks_than_ranks_leaves_some_ranks_empty() -> None:
    shards = plan_shards([("w", 10), ("b", 3)], 4, 1000)
    assert sum(1 for pieces in shards if pieces) <= 2
    assert sorted(p.name for pieces in shards for p in pieces) == ["b", "w"]


def test_a_reader_of_the_committed_copy_holds_off_the_next_begin_not_the_commit(setup, device: Device) -> None:
    """Two ranks' polls find the step complete while a reader (a snapshot's copy, a reply)
    pins the committed copy: the step commits at once, both read the one commit, and the
    reader still sees the step before; the next begin, which writes into that copy, waits
    until the reader lets go."""
    import threading

    admin, nsid, namespace, grads = setup
    for rank in (0, 1):
        admin.begin_shared_step(nsid, 1, 1.0, seq=1, rank=rank, **JOB)
    grads("w", 0, BLOCK_ELEMS + 64)
    grads("b", 0, 64)
    clients = [AdminClient(InProcessTransport(Controller(device))) for _ in range(2)]  # type: ignore[arg-type]
    results: list[object] = []

    def poll(rank: int) -> None:
        try:
            results.append(clients[rank].commit_shared_step(nsid, 1, seq=1, rank=rank, **JOB))
        except DeviceError as exc:
            results.append(exc)

    began = threading.Event()

    def begin() -> None:
        admin.begin_step(nsid, 2, 1.0)
        began.set()

    with namespace.pinned_committed() as (superblock, copy):
        before = bytes(copy.view(0, 4096, np.uint8))
        threads = [threading.Thread(target=poll, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)  # bounded: a commit held off by the pin would hang here
        assert results == [{"step": 1, "committed_step": 1, "skipped": False, "nonfinite_elements": 0}] * 2
        assert superblock.committed_step == 0 and namespace.committed_step == 1
        opener = threading.Thread(target=begin)
        opener.start()
        assert not began.wait(0.3), "step 2 began writing into the copy a reader still holds"
        assert bytes(copy.view(0, 4096, np.uint8)) == before
    assert began.wait(60), "the begin never went on once the reader let go"
    opener.join()
    admin.abort_step(nsid)
