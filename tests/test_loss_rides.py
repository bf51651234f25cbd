"""With ``loss_rides``, the loss a data-parallel module returns rides in backward's first gradient
bucket (``codegen/grad_sync.py``, "The loss rides"): a training step runs as many gloo collectives as it
has buckets (``GradSync.reductions``), none for the loss, as ``DistributedDataParallel`` runs none
for it. Against the single-device model, on 2 gloo ranks, the MLP (a mean loss) and GPT-2 (a
token-mean cross-entropy whose count each rank, fed the whole batch, counts itself): the loss read
after backward; read before backward on every rank (summed on its own); under ``torch.no_grad``
(no backward: the forward starts it); never read, with the next forward after it; the sync off
(``accumulating``: no bucket runs, so the forward starts it); and, with ``check_calls``, a read
before backward on one rank only raises ``CollectiveCallError`` on both, rather than hang."""

from __future__ import annotations

import pytest
import torch
from harness import free_link_cpu
from test_deferred_loss import _gpt2, _loss, _mlp  # the same models and loss read as the deferral's tests

import autopar
from autopar.launch import run_on_ranks

D = autopar.AxisRole.DATA
BUILDS = {"mlp": _mlp, "gpt2": _gpt2}


def _gloo_all_reduces(fn) -> tuple[int, object]:
    """How many gloo all-reduces ``fn()`` ran (``torch.profiler``'s events), and its result."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return sum(1 for e in prof.events() if e.name == "gloo:all_reduce"), out


def _rank(rank, world, plan_path, name):
    model, inputs = BUILDS[name]()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plan_path)
    pmodel.loss_rides = True
    sync = pmodel.grad_sync
    res = {}

    def after():  # forward, backward, then the loss read
        loss = _loss(pmodel, inputs)
        res["pending_after_forward"] = loss.pending
        before = sync.reductions
        loss.backward()
        return sync.reductions - before, loss.item()

    res["after"] = _gloo_all_reduces(after)
    res["grads"] = {k: v.clone() for k, v in pmodel.full_grads().items()}
    pmodel.zero_grad(set_to_none=True)

    def before():  # read before backward on every rank: summed on its own
        loss = _loss(pmodel, inputs)
        value = loss.item()
        loss.backward()
        return value

    res["before"] = _gloo_all_reduces(before)
    res["grads_before"] = {k: v.clone() for k, v in pmodel.full_grads().items()}
    pmodel.zero_grad(set_to_none=True)
    with torch.no_grad():
        evaluated = _loss(pmodel, inputs)
        res["no_grad"] = (evaluated.pending, evaluated.item())
    unread = _loss(pmodel, inputs)  # never backward, never read: the next forward sums it
    res["unread"] = (unread.pending, float(_loss(pmodel, inputs).detach()), unread.pending, unread.item())
    with sync.accumulating():
        accumulated = _loss(pmodel, inputs)
        res["accumulating"] = accumulated.pending
        accumulated.backward()
        res["accumulated"] = accumulated.item()
    pmodel.zero_grad(set_to_none=True)
    return res


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_the_loss_rides_in_the_first_bucket(tmp_path, name):
    model, inputs = BUILDS[name]()
    res = autopar.search(model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,), zero_stage=0)
    path = tmp_path / "dp.json"
    res.plan.save(path)
    want = _loss(model, inputs)
    want.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    # no collective for GPT-2's token count either: every rank is fed the whole batch, so it counts
    # the whole batch's labels itself (ParallelModule._known_count; fed slices, it is all-reduced
    # from the top of the forward: tests/test_step_collectives.py)
    count = 0
    for got in run_on_ranks(_rank, 2, str(path), name):
        assert got["pending_after_forward"] is True
        (gloo, (buckets, loss)) = got["after"]
        assert buckets >= 1
        assert gloo == buckets + count, f"{gloo} gloo all-reduces for {buckets} buckets and {count} count"
        assert loss == pytest.approx(want.item(), rel=1e-5)
        gloo_before, value = got["before"]
        assert gloo_before == buckets + count + 1  # the loss's own, at the read
        assert value == pytest.approx(want.item(), rel=1e-5)
        for key in ("grads", "grads_before"):
            assert set(got[key]) == set(grads)
            for n, g in got[key].items():
                scale = g.abs().max().item()
                torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6 * max(scale, 1.0))
        pending, value = got["no_grad"]
        assert pending is False and value == pytest.approx(want.item(), rel=1e-5)
        was, second, now, value = got["unread"]
        assert (was, now) == (True, False)
        assert second == pytest.approx(want.item(), rel=1e-5)
        assert value == pytest.approx(want.item(), rel=1e-5)
        assert got["accumulating"] is False
        assert got["accumulated"] == pytest.approx(want.item(), rel=1e-5)


def _lone_reader(rank, world, plan_path):
    model, inputs = _mlp()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plan_path)
    pmodel.loss_rides = True
    pmodel.check_calls = True
    pmodel.entry_timeout_s = 20.0
    loss = _loss(pmodel, inputs)
    store = torch.distributed.distributed_c10d._get_default_store()
    outcome = None
    try:
        if rank == 0:
            loss.item()  # rank 0 alone reads before backward
        loss.backward()
    except autopar.errors.AutoparError as e:
        outcome = type(e).__name__
    # rank 0's process serves the store: it stays until rank 1 has read the failure from it (else
    # rank 1, late, finds only that rank 0's process exited: "Connection reset by peer")
    store.set(f"test/rank {rank} done", "1")
    if rank == 0:
        store.wait(["test/rank 1 done"])
    return outcome


@pytest.mark.slow
def test_a_lone_read_before_backward_raises_with_check_calls(tmp_path):
    model, inputs = _mlp()
    res = autopar.search(model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,), zero_stage=0)
    path = tmp_path / "dp.json"
    res.plan.save(path)
    got = run_on_ranks(_lone_reader, 2, str(path))
    assert got[0] == "CollectiveCallError"
    assert got[1] in ("CollectiveCallError", "PeerFailedError")
