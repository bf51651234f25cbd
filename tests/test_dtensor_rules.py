"""Options derived from PyTorch's DTensor strategies (``passes/rules/dtensor.py``) are correct.

For ops users' models contain that autopar has no rule of its own for, random small shapes and
meshes of 1 and 2 axes: every strategy the search would be given (the derived options expanded
over the mesh, all-Replicate included) is checked forward and backward by the validator
(``autopar.tools.validate``, all ranks simulated in one process through the real lowering), as
``test_rules_property.py`` does for autopar's own rules; and the derived options do appear (a
batch-sharded baddbmm, a stack sharded off its new dim, ...).
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from rules_check import SETTINGS, assert_rules_hold, randn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autopar.passes import strategies as strategies_mod
from autopar.passes.rules import RULES, AxisOption, dtensor
from autopar.tools.validate import check_node, node_strategies, one_node_graph

aten = torch.ops.aten

MESHES = [(2,), (3,), (2, 2)]
SIZES = [1, 2, 3, 4, 6]
meshes = st.sampled_from(MESHES)
sizes = st.sampled_from(SIZES)

# the ops this file covers: none may have a rule of autopar's own (else the derived options are unused)
OPS = [
    aten.baddbmm.default,
    aten.stack.default,
    aten.max_pool2d_with_indices.default,
    aten.avg_pool2d.default,
    aten.index_select.default,
    aten.flip.default,
    aten.roll.default,
    aten.sort.default,
    aten.topk.default,
    aten.amax.default,
    aten.logsumexp.default,
    aten.var_mean.correction,
    aten.repeat.default,
    aten.hardtanh.default,
    # through DTensor's decomposition path (CompositeImplicit ops a pre-dispatch graph keeps)
    aten.unflatten.int,
    aten.repeat_interleave.self_int,
    aten.numpy_T.default,
    aten.max_pool2d.default,
    aten.adaptive_avg_pool2d.default,
    aten.group_norm.default,
]
# user-named ops that get no derived option, and why (asserted below, so that a torch that starts
# offering one is noticed):
# - clamp_: writes its input (a resharded input is a copy: the write would be lost); clamp has a rule
# - native_batch_norm / batch_norm: DTensor shards the output on channels and the saved statistics
#   on their dim 0; AxisOption has one placement for all outputs (the batch split needs the
#   statistics of the whole batch: DTensor offers none; autopar's own rule, passes/rules/nn.py,
#   all-reduces them, as SyncBatchNorm does)
NONE = [aten.clamp_.default, aten.batch_norm.default, aten.native_batch_norm.default]


def _has(found, out, ins, axis=0) -> bool:
    return any(s.out[axis] == out and tuple(x[axis] for x in s.ins) == ins for s in found)


# which ops DTensor has strategies for depends on torch: 2.13 answers for pooling, group_norm,
# convolution and (through decompositions) unflatten; 2.11 for fewer of them. Correctness is checked
# on both; that an option appears, for those, only on 2.13 and later.
TORCH_213 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _has_since_213(found, out, ins, axis=0) -> bool:
    return _has(found, out, ins, axis) or not TORCH_213


def test_covered_ops_have_no_rule_of_their_own():
    assert not [op for op in OPS if op in RULES]


@SETTINGS
@given(b=sizes, m=sizes, k=sizes, n=sizes, mesh=meshes, alpha=st.sampled_from([1, 0.5]))
def test_baddbmm(b, m, k, n, mesh, alpha):
    args = (randn((b, m, n), 1), randn((b, m, k), 2), randn((b, k, n), 3))
    found = assert_rules_hold(aten.baddbmm.default, args, {"alpha": alpha, "beta": 0.5}, mesh)
    if b % mesh[0] == 0 and b >= mesh[0]:
        assert _has(found, Shard(0), (Shard(0), Shard(0), Shard(0)))  # batch-sharded


@SETTINGS
@given(
    shape=st.lists(sizes, min_size=1, max_size=3).map(tuple),
    n_in=st.integers(1, 3),
    mesh=meshes,
    data=st.data(),
)
def test_stack(shape, n_in, mesh, data):
    dim = data.draw(st.integers(-len(shape) - 1, len(shape)))
    tensors = [randn(shape, i) for i in range(n_in)]
    found = assert_rules_hold(aten.stack.default, (tensors, dim), None, mesh)
    d = dim % (len(shape) + 1)
    k = next((i for i, s in enumerate(shape) if s % mesh[0] == 0 and s >= mesh[0]), None)
    # (torch 2.11's stack strategy shifts every Shard dim for a negative ``dim``: wrong, and dropped by
    # the local shape check; so the option is only required for dim >= 0)
    if k is not None and dim >= 0:  # input dim k sharded: output dim k, shifted past the new dim
        assert _has(found, Shard(k + (k >= d)), (Shard(k),) * n_in)


POOLS = {
    "max_with_indices": (aten.max_pool2d_with_indices.default, [2, 2]),
    "max": (aten.max_pool2d.default, [2, 2]),
    "avg": (aten.avg_pool2d.default, [2, 2]),
    "adaptive_avg": (aten.adaptive_avg_pool2d.default, [1, 1]),
}


@SETTINGS
@given(n=sizes, c=sizes, hw=st.sampled_from([2, 4, 6]), mesh=meshes, op=st.sampled_from(sorted(POOLS)))
def test_pool2d(n, c, hw, mesh, op):
    target, size = POOLS[op]
    found = assert_rules_hold(target, (randn((n, c, hw, hw)), size), None, mesh)
    for d, s in enumerate((n, c)):
        if s % mesh[0] == 0 and s >= mesh[0]:
            assert _has_since_213(found, Shard(d), (Shard(d),))  # batch and channels


@SETTINGS
@given(n=sizes, groups=st.sampled_from([1, 2]), per=sizes, length=sizes, affine=st.booleans(), mesh=meshes)
def test_group_norm(n, groups, per, length, affine, mesh):
    c = groups * per
    wb = (randn((c,), 1), randn((c,), 2)) if affine else (None, None)
    found = assert_rules_hold(aten.group_norm.default, (randn((n, c, length)), groups, *wb, 1e-5), None, mesh)
    if n % mesh[0] == 0 and n >= mesh[0]:
        assert _has_since_213(found, Shard(0), (Shard(0),) + (Replicate(),) * (2 if affine else 0))


@SETTINGS
@given(rows=sizes, a=st.sampled_from([1, 2, 3]), b=st.sampled_from([1, 2]), mesh=meshes, data=st.data())
def test_unflatten_repeat_interleave_numpy_t(rows, a, b, mesh, data):
    x = randn((rows, a * b))
    found = assert_rules_hold(aten.unflatten.int, (x, 1, [a, b]), None, mesh)
    if rows % mesh[0] == 0 and rows >= mesh[0]:
        assert _has_since_213(found, Shard(0), (Shard(0),))
    dim = data.draw(st.sampled_from([0, 1, -1]))
    assert_rules_hold(aten.repeat_interleave.self_int, (x, data.draw(st.integers(1, 3)), dim), None, mesh)
    found = assert_rules_hold(aten.numpy_T.default, (x,), None, mesh)
    if rows % mesh[0] == 0 and rows >= mesh[0]:
        assert _has(found, Shard(1), (Shard(0),))


@SETTINGS
@given(rows=sizes, cols=sizes, mesh=meshes, data=st.data())
def test_data_movement(rows, cols, mesh, data):
    x = randn((rows, cols))
    dim = data.draw(st.sampled_from([0, 1, -1]))
    idx = torch.randint(0, x.shape[dim], (data.draw(sizes),), generator=torch.Generator().manual_seed(5))
    assert_rules_hold(aten.index_select.default, (x, dim, idx), None, mesh)
    assert_rules_hold(aten.flip.default, (x, [dim]), None, mesh)
    assert_rules_hold(aten.roll.default, (x, [1], [dim]), None, mesh)
    assert_rules_hold(aten.repeat.default, (x, [data.draw(st.integers(1, 2)), 1]), None, mesh)


@SETTINGS
@given(rows=sizes, cols=sizes, mesh=meshes, data=st.data())
def test_sort_topk_and_reductions(rows, cols, mesh, data):
    x = randn((rows, cols))
    dim = data.draw(st.sampled_from([0, 1]))
    found = assert_rules_hold(aten.sort.default, (x, dim), None, mesh)
    other = 1 - dim
    if x.shape[other] % mesh[0] == 0 and x.shape[other] >= mesh[0]:
        assert _has(found, Shard(other), (Shard(other),))
    assert_rules_hold(aten.topk.default, (x, data.draw(st.integers(1, x.shape[dim])), dim), None, mesh)
    keepdim = data.draw(st.booleans())
    assert_rules_hold(aten.amax.default, (x, [dim], keepdim), None, mesh)
    assert_rules_hold(aten.logsumexp.default, (x, [dim], keepdim), None, mesh)
    assert_rules_hold(aten.var_mean.correction, (x, [dim]), {"keepdim": keepdim}, mesh)
    assert_rules_hold(aten.hardtanh.default, (x, -0.5, 0.5), None, mesh)


def test_only_expressible_placements_are_derived():
    """Every derived option is Replicate / Shard / Partial(sum), never all-Replicate, and nothing is
    derived for an op that writes its input (``clamp_``: a resharded input would be a copy)."""
    for target, args in [
        (aten.amax.default, (randn((4, 6)), [1])),  # DTensor also offers Partial("max"): dropped
        (aten.baddbmm.default, (randn((4, 2, 6)), randn((4, 2, 2)), randn((4, 2, 6)))),
        (aten.index_select.default, (randn((4, 6)), 0, torch.tensor([0, 3]))),  # masked partials: dropped
    ]:
        node, _ = one_node_graph(target, args)
        opts = dtensor.options(node, (2,))
        assert opts, target
        for o in opts:
            assert all(type(p) in (Replicate, Shard, Partial) for p in (o.out, *o.ins)), o
            assert all(p.reduce_op == "sum" for p in (o.out, *o.ins) if isinstance(p, Partial)), o
            assert not all(isinstance(p, Replicate) for p in (o.out, *o.ins)), o


def test_user_named_ops_without_options():
    """See ``NONE``: clamp_ writes its input; batch norm's outputs would be placed differently."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 6, device="meta")
    node = g.call_function(aten.clamp_.default, (x, -1.0, 1.0))
    node.meta["val"] = torch.empty(4, 6, device="meta")
    assert dtensor.options(node, (2,)) == []
    c = randn((2,))
    with torch.no_grad():
        for target, extra in [(aten.batch_norm.default, (False,)), (aten.native_batch_norm.default, ())]:
            node, _ = one_node_graph(
                target, (randn((4, 2, 3, 3)), c, c, c.clone(), c.abs(), True, 0.1, 1e-5, *extra)
            )
            assert dtensor.options(node, (2,)) == [], target
    assert [op for op in NONE if op in RULES] == [aten.batch_norm.default]  # autopar's own rule


def test_registry_failure_means_replicated(monkeypatch, caplog):
    """Anything torch's registry raises means no options (logged once), never a failed plan."""

    def boom(*a, **k):
        raise RuntimeError("registry changed")

    prop = dtensor._propagator()
    for table in ("op_single_dim_strategy_funcs", "op_strategy_funcs"):
        if aten.baddbmm.default in getattr(prop, table, {}):
            monkeypatch.setitem(getattr(prop, table), aten.baddbmm.default, boom)
    monkeypatch.setattr(dtensor, "_CACHE", {})
    monkeypatch.setattr(dtensor, "_warned", set())
    node, _ = one_node_graph(aten.baddbmm.default, (randn((4, 2, 6)), randn((4, 2, 3)), randn((4, 3, 6))))
    with caplog.at_level(logging.INFO, logger=dtensor.__name__):
        assert dtensor.options(node, (2,)) == []
        assert dtensor.options(node, (2, 4)) == []
    assert sum("registry changed" in r.getMessage() for r in caplog.records) == 1
    assert len(node_strategies(node, (2,))) == 1  # all-Replicate only


def test_options_are_cached_per_shape():
    node, _ = one_node_graph(aten.baddbmm.default, (randn((4, 2, 6)), randn((4, 2, 3)), randn((4, 3, 6))))
    first = dtensor.options(node, (2,))
    assert dtensor.options(node, (2,)) == first and any(k[0] is node.target for k in dtensor._CACHE)


def test_build_strategies_uses_derived_options_only_without_a_rule():
    from autopar.passes.analyze import analyze
    from autopar.passes.trace import trace

    class M(torch.nn.Module):
        def forward(self, x, a, b):
            return torch.baddbmm(x, a, b).clamp(-1, 1)

    tg = trace(M(), (randn((4, 2, 6)), randn((4, 2, 3)), randn((4, 3, 6))))
    strat = strategies_mod.build_strategies(tg, analyze(tg), (2,))
    by_target = {ns.node.target: ns for ns in strat.values() if ns.node.op == "call_function"}
    bad = by_target[aten.baddbmm.default]
    assert bad.has_rule and _has(bad.strategies, Shard(0), (Shard(0),) * 3)
    clamp = next(ns for t, ns in by_target.items() if t in RULES and "clamp" in str(t))
    opts = RULES[clamp.node.target]
    assert opts is not None and clamp.has_rule


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_conv_derived_batch_sharding(mesh):
    """convolution: DTensor shards its batch (its other options need halo exchange: not offered)."""
    args = (
        randn((4, 2, 5, 5)),
        randn((3, 2, 3, 3), 1),
        randn((3,), 2),
        [1, 1],
        [1, 1],
        [1, 1],
        False,
        [0, 0],
        1,
    )
    if aten.convolution.default in RULES:
        pytest.skip("convolution has a rule of autopar's own")
    found = assert_rules_hold(aten.convolution.default, args, None, mesh)
    assert _has_since_213(found, Shard(0), (Shard(0), Replicate(), Replicate()))


def test_validator_catches_a_wrong_derived_option(monkeypatch):
    """The gate works on derived options too: a wrong one (baddbmm's batch split claimed to give
    a Partial sum) is reported WRONG by the validator."""
    wrong = AxisOption(Partial(), (Shard(0), Shard(0), Shard(0)))
    monkeypatch.setattr(dtensor, "_CACHE", {})
    monkeypatch.setattr(dtensor, "_derive", lambda node, n: [wrong])
    node, values = one_node_graph(
        aten.baddbmm.default, (randn((4, 2, 6)), randn((4, 2, 3)), randn((4, 3, 6)))
    )
    found = node_strategies(node, (2,))
    assert len(found) == 2
    results = check_node(node, (2,), values, found)
    assert [r.ok for r in results] == [True, False]


def test_coverage_lists_dtensor_derived_ops():
    import autopar

    class M(torch.nn.Module):
        def forward(self, x, a, b):
            return torch.baddbmm(x, a, b).clamp_(-1, 1)

    rows = {r.op: r for r in autopar.coverage(M(), (randn((4, 2, 6)), randn((4, 2, 3)), randn((4, 3, 6))))}
    assert rows["aten.baddbmm.default"].dtensor and not rows["aten.baddbmm.default"].has_rule
    assert not rows["aten.clamp_.default"].dtensor  # writes its input: replicated
