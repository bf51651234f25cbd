"""Experts: find each token-choice mixture-of-experts layer in the traced graph and make it one op.

A token-choice MoE layer, as Hugging Face's grouped-GEMM experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3, every family on ``transformers.integrations.moe``) and plain PyTorch write it, traces
to a region of a dozen aten ops that mix every token: the ids the router picked sorted, tokens
gathered in expert order, two or three grouped matmuls with per-expert offsets, the results
weighted and put back in token order. No op of that region has a sharding rule on a slice of the
tokens or of the experts. As one op, ``autopar::moe_experts`` (``kernels/moe.py``), it has:
tokens split (data parallel), experts split with tokens sent to their experts by all-to-all
(expert parallel), experts split with tokens whole (each rank's summand), all in
``passes/rules/experts.py``.

Recognized from the graph's structure only, never from module names (``fold_experts``):

1. ``sort(reshape(ids, [-1]))`` of integer router ids ``ids [T, k]``: its values ``sorted`` and
   its permutation ``perm``;
2. tokens ``index(x, [floor_divide(perm, k)])`` of ``x [T, H]``, cast or not;
3. offsets ``cumsum(histc(sorted as float, E, 0, E - 1))``;
4. grouped matmuls (``transformers.grouped_mm_fallback``, ``aten._grouped_mm``,
   ``autopar::grouped_mm``) taking those offsets, each weight a parameter ``[E, ...]`` or its
   ``transpose(-2, -1)`` (all alike), in one of three forms: packed gate and up
   (``chunk(2, -1)``, ``act(first) * second``), separate gate and up (``act(a) * b``), or
   ``act(up)``; then the down projection;
5. the weights ``index(reshape(weights, [-1]), [perm])`` multiplied in, the rows put back in token
   order (``index`` by the inverse permutation, from ``index_put_`` of an ``arange`` or ``argsort``
   of ``perm``), ``view(T, k, H)`` and ``sum(1)``, cast or not.

Every node of the match but its output must be read by the match alone; the op's output must have
the matched value's shape and dtype (its fake implementation is run). The op computes the same
values in the same order (``tests/test_experts_fold.py`` checks it on every family: outputs and
gradients of the whole model against the unfolded graph).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten

_CAST = (aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout)
_VIEW = (aten.reshape.default, aten.view.default)
_ACTS = {aten.silu.default: "silu", aten.relu.default: "relu", aten.gelu.default: "gelu"}


def _grouped_mm_targets() -> tuple:
    out = []
    for ns, name in (
        ("transformers", "grouped_mm_fallback"),
        ("aten", "_grouped_mm"),
        ("autopar", "grouped_mm"),
    ):
        packet = getattr(getattr(torch.ops, ns), name, None)
        if packet is not None:
            out.append(packet.default)
    return tuple(out)


@dataclass(frozen=True)
class ExpertsMatch:
    """One MoE layer found: the op's arguments and the nodes it replaces (``out``'s value)."""

    x: fx.Node
    weights: fx.Node
    ids: fx.Node
    w_in: fx.Node
    w_up: fx.Node | None
    w_out: fx.Node
    act: str
    gated: bool
    transposed: bool
    num_experts: int
    out: fx.Node
    absorbed: tuple[fx.Node, ...]


def _is(n, *targets) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in targets


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _users(n: fx.Node) -> list[fx.Node]:
    return list(n.users)


def _one_user(n: fx.Node, *targets) -> fx.Node | None:
    us = _users(n)
    return us[0] if len(us) == 1 and _is(us[0], *targets) else None


def _uncast(n, absorbed: list[fx.Node]):
    """``n`` without the casts before it (each absorbed)."""
    while _is(n, *_CAST):
        absorbed.append(n)
        n = n.args[0]
    return n


def _flat_of(n, absorbed: list[fx.Node]):
    """``t`` where ``n = reshape(t, [-1])`` of a 2-d ``t``, else None."""
    if not _is(n, *_VIEW) or list(n.args[1]) != [-1] or _val(n.args[0]) is None or _val(n.args[0]).dim() != 2:
        return None
    absorbed.append(n)
    return n.args[0]


def _getitems(n: fx.Node) -> dict[int, fx.Node]:
    return {u.args[1]: u for u in n.users if u.target is operator.getitem}


def _param(n, absorbed: list[fx.Node]) -> tuple[fx.Node, bool] | None:
    """The ``[E, ...]`` parameter a grouped matmul reads, and whether it reads it transposed."""
    if _is(n, aten.transpose.int) and sorted(int(d) % 3 for d in n.args[1:3]) == [1, 2]:
        absorbed.append(n)
        return n.args[0], True
    if isinstance(n, fx.Node) and n.op in ("placeholder", "get_attr"):
        return n, False
    return None


def _offsets_of(c: fx.Node, sorted_ids: fx.Node, absorbed: list[fx.Node]) -> int | None:
    """E where ``c = cumsum(histc(float(sorted_ids), E, 0, E - 1), 0)``, else None."""
    if not _is(c, aten.cumsum.default) or c.args[1] not in (0, -1):
        return None
    h = c.args[0]
    if not _is(h, aten.histc.default):
        return None
    bins, lo, hi = (list(h.args[1:]) + [100, 0, 0])[:3]
    if lo != 0 or hi != bins - 1:
        return None
    src = h.args[0]
    casts: list[fx.Node] = []
    if _uncast(src, casts) is not sorted_ids:
        return None
    absorbed.extend([c, h, *casts])
    return int(bins)


def _offsets(sorted_ids: fx.Node, absorbed: list[fx.Node]) -> tuple[fx.Node, int] | None:
    """The per-expert offsets made from ``sorted_ids`` and the number of experts, if any."""
    for u in sorted_ids.users:
        first = u
        casts: list[fx.Node] = []
        while _is(first, *_CAST) and len(first.users) == 1:
            casts.append(first)
            first = next(iter(first.users))
        if _is(first, aten.histc.default) and len(first.users) == 1:
            c = next(iter(first.users))
            found: list[fx.Node] = []
            experts = _offsets_of(c, sorted_ids, found)
            if experts is not None:
                absorbed.extend(found)
                return c, experts
    return None


def _grouped_mms(sorted_ids: fx.Node, absorbed: list[fx.Node]):
    """The grouped matmuls of the layer: ``[(mm, input, param, transposed)]``, its output's
    squeeze where it has one (None), and the number of experts; None where there are none.

    Two forms: a grouped-GEMM op taking per-expert offsets (the rows grouped by expert), or
    ``bmm(rows [N, 1, in], index(P, [sorted_ids]))``: each pair's expert weights gathered."""
    found = _offsets(sorted_ids, absorbed)
    if found is not None:
        offs, experts = found
        gmms = _grouped_mm_targets()
        mms = [
            u
            for u in offs.users
            if _is(u, *gmms) and (u.args[2:3] == (offs,) or u.kwargs.get("offs") is offs)
        ]
        if len(mms) != len(offs.users):
            return None
        out = []
        for mm in mms:
            p = _param(mm.args[1], absorbed)
            if p is None:
                return None
            out.append((mm, mm.args[0], p[0], p[1]))
        return out, experts, False
    out = []
    for g in sorted_ids.users:
        if not (_is(g, aten.index.Tensor) and list(g.args[1]) == [sorted_ids] and len(g.users) == 1):
            continue
        mm = next(iter(g.users))
        param = g.args[0]
        if not (_is(mm, aten.bmm.default) and mm.args[1] is g and param.op in ("placeholder", "get_attr")):
            return None
        absorbed.append(g)
        out.append((mm, mm.args[0], param, False))
    if not out:
        return None
    return out, _val(out[0][2]).shape[0], True


def _match(srt: fx.Node) -> ExpertsMatch | None:
    absorbed: list[fx.Node] = [srt]
    ids = _flat_of(srt.args[0], absorbed)
    if ids is None or _val(ids).dtype.is_floating_point or len(srt.args) > 1 and srt.args[1] not in (0, -1):
        return None
    T, k = _val(ids).shape
    items = _getitems(srt)
    if set(items) != {0, 1}:
        return None
    sorted_ids, perm = items[0], items[1]
    absorbed += [sorted_ids, perm]
    # the users of perm: the token index (perm // k), the weights' index, the inverse permutation
    tok = weight_idx = inverse = None
    for u in perm.users:
        if _is(u, aten.floor_divide.default) and u.args[0] is perm and u.args[1] == k:
            tok = u
        elif _is(u, aten.index.Tensor) and list(u.args[1]) == [perm]:
            weight_idx = u
        elif _is(u, aten.index_put_.default, aten.index_put.default) and list(u.args[1]) == [perm]:
            inverse = u
        elif _is(u, aten.argsort.default, aten.argsort.stable):
            inverse = u
        elif _is(u, aten.empty_like.default):
            continue  # the inverse permutation's buffer, checked with it
        else:
            return None
    if tok is None or weight_idx is None:
        return None
    absorbed += [tok, weight_idx]
    if inverse is not None:
        absorbed.append(inverse)
        if inverse.target in (aten.index_put_.default, aten.index_put.default):
            base, ar = inverse.args[0], inverse.args[2]
            if not (
                _is(base, aten.empty_like.default) and base.args[0] is perm and _is(ar, aten.arange.default)
            ):
                return None
            absorbed += [base, ar]
    weights = _flat_of(weight_idx.args[0], absorbed)
    if weights is None or tuple(_val(weights).shape) != (T, k) or not _val(weights).dtype.is_floating_point:
        return None
    rows = [u for u in tok.users if _is(u, aten.index.Tensor) and list(u.args[1]) == [tok]]
    if len(rows) != 1:
        return None
    rows = rows[0]
    x = rows.args[0]
    if _val(x) is None or _val(x).dim() != 2 or _val(x).shape[0] != T:
        return None
    absorbed.append(rows)
    grouped = _grouped_mms(sorted_ids, absorbed)
    if grouped is None:
        return None
    mms, E, gathered = grouped
    if len(mms) not in (2, 3) or any(tuple(_val(p).shape[:1]) != (E,) for _, _, p, _ in mms):
        return None
    if len({t for *_, t in mms}) != 1:
        return None
    transposed = mms[0][3]
    absorbed += [mm for mm, *_ in mms]

    def rows_in(n) -> bool:
        """Is ``n`` the gathered tokens as a grouped matmul reads them (cast, or as ``[N, 1, H]``)?"""
        seen: list[fx.Node] = []
        n = _uncast(n, seen)
        if gathered and _is(n, aten.unsqueeze.default) and n.args[1] == 1:
            seen.append(n)
            n = n.args[0]
        if n is rows:
            absorbed.extend(seen)
            return True
        return False

    first_in = [m for m in mms if rows_in(m[1])]
    down = [m for m in mms if m not in first_in]
    if len(down) != 1:
        return None
    down = down[0]
    by_mm = {mm: p for mm, _, p, _ in mms}
    # the middle: act and gating, from the down projection's input back
    mid = _uncast(down[1], absorbed)
    w_up = None
    if _is(mid, aten.mul.Tensor) and len(mid.args) == 2:
        absorbed.append(mid)
        a, b = mid.args
        if not _is(a, *_ACTS):
            a, b = b, a
        if not _is(a, *_ACTS):
            return None
        act_node, gate, up = a, a.args[0], b
        gated = True
        first_nodes = [m[0] for m in first_in]
        if len(first_in) == 1 and _is(gate, operator.getitem) and _is(up, operator.getitem):
            ch = gate.args[0]
            if not (_is(ch, aten.chunk.default) and ch is up.args[0] and ch.args[0] is first_nodes[0]):
                return None
            if tuple(ch.args[1:3]) not in ((2, -1), (2, _val(ch.args[0]).dim() - 1)) or (
                gate.args[1],
                up.args[1],
            ) != (0, 1):
                return None
            absorbed += [ch, gate, up]
            w_in = by_mm[first_nodes[0]]
        elif len(first_in) == 2 and {gate, up} == set(first_nodes):
            w_in, w_up = by_mm[gate], by_mm[up]
        else:
            return None
    elif _is(mid, *_ACTS) and len(first_in) == 1 and mid.args[0] is first_in[0][0]:
        act_node, gated = mid, False
        w_in = by_mm[first_in[0][0]]
    else:
        return None
    absorbed.append(act_node)
    act = _ACTS[act_node.target]
    if (
        act == "gelu"
        and (act_node.kwargs.get("approximate") or (act_node.args[1:2] or ["none"])[0]) == "tanh"
    ):
        act = "gelu_tanh"
    w_out = by_mm[down[0]]
    y = down[0]
    if gathered:
        sq = _one_user(y, aten.squeeze.dim)
        if sq is None or sq.args[1] != 1:
            return None
        absorbed.append(sq)
        y = sq
    # weighting and combine
    mul = _one_user(y, aten.mul.Tensor)
    if mul is None:
        return None
    other = mul.args[1] if mul.args[0] is y else mul.args[0]
    if not (_is(other, aten.unsqueeze.default) and other.args[0] is weight_idx and other.args[1] in (-1, 1)):
        return None
    absorbed += [mul, other]
    H = _val(x).shape[1]
    if inverse is not None:
        back = _one_user(mul, aten.index.Tensor)
        if back is None or list(back.args[1]) != [inverse]:
            return None
        view = _one_user(back, *_VIEW)
        if view is None or list(view.args[1]) not in ([T, k, H], [T, k, -1], [-1, k, H]):
            return None
        total = _one_user(view, aten.sum.dim_IntList)
        if total is None or list(total.args[1]) != [1] or (total.args[2:3] or [False])[0]:
            return None
        absorbed += [back, view, total]
    else:
        total = _one_user(mul, aten.index_add.default)
        if total is None or total.args[1] != 0 or total.args[2] is not tok or total.args[3] is not mul:
            return None
        zeros = total.args[0]
        if not (
            _is(zeros, aten.zeros_like.default, aten.zeros.default) and tuple(_val(zeros).shape) == (T, H)
        ):
            return None
        if len(total.args) > 4 or total.kwargs.get("alpha", 1) != 1:
            return None
        absorbed += [total, zeros]
    out = total
    cast = _one_user(out, *_CAST)
    if cast is not None and _val(cast).dtype == _val(x).dtype:
        absorbed.append(cast)
        out = cast
    return ExpertsMatch(x, weights, ids, w_in, w_up, w_out, act, gated, transposed, E, out, tuple(absorbed))


def _closed(m: ExpertsMatch) -> bool:
    """Every node of the match but its output is read inside the match alone."""
    inside = set(m.absorbed)
    return all(set(n.users) <= inside for n in m.absorbed if n is not m.out)


def fold_experts(gm: fx.GraphModule) -> int:
    """Replace every MoE layer of ``gm``'s graph by one ``autopar::moe_experts`` call (in place;
    the caller recompiles); the number replaced."""
    g = gm.graph
    sorts = [n for n in g.nodes if _is(n, aten.sort.default, aten.sort.stable)]
    if not sorts:
        return 0
    op = _moe_op()
    done = 0
    for srt in sorts:
        if srt.graph is not g:
            continue
        m = _match(srt)
        if m is None or not _closed(m):
            continue
        args = (m.x, m.weights, m.ids, m.w_in, m.w_up, m.w_out, m.act, m.gated, m.transposed, m.num_experts)
        fake = _fake_run(op, args)
        want = _val(m.out)
        if fake is None or tuple(fake.shape) != tuple(want.shape) or fake.dtype != want.dtype:
            continue
        with g.inserting_before(m.out):
            node = g.call_function(op, args)
        node.meta["val"] = fake
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in m.out.meta:
                node.meta[key] = m.out.meta[key]
        m.out.replace_all_uses_with(node)
        order = {n: i for i, n in enumerate(g.nodes)}
        for n in sorted(set(m.absorbed), key=order.__getitem__, reverse=True):
            if not n.users:
                g.erase_node(n)
        done += 1
    return done


def mark_skew(tg, skew: float) -> None:
    """Record on each MoE op of ``tg`` the routing skew to price it at (under the key
    ``autopar/lowerings/experts.py``, which reads it, names)."""
    from autopar.lowerings.experts import SKEW_META

    op = _moe_op()
    for n in tg.graph.nodes:
        if n.op == "call_function" and n.target is op:
            n.meta[SKEW_META] = float(skew)


def mark_nodes(tg, devices_per_node: int | None) -> None:
    """Record on each MoE op of ``tg`` the devices per node of the cluster it is planned for
    (under the key ``autopar/lowerings/experts.py:NODES_META``): where an expert axis spans
    nodes, the dispatch once per node may run (None: no mark, only the flat one)."""
    from autopar.lowerings.experts import NODES_META

    op = _moe_op()
    for n in tg.graph.nodes:
        if n.op == "call_function" and n.target is op:
            if devices_per_node is None:
                n.meta.pop(NODES_META, None)
            else:
                n.meta[NODES_META] = int(devices_per_node)


def has_experts(tg) -> bool:
    """Does the traced graph hold a mixture-of-experts op (``fold_experts``)?"""
    op = _moe_op()
    return any(n.op == "call_function" and n.target is op for n in tg.graph.nodes)


def _moe_op():
    from autopar.kernels import moe  # noqa: F401  (registers autopar::moe_experts)

    return torch.ops.autopar.moe_experts.default


def _fake_run(op, args):
    vals = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    try:
        if mode is not None:
            with mode:
                return op(*vals)
        return op(*[v.to("meta") if isinstance(v, torch.Tensor) else v for v in vals])
    except Exception:  # noqa: BLE001 - a shape or dtype the op does not take: the region stays
        return None
