"""Mixture-of-experts layers as one op (``passes/experts.py``): every family's MoE region becomes
one ``autopar::moe_experts`` call, and the folded graph computes what the graph as captured
computes: the loss and the logits, and every parameter's gradient."""

from __future__ import annotations

import pytest
import torch

from autopar.examples import MOE_FAMILIES, llama_tiny, moe_plain_tiny, moe_tiny
from autopar.passes.trace import trace
from autopar.tools.validate import placeholder_values

pytest.importorskip("transformers")


def _moe_nodes(tg):
    return [
        n
        for n in tg.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.autopar.moe_experts.default
    ]


def _run(tg, batch):
    values = placeholder_values(tg, batch, seed=0)
    values = [v.detach().requires_grad_() if v.dtype.is_floating_point else v for v in values]
    loss, logits = tg.graph_module(*values)[:2]
    grads = torch.autograd.grad(loss, [v for v in values if v.requires_grad], allow_unused=True)
    return loss, logits, grads


# each model, its number of MoE layers and the form its experts take: (act, gated, transposed, E)
# and whether gate and up are separate weights
CASES = {
    **{f: (lambda f=f: moe_tiny(f, layers=2), 1 if f == "deepseek_v3" else 2, ("silu", True, True, 4), False)
       for f in MOE_FAMILIES},
    "plain": (lambda: moe_plain_tiny(layers=2), 2, ("silu", True, False, 4), True),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_family_folds_to_one_op_per_layer_and_computes_the_same(name):
    build, layers, form, separate = CASES[name]
    model, batch = build()
    folded, captured = trace(model, batch), trace(model, batch, experts=False)
    nodes = _moe_nodes(folded)
    assert len(nodes) == layers
    # the region's ops are gone: no sort, grouped matmul or gathered-weight bmm is left
    gone = ("sort", "grouped_mm", "bmm", "index_add")
    assert not any(any(g in str(n.target) for g in gone) for n in folded.graph.nodes)
    n = nodes[0]
    assert n.args[6:10] == form and (n.args[4] is not None) == separate
    loss, logits, grads = _run(folded, batch)
    want_loss, want_logits, want_grads = _run(captured, batch)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(logits, want_logits)
    assert len(grads) == len(want_grads)
    for got, want in zip(grads, want_grads):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()) + 1e-12)


def test_a_dense_model_has_nothing_to_fold():
    model, batch = llama_tiny(batch=2, seq=8)
    assert not _moe_nodes(trace(model, batch))


def test_under_autocast_the_experts_run_and_are_priced_in_the_half_type():
    """On fp32 masters under ``torch.autocast`` the experts' matmuls run in bf16, as a linear's do
    (their custom ops are out of autocast's reach: the op casts its operands), and the cost model
    prices the op in bf16 (``passes/precision.py:AUTOCAST_HALF``)."""
    from autopar.hardware import DeviceKind
    from autopar.passes.analyze import analyze
    from autopar.passes.precision import half_infos
    from autopar.trades import Precision

    model, batch = moe_tiny("qwen3_moe", layers=1)
    tg = trace(model, batch)
    node = _moe_nodes(tg)[0]
    infos = half_infos(tg, analyze(tg), Precision.BF16, DeviceKind.CPU)
    assert infos[node.name].dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    x, weights = torch.randn(16, 32, generator=gen), torch.rand(16, 2, generator=gen)
    ids = torch.randint(0, 4, (16, 2), generator=gen)
    w_in, w_out = torch.randn(4, 64, 32, generator=gen) / 6, torch.randn(4, 32, 32, generator=gen) / 6
    args = (x, weights, ids, w_in, None, w_out, "silu", True, True, 4)
    want = torch.ops.autopar.moe_experts(*args)
    assert want.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.ops.autopar.moe_experts(*args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2 * float(want.abs().max()))
