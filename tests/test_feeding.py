"""Feeding data: each data-parallel rank may be given only its slice of the batch.

``pmodel.data_rank`` and ``pmodel.data_world`` say which slice a rank takes (``DistributedSampler``
style: ``num_replicas=data_world, rank=data_rank``); ranks with the same ``data_rank`` (they differ
on model-parallel axes) take the same slice. The global batch is then the slices in ``data_rank``
order. On 4 gloo ranks (2 x 2 data x tensor), each rank fed rows ``data_rank::data_world`` trains as
the single-device model does on the whole batch (a token-mean loss: the rows' order does not
matter), with and without micro-batches; feeding the whole batch on every rank still works; slices
that differ between ranks of one ``data_rank`` raise ``CrossRankMismatchError``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import D, T, adam_reference, assert_adam_state_close, free_link_cpu

import autopar
from autopar.examples import llama_tiny
from autopar.launch import run_on_ranks
from autopar.trades import Trades

LR = 1e-3  # Adam normalizes each gradient: a larger rate magnifies rounding in near-zero ones
STEPS = 2


def _build():
    return llama_tiny(batch=8, seq=16, hidden=32, vocab=128)


def _slice(inputs, rank, world):
    return {k: v[rank::world] for k, v in inputs.items()}


def _rank(rank, world, plans):
    out = {}
    for name, path in plans.items():
        model, inputs = _build()
        pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=path)
        batch = inputs if name == "whole" else _slice(inputs, pmodel.data_rank, pmodel.data_world)
        opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
        losses = []
        for _ in range(STEPS):
            losses.append(pmodel.step(**batch).item())
            opt.step()
            opt.zero_grad()
        out[name] = (pmodel.data_rank, pmodel.data_world, losses, pmodel.full_state_dict())
    # a slice that differs between the two ranks of one data_rank
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plans["sliced"])
    wrong = _slice(inputs, rank % 2, 2)  # rank, not data_rank: the tensor-parallel peers disagree
    try:
        pmodel(**wrong)
        out["mismatch"] = None
    except autopar.CrossRankMismatchError as e:
        out["mismatch"] = str(e)
    return out


def _reference():
    return adam_reference(*_build(), STEPS, LR)


@pytest.mark.slow
def test_ranks_fed_their_own_slices_train_as_the_whole_batch(tmp_path):
    model, inputs = _build()
    base = autopar.plan(model, free_link_cpu(4), inputs, mesh_shape=(2, 2), axis_roles=(D, T))
    plans = {}
    for name, plan in {
        "sliced": base,
        "whole": base,
        "sliced, 2 micro-batches": dataclasses.replace(base, trades=Trades(micro_batches=2)),
    }.items():
        path = tmp_path / f"{len(plans)}.json"
        plan.save(path)
        plans[name] = str(path)
    ref_losses, ref_state = _reference()
    for rank, res in enumerate(run_on_ranks(_rank, 4, plans, timeout_s=600)):
        for name in plans:
            data_rank, data_world, losses, state = res[name]
            assert (data_rank, data_world) == (rank // 2, 2), f"rank {rank}: data coordinates"
            assert losses == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}: {name}"
            for k, v in ref_state.items():
                assert_adam_state_close(state[k], v, LR, STEPS, f"rank {rank}: {name}: {k}")
        assert res["mismatch"] is not None and "data_rank" in res["mismatch"], res["mismatch"]
