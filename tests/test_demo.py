"""The README's main job: `autopar demo` plans, runs on gloo processes, and writes plan + report."""

from __future__ import annotations

import json

import pytest

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
