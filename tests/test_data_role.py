"""``AxisRole.DATA`` means data parallelism: the batch stays split through every op, weights are
used whole and their gradients all-reduced in buckets, which the ILP prices once per bucket."""

from __future__ import annotations

import pytest
import torch
from harness import D, collective_axes, padded

import autopar
from autopar.examples import gpt2_tiny, llama_tiny, mlp, t5_tiny
from autopar.launch import run_on_ranks
from autopar.passes.analyze import analyze
from autopar.passes.costs import build_costs
from autopar.passes.grad_sync import deferred_grad_axes, grad_buckets, plan_uses
from autopar.passes.solver import bucket_axes, evaluate, solve
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import Role, trace
from autopar.placement import is_shard

MODELS = {
    "mlp": lambda: mlp(batch=16, hidden=32, ffn=64),
    "gpt2": lambda: gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "llama": lambda: llama_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "t5": lambda: t5_tiny(batch=4, seq=16, hidden=32, heads=4, vocab=128),
    # a padding mask: Hugging Face indexes the whole mask with batch and key indices, so the data
    # role must let an integer mask be gathered (floating tensors still never are)
    "gpt2_padded": lambda: padded(*gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)),
    "llama_padded": lambda: padded(*llama_tiny(batch=4, seq=16, hidden=32, vocab=128)),
}


def _cpu(world: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.preset("cpu", devices_per_node=world)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_data_role_keeps_the_batch_split_and_the_weights_whole(name):
    """On gloo's ~1 ms per collective the cheapest plan of a tiny model gathers the batch; the data
    role must not: no floating tensor split on the data axis is gathered or re-split there, every
    weight is used as stored, and the weights' gradients go to buckets."""
    model, inputs = MODELS[name]()
    res = autopar.search(model, _cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,))
    tg, choice = res.traced, res.choice
    deferred = deferred_grad_axes(tg, choice, (2,))
    params = {p.name for p in tg.placeholders if p.role is Role.PARAM}
    split = 0
    for u in plan_uses(tg, choice, deferred):
        if u.user.op != "call_function":
            continue  # the graph's outputs are returned whole
        have = choice[u.src].out
        if u.src in params:
            assert u.need == have, (u.user.name, u.src)
        elif u.inp.meta["val"].dtype.is_floating_point and is_shard(have[0]):
            split += 1
            assert u.need == have, (u.user.name, u.src, have, u.need)
    assert split >= 3, "the batch flows split through the ops"
    assert deferred and len(grad_buckets(tg, choice, deferred, (2,))) == 1


def test_the_ilp_pays_a_data_parallel_bucket_once():
    """Every weight's "f" on the data axis is priced as a share of one bucket, and the bucket's
    fixed price once however many weights join it: the solver's objective is the tables' sum
    plus that one fixed price."""
    model, inputs = MODELS["mlp"]()
    tg = trace(model, inputs)
    infos = analyze(tg)
    cluster, mesh, roles = _cpu(2), (2,), (D,)
    tables = build_costs(
        tg, infos, build_strategies(tg, infos, mesh, roles), cluster, mesh, autopar.Optimizer.SGD, roles
    )
    sol = solve(tables, float("inf"))
    chosen = [
        e for e in tables.edges if e.bucketed is not None and e.bucketed[sol.choice[e.src]][sol.choice[e.dst]]
    ]
    assert len(chosen) == 4  # two weights, two biases
    assert bucket_axes(tables, sol.choice) == {0}
    paid = sum(tables.node_cost[v][s] for v, s in sol.choice.items())
    paid += sum(
        e.cost[sol.choice[e.src]][0 if e.dst == "output" else sol.choice[e.dst]] for e in tables.edges
    )
    assert sol.objective == pytest.approx(paid + tables.bucket_fixed[0])
    assert evaluate(tables, sol.choice)[0] == pytest.approx(sol.objective)


def _mlp_rank(rank, world, path):
    model, (x, target) = MODELS["mlp"]()
    pm = autopar.autoparallelize(model, _cpu(world), (x, target), plan=path)
    loss, y = pm(x, target)
    loss.backward()
    grads = pm.full_grads()
    return loss.detach(), y.detach(), grads, collective_axes(pm)


@pytest.mark.slow
def test_a_data_parallel_mse_loss_matches_one_device(tmp_path):
    """The mlp's mean squared error over a split batch (``broadcast_tensors`` and ``mse_loss``
    rules, the mean divided by the pieces): loss, output and gradients of the single device."""
    model, (x, target) = MODELS["mlp"]()
    path = tmp_path / "dp.json"
    autopar.plan(model, _cpu(2), (x, target), mesh_shape=(2,), axis_roles=(D,)).save(path)
    ref_loss, ref_y = model(x, target)
    ref_loss.backward()
    for loss, y, grads, axes in run_on_ranks(_mlp_rank, 2, str(path)):
        assert axes == {0}  # the loss's and the gradient buckets' all-reduces
        torch.testing.assert_close(loss, ref_loss.detach())
        torch.testing.assert_close(y, ref_y.detach())
        for name, g in grads.items():
            torch.testing.assert_close(g, model.get_parameter(name).grad, rtol=1e-5, atol=1e-6)


def test_the_default_search_weighs_data_parallelism_on_each_mesh():
    """Without roles every mesh of one or two axes is also searched with axis 0 data parallel
    (the free search prices each weight's gradient all-reduce on its own, not in a bucket): the
    default plan is never predicted slower than the data-role plan."""
    model, inputs = MODELS["gpt2"]()
    auto = autopar.plan(model, _cpu(2), inputs)
    dp = autopar.plan(model, _cpu(2), inputs, axis_roles=(D,))
    # an entry per trades rung tried (pipeline stages' candidates aside: passes/pipeline.py), the
    # data-parallel candidate first (passes/candidates.py:mesh_runs)
    roles = [c.get("axis_roles") for c in auto.solver.candidates if not c.get("pipeline_stages")]
    assert [r for i, r in enumerate(roles) if i == 0 or r != roles[i - 1]] == [["data"], None]
    assert auto.predicted.step_time_s <= dp.predicted.step_time_s * (1 + 1e-9)


class _TokenLoss(torch.nn.Module):
    """Logits of a linear layer, cast to ``dtype``, and their mean cross-entropy (ignored tokens
    left out of the mean)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)
        self.dtype = dtype

    def forward(self, x, target):
        return torch.nn.functional.cross_entropy(self.lin(x).to(self.dtype), target)


def _token_loss_inputs():
    torch.manual_seed(0)
    x = torch.randn(70_000, 8)
    target = torch.randint(0, 16, (70_000,))
    target[:3001] = -100  # rank 0's half holds all the ignored tokens: the mean needs the global count
    return x, target


def _token_loss_rank(rank, world, path, dtype):
    from autopar.codegen import collectives as C

    torch.manual_seed(0)
    model = _TokenLoss(dtype)
    x, target = _token_loss_inputs()
    pm = autopar.autoparallelize(model, _cpu(world), (x, target), plan=path)
    # the count's all-reduce started at the top of the forward, the sum's where the loss is made
    # (codegen/module.py:defer_output_sums); no other
    kinds = (C.all_reduce, C.all_reduce_started, C.mean_deferred)
    reduces = [sum(n.target is k for n in pm.local.graph.nodes) for k in kinds]
    loss = pm(x, target)
    loss.backward()
    grads = pm.full_grads()
    return reduces, loss.detach(), grads


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_split_mean_cross_entropy_is_one_all_reduce_and_the_single_device_loss(tmp_path, dtype):
    """A mean cross-entropy over a batch split in two, ignored tokens all on one rank: the token
    count all-reduced from the top of the forward and the loss sum where the loss is made, waited
    for where it is read (the price counts one all-reduce of the pair), and the loss and gradients
    of the single device in float32. In float16 each rank's sum (~110,000) and the count
    (66,999) are past float16's largest number: they are summed in float32."""
    x, target = _token_loss_inputs()
    torch.manual_seed(0)
    model = _TokenLoss(dtype)
    path = tmp_path / "dp.json"
    plan = autopar.plan(model, _cpu(2), (x, target), mesh_shape=(2,), axis_roles=(D,))
    plan.save(path)
    ce = next(d for d in plan.decisions if "cross_entropy" in d.op)
    assert ce.inputs[0].startswith("S(0)")
    torch.manual_seed(0)
    ref_model = _TokenLoss(torch.float32)
    ref = ref_model(x, target)
    ref.backward()
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-4}
    for reduces, loss, grads in run_on_ranks(_token_loss_rank, 2, str(path), dtype):
        assert loss.dtype == dtype
        torch.testing.assert_close(loss.float(), ref.detach(), **tol)
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_model.get_parameter(name).grad, **tol)
        assert reduces == [0, 1, 1]


def test_a_role_no_plan_can_honour_names_the_op_that_prevents_it():
    """A running sum over the batch mixes samples: forced data parallelism has no plan at any
    memory limit, and the error says so and names the op, not memory."""

    class Running(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.lin(x).cumsum(0), y)

    torch.manual_seed(0)
    inputs = {"x": torch.randn(4, 8), "y": torch.randint(0, 4, (4,))}
    with pytest.raises(autopar.NoPlanFitsError) as err:
        autopar.plan(Running(), _cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,))
    text = str(err.value)
    assert "axis roles cannot be honoured" in text and "aten.cumsum" in text, text
    assert "GiB" not in text, text
    # the same model plans without the role (the running sum then runs on the whole batch)
    assert autopar.plan(Running(), _cpu(2), inputs, mesh_shape=(2,)).mesh_shape == (2,)


class CNN(torch.nn.Module):
    """Conv, BatchNorm2d in training (running statistics updated), pooling, a linear head."""

    def __init__(self, running_stats: bool = True):
        super().__init__()
        self.conv = torch.nn.Conv2d(
            3, 8, 3, padding=1, bias=False
        )  # a bias before BN has no gradient: Adam would step on noise
        self.bn = torch.nn.BatchNorm2d(8, track_running_stats=running_stats)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, y):
        h = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2).mean((2, 3))
        return torch.nn.functional.cross_entropy(self.head(h), y)


class LastTokenClassifier(torch.nn.Module):
    """Per-sample indexing ``h[arange(B), last]`` (every Hugging Face ``*ForSequenceClassification``
    pools so) and an in-place add into a matmul's output (Falcon's residual)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, ids, y):
        h = self.emb(ids)
        z = self.a(h)
        z.add_(self.b(h))
        last = (ids != 0).sum(-1) - 1
        return torch.nn.functional.cross_entropy(self.head(z)[torch.arange(ids.shape[0]), last], y)


class SelfAttention(torch.nn.Module):
    """``nn.MultiheadAttention``, whose output projection runs on rows ``L * B`` merged with the
    batch inner (``passes/merged_rows.py`` keeps them apart), then an MSE loss."""

    def __init__(self):
        super().__init__()
        # no bias: the key bias has no gradient (softmax ignores a constant per query): Adam steps on noise
        self.attn = torch.nn.MultiheadAttention(16, 4, batch_first=True, bias=False)
        self.head = torch.nn.Linear(16, 16)

    def forward(self, x, y):
        h, _ = self.attn(x, x, x, need_weights=False)
        return torch.nn.functional.mse_loss(self.head(h), y)


def _per_sample_models():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32, (4, 6), generator=g)
    ids[1, 4:] = 0
    ids[3, 2:] = 0
    return {
        "cnn": (
            CNN(),
            {"x": torch.randn(4, 3, 8, 8, generator=g), "y": torch.randint(0, 4, (4,), generator=g)},
        ),
        "last_token": (LastTokenClassifier(), {"ids": ids, "y": torch.randint(0, 3, (4,), generator=g)}),
        "attention": (
            SelfAttention(),
            {"x": torch.randn(4, 6, 16, generator=g), "y": torch.randn(4, 6, 16, generator=g)},
        ),
    }


def _per_sample_rank(rank, world, paths):
    out = {}
    for name, (model, inputs) in _per_sample_models().items():
        pm = autopar.autoparallelize(model, _cpu(world), inputs, plan=paths[name])
        out[name] = (_two_adam_steps(pm, inputs), pm.full_state_dict())
    return out


def _two_adam_steps(module, inputs) -> list[torch.Tensor]:
    """The losses of 2 Adam steps of ``module`` (parallel or the model itself) on its own loss."""
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        loss = module(**inputs)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.slow
def test_data_parallel_batch_norm_and_per_sample_indexing_train_as_one_device(tmp_path):
    """Forced data parallelism on ops with their own rules for a split batch: batch norm
    (statistics all-reduced, running statistics the whole batch's on every rank), ``h[arange(B),
    last]`` (each rank indexes its own rows), an in-place add into an activation, and
    ``nn.MultiheadAttention`` (its rows merged with the batch inner, kept apart). Losses and the
    full state (running statistics included) after 2 Adam steps equal one device's."""
    paths = {}
    for name, (model, inputs) in _per_sample_models().items():
        plan = autopar.plan(model, _cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,))
        paths[name] = str(tmp_path / f"{name}.json")
        plan.save(paths[name])
    want = {}
    for name, (model, inputs) in _per_sample_models().items():
        want[name] = (_two_adam_steps(model, inputs), model.state_dict())
    for got in run_on_ranks(_per_sample_rank, 2, paths):
        for name, (losses, state) in got.items():
            torch.testing.assert_close(losses, want[name][0], rtol=1e-5, atol=1e-6)
            assert state.keys() == want[name][1].keys()
            for k, v in state.items():
                torch.testing.assert_close(v, want[name][1][k], rtol=1e-4, atol=1e-5, msg=f"{name} {k}")


def test_per_sample_index_and_batch_norm_strategies_compute_the_dense_ops():
    """Every strategy of every node of both models, on real values (the identity index's values
    come from its ``arange``), all ranks simulated through the real lowering: forward and backward
    equal the dense op (``autopar.tools.validate``)."""
    from autopar.tools.validate import validate_graph

    for name, (model, inputs) in _per_sample_models().items():
        tg = trace(model, inputs)
        problems = [p for p in validate_graph(tg, (2,), inputs, max_per_node=None) if p.kind != "missing"]
        assert not problems, (name, [str(p) for p in problems])
        per_sample = {
            "last_token": torch.ops.aten.index.Tensor,
            "cnn": torch.ops.aten.batch_norm.default,
            "attention": torch.ops.aten.scaled_dot_product_attention.default,
        }[name]
        node = next(n for n in tg.graph.nodes if n.target is per_sample)
        strategies = build_strategies(tg, analyze(tg), (2,))[node.name].strategies
        assert any(is_shard(s.ins[0][0]) and s.ins[0][0].dim == 0 for s in strategies), name


def test_a_merge_of_rows_with_the_batch_is_undone_and_computes_the_same():
    """``nn.MultiheadAttention``'s ``reshape(L * B, E) -> out_proj -> view(L, B, E)``: the traced
    graph's reshape keeps ``L, B`` apart, and the graph computes the model's loss."""
    from autopar.passes.merged_rows import unmerge_row_reshapes
    from autopar.tools.validate import placeholder_values

    model, inputs = _per_sample_models()["attention"]
    tg = trace(model, inputs)
    reshapes = [n.args[1] for n in tg.graph.nodes if n.target is torch.ops.aten.reshape.default]
    assert [6, 4, 16] in reshapes and not [r for r in reshapes if len(r) == 2], reshapes
    assert unmerge_row_reshapes(tg.graph_module) == 0  # nothing left to undo
    got = tg.graph_module(*placeholder_values(tg, inputs, seed=0))
    torch.testing.assert_close(got[0] if isinstance(got, (tuple, list)) else got, model(**inputs))
