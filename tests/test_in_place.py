"""In-place ops under forced data parallelism: an in-place op keeps the batch split (its
out-of-place twin's rule, ``self`` taken as the output is), a write no later op sees leaves its
target free to split, one that a later op sees through a view keeps it whole and the error names the
in-place op; a check on made-up values draws indices below the size of the dim they index
(``passes/index_bounds.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import D, sgd_losses
from hypothesis import given
from hypothesis import strategies as st
from rules_check import SETTINGS, assert_rules_hold, randn

import autopar
from autopar.errors import NoPlanFitsError
from autopar.passes.index_bounds import index_bound
from autopar.passes.trace import trace
from autopar.placement import OwnRows, via_from_str

aten = torch.ops.aten


def _cpu(world: int = 2) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.preset("cpu", devices_per_node=world)


@SETTINGS
@given(
    op=st.sampled_from([aten.div_.Tensor, aten.mul_.Tensor, aten.add_.Tensor, aten.sub_.Tensor]),
    rows=st.sampled_from([2, 4, 6]),
    cols=st.sampled_from([2, 4]),
    other=st.sampled_from(["same", "column", "row"]),
    mesh=st.sampled_from([(2,), (2, 2)]),
)
def test_in_place_rules_hold(op, rows, cols, other, mesh):
    """Every strategy of an in-place binary op (its twin's, ``self`` as the output is) computes
    the dense op, forward and backward, the write landing in the value it returns."""
    shape = {"same": (rows, cols), "column": (rows, 1), "row": (cols,)}[other]
    strategies = assert_rules_hold(op, (randn((rows, cols), 1, True), randn(shape, 2, True)), None, mesh)
    assert len(strategies) > 1  # more than all-Replicate: the op splits


class Router(torch.nn.Module):
    """A top-k router as DeepSeek-V3 writes it: the chosen experts' scores gathered, then
    normalized in place (``w /= w.sum()``) after their sum has read them; an MSE loss."""

    def __init__(self, hidden: int = 8, experts: int = 4):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts)
        self.head = torch.nn.Linear(2, 1)

    def forward(self, x, y):
        scores = self.gate(x).sigmoid()
        top = scores.topk(2, dim=-1)[1]
        w = scores.gather(1, top)
        w /= w.sum(dim=-1, keepdim=True) + 1e-20
        return F.mse_loss(self.head(w * 2.5).squeeze(-1), y)


def test_a_gather_normalized_in_place_keeps_the_batch_split():
    """The gather and the in-place division each run on their rows (Shard(0), no region)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8)
    plan = autopar.plan(Router(), _cpu(), (x, y), mesh_shape=(2,), axis_roles=(D,))
    ops = {d.op: d for d in plan.decisions}
    for op in ("aten.gather.default", "aten.div_.Tensor"):
        assert ops[op].output == "S(0)", (op, ops[op].output)
        assert OwnRows.LOCAL not in via_from_str(ops[op].via), op


class Halved(torch.nn.Module):
    """Dropout, then half of the features scaled in place through a view (``h[:, :4].mul_``) and
    the whole ``h`` read after: the write lands in ``h`` only if ``h`` and the view are one storage,
    so the view and the write take ``h`` as it is stored, here split on the batch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        h = F.dropout(self.lin(x), 0.1, self.training)
        h[:, :4].mul_(0.5)
        return F.mse_loss(self.head(torch.tanh(h)).squeeze(-1), y)


class FirstRows(Halved):
    """``Halved`` scaling the batch's first two rows in place (``h[:2].mul_``): a slice of the
    batch dim, which no rule runs on a rank's rows."""

    def forward(self, x, y):
        h = F.dropout(self.lin(x), 0.1, self.training)
        h[:2].mul_(0.5)
        return F.mse_loss(self.head(torch.tanh(h)).squeeze(-1), y)


def test_an_in_place_write_through_a_view_keeps_the_batch_split():
    """The base, its view and the write all take the batch split, one storage on each rank (no
    reshard between them: it would copy the value and lose the write). That such a write lands on
    real ranks: DeepSeek-V3's MLA in ``test_data_region.py`` and ``test_expert_parallel_dist.py``."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4)
    model = Halved().eval()  # no dropout: the ranks' rows against one device's
    plan = autopar.plan(model, _cpu(), (x, y), mesh_shape=(2,), axis_roles=(D,))
    ops = {d.op: d for d in plan.decisions}
    for op in ("aten.dropout.default", "aten.slice.Tensor", "aten.mul_.Tensor"):
        if op in ops:
            assert ops[op].output == "S(0)" and all(i == "S(0)" for i in ops[op].inputs[:1]), ops[op]
    assert "aten.mul_.Tensor" in ops, sorted(ops)


def test_a_split_blocked_by_an_in_place_write_names_the_write():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8), torch.randn(4)
    with pytest.raises(
        NoPlanFitsError,
        match=r"aten\.mul_\.Tensor \(node mul_\) writes in place into slice_1, which aten\.tanh\.default "
        r"\(node tanh\) reads after the write.*as it is stored.*write it out of place",
    ):
        autopar.plan(FirstRows(), _cpu(), (x, y), mesh_shape=(2,), axis_roles=(D,))


class Indexed(torch.nn.Module):
    """Integer values indexing dims of several sizes: a scatter over one group (dim of size 1),
    a gather over 4 experts, an embedding of 10 rows, ``x[idx]`` over the batch's 8 rows."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, x, ids):
        group = x[:, :1]
        pick = group.topk(1, dim=-1)[1]
        mask = torch.zeros_like(group).scatter_(1, pick, 1.0)
        top = x.topk(2, dim=-1)[1]
        w = x.gather(1, top.view(-1, 2))
        order = x[:, 0].argsort()
        return (mask.sum() + w.sum() + self.emb(ids).sum() + x[order].sum(),)


def test_index_bounds_come_from_the_size_of_the_dim_indexed():
    """Each index's bound is the size of the dim it indexes (through a view: ``top.view``); on a
    rank's rows, the batch's dim counts as one rank's share of it; a value that indexes nothing has
    none."""
    x, ids = torch.randn(8, 4), torch.randint(0, 10, (8, 3))
    g = trace(Indexed(), (x, ids)).graph
    n = {node.name: node for node in g.nodes}
    scatter = next(v for v in n.values() if v.target is aten.scatter_.value)
    assert index_bound(scatter.args[2]) == 1  # the one group: only index 0 is valid
    gather = next(v for v in n.values() if v.target is aten.gather.default)
    top = gather.args[2].args[0]  # the topk indices, before the view
    assert index_bound(top) == 4
    assert index_bound(n["ids"]) == 10
    argsort = next(v for v in n.values() if v.target is aten.argsort.default)
    assert index_bound(argsort) == 8
    assert index_bound(argsort, rows={n["x"].name: 0}, parts=2) == 4
    assert index_bound(n["x"]) is None
    # only the users named count
    assert index_bound(n["ids"], within=()) is None


def _router():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return Router(), (torch.randn(8, 8, generator=gen), torch.randn(8, generator=gen))


def _router_rank(rank, world, path):
    model, (x, y) = _router()
    pm = autopar.autoparallelize(model, _cpu(world), (x, y), plan=path)
    return sgd_losses(pm, x, y), pm.full_state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("role", [D, autopar.AxisRole.TENSOR, autopar.AxisRole.AUTO])
def test_a_router_normalized_in_place_trains_as_one_device(role, tmp_path):
    """Whatever the plan makes of the in-place division (the batch split, or whole), two SGD steps
    on 2 gloo ranks give the single-device losses and weights."""
    from autopar.launch import run_on_ranks

    model, (x, y) = _router()
    path = tmp_path / "plan.json"
    autopar.plan(model, _cpu(), (x, y), mesh_shape=(2,), axis_roles=(role,)).save(path)
    ref = sgd_losses(model, x, y)
    for losses, state in run_on_ranks(_router_rank, 2, str(path)):
        for a, b in zip(losses, ref):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=k)
