"""Every plan says what it does on each mesh axis (``autopar/plan_axes.py``): the lines of
``Plan.summary`` and of the report, checked against the plan's own placements on real plans of a
small Llama; a plan that splits nothing says so and why, and its module's ``data_world`` is 1."""

from __future__ import annotations

import pytest
from harness import D, S, T
from torch.distributed.tensor.placement_types import Shard

import autopar
from autopar.examples import llama_tiny
from autopar.launch import run_on_ranks
from autopar.placement import is_partial, is_shard
from autopar.plan_axes import MATMULS, axis_line, replicated_line, split_axes
from autopar.report import render_report

H100x4 = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=4)


def _ops(plan):
    return [d for d in plan.decisions if d.role not in ("param", "buffer", "input")]


def _params(plan):
    return [d for d in plan.decisions if d.role == "param"]


def _split(d, a) -> bool:
    return any(is_shard(s[a]) or is_partial(s[a]) for s in (d.output_spec, *d.input_specs))


@pytest.fixture(scope="module")
def llama():
    return llama_tiny(batch=16, seq=64, hidden=128)


@pytest.fixture(scope="module")
def data_plan(llama):
    model, inputs = llama
    return autopar.plan(model, H100x4, inputs, mesh_shape=(4,), axis_roles=(D,), zero_stage=1)


@pytest.fixture(scope="module")
def tensor_plan(llama):
    model, inputs = llama
    return autopar.plan(model, H100x4, inputs, mesh_shape=(4,), axis_roles=(T,))


@pytest.fixture(scope="module")
def readme_plan():
    """The README's model on two CPU devices: the search keeps every op whole."""
    model, inputs = llama_tiny()
    return autopar.plan(model, autopar.ClusterSpec.preset("cpu", devices_per_node=2), inputs)


def test_a_data_parallel_axis_says_what_it_splits(data_plan):
    ops, params = _ops(data_plan), _params(data_plan)
    batch = [d for d in ops if is_shard(d.output_spec[0]) and d.output_spec[0].dim % len(d.shape) == 0]
    assert batch and not any(is_shard(p.output_spec[0]) for p in params)
    line = (
        f"axis 0 (size 4): data parallel: batch split on {len(batch)} of {len(ops)} ops, parameters whole, "
        "gradients all-reduced; ZeRO-1"
    )
    assert axis_line(data_plan, 0) == line
    assert f"  {line}\n" in data_plan.summary()
    assert replicated_line(data_plan) is None
    assert "every rank runs the whole step" not in data_plan.summary()


def test_a_tensor_parallel_axis_counts_the_matmuls_split_on_their_weights(tensor_plan):
    ops, params = _ops(tensor_plan), _params(tensor_plan)
    linears = [d for d in ops if d.op == "aten.linear.default"]
    assert linears and all(d.op != "aten.linear.default" or d.op in MATMULS for d in ops)
    on_weights = [d for d in linears if is_shard(d.input_specs[1][0])]
    sharded = [p for p in params if is_shard(p.output_spec[0])]
    assert on_weights and sharded
    line = axis_line(tensor_plan, 0)
    assert line.startswith("axis 0 (size 4): tensor parallel: ")
    assert f"{len(on_weights)} of {len(linears)} matmuls split on their weights" in line
    assert f"{len(sharded)} of {len(params)} parameters sharded" in line
    assert "gradients" not in line  # the inputs are whole on a tensor axis: no batch to reduce over
    assert f"  {line}\n" in tensor_plan.summary()


def test_a_sequence_parallel_axis_counts_its_split_ops(llama):
    model, inputs = llama
    plan = autopar.plan(model, H100x4, inputs, mesh_shape=(4,), axis_roles=(S,))
    assert all(d.output_spec[0] == Shard(1) for d in plan.decisions if d.role == "input")
    ops = _ops(plan)
    split = [d for d in ops if _split(d, 0)]
    line = axis_line(plan, 0)
    assert line.startswith("axis 0 (size 4): sequence parallel: the inputs' sequence split, ")
    assert f"{len(split)} of {len(ops)} ops split" in line
    whole = not any(is_shard(p.output_spec[0]) for p in _params(plan))
    assert ("parameters whole, gradients all-reduced" in line) is whole, line


def test_a_plan_that_splits_nothing_says_so_and_why(readme_plan):
    plan = readme_plan
    assert not any(_split(d, 0) for d in _ops(plan)), "the README's model is expected to run whole"
    assert not any(is_shard(p.output_spec[0]) for p in _params(plan))
    # an input may still be placed split on the batch: every op that reads it takes it whole
    assert split_axes(plan) == ()
    assert axis_line(plan, 0) == "axis 0 (size 2): splits nothing — every rank runs the whole step"
    # the reason: the fastest candidate that must split, with its figure, beside this plan's step
    forced = [c for c in plan.solver.candidates if any(r != "auto" for r in c.get("axis_roles") or ())]
    assert forced
    why = replicated_line(plan)
    assert why.startswith("no axis splits anything: every rank runs the whole step, predicted fastest: ")
    assert f"against this plan's {plan.predicted.step_time_s * 1e3:.3f} ms" in why
    best = min(
        forced,
        key=lambda c: (
            c["objective"] if c.get("objective") is not None else max(c["lower_bound"], c.get("lp_bound", 0))
        ),
    )
    assert f"mesh {tuple(best['mesh_shape'])} with axis roles ({', '.join(best['axis_roles'])})" in why
    summary = plan.summary()
    assert "  axis 0 (size 2): splits nothing — every rank runs the whole step\n" in summary
    assert f"  {why}\n" in summary
    html = render_report(plan)
    assert "every rank runs the whole step" in html and "No axis splits anything" in html


def test_one_axis_of_two_splits_nothing(llama):
    model, inputs = llama
    plan = autopar.plan(model, H100x4, inputs, mesh_shape=(2, 2), axis_roles=(D, T))
    for a in range(2):
        line = axis_line(plan, a)
        split = any(_split(d, a) for d in _ops(plan)) or any(
            is_shard(p.output_spec[a]) for p in _params(plan)
        )
        assert ("splits nothing" in line) is (not split), line
        assert (a in split_axes(plan)) is split
    assert axis_line(plan, 0).startswith("axis 0 (size 2): data ")


def _data_coordinates(rank, world, path):
    model, inputs = llama_tiny()
    pmodel = autopar.autoparallelize(model, autopar.ClusterSpec.local(), inputs, plan=path)
    return pmodel.data_rank, pmodel.data_world


def test_a_plan_that_splits_nothing_is_fed_the_whole_batch(readme_plan, tmp_path):
    """``data_world`` is 1 where no op is split, even though the plan places an input split on
    the batch (gathered whole before anything reads it)."""
    inputs_split = [d for d in readme_plan.decisions if d.role == "input" and is_shard(d.output_spec[0])]
    assert inputs_split, "the case this test is about: an input placed split, read whole"
    path = tmp_path / "plan.json"
    readme_plan.save(path)
    assert run_on_ranks(_data_coordinates, 2, str(path), timeout_s=300) == [(0, 1), (0, 1)]
