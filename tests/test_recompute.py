"""Activation recomputation run by the generated module (``codegen/blocks.py``).

* ``split_blocks`` computes exactly what the flat rank-local module computes, and each parameter
  is registered once: on the block that alone reads it, or on the root (GPT-2's tied embedding);
* recomputation really happens and frees memory: the bytes still alive after the forward (what is
  kept for backward) fall from NONE to SELECTIVE to FULL, the norms run again in backward under
  both, the matmuls only under FULL; recomputed dropout draws the forward's masks;
* a plan with ``Trades(recompute=FULL|SELECTIVE)`` trains as the single-device model does (two
  Adam steps, losses and full state compared) on gloo ranks: GPT-2, Llama, PaLM and a Qwen2 (tied
  embeddings, q/k/v biases) tensor parallel on 2 ranks, Llama data x tensor parallel on a 2x2
  mesh; their blocks run collectives, so the recomputation in backward needs the mesh it binds.

Single-process tests run a world-1 gloo group in this process; the multi-rank ones plan in the
parent and run every configuration of a world size in one spawn.
"""

from __future__ import annotations

import dataclasses
import gc
import traceback
import weakref
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from harness import assert_adam_state_close
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.codegen import collectives as C
from autopar.codegen.blocks import split_blocks
from autopar.codegen.lower import mangle
from autopar.examples import gpt2_tiny, llama_tiny, palm_tiny
from autopar.launch import run_on_ranks
from autopar.passes.blocks import alternate_matmuls, find_blocks
from autopar.passes.trace import trace
from autopar.trades import Recompute, Trades

tf = pytest.importorskip("transformers")

D, T = autopar.AxisRole.DATA, autopar.AxisRole.TENSOR
FULL, SELECTIVE, NONE = Recompute.FULL, Recompute.SELECTIVE, Recompute.NONE
HALF = Recompute.HALF_MATMULS
STEPS, LR = 2, 1e-3
RTOL, ATOL = 1e-4, 1e-5  # tests/harness.py's fp32 tolerance
aten = torch.ops.aten
MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}


def _cpu(world: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.preset("cpu", devices_per_node=world)


def _qwen2(batch=4, seq=16, hidden=32, vocab=128):
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(
        num_hidden_layers=2, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64, tie_word_embeddings=True,
        use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return tf.Qwen2ForCausalLM(cfg), {"input_ids": ids, "labels": ids}


MODELS = {
    "gpt2": lambda: gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "llama": lambda: llama_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "palm": lambda: palm_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "qwen2": _qwen2,
}
# world size -> (model, recompute mode) -> (mesh shape, axis roles)
RUNS = {
    2: {(name, mode): ((2,), (T,)) for name in MODELS for mode in (FULL, SELECTIVE)}
    | {("llama", HALF): ((2,), (T,))},
    4: {("llama", SELECTIVE): ((2, 2), (D, T)), ("gpt2", HALF): ((2, 2), (D, T))},
}


def build(name):
    return MODELS[name]()


def with_recompute(plan, mode: Recompute):
    """``plan`` with recomputation ``mode`` and no other trade (whatever the search chose)."""
    return dataclasses.replace(plan, trades=Trades(recompute=mode))


def train(model, inputs):
    """Two Adam steps with the model's own loss: the losses and the state after them."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(**inputs).loss
        losses.append(loss.detach().clone())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


# ------------------------------------------------------------------------------------------------
# single process: a world-1 gloo group
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    assert not dist.is_initialized()
    path = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (the module's parameters and buffers are DTensors), or ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _parallel(model, inputs, plan, mode: Recompute = NONE):
    return autopar.autoparallelize(model, _cpu(1), inputs, plan=with_recompute(plan, mode))


def _grads(module) -> dict[str, torch.Tensor]:
    """Mangled parameter name (unique, wherever the parameter is registered) -> its gradient."""
    return {n.rpartition(".")[2]: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_split_blocks_computes_what_the_flat_module_computes_and_blocks_own_their_parameters(world1):
    model, inputs = gpt2_tiny(batch=2, seq=8, hidden=32, vocab=64)
    pm = _parallel(model, inputs, autopar.plan(model, _cpu(1), inputs))
    flat = pm.local
    tg = trace(model, inputs)
    blocks = find_blocks(tg)
    assert len(blocks) == 2
    split = split_blocks(flat, blocks, tg.graph)

    def run(module):
        with C.bound_mesh(pm.mesh):
            outs = module(inputs["input_ids"], inputs["labels"])
        outs[0].backward()
        grads = {id(p): p.grad.clone() for p in module.parameters()}
        module.zero_grad(set_to_none=True)
        return [o.detach() for o in outs], grads

    (flat_outs, flat_grads), (split_outs, split_grads) = run(flat), run(split)
    torch.testing.assert_close(split_outs, flat_outs, rtol=0, atol=0)
    assert split_grads.keys() == flat_grads.keys()
    for k in flat_grads:
        torch.testing.assert_close(split_grads[k], flat_grads[k], rtol=0, atol=0)

    assert "self.block_0(" in split.code and "self.block_1(" in split.code
    # the same Parameter objects (GradSync and the optimizer hold them), each registered once
    named = list(split.named_parameters(remove_duplicate=False))
    assert len(named) == len({id(p) for _, p in named}) == len(list(flat.parameters()))
    assert {id(p) for _, p in named} == {id(p) for p in flat.parameters()}
    targets = {p.name: p.target for p in tg.placeholders}
    for b in blocks:
        sub = split.get_submodule(f"block_{b.index}")
        owned = {n for n, _ in sub.named_parameters()}
        assert owned == {mangle(targets[p]) for p in b.params}, b.index
        assert all(f"h__{b.index}__" in n for n in owned)
        for n in owned:  # the flat name still resolves on the root (ParallelModule looks state up by it)
            assert getattr(split, n) is getattr(sub, n) is getattr(flat, n)
    # the tied embedding (read by the embedding lookup and the LM head): the root's
    assert "p__transformer__wte__weight" in dict(split.named_parameters(recurse=False))


class _Watch(TorchDispatchMode):
    """Counts the aten ops that run; records a weak reference to every storage an op returns."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()
        self.storages: dict[int, tuple[weakref.ref, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func.overloadpacket] += 1
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout is torch.strided:
                s = _local(t).untyped_storage()
                self.storages[s.data_ptr()] = (weakref.ref(s), s.nbytes())
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        return sum(n for ptr, (ref, n) in self.storages.items() if ref() is not None and ptr not in exclude)


def test_recomputation_frees_activations_and_runs_the_forward_again_in_backward(world1):
    """On one plan: the bytes of the activations alive after the forward (what autograd, the
    checkpoints and the selective cache keep for backward: the storages ops returned that are still
    alive, parameters and inputs left out) fall from NONE to SELECTIVE to FULL. Saved-tensor hooks
    alone cannot count this: a checkpoint's own hooks hide what it keeps from outer ones. In
    backward, the recomputing modes run the blocks' layer norms again (NONE never does); FULL runs
    their matmuls again, HALF_MATMULS exactly the ones the pricing drops (``alternate_matmuls``),
    SELECTIVE none."""
    layers = 2
    model, inputs = gpt2_tiny(batch=4, seq=32, layers=layers, hidden=64, vocab=128)
    plan = autopar.plan(model, _cpu(1), inputs)
    kept, fwd_ops, bwd_ops, losses, grads = {}, {}, {}, {}, {}
    for mode in (NONE, SELECTIVE, HALF, FULL):
        pm = _parallel(model, inputs, plan, mode)
        state = {_local(t).untyped_storage().data_ptr() for t in [*pm.parameters(), *pm.buffers()]}
        state |= {t.untyped_storage().data_ptr() for t in inputs.values()}
        with _Watch() as fwd:
            loss = pm(**inputs).loss
        gc.collect()
        kept[mode], fwd_ops[mode] = fwd.alive_bytes(state), fwd.ops
        with _Watch() as bwd:
            loss.backward()
        bwd_ops[mode], losses[mode], grads[mode] = bwd.ops, loss.detach(), _grads(pm)
    print("bytes kept for backward:", {m.value: b for m, b in kept.items()})
    assert kept[FULL] < kept[HALF] < kept[SELECTIVE] < kept[NONE], kept
    for ops in fwd_ops.values():
        ops.pop(aten.detach, None)  # checkpoints detach what they keep
        ops.pop(aten.empty, None)  # and, on torch < 2.13, make an empty placeholder per block
    assert (
        fwd_ops[FULL] == fwd_ops[SELECTIVE] == fwd_ops[HALF] == fwd_ops[NONE]
    )  # the forward itself is unchanged

    def count(ops, packets):
        return sum(ops[p] for p in packets)

    norms = {aten.native_layer_norm}
    assert count(bwd_ops[NONE], norms) == 0
    assert count(bwd_ops[SELECTIVE], norms) == count(bwd_ops[FULL], norms) == 2 * layers
    assert count(bwd_ops[HALF], norms) == 2 * layers
    assert count(bwd_ops[SELECTIVE], MATMULS) == count(bwd_ops[NONE], MATMULS)
    assert count(bwd_ops[FULL], MATMULS) > count(bwd_ops[HALF], MATMULS) > count(bwd_ops[NONE], MATMULS)
    tg = trace(model, inputs)
    target = {n.name: str(n.target) for n in tg.graph.nodes}
    again = alternate_matmuls(find_blocks(tg), target.get)
    assert len(again) == 2 * layers  # of each layer's four linears, the 2nd and 4th
    # each layer's 2nd linear runs again; its 4th (the MLP's output projection) is not: nothing
    # after it in the block saves a value computed from it, and the checkpoint stops recomputing
    # once it has what backward needs (torch.utils.checkpoint's early stop)
    assert count(bwd_ops[HALF], MATMULS) - count(bwd_ops[NONE], MATMULS) == len(again) // 2
    for mode in (SELECTIVE, HALF, FULL):
        torch.testing.assert_close(losses[mode], losses[NONE], rtol=0, atol=0)
        assert grads[mode].keys() == grads[NONE].keys()
        for k in grads[NONE]:
            torch.testing.assert_close(grads[mode][k], grads[NONE][k], rtol=0, atol=0, msg=f"{mode} {k}")


def test_recomputed_dropout_draws_the_forwards_masks(world1):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.3, embd_pdrop=0.0, attn_pdrop=0.3, use_cache=False,
    )  # fmt: skip
    model = tf.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids}
    plan = autopar.plan(model, _cpu(1), inputs)
    results = {}
    for mode, seed in ((NONE, 5), (FULL, 5), (SELECTIVE, 5), (NONE, 6)):
        pm = _parallel(model, inputs, plan, mode)
        torch.manual_seed(seed)
        loss = pm(**inputs).loss
        torch.manual_seed(1234)  # backward must not draw from the RNG as it stands now
        loss.backward()
        results[(mode, seed)] = (loss.detach(), _grads(pm))
    assert not torch.equal(results[(NONE, 5)][0], results[(NONE, 6)][0]), "dropout is not active"
    ref_loss, ref_grads = results[(NONE, 5)]
    for mode in (FULL, SELECTIVE):
        loss, grads = results[(mode, 5)]
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=0, atol=0, msg=f"{mode} {k}")


# ------------------------------------------------------------------------------------------------
# gloo ranks: every configuration of a world size in one spawn
# ------------------------------------------------------------------------------------------------

COLLECTIVES = {
    C.all_gather, C.chunk, C.all_reduce, C.reduce_scatter, C.to_partial, C.f, C.all_gather_linear,
    C.linear_reduce_scatter,
}  # fmt: skip


def _rank(rank, world, jobs):
    results = {}
    for key, path in jobs:
        model, inputs = build(key[0])
        try:
            pm = autopar.autoparallelize(model, _cpu(world), inputs, plan=path)
            blocks = [m for n, m in pm.local.named_children() if n.startswith("block_")]
            in_blocks = sum(n.target in COLLECTIVES for b in blocks for n in b.graph.nodes)
            results[key] = (train(pm, inputs), pm.full_state_dict(), len(blocks), in_blocks)
        except Exception:  # noqa: BLE001 - reported by that configuration's test
            results[key] = traceback.format_exc()
    return results


def _run_world(world: int, tmp_dir):
    jobs = []
    for (name, mode), (mesh, roles) in RUNS[world].items():
        model, inputs = build(name)
        plan = autopar.plan(model, _cpu(world), inputs, mesh_shape=mesh, axis_roles=roles)
        assert tuple(plan.mesh_shape) == mesh
        path = tmp_dir / f"{name}_{mode.value}.json"
        with_recompute(plan, mode).save(path)
        jobs.append(((name, mode), str(path)))
    return run_on_ranks(_rank, world, jobs, timeout_s=600)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    cache = {}

    def get(world):
        if world not in cache:
            cache[world] = _run_world(world, tmp_path_factory.mktemp(f"recompute{world}"))
        return cache[world]

    return get


@pytest.fixture(scope="module")
def references():
    out = {}
    for name in MODELS:
        model, inputs = build(name)
        losses = train(model, inputs)
        out[name] = (losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,name,mode",
    [pytest.param(w, n, m, id=f"world{w}-{n}-{m.value}") for w, runs in RUNS.items() for n, m in runs],
)
def test_recomputing_plans_train_as_the_single_device_model(worlds, references, world, name, mode):
    ref_losses, ref_state = references[name]
    for rank, results in enumerate(worlds(world)):
        res = results[(name, mode)]
        assert not isinstance(res, str), f"{name} {mode}: rank {rank} failed:\n{res}"
        losses, state, n_blocks, in_blocks = res
        assert n_blocks == 2
        assert in_blocks > 0, "no collective in the blocks: the recomputation's mesh binding is untested"
        for step, (loss, ref) in enumerate(zip(losses, ref_losses)):
            torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL, msg=f"rank {rank} step {step} loss")
        assert set(state) == set(ref_state)
        for k in ref_state:
            assert_adam_state_close(state[k], ref_state[k], LR, STEPS, f"rank {rank} {k}", RTOL, ATOL)
