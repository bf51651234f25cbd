"""2D tensor-parallel matmuls (``Matmul2D``, ``autopar/lowerings/matmul_nd.py``) compute what one
device does.

Per op (linear with a 2-D or 3-D input, with and without a bias; ``mm``; ``addmm`` with a 1-D or 2-D
bias), every 2D strategy the search is offered on a 2 x 2 and a 2 x 2 x 2 mesh runs through the
real code generator on simulated ranks (``autopar/tools/validate.py``): forward and every input's
gradient equal the dense op's. The strategies are offered only on pairs of axes of one size that
may split weights. Then end to end on gloo, world 4 (a 2 x 2 mesh): tiny Llama (``aten.linear``)
and GPT-2 (``addmm``; its tied head a linear) with the 2D strategy forced on every matmul it is
legal for, by each algorithm (``GATHERED``, ``SUMMA``), the weights of the untied ones stored
split over both axes: losses and the full state after 2 Adam steps equal one device's, and the
generated code runs those matmuls so (on gathered operands, or as SUMMA's steps). And 2.5D on
world 8 (2 x 2 x 2): Llama with every linear on the grid of axes 1 and 2 and its batch split over
axis 0 (Tesseract's depth), the weights whole over it.
"""

from __future__ import annotations

import re
from html import escape

import pytest
import torch
from harness import adam_rank, adam_reference, assert_rank_as_reference, force_matmuls, matmul_forms
from torch.distributed.tensor.placement_types import Shard

import autopar
from autopar.launch import run_on_ranks
from autopar.lowerings.matmul_nd import OPERANDS, grid_axes, is_grid
from autopar.options import AxisRole
from autopar.placement import Matmul2D
from autopar.tools.validate import check_node, node_strategies, one_node_graph

aten = torch.ops.aten


@pytest.mark.parametrize("mesh", [(2, 2), (2, 2, 2)], ids=["2x2", "2x2x2"])
def test_every_2d_strategy_computes_the_dense_op(mesh):
    """Each is run by the simulator: SUMMA's real steps in a thread per rank."""
    m = 1
    for n in mesh:
        m *= n
    for op, args in matmul_forms(m):
        node, values = one_node_graph(op, args, {})
        grid = [s for s in node_strategies(node, mesh) if any(isinstance(v, Matmul2D) for v in s.via)]
        # on 2 x 2 both axis orders, both algorithms; on 2 x 2 x 2 every ordered pair, the third
        # axis any option
        assert {s.via[grid_axes(node, s)[0]] for s in grid} == set(Matmul2D), f"{op} on {mesh}"
        assert all(grid_axes(node, s) is not None for s in grid)
        for r in check_node(node, mesh, values, grid):
            assert r.ok and r.backward_error is not None, f"{op} on {mesh}: {r}"


def test_offered_only_on_a_square_grid_of_weight_splitting_axes():
    """Not on axes of different sizes, nor on an axis of one device, nor where an axis's role
    keeps weights whole (data parallelism)."""
    from autopar.passes.analyze import analyze
    from autopar.passes.strategies import build_strategies
    from autopar.passes.trace import trace

    node, _ = one_node_graph(aten.linear.default, (torch.randn(16, 8), torch.randn(8, 8)), {})
    assert not any(is_grid(s) for s in node_strategies(node, (2, 4)))
    assert not any(is_grid(s) for s in node_strategies(node, (1, 4)))
    assert any(is_grid(s) for s in node_strategies(node, (4, 4)))

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    tg = trace(model, (torch.randn(16, 8),))
    infos = analyze(tg)

    def grid_nodes(roles):
        built = build_strategies(tg, infos, (2, 2), roles)
        return {k for k, ns in built.items() if any(is_grid(s) for s in ns.strategies)}

    auto = grid_nodes((AxisRole.AUTO, AxisRole.AUTO))
    assert len(auto) == 2  # the two linears
    assert grid_nodes((AxisRole.TENSOR, AxisRole.AUTO)) == auto
    assert grid_nodes((AxisRole.DATA, AxisRole.AUTO)) == set()


# -- end to end on gloo ----------------------------------------------------------------------------

SEQ, HIDDEN, VOCAB, BATCH = 8, 32, 64, 4
LR, EPS, STEPS = 1e-2, 1e-5, 2
WORLD, MESH = 4, (2, 2)


def build(name):
    from autopar.examples import gpt2_tiny, llama_tiny

    kw = {"batch": BATCH, "seq": SEQ, "hidden": HIDDEN, "vocab": VOCAB}
    return {"llama": llama_tiny, "gpt2": gpt2_tiny}[name](**kw)


def grid_everywhere(plan, model, inputs, via: Matmul2D = Matmul2D.GATHERED, axes=(0, 1), depth=None):
    """``plan`` with every matmul that has a 2D strategy by ``via`` on ``axes`` running it (the
    first such: rows on the first batch-like dim free), and the weight and bias of each, where that
    matmul is their only use, stored as it takes them: split over both axes (``force_matmuls``).
    ``depth``: a third axis that splits the batch (dim 0) of the input and the output, the weights
    whole on it (2.5D, Tesseract's layout)."""

    def fits(n, s):
        if grid_axes(n, s) != axes or s.via[axes[0]] is not via:
            return False
        xi = OPERANDS[n.target][0]
        return depth is None or s.ins[xi][depth] == s.out[depth] == Shard(0)

    return force_matmuls(plan, model, inputs, fits)


@pytest.fixture(scope="module")
def grid_runs(tmp_path_factory):
    """Each model's free 2 x 2 plan made 2D on every matmul (``grid_everywhere``), trained on 4
    gloo ranks: (plans with their counts, per-rank results)."""
    plans, jobs = {}, []
    tmp = tmp_path_factory.mktemp("tp2d")
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=WORLD)
    for name in ("llama", "gpt2"):
        model, inputs = build(name)
        free = autopar.plan(model, cluster, inputs, mesh_shape=MESH)
        for via in Matmul2D:
            plans[(name, via)] = grid_everywhere(free, model, inputs, via)
            path = tmp / f"{name}_{via.value}.json"
            plans[(name, via)][0].save(path)
            jobs.append(((name, via), str(path)))
    return plans, run_on_ranks(adam_rank, WORLD, build, jobs, STEPS, LR, EPS, timeout_s=600)


# matmuls and weights (with biases) forced 2D: Llama's 7 linears a layer and the head, each weight
# its own; GPT-2's 4 Conv1D a layer (weight and bias) and the head, whose weight is the embedding's
EXPECTED = {"llama": (2 * 7 + 1, 2 * 7 + 1), "gpt2": (2 * 4 + 1, 2 * 4 * 2)}


# a matmul whose input and weight are all-gathers' outputs (an addmm's bias comes first)
GATHERED_MATMUL = re.compile(r"aten\.(?:linear|addmm|mm)\.default\((?:\w+, )?all_gather\w*, all_gather\w*")
SUMMA_CALL = re.compile(r"summa_matmul\(")


@pytest.mark.slow
@pytest.mark.parametrize("via", list(Matmul2D), ids=[v.value for v in Matmul2D])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_2d_matmuls_train_as_one_device(grid_runs, name, via):
    plans, per_rank = grid_runs
    plan, n_grid, n_stored = plans[(name, via)]
    assert (n_grid, n_stored) == EXPECTED[name]
    assert sum(via.value in d.via.split(",") for d in plan.decisions) == n_grid
    ref = adam_reference(*build(name), STEPS, LR, EPS)
    for rank, results in enumerate(per_rank):
        res = results[(name, via)]
        code, axes = assert_rank_as_reference(rank, res, ref, LR, STEPS)
        assert axes == {0, 1}
        if rank == 0:
            # every 2D matmul runs on its two gathered operands, or as SUMMA's steps
            ran = GATHERED_MATMUL.findall(code) if via is Matmul2D.GATHERED else SUMMA_CALL.findall(code)
            assert len(ran) == n_grid, code


@pytest.mark.parametrize("via", list(Matmul2D), ids=[v.value for v in Matmul2D])
def test_the_report_explains_and_the_export_refuses_a_2d_matmul(via):
    """The report's placement legend says what the algorithm does; PyTorch's parallelize_module
    styles split a weight on one axis, so a plan with a 2D matmul is refused naming the node, not
    exported as some other layout."""
    from autopar.export import ExportError
    from autopar.report import MATMUL_2D_MEANING, placement_legend

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    inputs = (torch.randn(16, 8),)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=WORLD)
    free = autopar.plan(model, cluster, inputs, mesh_shape=MESH)
    plan, n_grid, _ = grid_everywhere(free, model, inputs, via)
    assert n_grid == 2
    legend = placement_legend(plan)
    assert f"via {via.value}" in legend and escape(MATMUL_2D_MEANING[via].split(";")[0]) in legend
    assert "via " not in placement_legend(free)
    with pytest.raises(
        ExportError, match=rf"node linear\w* .* runs a 2D tensor-parallel matmul \({via.value}"
    ):
        autopar.to_torch(plan, model, inputs)


# -- 2.5D: a depth axis over the batch beside the 2D grid, world 8 -------------------------------------


@pytest.fixture(scope="module")
def depth_runs(tmp_path_factory):
    """Llama's free 2 x 2 x 2 plan made 2.5D (Tesseract: depth 2 over the batch on axis 0, a 2 x 2
    grid on axes 1 and 2) on every linear, by each algorithm, trained on 8 gloo ranks."""
    plans, jobs = {}, []
    tmp = tmp_path_factory.mktemp("tp25d")
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=8)
    model, inputs = build("llama")
    free = autopar.plan(model, cluster, inputs, mesh_shape=(2, 2, 2))
    for via in Matmul2D:
        plans[via] = grid_everywhere(free, model, inputs, via, axes=(1, 2), depth=0)
        path = tmp / f"llama_{via.value}.json"
        plans[via][0].save(path)
        jobs.append((("llama", via), str(path)))
    return plans, run_on_ranks(adam_rank, 8, build, jobs, STEPS, LR, EPS, timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("via", list(Matmul2D), ids=[v.value for v in Matmul2D])
def test_2p5d_matmuls_train_as_one_device(depth_runs, via):
    plans, per_rank = depth_runs
    plan, n_grid, n_stored = plans[via]
    assert (n_grid, n_stored) == EXPECTED["llama"]
    ref = adam_reference(*build("llama"), STEPS, LR, EPS)
    for rank, results in enumerate(per_rank):
        res = results[("llama", via)]
        code, axes = assert_rank_as_reference(rank, res, ref, LR, STEPS)
        assert axes == {0, 1, 2}
        if rank == 0:
            ran = GATHERED_MATMUL.findall(code) if via is Matmul2D.GATHERED else SUMMA_CALL.findall(code)
            assert len(ran) == n_grid, code
