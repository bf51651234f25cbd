"""Tests for autopar.tools.profiler / profile_cache: figures against what its (injected) clock
measured, the on-disk cache (reuse, keys, concurrent writers), fallbacks to the analytical model,
and planning with profile=True."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from fake_clock import FakeClock
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import autopar
import autopar.examples
from autopar.cli import main
from autopar.cost_model.compute import accumulate_time
from autopar.errors import ProfileCacheError, ProfilerDeviceError
from autopar.passes.analyze import analyze
from autopar.passes.costs import Optimizer, analytical_node_time, build_costs, grad_uses
from autopar.passes.strategies import Strategy, build_strategies
from autopar.passes.trace import trace
from autopar.placement import volume_factor
from autopar.tools.profile_cache import OpTiming, ProfileCache
from autopar.tools.profiler import OpProfiler, TensorSpec, _layout, op_key, profile_device_for

aten = torch.ops.aten
R = Replicate()
F32 = torch.float32
FAST = dict(warmup=1, repeats=3, min_sample_s=2e-4)  # where only the plumbing is under test


class EmbedMatmul(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4))
        self.e = torch.nn.Embedding(16, 8)

    def forward(self, ids):
        return (self.e(ids) @ self.w).view(-1).sum()


@pytest.fixture(scope="module")
def small_graph():
    tg = trace(EmbedMatmul(), (torch.randint(0, 16, (4, 6)),))
    infos = analyze(tg)
    return tg, infos, build_strategies(tg, infos, (2,))


def _node(tg, target):
    return next(n for n in tg.graph.nodes if n.target is target)


def _clocked_op(clock: FakeClock, forward_s: float, backward_s: float, stall_at: int, stall_s: float):
    """An op whose forward moves ``clock`` by ``forward_s`` (its call number ``stall_at`` by
    ``stall_s`` more: one stalled call) and whose backward by ``backward_s``."""
    calls = [0]

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            clock.advance(backward_s)
            return g * 2

    def op(x):
        calls[0] += 1
        clock.advance(forward_s + (stall_s if calls[0] == stall_at else 0.0))
        return Twice.apply(x)

    return op, calls


# ------------------------------------------------------------------------------------ measurements


def test_the_figures_are_the_median_per_call_times_its_timer_measured(tmp_path, monkeypatch):
    """On a clock that moves only when the op runs (3e-4 s forward, 5e-4 s backward, and one
    forward call stalled by a whole second): the forward figure is the forward's time per call,
    the backward the step's less the forward, and the stall is out (median of samples, not
    their mean). The real timings, against a direct timing of the same matmul, are
    benchmarks/bench_timing_checks.py's."""
    import autopar.tools.profiler as profiler

    clock = FakeClock()
    monkeypatch.setattr(profiler, "time", clock.module())
    op, calls = _clocked_op(clock, 3e-4, 5e-4, stall_at=10, stall_s=1.0)
    prof = OpProfiler(cache_path=tmp_path / "c.json", warmup=2, repeats=5, min_sample_s=2e-3)
    timing = prof.time_op(op, (TensorSpec((4, 4), F32, requires_grad=True),))
    assert timing.ok
    assert timing.forward_s == pytest.approx(3e-4, rel=1e-9)
    assert timing.backward_s == pytest.approx(5e-4, rel=1e-9)
    assert prof.runs == calls[0] > 10  # the stalled call was among the ones timed
    # samples of several calls each (min_sample_s), not one call per sample
    assert calls[0] > 2 * (2 + 1 + 5)
    # cached: asked again, the op does not run and the figures are the same
    again = prof.time_op(op, (TensorSpec((4, 4), F32, requires_grad=True),))
    assert again == timing and prof.runs == calls[0]


def test_no_gradient_means_no_backward(tmp_path):
    prof = OpProfiler(cache_path=tmp_path / "c.json", **FAST)
    t = prof.time_op(aten.mm.default, (TensorSpec((64, 64), F32), TensorSpec((64, 64), F32)))
    assert t.ok and t.forward_s > 0 and t.backward_s == 0.0


def test_synthesized_layout_follows_the_traced_strides():
    for real in (
        torch.empty(4, 6, 8).transpose(0, 2),
        torch.empty(2, 3, 5, 7).permute(0, 2, 1, 3),
        torch.empty(5, 1, 7).expand(5, 3, 7),
        torch.empty(3, 4),
    ):
        perm, expanded = _layout(real)
        made = TensorSpec(tuple(real.shape), F32, perm=perm, expanded=expanded).make(torch.device("cpu"))
        assert made.shape == real.shape

        def order(t):
            return sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))

        assert order(made) == order(real)
        assert [s == 0 for s in made.stride()] == [s == 0 for s in real.stride()]


# ------------------------------------------------------------------------------------ cache


def test_second_profiler_reuses_the_cache_without_running_ops(tmp_path, small_graph):
    tg, infos, strats = small_graph
    path = tmp_path / "c.json"
    first = OpProfiler(cache_path=path, **FAST)
    figures = {}
    for name in ("embedding", "matmul", "sum_1"):
        for s in strats[name].strategies:
            figures[(name, s)] = first.node_time(strats[name].node, s, (2,), infos)
    first.flush()
    assert first.runs > 0 and first.take_stats().measured >= 6
    mtime = path.stat().st_mtime_ns

    second = OpProfiler(cache_path=path, **FAST)
    for (name, s), t in figures.items():
        assert second.node_time(strats[name].node, s, (2,), infos) == t
    stats = second.take_stats()
    assert second.runs == 0 and stats.measured == 0 and stats.cached == len(figures)
    second.flush()  # nothing new: the file is not rewritten
    assert path.stat().st_mtime_ns == mtime


def test_cache_keys_distinguish_shapes_dtypes_gradients_and_threads(tmp_path):
    path = tmp_path / "c.json"
    prof = OpProfiler(cache_path=path, num_threads=1, **FAST)
    variants = [
        (TensorSpec((32, 32), F32), TensorSpec((32, 32), F32)),
        (TensorSpec((32, 16), F32), TensorSpec((16, 32), F32)),
        (TensorSpec((32, 32), torch.bfloat16), TensorSpec((32, 32), torch.bfloat16)),
        (TensorSpec((32, 32), F32, requires_grad=True), TensorSpec((32, 32), F32)),
    ]
    for args in variants:
        assert prof.time_op(aten.mm.default, args).ok
    assert prof.take_stats().measured == len(variants)
    prof.flush()
    entries = json.loads(path.read_text())["entries"]
    (ctx,) = entries
    assert f"torch {torch.__version__}" in ctx and "threads 1" in ctx and ctx.startswith("cpu:")
    assert set(entries[ctx]) == {op_key(aten.mm.default, a, {}) for a in variants}
    # another thread count is another context: measured again, not read from the first
    other = OpProfiler(cache_path=path, num_threads=2, **FAST)
    other.time_op(aten.mm.default, variants[0])
    assert other.runs > 0


def test_concurrent_writers_keep_every_entry_and_a_valid_file(tmp_path):
    path = tmp_path / "c.json"

    def writer(w: int):
        cache = ProfileCache(path, "ctx")
        for i in range(15):
            cache.put(f"op{w}-{i}", OpTiming(1e-6 * i, 0.0))
            cache.flush()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries = json.loads(path.read_text())["entries"]["ctx"]
    assert len(entries) == 60
    assert len(ProfileCache(path, "ctx")) == 60
    assert not list(tmp_path.glob("*.tmp"))


def test_a_flush_takes_in_what_other_processes_wrote(tmp_path):
    a, b = ProfileCache(tmp_path / "c.json", "ctx"), ProfileCache(tmp_path / "c.json", "ctx")
    a.put("x", OpTiming(1e-3, 2e-3))
    a.flush()
    assert b.get("x") is None  # loaded before a wrote
    b.put("y", OpTiming(1e-3, 0.0))
    b.flush()
    assert b.get("x") == OpTiming(1e-3, 2e-3)
    assert ProfileCache(tmp_path / "c.json", "other").get("x") is None  # another machine context


def test_a_corrupt_cache_raises_with_the_fix(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"format": "autopar-op-profile", "version": 1, "entr')
    with pytest.raises(ProfileCacheError, match="delete"):
        OpProfiler(cache_path=path)


# ------------------------------------------------------------------------------------ fallbacks


def test_an_op_that_raises_falls_back_and_the_failure_is_remembered(tmp_path, small_graph):
    tg, infos, strats = small_graph
    node = _node(tg, aten.matmul.default)
    bad = Strategy((Shard(2),), ((Shard(2),), (R,)))  # [4, 6, 4] @ [8, 4]: the op raises
    path = tmp_path / "c.json"
    prof = OpProfiler(cache_path=path, **FAST)
    assert prof.node_time(node, bad, (2,), infos) is None
    assert prof.take_stats().failed == 1
    prof.flush()
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert any("RuntimeError" in v["error"] for v in entry.values())
    again = OpProfiler(cache_path=path, **FAST)
    assert again.node_time(node, bad, (2,), infos) is None
    assert again.runs == 0 and again.take_stats().failed == 1


def test_build_costs_prices_measured_ops_by_their_measurement_times_core_sharing(tmp_path, small_graph):
    tg, infos, strats = small_graph
    prof = OpProfiler(cache_path=tmp_path / "c.json", **FAST)
    base = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    # two ranks on one core: each computes half as fast as the one rank the profiler measured
    shared = base.with_overrides(device=base.device.with_contention(host_cores=1))
    assert shared.compute_slowdown == 2.0
    costs = build_costs(tg, infos, strats, shared, (2,), Optimizer.SGD, profiler=prof)
    matmul = _node(tg, aten.matmul.default)
    for s, c in zip(strats["matmul"].strategies, costs.node_cost["matmul"]):
        assert c == pytest.approx(2.0 * prof.node_time(matmul, s, (2,), infos))
    # a view's arguments hold sizes: not run, the analytical figure
    view = _node(tg, aten.view.default)
    assert prof.node_time(view, strats["view"].strategies[0], (2,), infos) is None
    info = infos["view"]
    for s, c in zip(strats["view"].strategies, costs.node_cost["view"]):
        analytical = analytical_node_time(
            info, strats["view"].inputs, infos, shared.device, s.work_divisor((2,))
        )
        assert c == pytest.approx(2.0 * analytical)


def test_index_inputs_stay_in_range_of_the_local_table(tmp_path, small_graph):
    tg, infos, strats = small_graph
    node = _node(tg, aten.embedding.default)
    prof = OpProfiler(cache_path=tmp_path / "c.json", **FAST)
    vocab_parallel = next(s for s in strats["embedding"].strategies if isinstance(s.out[0], Partial))
    call = prof.node_call(node, vocab_parallel, (2,), infos)
    assert call[1][0].shape == (8, 8) and call[1][1].high == 8  # ids drawn below the 8 local rows
    assert prof.node_time(node, vocab_parallel, (2,), infos) is not None


# ------------------------------------------------------------------------------------ planning


def test_plan_with_profile_prices_measured_ops_by_their_measurement(tmp_path):
    model, inputs = autopar.examples.gpt2_tiny(batch=2, seq=8, hidden=32, vocab=64)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    # every node its own class: a decision's compute is then its own, not its class's average
    analytical = autopar.search(model, cluster, inputs, mesh_shape=(2,), coarsen=False).plan
    prof = OpProfiler(cache_path=tmp_path / "c.json", num_threads=1, **FAST)
    lines: list[str] = []
    result = autopar.search(
        model, cluster, inputs, mesh_shape=(2,), profile=prof, progress=lines.append, coarsen=False
    )
    profiled = result.plan
    assert any(m.startswith("profile: mesh (2,)") and " 0 failed" in m for m in lines)
    assert profiled.predicted.compute_s != analytical.predicted.compute_s
    infos = analyze(result.traced)
    uses = grad_uses(result.traced, infos)
    nodes = {n.name: n for n in result.traced.graph.nodes}
    by_name = {d.name: d for d in analytical.decisions}
    seen = {"measured": 0, "analytical": 0}
    for d in profiled.decisions:
        node = nodes[d.name]
        if node.op != "call_function" or d.name not in result.choice:
            continue
        call = prof.node_call(node, result.choice[d.name], (2,), infos)
        if call is None:  # not profiled: the same figure as the analytical plan when the choice agrees
            if by_name[d.name].output == d.output and by_name[d.name].inputs == d.inputs:
                assert d.compute_s == pytest.approx(by_name[d.name].compute_s)
                seen["analytical"] += 1
            continue
        timing = prof.cache.get(op_key(*call))
        assert timing is not None and timing.ok
        # plus the sum of its output's gradients when several ops use it (not part of the op)
        local = infos[d.name].out_bytes / volume_factor(result.choice[d.name].out, (2,))
        acc = accumulate_time(local, uses.get(d.name, 0), cluster.device)
        assert d.compute_s == pytest.approx((timing.total_s + acc) * cluster.compute_slowdown)
        seen["measured"] += 1
    assert seen["measured"] >= 20 and seen["analytical"] >= 5


def test_profiling_for_another_device_raises_with_the_fix(monkeypatch):
    model, inputs = autopar.examples.mlp(batch=8, hidden=16, ffn=32)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ProfilerDeviceError, match=r"ClusterSpec.local\(\).*drop profile=True"):
        autopar.plan(model, autopar.ClusterSpec.preset("h100-sxm", devices_per_node=2), inputs, profile=True)
    # a GPU of another family than the cluster's is refused too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ProfilerDeviceError, match="A100.*H100"):
        profile_device_for(autopar.ClusterSpec.preset("h100-sxm").device)
    assert profile_device_for(autopar.ClusterSpec.preset("a100-40gb").device).type == "cuda"
    assert profile_device_for(autopar.ClusterSpec.preset("cpu").device).type == "cpu"


def test_cli_plan_with_profile(tmp_path, capsys):
    cache = tmp_path / "c.json"
    argv = ["plan", "autopar.examples:mlp(batch=8, hidden=16, ffn=32)", "--cluster", "cpu:1x2",
            "--out", str(tmp_path / "p.json"), "--profile", "--profile-cache", str(cache)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "profile: mesh (2,)" in out and "cache hits" in out
    assert cache.exists() and autopar.Plan.load(tmp_path / "p.json").predicted.compute_s > 0
    assert main(argv) == 0
    assert "profile: mesh (2,): 0 distinct ops measured" in capsys.readouterr().out
    bad = ["plan", "autopar.examples:mlp(batch=8, hidden=16, ffn=32)", "--cluster", "h100-sxm:1x2", "--profile",
           "--profile-cache", str(cache), "--out", str(tmp_path / "q.json")]  # fmt: skip
    if not torch.cuda.is_available():
        assert main(bad) == 2
        assert "drop profile=True / --profile" in capsys.readouterr().err


def test_profiling_leaves_the_random_streams_alone(tmp_path):
    prof = OpProfiler(cache_path=tmp_path / "c.json", **FAST)
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    assert prof.time_op(aten.dropout.default, (TensorSpec((16, 16), F32, True), 0.5, True)).ok
    assert prof.runs > 0 and torch.equal(torch.rand(4), expected)
