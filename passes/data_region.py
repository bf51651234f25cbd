"""Data-parallel regions: ops that mix the batch's rows one by one, yet not as a whole.

Data parallelism (``AxisRole.DATA``) splits the batch over an axis and keeps it split through every
op: each op's rule must run on a slice of the rows. Some code is per sample only as a whole. A
token-choice mixture of experts (Qwen3-MoE) sorts the routed expert ids of every token, gathers the
tokens in expert order, runs a grouped matmul with per-expert offsets and scatters the results back
to their tokens: the sort, the gather and the grouped matmul each mix every token, so no op has a
rule on a slice of them; but run on one rank's tokens alone, the whole region returns exactly that
rank's rows of the whole batch's result (no capacity limit, no batch statistic).

A *region* is a set of op nodes ``N`` run on each rank as the model would run on its rows alone:

* its values are the rank's own quantities, not slices of the whole batch's (a sort of this
  rank's tokens); each op runs unchanged on them, with the sizes the model has on ``B / n`` rows
  (``LOCAL_CALL``: the node's arguments on those rows, ``localize``);
* what comes in from outside is a slice of the batch's rows (``Shard(d)``, ``d`` the dim that has
  them) or a value the same on every rank (``Replicate``: weights, what no row changes);
* what leaves to outside is, on every rank, that rank's rows of the whole batch's value: this is the
  claim, and it is checked (``check``), never assumed.

Which dim of each value has the rows, and the arguments a rank runs each op with, are read off the
model traced again on fewer rows (``passes/local_rows.py``).

Finding it (``find_region``), from the graph's structure only:

1. seeds: every op with some input or output that has rows and no strategy (its rules' or
   DTensor's, ``strategies.build_strategies`` on the data axis alone) that takes each input as the
   data role leaves it (its rows split, ``costs.data_parallel_pair``) and splits its output's rows;
2. closure: the seeds' getitems, the values they write into (an in-place op's target), the twins of
   repeated blocks (``coarsen``: twins share one strategy), and every input with rows that no user
   input reaches (``arange(B * S)``: a factory is sized by the batch; on a rank it is the model's on
   ``B / n`` rows, not a slice of the whole batch's);
3. check (``check``): the region's subgraph is run on inputs of the traced shapes (weights as
   they are; random values, integers that index a tensor of the region below the size of the dim
   they index, a rank's share of it where that dim has rows (``passes/index_bounds.py``: a
   ``scatter_`` over one group takes only 0), and once with each rank's rows larger than the next
   rank's, which any op that orders rows reorders) and once per rank on that rank's slices with its ``B / n``
   arguments; every output must equal the rank's rows of the whole run's (bit-exact for integers,
   ``RTOL``/``ATOL`` for floats). An output that does not is not a slice of the batch: the ops that
   read it join the region (those of the first such outputs: a later one may be wrong only through
   an earlier one), and the check runs again (``MAX_ROUNDS``).

A region is refused (the caller keeps today's error naming the first op that prevents the role)
when it reaches the graph's output, holds a random op, a value whose rows are on no one dim, or a
value without rows that carries a gradient inside the region (Megatron's "f" would sum it over the
ranks, as for a weight; a rank's own quantity must not be).

Each node of an accepted region takes one strategy (``region_option``): on the data axis its
placements say where its rows are (the cost model's local sizes and work), ``via`` says
``OwnRows.LOCAL`` (codegen runs ``LOCAL_CALL``, no collective), Replicate on any other axis.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor.placement_types import Replicate, Shard

from autopar.passes.analyze import NodeInfo, tensor_nbytes, tensor_vals
from autopar.passes.coarsen import Classes
from autopar.passes.index_bounds import index_bound
from autopar.passes.local_rows import ODD, Rows, local_call, localize, row_dims, tensors
from autopar.passes.rules import AxisOption, tensor_inputs, writes_inputs
from autopar.passes.strategies import NodeStrategies
from autopar.passes.trace import Role, TracedGraph
from autopar.passes.use_price import data_role_takes
from autopar.placement import OwnRows, Placement

R = Replicate()
MAX_ROUNDS = 32
RTOL, ATOL = 1e-4, 1e-5
TRIALS, DESCENDING = 3, 2  # check runs: random values twice, then rows in descending order
# the most the check may hold, counted from the traced values before anything runs: a model
# planned on the meta device has its region's weights made for the check (a large mixture of
# experts' would be tens of GiB), and every value of the region is computed for the whole batch
CHECK_BUDGET_BYTES = 2 * 2**30


@dataclass(frozen=True)
class DataRegion:
    """An accepted region: its op nodes (getitems included) and each one's option on the data axis."""

    nodes: frozenset[str]
    options: dict[str, AxisOption]  # every node but getitems
    parts: int  # ranks on the data axis


def _natural(dim) -> Placement:
    return Shard(dim) if isinstance(dim, int) else R


def region_option(node: fx.Node, dims: dict) -> AxisOption:
    """A region node's one option on the data axis: its rows where they are, ``OwnRows.LOCAL``."""
    ins = tuple(_natural(dims[a.name]) for a in tensor_inputs(node))
    return AxisOption(_natural(dims[node.name]), ins, via=OwnRows.LOCAL)


def _is_op(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is not operator.getitem


def seeds(
    tg: TracedGraph, dims: dict, strats: dict[str, NodeStrategies], infos: dict[str, NodeInfo]
) -> list[fx.Node]:
    """Ops with rows in or out that no strategy of theirs runs on a slice of the rows (step 1 of
    the module docstring). ``strats``: every node's strategies on the data axis alone."""
    params = {p.name for p in tg.placeholders if p.role in (Role.PARAM, Role.BUFFER)}
    found = []
    for node in tg.graph.nodes:
        if not _is_op(node) or node.name not in strats:
            continue
        ins = tensor_inputs(node)
        if any(dims.get(a.name) == ODD for a in ins) or dims.get(node.name) == ODD:
            continue  # no one dim to split: not a region's (the caller's error names it)
        if all(dims.get(a.name) is None for a in ins) and dims.get(node.name) is None:
            continue
        out = dims[node.name] if any(dims.get(a.name) is not None for a in ins) else None

        def fits(s, ins=ins, node=node, out=out) -> bool:
            # rows in, rows out: split as they came (a factory sized by the batch may be whole)
            if out is not None and s.out[0] != Shard(out):
                return False
            return all(
                data_role_takes(
                    node, i, infos[a.name], (_natural(dims[a.name]),), s.ins[i], a.name in params, (0,)
                )
                for i, a in enumerate(ins)
            )

        if not any(fits(s) for s in strats[node.name].strategies):
            found.append(node)
    return found


def find_region(
    tg: TracedGraph,
    rows: Rows,
    infos: dict[str, NodeInfo],
    strats: dict[str, NodeStrategies],
    classes: Classes | None = None,
    seed: int = 0,
) -> DataRegion | str:
    """The data-parallel region of ``tg`` on ``rows.parts`` ranks (module docstring), or why there
    is none. ``rows``: the model traced on fewer rows (``trace_rows``)."""
    parts = rows.parts
    dims = row_dims(tg, rows)
    start = seeds(tg, dims, strats, infos)
    if not start:
        return "no op to run on a rank's own rows"
    nodes = {n.name: n for n in tg.graph.nodes}
    from_input = _reached_from_inputs(tg)
    region: set[str] = {n.name for n in start}
    for _ in range(MAX_ROUNDS):
        _close(region, nodes, dims, from_input, classes)
        why = _inadmissible(region, nodes, dims, infos)
        if why:
            return why
        why = localize(tg, rows, region)
        if why:
            return why
        bad = check(tg, region, dims, parts, seed)
        if isinstance(bad, str):
            return bad
        if not bad:
            names = frozenset(region)
            options = {n: region_option(nodes[n], dims) for n in names if _is_op(nodes[n])}
            return DataRegion(names, options, parts)
        for name in _first_wrong(bad, nodes):
            for user in nodes[name].users:
                if user.op == "output":
                    return (
                        f"a region of {len(region)} ops around {start[0].target} (node {start[0].name}) "
                        f"returns {name}, which on a rank's rows is not that rank's rows of the whole batch's"
                    )
                region.add(user.name)
    return f"no region around {start[0].target} (node {start[0].name}) closes in {MAX_ROUNDS} rounds"


def _first_wrong(bad: list[str], nodes: dict) -> list[str]:
    """The wrong outputs that no other wrong output feeds: one that reads another may be wrong only
    because its input is (the ops that read the first join the region, then it is checked again)."""
    wrong = set(bad)
    fed: set[str] = set()
    for name in bad:
        stack, seen = [nodes[name]], set()
        while stack:
            for u in stack.pop().users:
                if u.name not in seen:
                    seen.add(u.name)
                    stack.append(u)
        fed |= seen & wrong
    return [n for n in bad if n not in fed]


def _reached_from_inputs(tg: TracedGraph) -> set[str]:
    inputs = {p.name for p in tg.placeholders if p.role is Role.INPUT}
    reached: set[str] = set()
    for node in tg.graph.nodes:
        if node.name in inputs or any(a.name in reached for a in node.all_input_nodes):
            reached.add(node.name)
    return reached


def _close(region: set[str], nodes: dict, dims: dict, from_input: set[str], classes: Classes | None) -> None:
    """Step 2 of the module docstring, to a fixed point."""
    changed = True
    while changed:
        before = len(region)
        for name in list(region):
            node = nodes[name]
            region.update(u.name for u in node.users if u.target is operator.getitem)
            if node.target is operator.getitem:
                region.add(node.args[0].name)
            if writes_inputs(node):
                for arg, formal in zip(node.args, node.target._schema.arguments):
                    written = formal.alias_info is not None and formal.alias_info.is_write
                    if written and isinstance(arg, fx.Node) and arg.op == "call_function":
                        region.add(arg.name)
            for a in node.all_input_nodes:
                # a value with rows that no input reaches (a factory sized by the batch) is the
                # model's on B / n rows inside the region, not a slice of the whole batch's
                if a.op == "call_function" and a.name not in from_input and isinstance(dims.get(a.name), int):
                    region.add(a.name)
            if classes is not None and name in classes.rep:
                region.update(classes.members[classes.rep[name]])
        changed = len(region) != before


def _inadmissible(region: set[str], nodes: dict, dims: dict, infos: dict[str, NodeInfo]) -> str | None:
    pos = {n: i for i, n in enumerate(nodes)}
    for name in sorted(region, key=pos.__getitem__):
        node = nodes[name]
        what = f"{node.target} (node {name})"
        if node.op != "call_function":
            return f"{what} is no op"
        if dims.get(name) == ODD:
            return f"{what} has its rows on no one dim"
        tags = getattr(node.target, "tags", ())
        if torch.Tag.nondeterministic_seeded in tags:
            return f"{what} is random"
        if dims.get(name) is None and infos[name].requires_grad and infos[name].dtype is not None:
            if infos[name].dtype.is_floating_point and any(u.name in region for u in node.users):
                return f"{what} is a value of the rank's rows without a batch dim that carries a gradient"
    return None


def _boundary(region: set[str], nodes: dict) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node]]:
    """The region's nodes, the nodes it reads from outside and those it gives outside, in graph order."""
    order = [n for n in nodes.values() if n.name in region]
    inputs: dict[str, fx.Node] = {}
    for n in order:
        for a in n.all_input_nodes:
            if a.name not in region:
                inputs.setdefault(a.name, a)
    for n in list(order):
        for a in pytree.tree_leaves(local_call(n)):
            if isinstance(a, fx.Node) and a.name not in region:
                inputs.setdefault(a.name, a)
    outputs = [n for n in order if any(u.name not in region for u in n.users) and tensors(n)]
    pos = {n: i for i, n in enumerate(nodes)}
    ins = sorted(inputs.values(), key=lambda a: pos[a.name])
    return order, ins, outputs


def _subgraph(
    gm: fx.GraphModule, order, inputs, outputs, call: Callable[[fx.Node], tuple[tuple, dict]]
) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for a in inputs:
        env[a.name] = g.get_attr(a.target) if a.op == "get_attr" else g.placeholder(a.name)

    def arg(a):
        if isinstance(a, fx.Node):
            return env[a.name]
        return torch.device("cpu") if isinstance(a, torch.device) else a

    for n in order:
        args, kwargs = call(n)
        env[n.name] = g.call_function(n.target, *pytree.tree_map(arg, (args, kwargs)))
    g.output([env[o.name] for o in outputs])
    return fx.GraphModule(gm, g)


def _value(
    tg: TracedGraph, node: fx.Node, dim, parts: int, trial: int, gen: torch.Generator, high: int = 2
) -> torch.Tensor:
    """A value for an input of the region in check ``trial``: a weight or buffer as it is, else of
    its traced shape and dtype, random (integers in [0, ``high``): valid ids, labels, and indices
    below the size of the dim they index, ``index_bounds``), and in the ``DESCENDING`` trial
    larger on each rank's rows than on the next rank's (a sort, or anything that orders the rows,
    moves the last rank's rows to the front: on a few rows, random keys may already be in order)."""
    t = _in_memory(tg, node)
    if t is not None:
        return t.detach()  # read, never written: no training op writes into a weight
    v = node.meta["val"]
    if v.dtype == torch.bool:
        return torch.rand(v.shape, generator=gen) < 0.5
    if v.dtype.is_floating_point:
        x = torch.randn(v.shape, generator=gen)
    else:
        x = torch.randint(0, high, v.shape, generator=gen)
    if trial == DESCENDING and isinstance(dim, int):
        shape = [1] * len(v.shape)
        shape[dim] = int(v.shape[dim])
        rank = torch.arange(int(v.shape[dim])) // (int(v.shape[dim]) // parts)
        if v.dtype.is_floating_point:
            x = x + 4.0 * (parts - 1 - rank).view(shape)
        else:
            x = (rank < (parts + 1) // 2).to(x.dtype).view(shape).expand(v.shape).clone() * min(1, high - 1)
    return x.to(v.dtype)


def _in_memory(tg: TracedGraph, node: fx.Node) -> torch.Tensor | None:
    """The weight or buffer ``node`` is, where it is in memory (not on the meta device): the check
    reads it as it is, and makes every other input."""
    role = next((p for p in tg.placeholders if p.name == node.name), None)
    if role is None or role.role is Role.INPUT:
        return None
    t = tg.state.get(role.target)
    return t if t is not None and t.device.type != "meta" else None


def _piece(t: torch.Tensor, dim, parts: int, r: int) -> torch.Tensor:
    return t.chunk(parts, dim)[r].contiguous() if isinstance(dim, int) else t


def _agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not want.dtype.is_floating_point:
        return torch.equal(got, want)
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    return torch.allclose(got, want, rtol=RTOL, atol=ATOL * scale, equal_nan=True)


def check(tg: TracedGraph, region: set[str], dims: dict, parts: int, seed: int = 0) -> list[str] | str:
    """Step 3 of the module docstring: the region's outputs that are not, on each rank, that rank's
    rows of the whole batch's in some trial (``TRIALS``; empty: the region holds), or why it could
    not run."""
    nodes = {n.name: n for n in tg.graph.nodes}
    order, inputs, outputs = _boundary(region, nodes)
    if not outputs:
        return "the region gives nothing outside"
    need = _check_bytes(tg, order, inputs)
    if need > CHECK_BUDGET_BYTES:
        return (
            f"checking the region around {order[0].target} (node {order[0].name}) would hold "
            f"{need / 2**30:.1f} GiB, over the {CHECK_BUDGET_BYTES / 2**30:.0f} GiB it may: not checked"
        )
    whole = _subgraph(tg.graph_module, order, inputs, outputs, lambda n: (n.args, n.kwargs))
    mine = _subgraph(tg.graph_module, order, inputs, outputs, local_call)
    weights = {p.name for p in tg.placeholders if p.role is not Role.INPUT}
    # an integer input that indexes a tensor of the region is drawn below the size it indexes
    high = {a.name: max(1, index_bound(a, region, dims, parts) or 2) for a in inputs}

    def fresh(a, v):  # an in-place op of the region may write into an activation it reads
        return v if a.name in weights else v.clone()

    bad: list[str] = []
    for trial in range(TRIALS):
        gen = torch.Generator().manual_seed(seed + trial)
        fed = [
            (a, _value(tg, a, dims[a.name], parts, trial, gen, high[a.name]))
            for a in inputs
            if a.op != "get_attr"
        ]
        try:
            with torch.no_grad():
                want = whole(*[fresh(a, v) for a, v in fed])
                got = [
                    mine(*[fresh(a, _piece(v, dims[a.name], parts, r)) for a, v in fed]) for r in range(parts)
                ]
        except Exception as e:  # noqa: BLE001 - a region that does not run is no region
            return f"the region around {order[0].target} (node {order[0].name}) does not run on a rank's rows: {e}"
        for k, o in enumerate(outputs):
            ok = all(_agree(got[r][k], _piece(want[k], dims[o.name], parts, r)) for r in range(parts))
            if not ok and o.name not in bad:
                bad.append(o.name)
    return bad


def _check_bytes(tg: TracedGraph, order: list[fx.Node], inputs: list[fx.Node]) -> float:
    """What ``check`` holds at most, from the traced values: the inputs it makes (``_in_memory``:
    a weight in memory is read as it is), and every value of the region, none freed, for the whole
    batch and again for the ranks' rows."""

    def nbytes(n: fx.Node) -> int:
        return sum(tensor_nbytes(t) for t in tensor_vals(n.meta.get("val")))

    made = [a for a in inputs if a.op != "get_attr" and _in_memory(tg, a) is None]
    return sum(nbytes(a) for a in made) + 2 * sum(nbytes(n) for n in order)


def region_parts(mesh_shape: Sequence[int], data_axes: Sequence[int]) -> int | None:
    """The ranks a region splits the batch over: a mesh with exactly one data axis of more than
    one device (a region runs on its rows; other axes replicate it), else None."""
    axes = [a for a in data_axes if mesh_shape[a] > 1]
    return math.prod(mesh_shape[a] for a in axes) if len(axes) == 1 else None


def plan_region(tg: TracedGraph, rows: Rows, names) -> dict[str, AxisOption] | str:
    """The options on the data axis that the region nodes ``names`` of a plan must have (their
    rows read off ``tg`` and ``rows``), their local arguments stored (``localize``); or why they
    cannot run on one rank's rows."""
    dims = row_dims(tg, rows)
    nodes = {n.name: n for n in tg.graph.nodes}
    why = localize(tg, rows, names)
    if why:
        return why
    return {n: region_option(nodes[n], dims) for n in names}
