"""``autopar::grouped_mm`` and ``autopar::moe_experts`` against plain loops, on CPU.

grouped_mm: values and gradients against one ``mm`` per group (empty groups, rows past the last
offset, a transposed weight view), on both paths (``torch._grouped_mm`` where it runs on CPU
float32 with aligned strides, the loop elsewhere or under ``AUTOPAR_KERNELS=torch``); its fake
implementation on meta tensors and its FLOP counts. moe_experts: against a per-token loop written
as Hugging Face's eager experts are (and against transformers' own Qwen3-MoE experts module), over
hypothesis-drawn shapes, activations, layouts and routings; gradients by ``gradcheck``; expert
slices (``first_expert``) summing to the whole; meta shapes and FLOPs.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from autopar.kernels.dispatch import ENV
from autopar.kernels.grouped_mm import fast_path_runs, strides_aligned, uses_fast_path
from autopar.kernels.moe import Act

grouped_mm = torch.ops.autopar.grouped_mm
moe_experts = torch.ops.autopar.moe_experts


def _loop_mm(x, w, offs):
    out = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def _offsets(draw_sizes: list[int]) -> torch.Tensor:
    return torch.tensor(draw_sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


@settings(max_examples=25)
@given(
    sizes=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    tail=st.integers(0, 3),
    k=st.integers(1, 5),
    m=st.integers(1, 5),
    transposed=st.booleans(),
)
def test_grouped_mm_equals_a_loop_of_matmuls(sizes, tail, k, m, transposed):
    offs = _offsets(sizes)
    n = sum(sizes) + tail
    x = torch.randn(n, k, dtype=torch.float64, requires_grad=True)
    base = torch.randn(
        len(sizes), *((m, k) if transposed else (k, m)), dtype=torch.float64, requires_grad=True
    )
    w = base.transpose(-2, -1) if transposed else base
    out = grouped_mm(x, w, offs)
    want = _loop_mm(x, w, offs)
    torch.testing.assert_close(out, want)
    assert not out[sum(sizes) :].any()  # rows past the last offset are zeros
    grad = torch.randn_like(want)
    got = torch.autograd.grad(out, (x, base), grad)
    ref = torch.autograd.grad(want, (x, base), grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_grouped_mm_both_paths_on_aligned_float32(backend, monkeypatch):
    monkeypatch.setenv(ENV, backend)
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)  # an empty group, and 3 rows past the end
    x = torch.randn(12, 16, requires_grad=True)
    base = torch.randn(3, 32, 16, requires_grad=True)  # [G, M, K] storage, used transposed
    w = base.transpose(-2, -1)
    fast = backend == "auto" and fast_path_runs(x.device, x.dtype)
    assert uses_fast_path(x, w) == fast
    out = grouped_mm(x, w, offs)
    want = _loop_mm(x, w, offs)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not out[9:].any()
    grad = torch.randn_like(want)
    got = torch.autograd.grad(out, (x, base), grad)
    ref = torch.autograd.grad(want, (x, base), grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not got[1][1].any()  # the empty group's weight gradient is zero


@settings(max_examples=40)
@given(
    k=st.integers(1, 9),
    m=st.integers(1, 9),
    w_transposed=st.booleans(),
    x_transposed=st.booleans(),
)
def test_the_fast_path_takes_only_layouts_torch_grouped_mm_runs(k, m, w_transposed, x_transposed):
    """``strides_aligned`` against ``torch._grouped_mm`` itself (where this build runs it on CPU): every
    layout it accepts runs (``x [N, 1]``, strides ``(1, 1)``, was accepted and raised)."""
    if not fast_path_runs(torch.device("cpu"), torch.float32):
        pytest.skip("torch._grouped_mm does not run on CPU float32 in this build")
    x = torch.randn(k, 6).t() if x_transposed else torch.randn(6, k)
    base = torch.randn(2, m, k) if w_transposed else torch.randn(2, k, m)
    w = base.transpose(-2, -1) if w_transposed else base
    offs = torch.tensor([2, 5], dtype=torch.int32)
    if strides_aligned(x, w):
        torch._grouped_mm(x, w, offs=offs)  # raises where the check let a layout through wrongly
    if strides_aligned(x.t(), torch.randn(6, m)):  # the weight gradient's operands
        torch._grouped_mm(x.t(), torch.randn(6, m), offs=torch.tensor([2, 6], dtype=torch.int32))
    assert strides_aligned(torch.randn(6, 4), torch.randn(2, 4, 8))  # a 16-byte aligned pair is taken


def test_grouped_mm_gradcheck():
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: grouped_mm(x, w, offs), (x, w))


def test_grouped_mm_on_meta_and_its_flops():
    n, k, m, g = 7, 5, 4, 3
    x = torch.empty(n, k, device="meta", requires_grad=True)
    w = torch.empty(g, k, m, device="meta", requires_grad=True)
    offs = torch.empty(g, dtype=torch.int32, device="meta")
    counter = FlopCounterMode(display=False)
    with counter:
        out = grouped_mm(x, w, offs)
        forward = counter.get_total_flops()
        out.backward(torch.empty_like(out))
    assert out.shape == (n, m) and out.device.type == "meta"
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert forward == 2 * n * k * m
    assert counter.get_total_flops() == 3 * 2 * n * k * m  # forward, dx, dw


def test_grouped_mm_errors_name_the_fix():
    offs = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="cast x to the weights' dtype"):
        grouped_mm(torch.randn(2, 3), torch.randn(1, 3, 4, dtype=torch.float64), offs)
    with pytest.raises(ValueError, match=r"x \[N, K\], w \[G, K, M\], offs \[G\]"):
        grouped_mm(torch.randn(2, 3), torch.randn(1, 5, 4), offs)


# ---- moe_experts ----

ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "relu": F.relu}


def _weights(e, h, i, mode, transposed, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = 2 * i if mode == "packed" else i
    shape_in, shape_out = ((e, f, h), (e, h, i)) if transposed else ((e, h, f), (e, i, h))
    w_in = torch.randn(*shape_in, generator=g, dtype=dtype) / math.sqrt(h)
    w_up = torch.randn(*shape_in, generator=g, dtype=dtype) / math.sqrt(h) if mode == "up" else None
    w_out = torch.randn(*shape_out, generator=g, dtype=dtype) / math.sqrt(i)
    return w_in, w_up, w_out


def _hf_loop(x, weights, ids, w_in, w_up, w_out, act, mode, transposed):
    """One token and one of its k experts at a time, as Hugging Face's eager experts module."""
    fn = ACTS[act]

    def lin(v, w):
        return v @ w.T if transposed else v @ w

    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            y = lin(x[t], w_in[e])
            if mode == "packed":
                gate, up = y.chunk(2, dim=-1)
                h = fn(gate) * up
            elif mode == "up":
                h = fn(y) * lin(x[t], w_up[e])
            else:
                h = fn(y)
            acc = acc + lin(h, w_out[e]) * weights[t, j]
        rows.append(acc)
    return torch.stack(rows) if rows else x * 0  # no tokens: [0, H]


@st.composite
def layers(draw):
    t, k, e = draw(st.integers(0, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 5))
    used = draw(st.lists(st.integers(0, e - 1), min_size=1, max_size=e, unique=True))
    ids = [[draw(st.sampled_from(used)) for _ in range(k)] for _ in range(t)]
    return dict(
        t=t, k=k, e=e, ids=torch.tensor(ids, dtype=torch.int64).reshape(t, k),
        h=draw(st.integers(1, 6)), i=draw(st.integers(1, 4)),
        act=draw(st.sampled_from(sorted(ACTS))), mode=draw(st.sampled_from(["packed", "up", "plain"])),
        transposed=draw(st.booleans()), seed=draw(st.integers(0, 1000)),
    )  # fmt: skip


def _operands(c, requires_grad=True):
    g = torch.Generator().manual_seed(c["seed"] + 1)
    x = torch.randn(c["t"], c["h"], generator=g, dtype=torch.float64)
    weights = torch.rand(c["t"], c["k"], generator=g, dtype=torch.float64)
    w_in, w_up, w_out = _weights(c["e"], c["h"], c["i"], c["mode"], c["transposed"], seed=c["seed"])
    leaves = [x, weights, w_in, w_up, w_out]
    return [t.requires_grad_(requires_grad) if t is not None else None for t in leaves]


def _call(c, x, weights, w_in, w_up, w_out, first=0):
    gated = c["mode"] != "plain"
    return moe_experts(
        x, weights, c["ids"], w_in, w_up, w_out, c["act"], gated, c["transposed"], c["e"], first
    )


@settings(max_examples=40)
@given(c=layers())
def test_moe_experts_equals_the_per_token_loop(c):
    x, weights, w_in, w_up, w_out = leaves = _operands(c)
    out = _call(c, *leaves)
    want = _hf_loop(x, weights, c["ids"], w_in, w_up, w_out, c["act"], c["mode"], c["transposed"])
    torch.testing.assert_close(out, want)
    live = [t for t in leaves if t is not None]
    grad = torch.randn_like(want)
    both = [
        torch.autograd.grad(y, live, grad, allow_unused=True, materialize_grads=True) for y in (out, want)
    ]
    for a, b in zip(*both):
        torch.testing.assert_close(a, b)


@settings(max_examples=20)
@given(c=layers(), cut=st.integers(0, 5))
def test_expert_slices_sum_to_the_whole_layer(c, cut):
    cut = min(cut, c["e"])
    x, weights, w_in, w_up, w_out = _operands(c, requires_grad=False)
    whole = _call(c, x, weights, w_in, w_up, w_out)

    def piece(lo, hi):
        return _call(c, x, weights, w_in[lo:hi], None if w_up is None else w_up[lo:hi], w_out[lo:hi], lo)

    parts = [piece(0, cut), piece(cut, c["e"])] if 0 < cut < c["e"] else [piece(0, c["e"])]
    torch.testing.assert_close(sum(parts), whole)


@pytest.mark.parametrize("mode", ["packed", "up", "plain"])
@pytest.mark.parametrize("transposed", [True, False])
def test_moe_experts_gradcheck(mode, transposed):
    c = dict(t=4, k=2, e=3, h=3, i=2, act="gelu_tanh", mode=mode, transposed=transposed, seed=3)
    c["ids"] = torch.tensor([[0, 2], [2, 2], [0, 0], [2, 0]])  # expert 1 gets no token
    leaves = _operands(c)
    live = [i for i, t in enumerate(leaves) if t is not None]

    def fn(*args):
        full = list(leaves)
        for i, a in zip(live, args):
            full[i] = a
        return _call(c, *full)

    assert torch.autograd.gradcheck(fn, [leaves[i] for i in live])


def test_moe_experts_equals_transformers_qwen3_experts():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=6, moe_intermediate_size=4, num_experts=5, num_experts_per_tok=2)
    experts = Qwen3MoeExperts(config).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(7, 6, dtype=torch.float64)
    ids = torch.tensor([[0, 3], [3, 4], [4, 0], [0, 3], [3, 0], [4, 3], [0, 4]])  # experts 1, 2: none
    weights = torch.rand(7, 2, dtype=torch.float64)
    want = experts(x, ids, weights)
    out = moe_experts(x, weights, ids, experts.gate_up_proj, None, experts.down_proj, "silu", True, True, 5)
    torch.testing.assert_close(out, want)


def test_moe_experts_on_meta_and_its_flops():
    t, k, e, h, i = 6, 2, 4, 8, 3
    x = torch.empty(t, h, device="meta", requires_grad=True)
    weights = torch.empty(t, k, device="meta")
    ids = torch.empty(t, k, dtype=torch.int64, device="meta")
    w_in = torch.empty(e, 2 * i, h, device="meta", requires_grad=True)
    w_out = torch.empty(e, h, i, device="meta", requires_grad=True)
    counter = FlopCounterMode(display=False)
    with counter:
        out = moe_experts(x, weights, ids, w_in, None, w_out, "silu", True, True, e)
    assert out.shape == (t, h) and out.device.type == "meta"
    pairs = t * k
    assert counter.get_total_flops() == 2 * pairs * h * (2 * i) + 2 * pairs * i * h
    out.backward(torch.empty_like(out))  # the pieces' backward runs on meta too
    assert [p.grad.shape for p in (x, w_in, w_out)] == [x.shape, w_in.shape, w_out.shape]


def test_moe_experts_output_dtype_is_x_and_matmuls_run_in_the_weights():
    c = dict(t=5, k=2, e=3, h=4, i=2, act="relu", mode="packed", transposed=True, seed=1)
    c["ids"] = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 0], [1, 1]])
    x, weights, w_in, w_up, w_out = _operands(c, requires_grad=False)
    out = _call(c, x.float(), weights, w_in, w_up, w_out)
    assert out.dtype == torch.float32
    want = _call(c, x.float().double(), weights, w_in, w_up, w_out).float()
    torch.testing.assert_close(out, want)


def test_moe_experts_errors_name_what_is_accepted():
    c = dict(t=2, k=1, e=2, h=4, i=2, act="silu", mode="packed", transposed=True, seed=0)
    c["ids"] = torch.tensor([[0], [1]])
    x, weights, w_in, w_up, w_out = _operands(c, requires_grad=False)
    with pytest.raises(ValueError, match="not one of silu, gelu, gelu_tanh, relu"):
        moe_experts(x, weights, c["ids"], w_in, None, w_out, "tanh", True, True, 2)
    with pytest.raises(ValueError, match=r"F = 2I"):
        moe_experts(x, weights, c["ids"], w_in[:, :3], None, w_out, "silu", True, True, 2)
    with pytest.raises(ValueError, match="not among the layer's 2"):
        moe_experts(x, weights, c["ids"], w_in, None, w_out, "silu", True, True, 2, 1)
    assert [a.value for a in Act] == ["silu", "gelu", "gelu_tanh", "relu"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grouped_mm_opcheck(dtype):
    """Schema, fake implementation against the real one (shapes, strides), autograd registration and
    AOT dispatch; float32 at aligned sizes takes ``torch._grouped_mm`` where it runs."""
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    x = torch.randn(12, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(3, 16, 32, dtype=dtype, requires_grad=True)
    torch.library.opcheck(grouped_mm, (x, w, offs))
    dy = torch.randn(12, 32, dtype=dtype)
    torch.library.opcheck(torch.ops.autopar.grouped_mm_weight_grad, (x.detach(), dy, offs, 3))
