"""The device kind (``DeviceSpec.kind``): every preset names it, spec files and plans carry it,
spec files written before it existed load with the kind their device had, and what is decided per
kind (autocast's op lists, the default kernels) reads the kind, never the device's name, and
refuses a kind it has no entry for."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

import autopar
from autopar import examples
from autopar.cluster import PRESET_NAMES, ClusterSpec, DeviceKind, DeviceSpec
from autopar.errors import ClusterSpecError, UnsupportedDeviceKindError
from autopar.fusion import Kernel
from autopar.hardware import per_kind
from autopar.passes import fuse, precision
from autopar.passes.analyze import analyze
from autopar.passes.trace import trace
from autopar.plan import Plan
from autopar.trades import Precision

# spec files written by ``ClusterSpec.save`` before devices had a kind (no "kind" key)
OLD_SPECS = Path(__file__).parent / "data" / "spec_before_kind"


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_names_its_kind_and_writes_it(name):
    spec = ClusterSpec.preset(name)
    assert spec.device.kind is (DeviceKind.CPU if name == "cpu" else DeviceKind.CUDA)
    assert spec.to_dict()["device"]["kind"] == spec.device.kind.value
    assert ClusterSpec.from_dict(spec.to_dict()) == spec


def test_a_device_must_be_given_a_kind_it_knows():
    with pytest.raises(TypeError, match="kind"):
        DeviceSpec("x", {"float32": 1.0}, 1, 1.0)  # type: ignore[call-arg]
    assert DeviceSpec("x", {"float32": 1.0}, 1, 1.0, kind=" CUDA ").kind is DeviceKind.CUDA
    for bad in ("xpu", "", None, 3):
        with pytest.raises(ClusterSpecError, match=r"DeviceSpec\.kind.*\['cpu', 'cuda'\]"):
            DeviceSpec("x", {"float32": 1.0}, 1, 1.0, kind=bad)
    d = ClusterSpec.preset("h100-sxm").to_dict()
    d["device"]["kind"] = "xpu"
    with pytest.raises(ClusterSpecError, match=r"cluster\.device: DeviceSpec\.kind: got 'xpu'"):
        ClusterSpec.from_dict(d)


@pytest.mark.parametrize(
    "file, kind, preset",
    [
        ("cpu.json", DeviceKind.CPU, None),
        ("h100-sxm.json", DeviceKind.CUDA, ClusterSpec.preset("h100-sxm", nodes=2)),
        ("a100-40gb.yaml", DeviceKind.CUDA, ClusterSpec.preset("a100-40gb", devices_per_node=4)),
    ],
)
def test_spec_files_written_before_the_kind_load_with_their_devices_kind(file, kind, preset, tmp_path):
    path = OLD_SPECS / file
    assert "kind" not in _read(path)["device"]
    loaded = ClusterSpec.from_file(path)
    assert loaded.device.kind is kind
    if preset is not None:
        assert loaded == preset
    # written again, the file names the kind, and loads to the same spec
    again = tmp_path / file
    loaded.save(again)
    assert _read(again)["device"]["kind"] == kind.value
    assert ClusterSpec.from_file(again) == loaded


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_a_preset_written_without_its_kind_loads_as_itself(name):
    spec = ClusterSpec.preset(name)
    old = spec.to_dict()
    del old["device"]["kind"]
    assert ClusterSpec.from_dict(old) == spec


def test_the_kind_is_what_the_file_says_not_what_the_name_suggests(tmp_path):
    """A kind written in the file wins over the device's name; a preset file's overrides keep the
    preset's kind unless they name another."""
    d = ClusterSpec.preset("cpu").to_dict()
    d["device"]["name"] = "NVIDIA H100 80GB HBM3"
    assert ClusterSpec.from_dict(d).device.kind is DeviceKind.CPU
    path = tmp_path / "over.yaml"
    path.write_text(yaml.safe_dump({"preset": "h100-sxm", "device": {"name": "cpu-like accelerator"}}))
    assert ClusterSpec.from_file(path).device.kind is DeviceKind.CUDA
    path.write_text(yaml.safe_dump({"preset": "h100-sxm", "device": {"kind": "cpu"}}))
    assert ClusterSpec.from_file(path).device.kind is DeviceKind.CPU


@pytest.fixture(scope="module")
def mlp():
    return examples.mlp(batch=8, hidden=16, ffn=32)


@pytest.mark.parametrize("preset", ["cpu", "h100-sxm"])
def test_the_kind_round_trips_through_a_plan(mlp, preset, tmp_path):
    cluster = ClusterSpec.preset(preset, devices_per_node=2)
    model, inputs = mlp
    path = tmp_path / "plan.json"
    autopar.plan(model, cluster, inputs).save(path)
    loaded = Plan.load(path)
    assert loaded.cluster["device"]["kind"] == cluster.device.kind.value
    assert ClusterSpec.from_dict(loaded.cluster) == cluster
    # a plan written before the kind: its cluster loads with the kind its device had
    del loaded.cluster["device"]["kind"]
    assert ClusterSpec.from_dict(loaded.cluster) == cluster


def _renamed(preset: str, name: str) -> ClusterSpec:
    spec = ClusterSpec.preset(preset)
    return spec.with_overrides(device=dataclasses.replace(spec.device, name=name))


def test_per_kind_choices_read_the_kind_not_the_name():
    gpu_named_cpu = _renamed("h100-sxm", "cpu (a GPU, despite its name)")
    cpu_named_gpu = _renamed("cpu", "NVIDIA H100 80GB HBM3")
    assert precision.autocast_device(gpu_named_cpu) is DeviceKind.CUDA
    assert precision.autocast_device(cpu_named_gpu) is DeviceKind.CPU
    assert fuse.chosen_kernels(gpu_named_cpu.device.kind, None) == frozenset(Kernel)
    assert fuse.chosen_kernels(cpu_named_gpu.device.kind, None) == frozenset()


@pytest.fixture(scope="module")
def traced_gpt2():
    model, inputs = examples.gpt2_tiny(batch=2, seq=8)
    tg = trace(model, inputs)
    return tg, analyze(tg)


def test_mixed_precision_is_priced_with_the_kinds_autocast_lists(traced_gpt2):
    """CUDA's autocast runs ``pow``, ``rsqrt``, softmax ... in fp32 where the CPU's keeps their
    input's dtype: the lists the pricing takes follow the kind."""
    tg, infos = traced_gpt2
    cuda_only = precision.AUTOCAST_FP32 - precision.AUTOCAST_FP32_CPU
    ops = [n for n, i in infos.items() if i.target and precision._packet(i.target) in cuda_only]
    assert ops
    cuda = precision.half_infos(tg, infos, Precision.BF16, DeviceKind.CUDA)
    cpu = precision.half_infos(tg, infos, Precision.BF16, DeviceKind.CPU)
    assert {cuda[n].dtype for n in ops} == {torch.float32}
    assert torch.bfloat16 in {cpu[n].dtype for n in ops}


def test_a_kind_without_autocast_lists_or_default_kernels_is_refused(traced_gpt2, monkeypatch):
    """Where a kind has no entry, the code that needs one raises, naming the table to extend,
    instead of taking another kind's (CUDA's autocast lists, as it once did for every non-CPU
    name); what needs no entry (fp32 pricing, kernels asked for by name) still works."""
    tg, infos = traced_gpt2
    monkeypatch.delitem(precision.AUTOCAST_BY_KIND, DeviceKind.CUDA)
    monkeypatch.delitem(fuse.AUTO_KERNELS, DeviceKind.CUDA)
    with pytest.raises(
        UnsupportedDeviceKindError, match=r"autocast.*CUDA.*passes/precision\.py AUTOCAST_BY_KIND"
    ):
        precision.half_infos(tg, infos, Precision.BF16, DeviceKind.CUDA)
    assert precision.half_infos(tg, infos, Precision.PARAM, DeviceKind.CUDA) is infos
    with pytest.raises(UnsupportedDeviceKindError, match=r"kernels.*CUDA.*passes/fuse\.py AUTO_KERNELS"):
        fuse.chosen_kernels(DeviceKind.CUDA, None)
    assert fuse.chosen_kernels(DeviceKind.CUDA, frozenset({Kernel.ROPE})) == {Kernel.ROPE}


def test_per_kind_names_the_table_and_the_known_kinds():
    table = {DeviceKind.CPU: 1}
    assert per_kind(table, DeviceKind.CPU, "x", "here") == 1
    with pytest.raises(
        UnsupportedDeviceKindError, match=r"no x for device kind CUDA \(known for: CPU\).*here"
    ):
        per_kind(table, DeviceKind.CUDA, "x", "here")
