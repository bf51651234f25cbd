"""Overlapped gradient all-reduce (passes/grad_sync.py, codegen/grad_sync.py) gives the gradients of
the single-device model in every way a user may run backward: one backward, gradient accumulation
over two backwards, into zeroed (not None) gradients, and ``torch.autograd.grad``."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree
from harness import free_link_cpu

import autopar
from autopar.codegen import collectives as C
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.passes import grad_sync
from autopar.passes.grad_sync import deferred_grad_axes, grad_buckets
from autopar.passes.strategies import AxisRole

D, T = AxisRole.DATA, AxisRole.TENSOR


def _build():
    return gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)


def _loss(model, inputs):
    return model(**inputs).loss


def _reference_grads():
    """name -> gradient of the single-device model: one backward, and two backwards accumulated."""
    model, inputs = _build()
    _loss(model, inputs).backward()
    one = {n: p.grad.clone() for n, p in model.named_parameters()}
    _loss(model, inputs).backward()
    two = {n: p.grad.clone() for n, p in model.named_parameters()}
    return one, two


def _full_grads(pmodel) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pmodel.full_grads().items()}


def _rank(rank, world, plan_path, bucket_bytes=None):
    model, inputs = _build()
    cluster = free_link_cpu(world)
    if bucket_bytes is not None:
        grad_sync.BUCKET_BYTES = bucket_bytes
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan_path)
    params = list(pmodel.parameters())
    res = {"deferred": len(pmodel.grad_sync._bucket_of), "buckets": pmodel.grad_sync.num_buckets}
    _loss(pmodel, inputs).backward()
    res["one"] = _full_grads(pmodel)
    _loss(pmodel, inputs).backward()  # accumulates into .grad: reduced inline
    res["two"] = _full_grads(pmodel)
    for p in params:
        p.grad.zero_()  # zeroed, not None
    _loss(pmodel, inputs).backward()
    res["zeroed"] = _full_grads(pmodel)
    for p in params:
        p.grad = None
    pmodel.local_leaves = False  # the parameters themselves in the graph (codegen/local_params.py)
    grads = torch.autograd.grad(_loss(pmodel, inputs), params)
    for p, g in zip(params, grads):
        p.grad = g
    res["autograd_grad"] = _full_grads(pmodel)
    res["code"] = pmodel.code
    return res


def _f_uses(tg, choice, mesh_shape, deferred=None) -> dict[str, list[tuple[int, ...]]]:
    """Parameter -> for each use, the axes of the "f" the inline lowering puts on it (read from
    the generated graph: the chain of collectives between the parameter and the op using it, and
    of ops that compute, from it alone, values the same on every rank: a replicated chain, whose
    uses are the parameter's, ``passes/grad_sync.py:deferred_grad_axes``)."""
    from autopar.codegen.lower import lower, mangle

    params = {mangle(p.target): p.name for p in tg.placeholders if p.role.value == "param"}
    attrs = {attr: torch.nn.Parameter(torch.empty(0)) for attr in params}
    gm = lower(tg, choice, mesh_shape, attrs, deferred)
    traced = {n.name: n for n in tg.graph.nodes}
    grads = set()  # the traced nodes whose values carry a gradient
    for n in tg.graph.nodes:
        if n.op == "placeholder" and getattr(n.meta.get("val"), "requires_grad", False):
            grads.add(n.name)
        elif any(i.name in grads for i in n.all_input_nodes) and n.meta.get("val") is not None:
            vals = [v for v in pytree.tree_leaves(n.meta["val"]) if isinstance(v, torch.Tensor)]
            if any(v.dtype.is_floating_point for v in vals):
                grads.add(n.name)

    def link(u) -> bool:  # an op of a replicated chain from the value that reaches it
        t = traced.get(u.meta.get("traced"))
        if t is None or u.op != "call_function" or not isinstance(t.meta.get("val"), torch.Tensor):
            return False
        # the value that reaches it is its only input that carries a gradient (on the traced op)
        return sum(i.name in grads for i in t.all_input_nodes) == 1

    coll = {getattr(C, n) for n in ("f", "all_gather", "chunk", "all_reduce", "reduce_scatter", "to_partial")}
    out: dict[str, list[tuple[int, ...]]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or node.target not in params:
            continue
        uses = out.setdefault(params[node.target], [])
        stack = [(u, (), ()) for u in node.users]
        while stack:
            u, axes, links = stack.pop()
            if u.target in coll or u.target is C.local:
                axes = axes + ((u.args[1],) if u.target is C.f else ())
                stack.extend((v, axes, links) for v in u.users)
            elif not axes and link(u):
                stack.extend((v, axes, (*links, u.meta["traced"])) for v in u.users)
            elif all(choice[t].out[a].is_replicate() for t in links for a in axes):
                uses.append(tuple(sorted(axes)))
            else:  # the chain's values differ across the ranks of the "f" at its end: not the parameter's
                uses.append(())
    return out


@pytest.mark.parametrize(
    "world,mesh,roles", [(2, (2,), (D,)), (2, (2,), (T,)), (4, (2, 2), (D, T)), (4, (2, 2), None)]
)
def test_deferred_exactly_where_every_use_has_the_same_f(world, mesh, roles):
    """A parameter's gradient is reduced after accumulation exactly when the inline code puts the
    same "f" on every one of its uses; the deferred code then has no "f" on it at all."""
    model, inputs = _build()
    cluster = free_link_cpu(world)
    res = autopar.search(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
    deferred = deferred_grad_axes(res.traced, res.choice, mesh)
    uses = _f_uses(res.traced, res.choice, mesh)
    expect = {p: u[0] for p, u in uses.items() if u and len(set(u)) == 1 and u[0]}
    assert deferred == expect
    after = _f_uses(res.traced, res.choice, mesh, deferred)
    assert all(after[p] == [()] * len(uses[p]) for p in deferred)
    assert all(after[p] == uses[p] for p in uses if p not in deferred)
    if roles == (D,):
        assert deferred, "a data-parallel plan reduces some gradient"


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True])
def test_overlapped_grads_match_single_device(tmp_path, split):
    """One bucket for every gradient (the default cap), and buckets of a third of them (several,
    some of one parameter)."""
    model, inputs = _build()
    cluster = free_link_cpu(2)
    path = tmp_path / "dp.json"
    # ZeRO-0: the gradient buckets are its engine (a ZeRO-2 plan's reduce-scatters are FSDP2's)
    res = autopar.search(model, cluster, inputs, mesh_shape=(2,), axis_roles=(D,), zero_stage=0)
    res.plan.save(path)
    (whole,) = grad_buckets(res.traced, res.choice, deferred_grad_axes(res.traced, res.choice, (2,)), (2,))
    bucket_bytes = whole.nbytes / 3 if split else None
    one, two = _reference_grads()
    for res in run_on_ranks(_rank, 2, str(path), bucket_bytes):
        assert res["deferred"] > 0
        if bucket_bytes is None:
            assert res["buckets"] == 1
        else:
            assert 1 < res["buckets"] < res["deferred"]
        assert "autopar.codegen.collectives.f(" not in res["code"]
        for case, ref in (("one", one), ("two", two), ("zeroed", one), ("autograd_grad", one)):
            got = res[case]
            assert set(got) <= set(ref) and got, case
            for name, g in got.items():
                torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-5, msg=f"{case}: {name}")


def test_buckets_follow_backward_and_the_cap():
    """Buckets hold parameters of one set of axes, at most ``cap`` bytes each once full, in the order
    backward completes them: a bucket's members are all used no earlier than the next bucket's."""
    model, inputs = _build()
    res = autopar.search(model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,))
    deferred = deferred_grad_axes(res.traced, res.choice, (2,))
    order = {n.name: i for i, n in enumerate(res.traced.graph.nodes)}
    nodes = {n.name: n for n in res.traced.graph.nodes}

    def first_use(p):
        return min(order[u.name] for u in nodes[p].users)

    def nbytes(p):
        v = nodes[p].meta["val"]
        return v.numel() * v.element_size()

    (whole,) = grad_buckets(res.traced, res.choice, deferred, (2,))
    assert sorted(whole.params) == sorted(deferred)
    assert whole.nbytes == sum(nbytes(p) for p in deferred)
    cap = whole.nbytes / 3
    buckets = grad_buckets(res.traced, res.choice, deferred, (2,), cap)
    assert sorted(p for b in buckets for p in b.params) == sorted(deferred)
    for b in buckets:
        assert b.nbytes == sum(nbytes(p) for p in b.params)
        assert b.nbytes - nbytes(b.params[-1]) < cap  # closed by its last member
        assert b.ready == min(first_use(p) for p in b.params)
    for b, c in zip(buckets, buckets[1:]):
        assert b.ready >= c.ready
        assert min(first_use(p) for p in b.params) >= max(first_use(p) for p in c.params)


class _TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        return h, self.b(h)


def _two_heads_rank(rank, world, plan_path):
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(4, 8)
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), (x,), plan=plan_path)
    h, _ = pmodel(x)
    h.sum().backward()  # never reaches b: its bucket starts with a's gradients only
    return pmodel.grad_sync.num_buckets, {k: v.clone() for k, v in _full_grads(pmodel).items()}


@pytest.mark.slow
def test_a_bucket_backward_does_not_complete_starts_when_backward_ends(tmp_path):
    torch.manual_seed(0)
    model, x = _TwoHeads(), torch.randn(4, 8)
    path = tmp_path / "dp.json"
    autopar.plan(model, free_link_cpu(2), (x,), mesh_shape=(2,), axis_roles=(D,)).save(path)
    model(x)[0].sum().backward()
    for buckets, got in run_on_ranks(_two_heads_rank, 2, str(path)):
        assert buckets == 1
        assert set(got) == {"a.weight", "a.bias"}
        for name, g in got.items():
            torch.testing.assert_close(g, model.get_parameter(name).grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_half_model_priced_as_its_fp32_twin(zero):
    """Under bf16 mixed precision a model traced in bf16 runs as its fp32 twin does: the
    parameters are upcast to fp32 masters (``codegen/zero.py``), so the gradients all-reduced,
    and ZeRO-1's gathered parameters, are fp32 for both. The plans are priced the same (they were
    16-19% apart when the buckets and gathers took the traced dtype's bytes), and the buckets hold
    fp32 bytes."""
    import copy

    from autopar.examples import mlp
    from autopar.trades import Precision

    model, inputs = mlp(batch=64, hidden=512, ffn=2048)
    half = copy.deepcopy(model).to(torch.bfloat16)
    cluster = autopar.ClusterSpec.parse("h100-sxm:2x8")
    got = []
    for m in (model, half):
        res = autopar.search(
            m, cluster, inputs, mesh_shape=(16,), axis_roles=(D,), zero_stage=zero,
            precision=Precision.BF16, recompute="none", micro_batches=1,
        )  # fmt: skip
        got.append(res.plan.predicted)
        if zero == 0:
            deferred = deferred_grad_axes(res.traced, res.choice, (16,))
            buckets = grad_buckets(res.traced, res.choice, deferred, (16,), grad_dtype=torch.float32)
            assert sum(b.nbytes for b in buckets) == 4 * sum(
                n.meta["val"].numel() for n in res.traced.graph.nodes if n.name in deferred
            )
    fp32, bf16 = got
    assert bf16.step_time_s == pytest.approx(fp32.step_time_s, rel=1e-9)
    assert bf16.comm_s == pytest.approx(fp32.comm_s, rel=1e-9)
    assert bf16.peak_memory_bytes == fp32.peak_memory_bytes


def test_zero_one_gathers_priced_in_the_half_type():
    """Under mixed precision ZeRO-1 reduce-scatters fp32 gradients into the shares it steps and
    all-gathers their half copies (``codegen/zero_one.py``; ``passes/precision.py:
    compute_param_dtype``): its communication (the data-parallel plan sends nothing else) lies
    strictly between the fp32 model's in fp32 (fp32 both ways) and the bf16 model's in bf16 (bf16
    both ways). Gathers priced fp32 would price it as the fp32 model's."""
    from autopar.examples import mlp
    from autopar.trades import Precision

    cluster = autopar.ClusterSpec.parse("h100-sxm:2x8")
    comm = {}
    for dtype, precision in (
        (None, Precision.PARAM),
        (None, Precision.BF16),
        (torch.bfloat16, Precision.PARAM),
    ):
        model, inputs = mlp(batch=64, hidden=512, ffn=2048)
        if dtype is not None:
            model, inputs = (
                model.to(dtype),
                pytree.tree_map_only(torch.Tensor, lambda t, d=dtype: t.to(d), inputs),
            )
        res = autopar.search(
            model, cluster, inputs, mesh_shape=(16,), axis_roles=(D,), zero_stage=1,
            precision=precision, recompute="none", micro_batches=1,
        )  # fmt: skip
        comm[(dtype, precision)] = res.plan.predicted.comm_s
    fp32, mixed, bf16 = (
        comm[(None, Precision.PARAM)],
        comm[(None, Precision.BF16)],
        comm[(torch.bfloat16, Precision.PARAM)],
    )
    assert bf16 < mixed < fp32, comm


def test_zero_one_buckets_are_reduce_scattered():
    """Under ZeRO-1 the buckets of parameters its optimizer cuts into shares are reduce-scattered
    (``scatters``), priced as reduce-scatters, outer axis first, the next on ``1/n`` of the bytes:
    half an all-reduce's bytes on one axis."""
    from autopar.cost_model.comm import Collective, CommModel
    from autopar.passes.grad_sync import Bucket, bucket_all_reduce_s

    model, inputs = _build()
    res = autopar.search(model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,), zero_stage=1)
    deferred = deferred_grad_axes(res.traced, res.choice, (2,))
    plain = grad_buckets(res.traced, res.choice, deferred, (2,))
    shared = grad_buckets(res.traced, res.choice, deferred, (2,), scatter_axes=(0,))
    assert not any(b.scatter for b in plain)
    assert any(b.scatter for b in shared)
    assert sorted(p for b in shared for p in b.params) == sorted(deferred)
    vals = {n.name: n.meta["val"] for n in res.traced.graph.nodes if n.name in deferred}
    for b in shared:  # over one data axis every parameter but a scalar is cut (share_cut_of)
        assert all((vals[p].dim() > 0) == b.scatter for p in b.params)
    comm = CommModel(autopar.ClusterSpec.parse("h100-sxm:2x8"), (2, 8))
    b = Bucket((0, 1), ("w",), 2**26, 0, scatter=True)
    t, _ = bucket_all_reduce_s(b, comm)
    rs = comm.time(Collective.REDUCE_SCATTER, 2**26, 0) + comm.time(Collective.REDUCE_SCATTER, 2**25, 1)
    assert t == pytest.approx(rs)
    ar, _ = bucket_all_reduce_s(Bucket((0,), ("w",), 2**26, 0), comm)
    assert bucket_all_reduce_s(Bucket((0,), ("w",), 2**26, 0, scatter=True), comm)[0] < 0.6 * ar


def test_plan_lists_scattered_buckets_as_reduce_scatters():
    """The plan's collectives name a bucket's reduction as it runs and is priced
    (``passes/price.py:bucket_collectives``): a ZeRO-1 bucket reduce-scattered into the shares
    (``Bucket.scatter``) as reduce-scatters, the outer axis's on its bytes and the next on ``1/n``
    of them; the others as all-reduces. Every scattered bucket's members were listed as
    all-reduces before."""
    import dataclasses

    from autopar.passes.grad_sync import Bucket
    from autopar.passes.price import bucket_collectives
    from autopar.passes.trade_terms import zero_one_axes
    from autopar.plan import Site
    from autopar.reshard import Collective

    model, inputs = _build()
    res = autopar.search(model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,), zero_stage=1)
    deferred = deferred_grad_axes(res.traced, res.choice, (2,))
    buckets = grad_buckets(
        res.traced, res.choice, deferred, (2,), scatter_axes=zero_one_axes(res.plan.trades)
    )
    scattered = {p for b in buckets if b.scatter for p in b.params}
    assert scattered, "no bucket reduce-scattered under ZeRO-1"
    listed = {d.name: {c.kind for c in d.collectives if c.site is Site.BUCKET} for d in res.plan.decisions}
    for b in buckets:
        for p in b.params:
            want = Collective.REDUCE_SCATTER if b.scatter else Collective.ALL_REDUCE
            assert listed[p] == {want}, (p, listed[p])
    b = Bucket((0, 1), ("w",), 2**26, 0, scatter=True)
    calls = bucket_collectives(b, 3, (2, 8))
    assert [(c.kind, c.axis, c.nbytes, c.bucket) for c in calls] == [
        (Collective.REDUCE_SCATTER, 0, 2**26, 3),
        (Collective.REDUCE_SCATTER, 1, 2**25, 3),
    ]
    plain = bucket_collectives(dataclasses.replace(b, scatter=False), 3, (2, 8))
    assert [(c.kind, c.axis, c.nbytes) for c in plain] == [
        (Collective.ALL_REDUCE, 0, 2**26),
        (Collective.ALL_REDUCE, 1, 2**26),
    ]
