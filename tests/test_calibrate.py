"""Calibration: fit_link recovers synthetic links; a real 2-process calibration yields a usable spec."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cli import main
from autopar.cluster import ClusterSpec, LinkSpec
from autopar.cost_model.calibrate import (
    Sample,
    calibrate,
    fit_errors,
    fit_link,
    predict_time,
    ring_coefficients,
)
from autopar.cost_model.comm import Collective, collective_time

SIZES = [4 * 4**k for k in range(15)]  # 4 B .. 1 GiB


def _synthetic(bw: float, lat: float, kinds, seed: int, noise: float = 0.02) -> list[Sample]:
    rng = random.Random(seed)
    link = LinkSpec(bandwidth=bw, latency=lat)
    out = []
    for kind in kinds:
        for n in (2, 4, 8):
            for b in SIZES:
                t = collective_time(Collective(kind), b, n, link) * (1 + rng.uniform(-noise, noise))
                out.append(Sample(kind=kind, nbytes=b, n=n, seconds=t))
    return out


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"])
def test_ring_coefficients_match_comm_model(kind):
    link = LinkSpec(bandwidth=3e9, latency=7e-6)
    for n in (2, 3, 8):
        s = Sample(kind=kind, nbytes=12345, n=n, seconds=1.0)
        assert predict_time(s, link) == pytest.approx(collective_time(Collective(kind), 12345, n, link))
    f, g = ring_coefficients(kind, 4)
    assert f > 0 and g > 0


@settings(max_examples=40, deadline=None)
@given(
    log_bw=st.floats(math.log10(1e8), math.log10(1e11)),
    log_lat=st.floats(math.log10(1e-6), math.log10(1e-3)),
    seed=st.integers(0, 2**16),
)
def test_fit_link_recovers_bandwidth_and_latency(log_bw, log_lat, seed):
    bw, lat = 10**log_bw, 10**log_lat
    samples = _synthetic(bw, lat, ["all_reduce", "all_gather"], seed)
    for kind in (None, "all_reduce", "all_gather"):
        link = fit_link(samples, kind)
        assert link.bandwidth == pytest.approx(bw, rel=0.1)
        assert link.latency == pytest.approx(lat, rel=0.1)
    errs = fit_errors(samples, fit_link(samples))
    assert max(abs(e) for e in errs) < 0.1


def test_fit_link_clamps_to_positive():
    # pure latency: no bandwidth term -> bandwidth clamped, finite and positive
    samples = [Sample("all_reduce", b, 2, 1e-4) for b in (8, 1024, 65536)]
    link = fit_link(samples)
    assert 0 < link.bandwidth < math.inf and link.latency == pytest.approx(5e-5, rel=0.05)
    # pure bandwidth: latency clamped to a small positive number
    samples = [Sample("all_gather", b, 2, b / 2 / 1e9) for b in (1024, 65536, 2**20)]
    link = fit_link(samples)
    assert link.bandwidth == pytest.approx(1e9, rel=1e-6) and 0 < link.latency <= 1e-8
    with pytest.raises(ValueError):
        fit_link([], None)


def _positive_finite(link: LinkSpec) -> bool:
    return 0 < link.bandwidth < math.inf and 0 < link.latency < math.inf


@pytest.mark.slow
def test_quick_calibration_on_two_processes_and_cli(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    spec = calibrate(2, out_path=path, sizes_bytes=(2**10, 2**16, 2**19), repeats=3, quick=True)
    assert spec.world_size == 2 and spec.nodes == 1
    assert _positive_finite(spec.intra_node) and spec.inter_node == spec.intra_node
    dev = spec.device
    assert all(0 < v < math.inf for v in (dev.peak_flops_for("float32"), dev.memory_bandwidth))
    assert 0 < dev.kernel_launch_s < 1e-2
    assert ClusterSpec.from_file(path) == spec

    cli_path = tmp_path / "cli_cluster.json"
    assert main(["calibrate", "--world-size", "2", "--out", str(cli_path), "--quick"]) == 0
    printed = capsys.readouterr().out
    assert "bandwidth" in printed and "rel.err" in printed and f"wrote {cli_path}" in printed
    loaded = ClusterSpec.from_file(cli_path)
    assert _positive_finite(loaded.intra_node) and json.loads(cli_path.read_text())["devices_per_node"] == 2
    # the file is what `autopar plan --cluster FILE` takes
    assert ClusterSpec.parse(str(cli_path)) == loaded
