"""Outputs.LOCAL: the module returns each output as this rank's piece, never gathered.

Compared with the single-device model: the loss, and each output rebuilt from the pieces
(``ParallelModule.full_output``). The plan prices what it saves: no gathered logits to keep."""

from __future__ import annotations

import pytest
import torch
from harness import free_link_cpu

import autopar
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.placement import Outputs, is_replicated

D = autopar.AxisRole.DATA


def _build():
    return gpt2_tiny(batch=4, seq=16, hidden=32, vocab=256)


def _rank(rank, world, plan_path):
    model, inputs = _build()
    cluster = free_link_cpu(world)
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan_path)
    out = pmodel(**inputs)
    out.loss.backward()
    leaves = [out.loss, out.logits]
    specs = pmodel.output_specs
    idx = [i for i, s in enumerate(specs) if s is not None]
    full = [pmodel.full_output(t.detach(), i) for t, i in zip(leaves, idx)]
    return {
        "loss": out.loss.item(),
        "logits_shape": tuple(out.logits.shape),
        "full": full,
        "specs": [s for s in specs if s is not None],
    }


@pytest.mark.slow
def test_local_outputs_are_pieces_of_the_single_device_outputs(tmp_path):
    model, inputs = _build()
    ref = model(**inputs)
    cluster = free_link_cpu(2)  # a free link: the batch splits (on gloo's 1 ms it would not pay)
    kw = dict(mesh_shape=(2,), axis_roles=(D,), optimizer=autopar.Optimizer.SGD)
    local = autopar.plan(model, cluster, inputs, outputs=Outputs.LOCAL, **kw)
    full = autopar.plan(model, cluster, inputs, **kw)
    assert local.outputs == "local" and full.outputs == "full"
    # batch-split logits are kept as a half on each rank instead of gathered whole
    assert local.predicted.peak_memory_bytes < full.predicted.peak_memory_bytes
    path = tmp_path / "local.json"
    local.save(path)
    for res in run_on_ranks(_rank, 2, str(path)):
        assert res["loss"] == pytest.approx(ref.loss.item(), rel=1e-5)
        assert not is_replicated(res["specs"][1])  # the logits stayed a piece
        assert res["logits_shape"] == (2, 16, 256)
        torch.testing.assert_close(res["full"][1], ref.logits.detach(), rtol=1e-4, atol=1e-5)
