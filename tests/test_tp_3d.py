"""3D tensor-parallel matmuls (``Matmul3D``, ``autopar/lowerings/matmul_nd.py``) compute what one
device does.

Per op (linear with a 2-D or 3-D input, with and without a bias; ``mm``; ``addmm`` with a 1-D or 2-D
bias), every 3D strategy the search is offered on a 2 x 2 x 2 mesh runs through the real code
generator on simulated ranks (``autopar/tools/validate.py``): forward and every input's gradient
equal the dense op's. The strategies are offered only where a third axis of the grid's size makes
it a slice of a cube. Then end to end on gloo, world 8 (2 x 2 x 2): tiny Llama (``aten.linear``)
and GPT-2 (``addmm``; its tied head a linear) with every matmul run as 3D on axes 1 and 2, the
batch split over axis 0 where the input has a batch dim beside the gathered one (Llama's linears
and GPT-2's head; GPT-2's Conv1D rows are one dim, so axis 0 keeps them whole there), the weights
of the untied ones stored split over the grid: losses and the full state after 2 Adam steps equal
one device's, and the generated code runs each of those matmuls as a gather, one product and a
reduce-scatter. The report explains a 3D matmul and the export to PyTorch's plans refuses it.
"""

from __future__ import annotations

import re

import pytest
import torch
from harness import adam_rank, adam_reference, assert_rank_as_reference, force_matmuls, matmul_forms
from torch.distributed.tensor.placement_types import Shard

import autopar
from autopar.launch import run_on_ranks
from autopar.lowerings import lowering_of
from autopar.lowerings.matmul_nd import MATMUL_3D, OPERANDS, cube_axes
from autopar.placement import Matmul3D, R
from autopar.tools.validate import check_node, node_strategies, one_node_graph

aten = torch.ops.aten
CUBE = (2, 2, 2)


def test_every_3d_strategy_computes_the_dense_op():
    """Every ordered pair of the cube's axes, every batch-like dim gathered, the third axis any
    option: forward and gradients equal the dense op's on simulated ranks."""
    for op, args in matmul_forms(8):
        node, values = one_node_graph(op, args, {})
        cube = [s for s in node_strategies(node, CUBE) if any(isinstance(v, Matmul3D) for v in s.via)]
        assert cube, op
        assert all(lowering_of(node, s, CUBE) is MATMUL_3D for s in cube)
        assert {cube_axes(node, s)[:2] for s in cube} == {
            (b, c) for b in range(3) for c in range(3) if b != c
        }
        for r in check_node(node, CUBE, values, cube):
            assert r.ok and r.backward_error is not None, f"{op}: {r}"


def test_offered_only_on_a_cube():
    """Not without a third axis of the grid's size (2 x 2, 2 x 2 x 4 puts none on the 4), nor on an
    axis whose role keeps weights whole."""
    node, _ = one_node_graph(aten.linear.default, (torch.randn(8, 16, 8), torch.randn(8, 8)), {})

    def pairs(mesh):
        return {cube_axes(node, s)[:2] for s in node_strategies(node, mesh) if cube_axes(node, s)}

    assert pairs((2, 2)) == set()
    assert pairs((4, 4)) == set()
    assert pairs((2, 2, 4)) == set()
    assert pairs((2, 4, 4, 4)) == {(b, c) for b in (1, 2, 3) for c in (1, 2, 3) if b != c}
    assert pairs(CUBE) == {(b, c) for b in range(3) for c in range(3) if b != c}


# -- end to end on gloo, world 8 --------------------------------------------------------------------

SEQ, HIDDEN, VOCAB, BATCH, LAYERS = 8, 32, 64, 4, 1  # one layer: 8 ranks on a busy 2-core machine
LR, EPS, STEPS = 1e-2, 1e-5, 2


def build(name):
    from autopar.examples import gpt2_tiny, llama_tiny

    kw = {"batch": BATCH, "seq": SEQ, "hidden": HIDDEN, "vocab": VOCAB, "layers": LAYERS}
    return {"llama": llama_tiny, "gpt2": gpt2_tiny}[name](**kw)


def cube_everywhere(plan, model, inputs):
    """Every matmul as 3D on axes 1 (gather) and 2 (reduce-scatter), axis 0 splitting the batch
    (dim 0) of input and output where the gathered dim is another, else keeping the input whole."""

    def fits(n, s):
        axes = cube_axes(n, s)
        if axes is None or axes[:2] != (1, 2):
            return False
        x = s.ins[OPERANDS[n.target][0]]
        return x[0] == s.out[0] == (Shard(0) if axes[2] != 0 else R)

    return force_matmuls(plan, model, inputs, fits)


@pytest.fixture(scope="module")
def cube_runs(tmp_path_factory):
    """Each model's free 2 x 2 x 2 plan with every matmul 3D, trained on 8 gloo ranks."""
    plans, jobs = {}, []
    tmp = tmp_path_factory.mktemp("tp3d")
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=8)
    for name in ("llama", "gpt2"):
        model, inputs = build(name)
        free = autopar.plan(model, cluster, inputs, mesh_shape=CUBE)
        plans[name] = cube_everywhere(free, model, inputs)
        path = tmp / f"{name}.json"
        plans[name][0].save(path)
        jobs.append(((name,), str(path)))
    return plans, run_on_ranks(adam_rank, 8, build, jobs, STEPS, LR, EPS, timeout_s=600)


# matmuls forced 3D and weights (with biases) stored so: Llama's 7 linears a layer and the head,
# each weight its own; GPT-2's 4 Conv1D a layer (weight and bias) and the head (the embedding's)
EXPECTED = {"llama": (LAYERS * 7 + 1, LAYERS * 7 + 1), "gpt2": (LAYERS * 4 + 1, LAYERS * 4 * 2)}
# the 3D lowering's product: a gathered input and the weight, no bias (added after the reduce-scatter)
CUBE_MATMUL = re.compile(r"aten\.(?:linear|mm)\.default\(all_gather\w*, \w+\)")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_3d_matmuls_train_as_one_device(cube_runs, name):
    plans, per_rank = cube_runs
    plan, n_cube, n_stored = plans[name]
    assert (n_cube, n_stored) == EXPECTED[name]
    assert sum(Matmul3D.GATHERED.value in d.via.split(",") for d in plan.decisions) == n_cube
    ref = adam_reference(*build(name), STEPS, LR, EPS)
    for rank, results in enumerate(per_rank):
        res = results[(name,)]
        code, axes = assert_rank_as_reference(rank, res, ref, LR, STEPS)
        assert axes == {0, 1, 2}
        if rank == 0:
            assert len(CUBE_MATMUL.findall(code)) == n_cube, code


def test_the_report_explains_and_the_export_refuses_a_3d_matmul():
    """The report's placement legend says what the 3D algorithm does; PyTorch's parallelize_module
    styles split a weight on one axis, so a plan with a 3D matmul is refused naming the node."""
    from html import escape

    from autopar.export import ExportError
    from autopar.report import MATMUL_2D_MEANING, placement_legend

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    inputs = (torch.randn(4, 8, 8),)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=8)
    free = autopar.plan(model, cluster, inputs, mesh_shape=CUBE)
    plan, n_cube, _ = cube_everywhere(free, model, inputs)
    assert n_cube == 2
    legend = placement_legend(plan)
    meaning = MATMUL_2D_MEANING[Matmul3D.GATHERED]
    assert "via 3d" in legend and escape(meaning.split(":")[0]) in legend
    assert "via " not in placement_legend(free)
    with pytest.raises(ExportError, match=r"node linear\w* .* runs a 3D tensor-parallel matmul \(\S*3d"):
        autopar.to_torch(plan, model, inputs)
