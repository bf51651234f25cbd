"""No silent mispricing: an op whose FLOPs or saved tensors analysis cannot derive is an error in
strict mode (on for the whole suite, tests/conftest.py), a reason on its ``NodeInfo`` and a WARNING
otherwise, and a line in ``autopar coverage``.

The op that cannot be probed is built here: a custom op whose fake kernel serves tracing
(FakeTensorMode) but refuses plain meta tensors, as an op without a meta kernel does.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import autopar
import autopar.passes.analyze as analyze_mod
from autopar.cli import main
from autopar.errors import AutoparError, UnpricedOpError
from autopar.passes.analyze import STRICT_ENV, analyze, strict_default
from autopar.passes.trace import trace


@torch.library.custom_op("autopar_test::no_meta_scale", mutates_args=())
def no_meta_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@no_meta_scale.register_fake
def _(x):
    if not isinstance(x, FakeTensor):
        raise NotImplementedError("autopar_test::no_meta_scale has no meta kernel")
    return torch.empty_like(x)


no_meta_scale.register_autograd(lambda ctx, g: g * 2)

OP = "autopar_test.no_meta_scale.default"


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.ops.autopar_test.no_meta_scale(self.lin(x)).sum()


def unprobed_model():
    """MODEL_SPEC for the CLI: ``test_analyze_strict:unprobed_model``."""
    return _Model(), (torch.randn(4, 8),)


def _node(tg):
    return next(n for n in tg.graph.nodes if str(n.target) == OP)


def test_the_suite_runs_strict():
    assert strict_default()


def test_strict_analysis_names_the_op_the_node_and_the_fix():
    tg = trace(*unprobed_model())
    with pytest.raises(UnpricedOpError) as err:
        analyze(tg)
    msg = str(err.value)
    assert isinstance(err.value, AutoparError)
    assert OP in msg and _node(tg).name in msg
    assert "flops" in msg and "saved tensors" in msg and "NotImplementedError" in msg
    assert "KNOWN_UNPROBED" in msg and STRICT_ENV in msg


def test_strict_is_read_from_the_environment(monkeypatch):
    tg = trace(*unprobed_model())
    monkeypatch.setenv(STRICT_ENV, "0")
    assert not strict_default()
    assert _node(tg).name in analyze(tg)  # falls back, does not raise
    with pytest.raises(UnpricedOpError):
        analyze(tg, strict=True)


def test_non_strict_keeps_the_fallback_and_says_why(caplog, monkeypatch):
    monkeypatch.setattr(analyze_mod, "_WARNED", set())  # earlier tests may have warned already
    tg = trace(*unprobed_model())
    with caplog.at_level(logging.WARNING, logger="autopar.passes.analyze"):
        infos = analyze(tg, strict=False)
        analyze(tg, strict=False)
    info = infos[_node(tg).name]
    # the fallback figures are unchanged: no FLOPs, every input kept, every input gradient new
    assert info.flops == 0.0 and info.saves_inputs == (True,) and info.grad_new == (True,)
    assert [r.split(":")[0] for r in info.unpriced] == ["flops", "saved tensors"]
    assert all(
        "NotImplementedError: autopar_test::no_meta_scale has no meta kernel" in r for r in info.unpriced
    )
    # every other node is derived
    assert not [n for n, i in infos.items() if i.unpriced and n != info.name]
    # one WARNING per op kind and figure, however often it is analyzed
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and OP in r.getMessage()]
    assert len(warned) == 2


def test_coverage_lists_the_op_and_why():
    rows = {r.op: r for r in autopar.coverage(*unprobed_model())}
    assert rows[OP].unpriced and rows[OP].unpriced[0].startswith("flops: NotImplementedError")
    assert not rows["aten.linear.default"].unpriced
    assert next(iter(rows)) == OP  # ops to look at come first


def test_coverage_cli_prints_a_line_with_the_reason(capsys):
    import json

    spec = "test_analyze_strict:unprobed_model"
    assert main(["coverage", spec]) == 0
    table = capsys.readouterr().out
    line = next(ln for ln in table.splitlines() if ln.startswith(OP))
    assert "NOT DERIVED" in line and "flops: NotImplementedError" in line and "saved tensors:" in line
    linear = next(ln for ln in table.splitlines() if ln.startswith("aten.linear.default"))
    assert "yes" in linear and "derived" in linear and "NOT DERIVED" not in linear
    assert "1 ops (1 nodes) have FLOPs or saved tensors that could not be derived" in table
    assert main(["coverage", spec, "--json"]) == 0
    rows = {r["op"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[OP]["unpriced"] and rows["aten.linear.default"]["unpriced"] == []


@pytest.mark.parametrize("name", ["mlp", "gpt2_tiny", "llama_tiny"])
def test_the_example_models_are_priced_throughout(name):
    from autopar import examples

    tg = trace(*getattr(examples, name)())
    assert not [i for i in analyze(tg, strict=True).values() if i.unpriced]


class _Wrapped(torch.nn.Module):
    """A no-grad block (as transformers' rotary embeddings) and an autocast region: each traced as
    a higher-order op around a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = torch.nn.Linear(8, 8)
        self.l = torch.nn.Linear(8, 8)
        self.register_buffer("f", torch.randn(8, 8))

    def forward(self, x):
        h = self.l0(x)
        with torch.no_grad():
            c = (h @ self.f).cos()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            d = self.l(h)
        return (h * c * d.float()).sum()


def test_wrapper_higher_order_ops_are_priced_by_their_body():
    tg = trace(_Wrapped(), (torch.randn(4, 8),))
    infos = analyze(tg, strict=True)
    hops = {
        str(n.target): infos[n.name]
        for n in tg.graph.nodes
        if isinstance(n.target, torch._ops.HigherOrderOperator)
    }
    assert set(hops) == {"wrap_with_set_grad_enabled", "wrap_with_autocast"}
    assert all(i.flops == 2 * 4 * 8 * 8 and not i.unpriced for i in hops.values())
    # under no_grad the body keeps nothing for backward and its output needs no gradient
    nograd = hops["wrap_with_set_grad_enabled"]
    assert not any(nograd.saves_inputs) and not nograd.saves_output and not any(nograd.grad_new)
