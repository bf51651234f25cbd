"""The fused custom ops of ``autopar.kernels`` (norms, gated activations, RoPE) against the eager
patterns they replace (Hugging Face's forms), forward and backward, on both backends: Triton (run on
CPU tensors by Triton's interpreter, ``TRITON_INTERPRET=1`` from conftest) and the torch fallback.

fp32 is compared tightly against the fp32 eager pattern; bf16 against the fp32 pattern computed
from the same bf16 values, within bf16 tolerance. Upstream gradients are random for every output
(``h`` of the norms included). Also: the ops on the meta device, ``torch.library.opcheck``, and
that a CPU run never imports the Triton modules.
"""

from __future__ import annotations

import math
import os
import sys
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.kernels import ops as kernel_ops

kernel_ops.load()
OPS = torch.ops.autopar
BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16]
SETTINGS = settings(max_examples=6, deadline=None, derandomize=True)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

rows = st.integers(1, 9)
hidden = st.integers(2, 70)
seeds = st.integers(0, 2**16)


def randn(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def assert_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` within ``TOL[dtype]`` of ``want``, its atol in units of ``want``'s scale
    (``max(1, max|want|)``): an element summed over rows (a norm's weight gradient) or left by
    cancelling terms (a gated activation's gradient) carries the rounding of the largest terms, not
    of its own size. A wrong kernel (a row or column missed, a wrong term) is off by up to
    ``max|want|``: 50x the bf16 bound, 10^5x the fp32 one."""
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale)


def leaves(*ts):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in ts]


def check(backend, dtype, op, reference, inputs, wrt=None):
    """Run ``op`` on ``inputs`` under ``backend`` and ``reference`` on fp32 copies of them; compare
    the outputs (dtype: the reference's on the inputs themselves) and the gradients of the inputs
    ``wrt`` (indices; every tensor input by default), with random upstream gradients for every
    output."""
    mine = leaves(*inputs)
    ref = leaves(*[t.float() if t is not None else None for t in inputs])
    with mock.patch.dict(os.environ, {"AUTOPAR_KERNELS": backend}):
        outs = as_tuple(op(*mine))
    expected = as_tuple(reference(*ref))
    with torch.no_grad():
        dtypes = [e.dtype for e in as_tuple(reference(*inputs))]
    assert [o.dtype for o in outs] == dtypes
    ups = [randn(o.shape, o.dtype, 1000 + i).to(o.device) for i, o in enumerate(outs)]
    for o, e in zip(outs, expected, strict=True):
        assert o.shape == e.shape and o.is_contiguous()
        assert_near(o.float(), e, dtype)
    wrt = [i for i, t in enumerate(inputs) if t is not None] if wrt is None else wrt
    tensors = [mine[i] for i in wrt]
    with mock.patch.dict(os.environ, {"AUTOPAR_KERNELS": backend}):
        grads = torch.autograd.grad(outs, tensors, ups)
    ref_grads = torch.autograd.grad(expected, [ref[i] for i in wrt], [u.float() for u in ups])
    for t, g, e in zip(tensors, grads, ref_grads, strict=True):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert_near(g.float(), e, dtype)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


# ---------------------------------------------------------------------------------------- norms


def llama_rms_norm(x, residual, weight, eps, offset, out_dtype):
    """LlamaRMSNorm (offset 0: ``weight * n.to(dtype)``) or GemmaRMSNorm (offset 1), with the
    residual add in front."""
    h = x + residual if residual is not None else x
    hf = h.float()
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        y = n.to(h.dtype)
    elif offset == 0:
        y = weight * n.to(h.dtype)
    else:
        y = (n * (offset + weight.float())).type_as(h)
    return y.to(out_dtype), h


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(lead=st.lists(rows, min_size=1, max_size=2).filter(lambda s: math.prod(s) <= 9), n=hidden,
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans()), offset=st.sampled_from([0.0, 1.0]),
       seed=seeds)  # fmt: skip
def test_rms_norm(backend, dtype, lead, n, flags, offset, seed):
    has_res, has_w, w_fp32 = flags
    shape = (*lead, n)
    x = randn(shape, dtype, seed)
    res = randn(shape, dtype, seed + 1) if has_res else None
    w = randn((n,), torch.float32 if w_fp32 else dtype, seed + 2) if has_w else None

    def reference(x, res, w):  # the op's dtype: promote_types(x, weight)
        out_dtype = torch.promote_types(x.dtype, w.dtype) if w is not None else x.dtype
        return llama_rms_norm(x, res, w, 1e-6, offset, out_dtype)

    check(backend, dtype, lambda x, r, w: OPS.rms_norm(x, r, w, 1e-6, offset), reference, [x, res, w])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(lead=st.lists(rows, min_size=1, max_size=2).filter(lambda s: math.prod(s) <= 9), n=hidden,
       flags=st.tuples(st.booleans(), st.booleans(), st.booleans()), seed=seeds)  # fmt: skip
def test_layer_norm(backend, dtype, lead, n, flags, seed):
    has_res, has_w, has_b = flags
    shape = (*lead, n)
    x = randn(shape, dtype, seed, scale=3.0) + 1.0  # a mean away from 0
    res = randn(shape, dtype, seed + 1) if has_res else None
    w = randn((n,), dtype, seed + 2) if has_w else None
    b = randn((n,), dtype, seed + 3) if has_b else None

    def reference(x, res, w, b):  # nn.LayerNorm after the residual add
        h = x + res if res is not None else x
        return F.layer_norm(h, (n,), w, b, 1e-5), h

    check(backend, dtype, lambda x, r, w, b: OPS.layer_norm(x, r, w, b, 1e-5), reference, [x, res, w, b])


@pytest.mark.parametrize("shape", [(1, 1), (1, 70), (37, 100), (130, 33)], ids=str)
@pytest.mark.parametrize("kind", ["rms", "rms_gemma", "ln", "ln_bias_only", "ln_weight_only"])
def test_norm_backward_many_rows(kind, shape):
    """More rows than the hypothesis cases: the dw/db reduction's several row groups, tiles per group
    and column blocks (masked in both dims) on the Triton path, bf16 with an fp32 weight for Gemma."""
    rows_, n = shape
    dtype = torch.bfloat16
    x, res = randn(shape, dtype, 1, scale=2.0) + 0.5, randn(shape, dtype, 2)
    if kind.startswith("rms"):
        offset = 1.0 if kind == "rms_gemma" else 0.0
        w = randn((n,), torch.float32 if offset else dtype, 3)

        def reference(x, r, w):
            return llama_rms_norm(x, r, w, 1e-6, offset, torch.promote_types(x.dtype, w.dtype))

        check("triton", dtype, lambda x, r, w: OPS.rms_norm(x, r, w, 1e-6, offset), reference, [x, res, w])
    else:
        w = randn((n,), dtype, 3) if kind != "ln_bias_only" else None
        b = randn((n,), dtype, 4) if kind != "ln_weight_only" else None

        def reference(x, r, w, b):
            h = x + r
            return F.layer_norm(h, (n,), w, b, 1e-5), h

        check("triton", dtype, lambda x, r, w, b: OPS.layer_norm(x, r, w, b, 1e-5), reference, [x, res, w, b])


# ---------------------------------------------------------------------------------- activations


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
       act=st.sampled_from(["silu", "none", "tanh"]), seed=seeds)  # fmt: skip
def test_gated_activations(backend, dtype, shape, act, seed):
    gate, up = randn(shape, dtype, seed, scale=3.0), randn(shape, dtype, seed + 1)
    if act == "silu":  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
        op, reference = OPS.swiglu, lambda g, u: F.silu(g) * u
    else:  # GELU-gated MLPs (Gemma: gelu_pytorch_tanh)
        op = lambda g, u: OPS.geglu(g, u, act)  # noqa: E731
        reference = lambda g, u: F.gelu(g, approximate=act) * u  # noqa: E731
    check(backend, dtype, op, reference, [gate, up])


# ------------------------------------------------------------------------------------------ rope


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):  # Hugging Face's apply_rotary_pos_emb for one of q, k
    return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@SETTINGS
@given(b=st.integers(1, 2), s=st.integers(1, 4), heads=st.integers(1, 3),
       d=st.integers(1, 35).map(lambda k: 2 * k), flags=st.tuples(st.booleans(), st.booleans()),
       seed=seeds)  # fmt: skip
def test_rope(backend, dtype, b, s, heads, d, flags, seed):
    transposed, batch_cos = flags
    if transposed:  # [B, S, H, D] -> [B, H, S, D], not contiguous
        x = randn((b, s, heads, d), dtype, seed).transpose(1, 2)
    else:
        x = randn((b, heads, s, d), dtype, seed)
    cs = (b if batch_cos else 1, 1, s, d)
    # halves unequal (HF's are cat(freqs, freqs)): each half of cos/sin must be read where it belongs
    cos, sin = randn(cs, dtype, seed + 1), randn(cs, dtype, seed + 2)
    check(backend, dtype, OPS.rope, apply_rotary, [x, cos, sin], wrt=[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_strided_and_promoted(backend):
    """A transposed bf16 ``x`` with fp32 cos/sin broadcast over batch and heads; 3-d and 5-d ``x``."""
    x = randn((2, 5, 3, 8), torch.bfloat16, 0).transpose(1, 2)
    cos, sin = randn((1, 1, 5, 8), torch.float32, 1), randn((1, 1, 5, 8), torch.float32, 2)
    with mock.patch.dict(os.environ, {"AUTOPAR_KERNELS": backend}):
        out = OPS.rope(x, cos, sin)
    assert out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out, apply_rotary(x.float(), cos, sin), **TOL[torch.bfloat16])
    x3 = randn((4, 3, 6), torch.float32, 3).transpose(0, 1)
    x5 = randn((2, 2, 3, 4, 6), torch.float32, 4).transpose(1, 3)
    for x, cs in [(x3, (4, 6)), (x5, (4, 1, 1, 6))]:
        cos, sin = randn(cs, torch.float32, 5), randn(cs, torch.float32, 6)
        check(backend, torch.float32, OPS.rope, apply_rotary, [x, cos, sin], wrt=[0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d", [6, 130, 128], ids=lambda d: f"d{d}")
def test_rope_tiles(backend, d):
    """Several programs of several rows each, the last one partial (rows masked), half-columns
    masked where ``D / 2`` is no power of two; ``x`` transposed, bf16, fp32 cos/sin broadcast over
    heads; and ``x`` contiguous with cos/sin of one batch."""
    b, s, h = 2, 37, 3
    x = randn((b, s, h, d), torch.bfloat16, 7).transpose(1, 2)
    cos, sin = randn((b, 1, s, d), torch.float32, 8), randn((b, 1, s, d), torch.float32, 9)
    check(backend, torch.bfloat16, OPS.rope, apply_rotary, [x, cos, sin], wrt=[0])
    x = randn((b, h, s, d), torch.float32, 10)
    cos, sin = randn((1, 1, s, d), torch.float32, 11), randn((1, 1, s, d), torch.float32, 12)
    check(backend, torch.float32, OPS.rope, apply_rotary, [x, cos, sin], wrt=[0])


# --------------------------------------------------------------------------- meta, opcheck, lazy


def _cases(device="cpu"):
    """(name, op, args) of every op with small inputs: the ones opcheck and the meta test run."""
    r = lambda *s, dt=torch.float32: torch.randn(*s, dtype=dt, device=device)  # noqa: E731
    x = r(3, 4, 10)
    return [
        ("rms_norm", OPS.rms_norm, (x, r(3, 4, 10), r(10), 1e-6, 0.0)),
        ("rms_norm_plain", OPS.rms_norm, (x, None, None, 1e-6, 1.0)),
        ("rms_norm_bf16_fp32w", OPS.rms_norm, (r(2, 6, dt=torch.bfloat16), None, r(6), 1e-6, 1.0)),
        ("layer_norm", OPS.layer_norm, (x, r(3, 4, 10), r(10), r(10), 1e-5)),
        ("layer_norm_plain", OPS.layer_norm, (x, None, None, None, 1e-5)),
        ("swiglu", OPS.swiglu, (r(3, 10), r(3, 10))),
        ("geglu", OPS.geglu, (r(3, 10), r(3, 10), "tanh")),
        ("rope", OPS.rope, (r(2, 4, 3, 8).transpose(1, 2), r(1, 1, 4, 8), r(2, 1, 4, 8))),
    ]


def _leaf(a):
    return a.requires_grad_() if isinstance(a, torch.Tensor) else a


def _run(op, args):
    """Outputs and the input gradients (None for cos/sin of rope) of ``op`` on ``args``."""
    args = [_leaf(a) for a in args]
    outs = as_tuple(op(*args))
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    grads = torch.autograd.grad(outs, tensors, [torch.ones_like(o) for o in outs], allow_unused=True)
    return outs, grads


@pytest.mark.parametrize("case", _cases("meta"), ids=lambda c: c[0])
def test_meta_forward_and_backward(case):
    """The fake implementations: forward and backward on meta tensors give the shapes, dtypes and
    strides of the CPU run."""
    name, op, meta_args = case
    outs, grads = _run(op, meta_args)
    with mock.patch.dict(os.environ, {"AUTOPAR_KERNELS": "torch"}):
        cpu_outs, cpu_grads = _run(op, {n: a for n, _, a in _cases()}[name])
    assert [g is None for g in grads] == [g is None for g in cpu_grads]
    tensors = sum(isinstance(a, torch.Tensor) for a in meta_args)
    assert sum(g is not None for g in grads) == (1 if name == "rope" else tensors)  # none for cos/sin
    for m, c in zip([*outs, *grads], [*cpu_outs, *cpu_grads], strict=True):
        if c is not None:
            assert m.device.type == "meta"
            assert (m.shape, m.dtype, m.stride()) == (c.shape, c.dtype, c.stride())


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_opcheck(case):
    """Schema, fake implementation, autograd registration and AOT dispatch, on the fallback."""
    _, op, args = case
    with mock.patch.dict(os.environ, {"AUTOPAR_KERNELS": "torch"}):
        torch.library.opcheck(op, [_leaf(a) for a in args])


def test_cpu_runs_never_import_triton_modules(monkeypatch):
    """On CPU tensors the default backend (and ``torch``) never imports ``kernels/_triton_*``: an
    import of one would fail here."""
    for name in ("norms", "activations", "rope"):
        monkeypatch.setitem(sys.modules, f"autopar.kernels._triton_{name}", None)
    for backend in ("auto", "torch"):
        monkeypatch.setenv("AUTOPAR_KERNELS", backend)
        for _, op, args in _cases():
            _run(op, args)
    monkeypatch.setenv("AUTOPAR_KERNELS", "triton")
    with pytest.raises(ImportError):  # the check can fail: the Triton path does import them
        _run(OPS.swiglu, [torch.ones(2), torch.ones(2)])


def test_load_registers_every_op():
    for name in ("rms_norm", "layer_norm", "swiglu", "geglu", "rope"):
        for suffix in ("", "_backward"):
            assert hasattr(OPS, name + suffix), name + suffix


# ------------------------------------------------------------------------------- compiled, on GPU


def _gpu_cases():
    """Model-sized shapes: non-power-of-2 rows, many programs in the weight-gradient reduction."""
    bf = torch.bfloat16
    r = lambda *s, dt=bf: torch.randn(*s, dtype=dt, device="cuda")  # noqa: E731
    return [
        ("rms_norm", lambda x, res, w: OPS.rms_norm(x, res, w, 1e-6, 0.0), (r(2, 300, 4096), r(2, 300, 4096), r(4096))),
        ("rms_norm_gemma", lambda x, w: OPS.rms_norm(x, None, w, 1e-6, 1.0), (r(1000, 3000), r(3000, dt=torch.float32))),
        ("layer_norm", lambda x, res, w, b: OPS.layer_norm(x, res, w, b, 1e-5), (r(600, 1000), r(600, 1000), r(1000), r(1000))),
        ("swiglu", OPS.swiglu, (r(4, 100, 11008), r(4, 100, 11008))),
        ("geglu", lambda g, u: OPS.geglu(g, u, "none"), (r(1000, 3000), r(1000, 3000))),
        ("geglu_tanh", lambda g, u: OPS.geglu(g, u, "tanh"), (r(1000, 3000, dt=torch.float32), r(1000, 3000))),
        ("rope", OPS.rope, (r(2, 512, 16, 128).transpose(1, 2), r(1, 1, 512, 128), r(2, 1, 512, 128))),
    ]  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("index", range(7))
def test_cuda_compiled_triton_matches_fallback(index):
    """The compiled kernels against the torch fallback on the same CUDA tensors (the fallback is held
    to the eager patterns above): outputs and every gradient, bf16 tolerance."""
    torch.manual_seed(index)
    name, op, args = _gpu_cases()[index]
    wrt = [0] if name == "rope" else list(range(len(args)))
    results = {}
    for backend in ("triton", "torch"):
        leaves_ = [a.detach().clone().requires_grad_(i in wrt) for i, a in enumerate(args)]
        with mock.patch.dict(os.environ, {"AUTOPAR_KERNELS": backend}):
            outs = as_tuple(op(*leaves_))
            torch.manual_seed(1)
            ups = [torch.randn_like(o) for o in outs]
            grads = torch.autograd.grad(outs, [leaves_[i] for i in wrt], ups)
        results[backend] = [*outs, *grads]
    for t, f in zip(results["triton"], results["torch"], strict=True):
        assert t.dtype == f.dtype and t.shape == f.shape
        assert_near(t.float(), f.float(), torch.bfloat16)
