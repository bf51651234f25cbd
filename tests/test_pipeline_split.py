"""The cut of a lowered graph into pipeline chunks (``codegen/pipeline.py:split_chunks``), run in
one process: the chunks called one after another, each on what the one before sent it, compute
the flat module's loss and gradients exactly.

The models are encoder-decoders, whose graphs hold nodes between two blocks (the encoder's final
norm, the decoder's embedding and masks): a pipeline runs them with the block before them
(``passes/blocks.py:between_blocks``), since the next block reads them. T5's decoder inputs are
the labels shifted right by in-place writes into a new tensor (``_shift_right``): input-derived
values, which every chunk that reads them computes again, in-place writes included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.codegen import collectives as C
from autopar.codegen.pipeline import split_chunks
from autopar.examples import t5_tiny
from autopar.passes.blocks import between_blocks, find_blocks
from autopar.passes.trace import trace
from autopar.trades import Pipeline, Schedule


class _Seq2Seq(nn.Module):
    """``torch.nn.Transformer`` (its own encoder's final norm between the encoder's blocks and the
    decoder's) behind a linear head, with an MSE loss."""

    def __init__(self, d: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.core = nn.Transformer(d, 2, 2, 2, 2 * d, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, d)

    def forward(self, src, tgt, target):
        return nn.functional.mse_loss(self.head(self.core(src, tgt)), target)


def _seq2seq():
    g = torch.Generator().manual_seed(1)
    src, tgt, target = (torch.randn(2, 6, 16, generator=g) for _ in range(3))
    return _Seq2Seq(), {"src": src, "tgt": tgt, "target": target}


MODELS = {
    "t5": lambda: t5_tiny(batch=2, seq=8, hidden=32, heads=4, vocab=64, layers=2),
    "nn_transformer": _seq2seq,
}


# the model's inputs each chunk reads: the encoder's blocks the source (T5's ids); T5's decoder
# embedding, after the encoder's last block, the labels (shifted right); the loss the labels or the
# target; a chunk of middle blocks none
READS = {
    ("t5", 2): [("input_ids", "labels"), ("labels",)],
    ("t5", 4): [("input_ids",), ("labels",), (), ("labels",)],
    ("nn_transformer", 2): [("src",), ("tgt", "target")],
    ("nn_transformer", 4): [("src",), (), ("tgt",), ("target",)],
}


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    yield
    dist.destroy_process_group()


def _loss(out) -> torch.Tensor:
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out if isinstance(out, torch.Tensor) else out.loss


def _run(module_calls, params) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    loss = _loss(module_calls())
    loss.backward()
    grads = {id(p): p.grad.clone() for p in params if p.grad is not None}
    for p in params:
        p.grad = None
    return loss.detach(), grads


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_chunks_one_after_another_compute_the_flat_module(world1, name, chunks):
    model, inputs = MODELS[name]()
    pm = autopar.autoparallelize(model, autopar.ClusterSpec.preset("cpu", devices_per_node=1), inputs)
    flat = pm.local
    tg = trace(model, inputs)
    blocks = find_blocks(tg)
    assert len(blocks) == 4
    # an encoder-decoder: nodes between the encoder's last block and the decoder's first
    between = between_blocks(tg.graph, blocks)
    assert between and set(between.values()) == {1}
    pipeline = Pipeline(chunks, Schedule.GPIPE, cuts=Pipeline.even_cuts(len(blocks), chunks))
    parts = split_chunks(flat, tg.graph, blocks, pipeline, set(range(chunks)))
    names = [n.name for n in flat.graph.nodes if n.op == "placeholder"]
    args = [inputs[k] for k in inputs]
    assert len(names) == len(args)

    def chained():
        sent: tuple = ()
        for part in parts:  # each chunk takes the inputs it reads, no others
            sent = part.module(*sent, **{n: a for n, a in zip(names, args) if n in part.inputs})
        return sent

    params = list(flat.parameters())
    with C.bound_mesh(pm.mesh):
        want_loss, want = _run(lambda: flat(*args), params)
        got_loss, got = _run(chained, params)
    torch.testing.assert_close(got_loss, want_loss, rtol=0, atol=0)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    # the inputs each chunk takes: those it reads (READS), no others
    assert [p.inputs for p in parts] == READS[name, chunks]
    # each chunk holds a strict part of the parameters, and together they hold them all
    held = [set(map(id, p.params.values())) for p in parts]
    assert all(h < set(map(id, params)) for h in held)
    assert set().union(*held) == set(map(id, params))
