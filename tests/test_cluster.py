"""Tests for autopar.cluster: presets, parsing, files, validation, local process group."""

from __future__ import annotations

import dataclasses
import json
import socket

import pytest
import torch
import torch.distributed as dist
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cluster import (
    PRESET_NAMES,
    ClusterSpec,
    DeviceKind,
    DeviceSpec,
    HostContention,
    LinkSpec,
    _gpu_device,
)
from autopar.errors import ClusterSpecError

GiB = 2**30


# ------------------------------------------------------------------------------------------ presets


def test_preset_names():
    assert set(PRESET_NAMES) == {"a100-40gb", "a100-80gb", "h100-sxm", "h100-96gb", "h200", "b200", "cpu"}
    for name in PRESET_NAMES:
        spec = ClusterSpec.preset(name)
        assert spec.name == name
        assert spec.nodes == 1


def test_h100_numbers():
    c = ClusterSpec.preset("h100-sxm")
    assert c.devices_per_node == 8
    assert c.world_size == 8
    assert c.device.peak_flops_for(torch.bfloat16) == 989e12
    assert c.device.peak_flops_for("float16") == 989e12
    assert c.device.peak_flops_for("float32") == 67e12
    assert c.device.peak_flops_for(torch.float8_e4m3fn) == 1979e12
    assert c.device.memory_bytes == 80 * GiB
    # what elementwise ops achieved on an H100 (tests/test_gpu_preset.py), of the datasheet's 3.35 TB/s
    assert c.device.memory_bandwidth == 2.96e12
    assert c.inter_node.bandwidth == 50e9
    assert c.host_link.bandwidth == 50e9
    assert 360e9 <= c.intra_node.bandwidth <= 480e9


def test_h100_96gb_and_b200_numbers():
    """The Grand Teton H100 (torchtitan's benchmarks) and the B200: their datasheets' figures, the
    bandwidth at the share of its datasheet the measured H100 reached (presets.py sources)."""
    h100, gt, b200 = (ClusterSpec.preset(n) for n in ("h100-sxm", "h100-96gb", "b200"))
    assert gt.device.peak_flops == h100.device.peak_flops  # the SXM's chip; its power cap unpriced
    assert gt.device.memory_bytes == 94 * GiB
    assert gt.device.memory_bandwidth == pytest.approx(2.4e12 * 2.96 / 3.35)
    assert gt.inter_node == h100.inter_node and gt.intra_node == h100.intra_node
    assert b200.device.peak_flops_for(torch.bfloat16) == 2250e12
    assert b200.device.peak_flops_for(torch.float8_e4m3fn) == 4500e12
    assert b200.device.memory_bytes == 180 * GiB
    assert b200.device.memory_bandwidth == pytest.approx(8e12 * 2.96 / 3.35)
    # NVLink5 doubles NVLink4 per GPU [B200-DS]; the same NDR rail per GPU between nodes
    assert b200.intra_node.bandwidth == 2 * h100.intra_node.bandwidth
    assert b200.inter_node == h100.inter_node
    assert ClusterSpec.parse("b200:2x8").world_size == 16


def test_a100_numbers():
    a40 = ClusterSpec.preset("a100-40gb")
    a80 = ClusterSpec.preset("a100-80gb")
    for c in (a40, a80):
        assert c.device.peak_flops_for("float32") == 19.5e12
        assert c.device.peak_flops_for(torch.bfloat16) == 312e12
        assert c.device.peak_flops_for(torch.float16) == 312e12
        assert c.intra_node.bandwidth == 240e9
        assert c.inter_node.bandwidth == 25e9
        assert c.host_link.bandwidth == 25e9
    assert a40.device.memory_bytes == 40 * GiB
    assert a80.device.memory_bytes == 80 * GiB
    assert a40.device.memory_bandwidth == 1555e9
    assert a80.device.memory_bandwidth == 2039e9
    # no fp8 on A100: falls back to the float32 peak
    assert a40.device.peak_flops_for(torch.float8_e4m3fn) == 19.5e12


def test_h200_numbers():
    h200 = ClusterSpec.preset("h200")
    h100 = ClusterSpec.preset("h100-sxm")
    assert h200.device.peak_flops == h100.device.peak_flops
    assert h200.device.memory_bytes == 141 * GiB
    assert h200.device.memory_bandwidth == 4.24e12  # 4.8 TB/s x the H100's achieved 2.96 / 3.35
    assert h200.host_memory_bytes == 2 * 2**40


def test_cpu_numbers():
    c = ClusterSpec.preset("cpu")
    assert c.devices_per_node == 4
    assert c.device.peak_flops_for(torch.float32) == 50e9
    assert c.device.peak_flops_for(torch.bfloat16) == 50e9  # fallback to float32
    assert c.device.memory_bytes == 8 * GiB
    assert c.device.memory_bandwidth == 20e9
    assert c.intra_node == LinkSpec(1e9, 1e-3)  # measured by autopar calibrate (see cluster.py)
    assert c.inter_node == LinkSpec(1.25e9, 50e-6)


def test_world_size_and_hashable():
    c = ClusterSpec.preset("a100-80gb", nodes=3, devices_per_node=2)
    assert c.world_size == 6
    assert hash(c) == hash(ClusterSpec.preset("a100-80gb", nodes=3, devices_per_node=2))
    assert c.with_overrides(nodes=5).world_size == 10
    assert c.nodes == 3  # frozen copy, original unchanged


def test_peak_flops_accepts_dict_and_sorts():
    d = DeviceSpec("x", {"float16": 2.0, torch.float32: 1.0}, 10, 1.0, kind=DeviceKind.CPU)
    assert d.peak_flops == (("float16", 2.0), ("float32", 1.0))
    assert d.peak_flops_for(torch.float64) == 1.0


def test_peak_flops_for_without_float32_raises():
    d = DeviceSpec("x", {"bfloat16": 2.0}, 10, 1.0, kind=DeviceKind.CPU)
    assert d.peak_flops_for("bfloat16") == 2.0
    with pytest.raises(ClusterSpecError, match="float32"):
        d.peak_flops_for(torch.float16)


# ------------------------------------------------------------------------------------------ parse


def test_parse_preset_with_shape():
    c = ClusterSpec.parse("h100-sxm:8x8")
    assert c.world_size == 64
    assert (c.nodes, c.devices_per_node) == (8, 8)
    assert ClusterSpec.parse("cpu:1x4").world_size == 4
    assert ClusterSpec.parse("h200") == ClusterSpec.preset("h200")


@pytest.mark.parametrize("text", ["h100-sxm:8", "h100-sxm:8by8", "h100-sxm:x8", "h100-sxm:8x8x2", ""])
def test_parse_malformed(text):
    with pytest.raises(ClusterSpecError, match="NODESxDEVICES"):
        ClusterSpec.parse(text)


def test_parse_unknown_preset():
    with pytest.raises(ClusterSpecError, match="h100-sxm"):  # lists the known names
        ClusterSpec.parse("tpu-v5:2x4")
    with pytest.raises(ClusterSpecError, match="nodes"):
        ClusterSpec.parse("h100-sxm:0x8")


def test_parse_path(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"preset": "h100-sxm", "nodes": 2, "devices_per_node": 8}))
    assert ClusterSpec.parse(str(p)).world_size == 16


# ------------------------------------------------------------------------------------------ files


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_save_and_from_file(tmp_path, suffix):
    c = ClusterSpec.preset("a100-40gb", nodes=2, devices_per_node=4)
    p = tmp_path / f"cluster{suffix}"
    c.save(p)
    text = p.read_text()
    loaded = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    assert loaded["device"]["peak_flops"]["bfloat16"] == 312e12
    assert ClusterSpec.from_file(p) == c


def test_from_file_preset_only_json(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"preset": "h100-sxm", "nodes": 2, "devices_per_node": 8}))
    c = ClusterSpec.from_file(p)
    assert c == ClusterSpec.preset("h100-sxm", nodes=2, devices_per_node=8)
    assert c.world_size == 16


def test_from_file_preset_with_overrides_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "preset: cpu\n"
        "devices_per_node: 2\n"
        "device:\n"
        "  memory_bytes: 1000000\n"
        "  peak_flops: {bfloat16: 1e9}\n"  # YAML 1.1 reads '1e9' as a string; accepted
        "inter_node:\n"
        "  bandwidth: 1.0e+8\n"
    )
    c = ClusterSpec.from_file(p)
    base = ClusterSpec.preset("cpu")
    assert c.devices_per_node == 2
    assert c.nodes == 1
    assert c.device.memory_bytes == 1_000_000
    assert c.device.peak_flops_for("bfloat16") == 1e9
    assert c.device.peak_flops_for("float32") == base.device.peak_flops_for("float32")  # merged, kept
    assert c.device.memory_bandwidth == base.device.memory_bandwidth
    assert c.inter_node == LinkSpec(1e8, base.inter_node.latency)


def test_from_file_override_unknown_key(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"preset": "cpu", "device": {"memroy_bytes": 5}}))
    with pytest.raises(ClusterSpecError, match="memroy_bytes"):
        ClusterSpec.from_file(p)


def test_from_file_bad_extension_and_missing(tmp_path):
    with pytest.raises(ClusterSpecError, match="path"):
        ClusterSpec.from_file(tmp_path / "c.toml")
    with pytest.raises(ClusterSpecError, match="cannot read"):
        ClusterSpec.from_file(tmp_path / "missing.json")


def test_from_file_invalid_json(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("{not json")
    with pytest.raises(ClusterSpecError, match="not valid JSON"):
        ClusterSpec.from_file(p)


# ------------------------------------------------------------------------------------------ validation


def test_negative_bandwidth():
    with pytest.raises(ClusterSpecError, match="bandwidth") as ei:
        LinkSpec(bandwidth=-1.0, latency=0.0)
    assert "-1.0" in str(ei.value)


def test_negative_latency_and_nan():
    with pytest.raises(ClusterSpecError, match="latency"):
        LinkSpec(bandwidth=1.0, latency=-1e-6)
    with pytest.raises(ClusterSpecError, match="bandwidth"):
        LinkSpec(bandwidth=float("nan"), latency=0.0)
    with pytest.raises(ClusterSpecError, match="bandwidth"):
        LinkSpec(bandwidth=True, latency=0.0)


def test_zero_nodes():
    with pytest.raises(ClusterSpecError, match="nodes") as ei:
        ClusterSpec.preset("h100-sxm", nodes=0)
    assert ">= 1" in str(ei.value)
    with pytest.raises(ClusterSpecError, match="devices_per_node"):
        ClusterSpec.preset("cpu", devices_per_node=0)


def test_unknown_preset_lists_names():
    with pytest.raises(ClusterSpecError, match="preset") as ei:
        ClusterSpec.preset("v100")
    for name in PRESET_NAMES:
        assert name in str(ei.value)


def test_bad_device_fields():
    with pytest.raises(ClusterSpecError, match="memory_bytes"):
        DeviceSpec("x", {"float32": 1.0}, 0, 1.0, kind=DeviceKind.CPU)
    with pytest.raises(ClusterSpecError, match="peak_flops"):
        DeviceSpec("x", {"not_a_dtype": 1.0}, 1, 1.0, kind=DeviceKind.CPU)
    with pytest.raises(ClusterSpecError, match="peak_flops"):
        DeviceSpec("x", {"float32": 0.0}, 1, 1.0, kind=DeviceKind.CPU)
    with pytest.raises(ClusterSpecError, match="peak_flops"):
        DeviceSpec("x", {}, 1, 1.0, kind=DeviceKind.CPU)
    with pytest.raises(ClusterSpecError, match="memory_bandwidth"):
        DeviceSpec("x", {"float32": 1.0}, 1, -5.0, kind=DeviceKind.CPU)
    with pytest.raises(ClusterSpecError, match="name"):
        DeviceSpec("", {"float32": 1.0}, 1, 1.0, kind=DeviceKind.CPU)


def test_from_dict_unknown_and_missing_keys():
    d = ClusterSpec.preset("cpu").to_dict()
    d["colour"] = "blue"
    with pytest.raises(ClusterSpecError, match="colour"):
        ClusterSpec.from_dict(d)
    d = ClusterSpec.preset("cpu").to_dict()
    del d["host_link"]
    with pytest.raises(ClusterSpecError, match="host_link"):
        ClusterSpec.from_dict(d)
    d = ClusterSpec.preset("cpu").to_dict()
    d["intra_node"]["bandwidth"] = -3
    with pytest.raises(ClusterSpecError, match="intra_node.*bandwidth"):
        ClusterSpec.from_dict(d)


def test_with_overrides_unknown_field():
    with pytest.raises(ClusterSpecError, match="gpus"):
        ClusterSpec.preset("cpu").with_overrides(gpus=3)
    with pytest.raises(ClusterSpecError, match="nodes"):
        ClusterSpec.preset("cpu").with_overrides(nodes=-1)


# ------------------------------------------------------------------------------------------ round trip

_finite = {"allow_nan": False, "allow_infinity": False}
_pos = st.floats(min_value=1e-9, max_value=1e18, **_finite)
_nonneg = st.floats(min_value=0.0, max_value=1.0, **_finite)
_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_ ", min_size=1, max_size=20).filter(
    lambda s: s.strip()
)
_links = st.builds(LinkSpec, bandwidth=_pos, latency=_nonneg)
_dtypes = ["bfloat16", "float16", "float8_e4m3fn", "float64"]
_peaks = st.builds(
    lambda extra, f32: {"float32": f32, **extra},
    st.dictionaries(st.sampled_from(_dtypes), _pos),
    _pos,
)
_devices = st.builds(
    DeviceSpec,
    name=_names,
    peak_flops=_peaks,
    memory_bytes=st.integers(min_value=1, max_value=2**50),
    memory_bandwidth=_pos,
    kernel_launch_s=_nonneg,
)
_clusters = st.builds(
    ClusterSpec,
    name=_names,
    nodes=st.integers(min_value=1, max_value=4096),
    devices_per_node=st.integers(min_value=1, max_value=64),
    device=_devices,
    intra_node=_links,
    inter_node=_links,
    host_memory_bytes=st.integers(min_value=1, max_value=2**50),
    host_link=_links,
)


@settings(max_examples=75, deadline=None)
@given(_clusters)
def test_to_dict_from_dict_round_trip(spec):
    d = spec.to_dict()
    assert isinstance(d["device"]["peak_flops"], dict)
    via_json = json.loads(json.dumps(d))
    back = ClusterSpec.from_dict(via_json)
    assert back == spec
    assert back.to_dict() == d


# ------------------------------------------------------------------------------------------ local()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_local_without_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ClusterSpecError, match="init_process_group"):
        ClusterSpec.local()


def test_local_single_process_gloo(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        c = ClusterSpec.local()
        cpu = ClusterSpec.preset("cpu")
        assert c.name == "local"
        assert c.world_size == 1
        assert (c.nodes, c.devices_per_node) == (1, 1)
        assert c.device == cpu.device
        assert c.intra_node == cpu.intra_node
        assert c.inter_node == cpu.inter_node
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # does not divide world size 1
        with pytest.raises(ClusterSpecError, match="LOCAL_WORLD_SIZE"):
            ClusterSpec.local()
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert ClusterSpec.local(name="mine").name == "mine"
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("gpu", "mem", "flops_bf16", "bandwidth"),
    [
        ("NVIDIA A100-SXM4-40GB", 42_298_834_944, 312e12, 1555e9),
        ("NVIDIA A100-SXM4-80GB", 85_198_045_184, 312e12, 2039e9),
        ("NVIDIA H100 80GB HBM3", 85_020_000_000, 989e12, 2.96e12),  # achieved (test_gpu_preset.py)
        ("NVIDIA H200", 150_000_000_000, 989e12, 4.24e12),
        ("NVIDIA L40S", 48_000_000_000, 989e12, 2.96e12),  # unknown -> h100 numbers
    ],
)
def test_gpu_device_selection(gpu, mem, flops_bf16, bandwidth):
    d = _gpu_device(gpu, mem)
    assert d.memory_bytes == mem
    assert d.name == gpu
    assert d.peak_flops_for(torch.bfloat16) == flops_bf16
    assert d.memory_bandwidth == bandwidth


def test_local_gpu_backend_picks_closest_preset(monkeypatch):
    """With an NCCL-like backend and CUDA present, local() maps the GPU name to a preset's numbers."""

    class _Props:
        total_memory = 85_198_045_184

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: _Props())
        c = ClusterSpec.local()
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    a100 = ClusterSpec.preset("a100-80gb")
    assert c.world_size == 1
    assert c.device.memory_bytes == 85_198_045_184
    assert c.device.peak_flops == a100.device.peak_flops
    assert c.intra_node == a100.intra_node
    assert c.inter_node == a100.inter_node


def test_cpu_ranks_sharing_cores_compute_slower_in_proportion():
    """4 ranks on 2 cores: every op and optimizer step is priced twice as long; a core each: as given."""

    import autopar
    from autopar.examples import mlp

    base = ClusterSpec.preset("cpu", devices_per_node=4)
    shared = base.with_overrides(device=base.device.with_contention(host_cores=2))
    own = base.with_overrides(device=base.device.with_contention(host_cores=4))
    dedicated = base.with_overrides(device=base.device.with_contention(host_cores=0))
    assert (shared.compute_slowdown, own.compute_slowdown, dedicated.compute_slowdown) == (2.0, 1.0, 1.0)
    assert ClusterSpec.from_dict(shared.to_dict()) == shared
    model, inputs = mlp(batch=16, hidden=32, ffn=64)
    compute = {
        c.device.contention.host_cores: autopar.plan(
            model, c, inputs, axis_roles=(autopar.AxisRole.DATA,)
        ).predicted.compute_s
        for c in (shared, own, dedicated)
    }
    assert compute[2] == pytest.approx(2 * compute[4]) and compute[4] == pytest.approx(compute[0])


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "half"])
def test_comm_overlap_must_be_a_fraction(bad):
    base = ClusterSpec.preset("cpu")
    with pytest.raises(ClusterSpecError, match="comm_overlap"):
        dataclasses.replace(base.device, comm_overlap=bad)


def test_comm_overlap_round_trips_and_defaults_to_inline():
    base = ClusterSpec.preset("cpu")
    spec = base.with_overrides(device=dataclasses.replace(base.device, comm_overlap=0.25))
    assert ClusterSpec.from_dict(spec.to_dict()).device.comm_overlap == 0.25
    d = spec.to_dict()
    del d["device"]["comm_overlap"]  # a spec written before the field existed
    assert ClusterSpec.from_dict(d).device.comm_overlap == 0.0


def test_memory_reserve_is_a_validated_fraction_applied_to_any_limit():
    spec = ClusterSpec.preset("h100-sxm")
    assert spec.memory_reserve == 0.1
    assert spec.memory_limit() == pytest.approx(0.9 * spec.device.memory_bytes)
    assert spec.memory_limit(10 * 2**30) == pytest.approx(9 * 2**30)  # an explicit limit keeps it too
    tight = spec.with_overrides(memory_reserve=0.25)
    assert ClusterSpec.from_dict(tight.to_dict()) == tight
    d = spec.to_dict()
    del d["memory_reserve"]  # spec files (and plans) written before it existed: the default
    assert ClusterSpec.from_dict(d) == spec
    for bad in (-0.1, 1.0, "0.1x", True):
        with pytest.raises(ClusterSpecError, match="memory_reserve"):
            spec.with_overrides(memory_reserve=bad)


# ---------------------------------------------------------------- CPU contention (HostContention)


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if n != "cpu"])
def test_gpu_presets_carry_no_contention_terms(name):
    """Accelerators share no cores: no contention model, no slowdown, no sync wait, and no
    calibrated link ranges (per group layout, queued all-reduce) on any link."""
    c = ClusterSpec.preset(name, nodes=2)
    assert c.device.contention is None
    assert c.compute_slowdown == 1.0
    assert all(c.device.sync_wait_for(k) == 0.0 for k in ("all_reduce", "all_gather", "reduce_scatter"))
    assert "contention" not in c.to_dict()["device"]
    assert not any(link.ranges for link in (c.intra_node, c.inter_node, c.host_link))


def test_cpu_preset_carries_contention_of_this_hosts_cores():
    from autopar.hardware import usable_cores

    c = ClusterSpec.preset("cpu", devices_per_node=4)
    assert isinstance(c.device.contention, HostContention)
    assert c.device.contention.host_cores == usable_cores()
    assert c.compute_slowdown == max(1.0, 4 / usable_cores())
    assert c.device.sync_wait_for("all_reduce") == 0.0  # not calibrated
    assert c.to_dict()["device"]["contention"]["host_cores"] == usable_cores()


def test_contention_prices_slowdown_and_sync_wait_per_kind():
    h = HostContention(host_cores=2, sync_wait=0.03, sync_wait_kinds={"all_reduce": 0.05})
    assert h.slowdown(4) == 2.0 and h.slowdown(1) == 1.0 and HostContention().slowdown(8) == 1.0
    assert h.sync_wait_for("all_reduce") == 0.05 and h.sync_wait_for("all_gather") == 0.03
    dev = ClusterSpec.preset("cpu").device.with_contention(sync_wait=0.02)
    assert dev.sync_wait_for("all_gather") == 0.02
    assert hash(h) == hash(
        HostContention(host_cores=2, sync_wait=0.03, sync_wait_kinds=(("all_reduce", 0.05),))
    )


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"host_cores": -1}, "host_cores"),
        ({"host_cores": 1.5}, "host_cores"),
        ({"sync_wait": -0.1}, "sync_wait"),
        ({"sync_wait": float("nan")}, "sync_wait"),
        ({"sync_wait_kinds": {"all_reduce": -1.0}}, "sync_wait_kinds"),
        ({"sync_wait_kinds": [("all_reduce",)]}, "sync_wait_kinds"),
    ],
)
def test_contention_fields_are_validated(kw, field):
    with pytest.raises(ClusterSpecError, match=f"HostContention.{field}"):
        HostContention(**kw)


def test_device_contention_must_be_a_host_contention():
    base = ClusterSpec.preset("h100-sxm").device
    with pytest.raises(ClusterSpecError, match="DeviceSpec.contention"):
        dataclasses.replace(base, contention=4)
    # a mapping is read as HostContention's fields
    dev = dataclasses.replace(base, contention={"host_cores": 2})
    assert dev.contention == HostContention(host_cores=2)
    with pytest.raises(ClusterSpecError, match="unknown key"):
        dataclasses.replace(base, contention={"cores": 2})


def _today_device_dict(spec: ClusterSpec, **flat) -> dict:
    """``spec.to_dict()`` as spec files were written before ``DeviceSpec.contention``: the
    contention terms as flat device keys."""
    d = spec.to_dict()
    dev = d["device"]
    c = dev.pop("contention", None) or {"host_cores": 0, "sync_wait": 0.0, "sync_wait_kinds": {}}
    dev.update(c | flat)
    return d


def test_old_format_spec_dicts_load_into_contention(tmp_path):
    cpu = ClusterSpec.preset("cpu", devices_per_node=4)
    old = _today_device_dict(
        cpu, host_cores=2, sync_wait=0.049, sync_wait_kinds={"all_reduce": 0.049, "all_gather": 0.026}
    )
    assert {"host_cores", "sync_wait", "sync_wait_kinds"} <= set(old["device"])
    loaded = ClusterSpec.from_dict(old)
    assert loaded.device.contention == HostContention(
        host_cores=2, sync_wait=0.049, sync_wait_kinds={"all_reduce": 0.049, "all_gather": 0.026}
    )
    assert loaded.compute_slowdown == 2.0 and loaded.device.sync_wait_for("all_gather") == 0.026
    # written back in the new structure, which loads to the same spec
    assert "host_cores" not in loaded.to_dict()["device"]
    assert ClusterSpec.from_dict(loaded.to_dict()) == loaded
    # YAML files of the old format, numbers as text
    old["device"]["sync_wait"] = "0.049"
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(old))
    assert ClusterSpec.from_file(path) == loaded
    # a GPU spec file of the old format (host_cores 0, no wait) loads without a contention model
    h100 = ClusterSpec.preset("h100-sxm")
    old_gpu = _today_device_dict(h100)
    assert old_gpu["device"]["host_cores"] == 0
    assert ClusterSpec.from_dict(old_gpu) == h100
    # old-style flat overrides of a preset file
    path = tmp_path / "over.json"
    path.write_text(json.dumps({"preset": "cpu", "devices_per_node": 4, "device": {"host_cores": 1}}))
    assert ClusterSpec.from_file(path).compute_slowdown == 4.0


def test_contention_errors_name_the_field():
    d = ClusterSpec.preset("cpu").to_dict()
    d["device"]["contention"]["host_cores"] = -2
    with pytest.raises(ClusterSpecError, match=r"cluster\.device\.contention.*host_cores"):
        ClusterSpec.from_dict(d)
    d = ClusterSpec.preset("cpu").to_dict()
    d["device"]["contention"]["cores"] = 2
    with pytest.raises(ClusterSpecError, match="unknown key"):
        ClusterSpec.from_dict(d)
    d = ClusterSpec.preset("cpu").to_dict()
    d["device"]["contention"] = 3
    with pytest.raises(ClusterSpecError, match="contention"):
        ClusterSpec.from_dict(d)


def test_host_memory_bandwidth_is_shared_by_the_nodes_devices():
    """An offloaded optimizer steps in host memory, which the node's devices share; files written
    before the field load as "unknown" (priced at the host link's bandwidth)."""
    node = ClusterSpec.preset("h100-sxm")
    assert node.host_step_bandwidth == pytest.approx(node.host_memory_bandwidth / 8)
    one = ClusterSpec.preset("h100-sxm", devices_per_node=1)
    assert one.host_step_bandwidth == pytest.approx(8 * node.host_step_bandwidth)
    assert ClusterSpec.from_dict(node.to_dict()) == node
    old = node.to_dict()
    del old["host_memory_bandwidth"]
    loaded = ClusterSpec.from_dict(old)
    assert loaded.host_memory_bandwidth is None and loaded.host_step_bandwidth == node.host_link.bandwidth
    with pytest.raises(ClusterSpecError, match="host_memory_bandwidth"):
        node.with_overrides(host_memory_bandwidth=0)


@pytest.mark.parametrize(
    "name, memory, preset",
    [
        ("NVIDIA H100 80GB HBM3", 80 * GiB, "h100-sxm"),
        ("NVIDIA H100", 94 * GiB, "h100-96gb"),  # Grand Teton's 96 GB HBM2e part
        ("NVIDIA H100 NVL", 94 * GiB, "h100-sxm"),  # 94 GB of HBM3: the SXM's figures
        ("NVIDIA H200", 141 * GiB, "h200"),
        ("NVIDIA B200", 180 * GiB, "b200"),
        ("NVIDIA A100-SXM4-40GB", 40 * GiB, "a100-40gb"),
    ],
)
def test_a_gpu_is_priced_as_its_nearest_preset(name, memory, preset):
    from autopar.presets import _gpu_preset_for

    assert _gpu_preset_for(name, memory) == preset


# ------------------------------------------------------------------------------------------ base: files


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_base_file_is_the_preset_with_its_fields_replaced(tmp_path, suffix):
    """``{"base": PRESET, ...}``: the preset sized by nodes / devices_per_node, each field given
    replaced (nested mappings key by key), the rest the preset's; and it saves and loads back."""
    data = {
        "base": "h100-sxm",
        "nodes": 2,
        "device": {"memory_bytes": 40e9, "peak_flops": {"bfloat16": 500e12}},
        "inter_node": {"bandwidth": 25e9},
        "memory_reserve": 0.2,
    }
    p = tmp_path / f"c{suffix}"
    p.write_text(json.dumps(data) if suffix == ".json" else yaml.safe_dump(data))
    loaded = ClusterSpec.from_file(p)
    preset = ClusterSpec.preset("h100-sxm", nodes=2)
    peak = {**preset.device.to_dict()["peak_flops"], "bfloat16": 500e12}
    want = dataclasses.replace(
        preset,
        device=dataclasses.replace(preset.device, memory_bytes=int(40e9), peak_flops=peak),
        inter_node=dataclasses.replace(preset.inter_node, bandwidth=25e9),
        memory_reserve=0.2,
    )
    assert loaded == want
    assert loaded.device.peak_flops_for("float32") == preset.device.peak_flops_for("float32")
    assert loaded.world_size == 16 and loaded.name == "h100-sxm"
    out = tmp_path / f"saved{suffix}"
    loaded.save(out)
    assert ClusterSpec.from_file(out) == loaded
    # the older spelling of the key reads the same
    p.write_text(json.dumps({"preset": "h100-sxm", "nodes": 2}))
    assert ClusterSpec.from_file(p) == preset


@pytest.mark.parametrize(
    "data, message",
    [
        ({"base": "h100-sx"}, "cluster.base: unknown preset 'h100-sx' (did you mean 'h100-sxm'?)"),
        ({"base": "h100-sxm", "node": 2}, "cluster: unknown key 'node' (did you mean 'nodes'?)"),
        (
            {"base": "h100-sxm", "device": {"memroy_bytes": 1}},
            "cluster.device: unknown key 'memroy_bytes' (did you mean 'memory_bytes'?)",
        ),
        (
            {"base": "cpu", "device": {"contention": {"host_core": 1}}},
            "cluster.device.contention: unknown key 'host_core' (did you mean 'host_cores'?)",
        ),
        (
            {"base": "h100-sxm", "intra_node": {"bandwith": 1e9}},
            "cluster.intra_node: unknown key 'bandwith' (did you mean 'bandwidth'?)",
        ),
        (
            {"base": "h100-sxm", "device": {"peak_flops": {"bfloat": 1e12}}},
            "got dtype 'bfloat' (did you mean 'bfloat16'?)",
        ),
        ({"base": "h100-sxm", "preset": "cpu"}, "give the preset once, as 'base'"),
    ],
)
def test_base_file_errors_say_did_you_mean(tmp_path, data, message):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(data))
    with pytest.raises(ClusterSpecError) as e:
        ClusterSpec.from_file(p)
    assert message in str(e.value)


def test_a_file_without_base_names_what_it_lacks_and_the_base_form(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"name": "h100-sxm", "nodes": 2}))
    with pytest.raises(ClusterSpecError) as e:
        ClusterSpec.from_file(p)
    msg = str(e.value)
    assert (
        "missing key(s) ['devices_per_node', 'device', 'intra_node', 'inter_node', 'host_memory_bytes'" in msg
    )
    assert 'start from a preset and give only what differs, e.g. {"base": "h100-sxm"' in msg
    # a device's keys as files write them: contention's own keys are not offered beside them
    d = ClusterSpec.preset("cpu").to_dict()
    d["device"]["memory_byte"] = 1
    with pytest.raises(ClusterSpecError) as e:
        ClusterSpec.from_dict(d)
    msg = str(e.value)
    assert "unknown key 'memory_byte' (did you mean 'memory_bytes'?)" in msg
    assert "'contention'" in msg and "'sync_wait'" not in msg and "'host_cores'" not in msg
