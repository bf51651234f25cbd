"""Every registered lowering's generated code issues exactly the collectives its description prices.

For each lowering of ``autopar/lowerings`` (hypothesis over shapes, meshes of 1-3 axes, the rank,
and the strategies under which the lowering runs), the rank-local code ``codegen/lower.py`` emits
for one op, inputs already in their placements, runs forward and backward on a *fake* process group
(``torch.testing._internal.distributed.fake_pg``: every collective a no-op of the right shape, one
process standing for any rank of any world). A dispatch mode records each ``c10d`` collective the
code issues: its kind, the mesh axis of its group, its bytes, and whether it ran in forward or in
backward. They must equal ``describe(node, s, mesh).calls`` one for one: in order forward (the
code's order), as a multiset backward (autograd picks the order).

The recorded bytes follow the comm model's convention (``autopar/reshard.py``): an all-gather at its
gathered output, an all-reduce and an all-to-all at the tensor they send, a reduce-scatter at its
whole input (on gloo and the fake backend the code reduce-scatters as an all-reduce and a slice:
recorded as the reduce-scatter it stands for), a ring hop (a send and a receive) at the bytes sent.
An all-to-all receives what it sends (every rank stands for every other: the expert dispatch's
counts, exchanged first, size what arrives).

``test_a_wrong_description_fails`` mutates each family's description (a call dropped, an axis or a
byte count changed) and checks that the comparison catches it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from autopar import lowerings
from autopar.codegen import collectives as C
from autopar.codegen.experts_nodes import NODE_GROUPS_ATTR
from autopar.codegen.lower import LOWERINGS as EMITTERS
from autopar.lowerings import LOWERINGS, AxisGroup, Collective, Phase, lowering_of
from autopar.passes.rules import map_args, tensor_inputs
from autopar.placement import is_shard
from autopar.tools.validate import node_strategies, one_node_graph

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default

MESHES = [(1,), (2,), (4,), (2, 2), (1, 2), (2, 1, 2), (2, 2, 2), (4, 2)]


# -- the ops each lowering runs, as (op, args, kwargs) for a mesh of m ranks in all; k scales the ---
# -- sizes and the bits of `pick` choose the variant -------------------------------------------------


def _randn(*shape):
    return torch.randn(*shape, dtype=torch.float32)


def _cross_entropy(m, k, pick):
    n, c = m * k * 2, m * 3
    return aten.cross_entropy_loss.default, (_randn(n, c), torch.randint(0, c, (n,))), {}


def _linear_cross_entropy(m, k, pick):
    n, d, v = m * k * 2, 4, m * 3
    reduction = ("mean", "sum")[pick & 1]
    chunk = (pick >> 1) % 4  # several chunks per rank where small (0: the kernel's own size)
    args = (_randn(n, d), _randn(v, d), torch.randint(0, v, (n,)), -100, reduction, chunk)
    return torch.ops.autopar.linear_cross_entropy.default, args, {}


def _batch_norm(m, k, pick):
    n, c, h = m * k, 3, m
    args = (_randn(n, c, h), _randn(c), _randn(c), torch.zeros(c), torch.ones(c), True, 0.1, 1e-5, False)
    return aten.batch_norm.default, args, {}


def _sdpa(m, k, pick):
    b, h, seq, e = m, (m, 1)[pick & 1], m * k * 2, 4
    kv_heads = (h, 1)[(pick >> 1) & 1]  # grouped queries, or a single K/V head
    gqa = kv_heads != h
    q, key, v = _randn(b, h, seq, e), _randn(b, kv_heads, seq, e), _randn(b, kv_heads, seq, e)
    causal = not (pick >> 2) & 1
    return SDPA, (q, key, v, None, 0.0, causal), {"enable_gqa": gqa}


def _embedding(m, k, pick):
    return aten.embedding.default, (_randn(m * 3, 4), torch.randint(0, m * 3, (m * k, 2))), {}


def _index(m, k, pick):
    """``x[arange(n)]``: the index is the identity over x's rows (what lets the rows stay split),
    which the rule reads from the index's producer: a graph of two nodes."""
    n = m * k
    x, ids = _randn(n, 3), torch.arange(n)
    g = fx.Graph()
    ph = g.placeholder("x")
    ph.meta["val"] = x.to("meta")
    rng = g.call_function(aten.arange.default, (n,), {"dtype": torch.int64, "device": torch.device("cpu")})
    rng.meta["val"] = ids.to("meta")
    node = g.call_function(aten.index.Tensor, (ph, [rng]))
    node.meta["val"] = x.to("meta")
    g.output(node)
    return node, [x, ids]


def _mean(m, k, pick):
    dims = ([0], [1], [0, 1], [-1])[pick % 4]
    return aten.mean.dim, (_randn(m * k, m * 2), dims), {}


def _mse(m, k, pick):
    return aten.mse_loss.default, (_randn(m * k, m), _randn(m * k, m)), {}


def _moe(m, k, pick):
    """A mixture-of-experts layer: ``2 m k`` tokens, ``2 m`` experts (any axis splits them), top 2;
    gate and up packed or separate, weights stored transposed or not."""
    from autopar.kernels import moe  # noqa: F401  (registers autopar::moe_experts)

    t, h, f, e = m * k * 2, 4, 4, m * 2
    separate, transposed = bool(pick & 1), bool(pick & 2)
    ids = torch.stack([torch.randperm(e)[:2] for _ in range(t)])
    w_in = _randn(e, f, h) if transposed else _randn(e, h, f)
    if not separate:
        w_in = torch.cat([w_in, w_in], dim=1 if transposed else 2)
    w_up = (_randn(e, f, h) if transposed else _randn(e, h, f)) if separate else None
    w_out = _randn(e, h, f) if transposed else _randn(e, f, h)
    args = (_randn(t, h), torch.rand(t, 2), ids, w_in, w_up, w_out, "silu", True, transposed, e)
    return torch.ops.autopar.moe_experts.default, args, {}


def _moe_nodes(m, k, pick):
    """``_moe`` marked as planned for nodes of ``m / 2`` devices: on a mesh of one axis (or whose
    first axis strides by less than that) the axis spans whole nodes, and the dispatch once per node
    runs."""
    from autopar.lowerings.experts import NODES_META

    node, values = one_node_graph(*_moe(m, k, pick))
    node.meta[NODES_META] = max(1, m // 2)
    return node, values


def _matmul(m, k, pick):
    """A linear (3-D or 2-D input), ``mm`` or ``addmm`` (1-D or 2-D bias) whose rows, ``K`` and
    ``N`` divide over any axes of an ``m``-rank mesh; a linear's bias where ``pick >= 4``."""
    rows, kk, n = m * k * 2, 2 * m, 3 * m
    kind, more = pick % 4, pick >= 4
    if kind == 0:
        x, w = _randn(m, m * k, kk), _randn(n, kk)
        return aten.linear.default, (x, w, _randn(n)) if more else (x, w), {}
    if kind == 1:
        x, w = _randn(rows, kk), _randn(n, kk)
        return aten.linear.default, (x, w, _randn(n)) if more else (x, w), {}
    if kind == 2:
        return aten.mm.default, (_randn(rows, kk), _randn(kk, n)), {}
    bias = _randn(rows, n) if more else _randn(n)
    return aten.addmm.default, (bias, _randn(rows, kk), _randn(kk, n)), {}


EXAMPLES = {
    "expert_all_to_all": _moe,
    "expert_node_all_to_all": _moe_nodes,
    "local_experts": _moe,
    "cross_entropy_mean": _cross_entropy,
    "linear_cross_entropy": _linear_cross_entropy,
    "batch_norm_statistics": _batch_norm,
    "ring_attention": _sdpa,
    "sequence_all_to_all": _sdpa,
    "causal_attention_rows": _sdpa,
    "vocab_parallel_embedding": _embedding,
    "local_index": _index,
    "split_mean": _mean,
    "split_mse_loss": _mse,
    "matmul_2d_gathered": _matmul,
    "matmul_2d_summa": _matmul,
    "matmul_3d": _matmul,
}


def test_every_lowering_has_examples():
    """A lowering added to the registry without examples here would go unchecked."""
    assert set(EXAMPLES) == set(LOWERINGS)


# -- one op's generated code on a fake process group ------------------------------------------------


@contextlib.contextmanager
def _fake_world(mesh_shape, rank: int):
    if dist.is_initialized():
        raise RuntimeError("a process group is already set up in this process: this test needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(mesh_shape))
    try:
        yield init_device_mesh("cpu", tuple(mesh_shape))
    finally:
        dist.destroy_process_group()


_KINDS = {
    "allreduce_": Collective.ALL_REDUCE,
    "_allgather_base_": Collective.ALL_GATHER,
    "allgather_": Collective.ALL_GATHER,
    "alltoall_base_": Collective.ALL_TO_ALL,
    "_reduce_scatter_base_": Collective.REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced_": Collective.REDUCE_SCATTER,
    "send": Collective.SEND_RECV,
    "broadcast_": Collective.BROADCAST,
    "reduce_": Collective.REDUCE,
}


def _nbytes(t) -> int:
    return sum(x.numel() * x.element_size() for x in pytree.tree_leaves(t) if isinstance(x, torch.Tensor))


class _Recorder(TorchDispatchMode):
    """Records ``(kind, axis, bytes, phase, group)`` of each c10d collective (a receive is the
    other half of its hop's send; a reduce-scatter is recorded by ``_reduce_scatter`` as one call);
    ``group``: the whole axis's, or a rail or a node of it (``codegen/experts_nodes.py`` keeps
    those it makes on the mesh)."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.groups = [mesh.get_group(a) for a in range(mesh.ndim)]
        self.phase = Phase.FORWARD
        self.calls: list[tuple] = []
        self.paused = False

    def axis(self, args) -> tuple[int, AxisGroup]:
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    pg = dist.ProcessGroup.unbox(a)
                except RuntimeError:  # a ReduceOp
                    continue
                whole = [(i, AxisGroup.WHOLE) for i, g in enumerate(self.groups) if g is pg]
                parts = [
                    (axis, part)
                    for (axis, _), groups in getattr(self.mesh, NODE_GROUPS_ATTR, {}).items()
                    for part, g in zip((AxisGroup.RAIL, AxisGroup.NODE), groups)
                    if g is pg
                ]
                return (whole + parts)[0]
        raise AssertionError("a collective without a process group")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname if hasattr(func, "_opname") else str(func)
        if func.namespace == "c10d" and not self.paused and name != "recv_":
            kind = _KINDS[name]
            if kind is Collective.ALL_GATHER:
                nbytes = _nbytes(args[0])  # the gathered output (a list of parts, or one tensor)
            else:
                nbytes = _nbytes(args[0] if kind is not Collective.ALL_TO_ALL else args[1])
            axis, group = self.axis(args)
            self.calls.append((kind, axis, nbytes, self.phase, group))
        out = func(*args, **(kwargs or {}))
        if name == "alltoall_base_" and args[0].numel() == args[1].numel():
            # a symmetric world: every rank sends what this one sends (the fake backend moves
            # nothing), so counts exchanged first say what arrives (expert dispatch)
            args[0].copy_(args[1])
        return out


@contextlib.contextmanager
def _reduce_scatters_recorded(rec: _Recorder):
    orig = C._reduce_scatter

    def recorded(x, dim, mesh, axis):
        rec.calls.append((Collective.REDUCE_SCATTER, axis, _nbytes(x), rec.phase, AxisGroup.WHOLE))
        rec.paused = True
        try:
            return orig(x, dim, mesh, axis)
        finally:
            rec.paused = False

    C._reduce_scatter = recorded
    try:
        yield
    finally:
        C._reduce_scatter = orig


def _local_code(node: fx.Node, s, mesh_shape) -> fx.GraphModule:
    """The code ``codegen/lower.py`` emits for ``node`` under ``s``, its inputs already in place (no
    reshard, no Megatron "f": those are priced and checked as reshards)."""
    g = fx.Graph()
    phs = []
    for k, src in enumerate(tensor_inputs(node)):
        ph = g.placeholder(f"in{k}")
        ph.meta = dict(src.meta)
        phs.append(ph)
    ins = iter(phs)
    args, kwargs = map_args(node, lambda k, leaf: next(ins), lambda leaf: leaf.meta["val"])
    g.output(EMITTERS[node.target](g, node, args, kwargs, s, mesh_shape))
    return fx.GraphModule(torch.nn.Module(), g)


def _local_inputs(values, s, mesh_shape, rank: int) -> list[torch.Tensor]:
    """``rank``'s pieces of ``values`` under ``s`` (a Partial input: the whole value, one summand
    as good as another here); floating ones need a gradient."""
    coords = list(itertools.product(*[range(n) for n in mesh_shape]))[rank]
    out = []
    for v, spec in zip(values, s.ins):
        for a, p in enumerate(spec):
            if is_shard(p):
                v = v.chunk(mesh_shape[a], p.dim)[coords[a]]
        v = v.clone()
        out.append(v.requires_grad_() if v.dtype.is_floating_point else v)
    return out


def issued(node, values, s, mesh_shape, rank: int) -> list[tuple]:
    """The collectives the generated code of ``node`` under ``s`` issues on ``rank``."""
    code = _local_code(node, s, mesh_shape)
    with _fake_world(mesh_shape, rank) as mesh:
        ins = _local_inputs(values, s, mesh_shape, rank)
        rec = _Recorder(mesh)
        with C.bound_mesh(mesh), rec, _reduce_scatters_recorded(rec):
            outs = [o for o in pytree.tree_leaves(code(*ins)) if isinstance(o, torch.Tensor)]
            loss = sum(o.float().sum() for o in outs if o.requires_grad)
            if isinstance(loss, torch.Tensor):
                rec.phase = Phase.BACKWARD
                loss.backward()
    return rec.calls


def described(node, s, mesh_shape, values=None, rank: int = 0) -> list[tuple]:
    """The calls ``describe`` prices; for the dispatch once per node, whose bytes it prices at a
    balanced routing's expected copies, the same calls at the copies of this example's routing on
    ``rank`` (``_routed_copies``), after checking that ``describe`` is those calls at its copies."""
    calls = lowerings.describe(node, s, mesh_shape).calls
    if values is not None and lowering_of(node, s, mesh_shape) is LOWERINGS["expert_node_all_to_all"]:
        calls = _node_calls_as_routed(node, values, s, mesh_shape, rank, calls)
    return [(c.kind, c.axis, c.nbytes, c.phase, c.group) for c in calls]


def _node_calls_as_routed(node, values, s, mesh_shape, rank, calls):
    from autopar.lowerings.experts import expected_distinct, experts_axis, node_dispatch_calls, ranks_per_node

    a = experts_axis(s, mesh_shape)
    m, nodes = ranks_per_node(node, mesh_shape, a)
    x, weights, ids, w_in = (node.args[i].meta["val"] for i in range(4))
    experts, k, h = w_in.shape[0], ids.shape[1], x.shape[1]
    row, w = h * w_in.element_size(), weights.element_size()
    tokens = _local_inputs(values, s, mesh_shape, rank)[0].shape[0]
    expected = node_dispatch_calls(
        a, nodes, m, tokens * expected_distinct(experts, k, nodes),
        tokens * expected_distinct(experts, k, nodes * m), k, row, w,
    )  # fmt: skip
    assert tuple(calls) == expected, f"describe's calls are not node_dispatch_calls': {calls}"
    rail, inside = _routed_copies(
        _local_inputs(values, s, mesh_shape, rank)[2], experts, m, nodes, mesh_shape, a, rank
    )
    return node_dispatch_calls(a, nodes, m, rail, inside, k, row, w)


def _routed_copies(ids, experts, m, nodes, mesh_shape, axis, rank):
    """The rows rank ``rank`` sends over its rail and inside its node for its tokens' ``ids`` on the
    fake world (every rank sends what it receives: the copies that reach this rank's node are its
    own, whatever their destination node)."""
    coord = list(itertools.product(*[range(n) for n in mesh_shape]))[rank][axis]
    per_rank = experts // (m * nodes)
    my_node = coord // m
    rail = inside = 0
    for t in ids.tolist():
        dest_nodes = {e // (per_rank * m) for e in t}
        here = {e // per_rank for e in t if e // (per_rank * m) == my_node}
        rail += len(dest_nodes)
        inside += len(dest_nodes) * len(here)
    return rail, inside


def same_calls(got: list[tuple], want: list[tuple]) -> bool:
    """Forward in order, backward as a multiset; bytes to float rounding."""

    def key(c):
        return (c[0].value, c[1], round(float(c[2]), 6), c[3].value, c[4].value)

    fwd = [key(c) for c in got if c[3] is Phase.FORWARD], [key(c) for c in want if c[3] is Phase.FORWARD]
    bwd = (
        sorted(key(c) for c in got if c[3] is Phase.BACKWARD),
        sorted(key(c) for c in want if c[3] is Phase.BACKWARD),
    )
    return fwd[0] == fwd[1] and bwd[0] == bwd[1]


def build(name: str, m: int, k: int, pick: int):
    """The node of ``name``'s example and its input values (``rules.tensor_inputs`` order)."""
    made = EXAMPLES[name](m, k, pick)
    return made if isinstance(made[0], fx.Node) else one_node_graph(*made)


def _case(name: str, data):
    """An op of lowering ``name`` on a drawn mesh, a strategy under which ``name`` runs it (None
    where no strategy of this example does), the rank."""
    mesh_shape = data.draw(st.sampled_from(MESHES), label="mesh")
    m = math.prod(mesh_shape)
    k, pick = data.draw(st.integers(1, 2), label="k"), data.draw(st.integers(0, 7), label="pick")
    node, values = build(name, m, k, pick)
    mine = [
        s for s in node_strategies(node, mesh_shape) if lowering_of(node, s, mesh_shape) is LOWERINGS[name]
    ]
    if not mine:
        return None
    s = data.draw(st.sampled_from(mine), label="strategy")
    return node, values, s, mesh_shape, data.draw(st.integers(0, m - 1), label="rank")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(data=st.data())
def test_generated_code_issues_what_the_lowering_describes(name, data):
    case = _case(name, data)
    assume(case is not None)  # a mesh or an example under which this lowering never runs
    node, values, s, mesh_shape, rank = case
    got, want = issued(node, values, s, mesh_shape, rank), described(node, s, mesh_shape, values, rank)
    assert same_calls(got, want), (
        f"{name} on {mesh_shape} rank {rank} under {s}:\nissued {got}\npriced {want}"
    )


# the smallest mesh each lowering runs on, where it is not 2 x 2: a 3D matmul's cube
SMALLEST = {"matmul_3d": (2, 2, 2), "expert_node_all_to_all": (4,)}


def _on_smallest(name: str):
    """Every (node, values, strategy) of ``name``'s examples under which it runs on its smallest
    mesh (``SMALLEST``, else 2 x 2)."""
    mesh = SMALLEST.get(name, (2, 2))
    for k in (1, 2):
        for pick in range(8):
            node, values = build(name, math.prod(mesh), k, pick)
            for s in node_strategies(node, mesh):
                if lowering_of(node, s, mesh) is LOWERINGS[name]:
                    yield node, values, s


# -- the comparison catches a wrong description -----------------------------------------------------


def _mutations(want: list[tuple]) -> list[list[tuple]]:
    out = [want[:-1]] if want else [[(Collective.ALL_REDUCE, 0, 8.0, Phase.FORWARD, AxisGroup.WHOLE)]]
    if want:
        kind, axis, nbytes, phase, group = want[0]
        out.append([(kind, axis, nbytes * 2 + 4, phase, group)] + want[1:])
        out.append([(kind, axis + 1, nbytes, phase, group)] + want[1:])
        if group is not AxisGroup.WHOLE:  # the other part of the axis's group
            other = AxisGroup.NODE if group is AxisGroup.RAIL else AxisGroup.RAIL
            out.append([(kind, axis, nbytes, phase, other)] + want[1:])
    return out


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_wrong_description_fails(name):
    """On a 2 x 2 mesh (a 3D matmul: 2 x 2 x 2), under the first strategy of each variant of the example that runs ``name``
    (so the property above is never vacuous for it): the code issues what is described, and
    dropping a call, changing its bytes or moving it to another axis fails the comparison (for the
    lowerings that issue nothing, so does a call the code does not issue)."""
    cases, seen = [], set()
    mesh = SMALLEST.get(name, (2, 2))
    for node, values, s in _on_smallest(name):
        key = (str(node.args[1:]), tuple(str(x) for x in node.args[0].meta["val"].shape))
        if key not in seen:
            seen.add(key)
            cases.append((node, values, s))
    assert cases, f"no example of {name} runs under a strategy of a {mesh} mesh"
    for node, values, s in cases:
        got, want = issued(node, values, s, mesh, 1), described(node, s, mesh, values, 1)
        assert same_calls(got, want), f"{name} under {s}: issued {got}, priced {want}"
        for bad in _mutations(want):
            assert not same_calls(got, bad), f"{name}: {bad} passed for {got}"


def test_the_ring_is_priced_hop_by_hop():
    """Ring attention on 4 ranks: 3 K/V hops forward; backward 3 K/V hops and 4 gradient hops,
    the last hidden by nothing; the rest hide in windows of a third (forward) and two thirds
    (backward) of the op's compute over the ring."""
    node, _ = build("ring_attention", 4, 1, 0)
    s = next(
        s for s in node_strategies(node, (4,)) if lowering_of(node, s, (4,)) is LOWERINGS["ring_attention"]
    )
    calls = lowerings.describe(node, s, (4,)).calls
    fwd = [c for c in calls if c.phase is Phase.FORWARD]
    bwd = [c for c in calls if c.phase is Phase.BACKWARD]
    assert len(fwd) == 3 and len(bwd) == 7
    assert {c.hides for c in fwd} == {1 / 12} and [c.window for c in bwd].count(None) == 1
    priced = lowerings.price_calls(calls, lambda c: 1.0, 0.0)
    assert sum(t for _, t in priced) == len(calls)  # nothing to hide behind: every hop whole
    hidden = lowerings.price_calls(calls, lambda c: 1.0, 1e9)
    assert sum(t for _, t in hidden) == 1.0  # everything hides but the last gradient hop
    assert dataclasses.replace(calls[0], hides=0.5) != calls[0]
