"""The `autopar` command line: plan writes a loadable plan and report; errors exit 2 with a message."""

from __future__ import annotations

import json
import textwrap

import pytest

import autopar
from autopar.cli import main
from autopar.model_spec import load_model_spec


def test_plan_writes_plan_and_report(tmp_path, capsys):
    out, report = tmp_path / "plan.json", tmp_path / "report.html"
    rc = main(["plan", "autopar.examples:mlp(batch=8, hidden=16, ffn=32)", "--cluster", "cpu:1x2",
               "--out", str(out), "--report", str(report)])  # fmt: skip
    assert rc == 0
    plan = autopar.Plan.load(out)
    assert plan.world_size == 2 and plan.model == "MLP"
    assert "<svg" in report.read_text()
    printed = capsys.readouterr().out
    assert "solve: mesh (2,)" in printed and "predicted step time" in printed


def test_plan_from_a_file_model_spec_with_fixed_mesh(tmp_path):
    f = tmp_path / "my_model.py"
    f.write_text(
        textwrap.dedent("""
        import torch
        def build():
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
            return model, (torch.randn(4, 8),)
    """)
    )
    out = tmp_path / "p.json"
    assert main(["plan", f"{f}:build", "--cluster", "cpu:1x4", "--mesh", "2x2", "--out", str(out)]) == 0
    assert autopar.Plan.load(out).mesh_shape == (2, 2) and autopar.Plan.load(out).outputs == "full"
    args = ["plan", f"{f}:build", "--cluster", "cpu:1x4", "--outputs", "local", "--out", str(out)]
    assert main(args) == 0
    assert autopar.Plan.load(out).outputs == "local"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["plan", "autopar.examples:mlp", "--cluster", "nosuchgpu:1x2"], "nosuchgpu"),
        (["plan", "no_such_module_xyz:build", "--cluster", "cpu"], "no_such_module_xyz"),
        (["plan", "autopar.examples", "--cluster", "cpu"], "MODEL_SPEC"),
        (["plan", "autopar.examples:mlp", "--cluster", "cpu:1x2", "--mesh", "3"], "devices"),
        # a misspelt keyword of the example: the keywords it takes, not a traceback
        (["plan", "autopar.examples:gpt2_tiny(hiden=32)", "--cluster", "cpu:1x2"], "hidden: 'int' = 64"),
    ],
)
def test_errors_exit_2_with_a_message(argv, needle, capsys, tmp_path):
    assert main(argv + ["--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error:") and needle in err


def test_model_spec_kwargs():
    model, inputs = load_model_spec("autopar.examples:mlp(batch=3, hidden=5, ffn=7)")
    assert inputs[0].shape == (3, 5) and model.up.weight.shape == (7, 5)
    # a positional argument was dropped without a word (moe_tiny('mixtral') built the default family)
    from autopar.errors import ModelSpecError

    with pytest.raises(ModelSpecError, match="name every argument"):
        load_model_spec("autopar.examples:mlp(3, hidden=5)")


def test_coverage_lists_ops_and_fallbacks(capsys):
    import json

    spec = "autopar.examples:llama_tiny(batch=2, seq=8, hidden=32, vocab=64)"
    assert main(["coverage", spec, "--json"]) == 0
    rows = {r["op"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["aten.linear.default"]["has_rule"] and rows["aten.linear.default"]["count"] == 2 * 7 + 1
    # every op has a rule but, where transformers runs the rotary embedding under no_grad, that
    # block: a higher-order op (replicated)
    assert {op for op, r in rows.items() if not r["has_rule"]} <= {"wrap_with_set_grad_enabled"}
    assert "<built-in function getitem>" not in rows
    assert main(["coverage", "autopar.examples:mlp(batch=4, hidden=8, ffn=16)"]) == 0
    table = capsys.readouterr().out
    assert "aten.linear.default" in table and "have no rule" in table


def test_plan_a_meta_device_llama_prints_progress_and_gap(tmp_path, capsys):
    """The large-model path: --meta builds no weights; progress, then the plan with its gap."""
    spec = "autopar.examples:llama(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, vocab=1000, batch=8, seq=128)"
    out = tmp_path / "p.json"
    assert main(["plan", spec, "--cluster", "h100-sxm:1x8", "--meta", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert (
        printed.index("trace:")
        < printed.index("coarsen:")
        < printed.index("solve: mesh (8,)")
        < printed.index("plan for LlamaForCausalLM")
    )
    assert "optimality gap" in printed and "predicted peak memory per device" in printed
    assert autopar.Plan.load(out).world_size == 8


def test_plan_forces_pipeline_stages_and_schedule(tmp_path, capsys):
    out, report = tmp_path / "p.json", tmp_path / "r.html"
    spec = "autopar.examples:gpt2_tiny(batch=8, seq=16, layers=4, hidden=32, vocab=128)"
    argv = ["plan", spec, "--cluster", "cpu:1x4", "--mesh", "2", "--out", str(out)]
    assert main(argv + ["--pipeline-stages", "2", "--schedule", "1f1b", "--report", str(report)]) == 0
    saved = json.loads(out.read_text())
    assert saved["pipeline"]["stages"] == 2 and saved["pipeline"]["schedule"] == "1f1b"
    assert saved["mesh_shape"] == [2] and autopar.Plan.load(out).world_size == 4
    assert "pipeline: 2 stages, 1f1b" in capsys.readouterr().out
    assert "<h2>Pipeline</h2>" in report.read_text()


# auto: off on CPU ranks (their comm_overlap is 0: nothing hides behind a matmul there)
@pytest.mark.parametrize("flag,on", [("auto", False), ("on", True), ("off", False)])
def test_plan_takes_overlap_matmuls(tmp_path, flag, on):
    out = tmp_path / "p.json"
    argv = [
        "plan",
        "autopar.examples:mlp(batch=8, hidden=16, ffn=32)",
        "--cluster",
        "cpu:1x2",
        "--out",
        str(out),
    ]
    assert main(argv + ["--overlap-matmuls", flag]) == 0
    assert json.loads(out.read_text())["overlap_matmuls"] is on


def test_bad_pipeline_flags(tmp_path, capsys):
    argv = ["plan", "autopar.examples:gpt2_tiny", "--cluster", "cpu:1x4", "--out", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit) as e:
        main(argv + ["--schedule", "zigzag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "zigzag" in err
    assert all(s in err for s in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"))
    assert main(argv + ["--virtual-stages", "two"]) == 2
    assert "--virtual-stages must be a positive integer" in capsys.readouterr().err
    assert main(argv + ["--pipeline-stages", "0"]) == 2
    assert "pipeline_stages must be a positive integer" in capsys.readouterr().err


def test_report_renders_a_saved_plan_as_plan_report_did(tmp_path, capsys):
    """`autopar report PLAN.json` writes the page `autopar plan --report` wrote for the same plan."""
    out, first, again = tmp_path / "p.json", tmp_path / "first.html", tmp_path / "again.html"
    spec = "autopar.examples:gpt2_tiny(batch=8, seq=16, layers=4, hidden=32, vocab=128)"
    argv = ["plan", spec, "--cluster", "cpu:1x4", "--mesh", "2", "--pipeline-stages", "2"]
    assert main(argv + ["--out", str(out), "--report", str(first)]) == 0
    assert main(["report", str(out), "--out", str(again)]) == 0
    assert f"wrote {again}" in capsys.readouterr().out
    assert again.read_text() == first.read_text()
    assert "<h2>Pipeline</h2>" in again.read_text() and "This section is missing" not in again.read_text()
    assert main(["report", str(out), "--out", str(again), "--title", "run 7"]) == 0
    assert "<title>run 7</title>" in again.read_text()


def test_report_of_a_missing_or_broken_plan_file_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope.json"), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: cannot read the plan") and "nope.json" in err
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1')
    assert main(["report", str(bad), "--out", str(tmp_path / "r.html")]) == 2
    assert "not a JSON plan file" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def test_plan_takes_axis_roles(tmp_path):
    out = tmp_path / "p.json"
    spec = "autopar.examples:mlp(batch=8, hidden=16, ffn=32)"
    argv = ["plan", spec, "--cluster", "cpu:1x4", "--mesh", "2x2", "--axis-roles", "data,tensor"]
    assert main(argv + ["--out", str(out)]) == 0
    plan = autopar.Plan.load(out)
    assert plan.mesh_shape == (2, 2)
    assert {tuple(c["axis_roles"]) for c in plan.solver.candidates} == {("data", "tensor")}
    # axis 0 data parallel: the inputs split on the batch over it, every parameter whole over it
    inputs = [d for d in plan.decisions if d.role == "input"]
    assert inputs and all(d.output_spec[0].is_shard(0) for d in inputs)
    assert all(not d.output_spec[0].is_shard() for d in plan.decisions if d.role == "param")
    # axis 1 tensor parallel: every matrix sharded over it
    matrices = [d for d in plan.decisions if d.role == "param" and len(d.shape) >= 2]
    assert matrices and all(d.output_spec[1].is_shard() for d in matrices)


def test_bad_axis_roles(tmp_path, capsys):
    argv = ["plan", "autopar.examples:mlp", "--cluster", "cpu:1x4", "--out", str(tmp_path / "x.json")]
    with pytest.raises(SystemExit) as e:
        main(argv + ["--mesh", "2x2", "--axis-roles", "data,tensr"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "bad axis role 'tensr'" in err and "auto, data, tensor, sequence" in err
    # as many roles as the mesh has axes
    assert main(argv + ["--mesh", "2x2", "--axis-roles", "data"]) == 2
    assert "axis_roles has 1 entries but mesh_shape (2, 2) has 2 axes" in capsys.readouterr().err


def test_a_cpu_start_prints_no_torchao_noise():
    """On a torch built without CUDA, importing autopar and then building a Hugging Face model (which
    imports torchao where it is installed) prints none of torchao's "Failed to load" warnings for
    its CUDA-only extensions nor torch's notices about torchao's enums (``autopar/_quiet.py``):
    without it, every rank of the demo printed them."""
    import subprocess
    import sys

    import torch

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build: torchao's messages are left as they are")
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    code = (
        "import autopar\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,"
        " num_attention_heads=4, vocab_size=64))\n"
        "import torchao.float8\n"
        "print('built')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "built" in out.stdout, out.stderr[-2000:]
    assert "Failed to load" not in out.stderr and "is an Enum subclass" not in out.stderr, out.stderr[-2000:]


def test_plan_takes_expert_dispatch(tmp_path):
    """On 2 H100 nodes an expert axis over both is dispatched once per node by default (the
    search's choice there, tests/test_expert_nodes_search.py) and with the flat all-to-all under
    ``--expert-dispatch expert_all_to_all``."""
    spec = "autopar.examples:moe_plain_tiny(batch=64, seq=256, hidden=1024, experts=8)"
    vias = {}
    for flag in ("auto", "expert_all_to_all"):
        out = tmp_path / f"{flag}.json"
        argv = ["plan", spec, "--cluster", "h100-sxm:2x4", "--mesh", "8", "--axis-roles", "expert", "--meta"]
        assert main(argv + ["--out", str(out), "--expert-dispatch", flag]) == 0
        vias[flag] = {
            d["via"] for d in json.loads(out.read_text())["decisions"] if "expert" in d.get("via", "")
        }
    assert any("expert_node_all_to_all" in v for v in vias["auto"]), vias
    assert vias["expert_all_to_all"] and not any("node" in v for v in vias["expert_all_to_all"]), vias


def test_plan_takes_no_sequence_parallel(tmp_path):
    """``--no-sequence-parallel`` keeps the norms whole on the tensor axis (SearchOptions.sequence_parallel)."""
    spec = "autopar.examples:gpt3(layers=2, hidden=2048, heads=16, vocab=51200, batch=8, seq=2048, dtype='float16')"
    outputs = {}
    for flags in ([], ["--no-sequence-parallel"]):
        out = tmp_path / f"{len(flags)}.json"
        argv = ["plan", spec, "--cluster", "a100-80gb:1x8", "--mesh", "8", "--axis-roles", "tensor", "--meta"]
        assert (
            main(argv + ["--precision", "fp16", "--overlap-matmuls", "off", "--out", str(out)] + flags) == 0
        )
        decisions = json.loads(out.read_text())["decisions"]
        outputs[bool(flags)] = {d["output"] for d in decisions if "layer_norm" in d["op"]}
    assert outputs[False] and "R" not in outputs[False], outputs
    assert outputs[True] == {"R"}, outputs
