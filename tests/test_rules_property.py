"""Property tests: every strategy the rules + ``expand`` give an op is numerically correct.

For random shapes (including sizes that do not divide the mesh) and small meshes of 1 to 3 axes,
each case builds a one-node FX graph, enumerates ALL strategies ``strategies.expand`` produces and
checks each with ``autopar.tools.validate.check_strategy`` (all ranks simulated in one process, forward
and backward, through the real lowering). Strategies that would shard a dim unevenly must not be
produced at all. Rules this suite once caught wrong have their own regression tests.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from rules_check import SETTINGS, assert_rules_hold, randn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from autopar.passes import rules
from autopar.passes.rules import AxisOption
from autopar.tools.validate import check_node, one_node_graph

aten = torch.ops.aten

MESHES = [(1,), (2,), (3,), (2, 2), (2, 1, 2), (1, 3)]
SIZES = [1, 2, 3, 4, 6]
meshes = st.sampled_from(MESHES)
sizes = st.sampled_from(SIZES)


def shapes(min_dims=1, max_dims=3):
    return st.lists(sizes, min_size=min_dims, max_size=max_dims).map(tuple)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------------
# elementwise with broadcasting
# --------------------------------------------------------------------------------------------------

BINARY = [
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.maximum.default,
    aten.eq.Tensor,
    aten.pow.Tensor_Tensor,
]
UNARY = [
    aten.gelu.default,
    aten.exp.default,
    aten.tanh.default,
    aten.silu.default,
    aten.rsqrt.default,
    aten.neg.default,
    aten.clone.default,
    aten.relu.default,
]


@st.composite
def broadcast_pair(draw):
    out = draw(shapes(1, 3))
    k = draw(st.integers(0, len(out)))
    other = tuple(1 if draw(st.booleans()) else s for s in out[len(out) - k :])
    return (out, other) if draw(st.booleans()) else (other, out)


@SETTINGS
@given(op=st.sampled_from(BINARY), pair=broadcast_pair(), mesh=meshes, alpha=st.sampled_from([None, 2]))
def test_binary_broadcast(op, pair, mesh, alpha):
    a, b = pair
    positive = op in (aten.div.Tensor, aten.pow.Tensor_Tensor)
    kwargs = {"alpha": alpha} if alpha and op in (aten.add.Tensor, aten.sub.Tensor) else None
    assert_rules_hold(op, (randn(a, 1, positive), randn(b, 2, positive)), kwargs, mesh)


@SETTINGS
@given(op=st.sampled_from(UNARY), shape=shapes(), mesh=meshes)
def test_unary(op, shape, mesh):
    assert_rules_hold(op, (randn(shape, positive=op is aten.rsqrt.default),), None, mesh)


@SETTINGS
@given(
    op=st.sampled_from([aten.mul.Tensor, aten.div.Tensor, aten.mul.Scalar, aten.div.Scalar]),
    shape=shapes(),
    mesh=meshes,
)
def test_scalar_mul_div(op, shape, mesh):
    assert_rules_hold(op, (randn(shape), 3.0), None, mesh)


@st.composite
def suffix_broadcast(draw, out):
    """A shape that broadcasts to ``out``: a suffix of it with some dims set to 1."""
    k = draw(st.integers(0, len(out)))
    return tuple(1 if draw(st.booleans()) else s for s in out[len(out) - k :])


@SETTINGS
@given(shape=shapes(1, 3), mesh=meshes, data=st.data())
def test_where_and_masked_fill(shape, mesh, data):
    mask = randn(data.draw(suffix_broadcast(shape)), 3) > 0
    assert_rules_hold(aten.masked_fill.Scalar, (randn(shape, 4), mask, -1.5), None, mesh)
    cond = randn(data.draw(suffix_broadcast(shape)), 5) > 0
    other = randn(data.draw(suffix_broadcast(shape)), 6)
    x, y = (randn(shape, 7), other) if data.draw(st.booleans()) else (other, randn(shape, 7))
    assert_rules_hold(aten.where.self, (cond, x, y), None, mesh)


@SETTINGS
@given(op=st.sampled_from([aten.add.Tensor, aten.sub.Tensor]), shape=shapes(), mesh=meshes)
def test_add_scalar_is_not_partial(op, shape, mesh):
    assert_rules_hold(op, (randn(shape), 1.0), None, mesh if mesh[0] > 1 else (2,))


# --------------------------------------------------------------------------------------------------
# matmul family
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(batch=shapes(0, 2), k=sizes, n=sizes, bias=st.booleans(), mesh=meshes)
def test_linear(batch, k, n, bias, mesh):
    args = (randn(batch + (k,), 1), randn((n, k), 2)) + ((randn((n,), 3),) if bias else ())
    assert_rules_hold(aten.linear.default, args, None, mesh)


@SETTINGS
@given(m=sizes, k=sizes, n=sizes, bias_kind=st.sampled_from(["n", "mn", "1n", "m1"]), mesh=meshes)
def test_addmm(m, k, n, bias_kind, mesh):
    bias_shape = {"n": (n,), "mn": (m, n), "1n": (1, n), "m1": (m, 1)}[bias_kind]
    args = (randn(bias_shape, 1), randn((m, k), 2), randn((k, n), 3))
    assert_rules_hold(aten.addmm.default, args, None, mesh)


@SETTINGS
@given(b=sizes, m=sizes, k=sizes, n=sizes, mesh=meshes, batched=st.booleans())
def test_mm_bmm(b, m, k, n, mesh, batched):
    if batched:
        assert_rules_hold(aten.bmm.default, (randn((b, m, k), 1), randn((b, k, n), 2)), None, mesh)
    else:
        assert_rules_hold(aten.mm.default, (randn((m, k), 1), randn((k, n), 2)), None, mesh)


# --------------------------------------------------------------------------------------------------
# embedding, layer_norm, softmax
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(v=sizes, h=sizes, ids=shapes(1, 2), mesh=meshes, pad=st.booleans())
def test_embedding(v, h, ids, mesh, pad):
    idx = torch.randint(0, v, ids, generator=_gen(7))
    args = (randn((v, h)), idx) + ((0,) if pad else ())
    assert_rules_hold(aten.embedding.default, args, None, mesh)


@SETTINGS
@given(
    shape=shapes(2, 3), k=st.integers(1, 2), affine=st.sampled_from(["none", "weight", "both"]), mesh=meshes
)
def test_layer_norm(shape, k, affine, mesh):
    k = min(k, len(shape) - 1)
    norm = list(shape[-k:])
    w = randn(norm, 1) if affine != "none" else None
    b = randn(norm, 2) if affine == "both" else None
    assert_rules_hold(aten.layer_norm.default, (randn(shape), norm, w, b, 1e-5), None, mesh)


@SETTINGS
@given(
    shape=shapes(2, 4), mode=st.sampled_from(["running", "batch", "eval"]), affine=st.booleans(), mesh=meshes
)
def test_batch_norm(shape, mode, affine, mesh):
    """Split batch (or any non-channel dim): training normalizes with the whole batch's statistics,
    all-reduced inside the lowering (SyncBatchNorm); channels split where no running statistics are
    updated. Running statistics are updated in place by every rank alike, and the backward with
    them runs in the data-parallel CNN of test_data_role.py."""
    c = shape[1]
    w, b = (randn((c,), 1), randn((c,), 2)) if affine else (None, None)
    stats = (randn((c,), 3), randn((c,), 4, positive=True)) if mode != "batch" else (None, None)
    args = (randn(shape, 0, positive=mode == "eval"), w, b, *stats, mode != "eval", 0.1, 1e-5, False)
    # the validator would make running statistics require gradients: backward where there are none
    assert_rules_hold(aten.batch_norm.default, args, None, mesh, backward=mode == "batch")


@SETTINGS
@given(
    op=st.sampled_from(["softmax", "_softmax", "log_softmax", "_log_softmax"]),
    shape=shapes(1, 3),
    mesh=meshes,
    data=st.data(),
)
def test_softmax(op, shape, mesh, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    target = getattr(aten, op)
    args = (randn(shape), dim) + ((False,) if op.startswith("_") else ())
    target = target.default if op.startswith("_") else target.int
    assert_rules_hold(target, args, None, mesh)


# --------------------------------------------------------------------------------------------------
# attention
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(
    b=sizes,
    hkv=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 3]),
    lq=st.sampled_from([1, 2, 4]),
    lk=st.sampled_from([2, 4]),
    e=st.sampled_from([2, 4]),
    mask=st.sampled_from(["none", "causal", "bool_ls", "float_b1ls", "float_1hls"]),
    mesh=meshes,
)
def test_sdpa(b, hkv, group, lq, lk, e, mask, mesh):
    hq = hkv * group
    q, k, v = randn((b, hq, lq, e), 1), randn((b, hkv, lk, e), 2), randn((b, hkv, lk, e), 3)
    gqa = hq != hkv
    attn_mask, causal = None, False
    if mask == "causal":
        causal = True
    elif mask == "bool_ls":
        attn_mask = randn((lq, lk), 4) > 0
        attn_mask[:, 0] = True  # no fully masked row
    elif mask == "float_b1ls":
        attn_mask = randn((b, 1, lq, lk), 4)
    elif mask == "float_1hls":
        attn_mask = randn((1, hq, lq, lk), 4)
    args = (q, k, v, attn_mask, 0.0, causal)
    kwargs = {"enable_gqa": gqa}
    strategies = assert_rules_hold(aten.scaled_dot_product_attention.default, args, kwargs, mesh)
    if hkv == 1 and mesh == (2,) and hq % 2 == 0:  # multi-query: heads split, the single K/V head replicated
        assert any(str(s.out[0]) == "S(1)" and str(s.ins[1][0]) == "R" for s in strategies)


@SETTINGS
@given(
    hkv=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2]),
    seq=st.sampled_from([4, 6, 12]),
    mask=st.sampled_from(["causal", "none", "bool_ls", "float_b1ls", "float_b11s", "float_1hls"]),
    mesh=st.sampled_from([(2,), (3,), (4,), (2, 2)]),
    chunked=st.booleans(),
)
def test_sdpa_sequence_split_ring_and_all_to_all(hkv, group, seq, mask, mesh, chunked):
    """Queries, keys and values all split on the sequence: the ring (K/V blocks passed around the
    axis, online softmax, forward and backward run by the real ring code in one thread per rank;
    ``chunked``: a block's query rows taken two at a time, as long sequences are) and the
    all-to-all (heads for sequence) compute the dense attention, with grouped and single K/V heads
    and every mask kind; all-to-all is offered only where the heads divide the axis."""
    from unittest import mock

    from autopar.codegen import context_parallel
    from autopar.placement import SeqAttention

    hq = hkv * group
    q, k, v = randn((2, hq, seq, 4), 1), randn((2, hkv, seq, 4), 2), randn((2, hkv, seq, 4), 3)
    attn_mask, causal = None, mask == "causal"
    if mask == "bool_ls":
        attn_mask = randn((seq, seq), 4) > 0
        attn_mask[:, 0] = True
    elif mask == "float_b1ls":
        attn_mask = randn((2, 1, seq, seq), 4)
    elif mask == "float_b11s":  # a padding mask: the same for every query row
        attn_mask = randn((2, 1, 1, seq), 4)
    elif mask == "float_1hls":
        attn_mask = randn((1, hq, seq, seq), 4)
    args = (q, k, v, attn_mask, 0.0, causal)
    budget = 2 * 2 * hq * seq * 4 if chunked else context_parallel.SCORE_BYTES  # two rows per chunk
    with mock.patch.object(context_parallel, "SCORE_BYTES", budget):
        strategies = assert_rules_hold(
            aten.scaled_dot_product_attention.default, args, {"enable_gqa": hq != hkv}, mesh
        )
    n = mesh[-1]
    vias = {v for s in strategies for v in s.via if v is not None and seq % n == 0}
    if seq % n == 0:
        assert SeqAttention.RING in vias
    heads_divide = hq % n == 0 and (hkv == 1 or hkv % n == 0)
    head_free_mask = attn_mask is None or attn_mask.dim() < 3 or attn_mask.shape[-3] == 1
    if seq % n == 0 and mesh == (n,):
        assert (SeqAttention.ALL_TO_ALL in vias) == (heads_divide and head_free_mask)


@SETTINGS
@given(b=sizes, s=st.sampled_from([2, 4]), e=st.sampled_from([2, 4]))
def test_sdpa_3d_never_shards_sequence(b, s, e):
    args = (randn((b, s, e), 1), randn((b, s, e), 2), randn((b, s, e), 3))
    assert_rules_hold(aten.scaled_dot_product_attention.default, args, None, (2,))


# --------------------------------------------------------------------------------------------------
# reductions
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(
    op=st.sampled_from(["sum_dim", "mean_dim", "sum", "mean"]),
    shape=shapes(1, 3),
    keepdim=st.booleans(),
    mesh=meshes,
    data=st.data(),
)
def test_reductions(op, shape, keepdim, mesh, data):
    x = randn(shape)
    if op in ("sum", "mean"):
        assert_rules_hold(aten.sum.default if op == "sum" else aten.mean.default, (x,), None, mesh)
        return
    dims = data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    dims = [d - len(shape) if data.draw(st.booleans()) else d for d in dims]  # some negative
    target = aten.sum.dim_IntList if op == "sum_dim" else aten.mean.dim
    assert_rules_hold(target, (x, dims, keepdim), None, mesh)


# --------------------------------------------------------------------------------------------------
# views
# --------------------------------------------------------------------------------------------------

_FACTORS = {4: [(2, 2)], 6: [(2, 3), (3, 2)]}


@st.composite
def reshape_pair(draw):
    """(src, dst): dst splits composite dims of src, merges neighbours, and adds/drops size-1 dims."""
    src = draw(shapes(1, 3))
    dst: list[int] = []
    i = 0
    while i < len(src):
        action = draw(st.sampled_from(["keep", "split", "merge", "one"]))
        if action == "split" and src[i] in _FACTORS:
            dst.extend(draw(st.sampled_from(_FACTORS[src[i]])))
        elif action == "merge" and i + 1 < len(src):
            dst.append(src[i] * src[i + 1])
            i += 1
        elif action == "one":
            dst.extend([1, src[i]])
        else:
            dst.append(src[i])
        i += 1
    return src, tuple(dst)


@SETTINGS
@given(
    op=st.sampled_from([aten.view.default, aten.reshape.default, aten._unsafe_view.default]),
    pair=reshape_pair(),
    minus_one=st.booleans(),
    mesh=meshes,
)
def test_view_reshape(op, pair, minus_one, mesh):
    src, dst = pair
    size = list(dst)
    if minus_one:
        size[0] = -1
    assert_rules_hold(op, (randn(src), size), None, mesh)


@SETTINGS
@given(shape=shapes(1, 3), mesh=meshes, data=st.data())
def test_transpose_permute_t(shape, mesh, data):
    x = randn(shape)
    nd = len(shape)
    d0, d1 = data.draw(st.integers(-nd, nd - 1)), data.draw(st.integers(-nd, nd - 1))
    assert_rules_hold(aten.transpose.int, (x, d0, d1), None, mesh)
    perm = data.draw(st.permutations(range(nd)))
    assert_rules_hold(aten.permute.default, (x, list(perm)), None, mesh)
    if nd == 2:
        assert_rules_hold(aten.t.default, (x,), None, mesh)


@SETTINGS
@given(shape=shapes(1, 3), mesh=meshes, data=st.data())
def test_unsqueeze_expand(shape, mesh, data):
    nd = len(shape)
    u = data.draw(st.integers(-nd - 1, nd))
    assert_rules_hold(aten.unsqueeze.default, (randn(shape), u), None, mesh)
    src = tuple(1 if data.draw(st.booleans()) else s for s in shape)
    lead = data.draw(st.lists(sizes, max_size=1))
    size = lead + [s if s2 == 1 else (-1 if data.draw(st.booleans()) else s) for s, s2 in zip(shape, src)]
    assert_rules_hold(aten.expand.default, (randn(src), size), None, mesh)


@SETTINGS
@given(shape=shapes(1, 3), mesh=meshes, data=st.data())
def test_squeeze_size_one_dims(shape, mesh, data):
    """squeeze.dim of a genuine size-1 dim (never sharded, so it stays size 1 on every rank)."""
    x = randn(shape).unsqueeze(1)
    assert_rules_hold(aten.squeeze.dim, (x, 1), None, mesh)


@SETTINGS
@given(rest=shapes(1, 2), op=st.sampled_from(["default", "dims"]))
def test_squeeze_of_mesh_sized_dim(rest, op):
    x = randn((2, 1) + rest)
    args = (x,) if op == "default" else (x, [0, 1])
    assert_rules_hold(getattr(aten.squeeze, op), args, None, (2,))


# --------------------------------------------------------------------------------------------------
# slice / split / cat
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(shape=shapes(1, 3), mesh=meshes, data=st.data())
def test_slice_select_split(shape, mesh, data):
    x = randn(shape)
    nd = len(shape)
    dim = data.draw(st.integers(-nd, nd - 1))
    size = shape[dim]
    start = data.draw(st.integers(0, size - 1))
    end = data.draw(st.integers(start + 1, size))
    step = data.draw(st.sampled_from([1, 2]))
    assert_rules_hold(aten.slice.Tensor, (x, dim, start, end, step), None, mesh)
    assert_rules_hold(aten.select.int, (x, dim, start), None, mesh)
    assert_rules_hold(aten.split.Tensor, (x, data.draw(st.integers(1, size)), dim), None, mesh)
    assert_rules_hold(aten.chunk.default, (x, data.draw(st.integers(1, 3)), dim), None, mesh)


@SETTINGS
@given(shape=shapes(1, 3), mesh=meshes, data=st.data())
def test_split_with_sizes(shape, mesh, data):
    x = randn(shape)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    cut = data.draw(st.integers(0, shape[dim]))
    assert_rules_hold(aten.split_with_sizes.default, (x, [cut, shape[dim] - cut], dim), None, mesh)


@SETTINGS
@given(shape=shapes(1, 3), n_in=st.integers(1, 3), mesh=meshes, data=st.data())
def test_cat(shape, n_in, mesh, data):
    nd = len(shape)
    dim = data.draw(st.integers(-nd, nd - 1))
    parts = []
    for i in range(n_in):
        s = list(shape)
        s[dim] = data.draw(sizes)
        parts.append(randn(tuple(s), i))
    assert_rules_hold(aten.cat.default, (parts, dim), None, mesh)


# --------------------------------------------------------------------------------------------------
# cross entropy
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(
    n=sizes,
    c=st.sampled_from([2, 3, 5]),
    extra=shapes(0, 1),
    reduction=st.sampled_from([0, 1, 2]),
    mesh=meshes,
)
def test_cross_entropy(n, c, extra, reduction, mesh):
    logits = randn((n, c) + extra)
    target = torch.randint(0, c, (n,) + extra, generator=_gen(9))
    target.view(-1)[0] = -100  # ignore_index present
    if target.numel() > 2:
        target.view(-1)[-1] = -100
    args = (logits, target, None, reduction, -100, 0.0)
    assert_rules_hold(aten.cross_entropy_loss.default, args, None, mesh)


# --------------------------------------------------------------------------------------------------
# the validator catches a wrong rule
# --------------------------------------------------------------------------------------------------


def _wrong_softmax_rule(ctx):
    """Deliberately wrong: allows Shard on the softmax dim."""
    return [AxisOption(Shard(d), (Shard(d),)) for d in range(len(ctx.out_shape))]


def test_validator_catches_wrong_rule(monkeypatch):
    from autopar.passes.trace import trace
    from autopar.tools.validate import validate_graph

    for op in (aten.softmax.int, aten._softmax.default):
        monkeypatch.setitem(rules.RULES, op, _wrong_softmax_rule)

    # one node
    node, values = one_node_graph(aten._softmax.default, (randn((4, 6)), -1, False))
    results = check_node(node, (2,), values)
    wrong = [r for r in results if not r.ok]
    assert [r.strategy for r in wrong] == ["S(1) <- S(1)"]
    assert wrong[0].forward_error > 1e-3

    # a traced model
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x * 2.0, dim=-1)

    x = randn((4, 6))
    problems = validate_graph(trace(M(), (x,)), (2,), (x,))
    bad = [p for p in problems if p.kind == "wrong"]
    assert bad and all("softmax" in p.op for p in bad)
    assert any(p.strategy == "S(1) <- S(1)" and p.error > 1e-3 for p in bad)


def test_registry_restored_after_monkeypatch():
    assert rules.RULES[aten._softmax.default] is rules.nn.softmax_rule
    assert rules.RULES[aten.softmax.int] is rules.nn.softmax_rule


# --------------------------------------------------------------------------------------------------
# matmul / einsum / gather / arg-reductions, vocabulary-parallel embedding, sequence-parallel attention
# --------------------------------------------------------------------------------------------------


@SETTINGS
@given(batch=shapes(0, 2), m=sizes, k=sizes, n=sizes, b_batched=st.booleans(), mesh=meshes)
def test_matmul(batch, m, k, n, b_batched, mesh):
    a = randn(batch + (m, k))
    b = randn((batch if b_batched else ()) + (k, n), 1)
    strategies = assert_rules_hold(aten.matmul.default, (a, b), None, mesh)
    if mesh == (2,) and k % 2 == 0:
        assert any(isinstance(s.out[0], Partial) for s in strategies)  # the contraction split exists


@SETTINGS
@given(
    eq=st.sampled_from(["bij,bjk->bik", "ij,jk->ik", "bsh,bth->bst", "ij->j", "bhqd,bhkd->bhqk", "ij,j->i"]),
    dims=st.lists(sizes, min_size=6, max_size=6),
    mesh=meshes,
)
def test_einsum(eq, dims, mesh):
    letters = sorted(set(eq.replace(",", "").replace("->", "")))
    size = dict(zip(letters, dims))
    terms = eq.split("->")[0].split(",")
    args = [randn(tuple(size[c] for c in t), i) for i, t in enumerate(terms)]
    assert_rules_hold(aten.einsum.default, (eq, args), None, mesh)


@SETTINGS
@given(shape=shapes(2, 3), data=st.data(), mesh=meshes)
def test_gather(shape, data, mesh):
    dim = data.draw(st.integers(0, len(shape) - 1))
    index = torch.randint(0, shape[dim], shape, generator=_gen(3))
    assert_rules_hold(aten.gather.default, (randn(shape), dim, index), None, mesh)


@SETTINGS
@given(shape=shapes(2, 3), data=st.data(), keepdim=st.booleans(), mesh=meshes)
def test_arg_reductions(shape, data, keepdim, mesh):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = randn(shape)
    for op in (aten.argmax.default, aten.argmin.default):
        assert_rules_hold(op, (x, dim, keepdim), None, mesh, backward=False)
    assert_rules_hold(aten.max.dim, (x, dim, keepdim), None, mesh)


def test_vocab_parallel_embedding_is_offered_and_correct():
    """Rows of the table cut over the axis: a masked local lookup, summed over ranks (Partial)."""
    table, ids = randn((8, 4)), torch.tensor([[0, 3, 4, 7], [5, 2, 6, 1]])
    for mesh in [(2,), (4,), (2, 2)]:
        strategies = assert_rules_hold(aten.embedding.default, (table, ids, 5), None, mesh)
        assert any(s.ins[0][0] == Shard(0) and isinstance(s.out[0], Partial) for s in strategies)


def test_sequence_parallel_causal_attention():
    """Query rows sharded, keys/values gathered: the causal mask must follow global positions."""
    q, k, v = randn((2, 2, 8, 4)), randn((2, 2, 8, 4), 1), randn((2, 2, 8, 4), 2)
    for mesh in [(2,), (4,), (2, 2)]:
        strategies = assert_rules_hold(
            aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": True}, mesh
        )
        assert any(s.ins[0][0] == Shard(2) and s.ins[1][0] == Replicate() for s in strategies)


@SETTINGS
@given(shape=shapes(1, 3), data=st.data(), mesh=meshes)
def test_scans_and_diff(shape, data, mesh):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = randn(shape)
    assert_rules_hold(aten.cumsum.default, (x, dim), None, mesh)
    if shape[dim] > 1:
        assert_rules_hold(aten.diff.default, (x, 1, dim), None, mesh)
        pre = randn(shape[: dim % len(shape)] + (1,) + shape[dim % len(shape) + 1 :], 4)
        assert_rules_hold(aten.diff.default, (x, 1, dim, pre), None, mesh)


@SETTINGS
@given(src=shapes(2, 3), b=sizes, q=sizes, mesh=meshes)
def test_advanced_index(src, b, q, mesh):
    """x[i0, i1] with broadcasting index tensors (Hugging Face mask bookkeeping), trailing dims kept."""
    x = randn(src)
    i0 = torch.randint(0, src[0], (b, 1), generator=_gen(5))
    i1 = torch.randint(0, src[1], (1, q), generator=_gen(6))
    assert_rules_hold(aten.index.Tensor, (x, [i0, i1]), None, mesh)
    assert_rules_hold(aten.index.Tensor, (x, [i0.view(-1)]), None, mesh)


@SETTINGS
@given(shape=shapes(1, 3), start=st.integers(-3, 3), step=st.sampled_from([1, 2, 3]), mesh=meshes)
def test_factories_make_local_pieces(shape, start, step, mesh):
    assert_rules_hold(aten.zeros.default, (list(shape),), {"dtype": torch.float32}, mesh, backward=False)
    assert_rules_hold(aten.full.default, (list(shape), 2.5), {"dtype": torch.float32}, mesh, backward=False)
    n = shape[0]
    assert_rules_hold(aten.arange.default, (n,), {"dtype": torch.int64}, mesh, backward=False)
    assert_rules_hold(aten.arange.start_step, (start, start + n * step, step), {"dtype": torch.int64}, mesh,
                      backward=False)  # fmt: skip


@SETTINGS
@given(src=shapes(1, 3), out=shapes(1, 3), mesh=meshes)
def test_new_factories(src, out, mesh):
    x = randn(src)
    for op, extra in (
        (aten.new_zeros.default, ()),
        (aten.new_ones.default, ()),
        (aten.new_full.default, (1.5,)),
    ):
        assert_rules_hold(op, (x, list(out)) + extra, None, mesh, backward=False)


@SETTINGS
@given(shape=shapes(2, 3), affine=st.booleans(), mesh=meshes)
def test_rms_norm(shape, affine, mesh):
    """torch.nn.RMSNorm exports as aten.rms_norm: shard any dim but the normalized one."""
    args = (randn(shape), [shape[-1]]) + ((randn((shape[-1],), 1),) if affine else ())
    strategies = assert_rules_hold(aten.rms_norm.default, args, {"eps": 1e-6}, mesh)
    assert all(not (isinstance(p, Shard) and p.dim == len(shape) - 1) for s in strategies for p in s.out)
