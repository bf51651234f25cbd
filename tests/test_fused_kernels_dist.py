"""Plans with the fused kernels (``passes/fuse.py``, ``kernels/``) train as one device does.

On gloo world 2 and 4, GPT-2 (residual + LayerNorm), Llama (residual + RMSNorm, SwiGLU, RoPE),
the PaLM-style model (RoPE with one K/V head, SwiGLU) and Mistral (named by no other test) are
planned with every kernel forced on (``kernels="all"``: the CPU ranks run the torch fallbacks)
and ``outputs=Outputs.LOSS`` (the logits are never computed, so the output projection fuses with
the loss), data parallel, tensor parallel (where the fused cross-entropy runs vocabulary-parallel)
and data x tensor on 2 x 2. Each plan must substitute the kernels the model's patterns call for
and the generated code must call them; each rank's losses of 2 Adam steps and the full state
after them equal the single-device model's (which runs the aten patterns, unfused).
"""

from __future__ import annotations

import pytest
import torch
from harness import (
    D,
    T,
    adam_reference,
    assert_adam_state_close,
    assert_rank_as_reference,
    parallel_axes,
    plan_and_train,
    saved_bytes,
)

import autopar
from autopar.examples import gpt2_tiny, llama_tiny, palm_tiny
from autopar.fusion import Kernel
from autopar.launch import run_on_ranks
from autopar.passes.analyze import analyze
from autopar.passes.fuse import fuse
from autopar.passes.kept import kept_for_backward
from autopar.passes.trace import Role, keep_loss_only, trace
from autopar.placement import Outputs, is_shard, spec_from_str

pytestmark = pytest.mark.slow

SEQ, HIDDEN, VOCAB, BATCH = 8, 32, 96, 4
LR, EPS, STEPS = 1e-2, 1e-5, 2


def _mistral():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MistralConfig(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, sliding_window=None,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return tf.MistralForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def build(name):
    kw = {"batch": BATCH, "seq": SEQ, "hidden": HIDDEN, "vocab": VOCAB}
    return {
        "gpt2": lambda: gpt2_tiny(**kw),
        "llama": lambda: llama_tiny(**kw),
        "palm": lambda: palm_tiny(**kw),
        "mistral": _mistral,
    }[name]()


# the kernels each model's patterns call for
EXPECTED = {
    "gpt2": {Kernel.LAYER_NORM, Kernel.LINEAR_CROSS_ENTROPY},
    "llama": {Kernel.RMS_NORM, Kernel.SWIGLU, Kernel.ROPE, Kernel.LINEAR_CROSS_ENTROPY},
    "mistral": {Kernel.RMS_NORM, Kernel.SWIGLU, Kernel.ROPE, Kernel.LINEAR_CROSS_ENTROPY},
    "palm": {Kernel.LAYER_NORM, Kernel.SWIGLU, Kernel.ROPE, Kernel.LINEAR_CROSS_ENTROPY},
}

# data parallel splits the fused loss's rows (its sum and count all-reduced), tensor parallel its
# vocabulary (vocabulary-parallel); the 2 x 2 cases do both at once
CASES = {
    2: [("gpt2", (2,), (T,)), ("llama", (2,), (D,)), ("palm", (2,), (T,)), ("mistral", (2,), (T,))],
    4: [("llama", (2, 2), (D, T)), ("gpt2", (2, 2), (D, T))],
}


def _no_logits(out):
    assert out.logits is None, "outputs='loss' returns no logits"


_RUNS: dict[int, tuple[dict, list]] = {}
_REFS: dict[str, tuple] = {}


def _world(world: int, tmp_path_factory):
    if world not in _RUNS:
        cases = {
            (name, mesh, tuple(r.value for r in roles)): dict(
                mesh_shape=mesh, axis_roles=roles, kernels="all", outputs=Outputs.LOSS
            )
            for name, mesh, roles in CASES[world]
        }
        cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
        tmp = tmp_path_factory.mktemp(f"fused{world}")
        _RUNS[world] = plan_and_train(world, build, cluster, cases, tmp, STEPS, LR, EPS, _no_logits)
    return _RUNS[world]


def _reference(name):
    if name not in _REFS:
        model, inputs = build(name)
        _REFS[name] = adam_reference(model, inputs, STEPS, LR, EPS)
    return _REFS[name]


@pytest.mark.parametrize(
    "world,name,mesh,roles", [(w, *case) for w, cases in CASES.items() for case in cases]
)
def test_fused_kernels_train_as_one_device(world, name, mesh, roles, tmp_path_factory):
    plans, per_rank = _world(world, tmp_path_factory)
    key = (name, mesh, tuple(r.value for r in roles))
    plan = plans[key]
    assert not isinstance(plan, str), f"planning failed:\n{plan}"
    fused = {u.kernel for u in plan.kernels}
    assert fused == EXPECTED[name], f"{name}: fused {sorted(k.value for k in fused)}"
    if T in roles:  # the tensor-parallel head computes its loss vocabulary-parallel, in chunks
        ce = [u.node for u in plan.kernels if u.kernel is Kernel.LINEAR_CROSS_ENTROPY]
        weight = spec_from_str(plan[ce[0]].inputs[1])
        assert is_shard(weight[roles.index(T)]), f"{name}: the fused loss's weight is {plan[ce[0]].inputs[1]}"
    ref_losses, ref_state = _reference(name)
    for rank, results in enumerate(per_rank):
        res = results[key]
        # the fused ops sum in another order, rounding Adam's step apart (assert_adam_state_close)
        code, axes = assert_rank_as_reference(rank, res, (ref_losses, ref_state), LR, STEPS)
        assert axes >= parallel_axes(mesh)
        if rank == 0:
            for u in plan.kernels:  # the op itself, or the lowering that calls it on a split
                names = {f"autopar.{u.kernel.value}"}
                if u.kernel is Kernel.LINEAR_CROSS_ENTROPY:
                    names |= {"vocab_parallel_cross_entropy", "fused_loss_sum_and_count"}
                assert any(n in code for n in names), f"the generated code calls no {names}"


def _saved_bytes_rank(rank, world, paths):
    """Bytes autograd saves in one forward under each plan, on this rank (``harness.saved_bytes``)."""
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}
    for kind, path in paths:
        model, inputs = llama_tiny(batch=4, seq=32, hidden=32, vocab=512)
        out[kind] = saved_bytes(autopar.autoparallelize(model, cluster, inputs, plan=path), inputs)
    return out


def _predicted_saved(model, inputs, kernels) -> int:
    """What the memory model says autograd keeps for backward, on one device: the activation
    storages some op saves (``passes/kept.py:kept_for_backward``, from what ``passes/analyze.py``
    probed each op's autograd to save) plus the tensors ops keep that are neither inputs nor
    outputs."""
    tg = trace(model, inputs)
    keep_loss_only(tg)
    fuse(tg, kernels)
    infos = analyze(tg)
    kept = kept_for_backward(tg, infos)
    # an op with several outputs keeps the ones it saves at its node; another output is its own storage
    bases = {b: kept.at_node_bytes(b, infos[b]) for b in kept.at_node}
    bases.update({b: infos[b].out_bytes for b in kept.keeper.values()})
    total = sum(n for b, n in bases.items() if infos[b].role is Role.ACTIVATION)
    return total + sum(i.saved_temp_bytes for i in infos.values() if i.requires_grad)


def test_fused_kernels_keep_less_for_backward_by_what_the_memory_model_counts(tmp_path):
    """The memory model counts what the fused ops keep for backward: a Llama (vocabulary 512
    against width 32, so that the loss's log-probabilities matter) planned on one gloo rank with
    and without the kernels; the bytes autograd saves in one forward, measured, differ by what
    the memory model counts for the two graphs (within 10%), and the fused plan predicts the
    smaller peak."""
    model, inputs = llama_tiny(batch=4, seq=32, hidden=32, vocab=512)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=1)
    paths, plans = [], {}
    for kernels in ("none", "all"):
        plans[kernels] = autopar.plan(model, cluster, inputs, kernels=kernels, outputs=Outputs.LOSS)
        path = tmp_path / f"{kernels}.json"
        plans[kernels].save(path)
        paths.append((kernels, str(path)))
    assert not plans["none"].kernels and plans["all"].kernels
    assert plans["all"].predicted.activation_bytes < plans["none"].predicted.activation_bytes
    predicted = _predicted_saved(model, inputs, set()) - _predicted_saved(model, inputs, set(Kernel))
    assert predicted > 0
    (measured,) = run_on_ranks(_saved_bytes_rank, 1, paths, timeout_s=600)
    saved = measured["none"] - measured["all"]
    assert abs(saved - predicted) <= 0.1 * predicted, (saved, predicted, measured)


def _pipeline_rank(rank, world, path):
    model, inputs = build("llama")
    pmodel = autopar.autoparallelize(
        model, autopar.ClusterSpec.preset("cpu", devices_per_node=world), inputs, plan=path
    )
    opt = pmodel.optimizer(torch.optim.Adam, lr=LR, eps=EPS)
    losses = []
    for _ in range(STEPS):
        losses.append(float(pmodel.step(**inputs)))
        opt.step()
        opt.zero_grad()
    return losses, pmodel.full_state_dict()


def test_fused_kernels_in_pipeline_stages_train_as_one_device(tmp_path):
    """Two pipeline stages of a Llama with every kernel and only the loss returned: the last
    stage returns the loss alone (a pipeline stage returns tensors, the dropped outputs are put
    back as None for the loss function), and training matches one device."""
    model, inputs = build("llama")
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    plan = autopar.plan(
        model, cluster, inputs, pipeline_stages=2, micro_batches=2, kernels="all", outputs=Outputs.LOSS
    )
    assert plan.pipeline.stages == 2 and {u.kernel for u in plan.kernels} == EXPECTED["llama"]
    path = tmp_path / "pp.json"
    plan.save(path)
    ref_losses, ref_state = _reference("llama")
    for losses, state in run_on_ranks(_pipeline_rank, 2, str(path), timeout_s=600):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
        for k in ref_state:
            assert_adam_state_close(state[k], ref_state[k], LR, STEPS, k)
