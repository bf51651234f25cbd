"""A plan's step in parts (autopar/report/parts.py): the op families partition the plan's own
per-node prices, the collectives split by what they move, and a pipeline's bubble is the
schedule's idle time, so step = busiest rank's compute + exposed communication + bubble."""

from __future__ import annotations

import json
import math

import pytest

import autopar
from autopar.cost_model.compute import GEMM_OPS
from autopar.examples import gpt2_tiny, llama_tiny
from autopar.plan import Plan
from autopar.report.parts import FAMILIES, op_family, step_parts


@pytest.fixture(scope="module")
def tp_dp_plan():
    model, inputs = llama_tiny(batch=8, seq=32, layers=2, hidden=64, vocab=256)
    return autopar.plan(
        model, autopar.ClusterSpec.preset("h100-sxm", nodes=1, devices_per_node=4), inputs,
        mesh_shape=(2, 2), axis_roles=(autopar.AxisRole.DATA, autopar.AxisRole.TENSOR), kernels="none",
    )  # fmt: skip


@pytest.fixture(scope="module")
def pipelined_plan():
    model, inputs = gpt2_tiny(batch=8, seq=16, layers=4, hidden=32, vocab=128)
    return autopar.plan(
        model, autopar.ClusterSpec.preset("cpu", devices_per_node=4), inputs, pipeline_stages=2,
        mesh_shape=(2,), axis_roles=(autopar.AxisRole.DATA,), schedule="1f1b", micro_batches=2,
    )  # fmt: skip


def test_families_partition_the_plans_compute(tp_dp_plan):
    parts = step_parts(tp_dp_plan)
    total = sum(d.compute_s for d in tp_dp_plan.decisions)
    assert set(parts.compute) == set(FAMILIES)
    assert math.isclose(sum(parts.compute.values()), total, rel_tol=1e-9)
    gemms = sum(d.compute_s for d in tp_dp_plan.decisions if d.op in GEMM_OPS)
    assert gemms > 0 and math.isclose(parts.compute["matmuls"], gemms, rel_tol=1e-9)
    sdpa = [d for d in tp_dp_plan.decisions if "scaled_dot_product" in d.op]
    assert sdpa and math.isclose(parts.compute["attention"], sum(d.compute_s for d in sdpa), rel_tol=1e-9)
    # the loss of a causal LM: its cross-entropy (unfused: kernels="none")
    assert parts.compute["loss"] > 0


def test_collectives_split_by_what_they_move(tp_dp_plan):
    parts = step_parts(tp_dp_plan)
    act = sum(d.comm_s for d in tp_dp_plan.decisions if d.role not in ("param", "buffer"))
    par = sum(d.comm_s for d in tp_dp_plan.decisions if d.role in ("param", "buffer"))
    assert act > 0 and par > 0  # a tensor axis reshards activations, a data axis reduces gradients
    assert math.isclose(parts.tensor_comm_s, act, rel_tol=1e-9)
    assert math.isclose(parts.data_comm_s, par, rel_tol=1e-9)
    assert parts.bubble_s == 0.0 and parts.stages == 1
    assert parts.rows()[-1] == ("step", tp_dp_plan.predicted.step_time_s)


def test_pipeline_bubble_is_the_schedules_idle_time(pipelined_plan):
    p = pipelined_plan.predicted
    parts = step_parts(pipelined_plan)
    assert parts.stages == 2
    # 1F1B over 2 stages and 2 micro-batches idles each rank for one forward and one backward
    assert p.bubble_s > 0
    assert math.isclose(p.step_time_s, p.compute_s + p.comm_s + p.bubble_s, rel_tol=1e-9)
    # the decisions price the whole model on one stage's mesh: per device, half of it
    total = sum(d.compute_s for d in pipelined_plan.decisions)
    assert math.isclose(sum(parts.compute.values()), total / 2, rel_tol=1e-9)
    # the plan keeps its bubble through JSON, and a plan written before it reads as none
    again = Plan.from_dict(json.loads(json.dumps(pipelined_plan.to_dict())))
    assert again.predicted.bubble_s == p.bubble_s
    data = pipelined_plan.to_dict()
    del data["predicted"]["bubble_s"]
    assert Plan.from_dict(data).predicted.bubble_s == 0.0


@pytest.mark.parametrize(
    "op, role, family",
    [
        ("aten.linear.default", "activation", "matmuls"),
        ("aten.addmm.default", "activation", "matmuls"),
        ("autopar.linear_cross_entropy.default", "activation", "loss"),
        ("aten.scaled_dot_product_attention.default", "activation", "attention"),
        ("autopar.rms_norm.default", "activation", "norms and elementwise"),
        ("placeholder", "param", "per-parameter work"),
    ],
)
def test_op_family(op, role, family):
    assert op_family(op, role) == family


def test_recomputation_is_counted_once():
    """Recomputation's forwards are in the traded tables' node costs: the op families hold them,
    and the trade's own row says so instead of adding them again."""
    model, inputs = llama_tiny(batch=8, seq=32, layers=2, hidden=64, vocab=256)
    cluster = autopar.ClusterSpec.preset("h100-sxm", nodes=1, devices_per_node=4)
    kw = dict(mesh_shape=(2, 2), axis_roles=(autopar.AxisRole.DATA, autopar.AxisRole.TENSOR), kernels="none")
    full = autopar.plan(model, cluster, inputs, recompute=autopar.Recompute.FULL, **kw)
    none = autopar.plan(model, cluster, inputs, recompute=autopar.Recompute.NONE, **kw)
    a, b = step_parts(full), step_parts(none)
    extra = sum(a.compute.values()) - sum(b.compute.values())
    assert a.trades["recompute"] > 0 and extra > 0
    # the forwards run again are the families' growth (the collectives run again, the rest of the
    # trade's seconds, are the exposed communication's; the plans' placements may differ a little)
    assert math.isclose(extra, a.trades["recompute"], rel_tol=0.1)
    assert ("trade: recompute (in the parts above)", a.trades["recompute"]) in a.rows()
