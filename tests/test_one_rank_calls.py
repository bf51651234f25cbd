"""Collective methods called on one rank only (``codegen/agree.py:all_entered``).

On 2 gloo ranks, a tensor-parallel module (weights sharded, outputs returned as pieces): its
``full_state_dict`` called on every rank equals the single-device model's state; called on rank 0
alone (the "save on rank 0" habit: ``if rank == 0: torch.save(pmodel.full_state_dict(), ...)``),
it raises ``CollectiveCallError`` on rank 0, naming the call and the fix, where gloo alone would
abort ("Received data size doesn't match expected size") or hang, and rank 1 goes on untouched;
``full_output`` likewise. After those failures, calls on every rank work again: rank 1, which never
came to the calls rank 0 gave up on, skips them and joins rank 0's next.
"""

from __future__ import annotations

import pytest
import torch
from harness import T, free_link_cpu, labelled

import autopar
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.placement import Outputs, is_replicated

# how long a rank waits for the other in a call both make (the default, 60 s, is for real jobs): a
# busy 2-core machine may hold one rank back for seconds, and a wait that ran out there would make
# rank 0 raise in a call rank 1 then joins late, out of step; rank 0 waits ALONE_S in the calls it
# makes alone (rank 1 never comes: the forward's collectives keep it from reaching a later call first)
ENTRY_TIMEOUT_S, ALONE_S = 120.0, 2.0


def _build():
    return gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)  # seeded: the same weights each time


def _alone(pmodel, fn):
    """``fn()`` called on rank 0 alone, waiting ``ALONE_S`` for rank 1: ("ok", "") or ("error", msg)."""
    pmodel.entry_timeout_s = ALONE_S
    try:
        fn()
        return ("ok", "")
    except autopar.CollectiveCallError as e:
        return ("error", str(e))
    finally:
        pmodel.entry_timeout_s = ENTRY_TIMEOUT_S


def _rank(rank, world, plan_path):
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plan_path)
    pmodel.entry_timeout_s = ENTRY_TIMEOUT_S
    out = {"state": pmodel.full_state_dict()}
    out["state, rank 0 only"] = _alone(pmodel, pmodel.full_state_dict) if rank == 0 else None
    logits = pmodel(**inputs).logits.detach()  # the second output: (loss, logits, ...)
    index = [i for i, s in enumerate(pmodel.output_specs) if s is not None][1]
    out["logits spec"] = pmodel.output_specs[index]
    gather = lambda: pmodel.full_output(logits, index)  # noqa: E731
    out["output, rank 0 only"] = _alone(pmodel, gather) if rank == 0 else None
    out["state again"] = pmodel.full_state_dict()
    out["output"] = pmodel.full_output(logits, index)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model, inputs = _build()
    plan = autopar.plan(
        model,
        free_link_cpu(2),
        inputs,
        mesh_shape=(2,),
        axis_roles=(T,),
        outputs=Outputs.LOCAL,
        optimizer=autopar.Optimizer.SGD,
    )
    path = tmp_path_factory.mktemp("one_rank") / "tp.json"
    plan.save(path)
    return run_on_ranks(_rank, 2, str(path), timeout_s=300)


@pytest.mark.slow
def test_full_state_dict_on_every_rank_is_the_single_device_state(results):
    model, inputs = _build()
    ref = model.state_dict()
    for rank, res in enumerate(results):
        for key in ("state", "state again"):  # before the one-rank calls, and after them
            assert set(res[key]) == set(ref), (rank, key)
            for name, v in ref.items():
                torch.testing.assert_close(res[key][name], v, msg=labelled(f"rank {rank}: {key}: {name}"))
        torch.testing.assert_close(res["output"], model(**inputs).logits.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "key, call", [("state, rank 0 only", "full_state_dict"), ("output, rank 0 only", "full_output")]
)
def test_a_call_on_rank_0_only_raises_there_and_leaves_rank_1_alone(results, key, call):
    kind, msg = results[0][key]
    assert kind == "error", msg
    assert call in msg and "rank(s) [1]" in msg and "call it on every rank" in msg, msg
    if call == "full_state_dict":
        assert "rank0_only=True" in msg, msg
    else:  # the logits are pieces: without the check, the gather would be gloo's to fail
        assert not is_replicated(results[0]["logits spec"])
    assert results[1][key] is None  # rank 1 never called it, and finished (results came back)
