"""FP8 linears (``autopar/lowerings/float8.py``, ``codegen/float8.py``) as the search prices and
chooses them and as the generated code runs them.

Compared against torchao itself: one FP8 linear, forward and backward, against torchao's
``Float8Linear`` of the same recipe (bit for bit: the same casts and scaled matmuls); a tiny Llama
with every linear forced FP8 on 2 gloo ranks (tensor parallel, data parallel) against the
single-device model converted by torchao's ``convert_to_float8_training`` with the same recipe:
losses and weights after two Adam steps; the amax all-reduces the generated code issues against
the description's calls; and the search's choice against the plan priced without FP8.

torch runs ``torch._scaled_mm`` on CPU (float8_e4m3fn operands, tensorwise and rowwise scales), so
none of this needs a GPU; ``benchmarks/gpu_float8.sh`` runs the loss-curve check where one is.

Tolerances: with each amax reduced over the axes that shard it, a rank casts its piece with the
single device's scale, so the FP8 rounding is the same; what differs is the fp32 summation order of
the split matmuls (a row-parallel linear's partial sums), which can move a value feeding a later
cast across an FP8 rounding boundary: one e4m3 step is 2^-3 of the value (12.5%) on that element,
a few such elements move a loss by far less than 1e-3 of itself, and a weight's Adam update by a
share of one step (``assert_adam_state_close``'s bound, 1/10 of ``steps * lr``, with ``rtol`` at
e4m3's half step, 2^-4).
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist

torchao_float8 = pytest.importorskip("torchao.float8")

from harness import adam_reference  # noqa: E402

import autopar  # noqa: E402
from autopar import AxisRole, Float8  # noqa: E402
from autopar.examples import llama_tiny  # noqa: E402
from autopar.launch import run_on_ranks  # noqa: E402

warnings.filterwarnings("ignore", message=".*register_constant.*")

CPU2 = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
STEPS, LR, EPS = 2, 1e-2, 1e-3
RECIPES = (Float8.TENSORWISE, Float8.ROWWISE)


def _build():
    return llama_tiny(batch=4, seq=16, layers=2, hidden=64, vocab=64)


# -- one linear, one process ----------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("bias", [False, True])
def test_one_fp8_linear_is_torchaos_float8_linear(recipe, bias):
    from torchao.float8.float8_linear import Float8Linear

    from autopar.codegen.float8 import float8_config, float8_linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=bias)
    ref = Float8Linear.from_float(copy.deepcopy(lin), config=float8_config(recipe.value)[0])
    x = torch.randn(3, 5, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    w = lin.weight.detach().clone().requires_grad_()
    b = lin.bias.detach().clone().requires_grad_() if bias else None
    y = float8_linear(x, w, b, recipe.value, ((),) * 6)
    want = ref(x2)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    dy = torch.randn_like(y)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, ref.weight.grad, rtol=0, atol=0)
    if bias:
        torch.testing.assert_close(b.grad, ref.bias.grad, rtol=0, atol=0)
    # FP8 is FP8: the plain linear differs by e4m3's rounding, a few % of the output (measured:
    # 3.5-5.5%; else the comparison above could not fail)
    assert (y - lin(x.detach())).abs().max() > 1e-2 * y.abs().max()


# -- a model on 2 ranks vs torchao on one -----------------------------------------------------------


def _float8_reference(recipe: Float8):
    from torchao.float8 import convert_to_float8_training

    from autopar.codegen.float8 import float8_config

    model, inputs = _build()
    model = convert_to_float8_training(model, config=float8_config(recipe.value)[0])
    return adam_reference(model, inputs, STEPS, LR, EPS)


@functools.cache
def _plan(role: AxisRole, recipe: Float8):
    model, inputs = _build()
    return autopar.plan(model, CPU2, inputs, mesh_shape=(2,), axis_roles=(role,), float8=recipe)


def _rank(rank: int, world: int, plan_path: str):
    import autopar.codegen.float8 as F8

    issued = []
    reduce = F8.amax_all_reduce

    def counted(amax, group):  # the amax all-reduces the generated code issues: scales per call
        issued.append(amax.numel())
        reduce(amax, group)

    F8.amax_all_reduce = counted
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, CPU2, inputs, plan=plan_path)
    opt = pmodel.optimizer(torch.optim.Adam, lr=LR, eps=EPS)
    losses, per_step = [], []
    for _ in range(STEPS):
        before = len(issued)
        loss = pmodel(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        per_step.append(issued[before:])
    return losses, pmodel.full_state_dict(), per_step, pmodel.local.code


# per plan: (role, recipe, loss rtol, update rtol). Tensorwise scales are the single device's
# exactly (each amax reduced), so only fp32 summation order differs: 1e-5 / 1e-4. Rowwise: the scaled
# matmul writes its output in bf16 (torchao's rowwise GEMM), so a contraction split over ranks rounds
# each partial sum to bf16 (2^-9) before adding them, and later casts turn that into FP8 steps on a
# few elements: the update of every weight within one e4m3 step (2^-3) of the reference's
# (measured: 0.072), losses within 2e-3 (measured: 5e-4)
CASES = {
    "tp-tensorwise": (AxisRole.TENSOR, Float8.TENSORWISE, 1e-5, 1e-4),
    "tp-rowwise": (AxisRole.TENSOR, Float8.ROWWISE, 2e-3, 2**-3),
    "dp-tensorwise": (AxisRole.DATA, Float8.TENSORWISE, 1e-5, 1e-4),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_linears_on_two_ranks_train_as_torchao_on_one(tmp_path, case):
    from autopar.lowerings.float8 import AMAX_ITEM

    role, recipe, loss_rtol, update_rtol = CASES[case]
    plan = _plan(role, recipe)
    model, _ = _build()
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert len(plan.float8_linears) == linears and set(plan.float8_linears.values()) == {recipe}
    assert f"FP8 linears: {linears} of {linears}" in plan.summary()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert autopar.Plan.load(path).float8_linears == plan.float8_linears  # JSON round trip
    # the amax all-reduces the plan lists (each cast's, over the axes that shard it), by scales
    listed = sorted(
        int(c.nbytes / AMAX_ITEM)
        for d in plan.decisions
        if d.float8
        for c in d.collectives
        if c.site.value == "inside"
    )
    assert listed, "a plan that splits its linears over 2 ranks reduces some amax"
    ref_losses, ref_state = _float8_reference(recipe)
    for rank, (losses, state, per_step, code) in enumerate(run_on_ranks(_rank, 2, str(path), timeout_s=600)):
        where = f"rank {rank}"
        assert code.count("float8_linear(") == linears, where
        for issued in per_step:
            assert sorted(issued) == listed, (
                f"{where}: amax all-reduces issued {sorted(issued)}, listed {listed}"
            )
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=loss_rtol, atol=0)
        assert set(state) == set(ref_state)
        for k, want in ref_state.items():
            moved, ref_moved = state[k] - init[k], want - init[k]
            err = ((moved - ref_moved).norm() / ref_moved.norm()).item()
            assert err <= update_rtol, (
                f"{where}: {k}: update off by {err:.3g} of the reference's, over {update_rtol:g}"
            )


# -- one linear split over 2 ranks: each cast's amax reduced where its scale's dims are split ----------


def _split_rank(rank: int, world: int, layout: str, recipe: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_utils import tensor_to_scale

    from autopar.codegen.collectives import bound_mesh
    from autopar.codegen.float8 import float8_config, float8_linear
    from autopar.lowerings.float8 import CASTS, amax_axes
    from autopar.passes.strategies import Strategy

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96, bias=False)
    ref = Float8Linear.from_float(copy.deepcopy(lin), config=float8_config(recipe)[0])
    x = torch.randn(4, 8, 64, requires_grad=True)
    dy = torch.randn(4, 8, 96)
    want = ref(x)
    want.backward(dy)
    R, S = Replicate(), Shard
    # (X, W, Y) placements of a column-parallel, row-parallel and batch-split linear
    specs = {"column": (R, S(0), S(2)), "row": (S(2), S(1), R), "batch": (S(0), R, S(0))}[layout]

    def piece(t, p):
        return t.chunk(world, p.dim)[rank] if isinstance(p, Shard) else t

    xs = piece(x.detach(), specs[0]).requires_grad_()
    ws = piece(lin.weight.detach(), specs[1]).requires_grad_()

    g = torch.fx.Graph()  # the traced linear, as amax_axes reads it
    gx, gw = g.placeholder("x"), g.placeholder("w")
    gx.meta["val"], gw.meta["val"] = x, lin.weight
    node = g.call_function(torch.ops.aten.linear.default, (gx, gw))
    node.meta["val"] = want
    s = Strategy(out=(specs[2],), ins=((specs[0],), (specs[1],)))
    axes = amax_axes(node, s, Float8(recipe))
    assert len(axes) == len(CASTS)
    import autopar.codegen.float8 as F8

    scales = []  # each cast's scale on this rank, in cast order
    cast = F8.hp_tensor_and_scale_to_float8

    def recorded(t, scale, *args):
        scales.append(scale.clone())
        return cast(t, scale, *args)

    F8.hp_tensor_and_scale_to_float8 = recorded
    with bound_mesh(mesh):
        y = float8_linear(xs, ws, None, recipe, axes)
    y.backward(piece(dy, specs[2]) if isinstance(specs[2], Shard) else dy)
    if layout == "row":  # a partial sum per rank; its input's gradient is whole on each
        dist.all_reduce(y := y.detach().clone())
    dx, dw = xs.grad, ws.grad
    if layout == "column":  # X whole: each rank's dX sums over its outputs
        dist.all_reduce(dx := dx.clone())
    if layout == "batch":  # W whole: each rank's dW sums over its rows
        dist.all_reduce(dw := dw.clone())
    # the single device's scales of the six casts (torchao's own function), as this rank's piece:
    # (whole operand as the cast sees it, its dim, {dim of the placement: dim of the cast's tensor})
    c, _ = float8_config(recipe)
    w_t, dy2, x2 = lin.weight.detach().t(), dy.reshape(-1, 96), x.detach().reshape(-1, 64)
    whole = [
        (c.cast_config_input, x.detach(), -1, specs[0], {0: 0, 1: 1, 2: 2}),
        (c.cast_config_weight, w_t, 0, specs[1], {0: 1, 1: 0}),
        (c.cast_config_grad_output, dy2, -1, specs[2], {0: 0, 2: 1}),
        (c.cast_config_weight_for_grad_input, w_t, -1, specs[1], {0: 1, 1: 0}),
        (c.cast_config_grad_output_for_grad_weight, dy2, 0, specs[2], {0: 0, 2: 1}),
        (c.cast_config_input_for_grad_weight, x2, 0, specs[0], {0: 0, 2: 1}),
    ]
    assert len(scales) == len(whole)
    same = []
    for got, (cc, t, dim, p, where) in zip(scales, whole):
        gran = cc.scaling_granularity
        want_s = tensor_to_scale(
            t,
            cc.target_dtype,
            False,
            None,
            gran,
            get_maybe_axiswise_dim(dim, gran),
            c.round_scales_to_power_of_2,
        )
        if isinstance(p, Shard) and want_s.dim() and want_s.shape[where[p.dim]] > 1:
            want_s = want_s.chunk(world, where[p.dim])[rank]
        same.append(bool(torch.equal(got, want_s)))
    return same, [
        ((got - piece(ref_t, p)).abs().max() / ref_t.abs().max()).item()
        for got, ref_t, p in (
            (y.detach(), want.detach(), specs[2]),
            (dx, x.grad, specs[0]),
            (dw, ref.weight.grad, specs[1]),
        )
    ]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_a_split_fp8_linear_casts_as_the_whole_one(recipe):
    """Output, input gradient and weight gradient of one linear split three ways over 2 gloo ranks
        against torchao's ``Float8Linear`` on the whole tensors, and every cast's scale (the six of
    ``lowerings/float8.py``) against the whole tensor's, exactly (a rowwise scale's piece). Tensorwise: the same scales, so equal
        to fp32 summation order (1e-5 of the largest value); rowwise: the scaled matmul's bf16 output
        rounds each rank's partial sum (2^-8 of the largest value, two of them), which hides what a
        scale left local costs (a rowwise scale is rounded to a power of 2): the scales show it."""
    tol = 1e-5 if recipe is Float8.TENSORWISE else 2**-7
    for layout in ("column", "row", "batch"):
        for rank, (same, errs) in enumerate(
            run_on_ranks(_split_rank, 2, layout, recipe.value, timeout_s=300)
        ):
            assert all(same), f"{layout}, rank {rank}: casts whose scale is not the whole tensor's: " + str(
                [i for i, ok in enumerate(same) if not ok]
            )
            for what, err in zip(("output", "input gradient", "weight gradient"), errs):
                assert err <= tol, f"{layout}, rank {rank}: {what} off by {err:.3g} of its largest value"
