"""A step of micro-batches trains on the global batch's loss when labels are ignored unevenly
(``codegen/loss_weights.py``).

A token-mean loss whose ``ignore_index`` labels (padding, a masked-LM batch's unmasked positions)
fall unevenly over the micro-batches is ``sum_i c_i L_i / sum_i c_i``, not the mean of the ``L_i``.
Checked against the single-device model on the whole batch (two SGD steps, whose weights see the
exact gradient: SGD keeps its scale, where Adam would hide it), on 2 gloo ranks:

* a 2-stage pipeline of 4 micro-batches (``PipelinedModule.step``), the caller's ``loss_fn``
  returning the model's own loss (as ``benchmarks/bench_any_model.py`` does);
* data parallelism with 2 micro-batches (``ParallelModule.step``), fed the global batch, and fed
  each rank its slice (its counts summed over the data axis).

Without the weights, these runs' losses and weights differ from one device's by more than the
tolerance (``test_uneven_counts_matter`` shows the plain mean is wrong here).
The counting program itself is checked against a count of the labels over any masking
(hypothesis), and the loss kinds it must leave to the plain mean are named.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import D
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.codegen.loss_weights import loss_weights
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks
from autopar.passes.trace import trace

BATCH, SEQ, VOCAB = 8, 16, 128
LR, STEPS = 0.1, 2
RTOL, ATOL = 1e-4, 1e-5


def model_and_batch():
    """GPT-2 tiny whose labels ignore a different number of positions in every row (row r: its
    first 2 r positions), so every micro-batch averages over its own count of tokens."""
    model, inputs = gpt2_tiny(batch=BATCH, seq=SEQ, hidden=32, vocab=VOCAB)
    labels = inputs["labels"].clone()
    for r in range(BATCH):
        labels[r, : 2 * r] = -100
    return model, {"input_ids": inputs["input_ids"], "labels": labels}


def sgd_reference(steps: int = STEPS):
    model, inputs = model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def plain_mean_reference(k: int):
    """One SGD step on the plain mean of ``k`` micro-batch losses: what a step without the weights
    trains on."""
    model, inputs = model_and_batch()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    parts = [{n: t.chunk(k)[i] for n, t in inputs.items()} for i in range(k)]
    loss = sum(model(**p).loss for p in parts) / k
    loss.backward()
    opt.step()
    return loss.item(), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(rank: int, world: int, jobs):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}
    for key, path, sliced in jobs:
        model, inputs = model_and_batch()
        pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
        opt = pmodel.optimizer(torch.optim.SGD, lr=LR)
        if sliced:
            d, r = pmodel.data_world, pmodel.data_rank
            inputs = {n: t[r::d] for n, t in inputs.items()}
        losses = []
        for _ in range(STEPS):
            losses.append(float(pmodel.step(**inputs, loss_fn=lambda o: o.loss)))
            opt.step()
            opt.zero_grad()
        out[key] = (losses, pmodel.full_state_dict())
    return out


@pytest.mark.slow
def test_micro_batches_weigh_their_tokens(tmp_path):
    model, inputs = model_and_batch()
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    plans = {
        "pipeline": autopar.plan(model, cluster, inputs, pipeline_stages=2, micro_batches=4, mesh_shape=(1,)),
        "data": autopar.plan(model, cluster, inputs, mesh_shape=(2,), axis_roles=(D,), micro_batches=2),
    }
    jobs = []
    for key, plan in plans.items():
        path = tmp_path / f"{key}.json"
        plan.save(path)
        jobs.append((key, str(path), False))
    jobs.append(("data, sliced", str(tmp_path / "data.json"), True))
    per_rank = run_on_ranks(_rank, 2, jobs, timeout_s=600)
    want_losses, want_state = sgd_reference()
    for rank, res in enumerate(per_rank):
        for key, _, _ in jobs:
            losses, state = res[key]
            assert losses == pytest.approx(want_losses, rel=RTOL), (rank, key)
            for name, want in want_state.items():
                torch.testing.assert_close(
                    state[name], want, rtol=RTOL, atol=ATOL, msg=f"{rank} {key} {name}"
                )


def test_uneven_counts_matter():
    """The plain mean of the micro-batches' losses is not the batch's: the weights above are needed."""
    (want_loss, *_), want_state = sgd_reference(steps=1)
    got_loss, got_state = plain_mean_reference(4)
    assert abs(got_loss - want_loss) > RTOL * abs(want_loss)  # near log V at initialization
    worst = max(float((got_state[n] - want_state[n]).abs().max()) for n in want_state)
    assert worst > 10 * (ATOL + RTOL)


def test_a_model_traced_on_meta_counts_the_labels_where_they_are():
    """A model built on the meta device traces its labels' device move (Hugging Face's
    ``labels.to(logits.device)``) to ``meta``; the counting program counts real labels anyway, on
    their own device (it had copied the move, and ``autoparallelize`` of a meta-built model failed
    at its first step: "Cannot copy out of meta tensor")."""
    model, inputs = model_and_batch()
    with torch.device("meta"):
        meta_model, _ = gpt2_tiny(batch=BATCH, seq=SEQ, hidden=32, vocab=VOCAB)
    weights = loss_weights(trace(meta_model, inputs))
    assert weights is not None and weights.counts is not None
    got = weights.counts(inputs["input_ids"], inputs["labels"])
    assert got.device.type == "cpu"
    assert int(got) == int((inputs["labels"][:, 1:] != -100).sum())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, SEQ), min_size=BATCH, max_size=BATCH), st.integers(1, 4))
def test_counts_are_the_counted_labels(ignored, k):
    """The counting program's factors are ``k c_i / sum c`` for any masking and any ``k``."""
    if BATCH % k:
        k = 2
    model, inputs = gpt2_tiny(batch=BATCH // k, seq=SEQ, hidden=32, vocab=VOCAB)
    weights = loss_weights(trace(model, inputs))
    assert weights is not None and weights.counts is not None
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(sum(ignored)))
    for r, n in enumerate(ignored):
        labels[r, :n] = -100
    ids = labels.clamp(min=0)
    parts = [[ids.chunk(k)[i], labels.chunk(k)[i]] for i in range(k)]
    # GPT-2 shifts its labels: the first position of every row never counts
    counts = [float((lab[:, 1:] != -100).sum()) for _, lab in parts]
    factors = weights.factors(parts)
    total = sum(counts)
    want = [k * c / total for c in counts] if total else [1.0] * k
    assert factors == pytest.approx(want, rel=1e-12)


class _Sum(torch.nn.Module):
    def __init__(self, reduction="sum", weight=None, mse=False):
        super().__init__()
        self.lin = torch.nn.Linear(8, 5)
        self.reduction, self.mse = reduction, mse
        self.register_buffer("w", weight)

    def forward(self, x, y):
        out = self.lin(x)
        if self.mse:
            return F.mse_loss(out, torch.nn.functional.one_hot(y, 5).float())
        return F.cross_entropy(out, y, weight=self.w, reduction=self.reduction)


@pytest.mark.parametrize(
    "module, kind",
    [
        (_Sum("sum"), "unit"),  # a summed loss: every micro-batch weighs 1 (factor k)
        (_Sum("mean"), "counts"),
        (_Sum("mean", weight=torch.rand(5)), None),  # class weights: left to the plain mean
        (_Sum(mse=True), None),  # equally many elements per micro-batch: the plain mean is exact
    ],
)
def test_loss_kinds(module, kind):
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    weights = loss_weights(trace(module, (x, y)))
    if kind is None:
        assert weights is None
        return
    assert weights is not None
    parts = [[x[:2], y[:2]], [x[2:], torch.tensor([-100, 1])]]
    if kind == "unit":
        assert weights.counts is None and weights.factors(parts) == [2.0, 2.0]
    else:
        assert weights.factors(parts) == pytest.approx([2 * 2 / 3, 2 * 1 / 3])
