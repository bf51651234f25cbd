"""SearchOptions: one frozen value for every choice a search may be told; bad values are refused
where they are given, with the fix in the message."""

from __future__ import annotations

import math

import pytest
import torch

import autopar
import autopar.examples
from autopar.examples import mlp
from autopar.options import AxisRole, SearchOptions, SearchOptionsError


@pytest.mark.parametrize("limit", [0, -5, math.nan])
def test_a_limit_that_is_not_a_positive_number_is_refused(limit):
    with pytest.raises(SearchOptionsError, match="memory_limit_bytes must be a positive number"):
        SearchOptions(memory_limit_bytes=limit)
    with pytest.raises(SearchOptionsError, match="time_limit_s must be a positive number"):
        SearchOptions(time_limit_s=limit)


def test_roles_must_match_the_mesh():
    with pytest.raises(SearchOptionsError, match="one role per mesh axis"):
        SearchOptions(mesh_shape=(2, 2), axis_roles=(AxisRole.DATA,))
    with pytest.raises(SearchOptionsError, match="mesh_shape must be positive integers"):
        SearchOptions(mesh_shape=(2, 0))


def test_overlap_matmuls_is_on_where_devices_overlap_unless_forced():
    assert SearchOptions().fuses_matmuls(0.5) and not SearchOptions().fuses_matmuls(0.0)
    assert SearchOptions(overlap_matmuls=True).fuses_matmuls(0.0)
    assert not SearchOptions(overlap_matmuls=False).fuses_matmuls(0.5)
    with pytest.raises(SearchOptionsError, match="overlap_matmuls must be True, False or None"):
        SearchOptions(overlap_matmuls="on")


def test_keywords_override_an_options_value_and_unknown_ones_are_named():
    base = SearchOptions(mesh_shape=(4,))
    both = SearchOptions.of(base, axis_roles=[AxisRole.TENSOR])
    assert both == SearchOptions(mesh_shape=(4,), axis_roles=(AxisRole.TENSOR,))
    assert base.axis_roles is None  # frozen: the original is unchanged
    with pytest.raises(TypeError, match="unknown search option.*mesh_shap"):
        SearchOptions.of(base, mesh_shap=(2,))


def test_plan_takes_an_options_value_or_the_same_keywords():
    """The same search whether its options come as a value or as keyword arguments."""
    torch.manual_seed(0)
    model, inputs = mlp(batch=8, hidden=32, ffn=64)
    cluster = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=2)
    by_value = autopar.plan(
        model, cluster, inputs, SearchOptions(mesh_shape=(2,), axis_roles=(AxisRole.TENSOR,))
    )
    by_keyword = autopar.plan(model, cluster, inputs, mesh_shape=(2,), axis_roles=(AxisRole.TENSOR,))
    assert by_value.decisions == by_keyword.decisions
    assert by_value.predicted == by_keyword.predicted
    assert by_value.overlap_matmuls  # auto on an H100 (it overlaps communication), recorded in the plan
    off = autopar.plan(
        model, cluster, inputs, mesh_shape=(2,), axis_roles=(AxisRole.TENSOR,), overlap_matmuls=False
    )
    assert not off.overlap_matmuls
    assert any(d.output != "R" for d in by_value.decisions if d.role == "param")  # tensor parallel
    with pytest.raises(SearchOptionsError):
        autopar.plan(model, cluster, inputs, memory_limit_bytes=-5)


def test_every_stage_of_the_search_is_dumped(tmp_path):
    """``dump_dir``: each stage's output, the strategy and cost tables of every mesh solved too; the
    dumped plan is the plan returned."""
    model, inputs = mlp(batch=8, hidden=32, ffn=64)
    cluster = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=2)
    plan = autopar.plan(model, cluster, inputs, mesh_shape=(2,), dump_dir=tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    for stage in ("1_trace.py", "2_analyze.tsv", "2_coarsen.tsv", "5_select.json", "6_plan.json"):
        assert stage in names, stage
    # mesh (2,) free and with axis 0 data parallel: both candidates' tables
    for stage in ("3_strategies_2.tsv", "3_costs_2.tsv", "3_strategies_2_data.tsv", "3_costs_2_data.tsv"):
        assert stage in names, stage
    assert any(n.startswith("4_solve_2") for n in names)
    assert autopar.Plan.load(tmp_path / "6_plan.json") == plan
    costs = (tmp_path / "3_costs_2.tsv").read_text().splitlines()
    assert costs[0].split("\t")[:3] == ["kind", "name", "strategy"]
    assert any(row.startswith("node\t") for row in costs) and any(row.startswith("edge\t") for row in costs)


def test_a_batch_of_one_plans_and_a_role_nothing_satisfies_is_named():
    """A candidate whose axis roles leave a tensor no placement (a batch of one on a data-parallel
    axis) is skipped, never fatal; when every candidate is, the error names the tensor and roles."""
    model, inputs = autopar.examples.llama_tiny(batch=1, seq=16, hidden=32, vocab=64)
    cluster = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=8)
    plan = autopar.plan(model, cluster, inputs)
    skipped = [c for c in plan.solver.candidates if c["status"] == "no placement for its axis roles"]
    assert skipped and all(c["axis_roles"][0] == "data" for c in skipped)
    # the 3-axis mesh, whose outer axis the search pins data parallel, once aborted the search
    assert [2, 2, 2] in [c["mesh_shape"] for c in skipped]
    assert plan.world_size == 8
    with pytest.raises(
        autopar.NoPlanFitsError, match=r"no candidate mesh.*input_ids of shape \(1, 16\).*\['data'\]"
    ):
        autopar.plan(model, cluster, inputs, axis_roles=(AxisRole.DATA,))


def test_sequence_parallel_off_keeps_norms_whole_on_a_tensor_axis():
    """A GPT on 8 A100 over a tensor axis (fp16, collectives not overlapped, as [SC21] ran): the
    search splits its LayerNorms on the sequence (Megatron's sequence parallelism: an eighth of
    the norms' work and kept bytes); ``sequence_parallel=False`` keeps every one whole on each
    rank, as Megatron-LM without ``--sequence-parallel`` runs, and that plan is the slower one."""
    cluster = autopar.ClusterSpec.preset("a100-80gb", devices_per_node=8)
    with torch.device("meta"):
        model, inputs = autopar.examples.gpt3(
            layers=2, hidden=2048, heads=16, vocab=51200, batch=8, seq=2048, dtype="float16"
        )
    plans = {
        sp: autopar.plan(
            model,
            cluster,
            inputs,
            mesh_shape=(8,),
            axis_roles=(AxisRole.TENSOR,),
            precision="fp16",
            overlap_matmuls=False,
            sequence_parallel=sp,
        )  # fmt: skip
        for sp in (True, False)
    }
    norms = {sp: [d.output for d in p.decisions if "layer_norm" in d.op] for sp, p in plans.items()}
    assert norms[True] and all(o != "R" for o in norms[True]), norms
    assert norms[False] and all(o == "R" for o in norms[False]), norms
    assert plans[False].predicted.step_time_s > plans[True].predicted.step_time_s
    with pytest.raises(SearchOptionsError, match="sequence_parallel"):
        SearchOptions(sequence_parallel="no")
