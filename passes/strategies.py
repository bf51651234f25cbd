"""Strategies: every placement a node may take on the whole mesh, with its input requirements.

Per-axis options from ``rules.py`` are expanded to the mesh as their cartesian product, keeping a
combination only if every tensor it touches divides evenly (each sharded dim by its axis size) and
no tensor dim is sharded by two axes, except on the axes of one nest group (``nest_axes``), nested
as DTensor nests them (the lower axis outer), save by an op whose lowering cuts by one axis's
coordinate (``_nest_ok``). Two groups nest: the axes that split the batch, where two do (``DATA``
and ``EXPERT``: expert parallelism beside data parallelism), and the ``SEQUENCE`` axes with the
``TENSOR`` axes after them (Megatron's sequence parallelism inside context parallelism: the norms,
residual adds and dropout run on a sequence split over the context axis and, inside it, over the
tensor group; the sequence axis outer, DTensor's ``(Shard(1), Shard(1))``; an all-gather over the
tensor axis before a column-parallel linear, a reduce-scatter after a row-parallel one, are the
reshards between those placements and the matmuls': ``autopar/reshard.py``). Placeholders (parameters, buffers, user inputs) may take
Replicate or Shard(d) for any dim. Ops without a rule of autopar's own take the options PyTorch's
DTensor strategies give them (``rules/dtensor.py``); ops with neither get the all-Replicate strategy
only, and the fallback is logged once per op.

Constraints on the search (``AxisRole``) restrict the strategies of placeholders:
``DATA`` on an axis replicates parameters and shards user inputs on dim 0 (data parallelism);
``TENSOR`` replicates user inputs and shards every parameter of two or more dims (tensor
parallelism); ``SEQUENCE`` replicates parameters and shards user inputs on dim 1, the sequence, and splits
attention's queries on the sequence (context parallelism: K/V gathered, a ring, or all-to-all,
``SeqAttention``; ``seq_attention`` forces one);
``AUTO`` leaves the choice to the solver.

``fixed`` pins mesh axes of every node to placements chosen beforehand, given as strategies on a
1-axis mesh (the default search pins a 3-axis mesh's outer axis to the data-parallel solution of
that axis alone, so that its strategy tables stay the size of a 2-axis mesh's).
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Replicate, Shard

from autopar.errors import NoPlanFitsError
from autopar.lowerings import lowering_of
from autopar.lowerings.experts import NODES_META
from autopar.options import AxisRole
from autopar.passes.analyze import NodeInfo
from autopar.passes.background import checkpoint
from autopar.passes.rules import (
    ALIASING_OPS,
    RULES,
    VIEW_OPS,
    AxisOption,
    in_place_options,
    make_ctx,
    tensor_inputs,
    written_inputs,
)
from autopar.passes.rules.dtensor import options as dtensor_options
from autopar.passes.rules.experts import MOE, expert_weights, experts_strategies
from autopar.passes.rules.matmul import GRID_3D_OPTIONS, GRID_OPTIONS
from autopar.passes.trace import Role, TracedGraph
from autopar.placement import (
    ExpertDispatch,
    Matmul2D,
    Matmul3D,
    SeqAttention,
    Spec,
    Via,
    is_partial,
    is_replicate,
    is_shard,
)

log = logging.getLogger(__name__)
R = Replicate()
aten = torch.ops.aten


@dataclass(frozen=True)
class Strategy:
    out: Spec
    ins: tuple[Spec, ...]  # one spec per tensor input (see rules.tensor_inputs)
    # per mesh axis, the algorithm of an op whose placements do not say it (``SeqAttention``, or
    # ``OwnRows``: an op of a data-parallel region); empty where no axis has one
    via: tuple[Via | None, ...] = ()

    def via_axis(self, kind: SeqAttention) -> int | None:
        """The mesh axis this strategy runs ``kind`` on, if any."""
        return next((a for a, v in enumerate(self.via) if v is kind), None)

    def split_axes(self) -> tuple[bool, ...]:
        """Per axis: is the op split over the axis (anything but all-Replicate)? Where an input is
        Replicate on such an axis its gradient is partial there (Megatron "f")."""
        return _split_axes(self)

    def work_divisor(self, mesh_shape: Sequence[int]) -> int:
        """How many ranks share this op's work: the product of the axes on which some input or the
        output is Shard. An axis where the op only takes Partial inputs divides nothing: every
        rank runs the whole op on its own summand (a matmul of a Partial activation is full size)."""
        return _work_divisor(self, tuple(mesh_shape))


@functools.cache
def _work_divisor(s: Strategy, mesh_shape: tuple[int, ...]) -> int:
    k = 1
    for a, n in enumerate(mesh_shape):
        if is_shard(s.out[a]) or any(is_shard(x[a]) for x in s.ins):
            k *= n
    return k


@functools.cache
def _split_axes(s: Strategy) -> tuple[bool, ...]:
    return tuple(
        not is_replicate(s.out[a]) or any(not is_replicate(x[a]) for x in s.ins) for a in range(len(s.out))
    )


@dataclass
class NodeStrategies:
    node: fx.Node
    strategies: list[Strategy]
    inputs: list[fx.Node]  # tensor inputs, aligned with Strategy.ins
    has_rule: bool


_warned_fallback: set[str] = set()


Nest = tuple[tuple[int, ...], ...]  # groups of mesh axes a dim may be split on together (``nest_axes``)


def _fits(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int], nest: Nest = ()) -> bool:
    """Does ``spec`` split ``shape`` evenly, each dim on one axis, or on several of one group of
    ``nest`` (nested as DTensor nests them, the lower axis outer)?"""
    held: dict[int, list[int]] = {}
    rest = list(shape)
    for a, (p, n) in enumerate(zip(spec, mesh_shape)):
        if is_shard(p):
            if not shape:
                return False
            d = p.dim % len(shape)
            if d in held and not any(a in g and all(b in g for b in held[d]) for g in nest):
                return False
            if rest[d] % n or rest[d] < n:
                return False
            rest[d] //= n
            held.setdefault(d, []).append(a)
    return True


def nested(s: Strategy, mesh_shape: Sequence[int]) -> bool:
    """Does ``s`` split some tensor's dim on two axes of more than one rank?"""
    for spec in (s.out, *s.ins):
        dims = [p.dim for p, n in zip(spec, mesh_shape) if is_shard(p) and n > 1]
        if len(dims) != len(set(dims)):
            return True
    return False


def nest_axes(mesh_shape: Sequence[int], axis_roles: Sequence[AxisRole]) -> Nest:
    """The groups of axes a dim may be split on together, each of axes of more than one rank:
    those that split the batch, where two or more do (expert parallelism beside data
    parallelism); and a ``SEQUENCE`` axis with a ``TENSOR`` axis after it in the mesh
    (sequence parallelism inside context parallelism, the sequence axis outer as DTensor nests
    ``(Shard(1), Shard(1))``: a tensor axis before the sequence axis would be the outer one, and
    gathering it for a matmul would first gather the sequence axis inside it). None otherwise:
    e.g. a data axis and a tensor axis never split one dim together."""
    live = [(a, r) for a, (n, r) in enumerate(zip(mesh_shape, axis_roles)) if n > 1]
    batch = tuple(a for a, r in live if r.splits_batch)
    pairs = tuple(
        (s, t)
        for s, rs in live
        for t, rt in live
        if rs is AxisRole.SEQUENCE and rt is AxisRole.TENSOR and s < t
    )
    return ((batch,) if len(batch) > 1 else ()) + pairs


# the registered lowerings (autopar/lowerings) that take a dim split on several axes: they reduce
# or dispatch per axis, or scale by the product of the axes; the others cut by one axis's
# coordinate (their block of an embedding table, of an index's rows, of attention's query rows)
NEST_LOWERINGS = frozenset(
    {
        "batch_norm_statistics",
        "expert_all_to_all",
        "expert_node_all_to_all",
        "local_experts",
        "split_mean",
        "split_mse_loss",
        "cross_entropy_mean",
        "linear_cross_entropy",
    }
)
# ops codegen/lower.py cuts by one axis's coordinate with no registered lowering: its block of an arange
ARANGE = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})


def _nest_ok(node: fx.Node, s: Strategy, mesh_shape: Sequence[int]) -> bool:
    """May ``node`` take ``s``, if nested? Not where it runs by a lowering that cuts by one axis's
    coordinate, nor under an algorithm of its own (``via``) other than the experts' dispatch, which
    runs over the expert axis alone."""
    if not nested(s, mesh_shape):
        return True
    if node.target in ARANGE or not all(v is None or isinstance(v, ExpertDispatch) for v in s.via):
        return False
    how = lowering_of(node, s, mesh_shape)
    return how is None or how.name in NEST_LOWERINGS


def _normalize(spec: Spec, ndim: int) -> Spec:
    return tuple(Shard(p.dim % ndim) if is_shard(p) and ndim else p for p in spec)


def expand(
    options: list[AxisOption],
    n_in: int,
    out_shapes: Sequence[Sequence[int]],
    in_shapes: Sequence[Sequence[int]],
    mesh_shape: Sequence[int],
    pinned: dict[int, AxisOption] | None = None,
    nest: Nest = (),
) -> list[Strategy]:
    """Cartesian product of per-axis options, filtered for even, non-overlapping sharding (a dim
    may be split on several axes of one group of ``nest``: ``_fits``); an axis in ``pinned`` takes that one
    option."""
    per_axis = [AxisOption(R, (R,) * n_in)] + [o for o in options if len(o.ins) == n_in]
    choices = [[pinned[a]] if pinned and a in pinned else per_axis for a in range(len(mesh_shape))]
    out: list[Strategy] = []
    seen = set()
    for combo in itertools.product(*choices):
        o_spec = tuple(c.out for c in combo)
        if not out_shapes:
            o_spec = tuple(R for _ in combo) if any(not is_replicate(p) for p in o_spec) else o_spec
        ins = tuple(tuple(c.ins[i] for c in combo) for i in range(n_in))
        if out_shapes:
            o_spec = _normalize(o_spec, len(out_shapes[0]))
        ins = tuple(_normalize(s, len(shape)) for s, shape in zip(ins, in_shapes))
        if not all(_fits(s, o_spec, mesh_shape, nest) for s in out_shapes):
            continue
        if not all(_fits(shape, s, mesh_shape, nest) for shape, s in zip(in_shapes, ins)):
            continue
        if not _splits_fit(combo, ins, in_shapes, mesh_shape):
            continue
        via = tuple(c.via for c in combo) if any(c.via for c in combo) else ()
        key = (o_spec, ins, via)
        if key not in seen:
            seen.add(key)
            out.append(Strategy(o_spec, ins, via))
    return out


def _splits_fit(
    combo: Sequence[AxisOption],
    ins: Sequence[Spec],
    in_shapes: Sequence[Sequence[int]],
    mesh_shape: Sequence[int],
) -> bool:
    """Every dim an option's algorithm cuts itself (``AxisOption.splits``) divides evenly by its
    axis, after the other axes' Shards of that dim."""
    for a, c in enumerate(combo):
        for i, d in c.splits:
            size = in_shapes[i][d]
            for b, p in enumerate(ins[i]):
                if b != a and is_shard(p) and p.dim == d:
                    size //= mesh_shape[b]
            if size % mesh_shape[a] or size < mesh_shape[a]:
                return False
    return True


def axis_options(node: fx.Node, mesh_shape: Sequence[int]) -> list[AxisOption]:
    """A call_function node's per-axis options: its rule's (``RULES``) where autopar has one, else
    those derived from PyTorch's DTensor strategies for the axis sizes of ``mesh_shape``
    (``rules/dtensor.py``, each checked by the validator's tests), else none (replicated). An
    in-place op without a rule of its own takes its out-of-place twin's that keep ``self`` as the
    output is (``rules.in_place_options``)."""
    rule = RULES.get(node.target)
    if rule is not None:
        return rule(make_ctx(node))
    twin = in_place_options(make_ctx(node)) if written_inputs(node) else None
    if twin is not None:
        return twin
    return dtensor_options(node, mesh_shape)


def placeholder_options(shape: Sequence[int]) -> list[AxisOption]:
    return [AxisOption(Shard(d), ()) for d in range(len(shape)) if shape[d] > 1]


def build_strategies(
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    mesh_shape: Sequence[int],
    axis_roles: Sequence[AxisRole] | None = None,
    only: set[str] | None = None,
    fixed: dict[int, dict[str, Strategy]] | None = None,
    seq_attention: SeqAttention | None = None,
    regions: dict[str, AxisOption] | None = None,
    nest: Nest | None = None,
) -> dict[str, NodeStrategies]:
    """Strategies of every placeholder and op node (or of the names in ``only``: class representatives).

    ``fixed[a][name]``: a strategy on a 1-axis mesh that node ``name`` takes on mesh axis ``a``.
    ``regions[name]``: the one option of a node of a data-parallel region (``passes/data_region.py``)
    on the mesh's data axis; such a node is replicated on every other axis. ``nest``: the axes a
    dims may be split on together (default ``nest_axes`` of the roles; a plan read back, whose roles
    are not recorded, passes the groups its own decisions nest: ``passes/replay.py``)."""
    axis_roles = tuple(axis_roles or (AxisRole.AUTO,) * len(mesh_shape))
    if len(axis_roles) != len(mesh_shape):
        raise ValueError(f"axis_roles {axis_roles} must have one entry per mesh axis {tuple(mesh_shape)}")
    result: dict[str, NodeStrategies] = {}
    experts = expert_weights(tg) if {AxisRole.EXPERT, AxisRole.TENSOR} & set(axis_roles) else frozenset()
    nest = nest_axes(mesh_shape, axis_roles) if nest is None else nest
    for node in tg.graph.nodes:
        checkpoint()  # on a search's worker thread: only while the search waits (passes/background.py)
        if only is not None and node.name not in only:
            continue
        info = infos[node.name]
        pinned = {
            a: AxisOption(
                f[node.name].out[0],
                tuple(x[0] for x in f[node.name].ins),
                f[node.name].via[0] if f[node.name].via else None,
            )
            for a, f in (fixed or {}).items()
            if node.name in f
        }
        if regions and node.name in regions:
            pinned = _region_pins(regions[node.name], mesh_shape, axis_roles)
        if node.op == "placeholder":
            strategies = expand(placeholder_options(info.shape), 0, info.shapes, [], mesh_shape, pinned, nest)
            strategies = [
                s for s in strategies if _placeholder_allowed(s.out, info, axis_roles, experts, mesh_shape)
            ]
            if not strategies:
                raise NoPlanFitsError(
                    f"{info.role.value} {info.target} of shape {info.shape} has no placement allowed by axis roles "
                    f"{[r.value for r in axis_roles]} on mesh {tuple(mesh_shape)} (dims must divide evenly); "
                    "use another mesh shape or AxisRole.AUTO"
                )
            result[node.name] = NodeStrategies(node, strategies, [], True)
        elif node.op == "call_function":
            if node.target is operator.getitem:
                continue  # aliases its producer's placement; see solver.resolve_source
            ins = tensor_inputs(node)
            in_shapes = [tuple(a.meta["val"].shape) for a in ins]
            rule = RULES.get(node.target)
            options = axis_options(node, mesh_shape)
            if rule is None and not options:
                name = str(node.target)
                if name not in _warned_fallback:
                    _warned_fallback.add(name)
                    log.info("no sharding rule or DTensor strategy for %s: replicated", name)
            strategies = expand(options, len(ins), info.shapes, in_shapes, mesh_shape, pinned, nest)
            if nest:
                strategies = [s for s in strategies if _nest_ok(node, s, mesh_shape)]
            if options and not (regions and node.name in regions):
                strategies += grid_strategies(
                    node, options, info.shapes, in_shapes, mesh_shape, pinned, axis_roles
                )
            if node.target is SDPA:
                strategies = _attention_strategies(
                    strategies, in_shapes, mesh_shape, axis_roles, seq_attention
                )
            elif node.target is MOE:
                strategies = experts_strategies(strategies, mesh_shape, axis_roles, node.meta.get(NODES_META))
            result[node.name] = NodeStrategies(node, strategies, ins, rule is not None or bool(options))
    return result


SDPA = aten.scaled_dot_product_attention.default


def grid_strategies(
    node: fx.Node,
    options: list[AxisOption],
    out_shapes: Sequence[Sequence[int]],
    in_shapes: Sequence[Sequence[int]],
    mesh_shape: Sequence[int],
    pinned: dict[int, AxisOption] | None = None,
    axis_roles: Sequence[AxisRole] | None = None,
) -> list[Strategy]:
    """A matmul's 2D strategies (each ``Matmul2D`` algorithm, ``rules/matmul.py:GRID_OPTIONS``):
    the pair of options on every ordered pair of mesh axes of one size ``q >= 2`` whose role
    leaves weights split (``AUTO``, ``TENSOR``) and that nothing pins, the other axes taking any
    of the op's options (``expand``'s filters: every split divides, no dim split twice). A
    batch-like split on a third axis beside the grid, the weights whole on it, is Tesseract's
    2.5D layout (depth over the rows; the weights' gradients summed over the depth axis as data
    parallelism's are). The 3D strategies (``Matmul3D``, ``rules/matmul.py:GRID_3D_OPTIONS``) are
    offered on the same pairs where the mesh has a third axis of the same size ``q``: the cube's
    third direction, which splits the batch where the input has a batch-like dim beside the
    grid's (a 2-D input, GPT-2's Conv1D, has none: its rows take one axis)."""
    grid = GRID_OPTIONS.get(node.target)
    if grid is None:
        return []
    ctx = make_ctx(node)
    pairs = [pair for via in Matmul2D for pair in grid(ctx, via)]
    cube = [pair for via in Matmul3D for pair in GRID_3D_OPTIONS[node.target](ctx, via)]
    roles = tuple(axis_roles or (AxisRole.AUTO,) * len(mesh_shape))
    free = [
        a
        for a, n in enumerate(mesh_shape)
        if n >= 2 and roles[a] in (AxisRole.AUTO, AxisRole.TENSOR) and a not in (pinned or {})
    ]
    out: list[Strategy] = []
    for a, b in itertools.permutations(free, 2):
        if mesh_shape[a] != mesh_shape[b]:
            continue
        # 3D only where a third axis of the same size makes the grid one slice of a q x q x q cube
        depth = any(n == mesh_shape[a] for c, n in enumerate(mesh_shape) if c not in (a, b))
        for rows, cols in pairs + (cube if depth else []):
            pins = dict(pinned or {}) | {a: rows, b: cols}
            out += expand(options, len(in_shapes), out_shapes, in_shapes, mesh_shape, pins)
    return out


def _region_pins(option: AxisOption, mesh_shape: Sequence[int], axis_roles: Sequence[AxisRole]) -> dict:
    """A data-parallel region's node: its option on the data axis, Replicate on every other."""
    whole = AxisOption(R, (R,) * len(option.ins))
    return {
        a: option if role.splits_batch and n > 1 else whole
        for a, (n, role) in enumerate(zip(mesh_shape, axis_roles))
    }


def _attention_strategies(
    strategies: list[Strategy],
    in_shapes,
    mesh_shape: Sequence[int],
    axis_roles: Sequence[AxisRole],
    kind: SeqAttention | None,
) -> list[Strategy]:
    """Attention's strategies under the search's constraints: on a ``SEQUENCE`` axis its queries
    are split on the sequence (context parallelism), where any strategy does so; with ``kind``
    forced, a split sequence runs only by that algorithm."""
    seq = len(in_shapes[0]) - 2
    for a, role in enumerate(axis_roles):
        if role is AxisRole.SEQUENCE and mesh_shape[a] > 1:
            split = [s for s in strategies if is_shard(s.ins[0][a]) and s.ins[0][a].dim == seq]
            strategies = split or strategies
    if kind is not None:
        strategies = [s for s in strategies if _attention_is(s, in_shapes, mesh_shape, kind)]
    return strategies


def _attention_is(s: Strategy, in_shapes, mesh_shape: Sequence[int], kind: SeqAttention) -> bool:
    """Does attention strategy ``s`` split its queries' sequence only by ``kind`` (or not at all)?"""
    seq = len(in_shapes[0]) - 2
    for a, p in enumerate(s.ins[0]):
        if not (is_shard(p) and p.dim == seq and mesh_shape[a] > 1):
            continue
        via = s.via[a] if s.via else None
        if (via or SeqAttention.GATHER) is not kind:
            return False
    return True


def mutated_views(tg: TracedGraph) -> dict[str, tuple[fx.Node, fx.Node]]:
    """Nodes an in-place op writes into, and the views between them and their base, where some
    other op sees the write: each with (the in-place op, an op that sees its write).

    e.g. ``z = new_zeros(...); z[:, 1:].copy_(x)`` (T5's shift-right): ``z`` and the slice must be
    one storage for the copy to land in ``z``. A chain whose write no other op sees is not counted:
    whatever it is resharded into, the op's result is what later ops read. Another op sees it where
    it reads a link of the chain after the write, or takes a view of one (a view may be read later);
    one that reads a link before the write does not (a router's ``w = gather(...)`` summed, then
    ``w.div_(sum)``: Falcon's ``matmul(...).add_(attention)`` has no other reader at all).
    Placeholders are excluded: they are never resharded in place (they are parameters, buffers or
    inputs, which in-place ops do not touch in training)."""
    return written_in_place(tg.graph)


def takes_as_stored(user: fx.Node, inp: fx.Node, mutated: dict) -> bool:
    """Must ``user`` take ``inp`` in the placement ``inp`` is stored in (``mutated``: of
    ``mutated_views``)? It must where ``inp`` is a link of a chain an in-place op writes into and
    ``user`` is the next link (a view of it) or the op writing into it: a reshard between them would
    copy the storage and the write would be lost. The links and the writer may take any placement,
    all the same one (``passes/costs.py`` forbids the pairs that move it): z = new_empty(...);
    z[..., :d].copy_(a) runs on each rank's rows when z, its slice and a are split on the batch
    (DeepSeek-V3's MLA builds its queries so)."""
    if inp.name not in mutated:
        return False
    if user.name in mutated and user.target in VIEW_OPS and user.args and user.args[0] is inp:
        return True
    return any(a is inp for a in written_inputs(user))


def written_in_place(graph: fx.Graph) -> dict[str, tuple[fx.Node, fx.Node]]:
    """``mutated_views`` of the nodes of ``graph``."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    out: dict[str, tuple[fx.Node, fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        for arg in written_inputs(node):
            chain = []
            while isinstance(arg, fx.Node) and arg.op == "call_function":
                chain.append(arg)
                if arg.target not in VIEW_OPS:
                    break
                arg = arg.args[0]
            links = {node, *chain}
            sees = [
                u
                for n in chain
                for u in n.users
                if u not in links and (pos[u] > pos[node] or u.target in ALIASING_OPS)
            ]
            if sees:
                out.update((n.name, (node, sees[0])) for n in chain)
    return out


def _placeholder_allowed(
    spec: Spec,
    info: NodeInfo,
    axis_roles: Sequence[AxisRole],
    experts: frozenset[str] = frozenset(),
    mesh_shape: Sequence[int] | None = None,
) -> bool:
    """May a placeholder take ``spec`` under ``axis_roles``? ``experts``: the names of the experts'
    weights (split over an ``EXPERT`` axis, every other parameter whole there). An axis of one
    device (``mesh_shape``) holds the whole tensor whatever its role: its role asks nothing there
    (a (1, e) stage mesh of data x expert roles, its data axis of one rank)."""
    sizes = mesh_shape if mesh_shape is not None else (2,) * len(axis_roles)
    for p, role, n in zip(spec, axis_roles, sizes):
        if n == 1:
            if is_partial(p):
                return False
            continue
        if info.role is Role.INPUT:
            if role.splits_batch and not (is_shard(p) and p.dim == 0):
                return False
            if role is AxisRole.TENSOR and not is_replicate(p):
                return False
            if role is AxisRole.SEQUENCE and p != (Shard(1) if len(info.shape) >= 2 else R):
                return False
        elif info.role is Role.PARAM:
            if role is AxisRole.EXPERT and info.name in experts:
                if p != Shard(0):
                    return False
            elif role in (AxisRole.DATA, AxisRole.SEQUENCE, AxisRole.EXPERT) and not is_replicate(p):
                return False
            if (
                role is AxisRole.TENSOR
                and len(info.shape) >= 2
                and is_replicate(p)
                and info.name not in experts
            ):
                return False  # experts may stay whole on a tensor axis (split there on I: passes/rules/experts.py)
        if is_partial(p):
            return False
    return True


def variable_nodes(tg: TracedGraph) -> list[str]:
    """Nodes that carry a strategy choice: placeholders and ops (getitem follows its producer)."""
    return [
        n.name
        for n in tg.graph.nodes
        if n.op == "placeholder" or (n.op == "call_function" and n.target is not operator.getitem)
    ]


# normalization ops, as traced and as ``passes/fuse.py`` fuses them (``autopar::layer_norm``,
# ``autopar::rms_norm``): what sequence parallelism splits on the sequence
NORM_OPS = ("layer_norm", "rms_norm", "group_norm")


def whole_norms_on_tensor_axes(
    strats: dict[str, NodeStrategies], mesh_shape: Sequence[int], axis_roles: Sequence[AxisRole] | None
) -> dict[str, NodeStrategies]:
    """``strats`` without sequence parallelism (``SearchOptions.sequence_parallel=False``): each
    normalization op keeps only its strategies whose output is whole on every ``TENSOR`` axis of
    more than one rank (Megatron-LM without ``--sequence-parallel``: the tensor group's ranks each
    normalize the whole sequence). A norm with no such strategy keeps its own (never none)."""
    axes = [a for a, (n, r) in enumerate(zip(mesh_shape, axis_roles or ())) if r is AxisRole.TENSOR and n > 1]
    if not axes:
        return strats
    out = dict(strats)
    for name, ns in strats.items():
        if ns.node.op != "call_function" or not any(k in str(ns.node.target) for k in NORM_OPS):
            continue
        whole = [s for s in ns.strategies if all(is_replicate(s.out[a]) for a in axes)]
        if whole:
            out[name] = replace(ns, strategies=whole)
    return out
