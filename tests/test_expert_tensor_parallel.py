"""Expert tensor parallelism (``passes/rules/experts.py``): each expert's MLP split on its
intermediate dim on an axis, tokens whole there, the output a summand.

Its strategies compute the op on real values (forward and backward, every rank simulated:
``autopar.tools.validate``), with gate and up separate or no gate, stored transposed or not, alone
and beside the other options on a second axis. A packed gate-up stack is split on its ``2I`` dim
from the order the module stores it in (``PackedSplit``: each piece a gate block and the matching
up block). The search takes it where it pays: on
a link priced free the plain MoE's experts split on the tensor axis; on loopback gloo's ~1 ms per
collective they stay whole there.
"""

from __future__ import annotations

import pytest
import torch
from harness import T, free_link_cpu

import autopar
from autopar.kernels import moe  # noqa: F401  (registers autopar::moe_experts)
from autopar.lowerings.experts import PackedSplit
from autopar.placement import Shard, is_shard, spec_from_str
from autopar.tools import validate
from autopar.tools.validate import check_op

MOE = torch.ops.autopar.moe_experts.default
E = autopar.AxisRole.EXPERT


def _args(layout: str, transposed: bool, t=8, h=4, i=4, e=4):
    """A layer's operands: ``layout`` "up" (gate and up separate), "plain" (no gate), "packed"."""
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64)

    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(t)])
    w_in = r(e, i, h) if transposed else r(e, h, i)
    if layout == "packed":
        w_in = torch.cat([w_in, r(*w_in.shape)], dim=1 if transposed else 2)
    w_up = (r(e, i, h) if transposed else r(e, h, i)) if layout == "up" else None
    w_out = r(e, h, i) if transposed else r(e, i, h)
    weights = torch.rand(t, 2, generator=g, dtype=torch.float64)
    return (r(t, h), weights, ids, w_in, w_up, w_out, "silu", layout != "plain", transposed, e)


def _etp(strategy: str, n_weights: int) -> bool:
    """Does the strategy (validate's text) split some expert weight on a dim other than ``E``?"""
    ins = strategy.split(" <- ")[1].split(" | ")
    return any(p not in ("R", "S(0)") for w in ins[3 : 3 + n_weights] for p in w.split(","))


def _experts_split(strategy: str) -> bool:
    """Does some axis split the experts (their dim ``E``: all-to-all or local experts)?"""
    return "S(0)" in strategy.split(" <- ")[1].split(" | ")[3]


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)], ids=str)
@pytest.mark.parametrize("layout,transposed", [("up", False), ("up", True), ("plain", False)], ids=str)
def test_expert_tensor_parallel_strategies_compute_the_op(layout, transposed, mesh):
    results = check_op(MOE, _args(layout, transposed), None, mesh)
    n_weights = 3 if layout == "up" else 2
    etp = [r for r in results if _etp(r.strategy, n_weights)]
    # one axis: the ETP option alone; two: on either axis, with each of the other axis's four
    # (replicated, data parallel, all-to-all, local experts), never on both (one dim split twice)
    assert len(etp) == (1 if len(mesh) == 1 else 8), [r.strategy for r in results]
    # those with the experts split on the other axis run a lowering that needs a process group:
    # tests/test_lowering_registry.py runs them (its MoE examples have gate and up separate)
    plain = [r for r in etp if not _experts_split(r.strategy)]
    assert len(plain) == (1 if len(mesh) == 1 else 4)
    for r in plain:
        assert r.ok, (r.strategy, r.detail)


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)], ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=str)
def test_a_packed_gate_up_stack_split_on_its_intermediate_dim_computes_the_op(transposed, mesh):
    """The packed ``w_in`` cut from its stored order (``PackedSplit``): each rank a gate block and
    the matching up block."""
    results = check_op(MOE, _args("packed", transposed), None, mesh)
    etp = [r for r in results if _etp(r.strategy, 2)]
    assert len(etp) == (1 if len(mesh) == 1 else 8), [r.strategy for r in results]
    plain = [r for r in etp if not _experts_split(r.strategy)]
    assert plain
    for r in plain:
        assert r.ok and not r.skipped, (r.strategy, r.detail)


def test_a_packed_gate_up_stack_cut_in_the_models_order_is_wrong(monkeypatch):
    """Without the stored order the same strategy fails: what ``PackedSplit`` is for."""
    monkeypatch.setattr(validate, "packed_split", lambda *a: None)
    results = check_op(MOE, _args("packed", True), None, (2,))
    etp = [r for r in results if _etp(r.strategy, 2)]
    assert etp and not any(r.ok for r in etp)


@pytest.mark.parametrize("size,parts", [(8, 2), (8, 4), (12, 3), (2, 1)])
def test_packed_split_pieces_are_matching_gate_and_up_blocks(size, parts):
    w = torch.arange(3 * size).view(3, size)  # [E, 2I] rows numbered: gate 0..I-1, up I..2I-1
    split = PackedSplit(dim=1, parts=parts)
    stored = split.to_stored(w)
    half, block = size // 2, size // (2 * parts)
    for c, piece in enumerate(stored.chunk(parts, dim=1)):
        gate, up = piece.chunk(2, dim=1)
        assert torch.equal(gate, w[:, c * block : (c + 1) * block])
        assert torch.equal(up, w[:, half + c * block : half + (c + 1) * block])
    assert torch.equal(split.from_stored(stored), w)


def test_packed_split_needs_whole_halves():
    with pytest.raises(ValueError, match="matching gate and up halves"):
        PackedSplit(dim=1, parts=2).to_stored(torch.zeros(2, 6))  # I = 3 does not split in 2


def test_a_packed_gate_up_read_by_another_op_is_not_split():
    """The module can keep a packed weight permuted only where this op alone reads it."""
    from autopar.passes.rules import make_ctx
    from autopar.passes.rules.experts import experts_rule

    node, _ = validate.one_node_graph(MOE, _args("packed", True))

    def n_etp() -> int:
        options = experts_rule(make_ctx(node))
        return sum(any(is_shard(p) and p.dim != 0 for p in o.ins[3:]) for o in options)

    assert n_etp() == 1
    w = node.args[3]
    with node.graph.inserting_after(node):
        node.graph.call_function(torch.ops.aten.clone.default, (w,))  # a second reader
    assert n_etp() == 0


def _moe_plan(cluster):
    from autopar.examples import moe_plain_tiny

    model, inputs = moe_plain_tiny(batch=4, seq=8)
    plan = autopar.plan(model, cluster, inputs, mesh_shape=(2, 2), axis_roles=(E, T))
    return plan, [d for d in plan.decisions if d.op == "autopar.moe_experts.default"]


def test_the_search_splits_the_experts_on_a_tensor_axis_only_where_it_pays():
    (free_plan, free), (gloo_plan, gloo) = (
        _moe_plan(c) for c in (free_link_cpu(4), autopar.ClusterSpec.preset("cpu", devices_per_node=4))
    )
    assert free and gloo
    # the summary's line for the tensor axis says so
    assert "intermediate dim split in 2 of 2 MoE layers (expert tensor parallel)" in free_plan.summary()
    assert "expert tensor parallel" not in gloo_plan.summary()
    for d in free:  # w_gate [E, H, F] on F, w_down [E, F, H] on F
        assert [spec_from_str(d.inputs[i])[1] for i in (3, 4, 5)] == [Shard(2), Shard(2), Shard(1)], d
    for d in gloo:
        assert all(spec_from_str(d.inputs[i])[1] == autopar.placement.R for i in (3, 4, 5)), d
