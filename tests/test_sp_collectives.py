"""Sequence parallelism's collectives as Megatron-LM runs them.

(a) Reshards in the half type under mixed precision (``passes/half_reshard.py``): an fp32 activation
whose every use is an autocast GEMM (a layer norm's output before Q, K and V) is cast to bf16
before its reshards, so sequence parallelism all-gathers it in bf16; the cost model prices those
collectives at the half type's bytes.
(b) A collective matmul whose linear is its input's only use keeps the shard and gathers it again
in backward (``kernels/collective_matmul.py``, ``passes/collective_matmul.py``): forward keeps
``1/n`` of the gathered bytes.

Checked here: Llama's sequence-parallel plan (``test_collective_matmul._sequence_parallel``) under
bf16 mixed precision, with and without collective matmuls, trains on gloo ranks as the single
device does under ``torch.autocast`` (the tolerances of ``test_zero.py``'s bf16 runs), its code
casting before the gathers; the bytes autograd saves drop, with collective matmuls on, by what the
memory model prices; and the plan's gathers into linears are priced at half the bytes of the
same plan's reshards in the tensor's own dtype, the others at the same."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import pytest
import torch
from harness import saved_bytes
from test_collective_matmul import _sp_plan, build

import autopar
from autopar.launch import run_on_ranks
from autopar.passes.collective_matmul import regathers
from autopar.placement import R, spec_from_str
from autopar.reshard import Collective
from autopar.trades import Precision

BF16_LOSS = dict(rtol=2e-2, atol=2e-2)  # as test_zero.py's bf16 runs
BF16_GRAD = dict(rtol=5e-2, atol=5e-3)


def _bf16(plan, overlap: bool):
    trades = dataclasses.replace(plan.trades, precision=Precision.BF16)
    return dataclasses.replace(plan, trades=trades, overlap_matmuls=overlap)


def _no_regather(*args) -> bool:
    return False


def _rank(rank, world, jobs):
    from unittest import mock

    from autopar.codegen.module import full_tensor

    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    results = {}
    for key, path in jobs:
        # "kept": the collective matmuls keep the gathered input, as before they re-gathered
        with mock.patch("autopar.codegen.lower.regathers", _no_regather) if key == "kept" else nullcontext():
            model, inputs = build("llama")
            pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
            fresh_model, fresh_inputs = build("llama")
            fresh = autopar.autoparallelize(fresh_model, cluster, fresh_inputs, plan=path)
        out = pmodel(**inputs)
        out.loss.backward()
        grads = {}
        for fqn, (attr, spec) in pmodel._state_specs.items():
            p = getattr(pmodel.local, attr)
            if isinstance(p, torch.nn.Parameter) and p.grad is not None:
                grads[fqn] = full_tensor(p.grad, spec, pmodel.mesh).clone()
        grads = {name: grads[fqn] for name, fqn in pmodel._aliases.items() if fqn in grads}
        saved = saved_bytes(fresh, fresh_inputs)
        results[key] = (out.loss.detach().float(), grads, pmodel.code if rank == 0 else "", saved)
    return results


def _reference():
    model, inputs = build("llama")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_sequence_parallel_gathers_in_bf16_and_trains_as_one_device(tmp_path, monkeypatch):
    sp = _sp_plan("llama")
    jobs = []
    for key, overlap in (("fused", True), ("unfused", False), ("kept", True)):
        path = tmp_path / f"llama_{key}.json"
        _bf16(sp, overlap).save(path)
        jobs.append((key, str(path)))
    per_rank = run_on_ranks(_rank, 2, jobs, timeout_s=300)
    ref_loss, ref_grads = _reference()
    for key, _ in jobs:
        for rank, results in enumerate(per_rank):
            loss, grads, code, _ = results[key]
            where = f"{key} rank {rank}"
            torch.testing.assert_close(loss, ref_loss, **BF16_LOSS, msg=f"{where}: loss")
            assert set(grads) == set(ref_grads), where
            for k in ref_grads:
                torch.testing.assert_close(
                    grads[k], ref_grads[k], **BF16_GRAD, msg=f"{where}: gradient of {k}"
                )
                if key == "fused":  # re-gathered: the gradients of the path that kept the gathered input
                    torch.testing.assert_close(
                        grads[k], results["kept"][1][k], **BF16_GRAD, msg=f"{where}: gradient of {k}"
                    )
            if rank == 0:  # the norms' outputs cast to bf16, then gathered (fused with the linear or not)
                gather = "all_gather_linear(to" if key != "unfused" else "all_gather(to"
                assert ".to(torch.bfloat16)" in code and gather in code, code
                assert ("regather = True" in code) is (key == "fused"), code
    # the peak the memory model prices drops by (n - 1) / n of each re-gathered input (the stacked
    # Q, K and V's, gate and up's, the head's); autograd saves that much less
    model, inputs = build("llama")
    cpu = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    regather = autopar.reprice(model, cpu, inputs, _bf16(sp, True)).predicted.peak_memory_bytes
    # the inputs gathered into linears that only linears read: each norm's output (Q, K and V's,
    # gate and up's, the head's)
    gathered = {
        n.args[0]
        for n in _linears(model, inputs)
        if spec_from_str(sp[n.name].inputs[0]) == (R,) and regathers(n, 0, n.args[0])
    }
    monkeypatch.setattr("autopar.passes.collective_matmul.regathers", _no_regather)
    kept = autopar.reprice(model, cpu, inputs, _bf16(sp, True)).predicted.peak_memory_bytes
    assert len(gathered) == 5
    want = sum(x.meta["val"].numel() * 2 / 2 for x in gathered)  # bf16, the half the other rank holds
    assert kept - regather == want
    # measured, what autograd saves on each rank: that alone. Both paths read the same bf16 copies
    # of the weights (``codegen/local_params.py``: cast once a forward, whatever op reads them),
    # priced as parameter memory; before those, autocast's own casts for the linears after the first
    # of each group (K, V, up) were kept by one path and not the other
    for rank, results in enumerate(per_rank):
        assert results["kept"][3] - results["fused"][3] == want, (
            rank,
            results["kept"][3],
            results["fused"][3],
        )


def test_gathers_into_linears_are_priced_in_the_half_type(monkeypatch):
    """The plan under bf16 mixed precision (where the norms stay fp32) priced as it runs, and as
    it ran before (every reshard in the tensor's own dtype): each all-gather into a linear moves
    half the bytes, forward and its backward reduce-scatter; every other collective as many; the
    step is priced faster."""
    import autopar.passes.precision as trades_pricing

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
