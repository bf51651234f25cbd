"""The loss a data-parallel module returns is summed across ranks without blocking its forward
(``codegen/module.py:defer_output_sums``): a mean loss's all-reduce (``collectives.
all_reduce_deferred``) is started where the graph computed it and waited for where the caller reads
the loss; a token-mean cross-entropy's count is all-reduced from the top of the forward and its sum
waited for where the loss is read (``collectives.mean_deferred``). Against the single-device model:
the loss read after backward, and the gradients; the labels of one rank's rows partly ignored, so
that the ranks count different numbers of tokens."""

from __future__ import annotations

import pytest
import torch
from harness import free_link_cpu

import autopar
from autopar.codegen import collectives as C
from autopar.examples import gpt2_tiny, mlp
from autopar.launch import run_on_ranks

D = autopar.AxisRole.DATA


def _mlp():
    return mlp(batch=8, hidden=16, ffn=32)


def _gpt2():
    model, inputs = gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)
    labels = inputs["labels"].clone()
    labels[0, 4:] = -100  # rank 0's rows count 12 tokens fewer than rank 1's
    return model, {**inputs, "labels": labels}


BUILDS = {"mlp": (_mlp, "all_reduce_deferred("), "gpt2": (_gpt2, "mean_deferred(")}


def _loss(model, inputs):
    return model(**inputs).loss if isinstance(inputs, dict) else model(*inputs)[0]


def _rank(rank, world, plan_path, name):
    model, inputs = BUILDS[name][0]()
    pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=plan_path)
    res = {"code": pmodel.code}
    loss = _loss(pmodel, inputs)
    res["type"] = type(loss).__name__
    res["waited_after_forward"] = getattr(loss, "completed", None)
    loss.backward()  # seeded by ones_like(loss): reads the loss's shape only
    res["waited_after_backward"] = getattr(loss, "completed", None)
    res["grads"] = {k: v.clone() for k, v in pmodel.full_grads().items()}
    res["loss"] = loss.detach()  # waits here
    res["ops"] = (loss * 2, torch.stack([loss, loss]), loss.item(), repr(loss))
    # a second step, the last loss never read: the next forward waits for its sum
    unread = _loss(pmodel, inputs)
    unread.backward()
    res["unread_waited"] = [unread.completed]
    res["second"] = float(_loss(pmodel, inputs))  # the next forward waits for the unread one
    res["unread_waited"].append(unread.completed)
    return res


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_returned_loss_summed_after_backward(tmp_path, name):
    build, call = BUILDS[name]
    model, inputs = build()
    res = autopar.search(model, free_link_cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,), zero_stage=0)
    path = tmp_path / "dp.json"
    res.plan.save(path)
    want = _loss(model, inputs)
    want.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for got in run_on_ranks(_rank, 2, str(path), name):
        assert call in got["code"]
        assert got["type"] == C.DeferredSum.__name__
        assert got["waited_after_forward"] is False and got["waited_after_backward"] is False
        assert type(got["loss"]) is torch.Tensor
        torch.testing.assert_close(got["loss"], want.detach(), rtol=1e-5, atol=1e-6)
        twice, stacked, item, text = got["ops"]
        torch.testing.assert_close(twice, 2 * want.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(stacked, want.detach().expand(2), rtol=1e-5, atol=1e-6)
        assert item == pytest.approx(want.item(), rel=1e-5)
        assert text == f"DeferredSum({got['loss']!r})"
        assert got["second"] == pytest.approx(want.item(), rel=1e-5)  # no optimizer step: the same loss
        assert got["unread_waited"] == [False, True]
        assert set(got["grads"]) == set(grads)
        for n, g in got["grads"].items():
            scale = g.abs().max().item()
            torch.testing.assert_close(g, grads[n], rtol=1e-4, atol=1e-6 * max(scale, 1.0))


def _graph(label_from_param: bool):
    """A module graph ending as a token loss's lowering does: ``mean_of_sum_and_count(all_reduce(
    loss_sum_and_count(logits, target)))``, the target shifted from the labels input, or (where
    ``label_from_param``) computed from a parameter, which cannot move to the top."""
    import torch.fx as fx

    from autopar.codegen import local_ops as L

    g = fx.Graph()
    x, labels = g.placeholder("x"), g.placeholder("labels")
    w = g.get_attr("w")
    logits = g.call_function(torch.ops.aten.mm.default, (x, w))
    src = g.call_function(torch.ops.aten.argmax.default, (w,)) if label_from_param else labels
    target = g.call_function(torch.ops.aten.add.Tensor, (src, 1))
    pair = g.call_function(L.loss_sum_and_count, (logits, target, -100))
    mean = g.call_function(L.mean_of_sum_and_count, (g.call_function(C.all_reduce, (pair, 0)), torch.float32))
    g.output([mean])
    root = torch.nn.Module()
    root.w = torch.nn.Parameter(torch.ones(2, 2))
    return fx.GraphModule(root, g)


@pytest.mark.parametrize("label_from_param", [False, True])
def test_the_count_moves_to_the_top_only_from_the_inputs_alone(label_from_param):
    from autopar.codegen.module import defer_output_sums

    gm = defer_output_sums(_graph(label_from_param))
    order = [n.target if n.op == "call_function" else n.op for n in gm.graph.nodes]
    if label_from_param:  # left as it was: the blocking all-reduce
        assert C.all_reduce in order and C.mean_deferred not in order and C.all_reduce_started not in order
        return
    assert C.all_reduce not in order
    started = order.index(C.all_reduce_started)
    # the target and its count come before the model's first op (the parameter's read, the matmul)
    assert started < order.index("get_attr") < order.index(torch.ops.aten.mm.default)
    assert order.index(C.mean_deferred) > order.index(torch.ops.aten.mm.default)
