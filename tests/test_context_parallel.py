"""Ring attention and all-to-all (Ulysses) sequence parallelism train as one device does.

On gloo world 2 and 4, Llama (grouped K/V heads), GPT-2, the PaLM-style model (one K/V head: the
all-to-all re-cuts the queries' heads and all-gathers the single K/V head) and Qwen3 (per-head
q/k norms; named by no other test) are planned with the sequence axis (``AxisRole.SEQUENCE``) on
a link priced as free, so that the solver keeps the sequence split through the model, and with
``sequence_attention`` forced to ring or all-to-all. Llama and GPT-2 also run with a padding mask
(``attention_mask`` with zeros: the traced mask is then a tensor the ring cuts by query rows and
the all-to-all takes whole). Each plan must run every attention by the forced algorithm; each
rank's losses of 2 Adam steps and the full state after them equal the single-device model's.
"""

from __future__ import annotations

import pytest
import torch
from harness import (
    D,
    S,
    adam_reference,
    assert_rank_as_reference,
    free_link_cpu,
    padded,
    parallel_axes,
    plan_and_train,
    saved_bytes,
)  # fmt: skip

import autopar
from autopar.examples import gpt2_tiny, llama_tiny, palm_tiny
from autopar.launch import run_on_ranks
from autopar.placement import SeqAttention, via_from_str

pytestmark = pytest.mark.slow

SEQ, HIDDEN, VOCAB, BATCH = 16, 32, 128, 2
LR, EPS, STEPS = 1e-2, 1e-5, 2
RING, A2A = SeqAttention.RING, SeqAttention.ALL_TO_ALL


def _qwen3():
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        num_hidden_layers=2, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return tf.Qwen3ForCausalLM(cfg), {"input_ids": ids, "labels": ids}


def build(name):
    kw = {"batch": BATCH, "seq": SEQ, "hidden": HIDDEN, "vocab": VOCAB}
    return {
        "llama": lambda: llama_tiny(**kw),
        "llama_pad": lambda: padded(*llama_tiny(**kw)),
        "gpt2": lambda: gpt2_tiny(**kw),
        "gpt2_pad": lambda: padded(*gpt2_tiny(**kw)),
        "palm": lambda: palm_tiny(**kw),
        "qwen3": _qwen3,
        "llama_long": lambda: llama_tiny(batch=1, seq=256, hidden=16, vocab=64),
    }[name]()


# world -> (model, mesh, roles, algorithm); the K/V heads must divide an all-to-all's axis. Each
# model runs each algorithm in one of the two worlds (Llama both in both)
CASES = {
    2: [
        ("llama", (2,), (S,), RING),
        ("llama", (2,), (S,), A2A),
        ("llama_pad", (2,), (S,), A2A),
        ("gpt2_pad", (2,), (S,), RING),
        ("palm", (2,), (S,), RING),
        ("qwen3", (2,), (S,), A2A),
    ],
    4: [
        ("llama_pad", (4,), (S,), RING),  # llama's ring without a padding mask: at 2 ranks
        ("gpt2", (4,), (S,), A2A),
        ("palm", (4,), (S,), A2A),
        ("qwen3", (2, 2), (D, S), RING),
        ("gpt2_pad", (2, 2), (D, S), A2A),
    ],
}


_RUNS: dict[int, tuple[dict, list]] = {}


def _world(world: int, tmp_path_factory):
    if world not in _RUNS:
        cases = {
            (name, mesh, kind.value): dict(mesh_shape=mesh, axis_roles=roles, sequence_attention=kind)
            for name, mesh, roles, kind in CASES[world]
        }
        tmp = tmp_path_factory.mktemp(f"cp{world}")
        _RUNS[world] = plan_and_train(world, build, free_link_cpu(world), cases, tmp, STEPS, LR, EPS)
    return _RUNS[world]


@pytest.mark.parametrize(
    "world,name,mesh,roles,kind",
    [(w, *case) for w, cases in CASES.items() for case in cases],
    ids=lambda v: v.value if isinstance(v, SeqAttention) else None,
)
def test_sequence_parallel_attention_trains_as_one_device(world, name, mesh, roles, kind, tmp_path_factory):
    plans, per_rank = _world(world, tmp_path_factory)
    key = (name, mesh, kind.value)
    plan = plans[key]
    assert not isinstance(plan, str), f"planning failed:\n{plan}"
    seq_axis = roles.index(S)
    attn = [d for d in plan.decisions if d.op == "aten.scaled_dot_product_attention.default"]
    assert attn and all(via_from_str(d.via)[seq_axis] is kind for d in attn if d.via), [d.via for d in attn]
    assert all(d.via for d in attn), f"attention not split on the sequence: {[d.inputs for d in attn]}"
    ref = adam_reference(*build(name), STEPS, LR, EPS)
    for rank, results in enumerate(per_rank):
        res = results[key]
        code, axes = assert_rank_as_reference(rank, res, ref, LR, STEPS)
        assert axes >= parallel_axes(mesh)
        if rank == 0:
            assert ("ring_attention(" in code) == (kind is RING), code
            assert ("all_to_all(" in code) == (kind is A2A), code


def _saved_bytes_rank(rank, world, paths):
    """Bytes autograd saves in one forward under each plan, on this rank (``harness.saved_bytes``)."""
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}
    for kind, path in paths:
        model, inputs = build("llama_long")
        out[kind] = saved_bytes(autopar.autoparallelize(model, cluster, inputs, plan=path), inputs)
    return out


def test_a_ring_keeps_less_than_gathered_keys_and_values(tmp_path):
    """What a ring saves for backward is this rank's K/V block, where gathering saves the whole
    sequence's K and V. One ring plan, and the same plan with every attention switched to gathered
    K/V (codegen all-gathers them before it): measured on 2 gloo ranks, for a Llama whose sequence
    is long against its width, the ring saves fewer bytes, by what the plans predict."""
    import dataclasses

    model, inputs = build("llama_long")
    cluster = free_link_cpu(2)
    ring = autopar.plan(model, cluster, inputs, mesh_shape=(2,), axis_roles=(S,), sequence_attention=RING)
    decisions = []
    for d in ring.decisions:
        if d.op == "aten.scaled_dot_product_attention.default":
            d = dataclasses.replace(d, inputs=(d.inputs[0], "R", "R", *d.inputs[3:]), via="")
        decisions.append(d)
    gather = autopar.reprice(model, cluster, inputs, dataclasses.replace(ring, decisions=tuple(decisions)))
    paths = []
    for kind, plan in ((RING, ring), (SeqAttention.GATHER, gather)):
        path = tmp_path / f"{kind.value}.json"
        plan.save(path)
        paths.append((kind.value, str(path)))
    predicted = gather.predicted.activation_bytes - ring.predicted.activation_bytes
    per_rank = run_on_ranks(_saved_bytes_rank, 2, paths, timeout_s=600)
    for measured in per_rank:
        saved = measured[SeqAttention.GATHER.value] - measured[RING.value]
        assert saved > 0, measured
        assert abs(saved - predicted) <= 0.1 * predicted, (saved, predicted, measured)
