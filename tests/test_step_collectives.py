"""How many collectives a data-parallel training step runs, counted (gloo's own events under
``torch.profiler``), so that one more per step shows as a failure, not as a slower benchmark.

``DistributedDataParallel`` runs one all-reduce a step on these models (its gradient bucket). A
data-parallel ``ParallelModule`` returns the whole batch's loss, so it also sums the loss over the
ranks (deferred, ``codegen/module.py:defer_output_sums``); a token-mean loss divides by the whole
batch's label count. That count is all-reduced only where no rank can know it otherwise
(``ParallelModule._known_count``), and then with the loss's sum, in one all-reduce:

* a rank fed its slice of the batch, one forward: backward runs on the loss's sum, and the reduced
  gradients are divided by the count where it ends (``ParallelModule._scale_after``, Megatron-LM's
  ``calculate_per_token_loss``), so the count is summed with the loss (2 a step: loss and count,
  bucket; 3 when the count had an all-reduce of its own, started at the top of the forward);
* a rank fed the whole batch: the count is counted from its labels, no all-reduce (2);
* ``step`` over ``k`` micro-batches: the step's weights sum every micro-batch's count over the
  ranks in one all-reduce where the ranks are fed slices (none where fed whole), and each
  micro-batch's forward takes its count from there (slices: 1 + k + 1; whole: k + 1).

And a tensor-parallel residual MLP on CPU ranks (``test_gloo_tensor_plan.py``): Megatron's all-reduce
per block in forward, one per block input and the head's in backward, the loss's (deferred): 5,
where the sequence-split plan gloo's reduce-scatter was once priced into ran 9 (5 all-reduces, 4
all-gathers; ``parallelize_module`` runs 3, its head whole).

Each loss is checked against the single-device model's, so that a count taken from the wrong
place fails here too (the gradients with these counts: ``test_loss_weights.py``,
``test_deferred_loss.py``).
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.examples import gpt2_tiny, mlp
from autopar.launch import run_on_ranks

D, T = autopar.AxisRole.DATA, autopar.AxisRole.TENSOR
BATCH, SEQ, K = 4, 8, 2

# (model, micro-batches, fed) -> gloo collectives per step, rank 0
EXPECTED = {
    ("gpt2", 1, "slices"): 2,
    ("gpt2", 1, "whole"): 2,
    ("gpt2", K, "slices"): 1 + K + 1,
    ("gpt2", K, "whole"): K + 1,
    ("mlp", 1, "slices"): 2,
    ("mlp_tp", 1, "whole"): 5,
}


def build(name: str):
    if name == "mlp_tp":
        from test_gloo_tensor_plan import ResidualMLP

        torch.manual_seed(0)
        return ResidualMLP(hidden=16, inter=32), (torch.randn(BATCH, SEQ, 16), torch.randn(BATCH, SEQ, 16))
    if name == "mlp":
        return mlp(batch=BATCH, hidden=16, ffn=32)
    model, inputs = gpt2_tiny(batch=BATCH, seq=SEQ, hidden=32, vocab=64)
    labels = inputs["labels"].clone()
    for r in range(BATCH):  # every row, so every rank and micro-batch, counts its own number
        labels[r, : 2 * r] = -100
    return model, {"input_ids": inputs["input_ids"], "labels": labels}


def _loss(out):
    if isinstance(out, torch.Tensor):
        return out
    return out.loss if hasattr(out, "loss") else out[0]


def _call(pmodel, inputs, k: int):
    if k > 1:
        return pmodel.step(**inputs, loss_fn=_loss) if isinstance(inputs, dict) else pmodel.step(*inputs)
    loss = _loss(pmodel(**inputs) if isinstance(inputs, dict) else pmodel(*inputs))
    loss.backward()
    return loss


def _rank(rank: int, world: int, jobs: list):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}
    for key, path in jobs:
        name, k, fed = key
        model, inputs = build(name)
        pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
        if fed == "slices":
            d, r = pmodel.data_world, pmodel.data_rank
            inputs = (
                {n: t[r::d] for n, t in inputs.items()}
                if isinstance(inputs, dict)
                else [t[r::d] for t in inputs]
            )
        loss = float(_call(pmodel, inputs, k))  # the first call: the batches compared, the caches filled
        pmodel.zero_grad()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _call(pmodel, inputs, k)
        pmodel.zero_grad()
        events = [e.name for e in prof.events() if e.name.startswith("gloo:")]
        out[key] = (loss, events)
    return out


@pytest.mark.slow
def test_collectives_per_data_parallel_step(tmp_path):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    jobs, want = [], {}
    for name in ("gpt2", "mlp", "mlp_tp"):
        model, inputs = build(name)
        loss = _loss(model(**inputs) if isinstance(inputs, dict) else model(*inputs))
        want[name] = loss.item()
        for k in sorted({k for (n, k, _) in EXPECTED if n == name}):
            plan = autopar.plan(  # the step reads the loss alone (the logits are not gathered)
                model, cluster, inputs, mesh_shape=(2,), axis_roles=(T if name == "mlp_tp" else D,), zero_stage=0,
                micro_batches=k,
                outputs=autopar.Outputs.LOSS,
            )  # fmt: skip
            path = tmp_path / f"{name}-{k}.json"
            plan.save(path)
            jobs += [(key, str(path)) for key in EXPECTED if key[:2] == (name, k)]
    per_rank = run_on_ranks(_rank, 2, jobs, timeout_s=600)
    for rank, got in enumerate(per_rank):
        for key, n in EXPECTED.items():
            loss, events = got[key]
            assert loss == pytest.approx(want[key[0]], rel=1e-5), (rank, key)
            assert len(events) == n, (
                f"rank {rank} {key}: {len(events)} collectives a step, expected {n}: {events}"
            )
