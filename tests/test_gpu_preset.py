"""The H100 / H200 presets against the single-op times measured on one H100
(``cost_model/reference/h100_ops.jsonl``), priced through the cost model's own path
(``autopar/tools/op_reference.py``): no GPU needed, no clock read.

* the preset's fitted figures are what ``fit_figures`` returns from the file (so the preset cannot
  drift from its source), the H200's the same but for its memory bandwidth;
* ``EFF_MAX`` (a module-wide constant, not a device field) holds for this device's matmuls;
* bf16 matmuls at large shapes and elementwise ops are priced within the tolerances below.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest

from autopar.cluster import ClusterSpec
from autopar.cost_model.compute import EFF_MAX
from autopar.tools.op_reference import (
    EFF_TOLERANCE,
    H100_OPS,
    efficiency,
    errors,
    fit_figures,
    load_samples,
    predict,
    round_sig,
)

H100_DATASHEET_BW = 3.35e12  # [H100-DS] autopar/presets.py
H200_DATASHEET_BW = 4.8e12  # [H200-DS] autopar/presets.py

# the tolerances: predicted / measured - 1
LARGE_BF16_MEDIAN = 0.15  # median |error| of bf16 matmuls with m, n, k >= 1024
LARGE_BF16_FASTEST = -0.20  # none of them priced more than 20% faster than it ran
ELEMENTWISE_MEDIAN = 0.05
ELEMENTWISE_WORST = 0.15


@pytest.fixture(scope="module")
def samples():
    return load_samples()


@pytest.fixture(scope="module")
def h100():
    return ClusterSpec.preset("h100-sxm").device


@pytest.fixture(scope="module")
def fitted(samples, h100):
    return fit_figures(samples, dict(h100.peak_flops))


@pytest.fixture(scope="module")
def by_family(samples, h100):
    return errors(predict(samples, h100))


def test_reference_file_is_read_whole(samples):
    rows = [json.loads(line) for line in H100_OPS.read_text().splitlines() if line.strip()]
    assert rows[0]["op"] == "device" and "H100" in rows[0]["name"]
    # one sample per measured time: rows with forward and forward + backward times give two
    assert len(samples) == sum(("ms" in r) + ("fwd_ms" in r) + ("fwd_bwd_ms" in r) for r in rows[1:])
    assert all(s.seconds > 0 for s in samples)


def test_every_row_is_priced(samples, h100):
    predicted = predict(samples, h100)
    assert set(predicted) == set(samples)
    assert all(math.isfinite(t) and t > 0 for t in predicted.values())


def test_preset_figures_are_the_fit_of_the_file(h100, fitted):
    assert h100.kernel_launch_s == fitted.kernel_launch_s
    assert h100.memory_bandwidth == fitted.memory_bandwidth
    assert h100.matmul_dim_half == fitted.matmul_dim_half
    assert h100.matmul_overhead_s == fitted.matmul_overhead_s
    assert h100.pointwise_s == fitted.pointwise_s
    assert h100.optimizer_param_s == fitted.optimizer_param_s
    assert fitted.apply(h100) == h100
    # the datasheet peaks stay: efficiency is what the fit accounts for
    assert h100.peak_flops_for("bfloat16") == 989e12 and h100.peak_flops_for("float32") == 67e12


def test_h200_takes_the_h100_figures_and_scales_its_bandwidth(h100, fitted):
    h200 = ClusterSpec.preset("h200").device
    assert h200.peak_flops == h100.peak_flops
    expected_bw = round_sig(H200_DATASHEET_BW * fitted.memory_bandwidth / H100_DATASHEET_BW)
    assert h200.memory_bandwidth == expected_bw
    assert fitted.apply(h200) == dataclasses.replace(h200, memory_bandwidth=fitted.memory_bandwidth)


def test_eff_max_holds_for_h100_matmuls(samples, h100):
    eff = efficiency(samples, dict(h100.peak_flops))
    assert set(eff) == {"bfloat16", "float32"}
    for dtype, value in eff.items():
        assert abs(value - EFF_MAX) <= EFF_TOLERANCE, (dtype, value)


def test_large_bf16_matmuls_within_tolerance(by_family):
    large = [e for s, e in by_family["mm bfloat16"] if s.large_gemm]
    assert len(large) >= 10
    assert statistics.median(abs(e) for e in large) <= LARGE_BF16_MEDIAN
    assert min(large) >= LARGE_BF16_FASTEST, min(large)


def test_elementwise_ops_within_tolerance(by_family):
    errs = [e for _, e in by_family["elementwise"]]
    assert len(errs) == 40
    assert statistics.median(abs(e) for e in errs) <= ELEMENTWISE_MEDIAN
    assert max(abs(e) for e in errs) <= ELEMENTWISE_WORST


def test_adam_foreach_step_within_tolerance(by_family):
    errs = [e for _, e in by_family["adam_foreach"]]
    assert errs and max(abs(e) for e in errs) <= 0.05


def test_presets_round_trip_through_json():
    for name in ("h100-sxm", "h200"):
        spec = ClusterSpec.preset(name)
        assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
