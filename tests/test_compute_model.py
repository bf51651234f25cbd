"""The analytical compute model (cost_model/compute.py, passes/costs.py) against real counts:
FLOPs the op runs on one rank's local shapes, storages the traced values share."""

from __future__ import annotations

import dataclasses
import json
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import autopar.examples
from autopar.cluster import ClusterSpec
from autopar.cost_model.compute import EFF_MAX, forward_body, node_time
from autopar.errors import ClusterSpecError
from autopar.launch import keep_freed_memory
from autopar.passes.analyze import analyze
from autopar.passes.costs import Optimizer
from autopar.passes.rules import VIEW_OPS
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace
from autopar.tools.calibrate import median_compute
from autopar.tools.calibrate_compute import (
    MATMUL_SHAPES,
    OPTIMIZERS,
    fit_matmul,
    matmul_overhead,
)
from autopar.tools.profiler import OpProfiler, TensorSpec

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default, aten.matmul.default}


@pytest.fixture(scope="module")
def graphs():
    out = []
    for make in (autopar.examples.gpt2_tiny, autopar.examples.llama_tiny):
        model, inputs = make(batch=4, seq=8, hidden=32, vocab=64)
        tg = trace(model, inputs)
        out.append((tg, analyze(tg)))
    return out


def _local_flops(call) -> float:
    op, args, kwargs = call

    def meta(x):
        return torch.empty(x.shape, dtype=x.dtype, device="meta") if isinstance(x, TensorSpec) else x

    args, kwargs = torch.utils._pytree.tree_map(meta, (args, kwargs))
    with FlopCounterMode(display=False) as counter:
        op(*args, **kwargs)
    return float(counter.get_total_flops())


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_work_divisor_is_the_flops_a_rank_runs_on_its_local_shapes(graphs, tmp_path, mesh):
    """A matmul strategy's work divisor is global FLOPs / the FLOPs of the op on one rank's local
    inputs: Shard divides, Partial and Replicate inputs do not (a Partial activation times a
    replicated weight is a full-size matmul on every rank)."""
    prof = OpProfiler(cache_path=tmp_path / "c.json")
    checked = partial_full = 0
    for tg, infos in graphs:
        strats = build_strategies(tg, infos, mesh)
        for name, ns in strats.items():
            if ns.node.target not in MATMULS:
                continue
            for s in ns.strategies:
                if any(s.via):  # an algorithm of its own (a 2D matmul gathers K): not the local op
                    continue
                call = prof.node_call(ns.node, s, mesh, infos)
                assert call is not None
                local = _local_flops(call)
                assert infos[name].flops / local == pytest.approx(s.work_divisor(mesh))
                checked += 1
                partial_full += any(s.split_axes()) and s.work_divisor(mesh) == 1
    assert checked > 50 and partial_full > 0  # Partial-only strategies exist and cost full work


def test_views_move_no_bytes(graphs):
    """A node whose output shares its input's storage (a view, an identity reshape) moves nothing;
    every other tensor op's bytes are its inputs' and outputs' sizes."""
    views = 0
    for tg, infos in graphs:
        for node in tg.graph.nodes:
            if node.op != "call_function" or node.target not in VIEW_OPS:
                continue
            out = node.meta["val"]
            src = node.all_input_nodes[0].meta["val"]
            shares = out.untyped_storage()._cdata == src.untyped_storage()._cdata
            assert (infos[node.name].bytes == 0) == shares, node.name
            views += shares
    assert views > 10


# ------------------------------------------------------------------ roofline terms (cost_model/compute.py)
CPU = ClusterSpec.preset("cpu").device


@given(
    flops=st.floats(0, 1e12), nbytes=st.floats(0, 1e10), k=st.sampled_from([1, 2, 4, 8]),
    grads=st.integers(0, 4),
)  # fmt: skip
def test_backward_is_the_forward_body_once_per_new_gradient_up_to_two(flops, nbytes, k, grads):
    body = forward_body(flops, nbytes, torch.float32, CPU, k)
    launch = CPU.kernel_launch_s
    assert node_time(flops, nbytes, torch.float32, CPU, k, False) == pytest.approx(body + launch)
    t = node_time(flops, nbytes, torch.float32, CPU, k, True, new_grads=grads)
    assert t == pytest.approx(body * (1 + min(grads, 2)) + 2 * launch)


@given(
    elements=st.floats(1, 1e8), fwd=st.floats(0, 1e-8), bwd=st.floats(0, 1e-8), k=st.sampled_from([1, 2, 4])
)
def test_a_measured_pointwise_op_costs_at_least_its_per_element_time(elements, fwd, bwd, k):
    dev = dataclasses.replace(CPU, pointwise_s=(("aten.tanh.default", fwd, bwd),))
    nbytes = 8 * elements
    body = forward_body(0.0, nbytes, torch.float32, dev, k)
    t = node_time(
        0.0, nbytes, torch.float32, dev, k, True, new_grads=1, op="aten.tanh.default", elements=elements
    )
    expect = max(body, elements / k * fwd) + max(body, elements / k * bwd) + 2 * dev.kernel_launch_s
    assert t == pytest.approx(expect)
    # another op is not priced by tanh's figures
    other = node_time(
        0.0, nbytes, torch.float32, dev, k, True, new_grads=1, op="aten.exp.default", elements=elements
    )
    assert other == pytest.approx(2 * body + 2 * dev.kernel_launch_s)


def test_device_tables_round_trip_and_bad_entries_say_the_fix():
    dev = dataclasses.replace(CPU, pointwise_s={"aten.tanh.default": [2.5e-9, 5e-10]})
    assert dev.pointwise("aten.tanh.default") == (2.5e-9, 5e-10) and dev.pointwise("aten.exp.default") is None
    spec = ClusterSpec.preset("cpu").with_overrides(device=dev)
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    with pytest.raises(ClusterSpecError, match="forward, backward"):
        dataclasses.replace(CPU, pointwise_s={"aten.tanh.default": 1e-9})


@given(flops=st.floats(1, 1e12), fwd=st.floats(0, 1e-9), bwd=st.floats(0, 1e-9), k=st.sampled_from([1, 2, 4]))
def test_an_op_measured_per_flop_costs_at_least_its_flops_times_its_rate(flops, fwd, bwd, k):
    op = "aten.scaled_dot_product_attention.default"
    dev = dataclasses.replace(CPU, per_flop_s={op: [fwd, bwd]})
    body = forward_body(flops, 0.0, torch.float32, dev, k)
    t = node_time(flops, 0.0, torch.float32, dev, k, True, new_grads=3, op=op, elements=1.0)
    expect = max(body, flops / k * fwd) + max(2 * body, flops / k * bwd) + 2 * dev.kernel_launch_s
    assert t == pytest.approx(expect)
    assert dev.per_flop(op) == (fwd, bwd) and dev.pointwise(op) is None
    spec = ClusterSpec.preset("cpu").with_overrides(device=dev)
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_median_compute_takes_each_figure_and_table_entry_across_ranks():
    ranks = [
        {
            "memory_bandwidth": b,
            "kernel_launch_s": 1e-6,
            "pointwise_s": {"aten.tanh.default": [f, 1e-9]},
            "optimizer_param_s": {"ADAM": 10 * f},
            "matmul": [
                ((64, 64, 64), 1.5e6, t),
                ((128, 128, 128), 1.2e7, 8 * t),
                ((256, 256, 256), 1e8, 64 * t),
            ],
        }
        for b, f, t in [(10.0, 3e-9, 3e-5), (30.0, 1e-9, 1e-5), (20.0, 2e-9, 2e-5)]
    ]
    m = median_compute(ranks)
    assert m["memory_bandwidth"] == 20.0 and m["pointwise_s"]["aten.tanh.default"] == [2e-9, 1e-9]
    assert m["optimizer_param_s"] == {"ADAM": 2e-8}
    # the matmul figures: one fit to each shape's median time
    assert [p[2] for p in m["matmul"]] == [2e-5, 1.6e-4, 1.28e-3]
    rate, c, half = fit_matmul(m["matmul"])
    assert (m["flops_effective"], m["matmul_intercept_s"], m["matmul_dim_half"]) == (rate, c, half)


def test_step_and_optimizer_overheads_round_trip_and_bad_entries_say_the_fix(tmp_path):
    dev = dataclasses.replace(CPU, step_overhead_s=7e-5, optimizer_param_s={"ADAM": 2e-5, "SGD": 2e-6})
    assert dev.optimizer_param("ADAM") == 2e-5
    assert dev.optimizer_param("SGD_MOMENTUM") == dev.kernel_launch_s  # not measured: one launch
    spec = ClusterSpec.preset("cpu").with_overrides(device=dev)
    spec.save(tmp_path / "c.json")
    assert ClusterSpec.from_file(tmp_path / "c.json") == spec
    with pytest.raises(ClusterSpecError, match=r"optimizer_param_s\['ADAM'\]"):
        dataclasses.replace(CPU, optimizer_param_s={"ADAM": [1e-5, 2e-5]})
    with pytest.raises(ClusterSpecError, match="step_overhead_s"):
        dataclasses.replace(CPU, step_overhead_s=-1.0)
    # every optimizer the planner prices has a measurement
    assert set(OPTIMIZERS) == {o.name for o in Optimizer}


class _PassCounter(TorchDispatchMode):
    """Bytes the kernels of an optimizer step move over one parameter-sized tensor, in passes of
    its size: in-place kernels (their output is an input) and kernels that write a fresh tensor,
    each reading every distinct tensor argument once and writing its output once; and the most
    fresh parameter-sized tensors alive at once."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.inplace, self.fresh, self.live, self.most = numel, 0, 0, set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = {
            id(a): a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)
        }
        big = [t for t in tensors.values() if t.numel() == self.numel]
        if not big:  # the step counter and other scalars: not parameter traffic
            return out
        outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        in_place = any(id(o) in tensors for o in outs) or func._schema.name.endswith("_")
        passes = len(big) + sum(1 for o in outs if o.numel() == self.numel)
        if in_place:
            self.inplace += passes
        else:
            self.fresh += passes
            for o in outs:
                if o.numel() == self.numel:
                    self.live.add(weakref.ref(o))
            self.live = {r for r in self.live if r() is not None}
            self.most = max(self.most, len(self.live))
        return out


@pytest.mark.parametrize("kind", list(Optimizer))
def test_the_optimizer_traffic_is_the_bytes_pytorchs_step_kernels_move(kind):
    """``OPTIMIZER_TRAFFIC`` (in-place passes, fresh passes, fresh temporaries at once) against the
    kernels PyTorch's own step runs on the parameter (its defaults on CPU; the second step, once
    the states exist), counted at the dispatcher: bytes, not time."""
    from autopar.cost_model.compute import OPTIMIZER_TRAFFIC
    from autopar.tools.calibrate_compute import OPTIMIZERS

    name = kind.name
    p = torch.nn.Parameter(torch.randn(4096))
    p.grad = torch.randn(4096)
    opt = OPTIMIZERS[name]([p])
    opt.step()  # makes the states (momentum buffer, moments)
    counter = _PassCounter(p.numel())
    with counter, torch.no_grad():
        opt.step()
    assert (counter.inplace, counter.fresh, counter.most) == OPTIMIZER_TRAFFIC[name]


def _glibc_defaults() -> None:
    """glibc's documented starting thresholds (``mallopt(3)``: 128 KiB each), set, so that the
    process frees as a fresh one does whatever it allocated before: glibc raises both thresholds
    on its own after large frees, and how far depends on what the imports allocated (a process
    that imported more kept its freed memory without the setting, and the comparison meant
    nothing)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, 128 * 1024) and libc.mallopt(-1, 128 * 1024)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def _faults_of_steps(keep: bool) -> int:
    """Page faults of 4 "steps" after a first one, each making 40 activations of 1 MiB and
    freeing them (glibc trims the freed top of its heap, and the next step faults it back in)."""
    import resource

    if keep:
        assert keep_freed_memory()
    else:
        _glibc_defaults()

    def step():
        xs = [torch.ones(2**18) for _ in range(40)]
        del xs

    step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_ranks_keep_freed_memory_instead_of_faulting_it_back_in():
    """Counted page faults (not time): reallocating tensors of a step's sizes faults their pages in
    again without the setting, and not with it (one fresh process each, as ranks are)."""
    ctx = torch.multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        with_keep = pool.apply(_faults_of_steps, (True,))
    with ctx.Pool(1) as pool:
        without = pool.apply(_faults_of_steps, (False,))
    # the 4 steps touch 40 MiB each (4 x 10240 pages); without the setting glibc gives back and
    # faults in again one to four steps' worth (10,400-40,800 faults seen), with it a few hundred
    touched = 4 * 40 * 256
    assert with_keep < touched / 20 and without > 5 * with_keep, (with_keep, without)


class _Sliced(torch.nn.Module):
    """y has three gradient-carrying uses; a slice drops half of y, a view drops nothing."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        y = torch.relu(x @ self.w)
        half = y[:, :32]  # slice: its backward writes a zero-filled gradient of y's size
        flat = y.view(-1)  # view: its backward is a view of the gradient
        return half.sum() + flat.sin().sum() + y.cos().sum()


def _backward_ops(model, x) -> list:
    """The aten ops that the real backward of ``model(x)`` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.append((func, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
            return out

    loss = model(x)
    with Log():
        loss.backward()
    return seen


def test_backward_sums_the_gradients_of_a_tensor_with_several_uses_as_autograd_does():
    """The node cost of y carries one addition per use beyond the first: as many as the real
    backward runs on y-sized gradients."""
    from autopar.cost_model.compute import accumulate_time
    from autopar.passes.costs import grad_uses

    model, x = _Sliced(), torch.randn(16, 64)
    tg = trace(model, (x,))
    infos = analyze(tg)
    uses = grad_uses(tg, infos)
    relu = next(n.name for n in tg.graph.nodes if n.target is aten.relu.default)
    ops = _backward_ops(model, x)
    adds = [f for f, shapes in ops if f in (aten.add.Tensor, aten.add_.Tensor) and shapes[0] == (16, 64)]
    assert uses[relu] - 1 == len(adds) == 2
    nbytes = infos[relu].out_bytes
    assert accumulate_time(nbytes, uses[relu], CPU) == pytest.approx(
        2 * (3 * nbytes / CPU.memory_bandwidth + CPU.kernel_launch_s)
    )
    assert accumulate_time(nbytes, 1, CPU) == 0.0


def test_a_slice_backward_pays_the_zero_filled_gradient_a_view_backward_does_not():
    """A slice's real backward allocates y's gradient (probed on meta tensors) and is priced at
    the bytes it writes and reads; a view's passes the gradient on and costs its launches."""
    from autopar.passes.costs import analytical_node_time

    model, x = _Sliced(), torch.randn(16, 64)
    tg = trace(model, (x,))
    infos = analyze(tg)
    nodes = {n.target: n for n in tg.graph.nodes if n.op == "call_function"}
    sl, vw = nodes[aten.slice.Tensor], nodes[aten.view.default]
    assert infos[sl.name].grad_new == (True,) and infos[vw.name].grad_new == (False,)
    launch2 = 2 * CPU.kernel_launch_s
    y_bytes = infos[sl.args[0].name].out_bytes
    t_slice = analytical_node_time(infos[sl.name], sl.all_input_nodes, infos, CPU, 1)
    assert t_slice == pytest.approx(launch2 + (y_bytes + infos[sl.name].out_bytes) / CPU.memory_bandwidth)
    assert analytical_node_time(infos[vw.name], vw.all_input_nodes, infos, CPU, 1) == pytest.approx(launch2)
    # what the real backward of the slice runs: a y-sized zero fill
    ops = _backward_ops(model, x)
    assert any(f in (aten.zeros.default, aten.new_zeros.default, aten.fill_.Scalar, aten.zero_.default,
                     aten.slice_backward.default) for f, _ in ops)  # fmt: skip


@given(
    rate=st.floats(2e10, 2e12),
    half=st.sampled_from([0, 4, 12, 32, 64]),
    intercept=st.floats(0.0, 2e-5),
)
def test_fit_matmul_recovers_the_rate_and_the_skinny_size(rate, half, intercept):
    """Samples made by ``t = F / (rate * d / (d + D)) + c`` over the calibration's shapes give
    back ``rate``, ``c`` and ``D``."""
    points = []
    for m, k, n in MATMUL_SHAPES:
        f, d = 6.0 * m * k * n, min(m, k, n)
        points.append(((m, k, n), f, f / (rate * d / (d + half)) + intercept))
    got_rate, got_c, got_half = fit_matmul(points)
    assert got_half == half
    assert got_rate == pytest.approx(rate, rel=1e-6)
    assert got_c == pytest.approx(intercept, rel=1e-6, abs=1e-12)


def test_a_skinny_local_gemm_is_priced_at_its_smallest_size():
    """An mlp's linears: under data parallelism a rank has 32 of the 64 rows (d = 32); under
    tensor parallelism the 64 rows stay whole and the 2048-wide side is split (d = 64). Each is
    priced ``(d + D) / d`` times its large-GEMM time, ``d`` the local GEMM's smallest size."""
    import autopar

    base = ClusterSpec.preset("cpu", devices_per_node=2)
    times = {}
    for half in (0.0, 16.0):
        cluster = base.with_overrides(device=dataclasses.replace(base.device, matmul_dim_half=half))
        for role in (autopar.AxisRole.DATA, autopar.AxisRole.TENSOR):
            model, inputs = autopar.examples.mlp(batch=64, hidden=512, ffn=2048)
            p = autopar.plan(model, cluster, inputs, axis_roles=(role,), optimizer=Optimizer.SGD)
            times[half, role] = [d.compute_s for d in p.decisions if d.op == "aten.linear.default"]
    for role, d in ((autopar.AxisRole.DATA, 32), (autopar.AxisRole.TENSOR, 64)):
        for plain, skinny in zip(times[0.0, role], times[16.0, role]):
            launches = 2 * base.device.kernel_launch_s  # forward and backward, not scaled
            assert skinny - launches == pytest.approx((plain - launches) * (d + 16) / d, rel=1e-6)


@given(
    overhead=st.floats(0.0, 1e-4),
    flops=st.floats(1e5, 1e9),
    grads=st.integers(1, 3),
    gemm=st.booleans(),
)
def test_a_gemm_pays_its_fixed_cost_forward_and_once_per_backward_gemm(overhead, flops, grads, gemm):
    """``matmul_overhead_s`` is added to a matmul's forward and to each of its (at most two)
    backward GEMMs; any other op's price does not change."""
    dev = dataclasses.replace(CPU, matmul_overhead_s=overhead)
    min_dim = 64 if gemm else None
    args = (flops, 0.0, torch.float32)
    with_o = node_time(*args, dev, 1, True, new_grads=grads, min_dim=min_dim)
    without = node_time(*args, CPU, 1, True, new_grads=grads, min_dim=min_dim)
    assert with_o - without == pytest.approx(overhead * (1 + min(grads, 2)) if gemm else 0.0, abs=1e-12)


@settings(deadline=None, max_examples=40)
@given(
    overhead=st.floats(0.0, 6e-5),
    launch=st.floats(2e-6, 2e-5),
    half=st.sampled_from([0, 4, 12]),
)
def test_the_calibrated_gemm_overhead_is_what_the_cost_model_charges(overhead, launch, half):
    """Linears timed as the cost model prices them (forward and backward, ``matmul_overhead_s``,
    two launches, the small-op term) over the calibration's shapes: ``fit_matmul`` and
    ``matmul_overhead`` give back the device's fixed cost per GEMM, to the small-op term's
    spread over the shapes (which the skinny factor scales)."""
    rate = 8e10
    dev = dataclasses.replace(
        CPU,
        peak_flops={"float32": rate / EFF_MAX},
        kernel_launch_s=launch,
        matmul_dim_half=float(half),
        matmul_overhead_s=overhead,
    )
    points = []
    for m, k, n in MATMUL_SHAPES:
        f = 2.0 * m * k * n
        t = node_time(f, 0.0, torch.float32, dev, 1, True, new_grads=2, min_dim=min(m, k, n))
        points.append(((m, k, n), 3 * f, t))
    got_rate, got_c, got_half = fit_matmul(points)
    assert got_half == half
    assert got_rate == pytest.approx(rate, rel=1e-3)
    assert matmul_overhead(got_c, launch) == pytest.approx(overhead, abs=1.5e-6)


def test_fit_matmul_keeps_a_fixed_cost_non_negative_and_weighs_shapes_alike():
    """Samples whose small shapes ran faster than a line through the large ones allows (noise:
    a slow spell on a large shape) fit ``c = 0``, not a negative fixed cost; and one large shape
    timed 30% slow moves the rate and the fixed cost by a few percent (a least-squares line in
    seconds, which the largest shapes decide, moves the rate 13% and makes ``c`` negative)."""
    rate, c = 8e10, 1e-4
    clean = [((m, k, n), 6.0 * m * k * n, 6.0 * m * k * n / rate + c) for m, k, n in MATMUL_SHAPES]
    fast_small = [(s, f, t * 0.5 if f < 3e7 else t) for s, f, t in clean]
    got_rate, got_c, _ = fit_matmul(fast_small)
    assert got_c >= 0.0 and got_rate > 0
    biggest = max(range(len(clean)), key=lambda i: clean[i][1])
    slow_big = [(s, f, t * 1.3 if i == biggest else t) for i, (s, f, t) in enumerate(clean)]
    got_rate, got_c, _ = fit_matmul(slow_big)
    assert got_rate == pytest.approx(rate, rel=0.05) and got_c == pytest.approx(c, rel=0.1)
