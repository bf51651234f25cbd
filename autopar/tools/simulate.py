"""Simulate every rank of a mesh in one process: local pieces, lock-step runs, collectives.

Used by ``autopar/tools/validate.py`` to check sharding rules on real values:

* a global value becomes each rank's local piece from its placement, axis by axis
  (:func:`_distribute`): ``Shard(d)`` keeps ``torch.chunk(x, n, d)[c]`` (c: the rank's coordinate
  on the axis), ``Replicate`` the full value, ``Partial`` one of ``n`` random summands; ranks are
  ordered row-major over the mesh (last axis fastest, :func:`_coords`);
* :func:`_local_graph` is the rank-local code the real code generator emits for one node;
* :func:`_run_lockstep` runs it for all ranks at once, simulating each call to
  ``autopar.codegen.collectives`` over the ranks of its mesh-axis group with
  :class:`_GroupCollective` (the real collective's forward and backward); ring attention and
  SUMMA (``codegen/summa.py``) run their real algorithms, a thread per rank of each ring or grid,
  their messages passed between the threads;
* :func:`_assemble` rebuilds the global value from the pieces (concatenate shards, sum partials,
  require replicas to agree).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement

from autopar.codegen import collectives as C
from autopar.codegen import context_parallel as CP
from autopar.codegen import summa as SM
from autopar.codegen.lower import LOWERINGS, emit_reshard
from autopar.passes.rules import map_args, tensor_inputs
from autopar.passes.strategies import Strategy
from autopar.passes.use_price import f_axes
from autopar.placement import is_partial, is_shard

aten = torch.ops.aten
Coord = tuple[int, ...]


# --------------------------------------------------------------------------------------------------
# mesh helpers
# --------------------------------------------------------------------------------------------------


def _coords(mesh_shape: Sequence[int]) -> list[Coord]:
    """Rank coordinates, row-major (last axis fastest): rank r is ``_coords(mesh)[r]``."""
    return list(itertools.product(*[range(n) for n in mesh_shape]))


def _tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float64:
        return 1e-9
    if dtype == torch.float32:
        return 2e-5
    if dtype.is_floating_point:
        return 2e-2
    return 0.0


def _summands(x: torch.Tensor, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    """``n`` random tensors that add up to ``x`` (bool: ``x`` on coordinate 0, False elsewhere)."""
    if n == 1:
        return [x]
    if x.dtype == torch.bool:
        return [x] + [torch.zeros_like(x)] * (n - 1)
    if x.dtype.is_floating_point or x.dtype.is_complex:
        scale = float(x.abs().mean()) + 1.0 if x.numel() else 1.0
        noise = [
            torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype) * scale for _ in range(n - 1)
        ]
    else:
        noise = [torch.randint(-5, 6, x.shape, generator=gen).to(x.dtype) for _ in range(n - 1)]
    return noise + [x - sum(noise)]


def _distribute(
    x: torch.Tensor,
    spec: Sequence[Placement],
    mesh_shape: Sequence[int],
    gen: torch.Generator,
    grad_conv=False,
) -> dict[Coord, torch.Tensor]:
    """Each rank's local piece of global ``x`` under ``spec``. With ``grad_conv`` (gradients),
    Partial is treated like Replicate: the full gradient on every rank."""
    pieces: dict[Coord, torch.Tensor] = {(): x}
    for a, n in enumerate(mesh_shape):
        p = spec[a]
        nxt: dict[Coord, torch.Tensor] = {}
        for c, v in pieces.items():
            if is_shard(p):
                parts = list(torch.chunk(v, n, p.dim))
            elif is_partial(p) and not grad_conv:
                parts = _summands(v, n, gen)
            else:
                parts = [v] * n
            for i in range(n):
                nxt[c + (i,)] = parts[i]
        pieces = nxt
    return pieces


def _max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / (1 + max |ref|); exact for non-float; inf on shape mismatch or stray NaN."""
    if tuple(got.shape) != tuple(ref.shape):
        return math.inf
    if not ref.dtype.is_floating_point and not ref.dtype.is_complex:
        return 0.0 if torch.equal(got.to(ref.dtype), ref) else 1.0
    if got.numel() == 0:
        return 0.0
    g, r = got.detach().to(torch.float64), ref.detach().to(torch.float64)
    gn, rn = torch.isnan(g), torch.isnan(r)
    if not torch.equal(gn, rn):
        return math.inf
    g, r = g.masked_fill(gn, 0.0), r.masked_fill(rn, 0.0)
    gi, ri = torch.isinf(g), torch.isinf(r)
    if not torch.equal(gi, ri) or not torch.equal(g[gi], r[ri]):
        return math.inf
    g, r = g.masked_fill(gi, 0.0), r.masked_fill(ri, 0.0)
    return float((g - r).abs().max()) / (1.0 + float(r.abs().max()))


def _assemble(
    pieces: dict[Coord, torch.Tensor], spec: Sequence[Placement], mesh_shape: Sequence[int], grad_conv=False
) -> tuple[torch.Tensor, float]:
    """Inverse of :func:`_distribute`: the global value, and the largest disagreement between ranks
    that must agree (Replicate; Partial too with ``grad_conv``)."""
    spread = 0.0
    for a in reversed(range(len(mesh_shape))):
        p, n = spec[a], mesh_shape[a]
        nxt: dict[Coord, torch.Tensor] = {}
        for c in {c[:a] for c in pieces}:
            parts = [pieces[c + (i,)] for i in range(n)]
            if is_shard(p):
                nxt[c] = torch.cat(parts, dim=p.dim)
            elif is_partial(p) and not grad_conv:
                if parts[0].dtype == torch.bool:
                    nxt[c] = torch.stack(parts).any(0)
                else:
                    nxt[c] = torch.stack(parts).sum(0).to(parts[0].dtype)
            else:
                for q in parts[1:]:
                    spread = max(spread, _max_err(q, parts[0]))
                nxt[c] = parts[0]
        pieces = nxt
    return pieces[()], spread


# --------------------------------------------------------------------------------------------------
# simulated collectives (same forward and backward as codegen/collectives.py, over a list of ranks)
# --------------------------------------------------------------------------------------------------


def _sim_fwd(kind: str, dim: int, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    n = len(xs)
    if kind == "all_gather":
        full = torch.cat([x.contiguous() for x in xs], dim=dim)
        return [full.clone() for _ in xs]
    if kind == "chunk":
        return [x.chunk(n, dim=dim)[c].contiguous() for c, x in enumerate(xs)]
    if kind == "all_reduce":
        total = torch.stack([x.contiguous() for x in xs]).sum(0).to(xs[0].dtype)
        return [total.clone() for _ in xs]
    if kind == "reduce_scatter":
        total = torch.stack([x.contiguous() for x in xs]).sum(0).to(xs[0].dtype)
        return [total.chunk(n, dim=dim)[c].contiguous() for c in range(n)]
    if kind == "to_partial":
        return [x.clone() if c == 0 else torch.zeros_like(x) for c, x in enumerate(xs)]
    if kind == "f":
        return [x.clone() for x in xs]
    if kind == "all_to_all":  # dim: (split, cat); rank dst gets every rank's piece dst
        split, cat = dim
        pieces = [x.chunk(n, dim=split) for x in xs]
        return [torch.cat([pieces[src][dst] for src in range(n)], dim=cat).contiguous() for dst in range(n)]
    raise AssertionError(kind)


_BWD = {  # backward of each collective is another collective (see the table in collectives.py)
    "all_gather": "chunk",
    "chunk": "all_gather",
    "all_reduce": "identity",
    "reduce_scatter": "all_gather",
    "to_partial": "identity",
    "f": "all_reduce",
    "all_to_all": "all_to_all",
}


class _GroupCollective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kind, dim, fused_f, *xs):
        ctx.kind, ctx.dim, ctx.fused_f = kind, dim, fused_f
        outs = _sim_fwd(kind, dim, xs)
        ctx.mark_non_differentiable(*[o for o in outs if not o.dtype.is_floating_point])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):
        kind, dim = _BWD[ctx.kind], ctx.dim
        if ctx.kind == "all_gather" and ctx.fused_f:
            kind = "reduce_scatter"
        if ctx.kind == "all_to_all":
            dim = dim[::-1]
        grads = list(gs) if kind == "identity" else _sim_fwd(kind, dim, gs)
        return (None, None, None, *grads)


_SIMULATED = {  # collective -> (kind, index of dim argument or None, index of axis argument)
    C.all_gather: ("all_gather", 1, 2),
    C.chunk: ("chunk", 1, 2),
    C.all_reduce: ("all_reduce", None, 1),
    C.all_reduce_deferred: ("all_reduce", None, 1),
    C.reduce_scatter: ("reduce_scatter", 1, 2),
    C.to_partial: ("to_partial", None, 1),
    C.f: ("f", None, 1),
    C.all_to_all: ("all_to_all", (1, 2), 3),
}


def _run_collective(target, args: tuple, kwargs: dict, env_x: list, coords: list[Coord]) -> list:
    kind, dim_i, axis_i = _SIMULATED[target]
    flat = list(args) + list(kwargs.values())
    axis = flat[axis_i]
    dim = (
        tuple(flat[i] for i in dim_i) if isinstance(dim_i, tuple) else flat[dim_i] if dim_i is not None else 0
    )
    fused = bool(flat[3]) if kind == "all_gather" and len(flat) > 3 else False
    out: list = [None] * len(coords)
    for ranks in _axis_groups(coords, axis):
        res = _GroupCollective.apply(kind, dim, fused, *[env_x[r] for r in ranks])
        for r, v in zip(ranks, res):
            out[r] = v
    return out


def _axis_groups(coords: list[Coord], axis: int) -> list[list[int]]:
    """The ranks of each group along mesh axis ``axis``, in coordinate order."""
    groups: dict[Coord, list[int]] = {}
    for r, c in enumerate(coords):
        groups.setdefault(c[:axis] + c[axis + 1 :], []).append(r)
    return list(groups.values())


class _ThreadRing:
    """``context_parallel.Transport`` between simulated ranks running in threads: each hop puts
    this rank's tensors in its slot and takes the previous rank's, between two barriers."""

    def __init__(self, slots: list, barrier: threading.Barrier, rank: int):
        self.slots, self.barrier, self.rank = slots, barrier, rank

    def start(self, tensors):
        ring = self

        class _Hop:
            def wait(self):
                ring.slots[ring.rank] = [t.clone() for t in tensors]
                ring.barrier.wait()
                got = ring.slots[(ring.rank - 1) % len(ring.slots)]
                ring.barrier.wait()
                return got

        return _Hop()


def _in_threads(fn, n: int) -> list:
    """``fn(rank, transport)`` for every rank of a ring of ``n``, each in its own thread (they meet
    at every hop); the first exception is raised here."""
    slots: list = [None] * n
    barrier = threading.Barrier(n, timeout=120)
    results: list = [None] * n
    errors: list = []

    def run(r):
        try:
            results[r] = fn(r, _ThreadRing(slots, barrier, r))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class _GroupRing(torch.autograd.Function):
    """``context_parallel.ring_attention`` over one axis group of simulated ranks: the real ring
    forward and backward, every rank in a thread."""

    @staticmethod
    def forward(ctx, causal, scale, n, *flat):
        qs, ks, vs, masks = (list(flat[i * n : (i + 1) * n]) for i in range(4))
        res = _in_threads(
            lambda r, t: CP.ring_forward(qs[r], ks[r], vs[r], masks[r], r, n, causal, scale, t), n
        )
        ctx.causal, ctx.scale, ctx.n = causal, scale, n
        ctx.save_for_backward(*qs, *ks, *vs, *[r[0] for r in res], *[r[1] for r in res])
        ctx.masks = masks
        return tuple(r[0] for r in res)

    @staticmethod
    def backward(ctx, *douts):
        n = ctx.n
        saved = ctx.saved_tensors
        qs, ks, vs, outs, lses = (saved[i * n : (i + 1) * n] for i in range(5))
        mask_grad = [ctx.needs_input_grad[3 + 3 * n + r] for r in range(n)]
        res = _in_threads(
            lambda r, t: CP.ring_backward(
                douts[r], qs[r], ks[r], vs[r], ctx.masks[r], outs[r], lses[r], r, n, ctx.causal, ctx.scale, t,
                mask_grad[r],
            ),
            n,
        )  # fmt: skip
        return (None, None, None, *[x[i] for i in range(4) for x in res])


def _run_ring(args: tuple, env_args: list[list], coords: list[Coord]) -> list:
    """Every rank's ``ring_attention``: ``env_args`` holds q, k, v and the mask per rank."""
    axis, causal, scale = args[4], args[5], args[6] if len(args) > 6 else None
    out: list = [None] * len(coords)
    for ranks in _axis_groups(coords, axis):
        n = len(ranks)
        q0 = env_args[0][ranks[0]]
        flat = [env_args[i][r] for i in range(4) for r in ranks]
        res = _GroupRing.apply(causal, CP.attention_scale(q0, scale), n, *flat)
        for r, v in zip(ranks, res):
            out[r] = v
    return out


class _ThreadGrid:
    """``codegen/summa.py``'s ``Transport`` between the simulated ranks of a ``q x q`` grid, each
    in a thread (rank ``i q + j`` at grid coordinate ``(i, j)``): each call puts this rank's
    tensor in its slot and takes what its row or column gives, between two barriers."""

    def __init__(self, slots: list, barrier: threading.Barrier, rank: int, q: int):
        self.slots, self.barrier, self.q = slots, barrier, q
        self.rank, self.i, self.j = rank, rank // q, rank % q

    def _members(self, side) -> list[int]:
        if side is SM.Side.ROW:
            return [self.i * self.q + c for c in range(self.q)]
        return [c * self.q + self.j for c in range(self.q)]

    def _exchange(self, t: torch.Tensor, pick):
        self.slots[self.rank] = t.clone()
        self.barrier.wait()
        got = pick()
        self.barrier.wait()
        return _Given(got)

    def broadcast(self, mine, side, src):
        return self._exchange(mine, lambda: self.slots[self._members(side)[src]].clone())

    def reduce(self, t, side, dst):
        mine = self.j if side is SM.Side.ROW else self.i
        return self._exchange(
            t, lambda: sum(self.slots[m] for m in self._members(side)) if mine == dst else None
        )


class _Given:
    def __init__(self, value):
        self.value = value

    def wait(self):
        return self.value


def _in_grid(fn, q: int) -> list:
    """``fn(rank, transport)`` for every rank of a ``q x q`` grid, each in its own thread."""
    slots: list = [None] * (q * q)
    barrier = threading.Barrier(q * q, timeout=120)
    results: list = [None] * (q * q)
    errors: list = []

    def run(r):
        try:
            results[r] = fn(r, _ThreadGrid(slots, barrier, r, q))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(q * q)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class _GridSumma(torch.autograd.Function):
    """``summa.summa_matmul`` over one grid of simulated ranks: the real SUMMA forward and
    backward, every rank in a thread."""

    @staticmethod
    def forward(ctx, q, transposed, *flat):
        xs, ws = flat[: q * q], flat[q * q :]
        ctx.q, ctx.transposed = q, transposed
        ctx.save_for_backward(*flat)
        return tuple(_in_grid(lambda r, t: SM.summa_forward(xs[r], ws[r], q, transposed, t), q))

    @staticmethod
    def backward(ctx, *dys):
        q, saved = ctx.q, ctx.saved_tensors
        xs, ws = saved[: q * q], saved[q * q :]
        res = _in_grid(lambda r, t: SM.summa_backward(dys[r], xs[r], ws[r], q, ctx.transposed, t), q)
        return (None, None, *[g[0] for g in res], *[g[1] for g in res])


def _run_summa(args: tuple, env_args: list[list], coords: list[Coord]) -> list:
    """Every rank's ``summa_matmul``: ``env_args`` holds x and w per rank; each grid of the mesh
    axes ``a``, ``b`` (one per coordinate on the other axes) runs apart."""
    a, b, transposed = args[2], args[3], args[4]
    grids: dict[Coord, dict[tuple[int, int], int]] = {}
    for r, c in enumerate(coords):
        rest = tuple(x for ax, x in enumerate(c) if ax not in (a, b))
        grids.setdefault(rest, {})[(c[a], c[b])] = r
    out: list = [None] * len(coords)
    for members in grids.values():
        ranks = [members[k] for k in sorted(members)]  # grid rank i q + j
        q = max(i for i, _ in members) + 1
        flat = [env_args[0][r] for r in ranks] + [env_args[1][r] for r in ranks]
        for r, v in zip(ranks, _GridSumma.apply(q, transposed, *flat)):
            out[r] = v
    return out


# --------------------------------------------------------------------------------------------------
# the local program of one node
# --------------------------------------------------------------------------------------------------


def _local_graph(node: fx.Node, strategy: Strategy, mesh_shape: Sequence[int]) -> fx.Graph:
    """The rank-local code ``codegen.lower.lower`` generates for ``node``, inputs already in place."""
    g = fx.Graph()
    ins = tensor_inputs(node)
    phs = []
    for k, src in enumerate(ins):
        ph = g.placeholder(f"in{k}")
        ph.meta = dict(src.meta)
        phs.append(ph)

    def in_place(k, leaf):
        fops = f_axes(strategy, k) if leaf.meta["val"].dtype.is_floating_point else ()
        return emit_reshard(g, phs[k], strategy.ins[k], strategy.ins[k], mesh_shape, fops)

    args, kwargs = map_args(node, in_place, _constant_of)
    fn = LOWERINGS.get(node.target)
    out = (
        fn(g, node, args, kwargs, strategy, mesh_shape) if fn else g.call_function(node.target, args, kwargs)
    )
    g.output(out)
    return g


def _constant_of(leaf: fx.Node):
    """A non-tensor node argument (a get_attr submodule, a static SymInt): its value."""
    if leaf.op == "get_attr" and leaf.graph.owning_module is not None:
        obj = leaf.graph.owning_module
        for part in str(leaf.target).split("."):
            obj = getattr(obj, part)
        return obj
    if "val" in leaf.meta and not isinstance(leaf.meta["val"], torch.Tensor):
        return leaf.meta["val"]
    raise NotImplementedError(f"cannot validate {leaf.op} {leaf.name} used as a non-tensor argument")


def _run_lockstep(g: fx.Graph, local_inputs: list[list[torch.Tensor]], coords: list[Coord]) -> list:
    """Run ``g`` for every rank; ``local_inputs[k][r]`` is input k on rank r. Returns outputs per rank."""
    env: dict[fx.Node, list] = {}
    k = 0
    for n in g.nodes:
        if n.op == "placeholder":
            env[n] = local_inputs[k]
            k += 1
        elif n.op == "call_function":
            if n.target is C.coordinate:  # each simulated rank's own coordinate on the axis
                env[n] = [c[n.args[0]] for c in coords]
            elif n.target is CP.ring_attention:
                ins = [env[a] if isinstance(a, fx.Node) else [a] * len(coords) for a in n.args[:4]]
                env[n] = _run_ring(n.args, ins, coords)
            elif n.target is SM.summa_matmul:
                env[n] = _run_summa(n.args, [env[x] for x in n.args[:2]], coords)
            elif n.target in _SIMULATED:
                x = n.args[0]
                args = fx.node.map_arg(n.args, lambda a: None)
                kwargs = fx.node.map_arg(n.kwargs, lambda a: None)
                env[n] = _run_collective(n.target, args, kwargs, env[x], coords)
            else:
                outs = []
                for r in range(len(coords)):
                    args = fx.node.map_arg(n.args, lambda a, r=r: env[a][r])
                    kwargs = fx.node.map_arg(n.kwargs, lambda a, r=r: env[a][r])
                    outs.append(n.target(*args, **kwargs))
                env[n] = outs
        elif n.op == "output":
            return env[n.args[0]]
        else:
            raise NotImplementedError(f"unexpected {n.op} in a local graph")
    raise AssertionError("graph without output")


def _is_random(node: fx.Node) -> bool:
    target = node.target
    if target is aten.dropout.default:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return bool(p) and bool(train)
    if target is aten.scaled_dot_product_attention.default:
        p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        return bool(p)
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags
