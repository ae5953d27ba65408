"""FSDP2 (fully_shard) models with the cossd optimizer: ranks as real processes on gloo (tests/e2e/fsdp_job.py) through a real mount, the namespace holding the global tensors, against single-process cossd and torch."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from cossd.client import AdminClient
from cossd.harness.reference import MixedPrecisionOptimizer
from cossd.trainer import AdamW

from conftest import Mount
from ranks import bits_equal, finished, mounted_device, spawn_ranks

pytestmark = pytest.mark.mount

JOB = Path(__file__).with_name("fsdp_job.py")
sys.path.insert(0, str(JOB.parent))
import fsdp_job as job  # noqa: E402  (the model, its groups and schedule, shared with the ranks)

JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One device for the module's jobs (each on namespaces of its own), always unmounted."""
    with mounted_device(tmp_path_factory.mktemp("fsdp2"), "FSDP2TEST0001") as mounted:
        yield mounted


def run_job(mount: Mount, out: Path, namespace: str, world: int, last: int, mode: str = "fsdp",
            **options: Any) -> list[int]:
    """Start `world` ranks of fsdp_job.py as torchrun would and wait for them; their exit
    codes (each rank's log in out/logs.txt). Options: dtype, clip, overflow, placement, use_cmb,
    param_gather."""
    config = {"mount": str(mount.mountpoint), "namespace": namespace, "last": last, "out": str(out),
              "mode": mode} | options
    return spawn_ranks(JOB, config, world, out, JOB_TIMEOUT_S)


def model_for(dtype: str) -> job.Net:
    torch.manual_seed(0)
    model = job.Net()
    if dtype == "bf16":
        model.to(torch.bfloat16)
    return model


def single_process(mount: Mount, namespace: str, grads: dict[int, list[torch.Tensor]], last: int,
                   dtype: str = "mixed", clip: float | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], AdamW]:
    """The same model (FP32 params for "mixed", BF16 for "bf16"), groups and schedule in this
    process, stepped by cossd on the given (averaged) gradients: its params and masters."""
    model = model_for(dtype)
    optimizer = AdamW(job.groups_of(model), lr=job.BASE_LR, betas=(0.9, 0.95), mount=mount.mountpoint,
                      namespace=namespace, max_grad_norm=clip)
    params = job.params_of(optimizer)
    try:
        for step in range(1, last + 1):
            for group, base in zip(optimizer.param_groups, (job.BASE_LR, 2 * job.BASE_LR)):
                group["lr"] = base * job.schedule(step)
            for param, grad in zip(params, grads[step]):
                param.grad = grad.clone()
            optimizer.step()
        return [p.detach().clone() for p in params], optimizer.master_weights(), optimizer
    finally:
        optimizer.close()


def statistics(mount: Mount, namespace: str) -> dict[str, Any]:
    with AdminClient(mount.mountpoint) as admin:
        return admin.statistics(admin.nsid(namespace))


def check_rows(ranks: list[dict[str, Any]], world: int) -> None:
    """Each rank's pieces are its Shard(0) rows of every tensor, laid flat: together they
    tile every tensor exactly once (torch.chunk's cut, the last ranks' short or empty)."""
    sizes = {"fc1.weight": (job.HIDDEN, job.INPUTS), "fc2.weight": (job.CLASSES, job.HIDDEN),
             "fc1.bias": (job.HIDDEN, 1), "fc2.bias": (job.CLASSES, 1), "gain": (2, 1)}
    for name, (rows, width) in sizes.items():
        chunk = -(-rows // world)
        for rank, r in enumerate(ranks):
            start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
            mine = [(s, e) for n, s, e in r["result"]["shard"] if n == name]
            assert mine == ([(start * width, stop * width)] if stop > start else []), (name, rank, mine)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world,dtype", [(2, "mixed"), (3, "bf16")])
def test_fsdp2_run_equals_single_process_bit_for_bit(mount: Mount, tmp_path: Path, world: int, dtype: str) -> None:
    """FSDP2 at 2 ranks (FP32 params, BF16 compute, FP32 reduce-scatter) and at 3 (a BF16
    model, one rank's shard of `gain` empty), 20 steps, two param groups, warmup-cosine:
    every rank's local shards and the device's masters equal a single-process cossd run on
    the same averaged gradients, bit for bit."""
    steps, namespace = 20, f"fsdp{world}{dtype}"
    ranks = finished(tmp_path / "job", world, run_job(mount, tmp_path / "job", namespace, world, steps, dtype=dtype))
    assert all(r["result"]["committed_step"] == steps and r["result"]["steps_skipped"] == 0 for r in ranks)
    assert not any("averages the gradients" in w for r in ranks for w in r["result"]["warnings"])
    # Through the CMB on every rank: where two ranks' rows share a device block (fc1.weight's
    # first at 2 ranks), the device assembled it from both ranks' CMB_WRITEs.
    assert all(r["result"]["cmb"] for r in ranks)
    check_rows(ranks, world)
    if world == 3:
        assert not any(name == "gain" for name, _, _ in ranks[2]["result"]["shard"])  # an empty shard
    stats = statistics(mount, namespace)
    assert stats["steps_committed"] == steps and stats["committed_step"] == steps
    params, masters, _ = single_process(mount, f"{namespace}-ref", ranks[0]["grads"], steps, dtype)
    assert bits_equal(ranks[0]["params"], params)
    assert bits_equal(ranks[0]["masters"], masters)
    for rank, r in enumerate(ranks):  # each rank's own rows, as it holds them
        assert bits_equal(r["params"], params)
        for (name, start, stop), local in zip(
                sorted(r["result"]["shard"], key=lambda piece: ["fc1.weight", "fc2.weight", "fc1.bias", "fc2.bias", "gain"].index(piece[0])),
                [t for t in r["local"] if t.numel()]):
            index = ["fc1.weight", "fc2.weight", "fc1.bias", "fc2.bias", "gain"].index(name)
            assert bits_equal([local.reshape(-1)], [params[index].reshape(-1)[start:stop]]), (rank, name)


@pytest.fixture(scope="module")
def more_devices(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Mount]]:
    """Two more devices, for jobs over three (each its own daemon and backing)."""
    root = tmp_path_factory.mktemp("fsdp2-devices")
    with mounted_device(root / "b", "FSDP2TEST0002") as second, mounted_device(root / "c", "FSDP2TEST0003") as third:
        yield [second, third]


@pytest.mark.parametrize("world,devices,dtype", [(2, 2, "mixed"), pytest.param(3, 3, "bf16", marks=pytest.mark.slow),
                                                  pytest.param(1, 2, "mixed", marks=pytest.mark.slow)])
def test_fsdp2_over_several_devices_equals_one_device_bit_for_bit(mount: Mount, more_devices: list[Mount],
                                                                 tmp_path: Path, world: int, devices: int,
                                                                 dtype: str) -> None:
    """FSDP2 at 1, 2 and 3 ranks over 2 and 3 devices (mount=[...]), fc1.weight split across
    devices 0 and 1 by the placement rule: each rank sends, for each device, the part of its
    local shard that falls there (at 2 ranks device 0's piece of fc1.weight holds rows of
    both ranks) and reads those rows back; 8 steps equal single-process cossd on one device,
    params and masters bit for bit."""
    steps, namespace = 8, f"fsdp-group{world}x{devices}{dtype}"
    mounts = [str(device.mountpoint) for device in [mount, *more_devices][:devices]]
    out = tmp_path / "job"
    ranks = finished(out, world, run_job(mount, out, namespace, world, steps, dtype=dtype, mounts=mounts))
    assert all(r["result"]["committed_step"] == steps and r["result"]["steps_skipped"] == 0 for r in ranks)
    assert not any("averages the gradients" in w for r in ranks for w in r["result"]["warnings"])
    # Every element of every device's pieces comes from exactly one rank.
    for device in range(devices):
        sizes: dict[str, int] = {}
        covered: dict[str, list[tuple[int, int]]] = {}
        for r in ranks:
            for name, numel, start, stop in r["result"]["devices"][device]:
                sizes[name] = numel
                covered.setdefault(name, []).append((start, stop))
        for name, spans in covered.items():
            spans.sort()
            assert spans[0][0] == 0 and spans[-1][1] == sizes[name], (device, name, spans)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (device, name, spans)
    if world == 2:
        assert [name for name, _, _, _ in ranks[0]["result"]["devices"][0]] == ["fc1.weight"]
        assert [name for name, _, _, _ in ranks[1]["result"]["devices"][0]] == ["fc1.weight"]
    params, masters, _ = single_process(mount, f"{namespace}-ref", ranks[0]["grads"], steps, dtype)
    for r in ranks:
        assert bits_equal(r["params"], params)
    assert bits_equal(ranks[0]["masters"], masters)


@pytest.mark.parametrize("devices", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_hsdp_equals_one_device_bit_for_bit(mount: Mount, more_devices: list[Mount], tmp_path: Path,
                                            devices: int) -> None:
    """HSDP at 4 ranks (2 replicas x 2 shards, a 2-D mesh), on one device and over two
    (fc1.weight split across them): replica 0's ranks send their rows, replica 1's hold the
    same rows and send nothing, every rank reads its own rows back; 6 steps equal
    single-process cossd on the same averaged gradients, params and masters bit for bit."""
    steps, namespace = 6, f"hsdp{devices}"
    mounts = [str(device.mountpoint) for device in [mount, *more_devices][:devices]]
    out = tmp_path / "job"
    ranks = finished(out, 4, run_job(mount, out, namespace, 4, steps, hsdp=[2, 2],
                                     **({"mounts": mounts} if devices > 1 else {})))
    assert all(r["result"]["committed_step"] == steps and r["result"]["steps_skipped"] == 0 for r in ranks)
    if devices == 1:
        assert ranks[2]["result"]["shard"] == [] and ranks[3]["result"]["shard"] == []  # replica 1 sends nothing
        check_rows(ranks[:2], 2)  # replica 0's ranks send Shard(0) rows over the shard dim
    params, masters, _ = single_process(mount, f"{namespace}-ref", ranks[0]["grads"], steps)
    for r in ranks:
        assert bits_equal(r["params"], params)
    assert bits_equal(ranks[0]["masters"], masters)


@pytest.mark.parametrize("mode,gather,devices", [("fsdp", "device", 1), ("ddp", "allgather", 1), ("fsdp", "device", 2)])
def test_weights_loaded_before_the_first_step_become_the_masters_at_two_ranks(
        mount: Mount, more_devices: list[Mount], tmp_path: Path, mode: str, gather: str, devices: int) -> None:
    """2 ranks: params written outside the optimizer after it was made, before the first
    step (torchtitan's seed checkpoint, Hugging Face weights loaded into an FSDP2 model),
    become the masters once every rank agrees: each rank writes its own rows (FSDP2, on one
    device and over two) or its shard (DDP with param_gather="allgather", whose read-back is
    a collective), and the job ends bit for bit where one that loaded them before making the
    optimizer ends (params and masters)."""
    mounts = {"mounts": [str(device.mountpoint) for device in [mount, *more_devices][:devices]]} if devices > 1 else {}
    held = {}
    for name, options in (("adopted", {"load": {"step": 1, "ranks": [0, 1]}}), ("preloaded", {"preload": 0.01})):
        out = tmp_path / name
        ranks = finished(out, 2, run_job(mount, out, f"first-{mode}-{gather}-{devices}-{name}", 2, 3, mode=mode,
                                         param_gather=gather, **mounts, **options))
        assert all(r["result"]["committed_step"] == 3 for r in ranks)
        held[name] = ranks
    for adopted, preloaded in zip(held["adopted"], held["preloaded"]):
        assert bits_equal(adopted["params"], preloaded["params"])
    assert bits_equal(held["adopted"][0]["masters"], held["preloaded"][0]["masters"])


def test_a_read_failing_on_one_rank_inside_the_allgather_fails_every_rank_at_once(mount: Mount,
                                                                                  tmp_path: Path) -> None:
    """DDP with param_gather="allgather", weights loaded on both ranks before the first step:
    the first step's check reads the device's params through the all-gather, and rank 1's
    read of its shard fails. Rank 1 still takes part in the all-gather, flagged, so rank 0 is
    not left waiting in it (before, until the backend's timeout): every rank's step() raises
    at once, naming rank 1's error, and nothing is committed."""
    out = tmp_path / "job"
    codes = run_job(mount, out, "allgather-read-fails", 2, 3, mode="ddp", param_gather="allgather",
                    load={"step": 1, "ranks": [0, 1]}, fail_read={"rank": 1, "step": 1})
    assert codes == [7, 7], (codes, (out / "logs.txt").read_text()[-3000:])
    for rank in range(2):
        text = (out / f"error{rank}.txt").read_text()
        assert "checking the params written outside the optimizer before the first step failed" in text, text
        assert "rank 1: OSError" in text and "injected: the params' read failed" in text, text
        assert (out / f"committed{rank}.txt").read_text() == "0"
        assert "rank 0:" not in text, text  # rank 0 failed only because rank 1 did: not listed
    with AdminClient(mount.mountpoint) as admin:
        assert int(admin.statistics(admin.nsid("allgather-read-fails"))["committed_step"]) == 0


def test_an_interrupt_on_one_rank_inside_the_allgather_read_fails_the_others_at_once(mount: Mount,
                                                                                    tmp_path: Path) -> None:
    """As above, but rank 1 is interrupted (Ctrl-C) in its read of its shard: it still takes
    part in the all-gather and the exchange of why, then raises its KeyboardInterrupt; rank 0
    raises at once, naming rank 1's interrupt (before, rank 1 left the collective unmatched
    and rank 0 waited in it), and nothing is committed."""
    out = tmp_path / "job"
    codes = run_job(mount, out, "allgather-read-interrupted", 2, 3, mode="ddp", param_gather="allgather",
                    load={"step": 1, "ranks": [0, 1]}, fail_read={"rank": 1, "step": 1, "interrupt": True})
    assert codes == [7, 8], (codes, (out / "logs.txt").read_text()[-3000:])
    text = (out / "error0.txt").read_text()
    assert "checking the params written outside the optimizer before the first step failed" in text, text
    assert "rank 1: KeyboardInterrupt" in text and "rank 0:" not in text, text
    assert (out / "error1.txt").read_text() == "KeyboardInterrupt"
    with AdminClient(mount.mountpoint) as admin:
        assert int(admin.statistics(admin.nsid("allgather-read-interrupted"))["committed_step"]) == 0


@pytest.mark.parametrize("loaders", [[2, 3], pytest.param([0, 1, 2, 3], marks=pytest.mark.slow)])
def test_weights_loaded_before_the_first_step_under_hsdp(mount: Mount, tmp_path: Path, loaders: list[int]) -> None:
    """HSDP at 4 ranks (2 replicas x 2 shards): replica 0's ranks write the masters. Weights
    loaded by every rank become them (bit for bit as loaded before making the optimizer);
    loaded by replica 1's ranks only, the replicas of a shard disagree, so every rank's
    step() refuses, and nothing is committed (replica 1's load was silently dropped)."""
    name = "hsdp-first-" + "".join(map(str, loaders))
    out = tmp_path / "job"
    codes = run_job(mount, out, name, 4, 3, hsdp=[2, 2], load={"step": 1, "ranks": loaders})
    if len(loaders) < 4:
        assert codes == [7] * 4, (codes, (out / "logs.txt").read_text()[-3000:])
        for rank in range(4):
            text = (out / f"error{rank}.txt").read_text()
            assert "ranks that hold the same elements hold different values (ranks 0, 2; 1, 3)" in text, text
        with AdminClient(mount.mountpoint) as admin:
            assert int(admin.statistics(admin.nsid(name))["committed_step"]) == 0
        return
    adopted = finished(out, 4, codes)
    preloaded = finished(tmp_path / "pre", 4, run_job(mount, tmp_path / "pre", name + "-pre", 4, 3, hsdp=[2, 2],
                                                      preload=0.01))
    for a, b in zip(adopted, preloaded):
        assert bits_equal(a["params"], b["params"])
    assert bits_equal(adopted[0]["masters"], preloaded[0]["masters"])


def test_fsdp2_resumes_at_another_world_size_and_in_one_process(mount: Mount, tmp_path: Path) -> None:
    """An FSDP2 job saved at 2 ranks resumes at 3 (each rank loading nothing, reading only
    its rows), then in one process without torch.distributed: the same namespace of global
    tensors, ending bit for bit where one process stepping all the recorded gradients ends."""
    grads: dict[int, list[torch.Tensor]] = {}
    last = 0
    for index, (world, mode, until) in enumerate(((2, "fsdp", 6), (3, "fsdp", 12), (1, "ddp", 16))):
        out = tmp_path / f"phase{index}"
        ranks = finished(out, world, run_job(mount, out, "fsdp-resumed", world, until, mode=mode))
        for r in ranks:
            assert r["result"]["first"] == last + 1 and r["result"]["committed_step"] == until
            assert r["result"]["restored"] == (last > 0)
        grads |= ranks[0]["grads"]
        last = until
    params, masters, _ = single_process(mount, "fsdp-resumed-ref", grads, last)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)


def test_fsdp2_resumes_a_ddp_job(mount: Mount, tmp_path: Path) -> None:
    """A ZeRO-1 job under DDP (FP32 params) for 6 steps at 2 ranks, then FSDP2 at 2 ranks on
    its namespace for 6 more: bit for bit one process on the same averaged gradients."""
    grads: dict[int, list[torch.Tensor]] = {}
    for index, (mode, until) in enumerate((("ddp", 6), ("fsdp", 12))):
        out = tmp_path / f"phase{index}"
        ranks = finished(out, 2, run_job(mount, out, "ddp-then-fsdp", 2, until, mode=mode))
        grads |= ranks[0]["grads"]
    assert ranks[0]["result"]["first"] == 7 and ranks[0]["result"]["restored"]
    params, masters, _ = single_process(mount, "ddp-then-fsdp-ref", grads, 12)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)


def test_fsdp2_clipping_by_the_global_norm(mount: Mount, tmp_path: Path) -> None:
    """Clipping over the local shards (one gather of the ranks' squared sums): the norm is
    summed in another order than one process sums it, so the clip coefficient may differ in
    its last bits; within 1e-6 x max|param| of single-process cossd and of torch's fused
    AdamW with clip_grad_norm_, and the norm each rank saw equals the one-process norm to 1e-5."""
    world, steps, clip = 3, 20, 0.05
    ranks = finished(tmp_path / "job", world, run_job(mount, tmp_path / "job", "fsdp-clip3", world, steps, clip=clip))
    grads = ranks[0]["grads"]
    _, cossd_masters, optimizer = single_process(mount, "fsdp-clip3-ref", grads, steps, clip=clip)
    assert optimizer.last_grad_norm is not None and optimizer.last_grad_norm > clip  # it clipped
    for r in ranks:
        assert r["result"]["norms"] == ranks[0]["result"]["norms"]  # every rank the same coefficient
    assert abs(ranks[0]["result"]["norms"][-1] - optimizer.last_grad_norm) <= 1e-5 * optimizer.last_grad_norm
    torch.manual_seed(0)
    model = job.Net()
    reference = MixedPrecisionOptimizer(job.groups_of(model), torch.optim.AdamW, fused=True, lr=job.BASE_LR,
                                        betas=(0.9, 0.95))
    for step in range(1, steps + 1):
        for group, base in zip(reference.param_groups, (job.BASE_LR, 2 * job.BASE_LR)):
            group["lr"] = base * job.schedule(step)
        for param, grad in zip(reference.model_params, grads[step]):
            # The device steps on the BF16 wire gradients: so does the reference.
            param.grad = grad.to(torch.bfloat16).float()
        reference.step(max_grad_norm=clip)
    mine = ranks[0]["masters"]
    scale = max(float(m.abs().max()) for m in mine)
    for name, theirs in (("single-process cossd", cossd_masters),
                         ("torch fused AdamW", [m.detach() for m in reference.masters])):
        worst = max(float((a - b).abs().max()) for a, b in zip(mine, theirs))
        assert worst <= 1e-6 * scale, f"{name}: {worst} > 1e-6 x {scale}"


def test_fsdp2_overflow_on_one_rank_skips_the_step_on_all(mount: Mount, tmp_path: Path) -> None:
    """An inf in one rank's local gradient shard: the device skips the step for every rank,
    counted once, and the run goes on as one process skipping the same step."""
    world, steps = 2, 6
    ranks = finished(tmp_path / "job", world, run_job(mount, tmp_path / "job", "fsdp-overflow", world, steps,
                                                      overflow={"rank": 1, "step": 3}))
    for r in ranks:
        assert r["result"]["committed_step"] == steps - 1 and r["result"]["steps_skipped"] == 1
    stats = statistics(mount, "fsdp-overflow")
    assert stats["steps_skipped"] == 1 and stats["last_skipped_step"] == 3
    params, masters, optimizer = single_process(mount, "fsdp-overflow-ref", ranks[0]["grads"], steps)
    assert optimizer.steps_skipped == 1
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)


def test_fsdp2_without_the_cmb(mount: Mount, tmp_path: Path) -> None:
    """Through the tensor files (use_cmb=False): masters written and params read at each
    rank's offsets by positional I/O; bit for bit as one process."""
    world, steps = 2, 5
    ranks = finished(tmp_path / "job", world, run_job(mount, tmp_path / "job", "fsdp-files", world, steps,
                                                      use_cmb=False))
    assert not any(r["result"]["cmb"] for r in ranks)
    params, masters, _ = single_process(mount, "fsdp-files-ref", ranks[0]["grads"], steps)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)


def test_fsdp2_unsupported_placement_is_refused_naming_the_param(mount: Mount, tmp_path: Path) -> None:
    """Matrices placed as Shard(1) (fully_shard's shard_placement_fn): every rank fails at
    construction, naming the param and its placement, and nothing is created."""
    out = tmp_path / "job"
    codes = run_job(mount, out, "fsdp-shard1", 2, 2, placement="shard1")
    assert codes == [4, 4], (codes, (out / "logs.txt").read_text()[-4000:])
    for rank in range(2):
        message = (out / f"error{rank}.txt").read_text()
        assert "fc1.weight" in message and "Shard(dim=1)" in message and "Shard(0)" in message, message
    with AdminClient(mount.mountpoint) as admin:
        assert "fsdp-shard1" not in [entry["name"] for entry in admin.describe()["namespaces"]]


def test_fsdp2_through_a_storage_server(mount: Mount, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks of a node without a mount, FSDP2 at 3 ranks through `cossd serve`: each
    rank's masters written and params read at its offsets by the server's batched WRITE and
    READ; bit for bit as one process stepping the same gradients on a mount."""
    import dataclasses

    from cossd.emulator import Device
    from test_server import start_server

    token = tmp_path / "token"
    token.write_text("fsdp2-test-token-0123456789abcdef0123\n")
    token.chmod(0o600)
    Device.format(tmp_path / "srv", capacity_bytes=4 << 30, serial="FSDP2SERVER01")
    served = start_server(tmp_path / "srv", ["--listen", "127.0.0.1:0", "--token-file", str(token)])
    monkeypatch.setenv("COSSD_TOKEN_FILE", str(token))

    @dataclasses.dataclass
    class At:
        mountpoint: str

    try:
        world, steps = 3, 5
        ranks = finished(tmp_path / "job", world, run_job(At(served.url), tmp_path / "job", "fsdp-remote", world,  # type: ignore[arg-type]
                                                          steps))
    finally:
        served.stop()
    params, masters, _ = single_process(mount, "fsdp-remote-ref", ranks[0]["grads"], steps)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)


class _FakeMesh:
    def __init__(self, members: list[int], coordinate: int, ndim: int = 1) -> None:
        self.members, self.coordinate, self.ndim = members, coordinate, ndim

    def get_group(self) -> list[int]:
        return self.members

    def get_local_rank(self) -> int:
        return self.coordinate


class _FakeDTensor:
    """What fsdp.local_pieces reads of a DTensor (its placements, mesh, global and local
    shapes), for the cases a real job cannot easily make on one machine."""

    def __init__(self, shape: tuple[int, ...], local_rows: int, mesh: _FakeMesh, placements: tuple[Any, ...]) -> None:
        self.shape, self.device_mesh, self.placements = torch.Size(shape), mesh, placements
        self._local = torch.zeros(local_rows, *shape[1:])

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return self.shape.numel()

    def to_local(self) -> torch.Tensor:
        return self._local


def test_fsdp2_layouts_it_refuses_name_the_param(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a job: a mesh of other ranks than the optimizer's group, a local shard that
    is not torch.chunk's cut, and a plain param beside DTensors are each a ValueError naming
    the param; Shard(0) of 5 rows over 3 ranks gives rows 2, 2, 1 (and 2 rows an empty
    third shard)."""
    from torch.distributed.tensor import Shard

    from cossd.trainer import fsdp
    from cossd.trainer.distributed import Ranks
    from cossd.trainer.plan import Entry

    monkeypatch.setattr(fsdp.dist, "get_process_group_ranks", lambda group: group)
    monkeypatch.setattr(fsdp.dist, "group", type("G", (), {"WORLD": [0, 1, 2]}))
    world = Ranks(1, 3, None)

    def entry(param: Any, name: str = "w") -> Entry:
        return Entry(0, name, 0, param)  # type: ignore[arg-type]

    good = _FakeDTensor((5, 4), 2, _FakeMesh([0, 1, 2], 1), (Shard(0),))
    assert [(p.start, p.stop) for p in fsdp.local_pieces([entry(good)], world)] == [(8, 16)]
    last = _FakeDTensor((2, 4), 0, _FakeMesh([0, 1, 2], 2), (Shard(0),))
    assert fsdp.local_pieces([entry(last)], Ranks(2, 3, None)) == []
    other_mesh = _FakeDTensor((5, 4), 2, _FakeMesh([0, 1], 1), (Shard(0),))
    with pytest.raises(ValueError, match=r"param blocks\.0: its DTensor mesh spans global ranks \[0, 1\]"):
        fsdp.local_pieces([entry(other_mesh, "blocks.0")], world)
    uneven = _FakeDTensor((5, 4), 3, _FakeMesh([0, 1, 2], 1), (Shard(0),))
    with pytest.raises(ValueError, match=r"param head: local shard of shape \(3, 4\) on rank 1"):
        fsdp.local_pieces([entry(uneven, "head")], world)
    monkeypatch.setattr(fsdp, "is_dtensor", lambda tensor: isinstance(tensor, _FakeDTensor))
    with pytest.raises(ValueError, match="param bias is a plain tensor while w is an FSDP2 DTensor"):
        fsdp.uses_fsdp([entry(good, "w"), entry(torch.zeros(3), "bias")])


def test_fsdp2_a_rank_that_cannot_load_its_masters_fails_every_rank(mount: Mount, tmp_path: Path) -> None:
    """Rank 1's write of its masters' rows fails: every rank fails at construction with its
    reason (none goes on to a step, which would seal a half-loaded namespace), the device
    stays loading at step 0, and the job started again loads every rank's rows and trains
    bit for bit as one process."""
    out = tmp_path / "failed"
    codes = run_job(mount, out, "fsdp-loadfail", 2, 3, fail_masters_rank=1)
    assert codes == [4, 4], (codes, (out / "logs.txt").read_text()[-4000:])
    for rank in range(2):
        message = (out / f"error{rank}.txt").read_text()
        assert "loading the master weights of namespace 'fsdp-loadfail' failed: rank 1: OSError" in message and "injected" in message, message
    stats = statistics(mount, "fsdp-loadfail")
    assert stats["loading"] and stats["committed_step"] == 0
    again = tmp_path / "again"
    ranks = finished(again, 2, run_job(mount, again, "fsdp-loadfail", 2, 4))
    assert all(r["result"]["first"] == 1 and not r["result"]["restored"] for r in ranks)
    params, masters, _ = single_process(mount, "fsdp-loadfail-ref", ranks[0]["grads"], 4)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)


def test_fsdp2_on_a_one_member_mesh_trains_as_one_process(mount: Mount, tmp_path: Path) -> None:
    """fully_shard over a process group of one (torchtitan at one rank): each DTensor's local
    shard is the whole tensor, and the optimizer takes it as such (gradients out, params back
    in place): 6 steps equal single-process cossd on plain params bit for bit, and the job
    resumes from the device (a second run of 3 more steps)."""
    out = tmp_path / "job"
    ranks = finished(out, 1, run_job(mount, out, "fsdp-one", 1, 6))
    result = ranks[0]["result"]
    assert result["committed_step"] == 6 and result["steps_skipped"] == 0 and result["first"] == 1
    check_rows(ranks, 1)  # one piece per tensor, the whole of it
    params, masters, _ = single_process(mount, "fsdp-one-ref", ranks[0]["grads"], 6)
    assert bits_equal(ranks[0]["params"], params) and bits_equal(ranks[0]["masters"], masters)
    assert bits_equal([t.reshape(-1) for t in ranks[0]["local"]], [p.reshape(-1) for p in params])
    again = tmp_path / "again"
    resumed = finished(again, 1, run_job(mount, again, "fsdp-one", 1, 9))[0]
    assert resumed["result"]["first"] == 7 and resumed["result"]["restored"]
    assert statistics(mount, "fsdp-one")["committed_step"] == 9
    grads = ranks[0]["grads"] | resumed["grads"]
    params, masters, _ = single_process(mount, "fsdp-one-ref9", grads, 9)
    assert bits_equal(resumed["params"], params) and bits_equal(resumed["masters"], masters)
