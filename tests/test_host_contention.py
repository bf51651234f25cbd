"""What ``autopar calibrate`` writes of the CPU contention model (``HostContention``), on fake
measurements: CPU ranks get one, accelerators none, and the spec file holds the new structure."""

from __future__ import annotations

import json

import pytest

import autopar.launch
from autopar.cluster import ClusterSpec, HostContention
from autopar.tools import calibrate as cal
from autopar.tools.calibrate import Sample


def _results(host_cores: int | None, waits: dict[str, float] | None, points: dict, kind: str) -> list[dict]:
    """One rank's ``_measure_rank`` result on a ``kind`` of device, made up: collectives of 1 ms +
    B / 1 GB/s."""
    samples = [
        Sample(kind, nbytes, 2, 1e-3 + nbytes / 1e9)
        for kind in ("all_reduce", "all_gather")
        for nbytes in (2**10, 2**16, 2**20)
    ]
    compute = {
        "peak_flops": 60e9,
        "flops_effective": 45e9,
        "memory_bandwidth": 20e9,
        "inplace_bandwidth": 35e9,
        "matmul_dim_half": 16.0,
        "matmul_overhead_s": 4e-5,
        "kernel_launch_s": 1.2e-5,
        "pointwise_s": {},
        "per_flop_s": {},
        "optimizer_param_s": {"SGD": 2e-6},
        "step_overhead_s": 1e-4,
    }
    # on NCCL calibrate measures no sync wait: accelerators share no cores
    sync_wait = None if waits is None else {"points": points, "sync_wait": waits}
    return [
        {
            "samples": samples,
            "group_samples": {},
            "sync_wait": sync_wait,
            "compute": compute,
            "host_cores": host_cores,
            "kind": kind,
            "overlap": {
                "efficiency": 0.2,
                "nbytes": 2**20,
                "t_comm": 1e-3,
                "t_compute": 2e-3,
                "t_both": 2.5e-3,
            },
        }
    ]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_calibrate_writes_contention_for_cpu_ranks_only(backend, monkeypatch, tmp_path):
    waits = {"all_reduce": 0.05, "all_gather": 0.03, "reduce_scatter": 0.05}
    points = {k: [(1e-3, 2e-3), (4e-3, 3e-3)] for k in waits}
    results = _results(2, waits, points, "cpu") if backend == "gloo" else _results(None, None, {}, "cuda")
    monkeypatch.setattr(autopar.launch, "run_on_ranks", lambda *a, **k: results)
    path = tmp_path / "cluster.json"
    base = ClusterSpec.preset("cpu" if backend == "gloo" else "h100-sxm", devices_per_node=4)
    calibration = cal.run_calibration(4, base=base, out_path=path)
    got = calibration.cluster
    written = json.loads(path.read_text())["device"]
    assert not {"host_cores", "sync_wait", "sync_wait_kinds"} & set(written)  # the old flat keys
    if backend == "gloo":
        assert got.device.contention == HostContention(host_cores=2, sync_wait=0.05, sync_wait_kinds=waits)
        assert got.compute_slowdown == 2.0 and got.device.sync_wait_for("all_gather") == 0.03
        assert written["contention"] == {"host_cores": 2, "sync_wait": 0.05, "sync_wait_kinds": waits}
    else:
        assert got.device.contention is None and got.compute_slowdown == 1.0
        assert "contention" not in written
    assert ClusterSpec.from_file(path) == got
    assert written["kind"] == ("cpu" if backend == "gloo" else "cuda")  # the device measured on
    assert ("sync wait" in calibration.table()) == (backend == "gloo")
