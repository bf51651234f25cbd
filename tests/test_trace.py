"""Tracing: clear errors, tied weights kept tied, meta-device models, positional and keyword inputs."""

from __future__ import annotations

import inspect

import pytest
import torch

import autopar
from autopar.examples import gpt2_tiny, llama_tiny, mlp
from autopar.passes.trace import Role, trace


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:  # data-dependent Python control flow: not traceable
            return y * 2
        return y


def test_untraceable_model_names_the_construct(capfd):
    with pytest.raises(autopar.TraceError) as e:
        trace(DataDependent(), (torch.randn(2, 4),))
    lines = str(e.value).splitlines()
    # the user's line first (file:line, function, its source), then why, then what to do
    line = inspect.getsourcelines(DataDependent.forward)[1] + 2
    assert lines[0] == "could not trace DataDependent:"
    assert lines[1] == f"  at {__file__}:{line} in forward", lines
    assert lines[2].strip() == "if y.sum().item() > 0:  # data-dependent Python control flow: not traceable"
    assert lines[3].startswith(
        "  Python control flow or .item() on a tensor's value, which a trace cannot follow"
    )
    assert lines[4].startswith("  Make that line traceable") and len(lines) == 5
    # and nothing else on the terminal: none of the partial graphs torch.export prints as it fails
    err = capfd.readouterr().err
    assert "def forward" not in err and "torch.ops.aten" not in err, err
    assert "Unable to find user code" not in err, err


def test_tied_weights_stay_one_parameter():
    model, inputs = gpt2_tiny(batch=2, seq=8, hidden=32, vocab=64)
    assert model.lm_head.weight is model.transformer.wte.weight
    tg = trace(model, inputs)
    params = [p.target for p in tg.placeholders if p.role is Role.PARAM]
    assert len(params) == len({id(t) for t in model.parameters()})
    assert ("lm_head.weight" in params) != ("transformer.wte.weight" in params)


def test_roles_and_inputs():
    model, inputs = mlp(batch=4, hidden=8, ffn=16)
    tg = trace(model, inputs)  # positional inputs
    roles = [(p.role, p.target) for p in tg.placeholders]
    assert roles == [(Role.PARAM, "up.weight"), (Role.PARAM, "up.bias"), (Role.PARAM, "down.weight"),
                     (Role.PARAM, "down.bias"), (Role.INPUT, "0"), (Role.INPUT, "1")]  # fmt: skip
    model, inputs = llama_tiny(batch=2, seq=8, hidden=32, vocab=64)
    tg = trace(model, inputs)  # keyword inputs
    assert [p.target for p in tg.placeholders if p.role is Role.INPUT] == ["input_ids", "labels"]


def test_meta_device_model_plans_without_memory():
    """A 8B-wide Llama layer stack on the meta device plans without allocating its weights."""
    with torch.device("meta"):
        model, _ = llama_tiny(layers=2, hidden=4096, vocab=32000)
    assert all(p.is_meta for p in model.parameters())
    ids = torch.randint(0, 32000, (8, 1024))
    plan = autopar.plan(model, autopar.ClusterSpec.preset("h100-sxm"), {"input_ids": ids, "labels": ids},
                        mesh_shape=(8,))  # fmt: skip
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params > 5e8
    assert plan.predicted.param_bytes >= n_params * 4 / 8  # at most 8-way sharded fp32 weights
    assert plan.predicted.step_time_s > 0


def test_tracing_works_on_a_torch_without_the_stack_trace_switch(monkeypatch):
    """torch 2.11 has no ``torch.fx.config.do_not_emit_stack_traces``: tracing must not
    need it."""
    import torch.fx.config

    from autopar.examples import mlp
    from autopar.passes.trace import trace

    monkeypatch.delattr(torch.fx.config, "do_not_emit_stack_traces", raising=False)  # 2.11 lacks it
    model, inputs = mlp(batch=4, hidden=8, ffn=16)
    tg = trace(model, inputs)
    assert any(n.op == "call_function" for n in tg.graph.nodes)
