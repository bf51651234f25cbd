"""Calibration: fit_link recovers synthetic links; a real 2-process calibration yields a usable spec."""

from __future__ import annotations

import json
import math
import random

import pytest
from fake_clock import FakeClock
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cli import main
from autopar.cluster import ClusterSpec, DeviceKind, LinkSpec
from autopar.cost_model.comm import Collective, collective_time
from autopar.tools.calibrate import (
    Sample,
    calibrate,
    fit_errors,
    fit_link,
    fit_ranges,
    predict_time,
    ring_coefficients,
    trimmed_mean,
)

SIZES = [4 * 4**k for k in range(15)]  # 4 B .. 1 GiB


def _synthetic(bw: float, lat: float, kinds, seed: int, noise: float = 0.02) -> list[Sample]:
    rng = random.Random(seed)
    link = LinkSpec(bandwidth=bw, latency=lat)
    out = []
    for kind in kinds:
        for n in (2, 4, 8):
            for b in SIZES:
                t = collective_time(Collective(kind), b, n, link) * (1 + rng.uniform(-noise, noise))
                out.append(Sample(kind=kind, nbytes=b, n=n, seconds=t))
    return out


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"])
def test_ring_coefficients_match_comm_model(kind):
    link = LinkSpec(bandwidth=3e9, latency=7e-6)
    for n in (2, 3, 8):
        s = Sample(kind=kind, nbytes=12345, n=n, seconds=1.0)
        assert predict_time(s, link) == pytest.approx(collective_time(Collective(kind), 12345, n, link))
    f, g = ring_coefficients(kind, 4)
    assert f > 0 and g > 0


@settings(max_examples=40, deadline=None)
@given(
    log_bw=st.floats(math.log10(1e8), math.log10(1e11)),
    log_lat=st.floats(math.log10(1e-6), math.log10(1e-3)),
    seed=st.integers(0, 2**16),
)
def test_fit_link_recovers_bandwidth_and_latency(log_bw, log_lat, seed):
    bw, lat = 10**log_bw, 10**log_lat
    samples = _synthetic(bw, lat, ["all_reduce", "all_gather"], seed)
    for kind in (None, "all_reduce", "all_gather"):
        link = fit_link(samples, kind)
        assert link.bandwidth == pytest.approx(bw, rel=0.1)
        assert link.latency == pytest.approx(lat, rel=0.1)
    errs = fit_errors(samples, fit_link(samples))
    assert max(abs(e) for e in errs) < 0.1


@settings(max_examples=30, deadline=None)
@given(
    small=st.tuples(st.floats(8, 10), st.floats(-6, -4)),  # log10 of (bandwidth, latency)
    large=st.tuples(st.floats(8, 10), st.floats(-4, -2)),
    cut=st.integers(3, 10),
    seed=st.integers(0, 2**16),
)
def test_fit_ranges_follows_a_transport_that_changes_regime(small, large, cut, seed):
    """Samples from two links (one below a size, another above): the ranges recover each and predict
    every sample within noise, but the one whose range straddles the change."""
    links = [LinkSpec(10 ** small[0], 10 ** small[1]), LinkSpec(10 ** large[0], 10 ** large[1])]
    rng = random.Random(seed)
    samples = []
    for kind in ("all_reduce", "all_gather"):
        for k, b in enumerate(SIZES):
            link = links[k >= cut]
            t = collective_time(Collective(kind), b, 4, link) * (1 + rng.uniform(-0.01, 0.01))
            samples.append(Sample(kind=kind, nbytes=b, n=4, seconds=t))
    ranged = LinkSpec(1e9, 1e-5, ranges=fit_ranges(samples))
    assert [r[1] for r in ranged.ranges if r[0] == "all_reduce"] == SIZES[1:]
    for k, b in enumerate(SIZES[1:], start=1):
        if k not in (cut,):  # the range straddling the change mixes both links
            truth = links[k >= cut]
            assert predict_time(Sample("all_reduce", b, 4, 1.0), ranged) == pytest.approx(
                collective_time(Collective.ALL_REDUCE, b, 4, truth), rel=0.05
            )
    errs = [e for smp, e in zip(samples, fit_errors(samples, ranged)) if smp.nbytes != SIZES[cut]]
    assert max(abs(e) for e in errs) < 0.05


def test_link_ranges_price_by_size_and_round_trip():
    ag = "all_gather"
    link = LinkSpec(
        1e9, 1e-3, ranges=((ag, 1024, 5e8, 1e-5), (ag, 2**20, 1e9, 1e-4), ("all_reduce", 64, 1e8, 1e-2))
    )
    assert link.at(10, ag) == (5e8, 1e-5) and link.at(1024, ag) == (5e8, 1e-5)
    assert link.at(4096, ag) == (1e9, 1e-4) and link.at(2**30, ag) == (1e9, 1e-4)  # past the last: the last
    assert link.at(10, "send_recv") == (1e9, 1e-3)  # no ranges of its own: the link's figures
    assert collective_time(Collective.ALL_GATHER, 512, 2, link) == pytest.approx(0.5 * 512 / 5e8 + 1e-5)
    assert collective_time(Collective.ALL_REDUCE, 512, 2, link) == pytest.approx(512 / 1e8 + 2e-2)
    cluster = ClusterSpec.preset("cpu").with_overrides(intra_node=link)
    assert ClusterSpec.from_dict(json.loads(json.dumps(cluster.to_dict()))) == cluster
    with pytest.raises(Exception, match="ascend"):
        LinkSpec(1e9, 1e-3, ranges=((ag, 2048, 1e9, 1e-5), (ag, 1024, 1e9, 1e-5)))


@given(
    fast=st.floats(1e-4, 1e-3), stall=st.floats(2e-3, 5e-3), stalls=st.integers(2, 8), seed=st.integers(0, 99)
)  # fmt: skip
def test_sample_time_keeps_the_stalls_a_step_pays(fast, stall, stalls, seed):
    """A collective that stalls in a few calls of 40 (a scheduler tick on a busy VM) is priced at
    its expected time: the stalls stay in, only the single most extreme call on each side goes."""
    calls = [fast] * (40 - stalls) + [fast + stall] * stalls
    random.Random(seed).shuffle(calls)
    expected = sum(sorted(calls)[1:-1]) / 38
    assert trimmed_mean(calls) == pytest.approx(expected)
    assert trimmed_mean(calls) >= fast + stall * (stalls - 1) / 38 * 0.999


def test_fit_link_clamps_to_positive():
    # pure latency: no bandwidth term -> bandwidth clamped, finite and positive
    samples = [Sample("all_reduce", b, 2, 1e-4) for b in (8, 1024, 65536)]
    link = fit_link(samples)
    assert 0 < link.bandwidth < math.inf and link.latency == pytest.approx(5e-5, rel=0.05)
    # pure bandwidth: latency clamped to a small positive number
    samples = [Sample("all_gather", b, 2, b / 2 / 1e9) for b in (1024, 65536, 2**20)]
    link = fit_link(samples)
    assert link.bandwidth == pytest.approx(1e9, rel=1e-6) and 0 < link.latency <= 1e-8
    with pytest.raises(ValueError):
        fit_link([], None)


def _positive_finite(link: LinkSpec) -> bool:
    return 0 < link.bandwidth < math.inf and 0 < link.latency < math.inf


@pytest.mark.slow
def test_quick_calibration_on_two_processes_and_cli(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    spec = calibrate(2, out_path=path, sizes_bytes=(2**10, 2**16, 2**19), repeats=3, quick=True)
    assert spec.world_size == 2 and spec.nodes == 1
    assert _positive_finite(spec.intra_node) and spec.inter_node == spec.intra_node
    dev = spec.device
    assert all(0 < v < math.inf for v in (dev.peak_flops_for("float32"), dev.memory_bandwidth))
    assert 0 < dev.kernel_launch_s < math.inf
    assert 0.0 <= dev.comm_overlap <= 1.0
    assert dev.kind is DeviceKind.CPU  # measured on gloo ranks
    assert 0.0 <= dev.contention.sync_wait < math.inf and 0 < dev.step_overhead_s < math.inf
    # each kind a step synchronizes with; gloo's reduce-scatter is an all-reduce
    waits = dict(dev.contention.sync_wait_kinds)
    assert set(waits) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert waits["reduce_scatter"] == waits["all_reduce"] and dev.contention.sync_wait == max(waits.values())
    assert set(dict(dev.optimizer_param_s)) == {"SGD", "SGD_MOMENTUM", "ADAM"}
    assert ClusterSpec.from_file(path) == spec

    cli_path = tmp_path / "cli_cluster.json"
    assert main(["calibrate", "--world-size", "2", "--out", str(cli_path), "--quick"]) == 0
    printed = capsys.readouterr().out
    assert "bandwidth" in printed and "rel.err" in printed and f"wrote {cli_path}" in printed
    assert "comm_overlap" in printed and "sync_wait" in printed and "per parameter tensor" in printed
    loaded = ClusterSpec.from_file(cli_path)
    assert _positive_finite(loaded.intra_node) and json.loads(cli_path.read_text())["devices_per_node"] == 2
    # the file is what `autopar plan --cluster FILE` takes
    assert ClusterSpec.parse(str(cli_path)) == loaded


@pytest.mark.slow
def test_overlap_efficiency_follows_from_the_three_times_alike_on_every_rank():
    """``measure_overlap`` on 2 ranks: positive times (each the slowest rank's, so the same on
    every rank) and the efficiency that follows from them, clamped to [0, 1]. Whether the times
    are physical (both at once between the longer alone and both in a row) is a real timing:
    benchmarks/bench_timing_checks.py."""
    from autopar.launch import run_on_ranks

    res = run_on_ranks(_overlap_rank, 2)
    assert res[0] == res[1]
    for r in res:
        assert min(r["t_compute"], r["t_comm"], r["t_both"]) > 0 and r["nbytes"] == 2**22
        eff = (r["t_compute"] + r["t_comm"] - r["t_both"]) / min(r["t_compute"], r["t_comm"])
        assert r["efficiency"] == pytest.approx(min(1.0, max(0.0, eff)))


def _overlap_rank(rank, world):
    from autopar.tools.overlap import measure_overlap

    # 4 MiB: a few ms each way, so that a stalled run (one 3-4 ms scheduler tick) is not most of it;
    # the 10% trim drops one stalled run each side
    return measure_overlap(nbytes=2**22, repeats=10)


def test_the_graph_launch_counts_what_the_cost_model_charges():
    """``measure_graph_launch`` divides a step of ``_OpMix``'s traced graph by the launches the
    cost model charges that graph: planned on one device, the predicted compute grows by exactly
    that many times a change of ``kernel_launch_s``."""
    import dataclasses

    import torch

    import autopar
    from autopar.tools.calibrate_compute import _OpMix, measure_graph_launch

    launch, launches = measure_graph_launch(torch.device("cpu"), repeats=1, step_overhead=0.0)
    assert launch > 0 and launches > 30
    torch.manual_seed(0)
    model = _OpMix()
    inputs = (torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))
    base = ClusterSpec.preset("cpu", devices_per_node=1)
    compute = []
    for per_op in (1e-3, 2e-3):
        # the optimizer's per-tensor cost measured (else it falls back to one launch per tensor)
        dev = dataclasses.replace(base.device, kernel_launch_s=per_op, optimizer_param_s={"SGD": 1e-6})
        plan = autopar.plan(model, base.with_overrides(device=dev), inputs, optimizer=autopar.Optimizer.SGD)
        compute.append(plan.predicted.compute_s)
    assert compute[1] - compute[0] == pytest.approx(1e-3 * launches * base.compute_slowdown)


def test_lockstep_times_the_agreed_count_and_keeps_calling_until_every_rank_is_done(monkeypatch):
    """``_inner_for`` and ``median_time`` on a clock that moves 2**-13 s per call, in lockstep with
    stand-in ranks that agree on 25 calls per sample and whose samples end four polls after this
    rank's: the count offered is this rank's own (a sample of about ``target_s``), the count used
    the agreed one; one untimed call, the barrier, the timed samples, then the op again until the
    poll says every rank is done; the figure is the time per call."""
    import torch

    from autopar.tools import calibrate_compute as cc

    clock = FakeClock()
    monkeypatch.setattr(cc, "time", clock.module())
    per_call = 2.0**-13
    events: list = []
    polls = [0]

    def op() -> None:
        events.append("op")
        clock.advance(per_call)

    def agree(n: int) -> int:
        events.append(("agree", n))
        return 25

    def finished():
        events.append("finished")

        def done() -> bool:
            polls[0] += 1
            return polls[0] > 4

        return done

    cpu = torch.device("cpu")
    ranks = cc.Lockstep(barrier=lambda: events.append("barrier"), agree=agree, finished=finished)
    with cc.lockstep(ranks):
        inner = cc._inner_for(op, cpu, target_s=2e-3)
        t = cc.median_time(op, cpu, repeats=3, inner=inner)
    (own,) = [e[1] for e in events if isinstance(e, tuple)]
    assert own * per_call <= 2e-3 < (own + 1) * per_call  # a sample of about target_s
    assert inner == 25 and t == pytest.approx(per_call, rel=1e-12)
    assert events == ["op", ("agree", own), "op", "barrier"] + ["op"] * 75 + ["finished"] + ["op"] * 4
    # outside lockstep: no barrier, no agreement, no calls after the samples
    events.clear()
    assert cc._inner_for(op, cpu, target_s=2e-3) == own
    assert cc.median_time(op, cpu, repeats=2, inner=3) == pytest.approx(per_call, rel=1e-12)
    assert events == ["op"] * (1 + 1 + 2 * 3)


@pytest.mark.slow
def test_in_lockstep_a_fast_rank_calls_its_op_while_a_slow_rank_times_its_samples():
    """Two ranks in ``group_lockstep``, each on its own clock, rank 0's op 10x slower: both loop
    the larger of their counts, each figure is its own op's time per call, and rank 0's last timed
    call returns only once rank 1, its samples over, has called its op again (a barrier of a side
    group between the two calls: without lockstep's calls after the samples, the run hangs and
    run_on_ranks fails it)."""
    from autopar.launch import run_on_ranks

    (own0, agreed0, t0, extra0), (own1, agreed1, t1, extra1) = run_on_ranks(_lockstep_rank, 2, timeout_s=120)
    assert own0 < own1 and agreed0 == agreed1 == own1
    assert t0 == pytest.approx(2.0**-10, rel=1e-12) and t1 == pytest.approx(2.0**-13, rel=1e-12)
    assert extra1 >= 1  # the fast rank went on calling its op after its samples


def _lockstep_rank(rank, world):
    import torch
    import torch.distributed as dist

    from autopar.tools import calibrate_compute as cc
    from autopar.tools.calibrate import group_lockstep

    clock = FakeClock()
    cc.time = clock.module()  # this spawned process's own: nothing else reads it
    side = dist.new_group([0, 1])
    cpu = torch.device("cpu")
    per_call = 2.0**-10 if rank == 0 else 2.0**-13
    calls = [0]
    meet = [0]  # the call that waits for the other rank's: rank 0's last timed, rank 1's first after

    def op() -> None:
        calls[0] += 1
        clock.advance(per_call)
        if calls[0] == meet[0]:
            dist.barrier(group=side)

    own = cc._inner_for(op, cpu)
    calls[0] = 0
    repeats = 3
    with cc.lockstep(group_lockstep(None, cpu)):
        agreed = cc._inner_for(op, cpu)
        # calls: _inner_for's, median_time's untimed one, then repeats x agreed timed ones
        timed_end = 2 + repeats * agreed
        meet[0] = timed_end if rank == 0 else timed_end + 1
        t = cc.median_time(op, cpu, repeats=repeats, inner=agreed)
    return own, agreed, t, calls[0] - timed_end


@given(st.sampled_from([2, 3, 4, 6, 8, 12, 16]), st.data())
@settings(max_examples=40, deadline=None)
def test_group_layouts_are_the_groups_of_every_mesh_axis(world, data):
    """For any mesh of ``world`` ranks laid out row-major (as codegen's ``init_device_mesh``), each
    axis's groups are ``group_ranks`` of its size and stride, a layout of ``group_layouts`` unless
    the axis spans the whole world in one group."""
    import torch

    from autopar.passes.solver import mesh_candidates
    from autopar.tools.calibrate import group_layouts, group_ranks

    meshes = [m for k in (1, 2, 3) for m in mesh_candidates(world, k, world)]
    mesh = data.draw(st.sampled_from(meshes))
    ranks = torch.arange(world).reshape(mesh)
    layouts = group_layouts(world)
    assert len(set(layouts)) == len(layouts) and (world, 1) not in layouts
    for a, n in enumerate(mesh):
        if n == 1:
            continue
        stride = math.prod(mesh[a + 1 :])
        groups = sorted(ranks.movedim(a, -1).reshape(-1, n).tolist())
        assert sorted(group_ranks(world, n, stride)) == groups
        assert ((n, stride) in layouts) == ((n, stride) != (world, 1))


def _group_samples_rank(rank: int, world: int):
    from autopar.tools.calibrate import measure_group_collectives

    return measure_group_collectives((2**10, 2**16), ("all_reduce", "all_gather"), repeats=3)


@pytest.mark.slow
def test_group_collectives_are_measured_per_layout_alike_on_every_rank():
    """On 4 ranks: pairs of neighbours and pairs two apart, each collective and size, the same
    (slowest group's) figures on every rank, and a link fitted to them prices each axis of a 2 x 2
    mesh with its own layout's fit."""
    from autopar.cost_model.comm import CommModel, group_ranges
    from autopar.launch import run_on_ranks

    res = run_on_ranks(_group_samples_rank, 4)
    assert all(r == res[0] for r in res)
    assert set(res[0]) == {(2, 1), (2, 2)}
    for samples in res[0].values():
        assert [(s.kind, s.nbytes, s.n) for s in samples] == [
            (k, b, 2) for k in ("all_reduce", "all_gather") for b in (2**10, 2**16)
        ]
        assert all(s.seconds > 0 for s in samples)
    link = LinkSpec(
        1e9,
        1e-3,
        ranges=tuple(
            (group_ranges(kind, n, stride), up, bw, lat)
            for (n, stride), mine in res[0].items()
            for kind, up, bw, lat in fit_ranges(mine)
        ),
    )
    cluster = ClusterSpec.preset("cpu", devices_per_node=4).with_overrides(intra_node=link, inter_node=link)
    cm = CommModel(cluster, (2, 2))
    for axis, layout in ((0, (2, 2)), (1, (2, 1))):
        for s in res[0][layout]:
            fitted = predict_time(s, link, group_ranges(s.kind, *layout))  # the layout's own fit
            assert cm.time(Collective(s.kind), s.nbytes, axis) == pytest.approx(fitted, rel=1e-9)


def _added_rank(rank: int, world: int):
    import torch
    import torch.distributed as dist

    from autopar.tools import calibrate as cal

    clock = FakeClock()
    # this spawned process's own: its clock, its loops' compute (each op 1e-5 s of it) and a
    # barrier that leaves every rank at the last one's arrival, as a blocking collective does
    cal.time = clock.module()
    op_s, ops_seen = 1e-5, set()

    def gap_work(self, ops: int) -> None:
        ops_seen.add(ops)
        clock.advance(ops * op_s)

    cal._GapWork.__call__ = gap_work

    def barrier(group=None, **_) -> None:
        t = torch.tensor([clock()], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        clock.now = float(t.item())

    dist.barrier = barrier
    last = rank == world - 1
    calls = [0]

    def everyone_waits() -> None:
        clock.advance(4e-3)
        dist.barrier()

    def the_last_waits() -> None:  # the others wait for it
        if last:
            clock.advance(4e-3)
        dist.barrier()

    def the_last_leaves_late() -> None:  # the others go on computing: the loop ends with the last
        if last:
            clock.advance(4e-3)

    def one_call_stalls() -> None:  # 1 ms, once 1 s: one loop of 40, trimmed
        calls[0] += 1
        clock.advance(1e-3 + (1.0 if calls[0] == 7 else 0.0))
        dist.barrier()

    entries = [everyone_waits, the_last_waits, the_last_leaves_late, dist.barrier, one_call_stalls]
    return cal.measure_added(entries, repeats=40), ops_seen


@pytest.mark.slow
def test_a_call_costs_what_it_adds_to_the_wall_of_a_loop_of_steps():
    """``measure_added`` (what calibrate prices collectives with) on 2 ranks, each on a clock that
    moves only by the loops' compute and the calls' known seconds: a 4 ms call adds 4 ms per
    iteration to the loop's wall whether every rank spends it, one rank the others wait for, or
    one rank after the others have left; a barrier alone adds nothing; one call stalled by a
    second in one of 40 loops is trimmed off; the loops' compute is sized to ``gap_s``; every
    rank returns the same. The real timings (real waits) are benchmarks/bench_timing_checks.py's."""
    from autopar.cost_model.sync import REFERENCE_GAP_S
    from autopar.launch import run_on_ranks

    (added0, ops0), (added1, ops1) = run_on_ranks(_added_rank, 2, timeout_s=300)
    assert added0 == added1
    assert added0 == pytest.approx([4e-3, 4e-3, 4e-3, 0.0, 1e-3], abs=1e-9)
    assert ops0 == ops1 and max(ops0) == round(REFERENCE_GAP_S / 1e-5)


def test_the_calibration_compute_never_decays_into_denormals():
    """The fixed compute that calibration loops run between collectives keeps normal floats however
    many ops it runs: values that decay into denormals make each op ~15x slower on x86 (the
    sync wait's longest gap once took 95 ms where 8 ms was asked), so time would stop growing in
    proportion to the op count the loops are sized by."""
    import torch

    from autopar.tools.calibrate import _GapWork

    out = _GapWork(torch.device("cpu"))(2000)
    assert torch.isfinite(out).all() and out.abs().min() > torch.finfo(torch.float32).tiny
