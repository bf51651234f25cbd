"""Sharded initialization (``codegen/weights.py``): a model built on the meta device becomes a
parallel module whose ranks each hold only their pieces, read from a Hugging Face safetensors
checkpoint (one file, or shards with an index), sent by rank 0, or made by the model's own
initializers.

On 4 gloo ranks, a Llama whose weights and Adam state do not fit one rank's memory limit (the
plans shard it) is planned on the meta device and built from each source: two Adam steps give the
single-device model's losses and weights (the model the checkpoint was saved from; for
initialization, the same initializers run on one device). While ``autoparallelize`` builds the
module from a checkpoint, the tensors a rank holds at once (``LiveTensorTracker``: every storage
torch allocates, counted while alive; the checkpoint's mapped pages are not) peak at its own pieces
plus one whole tensor, within 10% (under ZeRO-3, where each FSDP2 group is made whole on its data
axis and then sharded: plus the larger of one tensor and one group's pieces).
"""

from __future__ import annotations

import math

import pytest
import torch
from harness import D, T, adam_reference, assert_adam_state_close, free_link_cpu
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
from autopar.codegen.initialize import Initializer
from autopar.codegen.weights import StateLoader, WeightsError, piece_slices
from autopar.launch import run_on_ranks
from autopar.placement import R
from autopar.tools.measure import LiveTensorTracker
from autopar.trades import ZeroStage

LR = 1e-3  # Adam normalizes each gradient: a larger rate magnifies rounding in near-zero ones
STEPS = 2
# name -> (mesh, roles, ZeRO stage, where the weights come from)
CASES = {
    "one file, tp": ((4,), (T,), 0, "file"),
    "shards, dp x tp, zero3": ((2, 2), (D, T), 3, "shards"),
    "rank 0, tp": ((4,), (T,), 0, "rank0"),
    "initialized, dp x tp": ((2, 2), (D, T), 0, None),
}


def _config():
    tf = pytest.importorskip("transformers")
    return tf.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip


def _inputs():
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _real():
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(_config())


def _meta():
    import transformers as tf

    with torch.device("meta"):
        return tf.LlamaForCausalLM(_config())


def _state_bytes(model) -> int:
    """Bytes of the weights, gradients and Adam's two moments (fp32): what training holds."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def _rank(rank, world, jobs, sources):
    out = {}
    for name, path in jobs:
        source = sources[name]
        if source == "rank0":
            weights = autopar.Rank0Weights(_real().state_dict() if rank == 0 else None)
        else:
            weights = source
        torch.manual_seed(0)  # initialization draws the same values on every rank
        model, inputs = _meta(), _inputs()
        with LiveTensorTracker() as tracker:
            pmodel = autopar.autoparallelize(model, free_link_cpu(world), inputs, plan=path, weights=weights)
        held = sum(
            p._local_tensor.numel() * p.element_size() for p in [*pmodel.parameters(), *pmodel.buffers()]
        )
        # under ZeRO-3 a group (a block, or the rest) is made whole on its data axis, then sharded
        d, groups, seen = pmodel.mesh.size(0), [0], set()
        for m in pmodel.zero.fsdp_modules:  # blocks first, the root last
            own = [p for p in m.parameters() if id(p) not in seen]
            seen.update(id(p) for p in own)
            groups.append(sum(p._local_tensor.numel() * p.element_size() * d for p in own))
        opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
        losses = []
        for _ in range(STEPS):
            losses.append(pmodel.step(**inputs).item())
            opt.step()
            opt.zero_grad()
        out[name] = {
            "losses": losses, "state": pmodel.full_state_dict(), "peak": tracker.peak, "held": held, "group": max(groups)
        }  # fmt: skip
    return out


def _train(model):
    return adam_reference(model, _inputs(), STEPS, LR)


def _initialized():
    """The single-device model with the weights the initializers give (the same procedure)."""
    model = _real()
    torch.manual_seed(0)  # as every rank seeds before autoparallelize
    whole = {name: t.clone() for name, t in Initializer(_meta(), torch.device("cpu")).pieces()}
    model.load_state_dict({k: whole[k] for k in model.state_dict()})
    return model


@pytest.mark.slow
def test_a_meta_model_is_built_shard_by_shard_from_each_source(tmp_path):
    real = _real()
    real.save_pretrained(tmp_path / "one")
    real.save_pretrained(tmp_path / "shards", max_shard_size="40KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").exists()
    sources = {name: {"file": str(tmp_path / "one"), "shards": str(tmp_path / "shards")}.get(src, src)
               for name, (_, _, _, src) in CASES.items()}  # fmt: skip
    meta, inputs = _meta(), _inputs()
    limit = 3 * _state_bytes(real) // 4  # the model's training state does not fit one rank
    jobs = []
    for name, (mesh, roles, zero, _) in CASES.items():
        plan = autopar.plan(
            meta, free_link_cpu(4), inputs, mesh_shape=mesh, axis_roles=roles, zero_stage=ZeroStage(zero),
            memory_limit_bytes=limit,
        )  # fmt: skip
        assert plan.predicted.peak_memory_bytes <= limit
        path = tmp_path / f"{name.replace(' ', '_').replace(',', '')}.json"
        plan.save(path)
        jobs.append((name, str(path)))
    ref_losses, ref_state = _train(_real())
    init_losses, init_state = _train(_initialized())
    biggest = max(t.numel() * t.element_size() for t in real.state_dict().values())
    whole = sum(t.numel() * t.element_size() for t in real.state_dict().values())
    for rank, res in enumerate(run_on_ranks(_rank, 4, jobs, sources, timeout_s=600)):
        for name, (_, _, _, src) in CASES.items():
            got = res[name]
            where = f"{name}, rank {rank}"
            losses, state = (ref_losses, ref_state) if src else (init_losses, init_state)
            assert got["losses"] == pytest.approx(losses, rel=1e-5), where
            for k, v in state.items():
                assert_adam_state_close(got["state"][k], v, LR, STEPS, f"{where}: {k}")
            assert got["held"] <= 0.55 * whole, f"{where}: holds {got['held']} of the model's {whole} bytes"
            if src is not None:  # its own pieces plus one whole tensor (ZeRO-3: or one group) at most
                extra = max(biggest, got["group"])
                assert got["peak"] <= 1.1 * (got["held"] + extra), (
                    f"{where}: peak {got['peak']} bytes, pieces {got['held']} + largest tensor {biggest} or group "
                    f"{got['group']}"
                )


def test_initialized_weights_are_the_models_own_initializers():
    """Units are materialized one at a time and initialized by the model's ``_init_weights``: the
    distributions are the model's (normal(0, 0.02) matrices, unit norms, the rotary table exact)."""
    real = _real()
    torch.manual_seed(0)
    init = Initializer(_meta(), torch.device("cpu"))
    assert init.budget < _state_bytes(real) // 4  # a unit is a fraction of the model
    whole = {name: t.clone() for name, t in init.pieces()}
    assert set(real.state_dict()) <= set(whole)
    w = whole["model.layers.0.mlp.up_proj.weight"]
    assert w.mean().abs() < 0.005 and abs(w.std().item() - 0.02) < 0.002
    assert torch.equal(whole["model.norm.weight"], torch.ones(64))
    torch.testing.assert_close(whole["model.rotary_emb.inv_freq"], real.model.rotary_emb.inv_freq)
    # the same seed gives the same weights
    torch.manual_seed(0)
    again = {name: t.clone() for name, t in Initializer(_meta(), torch.device("cpu")).pieces()}
    assert all(torch.equal(whole[k], again[k]) for k in whole)


def test_a_tensor_no_initializer_writes_is_an_error():
    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(4))  # no reset_parameters() makes it again

        def forward(self, x):
            return x * self.scale

    with torch.device("meta"):
        model = Bare()
    loader = StateLoader(
        model, {"scale": model.scale}, {"scale": (R,)}, {}, _Mesh((1,), (0,)), torch.device("cpu")
    )
    with pytest.raises(WeightsError, match="scale"):
        loader.load(["scale"])


class _Mesh:
    """A mesh's shape and this rank's coordinates, without a process group."""

    def __init__(self, shape, coord):
        self.shape, self.coord = shape, coord

    def size(self, a):
        return self.shape[a]

    def get_local_rank(self, a):
        return self.coord[a]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_piece_slices_are_the_pieces_dtensor_keeps(data):
    """For any even split: the slice is the piece ``torch.chunk`` leaves, axis by axis in mesh
    order (a dim cut on two axes: the second cuts the first's piece), as ``Shard`` keeps it."""
    from torch.distributed.tensor import Replicate, Shard

    mesh = data.draw(st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=3), label="mesh")
    ndim = data.draw(st.integers(1, 3), label="ndim")
    spec = tuple(
        data.draw(
            st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, ndim - 1))), label=f"axis {a}"
        )
        for a in range(len(mesh))
    )
    shape = [data.draw(st.integers(1, 3), label=f"dim {d}") for d in range(ndim)]
    for a, p in enumerate(spec):  # sizes that split evenly
        if isinstance(p, Shard):
            shape[p.dim] *= mesh[a]
    coord = tuple(data.draw(st.integers(0, n - 1), label=f"coord {a}") for a, n in enumerate(mesh))
    x = torch.arange(math.prod(shape)).reshape(shape)
    want = x
    for a, p in enumerate(spec):
        if isinstance(p, Shard):
            want = want.chunk(mesh[a], p.dim)[coord[a]]
    assert torch.equal(x[piece_slices(x.shape, spec, _Mesh(mesh, coord))], want)
