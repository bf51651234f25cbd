"""The README's main job: `autopar demo` plans, runs on gloo processes, and writes plan + report."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar import Optimizer, plan
from autopar.cluster import ClusterSpec
from autopar.demo import run_demo
from autopar.model_spec import load_model_spec

pytestmark = pytest.mark.slow


def test_demo_runs_and_writes_plan_and_report(tmp_path, capsys):
    result = run_demo(tmp_path, world_size=2, steps=2)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh_shape"] and plan["decisions"]
    html = (tmp_path / "report.html").read_text()
    assert "<svg" in html and "measured" in html.lower()
    assert "all_" in (tmp_path / "rank0_code.py").read_text() or plan["mesh_shape"] == [1]
    # the parallel losses are the single-device losses
    assert result["measured"]["max_loss_difference"] < 1e-4
    assert len(result["reference"]) == 2
    out = capsys.readouterr().out
    assert "predicted" in out and "measured" in out and "OK" in out


def test_three_axis_plan_runs_on_eight_ranks(tmp_path):
    """8 local ranks: the default search weighs a 3-axis mesh (outer axis data parallel) for this
    small GPT-2, and the 3-axis plan's generated code matches the single-device losses."""
    spec = "autopar.examples:gpt2_tiny(batch=8, seq=16, hidden=64)"
    base = ClusterSpec.preset(
        "cpu", devices_per_node=8
    )  # the CI machine's cores, fixed: the same plan anywhere
    cluster = base.with_overrides(device=dataclasses.replace(base.device, host_cores=2))
    model, inputs = load_model_spec(spec)
    searched = plan(model, cluster, inputs, optimizer=Optimizer.SGD)
    three = [c for c in searched.solver.candidates if len(c["mesh_shape"]) == 3]
    assert three and three[0]["axis_roles"] == ["data", "auto", "auto"] and three[0]["objective"]
    result = run_demo(tmp_path, model_spec=spec, world_size=8, steps=2, cluster=cluster, mesh_shape=(2, 2, 2))
    assert result["plan"].mesh_shape == (2, 2, 2)
    assert result["measured"]["max_loss_difference"] < 1e-4
