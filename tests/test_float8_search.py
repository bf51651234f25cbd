"""The search's FP8 decision (``autopar/lowerings/float8.py``): per linear, where it pays, on devices
with an FP8 rate only; forceable; recorded in the plan and priced again by ``reprice``.

Compared against the priced alternative, never a constant: the plan the same search writes with FP8
off, and the same plan's decisions repriced with every linear in its own precision.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import autopar
from autopar import AxisRole, Float8, Outputs
from autopar.examples import llama

pytest.importorskip("torchao.float8")

DATA = dict(mesh_shape=(8,), axis_roles=(AxisRole.DATA,), outputs=Outputs.LOSS)


@functools.cache
def _model():
    # a Llama-3-8B block pair at its published width, batch and sequence: GEMMs large enough for
    # FP8's rate to show, on the meta device
    with torch.device("meta"):
        return llama(layers=2, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, batch=8, seq=2048)


@functools.cache
def _plans(preset: str, float8=None):
    model, inputs = _model()
    cluster = autopar.ClusterSpec.preset(preset, devices_per_node=8)
    return cluster, autopar.plan(model, cluster, inputs, float8=float8, **DATA)


def _without_float8(plan):
    return dataclasses.replace(
        plan, decisions=tuple(dataclasses.replace(d, float8="") for d in plan.decisions)
    )


def test_on_h100_the_search_runs_fp8_linears_where_they_pay():
    cluster, auto = _plans("h100-sxm")
    _, off = _plans("h100-sxm", Float8.OFF)
    # [H100-DS]: 3,958 FP8 TFLOP/s with sparsity, 1,979 dense; the H200 has the H100 SXM's compute
    assert cluster.device.float8_flops == 1979e12
    assert autopar.ClusterSpec.preset("h200").device.float8_flops == 1979e12
    assert auto.float8_linears, auto.summary()
    assert not off.float8_linears
    assert auto.predicted.step_time_s < off.predicted.step_time_s
    assert "FP8 linears:" in auto.summary() and "FP8 linears:" not in off.summary()
    # each linear it runs FP8 costs less so than in its own precision under the same placements
    model, inputs = _model()
    again = autopar.reprice(model, cluster, inputs, auto)
    plain = autopar.reprice(model, cluster, inputs, _without_float8(auto))
    assert again.float8_linears == auto.float8_linears and not plain.float8_linears
    assert again.predicted.step_time_s == pytest.approx(auto.predicted.step_time_s, rel=1e-9)
    assert plain.predicted.step_time_s > again.predicted.step_time_s
    by_name = {d.name: d for d in plain.decisions}
    for d in again.decisions:
        if d.float8:
            own = by_name[d.name]
            inside = sum(1 for c in d.collectives if c.site.value == "inside")
            assert d.compute_s < own.compute_s, (d.name, d.compute_s, own.compute_s)
            # a linear whose amax is reduced lists those all-reduces; its own precision none
            assert inside == 0 or sum(1 for c in own.collectives if c.site.value == "inside") == 0


def test_without_torchao_the_search_plans_no_fp8(monkeypatch):
    """Auto plans FP8 only where torchao, which runs it, is installed: on an install without it (a
    GPU machine given wheels by hand) the H100 plan is the FP8-off plan, not a module that cannot
    run; forcing a recipe still plans it (the plan may be for another machine)."""
    from autopar.passes import float8_price

    monkeypatch.setattr(float8_price, "has_torchao", lambda: False)
    model, inputs = _model()
    cluster = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=8)
    auto = autopar.plan(model, cluster, inputs, **DATA)
    _, off = _plans("h100-sxm", Float8.OFF)
    assert not auto.float8_linears
    assert auto.decision_parts() == off.decision_parts()
    forced = autopar.plan(model, cluster, inputs, float8=Float8.TENSORWISE, **DATA)
    assert forced.float8_linears


@pytest.mark.parametrize("preset", ["a100-80gb", "cpu"])
def test_without_an_fp8_rate_the_search_never_runs_fp8(preset):
    cluster, auto = _plans(preset)
    _, off = _plans(preset, Float8.OFF)
    assert cluster.device.float8_flops is None
    assert not auto.float8_linears
    assert auto.decision_parts() == off.decision_parts()
    assert auto.predicted.step_time_s == off.predicted.step_time_s


def test_forced_fp8_runs_every_linear_it_can_even_where_it_costs():
    cluster, forced = _plans("a100-80gb", Float8.TENSORWISE)
    _, off = _plans("a100-80gb", Float8.OFF)
    linears = [d for d in forced.decisions if d.op == "aten.linear.default"]
    assert linears and all(d.float8 == "tensorwise" for d in linears)
    # no FP8 rate: the scaled GEMMs run at the bf16 rate and the casts come on top
    assert forced.predicted.step_time_s > off.predicted.step_time_s
    with pytest.raises(autopar.SearchOptionsError, match="float8 must be one of"):
        autopar.SearchOptions(float8="fp4")


def test_the_cli_forces_fp8_and_the_report_shows_it(tmp_path, capsys):
    from autopar.cli import main

    out, report = tmp_path / "plan.json", tmp_path / "report.html"
    spec = "autopar.examples:mlp(batch=8, hidden=32, ffn=64)"
    assert main(["plan", spec, "--cluster", "cpu:1x2", "--float8", "rowwise", "--out", str(out),
                 "--report", str(report)]) == 0  # fmt: skip
    plan = autopar.Plan.load(out)
    linears = [d for d in plan.decisions if d.op == "aten.linear.default"]
    assert linears and all(d.float8 == "rowwise" for d in linears)
    assert f"FP8 linears: {len(linears)} of {len(linears)}" in capsys.readouterr().out
    assert f"{len(linears)} rowwise of {len(linears)} linears" in report.read_text()
    assert main(["plan", spec, "--cluster", "cpu:1x2", "--out", str(out)]) == 0  # auto on a CPU: none
    assert not autopar.Plan.load(out).float8_linears
