"""A token-mean loss fed slices divides the reduced gradients by the whole batch's label count.

Each data-parallel rank fed only its slice of the batch holds its own labels' count; the loss is
the whole batch's sum over the whole batch's count. Rather than all-reduce that count at the top of
the forward (backward needing 1/count from its first step), backward runs on the loss's sum, the
count is summed with the loss's sum (one all-reduce of ``[sum, count]``), and the bucket-reduced
gradients are divided by it where backward ends (``GradSync.divide_after``), before clipping and
the optimizer: Megatron-LM's ``calculate_per_token_loss``. One collective less a step.

And the backwards that cannot leave the division to the end (``GradSync.divide_after``): a loss
read before backward on one rank alone (its pair's sum started in forward: no collective of its
own), two losses of different counts in one backward (the second's gradient scaled to the first's
count), gradients accumulated unreduced and then reduced once (each loss's backward divides by its
own count), a backward through the returned logits too (the loss's backward divides; the logits'
gradient is not divided); each against one device, and each able to fail (a second loss weighed
1, or the accumulated sums divided again, is off on every element).

GPT-2 on 2 gloo ranks (data parallel, ZeRO 0 and 1), each row of the batch with a different number
of ignored labels, so that the two ranks' slices count different numbers; 2 steps of SGD and of
Adam with the gradient norm clipped (the clip biting): the losses, the gradients (as reduced, and
clipped), the norms and the weights equal the single device's. The collectives of a step's forward and backward are the
buckets' and the loss's one: no all-reduce of the count alone; with the loss riding in the first
bucket (``loss_rides``), the buckets' alone, as ``DistributedDataParallel``'s.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import D, assert_adam_state_close, free_link_cpu, labelled

import autopar
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.trades import Trades, ZeroStage

BATCH, SEQ, STEPS = 4, 8, 2
LR = {"sgd": 0.5, "adam": 1e-3}
CLIP = 0.05  # well under the gradients' norm (checked): the clip scales every gradient


def _build():
    model, inputs = gpt2_tiny(batch=BATCH, seq=SEQ, hidden=32, vocab=64)
    labels = inputs["labels"].clone()
    for r in range(BATCH):  # rank 0 (rows 0, 2) counts 6 + 2 labels, rank 1 (rows 1, 3) 4 + 0
        labels[r, : 2 * r + 2] = -100
    return model, {"input_ids": inputs["input_ids"], "labels": labels}


OPT = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def _reference(name):
    model, inputs = _build()
    opt = OPT[name](model.parameters(), lr=LR[name])
    losses, grads, norms = [], [], []
    for _ in range(STEPS):
        loss = model(**inputs).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(rank, world, jobs):
    out = {}
    for key, path in jobs:
        model, inputs = _build()
        pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=path)
        pmodel.loss_rides = key[2]
        d, r = pmodel.data_world, pmodel.data_rank
        batch = {n: t[r::d] for n, t in inputs.items()}
        opt = pmodel.optimizer(OPT[key[1]], lr=LR[key[1]])
        losses, grads, norms, events = [], [], [], []
        for _ in range(STEPS):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss = _loss(pmodel(**batch))
                loss.backward()
            events.append([e.name for e in prof.events() if e.name.startswith("gloo:")])
            # as reduced (clipping hides a gradient's scale); copies: a whole one may be .grad itself
            grads.append({n: g.clone() for n, g in pmodel.full_grads().items()})
            norms.append(float(pmodel.clip_grad_norm_(CLIP)))
            losses.append(loss.item())
            grads.append(pmodel.full_grads())  # clipped
            opt.step()
            opt.zero_grad()
        sync = pmodel.grad_sync
        buckets = (
            (sync.num_buckets, sum(1 for b in sync._buckets if b.scatter), sync.divisions)
            if sync is not None
            else None
        )
        out[key] = (losses, grads, norms, events, buckets, pmodel.full_state_dict())
    return out


@pytest.mark.slow
def test_count_summed_with_the_loss_divides_reduced_gradients(tmp_path):
    model, inputs = _build()
    cluster = free_link_cpu(2)
    jobs = []
    base = autopar.plan(  # the forward returns the loss alone: backward reaches the buckets through it alone
        model, cluster, inputs, mesh_shape=(2,), axis_roles=(D,), zero_stage=0, outputs=autopar.Outputs.LOSS
    )
    for zero in (0, 1):
        # ZeRO-1 as test_zero_one_scatter.py forces it: its buckets reduce-scattered into shares
        trades = Trades(zero_stage=ZeroStage.OPTIMIZER, data_axes=(0,)) if zero else base.trades
        plan = dataclasses.replace(base, trades=trades)
        path = tmp_path / f"zero{zero}.json"
        plan.save(path)
        jobs += [((zero, name, False), str(path)) for name in LR]
        if (
            zero == 0
        ):  # the loss's [sum, count] rides in the first bucket (loss_rides): no collective of its own
            jobs.append(((zero, "sgd", True), str(path)))
    refs = {name: _reference(name) for name in LR}
    for name, (_, _, norms, _) in refs.items():
        assert min(norms) > 2 * CLIP, (name, norms)  # the clip bites
    for rank, res in enumerate(run_on_ranks(_rank, 2, jobs, timeout_s=600)):
        for key, (losses, grads, norms, events, buckets, state) in res.items():
            zero, name, rides = key
            ref_losses, ref_grads, ref_norms, ref_state = refs[name]
            label = f"rank {rank}, ZeRO-{zero}, {name}{', the loss riding' if rides else ''}"
            assert losses == pytest.approx(ref_losses, rel=1e-5), label
            assert norms == pytest.approx(ref_norms, rel=1e-4), label
            for step, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
                for n, g in got.items():
                    _close(g, want[n], 1e-4, f"{label}, step {step}, grad {n}")
            for n, w in ref_state.items():
                if name == "adam":
                    assert_adam_state_close(state[n], w, LR[name], STEPS, f"{label}: {n}")
                else:
                    _close(state[n], w, 1e-5, f"{label}: {n}")
            # the buckets' reductions and the loss's [sum, count]: no collective for the count alone
            assert buckets is not None, label
            buckets, scattered, divisions = buckets
            assert (scattered > 0) == (zero == 1), (label, buckets, scattered)
            assert divisions == STEPS, (label, divisions)  # every backward divided after reducing
            # (the first step's forward also compares the ranks' batches: the second's alone; gloo
            # runs a reduce-scatter as an all-reduce, so the events cannot tell them apart)
            assert len(events[-1]) == buckets + (0 if rides else 1), (label, buckets, events[-1])


def _close(got: torch.Tensor, want: torch.Tensor, share: float, msg: str) -> None:
    """``got`` equals ``want`` within rtol 1e-4 and ``share`` of ``want``'s largest magnitude."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=share * float(want.abs().max()), msg=labelled(msg))


def _second_batch(inputs):
    """Another batch: the rows rolled, so each rank's slice counts another number of labels, and the
    row that had every label ignored now counts all of them (the whole batch counts 19, not 12)."""
    out = {n: t.roll(1, dims=0) for n, t in inputs.items()}
    out["labels"][0] = out["input_ids"][0]
    return out


def _two_rank(rank, world, path, logits_path):
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=path)
    d, r = pmodel.data_world, pmodel.data_rank
    first = {n: t[r::d] for n, t in inputs.items()}
    second = {n: t[r::d] for n, t in _second_batch(inputs).items()}
    out = {}
    # a read before backward on one rank alone: the pair's sum was started in forward, no new collective
    loss = _loss(pmodel(**first))
    out["read"] = loss.item() if rank == 0 else None
    loss.backward()
    out["one"] = {n: g.clone() for n, g in pmodel.full_grads().items()}
    pmodel.zero_grad(set_to_none=True)
    # two losses in one backward: the second's gradient scaled to the first's count
    (_loss(pmodel(**first)) + _loss(pmodel(**second))).backward()
    out["summed"] = {n: g.clone() for n, g in pmodel.full_grads().items()}
    pmodel.zero_grad(set_to_none=True)
    # accumulated unreduced, then reduced once: each loss's backward divides by its own count
    with pmodel.grad_sync.accumulating():
        _loss(pmodel(**first)).backward()
    _loss(pmodel(**second)).backward()
    out["accumulated"] = {n: g.clone() for n, g in pmodel.full_grads().items()}
    out["divisions"] = pmodel.grad_sync.divisions
    # the logits returned too (requiring gradient): backward through both divides in the loss's
    # backward, and the next forwards all-reduce the count at their top again
    model, inputs = _build()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=logits_path)
    both = []
    for _ in range(2):
        o = pmodel(**first)
        (o.loss + 1e-3 * o.logits.sum()).backward()
        both.append({n: g.clone() for n, g in pmodel.full_grads().items()})
        pmodel.zero_grad(set_to_none=True)
    out["both"] = both
    out["both_divisions"] = pmodel.grad_sync.divisions
    return out


@pytest.mark.slow
def test_backwards_the_division_cannot_wait_for(tmp_path):
    model, inputs = _build()
    plan = autopar.plan(
        model,
        free_link_cpu(2),
        inputs,
        mesh_shape=(2,),
        axis_roles=(D,),
        zero_stage=0,
        outputs=autopar.Outputs.LOSS,
    )
    path = tmp_path / "zero0.json"
    plan.save(path)
    logits_path = tmp_path / "logits.json"
    autopar.plan(model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,), zero_stage=0).save(
        logits_path
    )
    ref_model, _ = _build()
    first = ref_model(**inputs).loss
    first.backward()
    one = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    (ref_model(**_second_batch(inputs)).loss).backward()  # accumulated onto the first's
    two = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    ref_model.zero_grad(set_to_none=True)
    o = ref_model(**inputs)
    (o.loss + 1e-3 * o.logits.sum()).backward()
    both = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    per_rank = run_on_ranks(_two_rank, 2, str(path), str(logits_path), timeout_s=300)
    assert per_rank[0]["read"] == pytest.approx(first.item(), rel=1e-5)
    for rank, res in enumerate(per_rank):
        for case, want in (("one", one), ("summed", two), ("accumulated", two)):
            for n, g in res[case].items():
                _close(g, want[n], 1e-5, f"rank {rank}, {case}: {n}")
        # the first two backwards divided after reducing; the accumulated one in the losses' backwards
        assert res["divisions"] == 2, (rank, res["divisions"])
        for step, got in enumerate(res["both"]):
            for n, g in got.items():
                _close(g, both[n], 1e-5, f"rank {rank}, logits {step}: {n}")
        assert res["both_divisions"] == 0, (rank, res["both_divisions"])
