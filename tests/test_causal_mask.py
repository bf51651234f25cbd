"""Causal masks (passes/causal_mask.py): a traced SDPA call whose mask is proven causal becomes
``is_causal=True`` with no mask, and the graph still computes what the eager model computes; a
mask that depends on an input or a buffer, or that is not the causal one, is left as it is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autopar.examples import gpt2_tiny, llama_tiny
from autopar.passes.causal_mask import SDPA, ancestors, is_causal_mask
from autopar.passes.trace import Role, trace
from autopar.tools.validate import placeholder_values


def _sdpa_calls(tg):
    return [n for n in tg.graph.nodes if n.op == "call_function" and n.target is SDPA]


def _mask_of(node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _run(tg, inputs):
    return tg.graph_module(*placeholder_values(tg, inputs, seed=0))


@pytest.mark.parametrize("build", [llama_tiny, gpt2_tiny], ids=["llama", "gpt2"])
def test_hugging_face_causal_mask_becomes_is_causal(build):
    model, batch = build(batch=2, seq=16)
    tg = trace(model, batch)
    calls = _sdpa_calls(tg)
    assert len(calls) == 2
    for n in calls:
        assert _mask_of(n) is None and n.kwargs["is_causal"] is True
    # the mask's ops are gone: no node of the graph compares positions into a (b, 1, L, S) tensor
    shapes = [
        tuple(n.meta["val"].shape) for n in tg.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
    ]
    assert (2, 1, 16, 16) not in shapes
    tg.graph.lint()
    # every node left keeps the value it had as traced (a region's get_attr never had one)
    had = {n.name for n in trace(model, batch, causal_masks=False).graph.nodes if "val" in n.meta}
    assert all("val" in n.meta for n in tg.graph.nodes if n.name in had)
    # placeholders intact: one per parameter, buffer and input, in order
    phs = [n.name for n in tg.graph.nodes if n.op == "placeholder"]
    assert phs == [p.name for p in tg.placeholders]
    # the rewritten graph computes the eager model's loss and logits
    model.eval()
    with torch.no_grad():
        eager = model(**batch)
        loss, logits = _run(tg, batch)[:2]
    torch.testing.assert_close(loss, eager.loss)
    torch.testing.assert_close(logits, eager.logits)
    # and what the graph as captured (with its mask) computes
    captured = trace(model, batch, causal_masks=False)
    assert all(_mask_of(n) is not None for n in _sdpa_calls(captured))
    with torch.no_grad():
        torch.testing.assert_close(_run(captured, batch)[1], logits)


def test_padding_mask_from_an_input_is_left_alone():
    model, batch = llama_tiny(batch=2, seq=8)
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding in the second sequence
    batch = dict(batch, attention_mask=attention_mask)
    tg = trace(model, batch)
    calls = _sdpa_calls(tg)
    assert calls
    inputs = {p.name for p in tg.placeholders if p.role is Role.INPUT and p.target == "attention_mask"}
    for n in calls:
        mask = _mask_of(n)
        assert mask is not None and not n.kwargs.get("is_causal", False)
        assert inputs & {a.name for a in ancestors(mask)}
    model.eval()
    with torch.no_grad():
        eager = model(**batch)
        logits = _run(tg, batch)[1]
    torch.testing.assert_close(logits, eager.logits)


def test_meta_device_model_is_rewritten():
    """A model planned on the meta device: the mask's ops name the meta device, evaluated on CPU."""
    with torch.device("meta"):
        model, batch = llama_tiny(batch=2, seq=16)
    tg = trace(model, batch)
    assert all(_mask_of(n) is None and n.kwargs["is_causal"] for n in _sdpa_calls(tg))


class _Buffered(torch.nn.Module):
    """GPT-2's old style: the causal mask is a buffer (state a user may change): never rewritten."""

    def __init__(self, seq: int):
        super().__init__()
        self.register_buffer("bias", torch.ones(seq, seq, dtype=torch.bool).tril())

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias)


def test_mask_from_a_buffer_is_left_alone():
    q = torch.randn(1, 2, 8, 4)
    tg = trace(_Buffered(8), (q, q, q))
    (n,) = _sdpa_calls(tg)
    assert _mask_of(n) is not None


STYLES = ("tril", "arange", "float_inf", "float_min", "band", "prefix", "anti")


class _Masked(torch.nn.Module):
    """SDPA with a mask built from the query's shape alone, in one of ``STYLES``; ``band`` keeps the
    last ``window`` keys (a sliding window: causal only where ``window >= L``), ``prefix`` also
    lets every query see the first ``window`` keys (a prefix LM: causal only where ``window <= 1``),
    ``anti`` is the transposed (upper-triangular) mask."""

    def __init__(self, style: str, window: int, expand: bool):
        super().__init__()
        self.style, self.window, self.expand = style, window, expand

    def mask(self, q: torch.Tensor) -> torch.Tensor:
        b, _, rows, _ = q.shape
        i = torch.arange(rows, device=q.device)[:, None]
        j = torch.arange(rows, device=q.device)[None, :]
        if self.style == "tril":
            m = torch.ones(rows, rows, dtype=torch.bool, device=q.device).tril()
        elif self.style == "arange":
            m = j <= i
        elif self.style == "band":
            m = (j <= i) & (i - j < self.window)
        elif self.style == "prefix":
            m = (j <= i) | (j < self.window)
        elif self.style == "anti":
            m = j >= i
        else:
            low = float("-inf") if self.style == "float_inf" else torch.finfo(q.dtype).min
            m = torch.zeros(rows, rows, dtype=q.dtype, device=q.device).masked_fill(j > i, low)
        return m[None, None].expand(b, 1, rows, rows) if self.expand else m

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(q))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    style=st.sampled_from(STYLES),
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    seq=st.integers(1, 9),
    window=st.integers(1, 9),
    expand=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rewritten_sdpa_computes_the_original(style, batch, heads, seq, window, expand, seed):
    module = _Masked(style, window, expand)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, seq, 8, generator=gen) for _ in range(3))
    tg = trace(module, (q, k, v))
    (n,) = _sdpa_calls(tg)
    # the oracle: rewritten exactly when the mask attends where SDPA's is_causal does
    allowed = module.mask(q)
    allowed = allowed if allowed.dtype == torch.bool else allowed == 0
    causal = torch.equal(
        allowed.expand(batch, 1, seq, seq)[0, 0], torch.ones(seq, seq, dtype=torch.bool).tril()
    )
    assert (_mask_of(n) is None) == causal
    assert n.kwargs.get("is_causal", False) == causal
    (out,) = _run(tg, (q, k, v))
    torch.testing.assert_close(out, module(q, k, v))


def test_is_causal_mask_reads_one_slice_of_broadcast_dims():
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert is_causal_mask(causal.expand(64, 8, 5, 5), 5, 5)  # stride 0: one slice compared
    assert is_causal_mask(causal[None, None], 5, 5)
    some = causal.repeat(3, 1, 1, 1)
    assert is_causal_mask(some, 5, 5)
    some[2, 0, 4, 0] = False  # a materialized batch dim is compared in full
    assert not is_causal_mask(some, 5, 5)
    assert is_causal_mask(torch.ones(4, 6, dtype=torch.bool).tril(), 4, 6)  # top-left aligned
    assert not is_causal_mask(torch.ones(4, 6, dtype=torch.bool).tril(2), 4, 6)  # bottom-right
    assert not is_causal_mask(causal.to(torch.int64), 5, 5)  # not a mask SDPA takes
    assert not is_causal_mask(None, 5, 5)
    f = torch.zeros(5, 5).masked_fill(~causal, float("-inf"))
    assert is_causal_mask(f, 5, 5) and is_causal_mask(f.to(torch.bfloat16), 5, 5)
    assert not is_causal_mask(f.masked_fill(~causal, -1e4), 5, 5)  # a finite penalty is not masking
    assert not is_causal_mask(f + 0.5, 5, 5)  # a bias where attended


def test_mask_too_large_to_evaluate_is_left_alone(monkeypatch):
    """Under a budget smaller than the mask and too small for the values it is computed from, it
    cannot be proven causal: it stays (never guessed). A mask over the budget that is proven
    without being held: tests/test_mask_blocks.py."""
    import autopar.passes.causal_mask as cm

    model, batch = llama_tiny(batch=2, seq=16)
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", 2 * 16 * 16 - 1)  # less than the (2, 1, 16, 16) mask
    assert all(_mask_of(n) is not None for n in _sdpa_calls(trace(model, batch)))
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", 64 * 2**10)
    assert all(_mask_of(n) is None for n in _sdpa_calls(trace(model, batch)))


@pytest.mark.parametrize("build", [llama_tiny, gpt2_tiny], ids=["llama", "gpt2"])
def test_the_budget_counts_what_the_evaluation_allocates(monkeypatch, build):
    """The budget holds what the evaluation allocates, op by op, not the values' written sizes:
    a Hugging Face mask of many rows, over the budget as written (16 GiB for 1024 rows of 4096),
    is one row with its broadcasts kept, and is proven causal; no op ever runs that would take
    the evaluation past the budget, and a budget under what it needs leaves the mask alone."""
    import autopar.passes.causal_mask as cm
    from autopar.passes.causal_mask import _bind, _live_peak

    model, batch = build(batch=64, seq=64)
    captured = trace(model, batch, causal_masks=False)
    budget = 160 * 2**10  # (64, 1, 64, 64) booleans are 256 KiB
    assert _live_peak(ancestors(_bind(_sdpa_calls(captured)[0])["attn_mask"])) > budget  # as written
    held: list[int] = []
    check = cm._Broadcasts._within_budget

    def spy(self, target, args, kwargs):
        check(self, target, args, kwargs)  # raises past the budget, before the op runs
        storages = {}
        for v in [*self.env.values(), *args]:
            if isinstance(v, torch.Tensor):
                storages[v.untyped_storage()._cdata] = v.untyped_storage().nbytes()
        held.append(sum(storages.values()) + cm._allocates(target, args, kwargs))

    monkeypatch.setattr(cm._Broadcasts, "_within_budget", spy)
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", budget)
    assert all(_mask_of(n) is None for n in _sdpa_calls(trace(model, batch)))
    assert held and max(held) <= budget
    monkeypatch.setattr(cm, "EVAL_BUDGET_BYTES", max(held) - 1)
    assert all(_mask_of(n) is not None for n in _sdpa_calls(trace(model, batch)))


@pytest.mark.parametrize("build", [llama_tiny, gpt2_tiny], ids=["llama", "gpt2"])
def test_mask_evaluated_on_broadcast_slices_equals_the_graphs_value(build):
    """``_evaluate`` keeps what repeats along a dim as a broadcast (one batch row of Hugging Face's
    mask instead of every row): every element equals what the mask's graph computes as written, and
    the batch dim comes back a broadcast (stride 0)."""
    import torch.fx as fx

    from autopar.passes.causal_mask import _bind, _evaluate

    model, batch = build(batch=3, seq=16)
    captured = trace(model, batch, causal_masks=False)
    mask = _bind(_sdpa_calls(captured)[0])["attn_mask"]
    fast = _evaluate(mask)
    nodes = ancestors(mask)
    g = fx.Graph()
    env = {}
    for n in nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output(env[mask])
    with torch.no_grad():
        plain = fx.Interpreter(fx.GraphModule(torch.nn.Module(), g)).run()
    assert fast.shape == plain.shape and fast.dtype == plain.dtype
    assert torch.equal(fast, plain)
    assert fast.stride(0) == 0


def test_pointwise_op_on_one_slice_of_broadcast_dims():
    from autopar.passes.causal_mask import _Broadcasts, _on_one_slice, _shared_slices

    rows = torch.arange(5)[None, :, None].expand(4, 5, 1)  # stride 0 on dim 0
    cols = torch.arange(6).repeat(4, 1)[:, None, :]  # every batch row equal, materialized
    shared = _shared_slices(cols)
    assert torch.equal(shared, cols) and shared.stride(0) == 0
    got = _on_one_slice(torch.ops.aten.le.Tensor, (shared, rows), {})
    assert got.stride(0) == 0 and torch.equal(got, cols <= rows)
    # a 0-dim operand keeps its promotion (a scalar tensor, not a broadcast one)
    frows = torch.arange(5.0)[None, :, None].expand(4, 5, 1)
    half = _on_one_slice(torch.ops.aten.mul.Tensor, (frows, torch.tensor(0.5, dtype=torch.float64)), {})
    assert half.dtype == torch.float32 and half.stride(0) == 0 and torch.equal(half, frows * 0.5)
    # no dim broadcast in every input: None (run as it is)
    assert _on_one_slice(torch.ops.aten.le.Tensor, (cols, torch.arange(6)), {}) is None
    # floats are never merged (-0.0 equals 0.0); a differing slice is kept
    assert _shared_slices(torch.zeros(3, 2)).stride(0) != 0
    assert _shared_slices(torch.tensor([[1, 2], [1, 3]])).stride(0) != 0
    assert issubclass(_Broadcasts, torch.fx.Interpreter)
