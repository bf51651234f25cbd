"""Masks over the evaluation budget (passes/mask_blocks.py, passes/mask_diagonals.py): kept as their
expression, proven causal from their diagonals or block by block, and never rewritten where they are
not the causal mask. The budget is lowered so that small shapes stand for a 128K-token mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autopar.passes.causal_mask as cm
import autopar.passes.mask_blocks as mb
from autopar.examples import gpt2_tiny, llama_tiny
from autopar.passes.causal_mask import SDPA, _bind, _evaluate
from autopar.passes.mask_blocks import Lazy
from autopar.passes.mask_diagonals import diagonal_vector
from autopar.passes.trace import trace
from autopar.tools.validate import placeholder_values

BUDGET = 48 * 2**10  # under a (256, 256) boolean, over the vectors it is built from


def _calls(tg):
    return [n for n in tg.graph.nodes if n.op == "call_function" and n.target is SDPA]


def _masks(tg):
    return [_bind(n).get("attn_mask") for n in _calls(tg)]


class _Spy:
    """Counts the proofs' paths: diagonal vectors found, blocks compared (and their rows)."""

    def __init__(self, mp: pytest.MonkeyPatch, diagonals: bool = True):
        self.vectors, self.blocks = 0, []
        real_diag, real_match = cm.diagonal_vector, mb.matches_causal

        def diag(one, rows, cols):
            g = real_diag(one, rows, cols) if diagonals else None
            self.vectors += g is not None
            return g

        def match(m, causal):
            if m.dim() == 2:  # a block of rows (a diagonal vector is 1-D)
                self.blocks.append(m.shape[0])
            return real_match(m, causal)

        mp.setattr(cm, "diagonal_vector", diag)
        mp.setattr(mb, "matches_causal", match)


@pytest.mark.parametrize("build", [llama_tiny, gpt2_tiny], ids=["llama", "gpt2"])
@pytest.mark.parametrize("diagonals", [True, False], ids=["diagonals", "blocks"])
def test_hugging_face_mask_over_the_budget_is_proven_causal(monkeypatch, build, diagonals):
    """A (2, 1, 256, 256) mask, 128 KiB (64 KiB a batch row), under a 48 KiB budget: before, left
    alone; now its last ops are kept lazy and it is proven causal, from its 511 diagonals or in
    blocks of rows within the budget, and the rewritten graph computes what the eager model
    computes."""
    model, batch = build(batch=2, seq=256)
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", BUDGET)
    spy = _Spy(monkeypatch, diagonals)
    tg = trace(model, batch)
    assert all(m is None for m in _masks(tg)) and all(n.kwargs["is_causal"] for n in _calls(tg))
    if diagonals:
        assert spy.vectors == 1 and not spy.blocks
    else:
        # several blocks of rows, covering the 256 rows once
        assert spy.vectors == 0 and len(spy.blocks) > 1 and sum(spy.blocks) == 256
    model.eval()
    with torch.no_grad():
        logits = tg.graph_module(*placeholder_values(tg, batch, seed=0))[1]
        torch.testing.assert_close(logits, model(**batch).logits)


def test_block_rows_keep_the_block_within_the_budget(monkeypatch):
    """Each block's rows times the bytes per row of every node of the expression, plus the leaves
    held, stay within the budget; a budget that holds not one row refuses (left alone)."""
    model, batch = llama_tiny(batch=2, seq=256)
    captured = trace(model, batch, causal_masks=False)
    mask = _masks(captured)[0]
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", BUDGET)
    lazy = _evaluate(mask)
    assert isinstance(lazy, Lazy)
    held = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in lazy.leaves()}.values())
    per_row = 256 * (sum(n.dtype.itemsize for n in lazy.nodes()) + mb.COMPARE_BYTES_PER_ELEMENT)
    rows = mb.block_rows(lazy, 256, BUDGET)
    assert 1 <= rows < 256 and held + rows * per_row <= BUDGET < held + (rows + 1) * per_row
    assert mb.block_rows(lazy, 256, held + per_row - 1) == 0
    assert not mb.causal_blockwise(lazy, 256, 256, held + per_row - 1)
    assert mb.causal_blockwise(lazy, 256, 256, held + per_row)


def test_padding_from_an_input_over_the_budget_is_left_alone(monkeypatch):
    model, batch = llama_tiny(batch=2, seq=256)
    attention_mask = torch.ones(2, 256, dtype=torch.long)
    attention_mask[1, :5] = 0
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", BUDGET)
    tg = trace(model, dict(batch, attention_mask=attention_mask))
    assert all(m is not None for m in _masks(tg))


STYLES = ("tril", "arange", "offset", "scaled", "sub", "shift", "band", "prefix", "anti", "float_inf",
          "float_min", "penalty", "tril_k", "int32")  # fmt: skip


class _Masked(torch.nn.Module):
    """SDPA with a mask of shapes alone: ``k`` shifts the diagonal (``shift``, ``tril_k``), sets a
    window (``band``: the last ``k`` keys; ``prefix``: also the first ``k``), an offset of both
    positions (``offset``) or of one (``sub``: ``i - j >= k``); ``scaled`` compares ``2j <= 2i``,
    ``penalty`` is a finite ``-1e4`` where masked, ``int32`` compares int32 positions."""

    def __init__(self, style: str, k: int, expand: bool):
        super().__init__()
        self.style, self.k, self.expand = style, k, expand

    def mask(self, q: torch.Tensor) -> torch.Tensor:
        b, _, rows, _ = q.shape
        i = torch.arange(rows, device=q.device)[:, None]
        j = torch.arange(rows, device=q.device)[None, :]
        s, k = self.style, self.k
        if s in ("tril", "tril_k"):
            m = torch.ones(rows, rows, dtype=torch.bool, device=q.device).tril(0 if s == "tril" else k)
        elif s == "arange":
            m = j <= i
        elif s == "offset":
            m = (j + k) <= (i + k)
        elif s == "scaled":
            m = 2 * j <= 2 * i
        elif s == "sub":
            m = (i - j) >= k
        elif s == "shift":
            m = j <= i + k
        elif s == "band":
            m = (j <= i) & (i - j < k)
        elif s == "prefix":
            m = (j <= i) | (j < k)
        elif s == "anti":
            m = j >= i
        elif s == "int32":
            m = j.to(torch.int32) <= i.to(torch.int32)
        else:
            low = {"float_inf": float("-inf"), "float_min": torch.finfo(q.dtype).min, "penalty": -1e4}[s]
            m = torch.zeros(rows, rows, dtype=q.dtype, device=q.device).masked_fill(j > i, low)
        return m[None, None].expand(b, 1, rows, rows) if self.expand else m

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(q))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    style=st.sampled_from(STYLES),
    seq=st.integers(96, 160),
    k=st.integers(-3, 5),
    expand=st.booleans(),
    diagonals=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_over_the_budget_rewritten_exactly_when_causal(style, seq, k, expand, diagonals, seed):
    """The oracle: the mask computed eagerly and compared with tril. Under a budget smaller than
    the mask, the lazy proof (diagonals or blocks) rewrites exactly the causal ones, and the
    rewritten graph computes what the module computes."""
    module = _Masked(style, k, expand)
    gen = torch.Generator().manual_seed(seed)
    q, kk, v = (torch.randn(2, 2, seq, 8, generator=gen) for _ in range(3))
    allowed = module.mask(q)
    allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    causal = torch.equal(allowed.expand(2, 1, seq, seq)[0, 0], torch.ones(seq, seq, dtype=torch.bool).tril())
    if style == "penalty":  # a finite penalty is not masking
        causal = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cm, "EVAL_BUDGET_BYTES", seq * seq * 3 // 4)  # under the (seq, seq) mask
        spy = _Spy(mp, diagonals)
        tg = trace(module, (q, kk, v))
    (n,) = _calls(tg)
    assert (_bind(n).get("attn_mask") is None) == causal
    assert bool(n.kwargs.get("is_causal", False)) == causal
    if causal:  # proven by one path or the other, never skipped
        assert spy.vectors or spy.blocks
    (out,) = tg.graph_module(*placeholder_values(tg, (q, kk, v), seed=0))
    torch.testing.assert_close(out, module(q, kk, v))


@pytest.mark.parametrize(
    "style,k,found",
    [("arange", 0, True), ("offset", 3, True), ("scaled", 0, True), ("sub", 1, True), ("band", 3, True),
     ("tril_k", -1, True), ("float_inf", 0, True), ("prefix", 2, False)],
)  # fmt: skip
def test_diagonal_vector_is_the_mask_on_every_diagonal(monkeypatch, style, k, found):
    """Where found, ``g[j - i + L - 1]`` equals the mask computed as written at every (i, j); a
    mask that is not a function of ``j - i`` (a prefix of keys every query sees) has none."""
    module = _Masked(style, k, expand=True)
    q = torch.randn(2, 2, 128, 8)
    captured = trace(module, (q, q, q), causal_masks=False)
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", 128 * 128 * 3 // 4)
    lazy = _evaluate(_masks(captured)[0])
    assert isinstance(lazy, Lazy)
    one = lazy.narrow(0, 0, 1).narrow(1, 0, 1)
    g = diagonal_vector(one, 128, 128)
    assert (g is not None) == found
    if found:
        i, j = torch.arange(128)[:, None], torch.arange(128)[None, :]
        torch.testing.assert_close(g[j - i + 127], module.mask(q)[0, 0])


class _Transposed(torch.nn.Module):
    """The causal mask built as an upper triangle, transposed (``transpose``), or not."""

    def __init__(self, transpose: bool):
        super().__init__()
        self.transpose = transpose

    def forward(self, q, k, v):
        rows = q.shape[-2]
        i = torch.arange(rows)[:, None]
        j = torch.arange(rows)[None, :]
        mask = (j >= i).transpose(0, 1) if self.transpose else j <= i
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_an_op_that_is_not_blockwise_refuses(monkeypatch):
    """A transpose of a lazy value is not blockwise: over the budget the mask is left alone, though
    causal (proven where the budget holds it, and the same mask untransposed is proven lazily)."""
    q = torch.randn(1, 2, 128, 8)
    assert _masks(trace(_Transposed(True), (q, q, q)))[0] is None
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", 128 * 128 * 3 // 4)
    assert _masks(trace(_Transposed(True), (q, q, q)))[0] is not None
    assert _masks(trace(_Transposed(False), (q, q, q)))[0] is None


def _col(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n)[None, :]


def _row(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n)[:, None]


@pytest.mark.parametrize(
    "build,found",
    [
        (lambda: mb.Elementwise(torch.ops.aten.le.Tensor, *_flat(_col(8), _row(8)), (8, 8), torch.bool), True),
        (lambda: mb.Elementwise(torch.ops.aten.le.Tensor, *_flat(_col(8), _row(8, 1)), (8, 8), torch.bool), True),
        (lambda: mb.Triangle(torch.ones((), dtype=torch.bool).expand(8, 8), 1, False), True),
        (lambda: mb.Triangle(torch.ones((), dtype=torch.bool).expand(8, 8), -2, True), True),
        # a triangle of one row, broadcast over the rows: j <= 0 at every row, not a function of j - i
        (lambda: mb.View.of(mb.Triangle(torch.ones((), dtype=torch.bool).expand(1, 8), 0, False), (8, 8)), False),
        (lambda: mb.Elementwise(torch.ops.aten.lt.Scalar, *_flat(_col(8), 3), (1, 8), torch.bool), False),
        (lambda: mb.View.of(mb.Elementwise(torch.ops.aten.lt.Scalar, *_flat(_col(8), 3), (1, 8), torch.bool), (8, 8)), False),
    ],
)  # fmt: skip
def test_diagonal_vector_of_hand_built_expressions(build, found):
    """Where found, the vector is the expression's materialized value on every diagonal; an
    expression that is not a function of ``j - i`` has none."""
    lazy = build()
    full = mb.View.of(lazy, (8, 8)) if tuple(lazy.shape) != (8, 8) else lazy
    g = diagonal_vector(full, 8, 8)
    assert (g is not None) == found
    if found:
        i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
        assert torch.equal(g[j - i + 7], full.materialize())


def _flat(*args):
    import torch.utils._pytree as pytree

    return pytree.tree_flatten((args, {}))


@pytest.mark.parametrize("window,causal", [(16, False), (512, True)])
def test_hugging_face_sliding_window_over_the_budget(monkeypatch, window, causal):
    """Mistral's sliding-window mask (Hugging Face's own mask code) over the budget: a window
    shorter than the sequence is not causal and stays; one longer than it is, and is rewritten."""
    import transformers as tf

    cfg = tf.MistralConfig(
        num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, use_cache=False,
        sliding_window=window, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.MistralForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 256))
    batch = {"input_ids": ids, "labels": ids}
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", BUDGET)
    spy = _Spy(monkeypatch)
    tg = trace(model, batch)
    assert all((m is None) == causal for m in _masks(tg))
    assert spy.vectors == 1  # proven (or disproven) from the diagonals, not refused
    model.eval()
    with torch.no_grad():
        logits = tg.graph_module(*placeholder_values(tg, batch, seed=0))[1]
        torch.testing.assert_close(logits, model(**batch).logits)
