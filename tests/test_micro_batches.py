"""Micro-batches (gradient accumulation, ``plan.trades.micro_batches = k``): ``ParallelModule.step``
on the global batch trains as the single-device model trained on the whole batch does, reduces the
bucketed gradients once per step, and keeps one micro-batch's activations at a time.

Each plan is made offline for the global batch (``autopar.plan``), the trade set with
``dataclasses.replace(plan, trades=Trades(micro_batches=k))``; ONE spawn per world size applies
them all (``autoparallelize(..., plan=path)``) and runs two Adam steps of ``pmodel.step(**batch)``.
Compared with the single-device model (fp32, rtol 1e-4, atol 1e-5 as in tests/harness.py): the
loss of both steps, the full gradient of the first (exact scale: Adam alone would hide a gradient
reduced twice or not divided by ``k``) and the full state after both (a few elements may take a
share of Adam's step: ``harness.assert_adam_state_close``). Adam's ``eps`` is 1e-5, above
the rounding noise of the gradients: Adam divides each gradient by its own magnitude, so an
element whose gradient is pure rounding noise (~1e-9) would take a step of ``lr`` with a random
sign and the comparison would see that noise, not the gradients.

Models: GPT-2, Llama and PaLM (``autopar.examples``) and Qwen2 (biased q/k/v projections; no
other test runs it). Plans (``RUNS``): data parallel at world 2 (every model with k = 4, GPT-2 also
with 2; small gradient buckets, so several reduce) and at world 4 (Llama k = 4, Qwen2 k = 2), data x
tensor on a 2x2 mesh at world 4 (GPT-2 k = 4, PaLM k = 2: the tensor-parallel gradient all-reduces
the generated graph runs inline run in every micro-batch's backward, the data-parallel buckets once).

Once per step: ``GradSync.reductions`` counts the bucket all-reduces started; per step it is the
number of buckets for every k (with k = 1 and k = 4 on the same plan: equal). One micro-batch at a
time: the bytes autograd saves during one forward (``saved_tensors_hooks``, unique storages,
parameters left out) are about ``1/k`` of the whole batch's. Called wrong (forward on the global
batch, step on a micro-batch, micro-batches that do not split over the data axis, a model whose
graph depends on the batch size), the module raises a typed error that says what to do.
"""

from __future__ import annotations

import dataclasses
import traceback

import pytest
import torch
from harness import D, T, assert_adam_state_close, collective_axes, parallel_axes
from torch.distributed.tensor import DTensor

import autopar
from autopar.codegen.micro_batches import MicroBatchError, batch_size, split_batch
from autopar.examples import gpt2_tiny, llama_tiny, palm_tiny
from autopar.launch import run_on_ranks
from autopar.trades import Trades

SEQ, HIDDEN, VOCAB = 16, 32, 128
BATCH = {2: 8, 4: 16}  # per world: k = 4 micro-batches split over a data axis of 2 / 4
LR, EPS, STEPS = 1e-2, 1e-5, 2
SMALL_BUCKET = 8 * 2**10  # world 2: several buckets per plan
MODELS = ("gpt2", "llama", "palm", "qwen2")
MODES = {"dp2": ((2,), (D,)), "dp4": ((4,), (D,)), "dxt": ((2, 2), (D, T))}
BASELINE = ("gpt2", "dp2", 1)  # the baseline of the counts and the memory
# world -> (model, mode, micro-batches) runs, lean: each model once per world (planning on the 2x2
# mesh takes seconds a model), both meshes and both k among them; GPT-2 also with k = 2 and 1 at
# world 2 (the memory and the reductions for 1, 2 and 4 micro-batches).
RUNS = {
    2: [(name, "dp2", 4) for name in MODELS] + [("gpt2", "dp2", 2), BASELINE],
    4: [("gpt2", "dxt", 4), ("palm", "dxt", 2), ("llama", "dp4", 4), ("qwen2", "dp4", 2)],
}


def build(name: str, batch: int):
    """(model, inputs) of the global batch."""
    kw = dict(batch=batch, seq=SEQ, hidden=HIDDEN, vocab=VOCAB)
    if name == "gpt2":
        return gpt2_tiny(**kw)
    if name == "llama":
        return llama_tiny(**kw)
    if name == "palm":
        return palm_tiny(**kw)
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))
    return tf.Qwen2ForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def _full_grads(pmodel) -> dict[str, torch.Tensor]:
    """State-dict name -> full gradient (collective on every rank)."""
    full = pmodel.full_grads()
    return {name: full[fqn].clone() for name, fqn in pmodel._aliases.items() if fqn in full}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the module's parameters and buffers are DTensors), or ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _saved_bytes(pmodel, inputs) -> list[int]:
    """Bytes of the unique storages autograd saves during each forward of one ``step``, the
    module's own state (parameters and buffers) left out. Runs one step (gradients zeroed after)."""
    own = [*pmodel.parameters(), *(v for v in vars(pmodel.local).values() if isinstance(v, torch.Tensor))]
    state = {_local(t).untyped_storage().data_ptr() for t in own}
    per_forward: list[dict[int, int]] = []

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state:
            per_forward[-1][s.data_ptr()] = s.nbytes()
        return t

    hook = pmodel.register_forward_pre_hook(lambda *_: per_forward.append({}))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pmodel.step(**inputs)
    finally:
        hook.remove()
    pmodel.zero_grad(set_to_none=True)
    return [sum(f.values()) for f in per_forward]


def _train(pmodel, inputs):
    opt = torch.optim.Adam(pmodel.parameters(), lr=LR, eps=EPS)
    losses, reductions, grads = [], [], None
    for step in range(STEPS):
        before = pmodel.grad_sync.reductions
        losses.append(pmodel.step(**inputs))
        reductions.append(pmodel.grad_sync.reductions - before)
        if step == 0:
            grads = _full_grads(pmodel)
        opt.step()
        opt.zero_grad()
    return {
        "losses": losses,
        "grads": grads,
        "state": pmodel.full_state_dict(),
        "reductions": reductions,
        "buckets": pmodel.grad_sync.num_buckets,
        "bucket_axes": pmodel.grad_sync.axes,
        "axes": collective_axes(pmodel),
    }


def _rank(rank, world, jobs):
    from autopar.passes import grad_sync

    if world == 2:
        grad_sync.BUCKET_BYTES = SMALL_BUCKET
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    results = {}
    for key, path in jobs:
        try:
            model, inputs = build(key[0], BATCH[world])
            pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
            res = {"saved": _saved_bytes(pmodel, inputs)} if key[0] == "gpt2" else {}
            if key == ("gpt2", "dp2", 4):
                res["errors"] = _errors(pmodel, model, cluster, inputs, path)
            results[key] = res | _train(pmodel, inputs)
        except Exception:  # noqa: BLE001 - reported by that configuration's test
            results[key] = traceback.format_exc()
    return results


def _errors(pmodel, model, cluster, inputs, path) -> dict[str, str]:
    """The messages of a micro-batched module called wrong: forward on the global batch, step on a
    micro-batch, and a plan whose micro-batches (of 1 row) do not split over the data axis (of 2)."""
    out = {}
    calls = {
        "forward": lambda: pmodel(**inputs),
        "step": lambda: pmodel.step(**{k: v[: len(v) // 4] for k, v in inputs.items()}),
        "indivisible": lambda: autopar.autoparallelize(
            model,
            cluster,
            inputs,
            plan=dataclasses.replace(autopar.Plan.load(path), trades=Trades(micro_batches=8)),
        ),
    }
    for what, call in calls.items():
        try:
            call()
            out[what] = "no error"
        except (ValueError, MicroBatchError) as e:
            out[what] = f"{type(e).__name__}: {e}"
    return out


_RUNS: dict[int, tuple[dict, list]] = {}


def _world(world: int, tmp_path_factory):
    """(plans, per-rank results) of every run of ``world``: planned here, run in one spawn."""
    if world in _RUNS:
        return _RUNS[world]
    tmp = tmp_path_factory.mktemp(f"micro_batches_{world}")
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    runs = RUNS[world]
    plans, jobs = {}, []
    for name, mode in dict.fromkeys((name, mode) for name, mode, _ in runs):
        model, inputs = build(name, BATCH[world])
        mesh, roles = MODES[mode]
        try:
            plans[(name, mode)] = autopar.plan(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
        except Exception:  # noqa: BLE001 - reported by that configuration's test
            plans[(name, mode)] = traceback.format_exc()
    for name, mode, k in runs:
        plan = plans[(name, mode)]
        if isinstance(plan, str):
            continue
        path = tmp / f"{name}_{mode}_{k}.json"
        dataclasses.replace(plan, trades=Trades(micro_batches=k)).save(path)
        jobs.append(((name, mode, k), str(path)))
    _RUNS[world] = (plans, run_on_ranks(_rank, world, jobs, timeout_s=900))
    return _RUNS[world]


_REFERENCE: dict[tuple[str, int], tuple] = {}


def _reference(name: str, batch: int):
    """(losses, gradients of the first step, state after the steps) of the single-device model."""
    if (name, batch) not in _REFERENCE:
        model, inputs = build(name, batch)
        opt = torch.optim.Adam(model.parameters(), lr=LR, eps=EPS)
        losses, grads = [], None
        for step in range(STEPS):
            loss = model(**inputs).loss
            loss.backward()
            losses.append(loss.detach())
            if step == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        _REFERENCE[(name, batch)] = (
            losses,
            grads,
            {k: v.detach().clone() for k, v in model.state_dict().items()},
        )
    return _REFERENCE[(name, batch)]


def _result(world, name, mode, k, tmp_path_factory) -> list[dict]:
    plans, per_rank = _world(world, tmp_path_factory)
    plan = plans[(name, mode)]
    assert not isinstance(plan, str), f"{name} {mode}: planning failed:\n{plan}"
    out = []
    for rank, results in enumerate(per_rank):
        res = results[(name, mode, k)]
        assert not isinstance(res, str), f"{name} {mode} k={k}: rank {rank} failed:\n{res}"
        out.append(res)
    return out


CASES = [(w, *run) for w, runs in RUNS.items() for run in runs if run != BASELINE]


@pytest.mark.slow
@pytest.mark.parametrize("world,name,mode,k", CASES, ids=[f"w{w}-{n}-{m}-k{k}" for w, n, m, k in CASES])
def test_step_over_micro_batches_trains_as_the_whole_batch(world, name, mode, k, tmp_path_factory):
    ref_losses, ref_grads, ref_state = _reference(name, BATCH[world])
    tol = dict(rtol=1e-4, atol=1e-5)
    for rank, res in enumerate(_result(world, name, mode, k, tmp_path_factory)):
        assert 0 in res["bucket_axes"], f"rank {rank}: no gradient bucket reduces over the data axis"
        assert res["axes"] >= parallel_axes(MODES[mode][0]), f"rank {rank}: collectives on {res['axes']}"
        for step, (loss, ref) in enumerate(zip(res["losses"], ref_losses)):
            assert loss.dim() == 0 and not loss.requires_grad
            torch.testing.assert_close(loss, ref, **tol, msg=f"rank {rank} step {step} loss")
        assert set(res["grads"]) >= set(ref_grads)
        for n, g in ref_grads.items():
            torch.testing.assert_close(res["grads"][n], g, **tol, msg=f"rank {rank} gradient of {n}")
        assert set(res["state"]) == set(ref_state)
        for n, v in ref_state.items():
            assert_adam_state_close(res["state"][n], v, LR, STEPS, f"rank {rank} {n} after {STEPS} steps")
        # every bucket reduced once per step, however many micro-batches ran
        assert res["reductions"] == [res["buckets"]] * STEPS, f"rank {rank}: {res['reductions']}"


@pytest.mark.slow
def test_gradients_reduce_once_per_step_and_one_micro_batch_is_live(tmp_path_factory):
    one = _result(2, *BASELINE, tmp_path_factory)
    four = _result(2, "gpt2", "dp2", 4, tmp_path_factory)
    two = _result(2, "gpt2", "dp2", 2, tmp_path_factory)
    for r1, r2, r4 in zip(one, two, four):
        assert r1["buckets"] > 1, "the small buckets should make several"
        assert r1["reductions"] == r4["reductions"] == [r1["buckets"]] * STEPS
        assert len(r1["saved"]) == 1 and len(r2["saved"]) == 2 and len(r4["saved"]) == 4
        full = r1["saved"][0]
        for k, r in ((2, r2), (4, r4)):
            for micro in r["saved"]:
                assert 0.8 / k < micro / full < 1.2 / k, f"k={k}: {micro} of {full} bytes saved"


@pytest.mark.slow
def test_a_micro_batched_module_called_wrong_says_what_to_do(tmp_path_factory):
    for res in _result(2, "gpt2", "dp2", 4, tmp_path_factory):
        errors = res["errors"]
        assert errors["forward"].startswith("InputsError") and "pmodel.step(" in errors["forward"]
        assert "step takes the global batch, 8 rows (4 micro-batches of 2" in errors["step"], errors["step"]
        assert errors["indivisible"].startswith("MicroBatchError"), errors["indivisible"]
        assert "do not split over the 2 ranks" in errors["indivisible"]


class _BatchDependent(torch.nn.Module):
    """Python control flow on the batch size: another graph for a micro-batch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return (y * 2 if x.shape[0] > 2 else y).sum()


def test_a_model_whose_graph_depends_on_the_batch_is_refused():
    from autopar.codegen.micro_batches import check_same_graph
    from autopar.passes.trace import trace

    model, x = _BatchDependent(), torch.randn(4, 4)
    check_same_graph(trace(model, (x,)), trace(model, (x[:4],)), 1)
    with pytest.raises(MicroBatchError, match="depends on the batch size"):
        check_same_graph(trace(model, (x,)), trace(model, (x[:2],)), 2)


def test_split_batch_and_its_errors():
    ids = torch.arange(24).reshape(8, 3)
    parts = split_batch(((ids,), {"labels": ids, "flag": True}), 4)
    assert len(parts) == 4
    for i, (args, kwargs) in enumerate(parts):
        assert torch.equal(args[0], ids[2 * i : 2 * i + 2]) and torch.equal(kwargs["labels"], args[0])
        assert kwargs["flag"] is True
    assert batch_size({"x": ids}, 2) == 8
    with pytest.raises(MicroBatchError, match="does not split into 3"):
        split_batch({"x": ids}, 3)
    with pytest.raises(MicroBatchError, match="disagree"):
        split_batch({"x": ids, "y": ids[:4]}, 2)
    with pytest.raises(MicroBatchError, match="scalar"):
        split_batch({"x": ids, "t": torch.tensor(1.0)}, 2)
    assert issubclass(MicroBatchError, autopar.PlanMismatchError)


class _BatchOneBranch(torch.nn.Module):
    """Code that takes another path for a batch of one row (as Hugging Face's squeezes do)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.shape[0] == 1:
            h = h.squeeze(0).unsqueeze(0)
        return h.square().mean()


def test_the_search_keeps_micro_batches_off_where_they_change_the_step():
    """A training batch norm normalizes each micro-batch with its own statistics, and a one-row
    micro-batch of code that branches on the batch traces another graph: the search refuses those
    counts (``passes/micro_batch_check.py``), a forced count is the user's."""
    from autopar.passes.micro_batch_check import MicroBatchCheck
    from autopar.passes.trace import trace

    torch.manual_seed(0)
    bn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    x = torch.randn(4, 3, 6, 6)
    check = MicroBatchCheck(bn, (x,), trace(bn, (x,)), forced=None)
    assert check.allows(4, 1) and not check.allows(4, 2) and not check.allows(4, 4)
    assert "batch_norm" in check.refused[2] and "statistics over the batch" in check.refused[2]
    assert MicroBatchCheck(bn, (x,), trace(bn, (x,)), forced=2).allows(4, 2)

    model, y = _BatchOneBranch(), torch.randn(4, 8)
    check = MicroBatchCheck(model, (y,), trace(model, (y,)), forced=None)
    assert check.allows(4, 2)  # two rows trace the plan's graph
    assert not check.allows(4, 4) and "one row" in check.refused[4]
    # a model whose code does not branch: one-row micro-batches are fine
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert MicroBatchCheck(plain, (y,), trace(plain, (y,)), forced=None).allows(4, 4)


class _OneRowStack(torch.nn.Module):
    """Repeated blocks (so the search may pipeline them) whose code takes another path for one
    row when ``branch``."""

    def __init__(self, branch: bool):
        super().__init__()
        torch.manual_seed(0)
        self.branch = branch
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(4)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        if self.branch and x.shape[0] == 1:
            x = x.squeeze(0).unsqueeze(0)
        return x.square().mean()


@pytest.mark.parametrize("branch", [True, False])
def test_one_row_micro_batches_are_traced_only_where_their_plan_wins(branch):
    """The search explores one-row micro-batches unchecked and traces the model on one row only
    where such a plan wins. Where the graph changes on one row, it searches again without them
    and answers what a search that never had them answers: the same plan as the next count forced."""
    model, x = _OneRowStack(branch), torch.randn(4, 256)
    cluster = autopar.ClusterSpec.preset("a100-80gb", devices_per_node=2)
    said: list[str] = []
    kw = dict(pipeline_stages=2, schedule="gpipe")
    got = autopar.plan(model, cluster, (x,), progress=said.append, **kw)
    # two stages of one device each: 4 micro-batches (one row each) are the search's first count
    assert got.pipeline.enabled and got.pipeline.stages == 2
    if not branch:
        assert got.trades.micro_batches == 4 and not any("again" in m for m in said)
        return
    assert any("search: again, without one-row micro-batches" in m for m in said)
    assert got.trades.micro_batches == 2
    forced = autopar.plan(model, cluster, (x,), micro_batches=2, **kw)
    assert forced.pipeline == got.pipeline
    assert got.predicted.step_time_s == pytest.approx(forced.predicted.step_time_s, rel=1e-12)
    assert got.to_dict()["decisions"] == forced.to_dict()["decisions"]
