"""The README's main job: `autopar demo` plans, runs on gloo processes, and writes plan + report."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar.cluster import ClusterSpec
from autopar.demo import run_demo

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
    """8 local ranks: the 3-axis plan's generated code matches the single-device losses (that the
    default search weighs 3-axis meshes is test_solver's
    test_default_search_covers_three_axis_meshes_with_a_data_parallel_outer_axis)."""
    spec = "autopar.examples:gpt2_tiny(batch=8, seq=16, hidden=64)"
    base = ClusterSpec.preset(
        "cpu", devices_per_node=8
    )  # the CI machine's cores, fixed: the same plan anywhere
    cluster = base.with_overrides(device=base.device.with_contention(host_cores=2))
    result = run_demo(tmp_path, model_spec=spec, world_size=8, steps=2, cluster=cluster, mesh_shape=(2, 2, 2))
    assert result["plan"].mesh_shape == (2, 2, 2)
    assert result["measured"]["max_loss_difference"] < 1e-4


def test_the_demo_command_plans_with_a_calibrated_spec_file(tmp_path, monkeypatch):
    """`autopar demo --cluster FILE` prices the plan with the file's device and links, on
    --world-size devices of one node (the preset's figures otherwise)."""
    import autopar.demo
    from autopar.cli import main

    spec = ClusterSpec.preset("cpu", devices_per_node=8)
    spec = spec.with_overrides(device=dataclasses.replace(spec.device, kernel_launch_s=1.25e-5))
    path = tmp_path / "cluster.json"
    spec.save(path)
    seen = {}
    monkeypatch.setattr(autopar.demo, "run_demo", lambda *a, **k: seen.update(args=a, **k))
    assert main(["demo", "--cluster", str(path), "--world-size", "2", "--out", str(tmp_path)]) == 0
    cluster = seen["cluster"]
    assert cluster.world_size == 2 and cluster.nodes == 1
    assert cluster.device == spec.device and cluster.intra_node == spec.intra_node
