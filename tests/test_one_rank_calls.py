"""Collective methods called on one rank only (``codegen/agree.py:all_entered``,
``codegen/failures.py``).

On 2 gloo ranks, a tensor-parallel module (weights sharded, outputs returned as pieces): its
``full_state_dict`` and ``full_output`` called on every rank equal the single-device model's state
and output. Called on rank 0 alone (the "save on rank 0" habit: ``if rank == 0:
torch.save(pmodel.full_state_dict(), ...)``) while rank 1 goes on training (``forward`` and
``backward``, or ``step``), it raises ``CollectiveCallError`` on rank 0, naming the call and the
fix, where gloo alone would abort ("Received data size doesn't match expected size") or hang, and
rank 1 raises ``PeerFailedError`` naming rank 0 and its call, instead of waiting forever in its
forward's collective; after that, each rank's next call raises again instead of blocking. A rank
that hangs fails the test through ``run_on_ranks``' timeout.
"""

from __future__ import annotations

import datetime

import pytest
import torch
from harness import T, free_link_cpu, labelled

import autopar
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.placement import Outputs, is_replicated

# how long a rank waits for the other in a call both make (the default, 60 s, is for real jobs): a
# busy 2-core machine may hold one rank back for seconds; rank 0 waits ALONE_S in the call it makes
# alone (rank 1 never comes: it trains on)
ENTRY_TIMEOUT_S, ALONE_S = 120.0, 2.0
# unchecked calls: how long rank 0 stays for rank 1, blocked until rank 0's process exits (the
# store's default wait, 300 s, made the test last that long)
UNCHECKED_EXIT_S = 10.0


def _build():
    return gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)  # seeded: the same weights each time


def _outcome(fn):
    """``fn()``: ("ok", "") or (the error's type name, its message) for autopar's collective errors."""
    try:
        fn()
        return ("ok", "")
    except autopar.CollectiveCallError as e:  # PeerFailedError is one
        return (type(e).__name__, str(e))


def _rank(rank, world, plan_path, case, check_calls=True):
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plan_path)
    pmodel.entry_timeout_s = ENTRY_TIMEOUT_S
    pmodel.check_calls = check_calls
    store = torch.distributed.distributed_c10d._get_default_store()
    out = {"state": pmodel.full_state_dict()}
    result = pmodel(**inputs)
    logits = result.logits.detach()  # the second output: (loss, logits, ...)
    index = [i for i, s in enumerate(pmodel.output_specs) if s is not None][1]
    out["logits spec"] = pmodel.output_specs[index]
    out["output"] = pmodel.full_output(logits, index)
    # rank 0 alone makes a collective call; rank 1 trains on
    if rank == 0:
        pmodel.entry_timeout_s = ALONE_S
        if case == "full_state_dict, step":
            out["alone"] = _outcome(pmodel.full_state_dict)
        else:
            out["alone"] = _outcome(lambda: pmodel.full_output(logits, index))
        store.set("test/rank 0 raised", "1")
    elif case == "full_state_dict, step":
        out["alone"] = _outcome(lambda: pmodel.step(**inputs))
    elif case == "full_output, backward":
        out["alone"] = _outcome(lambda: result.loss.backward())
    else:  # rank 1 comes to its next call after rank 0 gave up on its own
        store.wait(["test/rank 0 raised"])
        out["alone"] = _outcome(lambda: pmodel(**inputs))
    out["next"] = _outcome(lambda: pmodel(**inputs))  # raises again, without blocking
    # rank 0's process serves the store: it stays until rank 1 has read the failure from it (else
    # rank 1, late, finds only that rank 0's process exited, which says less)
    try:
        store.set(f"test/rank {rank} done", "1")
    except torch.distributed.DistNetworkError:  # unchecked calls: rank 0's process, the store's, has exited
        if check_calls:
            raise
    if rank == 0:
        if check_calls:
            store.wait(["test/rank 1 done"])
        else:  # rank 1 is blocked in an unchecked collective that only rank 0's exit breaks
            try:
                store.wait(["test/rank 1 done"], datetime.timedelta(seconds=UNCHECKED_EXIT_S))
            except (RuntimeError, TimeoutError):
                pass
    return out


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory):
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
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["full_state_dict, step", "full_output, backward", "full_output, late forward"]
)
def test_a_call_on_rank_0_only_raises_on_every_rank(plan_path, case):
    results = run_on_ranks(_rank, 2, plan_path, case, timeout_s=300)  # a rank that hangs fails here
    model, inputs = _build()
    ref = model.state_dict()
    for rank, res in enumerate(results):  # called on every rank, they gather the whole
        assert set(res["state"]) == set(ref), rank
        for name, v in ref.items():
            torch.testing.assert_close(res["state"][name], v, msg=labelled(f"rank {rank}: {name}"))
        torch.testing.assert_close(res["output"], model(**inputs).logits.detach(), rtol=1e-4, atol=1e-5)
    call, other = case.split(", ")
    # rank 0 raises, naming the call, rank 1 and the fix
    kind, msg = results[0]["alone"]
    assert kind == "CollectiveCallError", msg
    assert f"{call} is a collective" in msg and "rank(s) [1]" in msg and "call it on every rank" in msg, msg
    if call == "full_state_dict":
        assert "rank0_only=True" in msg, msg
    else:  # the logits are pieces: without the check, the gather would be gloo's to fail
        assert not is_replicated(results[0]["logits spec"])
    kind, msg = results[1]["alone"]
    if other != "late forward":
        # rank 1 made another call at that point: both raise at once, naming both calls
        assert f"{call} on rank(s) [0]" in results[0]["alone"][1] and f"{other} on rank(s) [1]" in msg, msg
        assert kind == "CollectiveCallError" and f"{other} is a collective" in msg, msg
    else:
        # rank 1 came after rank 0 gave up: its forward raises, naming rank 0 and its call, rather than block
        assert "did not call it within" in results[0]["alone"][1]
        assert (
            kind == "PeerFailedError" and "forward stopped on rank 1" in msg and f"rank 0: {call}" in msg
        ), msg
    # the job is over: each rank's next call raises the failure again, rather than block
    for rank in range(2):
        kind, msg = results[rank]["next"]
        assert kind == "PeerFailedError" and call in msg, (rank, msg)


@pytest.mark.slow
def test_without_checked_calls_the_peer_raises_when_the_failed_rank_exits(plan_path):
    """``check_calls`` off (the default): rank 1's step enters its collectives unchecked and
    blocks there; rank 0's lone ``full_state_dict`` times out, aborts its groups and returns, and
    its process's exit breaks rank 1's collective, which raises ``PeerFailedError`` instead of
    hanging (a hang fails through ``run_on_ranks``' timeout)."""
    results = run_on_ranks(_rank, 2, plan_path, "full_state_dict, step", False, timeout_s=300)
    kind, msg = results[0]["alone"]
    assert kind == "CollectiveCallError" and "full_state_dict is a collective" in msg, msg
    kind, msg = results[1]["alone"]
    assert kind == "PeerFailedError" and "step stopped on rank 1" in msg, msg
    for rank in range(2):
        assert results[rank]["next"][0] == "PeerFailedError", (rank, results[rank]["next"])
