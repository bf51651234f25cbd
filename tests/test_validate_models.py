"""validate_graph on the small GPT-2, Llama and DeepSeek-V3 (MLA, in-place writes into buffers,
grouped routing): every strategy of every node, mesh (2,)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from autopar import examples  # noqa: E402
from autopar.passes.trace import trace  # noqa: E402
from autopar.tools.validate import main, validate_graph  # noqa: E402

MODELS = {
    "gpt2": lambda: examples.gpt2_tiny(batch=4, seq=8, hidden=32, vocab=64),
    "llama": lambda: examples.llama_tiny(batch=4, seq=8, hidden=32, vocab=64),
    "deepseek_v3": lambda: examples.moe_tiny("deepseek_v3", batch=4, seq=8),
}


@pytest.fixture(scope="module", params=list(MODELS))
def validated(request):
    model, inputs = MODELS[request.param]()
    tg = trace(model, inputs)
    return request.param, tg, validate_graph(tg, (2,), inputs, max_per_node=None)


def test_no_wrong_rules(validated):
    name, _, problems = validated
    wrong = [p for p in problems if p.kind == "wrong"]
    assert not wrong, f"{name}:\n" + "\n".join(map(str, wrong))


def test_missing_rules_are_listed(validated):
    _, tg, problems = validated
    missing = [p for p in problems if p.kind == "missing"]
    ops = {str(n.target) for n in tg.graph.nodes if n.op == "call_function"}
    for p in missing:
        assert p.op in ops and p.nodes and p.node == p.nodes[0]
        assert "missing rule" in str(p)
    assert len({p.op for p in missing}) == len(missing)  # one entry per op
    # the only op left without a rule: Llama's no-grad rotary block, a higher-order op (replicated)
    assert {p.op for p in missing} <= {"wrap_with_set_grad_enabled"}


def test_cli(capsys):
    rc = main(["autopar.examples:gpt2_tiny(batch=4, seq=8, hidden=32, vocab=64, layers=1)", "--mesh", "2"])
    out = capsys.readouterr().out
    assert "GPT2LMHeadModel on mesh 2:" in out
    assert rc == (1 if "WRONG rule" in out else 0)
