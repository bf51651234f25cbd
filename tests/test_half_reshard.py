"""Reshards in the half type under mixed precision (``passes/half_reshard.py``): an fp32 activation
whose every use is an autocast GEMM (a layer norm's output before Q, K and V) is cast to bf16 before
its reshards, so sequence parallelism all-gathers it in bf16, as Megatron-LM does; the cost model
prices those collectives at the half type's bytes.

Checked here: Llama's sequence-parallel plan (``test_collective_matmul._sequence_parallel``) under
bf16 mixed precision, with and without collective matmuls, trains on gloo ranks as the single
device does under ``torch.autocast`` (the tolerances of ``test_zero.py``'s bf16 runs), its code
casting before the gathers; and the plan's gathers into linears are priced at half the bytes of the
fp32 plan's, the others at the same."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_collective_matmul import _sp_plan, build

import autopar
from autopar.launch import run_on_ranks
from autopar.reshard import Collective
from autopar.trades import Precision

BF16_LOSS = dict(rtol=2e-2, atol=2e-2)  # as test_zero.py's bf16 runs
BF16_GRAD = dict(rtol=5e-2, atol=5e-3)


def _bf16(plan, overlap: bool):
    trades = dataclasses.replace(plan.trades, precision=Precision.BF16)
    return dataclasses.replace(plan, trades=trades, overlap_matmuls=overlap)


def _rank(rank, world, jobs):
    from autopar.codegen.module import full_tensor

    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    results = {}
    for key, path in jobs:
        model, inputs = build("llama")
        pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
        out = pmodel(**inputs)
        out.loss.backward()
        grads = {}
        for fqn, (attr, spec) in pmodel._state_specs.items():
            p = getattr(pmodel.local, attr)
            if isinstance(p, torch.nn.Parameter) and p.grad is not None:
                grads[fqn] = full_tensor(p.grad, spec, pmodel.mesh).clone()
        grads = {name: grads[fqn] for name, fqn in pmodel._aliases.items() if fqn in grads}
        results[key] = (out.loss.detach().float(), grads, pmodel.code if rank == 0 else "")
    return results


def _reference():
    model, inputs = build("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_sequence_parallel_gathers_in_bf16_and_trains_as_one_device(tmp_path):
    sp = _sp_plan("llama")
    jobs = []
    for overlap in (True, False):
        path = tmp_path / f"llama_{overlap}.json"
        _bf16(sp, overlap).save(path)
        jobs.append((overlap, str(path)))
    per_rank = run_on_ranks(_rank, 2, jobs, timeout_s=300)
    ref_loss, ref_grads = _reference()
    for overlap, _ in jobs:
        for rank, results in enumerate(per_rank):
            loss, grads, code = results[overlap]
            where = f"overlap {overlap} rank {rank}"
            torch.testing.assert_close(loss, ref_loss, **BF16_LOSS, msg=f"{where}: loss")
            assert set(grads) == set(ref_grads), where
            for k in ref_grads:
                torch.testing.assert_close(
                    grads[k], ref_grads[k], **BF16_GRAD, msg=f"{where}: gradient of {k}"
                )
            if rank == 0:  # the norms' outputs cast to bf16, then gathered (fused with the linear or not)
                gather = "all_gather_linear(to" if overlap else "all_gather(to"
                assert ".to(torch.bfloat16)" in code and gather in code, code


def test_gathers_into_linears_are_priced_in_the_half_type(monkeypatch):
    """The plan under bf16 mixed precision (where the norms stay fp32) priced as it runs, and as
    it ran before (every reshard in the tensor's own dtype): each all-gather into a linear moves
    half the bytes, forward and its backward reduce-scatter; every other collective as many; the
    step is priced faster."""
    import autopar.passes.trades as trades_pricing

    model, inputs = build("llama")
    h100 = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=2)
    plan = _bf16(_sp_plan("llama"), False)
    half = autopar.reprice(model, h100, inputs, plan)
    monkeypatch.setattr(trades_pricing, "casts_before_reshard", lambda node: False)
    own = autopar.reprice(model, h100, inputs, plan)
    linears = {n.name for n in _linears(model, inputs)}
    halved = same = 0
    for d in own.decisions:
        b = half[d.name]
        assert len(b.collectives) == len(d.collectives), d.name
        gathered = d.name in linears and any(c.kind is Collective.ALL_GATHER for c in d.collectives)
        for c, c16 in zip(d.collectives, b.collectives):
            assert (c16.kind, c16.phase) == (c.kind, c.phase), d.name
            if gathered:
                assert c16.nbytes == c.nbytes / 2, (d.name, c, c16)
                halved += 1
            else:
                assert c16.nbytes == c.nbytes, (d.name, c, c16)
                same += 1
    assert halved >= 8 and same >= 4, (halved, same)
    assert half.predicted.step_time_s < own.predicted.step_time_s


def _linears(model, inputs):
    from autopar.passes.collective_matmul import LINEAR
    from autopar.passes.trace import trace

    return [n for n in trace(model, inputs).graph.nodes if n.target is LINEAR]
