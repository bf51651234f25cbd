"""A GEMM runs at its operands' rate, whatever dtype it returns: the fused output projection + loss
of a model whose parameters are bf16 (no autocast) returns an fp32 loss from bf16 operands, and
its GEMMs run on the bf16 tensor cores, as the same op under bf16 mixed precision does. Priced at
the fp32 rate, the loss of MPT-13B on 128 A100 took 4.6 of a 20.5 s step
(``benchmarks/bench_published.py --row mpt-13b-128xa100-40gb``: -18.9% -> +2.9%)."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.examples import llama_tiny
from autopar.passes.analyze import analyze
from autopar.passes.trace import trace

FUSED = "autopar.linear_cross_entropy.default"


def _loss_s(plan) -> float:
    (d,) = [d for d in plan.decisions if d.op == FUSED]
    return d.compute_s


@pytest.fixture(scope="module")
def model_inputs():
    # a vocabulary wide enough that the output projection is bound by its arithmetic on an H100
    return llama_tiny(batch=8, seq=256, layers=1, hidden=256, vocab=32768)


def _plan(model, inputs, **kw):
    cluster = autopar.ClusterSpec.preset("h100-sxm", nodes=1, devices_per_node=1)
    return autopar.plan(model, cluster, inputs, mesh_shape=(1,), outputs=autopar.placement.Outputs.LOSS, **kw)


def test_pure_bf16_loss_is_priced_at_the_bf16_rate(model_inputs):
    model, inputs = model_inputs
    mixed = _plan(model, inputs, precision=autopar.Precision.BF16)
    fp32 = _plan(model, inputs, precision=autopar.Precision.PARAM)
    pure = _plan(copy.deepcopy(model).to(torch.bfloat16), inputs, precision=autopar.Precision.PARAM)
    # the same GEMMs at the same shapes and rate as under mixed precision (bytes differ a little:
    # the masters are fp32 there), and a fraction of the fp32 model's (989 / 67 TFLOP/s dense)
    assert _loss_s(pure) == pytest.approx(_loss_s(mixed), rel=0.05)
    assert _loss_s(pure) < _loss_s(fp32) / 5


class _Head(torch.nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.out = torch.nn.Parameter(torch.randn(vocab, hidden) / hidden**0.5)

    def forward(self, h, labels):
        loss, _ = torch.ops.autopar.linear_cross_entropy(self.proj(h), self.out, labels)
        return loss


def test_rate_dtype_is_the_operands_where_narrower():
    import autopar.kernels.cross_entropy  # noqa: F401 - registers the op

    model = _Head(64, 512).to(torch.bfloat16)
    h = torch.randn(32, 64, dtype=torch.bfloat16)
    infos = analyze(trace(model, (h, torch.randint(0, 512, (32,)))))
    (fused,) = [i for i in infos.values() if i.target == FUSED]
    assert fused.dtype == torch.float32 and fused.rate_dtype == torch.bfloat16
    (linear,) = [i for i in infos.values() if i.target == "aten.linear.default"]
    assert linear.rate_dtype == linear.dtype == torch.bfloat16
    assert linear.operand_dtype is None  # its output's dtype already
