"""Feeding data under any plan: a rank may be fed its slice of every input that carries the batch,
or the whole batch, whatever placements the plan gives the inputs.

A plan may split one input's batch over the data axis and keep another whole (or split it on
another axis or dim): the module then gathers the slices of that one over the data axis before
the generated graph runs. On 2 gloo ranks, plans edited so that one input is replicated, or split
on its sequence instead of its batch (the search picks such plans where it prices them cheaper,
e.g. under load: the README's train.py model on a busy machine), train as the single-device model
does, fed slices and fed the whole batch: the loss, the outputs and every gradient, with and
without micro-batches. Errors about the inputs name them as the call does ("labels", "target") and
say which shapes are accepted; ranks fed different ways all raise. On 4 ranks (a data axis inside
each of 2 pipeline stages, 2 micro-batches) the gathered labels are cut into the same micro-batches
as the sliced ids.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import D, assert_adam_state_close, free_link_cpu, labelled
from test_pipeline_dist import _stack  # a small model of 4 blocks: 2 pipeline stages

import autopar
from autopar.examples import llama_tiny, mlp
from autopar.launch import run_on_ranks
from autopar.trades import Trades

WORLD = 2


def _mlp():
    return mlp(batch=8, hidden=16, ffn=32)


def _llama():
    return llama_tiny(batch=8, seq=16, hidden=32, vocab=128)


BUILDS = {"mlp": _mlp, "llama": _llama}


def _whole(plan, name: str, output: str = "R"):
    """``plan`` with input ``name`` placed ``output`` (kept whole by default) instead of split on
    the batch (its users reshard it as they need)."""
    decisions = tuple(
        dataclasses.replace(d, output=output) if d.role == "input" and d.target == name else d
        for d in plan.decisions
    )
    return dataclasses.replace(plan, decisions=decisions)


def _loss(out):
    return out.loss if hasattr(out, "loss") else out[0]


def _run(pmodel, args, kwargs):
    """One training step's loss, the full gradients, and (the mlp) the output of a forward."""
    loss = pmodel.step(*args, loss_fn=_loss, **kwargs)
    grads = {k: v.clone() for k, v in pmodel.full_grads().items()}
    y = pmodel(*args, **kwargs)[1].detach() if args and pmodel.micro_batches == 1 else None
    return loss.item(), grads, y


def _rank(rank, world, plans):
    out = {}
    for (model_name, label), path in plans.items():
        for fed in ("slices", "whole"):
            model, inputs = BUILDS[model_name]()
            pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=path)
            n, r = pmodel.data_world, pmodel.data_rank
            if fed == "whole":
                args, kwargs = (inputs, {}) if model_name == "mlp" else ((), inputs)
            elif model_name == "mlp":  # contiguous slices: the outputs come back in the batch's order
                args, kwargs = tuple(t.chunk(n)[r] for t in inputs), {}
            else:  # rows data_rank::data_world, as DistributedSampler gives them
                args, kwargs = (), {k: v[r::n] for k, v in inputs.items()}
            out[model_name, label, fed] = (n, *_run(pmodel, args, kwargs))
    errors = {}
    model, (x, target) = _mlp()
    pmodel = autopar.autoparallelize(
        model, free_link_cpu(world), (x, target), plan=plans["mlp", "target whole"]
    )
    for case, args in {
        "rows": (x, target[:3]),
        "mix": (x, target[:4]),
        "columns": (x[:4], target[:4, :8]),
    }.items():
        try:
            pmodel(*args)
        except autopar.InputsError as e:
            errors[case] = str(e)
    try:  # rank 0 fed the whole batch, rank 1 its slice: both raise, neither waits in a gather
        pmodel(x, target) if rank == 0 else pmodel(x[4:], target[4:])
    except autopar.CrossRankMismatchError as e:
        errors["ways"] = str(e)
    model, (x, target) = _mlp()
    try:  # example inputs that differ in target alone
        autopar.autoparallelize(
            model, free_link_cpu(world), (x, target + rank), plan=plans["mlp", "target whole"]
        )
    except autopar.CrossRankMismatchError as e:
        errors["example"] = str(e)
    model, inputs = _llama()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plans["llama", "labels whole"])
    try:
        pmodel(input_ids=inputs["input_ids"][:4], labels=inputs["labels"][:4, :8])
    except autopar.InputsError as e:
        errors["llama"] = str(e)
    return out, errors


def _reference(model_name):
    model, inputs = BUILDS[model_name]()
    if model_name == "mlp":
        loss, y = model(*inputs)
    else:
        loss, y = model(**inputs).loss, None
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return loss.item(), grads, y


@pytest.mark.slow
def test_slices_and_the_whole_batch_train_as_one_device_whatever_the_plan_does_with_an_input(tmp_path):
    plans = {}
    for model_name, kept in (("mlp", "target"), ("mlp", "x"), ("llama", "labels")):
        model, inputs = BUILDS[model_name]()
        base = autopar.plan(model, free_link_cpu(WORLD), inputs, mesh_shape=(WORLD,), axis_roles=(D,))
        assert all(d.output == "S(0)" for d in base.decisions if d.role == "input"), "a data-parallel plan"
        edited = {f"{kept} whole": _whole(base, kept)}
        if model_name == "llama":  # split on another dim: gathered, then cut as the plan cuts it
            edited[f"{kept} split on the sequence"] = _whole(base, kept, "S(1)")
        if model_name == "mlp" and kept == "target":
            edited[f"{kept} whole, 2 micro-batches"] = dataclasses.replace(
                edited[f"{kept} whole"], trades=Trades(micro_batches=2)
            )
        for label, plan in edited.items():
            path = tmp_path / f"{len(plans)}.json"
            plan.save(path)
            plans[model_name, label] = str(path)
    refs = {name: _reference(name) for name in BUILDS}
    for rank, (out, errors) in enumerate(run_on_ranks(_rank, WORLD, plans, timeout_s=600)):
        for (model_name, label, fed), (data_world, loss, grads, y) in out.items():
            what = f"rank {rank}: {model_name}, {label}, fed {fed}"
            ref_loss, ref_grads, ref_y = refs[model_name]
            assert data_world == WORLD, what
            assert loss == pytest.approx(ref_loss, rel=1e-5), what
            assert grads.keys() == ref_grads.keys(), what
            for k, g in grads.items():
                torch.testing.assert_close(
                    g, ref_grads[k], rtol=1e-4, atol=1e-6, msg=labelled(f"{what}: {k}")
                )
            if y is not None:
                torch.testing.assert_close(y, ref_y.detach(), msg=labelled(f"{what}: output"))
        assert errors["rows"] == (
            "target has 3 rows; the plan takes (8, 16), the whole batch, or (4, 16), this rank's slice "
            "(pmodel.data_world = 2): plans are specialized to the example inputs' shapes, re-plan for another "
            "batch size"
        ), errors["rows"]
        assert errors["mix"].startswith("x holds the whole batch but target holds this rank's slice"), errors[
            "mix"
        ]
        assert errors["columns"].startswith(
            "target has shape (4, 8); the plan takes (8, 16), the whole batch, or (4, 16), this rank's slice"
        ), errors["columns"]
        assert errors["ways"].startswith("the ways ranks are fed differ between ranks"), errors["ways"]
        assert errors["example"].startswith("the example inputs differ between ranks"), errors["example"]
        assert "(first: ['target'])" in errors["example"], errors["example"]
        assert errors["llama"].startswith(
            "labels has shape (4, 8); the plan takes (8, 16), the whole batch, or (4, 16), this rank's slice"
        ), errors["llama"]


def _pipeline_rank(rank, world, path):
    out = {}
    for fed in ("slices", "whole"):
        model, inputs = _stack()
        pmodel = autopar.autoparallelize(
            model, autopar.ClusterSpec.preset("cpu", devices_per_node=world), inputs, plan=path
        )
        n, r = pmodel.data_world, pmodel.data_rank
        batch = {k: v[r::n] for k, v in inputs.items()} if fed == "slices" else inputs
        opt = pmodel.optimizer(torch.optim.Adam, lr=PIPE_LR)
        losses = []
        for _ in range(PIPE_STEPS):
            losses.append(pmodel.step(**batch).item())
            opt.step()
            opt.zero_grad()
        out[fed] = (n, pmodel.feeding.batch_axes, losses, pmodel.full_state_dict())
    return out


PIPE_LR, PIPE_STEPS = 1e-3, 2


@pytest.mark.slow
def test_a_pipeline_fed_slices_gathers_the_input_its_stages_keep_whole(tmp_path):
    """PP2 x DP2, 2 micro-batches, labels kept whole: each rank fed its slice gathers the labels so
    that micro-batch i of them holds the rows of every slice's micro-batch i, as the ids' do."""
    model, inputs = _stack()
    plan = autopar.plan(
        model, autopar.ClusterSpec.preset("cpu", devices_per_node=4), inputs, pipeline_stages=2,
        schedule=autopar.Schedule.ONE_F_ONE_B, micro_batches=2, mesh_shape=(2,), axis_roles=(D,),
    )  # fmt: skip
    path = tmp_path / "pp.json"
    _whole(plan, "labels").save(path)
    opt = torch.optim.Adam(model.parameters(), lr=PIPE_LR)
    ref_losses = []
    for _ in range(PIPE_STEPS):
        loss = model(**inputs)
        loss.backward()
        ref_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    ref_state = model.state_dict()
    for rank, out in enumerate(run_on_ranks(_pipeline_rank, 4, str(path), timeout_s=600)):
        for fed, (data_world, batch_axes, losses, state) in out.items():
            what = f"rank {rank}, fed {fed}"
            assert (data_world, batch_axes) == (2, (0, None)), what  # ids split, labels whole
            assert losses == pytest.approx(ref_losses, rel=1e-5), what
            for k, v in ref_state.items():
                assert_adam_state_close(state[k], v, PIPE_LR, PIPE_STEPS, f"{what}: {k}")
