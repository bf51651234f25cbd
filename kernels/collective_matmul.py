"""Collective matmuls: a linear whose input all-gather, or output reduce-scatter, runs as a ring
whose hops overlap the matmul's chunks (async tensor parallelism; Wang et al., "Overlap
Communication with Dependent Computation via Decomposition in Large Deep Learning Models",
ASPLOS 2023; torchtitan's async TP).

Megatron-style sequence parallelism gathers the sequence before a column-parallel linear and
reduce-scatters it after a row-parallel one: the collective sits exposed before, or after, the
matmul. Cut along the gathered (scattered) dim, the matmul is ``n`` independent chunks, one per
rank of the group, so each chunk's matmul can run while the next chunk travels:

``all_gather_linear(x_r, W, b, dim, group)`` = ``F.linear(cat_j x_j, W, b)`` (cat along ``dim``,
  in rank order; ``dim`` not the last, the contracted one). Ring of ``n - 1`` hops: rank ``r``
  computes its own chunk ``linear(x_r)`` while it sends ``x_r`` to ``r + 1`` and receives
  ``x_{r-1}`` from ``r - 1``; at hop ``k`` it forwards what it received at hop ``k - 1`` and
  computes on it meanwhile; the last chunk to arrive (``x_{r+1}``) is computed after the last hop.
  Backward (``reduce_grad``: the gathered input's gradient is summed over the group, Megatron's
  "f" fused into the gather, ``autopar/reshard.py``): ``dx_r = sum over ranks of (g W)_r``, a ring
  reduce-scatter whose hops overlap the chunks ``g_j W`` (and the weight's ``g_j^T x_j``): rank
  ``r`` computes the chunk for ``r - 1`` first and sends it on, then receives the running sum for
  ``r - 2``, adds its own chunk for it (computed while the sum travelled) and sends that on, ...,
  ending with the sum for itself. Without ``reduce_grad`` (the gradient is already whole on every
  rank) ``dx_r = (g W)_r``, no communication.
  ``dW = g^T x`` needs the gathered input. **Backward re-gathers** (Megatron-LM's sequence
  parallelism; Korthikanti et al. 2022, section 4.2.2): forward keeps only the local shard
  ``x_r`` (``1/n`` of the gathered bytes), and backward runs the ring gather again, computing
  each arriving piece's ``g_j^T x_j`` (and the bias's ``sum g_j``) while the next travels, then
  the reduce-scatter ring above with the chunks ``g_j W`` alone: the gather hides behind the
  weight's gradient, the reduce-scatter behind the input's. Where other ops read the gathered
  input (``keep_gathered``: they keep it anyway), or the input needs no gradient, the gathered
  input is kept from forward as the unfused all-gather + linear keeps it, and ``g_j^T x_j``
  computed inside the reduce-scatter ring.

``linear_reduce_scatter(x, W, b, dim, group)`` = ``reduce_scatter(F.linear(x, W, b), dim)``: the
  sum over the group of every rank's linear, rank ``r`` keeping piece ``r`` along ``dim``. Each
  rank computes its partial of the chunk destined for ``r - 1`` and sends it on while it computes
  the next chunk; the running sums travel the ring as above. A chunk is ``linear(x_j, W, b)``
  with ``x_j`` the ``j``-th piece of ``x`` along ``dim``, or, where ``dim`` is the output's last
  (its features), ``linear(x, W_j, b_j)`` with ``W_j`` the ``j``-th block of the weight's rows.
  The full partial output is never materialized (the unfused path holds it, ``n`` times the result).
  Backward: the output's gradient pieces are all-gathered by the ring and each arriving piece's
  ``g_j W`` (``dx``) and ``g_j^T x_j`` (``dW``) computed while the next travels.

Per hop a rank sends one chunk to its successor and receives one from its predecessor
(``batch_isend_irecv``, ``async_op`` point-to-point works waited before the chunk is used): the
ring all-gather's and reduce-scatter's traffic, ``(n - 1) / n`` of the gathered bytes per rank.
The bias (a ``Partial`` bias is nonzero on one rank) is added in each chunk of the partial sums,
so the sum carries it once per rank that holds it, as the unfused linear's output does. Autocast
regions: the chunks' matmuls run under the forward's autocast state, and backward under the same
(as ``torch.amp.custom_bwd`` does), so mixed precision computes as the unfused linear does.

**Why written by hand.** PyTorch's fused forms (``torch.distributed._symmetric_memory``:
``fused_all_gather_matmul``, ``fused_matmul_reduce_scatter``, which torchtitan's async TP inserts
through ``torch._inductor``'s micro-pipeline TP pass) need CUDA devices with symmetric memory
(NVLink / NVSwitch peers of one host) and do not run on gloo or on CPU tensors, where this
project's multi-process tests run. On multi-GPU CUDA they would replace the rings below: the
generated code would call ``torch.ops.symm_mem.fused_all_gather_matmul(x_shard, [W.t()],
gather_dim=dim, group_name=group.group_name)`` (returning the gathered input too, which backward
keeps) and ``torch.ops.symm_mem.fused_matmul_reduce_scatter(x, W.t(), "sum", scatter_dim=dim,
group_name=...)`` after ``enable_symm_mem_for_group(group.group_name)``, each with a backward
written as here (PyTorch registers none); the bias would be added outside. Not done: no
multi-GPU machine to verify on. Also not done: hops across nodes (where the comm model prices
hierarchical collectives, ``cost_model/comm.py``, a flat ring is slower); uneven pieces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.errors import CollectiveMatmulError


def _ring(group) -> tuple[int, int, int, int]:
    """(n, this rank, successor, predecessor) in ``group``'s own rank numbering."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return n, r, (r + 1) % n, (r - 1) % n


def _hop(send: torch.Tensor, recv: torch.Tensor, group, nxt: int, prv: int) -> list:
    """Start sending ``send`` to ``nxt`` and receiving ``recv`` from ``prv``; returns the works."""
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=nxt),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=prv),
    ]
    return dist.batch_isend_irecv(ops)


def ring_gather(
    piece: torch.Tensor,
    group,
    compute: Callable[[int, torch.Tensor], None],
    into: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Every rank's ``piece`` (equal shapes), in rank order; ``compute(j, piece_j)`` is called for
    each as it is at hand (this rank's first), while the next one travels. ``into``: contiguous
    buffers, one per rank, to receive the pieces in (views of one gathered tensor), else new ones."""
    n, r, nxt, prv = _ring(group)
    pieces: list[torch.Tensor | None] = [None] * n
    pieces[r] = into[r].copy_(piece) if into is not None else piece.contiguous()
    cur = r
    for k in range(n - 1):
        j = (r - k - 1) % n
        pieces[j] = into[j] if into is not None else torch.empty_like(pieces[r])
        works = _hop(pieces[cur], pieces[j], group, nxt, prv)
        compute(cur, pieces[cur])
        for w in works:
            w.wait()
        cur = j
    compute(cur, pieces[cur])
    return pieces  # type: ignore[return-value]


def ring_reduce_scatter(group, partial: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """This rank's piece of the sum over ``group`` of every rank's ``partial(j)`` (piece ``j`` of
    the rank's summand, equal shapes): each rank computes its pieces in ring order, the one for
    its predecessor first, and adds the running sum received while it computed."""
    n, r, nxt, prv = _ring(group)
    acc = partial((r - 1) % n).contiguous()
    for k in range(1, n):
        recv = torch.empty_like(acc)
        works = _hop(acc, recv, group, nxt, prv)
        mine = partial((r - k - 1) % n)
        for w in works:
            w.wait()
        acc = recv.add_(mine)
    return acc


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _even(size: int, n: int, what: str) -> int:
    if size % n:
        raise CollectiveMatmulError(
            f"{what} has {size} rows along the scattered dim, not a multiple of the group's {n} ranks: "
            "the collective matmuls cut it in equal pieces; pad it to a multiple, or plan with "
            "overlap_matmuls=False"
        )
    return size // n


def _norm_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise CollectiveMatmulError(f"dim {dim} is out of range for a tensor of {ndim} dims")
    return dim % ndim


class _AllGatherLinear(torch.autograd.Function):
    """``k`` linears of one gathered input (their weights ``params[:k]``, biases ``params[k:]``):
    one ring, each arriving piece's ``k`` matmuls behind the next hop; ``k = 1`` is
    ``all_gather_linear``, ``k > 1`` ``all_gather_linears`` (Megatron's fused QKV without a
    stacked weight)."""

    @staticmethod
    def forward(ctx, x, dim, group, reduce_grad, keep_gathered, regather, k, *params):
        weights, biases = params[:k], params[k:]
        d = _norm_dim(dim, x.dim())
        if d == x.dim() - 1:
            raise CollectiveMatmulError(
                f"all_gather_linear gathers along dim {dim}, the contracted (last) dim of the input: the "
                "pieces' products would be summed, not concatenated; gather before the linear instead"
            )
        n, c = dist.get_world_size(group), x.shape[d]
        outs: list[dict[int, torch.Tensor]] = [{} for _ in range(k)]

        def chunk(j: int, piece: torch.Tensor) -> None:
            for i in range(k):
                outs[i][j] = F.linear(piece, weights[i], biases[i])

        if math.prod(x.shape[:d]) == 1:  # the pieces are consecutive: received into the gathered tensor
            gathered = x.new_empty((*x.shape[:d], n * c, *x.shape[d + 1 :]))
            ring_gather(x, group, chunk, [gathered.narrow(d, j * c, c) for j in range(n)])
        else:
            gathered = torch.cat(ring_gather(x, group, chunk), dim=d)
        out = [torch.cat([o.pop(j) for j in range(n)], dim=d) for o in outs]
        # the shard alone is kept where nothing else reads the gathered input and backward needs it
        # for the weights' gradients: gathered again there (module docstring, "Backward re-gathers")
        ctx.regather = regather and not keep_gathered and x.requires_grad
        ctx.save_for_backward(x if ctx.regather else gathered, *weights)
        ctx.dim, ctx.group, ctx.reduce_grad, ctx.k = d, group, reduce_grad, k
        ctx.device_type = x.device.type
        ctx.autocast = _autocast_state(x.device.type)
        return (*out, gathered) if keep_gathered else tuple(out) if k > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        kept, *weights = ctx.saved_tensors
        k = ctx.k
        gs, g_gathered = grads[:k], (grads[k] if len(grads) > k else None)
        n, r, _, _ = _ring(ctx.group)
        d = ctx.dim
        c = kept.shape[d] if ctx.regather else kept.shape[d] // n
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[7 : 7 + k]
        need_b = ctx.needs_input_grad[7 + k : 7 + 2 * k]
        enabled, dtype = ctx.autocast
        acc = _Sums()  # the weights' and biases' gradients, summed over the pieces as they come
        with torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):

            def weight_grads(j: int, x_j: torch.Tensor) -> None:
                """Piece ``j``'s share of the weights' and biases' gradients, added up."""
                for i, g in enumerate(gs):
                    g_j = _flat(g.narrow(d, j * c, c))
                    if need_w[i]:
                        acc.add(("w", i), g_j.t() @ _flat(x_j).to(g_j.dtype))
                    if need_b[i]:
                        acc.add(("b", i), g_j.sum(0))

            gathered = kept
            if ctx.regather:  # the input gathered again, each piece's weight gradients behind the next hop
                if any(need_w) or any(need_b):
                    ring_gather(kept, ctx.group, weight_grads)
                gathered = None

            def piece_grads(j: int, want_x: bool = True) -> torch.Tensor | None:
                """Piece ``j``'s share of the weights' and biases' gradients (added up, where the
                gathered input was kept), and, where ``want_x``, the gathered input's gradient on
                piece ``j``."""
                if gathered is not None:
                    weight_grads(j, gathered.narrow(d, j * c, c))
                if not want_x:
                    return None
                dx = sum(g.narrow(d, j * c, c) @ w.to(g.dtype) for g, w in zip(gs, weights))
                if g_gathered is not None:  # other ops' gradient of the gathered input
                    dx = dx + g_gathered.narrow(d, j * c, c)
                return dx

            if need_x and ctx.reduce_grad:
                dx = ring_reduce_scatter(ctx.group, piece_grads)
            else:  # the gradient is whole on every rank: this rank's piece, no communication
                dx = piece_grads(r, need_x)
                for j in range(n):
                    if j != r and gathered is not None:
                        piece_grads(j, False)
        dws = [acc.get(("w", i)).to(w.dtype) if need_w[i] else None for i, w in enumerate(weights)]
        dbs = [acc.get(("b", i)) if need_b[i] else None for i in range(k)]
        dx = dx.to(kept.dtype) if dx is not None else None
        return dx, None, None, None, None, None, None, *dws, *dbs


class _Sums:
    """Running sums by name (a backward's weight and bias gradients over the pieces): one
    tensor each, never a list of ``n`` of them."""

    def __init__(self):
        self.sums: dict = {}

    def add(self, name, t: torch.Tensor) -> None:
        self.sums[name] = self.sums[name].add_(t) if name in self.sums else t

    def get(self, name) -> torch.Tensor:
        return self.sums[name]


class _LinearReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dim, group):
        n = dist.get_world_size(group)
        d = _norm_dim(dim, x.dim())
        features = d == x.dim() - 1  # scatter the output's features: blocks of the weight's rows
        if features:
            c = _even(weight.shape[0], n, "the weight's output features")
        else:
            c = _even(x.shape[d], n, f"the input's dim {d}")

        def partial(j: int) -> torch.Tensor:
            if features:
                b = bias.narrow(0, j * c, c) if bias is not None else None
                return F.linear(x, weight.narrow(0, j * c, c), b)
            return F.linear(x.narrow(d, j * c, c), weight, bias)

        out = ring_reduce_scatter(group, partial)
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.group, ctx.features, ctx.c = d, group, features, c
        ctx.device_type = x.device.type
        ctx.autocast = _autocast_state(x.device.type)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        d, c, features = ctx.dim, ctx.c, ctx.features
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        enabled, dtype = ctx.autocast
        acc = _Sums()  # what every piece adds to: the weight's and bias's (rows) or the input's (features)
        parts: dict[str, dict[int, torch.Tensor]] = {"x": {}, "w": {}, "b": {}}  # one block per piece
        with torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled):

            def on_piece(j: int, g_j: torch.Tensor) -> None:
                if features:  # g_j: the gradient of output features j..; W_j their weight rows
                    if need_x:
                        acc.add("x", g_j @ weight.narrow(0, j * c, c).to(g_j.dtype))
                    if need_w:
                        parts["w"][j] = _flat(g_j).t() @ _flat(x).to(g_j.dtype)
                    if need_b:
                        parts["b"][j] = _flat(g_j).sum(0)
                else:  # g_j: the gradient of rows j.. of the output, made from x_j
                    if need_x:
                        parts["x"][j] = g_j @ weight.to(g_j.dtype)
                    if need_w:
                        acc.add("w", _flat(g_j).t() @ _flat(x.narrow(d, j * c, c)).to(g_j.dtype))
                    if need_b:
                        acc.add("b", _flat(g_j).sum(0))

            ring_gather(g, ctx.group, on_piece)

        def whole(name: str, need: bool, cat_dim: int) -> torch.Tensor | None:
            if not need:
                return None
            blocks = parts[name]
            return torch.cat([blocks.pop(j) for j in sorted(blocks)], cat_dim) if blocks else acc.get(name)

        gx, gw, gb = whole("x", need_x, d), whole("w", need_w, 0), whole("b", need_b, 0)
        gx = gx.to(x.dtype) if gx is not None else None
        gw = gw.to(weight.dtype) if gw is not None else None
        return gx, gw, gb, None, None


def all_gather_linear(
    x_shard: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dim: int,
    group,
    reduce_grad: bool = True,
    keep_gathered: bool = False,
    regather: bool = False,
):
    """``F.linear(all_gather(x_shard, dim), weight, bias)`` over ``group``, its ring's hops behind
    the chunks' matmuls (module docstring). ``reduce_grad``: backward reduce-scatters the gathered
    input's gradient (it is a partial sum on each rank: the linear's weight is split over the
    group); else each rank's piece of it is its own. ``keep_gathered``: also return the gathered
    input (for other ops that read it; their gradient joins the reduction). ``regather``: keep only
    ``x_shard`` for backward and gather it again there (module docstring; not with
    ``keep_gathered``, nor where ``x_shard`` needs no gradient)."""
    return _AllGatherLinear.apply(x_shard, dim, group, reduce_grad, keep_gathered, regather, 1, weight, bias)


def all_gather_linears(
    x_shard: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None] | None,
    dim: int,
    group,
    reduce_grad: bool = True,
    regather: bool = True,
) -> tuple[torch.Tensor, ...]:
    """``F.linear(all_gather(x_shard, dim), w_i, b_i)`` for each weight ``w_i`` (and bias ``b_i``;
    ``biases`` None: none), as ``all_gather_linear`` does for one: one ring, each piece's matmuls
    behind the next hop, backward's input gradient the sum of theirs (Megatron's fused QKV, with
    no stacked copy of the weights). ``regather``: keep only ``x_shard`` for backward."""
    k = len(weights)
    bs = list(biases) if biases is not None else [None] * k
    if len(bs) != k:
        raise CollectiveMatmulError(f"all_gather_linears takes one bias per weight ({k}), got {len(bs)}")
    return _AllGatherLinear.apply(x_shard, dim, group, reduce_grad, False, regather, k, *weights, *bs)


def linear_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dim: int, group
) -> torch.Tensor:
    """This rank's piece along ``dim`` of the sum over ``group`` of ``F.linear(x, weight, bias)``,
    each chunk's reduction travelling while the next chunk computes (module docstring). The output
    dim ``dim`` must divide evenly over the group (``CollectiveMatmulError`` otherwise)."""
    return _LinearReduceScatter.apply(x, weight, bias, dim, group)
