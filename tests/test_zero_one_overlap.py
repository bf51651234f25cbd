"""ZeRO-1's parameter all-gathers behind the next forward (``codegen/zero_one.py``), on gloo.

The parent plans GPT-2 (tiny) on a (2,) data mesh (world 2) and a (2, 2) data x tensor mesh (world
4) with ZeRO-1 forced. Each rank builds the module twice: one trained with ``pmodel.optimizer``
(the gathers started by ``step`` and waited for by the forward's reads), one with
``ZeroOneOptimizer(..., overlap=False)`` (waited for inside ``step``). The buckets are made small
(``BUCKET_BYTES`` 4 KiB) so that there are many and only ``IN_FLIGHT`` of them run at once.

Checked, after each of three Adam steps: right after ``step`` the overlapped optimizer has
gathers in flight, and ``state_dict()`` read then equals the non-overlapped module's (it waits);
``zero_grad`` between ``step`` and the forward leaves them in flight; the forward completes every
one; an eval forward (``no_grad``) right after a step gives the non-overlapped module's logits;
the two modules' losses and full states are equal (the same collectives on the same values), and
equal the single-device model's (losses rtol 1e-4, state ``harness.assert_adam_state_close``, as
the other ZeRO-1 tests hold them). The buckets follow the generated forward's read order.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import D, T, adam_reference, assert_adam_state_close

import autopar
from autopar.codegen import zero_one
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.trades import Trades, ZeroStage

LR = 1e-3
STEPS = 3
MESHES = {2: ((2,), (D,)), 4: ((2, 2), (D, T))}


def _build():
    return gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)


def _local_state(pmodel) -> dict[str, torch.Tensor]:
    """``state_dict()`` as this rank holds it: each tensor's local piece, copied."""
    return {k: (v._local_tensor if hasattr(v, "_local_tensor") else v).detach().clone() for k, v in
            pmodel.state_dict().items()}  # fmt: skip


def _rank(rank, world, path):
    zero_one.BUCKET_BYTES = 4096  # many buckets on a tiny model
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    model, inputs = _build()
    ovl = autopar.autoparallelize(model, cluster, inputs, plan=path)
    model, _ = _build()
    ref = autopar.autoparallelize(model, cluster, inputs, plan=path)
    opt = ovl.optimizer(torch.optim.Adam, lr=LR)
    ref_opt = zero_one.ZeroOneOptimizer(
        ref.parameters(), torch.optim.Adam, ref.mesh, ref.zero.data_axes[0], overlap=False, lr=LR
    )
    read = {id(t): i for i, t in reversed(list(enumerate(ovl._read_order())))}
    firsts = [min(read[id(p)] for p, *_ in b) for b in opt._buckets]
    out = dict(buckets=len(opt._buckets), in_read_order=firsts == sorted(firsts), losses=[], ref_losses=[])
    out.update(
        after_step=[], after_zero_grad=[], after_forward=[], ref_in_flight=[], state_same=[], eval_same=[]
    )
    for _ in range(STEPS):
        loss = ovl(**inputs).loss
        out["after_forward"].append(opt.in_flight)
        loss.backward()
        ref_loss = ref(**inputs).loss
        ref_loss.backward()
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
        opt.step()
        ref_opt.step()
        out["after_step"].append(opt.in_flight)
        out["ref_in_flight"].append(ref_opt.in_flight)
        opt.zero_grad()
        ref_opt.zero_grad()
        out["after_zero_grad"].append(opt.in_flight)
        if len(out["after_step"]) == 1:  # the state read right after the step waits for the gathers
            got, want = _local_state(ovl), _local_state(ref)
            out["state_same"].append(all(torch.equal(got[k], want[k]) for k in want))
            opt.step()  # no gradients: no update, but its gathers start again
            out["after_step"][-1] = opt.in_flight
        else:  # an eval forward right after the step waits for them too
            with torch.no_grad():
                a, b = ovl(**inputs).logits, ref(**inputs).logits
            out["eval_same"].append(torch.equal(a, b))
    out["full"] = ovl.full_state_dict()
    out["ref_full"] = ref.full_state_dict()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero_one_gathers_behind_the_forward_match_inline_gathers_and_one_device(world, tmp_path):
    mesh, roles = MESHES[world]
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    model, inputs = _build()
    plan = autopar.plan(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
    path = tmp_path / f"zero1_{world}.json"
    dataclasses.replace(plan, trades=Trades(zero_stage=ZeroStage.OPTIMIZER, data_axes=(0,))).save(path)
    per_rank = run_on_ranks(_rank, world, str(path), timeout_s=300)
    ref_losses, ref_state = adam_reference(*_build(), steps=STEPS, lr=LR)
    for rank, r in enumerate(per_rank):
        where = f"world {world} rank {rank}"
        assert r["buckets"] > zero_one.IN_FLIGHT, where
        assert r["in_read_order"], f"{where}: buckets out of the forward's read order"
        assert r["after_step"] == [zero_one.IN_FLIGHT] * STEPS, f"{where}: gathers in flight after step"
        assert r["after_zero_grad"] == [zero_one.IN_FLIGHT] * STEPS, f"{where}: zero_grad waited"
        assert r["after_forward"] == [0] * STEPS, f"{where}: the forward left gathers in flight"
        assert r["ref_in_flight"] == [0] * STEPS, where
        assert r["state_same"] == [True], f"{where}: state_dict() right after step() is stale"
        assert r["eval_same"] == [True] * (STEPS - 1), f"{where}: eval forward after step() differs"
        assert r["losses"] == r["ref_losses"], f"{where}: losses differ from the inline gathers'"
        for k, v in r["ref_full"].items():
            assert torch.equal(r["full"][k], v), f"{where}: {k} differs from the inline gathers'"
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        for k, v in ref_state.items():
            assert_adam_state_close(r["full"][k], v, LR, STEPS, f"{where} {k}")
