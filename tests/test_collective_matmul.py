"""Collective matmuls (``kernels/collective_matmul.py``) compute what the unfused collectives do.

The kernels, on gloo world 2 and 4 (the whole world and, on 4, each axis of a 2 x 2 mesh, whose
groups are not runs of consecutive ranks on axis 0): ``all_gather_linear`` against the linear of
the gathered input (column-parallel weight, the input's gradient reduce-scattered; replicated
weight, no reduction; the gathered input also read by another op), ``linear_reduce_scatter``
against the linear of the whole input reduce-scattered (row-parallel weight, a ``Partial`` bias),
along the batch, the sequence and (reduce-scatter) the features; forward and every gradient,
fp32, from one full reference computed on each rank with autograd. Then end to end: tiny Llama
and GPT-2 on a tensor-parallel axis with the sequence split around the linears (Megatron-style
sequence parallelism, made by editing the plan, ``_sequence_parallel``), ``overlap_matmuls`` on
and off: both train as one device does (loss and full state after 2 Adam steps), and the
generated code calls the fused collectives when on and none when off.
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import pytest
import torch
import torch.nn.functional as F
from harness import T, adam_rank, adam_reference, assert_rank_as_reference, parallel_axes

import autopar
from autopar.launch import run_on_ranks

pytestmark = pytest.mark.slow

B, S, IN, OUT = 4, 6, 8, 10


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed))


def _sum_length(x_full: torch.Tensor, out_total: int) -> int:
    """The longest sum behind any compared value: a weight's gradient sums over the input's rows,
    the output over its features, the input's gradient over the output's."""
    return max(x_full.numel() // x_full.shape[-1], x_full.shape[-1], out_total)


def _off(got: torch.Tensor, ref: torch.Tensor, k: int) -> float:
    """``got``'s largest error against ``ref`` in units of float32 rounding over a sum of ``k``
    terms of ``ref``'s size (``k * eps * max|ref|``): the two sum in different orders, so they
    may differ by that much and no more; a wrong block or a missing reduction is off by about
    ``1 / (k * eps)`` of these units."""
    bound = k * torch.finfo(torch.float32).eps * max(ref.abs().max().item(), torch.finfo(torch.float32).tiny)
    return (got - ref).abs().max().item() / bound


def _gather_case(group, dim: int, split_weight: bool, keep: bool, regather: bool = False) -> dict[str, float]:
    import torch.distributed as dist

    from autopar.kernels.collective_matmul import all_gather_linear

    n, r = dist.get_world_size(group), dist.get_rank(group)
    out_total = OUT * n if split_weight else OUT
    x_full = _randn(B * n if dim == 0 else B, S * n if dim == 1 else S, IN, seed=1)
    w_full, b_full = _randn(out_total, IN, seed=2), _randn(out_total, seed=3)
    g_full = _randn(*x_full.shape[:-1], out_total, seed=4)
    h_full = [_randn(*x_full.shape, seed=10 + j) for j in range(n)]  # each rank's gradient of `gathered`
    # the reference, on full tensors: the linear with every rank's weight block side by side
    X = x_full.clone().requires_grad_()
    W, Bb = w_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    Y = F.linear(X, W, Bb)
    loss = (Y * g_full).sum()
    if keep:
        hs = h_full if split_weight else [h_full[0]]  # whole on every rank: counted once
        loss = loss + sum((2 * X * h).sum() for h in hs)
    loss.backward()
    # this rank's run
    x = x_full.chunk(n, dim)[r].clone().requires_grad_()
    # column-parallel: this rank's block of output features (their weight rows), else all of them
    blk = (lambda t: t.chunk(n, -1)[r]) if split_weight else (lambda t: t)
    w = (w_full.chunk(n, 0)[r] if split_weight else w_full).clone().requires_grad_()
    b, g = blk(b_full).clone().requires_grad_(), blk(g_full)
    saved = []  # elements autograd keeps for backward (the kernel's input, gathered or not, and weight)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        res = all_gather_linear(
            x, w, b, dim, group, reduce_grad=split_weight, keep_gathered=keep, regather=regather
        )
    y, gathered = res if keep else (res, None)
    loss = (y * g).sum()
    if keep:
        loss = loss + (2 * gathered * h_full[r if split_weight else 0]).sum()
    loss.backward()
    k = _sum_length(x_full, out_total)
    return {
        "out": _off(y, blk(Y.detach()), k),
        "grad x": _off(x.grad, X.grad.chunk(n, dim)[r], k),
        "grad w": _off(w.grad, W.grad.chunk(n, 0)[r] if split_weight else W.grad, k),
        "grad b": _off(b.grad, blk(Bb.grad), k),
        **({"gathered": _off(gathered, x_full, k)} if keep else {}),
        # what forward keeps, in local inputs (x's elements): n where it keeps the gathered input, 1 the shard
        "kept": (sum(saved) - w.numel()) / x.numel(),
    }


def _gathers_case(group, dim: int) -> dict[str, float]:
    """``all_gather_linears`` of two column-parallel linears (Q and K of one input) against both on
    the full tensors: outputs, the input's gradient (the sum of theirs, reduce-scattered), each
    weight's and bias's; and the elements it keeps (the shard: 1)."""
    import torch.distributed as dist

    from autopar.kernels.collective_matmul import all_gather_linears

    n, r = dist.get_world_size(group), dist.get_rank(group)
    x_full = _randn(B * n if dim == 0 else B, S * n if dim == 1 else S, IN, seed=21)
    ws = [_randn(OUT * n, IN, seed=22 + j) for j in range(2)]
    bs = [_randn(OUT * n, seed=24 + j) for j in range(2)]
    gs = [_randn(*x_full.shape[:-1], OUT * n, seed=26 + j) for j in range(2)]
    X = x_full.clone().requires_grad_()
    W = [w.clone().requires_grad_() for w in ws]
    Bb = [b.clone().requires_grad_() for b in bs]
    Y = [F.linear(X, w, b) for w, b in zip(W, Bb)]
    sum((y * g).sum() for y, g in zip(Y, gs)).backward()
    x = x_full.chunk(n, dim)[r].clone().requires_grad_()
    w = [t.chunk(n, 0)[r].clone().requires_grad_() for t in ws]
    b = [t.chunk(n, 0)[r].clone().requires_grad_() for t in bs]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        ys = all_gather_linears(x, w, b, dim, group)
    sum((y * g.chunk(n, -1)[r]).sum() for y, g in zip(ys, gs)).backward()
    k = 2 * _sum_length(x_full, OUT * n)
    out = {"grad x": _off(x.grad, X.grad.chunk(n, dim)[r], k)}
    for j in range(2):
        out[f"out {j}"] = _off(ys[j], Y[j].detach().chunk(n, -1)[r], k)
        out[f"grad w{j}"] = _off(w[j].grad, W[j].grad.chunk(n, 0)[r], k)
        out[f"grad b{j}"] = _off(b[j].grad, Bb[j].grad.chunk(n, 0)[r], k)
    out["kept"] = (sum(saved) - sum(t.numel() for t in w)) / x.numel()
    return out


def _scatter_case(group, dim: int) -> dict[str, float]:
    import torch.distributed as dist

    from autopar.kernels.collective_matmul import linear_reduce_scatter

    n, r = dist.get_world_size(group), dist.get_rank(group)
    out_total = OUT * n if dim == 2 else OUT
    x_full = _randn(B * n if dim == 0 else B, S * n if dim == 1 else S, IN * n, seed=5)
    w_full, b_full = _randn(out_total, IN * n, seed=6), _randn(out_total, seed=7)
    g_full = _randn(*x_full.shape[:-1], out_total, seed=8)
    X = x_full.clone().requires_grad_()
    W, Bb = w_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    Y = F.linear(X, W, Bb)
    (Y * g_full).sum().backward()
    # row-parallel: this rank's input features and weight columns; the bias on rank 0 only (Partial)
    x = x_full.chunk(n, -1)[r].clone().requires_grad_()
    w = w_full.chunk(n, 1)[r].clone().requires_grad_()
    b = (b_full if r == 0 else torch.zeros_like(b_full)).clone().requires_grad_()
    y = linear_reduce_scatter(x, w, b, dim, group)
    (y * g_full.chunk(n, dim)[r]).sum().backward()
    k = _sum_length(x_full, out_total)
    return {
        "out": _off(y, Y.detach().chunk(n, dim)[r], k),
        "grad x": _off(x.grad, X.grad.chunk(n, -1)[r], k),
        "grad w": _off(w.grad, W.grad.chunk(n, 1)[r], k),
        "grad b": _off(b.grad, Bb.grad, k),
    }


def _errors(group) -> list[str]:
    """The messages of the calls the kernels refuse."""
    from autopar.errors import CollectiveMatmulError
    from autopar.kernels.collective_matmul import all_gather_linear, linear_reduce_scatter

    out = []
    for call in (
        lambda: all_gather_linear(torch.ones(2, 3), torch.ones(4, 3), None, -1, group),
        lambda: linear_reduce_scatter(torch.ones(3, 3), torch.ones(4, 3), None, 0, group),
    ):
        try:
            call()
            out.append("")
        except CollectiveMatmulError as e:
            out.append(str(e))
    return out


def _kernel_rank(rank: int, world: int):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    groups = {"world": dist.group.WORLD}
    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2))
        groups |= {"axis0": mesh.get_group(0), "axis1": mesh.get_group(1)}
    results = {}
    for name, group in groups.items():
        for dim in (0, 1):
            for split in (True, False):
                for keep, regather in ((False, False), (False, True), (True, False)):
                    case = (name, "gather", dim, split, keep, regather)
                    results[case] = _gather_case(group, dim, split, keep, regather)
            results[(name, "gathers", dim, True)] = _gathers_case(group, dim)
        for dim in (0, 1, 2):
            results[(name, "scatter", dim)] = _scatter_case(group, dim)
    return results, _errors(dist.group.WORLD)


_KERNELS: dict[int, list] = {}


@pytest.fixture(scope="module", params=[2, 4])
def kernel_runs(request):
    world = request.param
    if world not in _KERNELS:
        _KERNELS[world] = run_on_ranks(_kernel_rank, world, timeout_s=300)
    return world, _KERNELS[world]


def test_collective_matmuls_equal_the_unfused_collectives(kernel_runs):
    world, per_rank = kernel_runs
    for rank, (results, _) in enumerate(per_rank):
        assert len(results) == (1 if world == 2 else 3) * 17
        for case, errs in results.items():
            if case[1] in ("gather", "gathers"):  # a re-gather keeps the shard alone; the others the gathered
                n = 2 if world == 2 or case[0] != "world" else 4
                assert errs.pop("kept") == (1 if case[-1] else n), f"world {world} rank {rank} {case}"
            for what, err in errs.items():
                # within the rounding of the sums (``_off``): at most 4 units
                assert err <= 4.0, f"world {world} rank {rank} {case}: {what} off by {err:.3g} rounding units"


def test_collective_matmuls_refuse_what_they_cannot_cut(kernel_runs):
    world, per_rank = kernel_runs
    contracted, uneven = per_rank[0][1]
    assert "contracted (last) dim" in contracted
    assert "not a multiple of the group's" in uneven and "overlap_matmuls=False" in uneven


# -- end to end ------------------------------------------------------------------------------------

SEQ, HIDDEN, VOCAB, BATCH = 16, 32, 128, 2
LR, EPS, STEPS = 1e-2, 1e-5, 2
FUSED = ("all_gather_linear(", "linear_reduce_scatter(")


def build(name):
    from autopar.examples import gpt2_tiny, llama_tiny

    kw = {"batch": BATCH, "seq": SEQ, "hidden": HIDDEN, "vocab": VOCAB}
    return {"llama": llama_tiny, "gpt2": gpt2_tiny}[name](**kw)


def _sequence_parallel(plan, model, inputs):
    """``plan`` (tensor parallel on one axis) with the sequence split around its linears, as
    Megatron-LM's sequence parallelism has it: the input of every column-parallel linear (weight
    split by rows, input whole) made by an op whose output is split on the sequence (dim 1), and
    the one use of every row-parallel linear's output (a pending sum) taking it split on the
    sequence. Any strategy the rules offer runs correctly, chosen or not; these make the reshards
    the collective matmuls fuse: an all-gather of the sequence into a linear, a reduce-scatter
    of a linear's output over it."""
    from torch.distributed.tensor.placement_types import Shard

    from autopar.passes.analyze import analyze
    from autopar.passes.collective_matmul import LINEAR, sole_use
    from autopar.passes.costs import resolve_source
    from autopar.passes.rules import tensor_inputs
    from autopar.passes.strategies import build_strategies
    from autopar.passes.trace import trace
    from autopar.placement import R, is_partial, spec_from_str, spec_to_str

    tg = trace(model, inputs)
    allowed = build_strategies(tg, analyze(tg), plan.mesh_shape)
    seq = (Shard(1),)
    want = {}
    for n in tg.graph.nodes:
        if n.op != "call_function" or n.target is not LINEAR:
            continue
        d = plan[n.name]
        if spec_from_str(d.inputs[1]) == (Shard(0),) and spec_from_str(d.inputs[0]) == (R,):
            want[resolve_source(tensor_inputs(n)[0]).name] = lambda s: s.out == seq
        if is_partial(spec_from_str(d.output)[0]):
            user, k = sole_use(n)
            want[user.name] = lambda s, k=k: s.out == seq and s.ins[k] == seq
    decisions = []
    for d in plan.decisions:
        if d.name in want:
            s = next(s for s in allowed[d.name].strategies if want[d.name](s))
            d = dataclasses.replace(d, output=spec_to_str(s.out), inputs=tuple(spec_to_str(x) for x in s.ins))
        decisions.append(d)
    return dataclasses.replace(plan, decisions=tuple(decisions))


@functools.cache
def _sp_plan(name: str):
    """``name``'s tensor-parallel plan on 2 CPU ranks, made sequence parallel (``_sequence_parallel``)."""
    model, inputs = build(name)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    tp = autopar.plan(model, cluster, inputs, mesh_shape=(2,), axis_roles=(T,))
    return _sequence_parallel(tp, model, inputs)


@pytest.fixture(scope="module")
def sequence_parallel_runs(tmp_path_factory):
    """Each model's sequence-parallel plan with ``overlap_matmuls`` on and off (the same placements),
    trained on 2 gloo ranks: (plans, per-rank results)."""
    plans, jobs = {}, []
    tmp = tmp_path_factory.mktemp("cm")
    for name in ("llama", "gpt2"):
        sp = _sp_plan(name)
        for on in (True, False):
            key = (name, on)
            plans[key] = dataclasses.replace(sp, overlap_matmuls=on)
            path = tmp / f"{name}_{on}.json"
            plans[key].save(path)
            jobs.append((key, str(path)))
    return plans, run_on_ranks(adam_rank, 2, build, jobs, STEPS, LR, EPS, timeout_s=600)


@pytest.mark.parametrize("on", [True, False], ids=["overlap", "no_overlap"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sequence_parallel_trains_as_one_device(sequence_parallel_runs, name, on):
    plans, per_rank = sequence_parallel_runs
    assert plans[(name, on)].overlap_matmuls is on
    ref = adam_reference(*build(name), STEPS, LR, EPS)
    for rank, results in enumerate(per_rank):
        res = results[(name, on)]
        code, axes = assert_rank_as_reference(rank, res, ref, LR, STEPS)
        assert axes >= parallel_axes((2,))
        if rank == 0:
            fused = [f for f in FUSED if f in code]
            # llama's plan has both (column- and row-parallel linears), GPT-2's a row-parallel head
            want = list(FUSED) if name == "llama" else ["linear_reduce_scatter("]
            assert fused == (want if on else []), code


def _lowered(model, inputs, plan):
    """The rank-local graph codegen emits for ``plan``, lowered on meta-device shards (no process
    group), and the traced graph."""
    from autopar.codegen.lower import lower, mangle
    from autopar.passes.grad_sync import deferred_grad_axes
    from autopar.passes.replay import choice_from_plan
    from autopar.passes.trace import Role, trace
    from autopar.placement import Outputs, local_shape

    tg = trace(model, inputs)
    choice = choice_from_plan(tg, plan)
    attrs = {}
    for p in tg.placeholders:
        if p.role is not Role.INPUT:
            full = tg.state[p.target]
            t = torch.empty(
                local_shape(tuple(full.shape), choice[p.name].out, plan.mesh_shape), device="meta"
            )
            attrs[mangle(p.target)] = torch.nn.Parameter(t) if p.role is Role.PARAM else t
    deferred = deferred_grad_axes(tg, choice, plan.mesh_shape)
    gm = lower(tg, choice, plan.mesh_shape, attrs, deferred, Outputs(plan.outputs), plan.overlap_matmuls)
    return gm, tg


def _gathering_linear(n) -> str:
    """The traced linear an ``all_gather_linear`` node computes, or the first of those an
    ``all_gather_linears`` computes (the one the plan prices it on)."""
    for m in [n, *sorted(n.users, key=lambda u: u.args[1] if u.target is operator.getitem else -1)]:
        if "traced" in m.meta:
            return m.meta["traced"]
    raise AssertionError(f"{n} computes no traced linear")


def test_the_plan_prices_the_collective_matmuls_codegen_emits():
    """Priced on a device that overlaps communication with compute (the h100-sxm preset's
    ``comm_overlap``), Llama's sequence-parallel plan with collective matmuls costs what it costs
    without them less what each hides, at the nodes where codegen emits them: the linear an
    all-gather fuses into, the one use of a linear whose reduce-scatter fuses; each node's saving
    is ``ring_hidden_s`` of its collectives against the linear's forward and backward compute."""
    from autopar.codegen import collectives as C
    from autopar.cost_model.comm import CommModel
    from autopar.cost_model.overlap import ring_hidden_s
    from autopar.passes.collective_matmul import LINEAR, sole_use
    from autopar.reshard import Collective

    model, inputs = build("llama")
    h100 = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=2)
    sp = _sp_plan("llama")
    on = autopar.reprice(model, h100, inputs, dataclasses.replace(sp, overlap_matmuls=True))
    off = autopar.reprice(model, h100, inputs, dataclasses.replace(sp, overlap_matmuls=False))
    assert on.overlap_matmuls and not off.overlap_matmuls
    saved = {d.name: off[d.name].comm_s - d.comm_s for d in on.decisions}
    priced = {n for n, t in saved.items() if abs(t) > 1e-15}
    # where codegen fuses: the traced linear each fused call computes, and for a scatter its one use
    gm, tg = _lowered(model, inputs, on)
    nodes = {n.name: n for n in tg.graph.nodes}
    emitted = set()
    for n in gm.graph.nodes:
        if n.target in (C.all_gather_linear, C.all_gather_linears):
            emitted.add(_gathering_linear(n))
        elif n.target is C.linear_reduce_scatter:
            emitted.add(sole_use(nodes[n.meta["traced"]])[0].name)
    assert emitted and priced == emitted
    assert not any(
        n.target in (C.all_gather_linear, C.linear_reduce_scatter)
        for n in _lowered(model, inputs, off)[0].graph.nodes
    )
    assert on.predicted.step_time_s == pytest.approx(
        off.predicted.step_time_s - sum(saved.values()), rel=1e-9
    )
    # a fused gather's saving, from the comm model and the linear's compute as the plan has them
    comm, e = CommModel(h100, (2,)), h100.device.comm_overlap
    regathered = 0
    for n in gm.graph.nodes:
        if n.target in (C.all_gather_linear, C.all_gather_linears):
            linear = _gathering_linear(n)
            x = nodes[linear].args[0].meta["val"]
            full = x.numel() * x.element_size()
            t = comm.time(Collective.ALL_GATHER, full, 0)  # forward; backward reduce-scatters as much
            c = on[linear].compute_s
            if n.kwargs.get("regather") or n.target is C.all_gather_linears:  # only linears read its input
                assert all(u.target is LINEAR for u in nodes[linear].args[0].users)
                # backward's two rings, each behind half its compute; the re-gather's exposed part paid
                want = 2 * ring_hidden_s(t, c / 3, 2, e) - (t - ring_hidden_s(t, c / 3, 2, e))
                regathered += 1
            else:
                want = ring_hidden_s(t, c / 3, 2, e) + ring_hidden_s(t, 2 * c / 3, 2, e)
            assert saved[linear] == pytest.approx(want, rel=1e-9), linear
    assert regathered, "no fused gather re-gathers in backward"
