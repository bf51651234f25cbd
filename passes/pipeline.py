r"""Pricing pipeline stages: the rows the ILP sees for one stage, then the stages, schedule and
micro-batches chosen on its solution.

**Where they are decided.** Like the memory-for-time trades (``passes/trades.py``), in the outer
search (``passes/search.py``): per stage count ``S`` (a divisor of the world, at most the model's
repeated blocks), the devices are ``S`` copies of a stage mesh of ``W / S`` devices (the pipeline
the outermost axis, across nodes where a stage fills nodes), and the ILP places every op on the
stage mesh once: repeated blocks share their variables (``passes/coarsen.py``), so a deep model
costs one solve per candidate whatever its depth, and every stage runs the same placements of its
blocks (Megatron-LM's and torchtitan's layouts do too). Alpa's stage DP lets stages differ; here
they are identical blocks, and the cut is priced exactly on the solution instead.

**The ILP's memory rows** (``stage_tables``) are those of the stage that holds the most: of each
repeated block's parameter state the share of ``ceil(L / S)`` of the ``L`` blocks, every parameter
outside the blocks (the embedding of the first stage and the head of the last counted together: an
upper bound), the blocks' activations of one micro-batch (``Trades.micro_batches`` = ``k``, already
``1/k`` in the traded tables) times the first stage's micro-batches in flight over ``S`` (1F1B's
first stage keeps ``min(S, k)`` micro-batches of its ``L / S`` blocks: the whole model's activations
of one micro-batch), the embeddings' activations times ``min(S, k)``, the head's once.

**On the solution** (``price_pipeline``), per block and per region outside the blocks (what comes
before the first block, what follows the last): its seconds (node and edge costs at the chosen
placements, the class totals shared equally among the members), its activation bytes per
micro-batch, its parameters' state (``trades.param_state``), the bytes crossing into it (the
block's inputs that need gradients, as the plan places them). Then, for every schedule the options
allow (GPipe, 1F1B, interleaved 1F1B and zero bubble with ``v`` chunks per rank):

* the cut: blocks into ``S v`` contiguous chunks minimizing the slowest chunk (the embeddings in
  the first, the head in the last; bisection over the bottleneck with a greedy fill), and with
  several chunks per rank also the cut that balances the ranks and each rank's chunks
  (``rank_balanced_cut``), the faster of the two taken;
* the step: ``cost_model/pipeline.py:simulate`` of the schedule's order, with per micro-batch a
  chunk's forward one third of its seconds (of its seconds before recomputation) and the backward
  the rest (zero bubble: half of it the input gradients, half the weights'), the activations sent over the pipeline axis's link (``SEND_RECV``) both ways; plus what
  runs once per step: the optimizer's step and the gradient reductions of the rank's parameters
  (the parameter nodes' seconds), and the trades' terms divided among the stages;
* memory per pipeline rank: the state of the parameters its chunks read, the peak of the
  activations its chunks keep in flight (the simulation's), the largest transient.

The fastest that fits is taken. Forward one third, backward two thirds is the matmul ratio
(``cost_model`` prices an op's forward and backward together). Every action of the schedule
pays ``PIPELINE_ACTION_S`` of host time; every micro-batch pays each op's
fixed seconds (``kernel_launch_s``, a GEMM's ``matmul_overhead_s``): a chunk's seconds per
micro-batch are its fixed part plus ``1/k`` of the rest; the rest is priced at the global batch's
efficiency (a roofline's GEMM of fewer rows is no less efficient).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import CommModel
from autopar.cost_model.pipeline import ScheduleError, schedule_figures
from autopar.options import SearchOptions
from autopar.passes.analyze import NodeInfo
from autopar.passes.blocks import Block, between_blocks
from autopar.passes.costs import CostTables
from autopar.passes.strategies import Strategy
from autopar.passes.trace import Role, TracedGraph
from autopar.passes.trades import MATMULS, param_state
from autopar.placement import volume_factor
from autopar.reshard import Collective
from autopar.trades import Pipeline, Schedule, Trades

# the most micro-batches a pipelined step is split into (Megatron runs GPT 1T with 512)
MAX_PIPELINE_MICRO_BATCHES = 512
# virtual stages (chunks per rank) tried for the interleaved schedule
VIRTUAL_STAGES = (2, 4)
# host seconds torch's schedule spends per action (a chunk's forward or backward of one micro-batch):
# posting and waiting on its sends and receives, the stage's bookkeeping, one autograd call;
# measured on the development VM's gloo ranks (benchmarks/bench_pipeline.py: ~150 us)
PIPELINE_ACTION_S = 1.5e-4
PRO, EPI = "pro", "epi"  # the regions before the first block and after the last


def stage_counts(world: int, n_blocks: int, options: SearchOptions) -> list[int]:
    """The pipeline stage counts the search tries beside 1 (none): the forced one; none where the
    options give a mesh or axis roles (they describe the whole world's mesh); else every divisor of
    the world from 2 to the number of repeated blocks."""
    if options.pipeline_stages is not None:
        return [options.pipeline_stages] if options.pipeline_stages > 1 else []
    if options.mesh_shape is not None or options.axis_roles is not None:
        return []  # a mesh (or its roles) given for the whole world: pipeline_stages= forces stages
    return [s for s in range(2, min(world, n_blocks) + 1) if world % s == 0]


def stage_cluster(cluster: ClusterSpec, stages: int) -> ClusterSpec | None:
    """The cluster one stage's mesh sees: ``W / S`` devices, whole nodes when it spans several
    (None where a stage would split a node's devices unevenly)."""
    m = cluster.world_size // stages
    dpn = cluster.devices_per_node
    if m >= dpn:
        if m % dpn:
            return None
        return cluster.with_overrides(nodes=m // dpn)
    if dpn % m:
        return None
    return cluster.with_overrides(nodes=1, devices_per_node=m)


def micro_batch_counts(batch: int | None, parts: int, stages: int, options: SearchOptions) -> list[int]:
    """Micro-batch counts for a pipeline: the forced one, else the divisors ``k`` of the batch
    whose micro-batches still split over ``parts`` devices, at least ``stages`` where the batch
    allows (fewer leave ranks idle), largest first."""
    if options.micro_batches is not None:
        return [options.micro_batches]
    if not batch:
        return [1]
    ks = [
        k
        for k in range(1, min(batch, MAX_PIPELINE_MICRO_BATCHES) + 1)
        if batch % k == 0 and (batch // k) % parts == 0
    ]
    big = [k for k in ks if k >= stages]
    return sorted(big or ks, reverse=True)


def schedules(options: SearchOptions, stages: int, n_blocks: int, k: int) -> list[tuple[Schedule, int]]:
    """(schedule, chunks per rank) pairs to price: the options' or every one torch runs here."""
    forced = options.schedule
    out = []
    for s in (Schedule.ONE_F_ONE_B, Schedule.GPIPE, Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE):
        if forced is not None and s is not forced:
            continue
        if s.multi_chunk:
            vs = [options.virtual_stages] if options.virtual_stages else list(VIRTUAL_STAGES)
            out += [(s, v) for v in vs if v > 1 and stages * v <= n_blocks and k % stages == 0]
        elif options.virtual_stages in (None, 1):
            out.append((s, 1))
    return out


def in_flight(schedule: Schedule, stages: int, k: int) -> float:
    """The first stage's micro-batches in flight under ``schedule`` (an interleaved rank keeps up
    to about ``2 S`` chunks of half the size: priced as 1F1B's in the ILP's rows, exactly after)."""
    return float(k) if schedule is Schedule.GPIPE else float(min(stages, k))


# -- the ILP's rows ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Regions:
    """Where each traced node runs: a block's index, ``PRO`` or ``EPI``; parameters: every region
    that reads them."""

    node: dict[str, int | str]
    param: dict[str, tuple[int | str, ...]]
    blocks: int

    @classmethod
    def of(cls, tg: TracedGraph, blocks: Sequence[Block]) -> Regions:
        block_of = {n: b.index for b in blocks for n in b.nodes}
        block_of.update(between_blocks(tg.graph, blocks))  # runs with the block before it
        first = min((i for i, n in enumerate(tg.graph.nodes) if n.name in block_of), default=0)
        node: dict[str, int | str] = {}
        for i, n in enumerate(tg.graph.nodes):
            node[n.name] = block_of.get(n.name, PRO if i < first else EPI)
        param: dict[str, tuple] = {}
        nodes = {n.name: n for n in tg.graph.nodes}
        for p in tg.placeholders:
            if p.role is Role.INPUT:
                continue
            where = []
            for u in nodes[p.name].users:
                r = node.get(u.name, EPI)
                if r not in where:
                    where.append(r)
            param[p.name] = tuple(where) or (PRO,)
        return cls(node, param, len(blocks))


def stage_tables(tables: CostTables, infos: dict[str, NodeInfo], regions: Regions, stages: int,
                 flight: float) -> CostTables:  # fmt: skip
    """The traded ``tables`` with the memory of the stage that holds the most (module docstring)."""
    share = math.ceil(regions.blocks / stages) / max(regions.blocks, 1)
    members = tables.classes.members if tables.classes else {v: [v] for v in tables.strategies}

    def factor(v: str) -> float:
        """The mean factor of ``v``'s members (the class total is spread evenly)."""
        info = infos[v]
        fs = []
        for m in members[v]:
            if info.role is Role.PARAM or info.role is Role.BUFFER:
                where = regions.param.get(m, (PRO,))
                fs.append(share if all(isinstance(r, int) for r in where) else 1.0)
            else:
                r = regions.node.get(m, EPI)
                fs.append(flight * share if isinstance(r, int) else flight if r == PRO else 1.0)
        return sum(fs) / len(fs)

    f = {v: factor(v) for v in tables.strategies}
    node_mem = {v: [m * f[v] for m in ms] for v, ms in tables.node_mem.items()}
    grad_mem = {v: [g * f[v] for g in gs] for v, gs in tables.grad_mem.items()}
    edges = []
    for e in tables.edges:
        k = f.get(e.dst, 1.0)
        if k == 1.0:
            edges.append(e)
            continue
        edges.append(
            replace(
                e, mem=[[m * k for m in row] for row in e.mem],
                copy=None if e.copy is None else [[m * k for m in row] for row in e.copy],
                keep=None if e.keep is None else [[m * k for m in row] for row in e.keep],
            )
        )  # fmt: skip
    return replace(
        tables, node_mem=node_mem, grad_mem=grad_mem, edges=edges, node_keep={}, peak_at={}, mem_at={}
    )


# -- pricing the solution -------------------------------------------------------------------------

# simulated up to this many micro-batches; more are extrapolated (``price_schedule``)
SIMULATED_MICRO_BATCHES = 64


@dataclass(frozen=True)
class Priced:
    """What the search needs of a schedule's timeline: its makespan, each rank's busy seconds and
    peak activation bytes."""

    makespan: float
    busy: tuple[float, ...]
    peak_bytes: tuple[float, ...]


def price_schedule(schedule: Schedule, stages: int, v: int, k: int, fwd, bwd, p2p=(), act=()) -> Priced:
    """``simulate_schedule``'s makespan, busy time and peaks (``schedule_figures``); past ``SIMULATED_MICRO_BATCHES``
    (and ``4 S v``) micro-batches, from two simulations ``S`` micro-batches apart, extended
    linearly to ``k``: after the warm-up each further ``S`` micro-batches repeat the same
    steady-state pattern, adding the same time and the same in-flight bytes (none, but for GPipe's),
    so the figures are linear in ``k`` there: the peaks exactly, the makespan within 1% (a slow
    link can shift the steady state's phase by part of an action; ``tests/test_pipeline_search.py``
    checks both against the full simulation). A 1T model's 512 micro-batches on 64 stages are 65,536 actions per
    schedule simulated in Python; the two shorter runs take a fraction of that."""
    base = max(SIMULATED_MICRO_BATCHES, 4 * stages * v)
    base += -base % stages  # a multiple of the stages: every schedule here runs it
    if k <= base + stages:
        return Priced(*schedule_figures(schedule, stages, v, k, fwd, bwd, p2p, act))
    a = Priced(*schedule_figures(schedule, stages, v, base, fwd, bwd, p2p, act))
    b = Priced(*schedule_figures(schedule, stages, v, base + stages, fwd, bwd, p2p, act))
    x = (k - base) / stages

    def ext(p: float, q: float) -> float:
        return p + (q - p) * x

    return Priced(
        ext(a.makespan, b.makespan),
        tuple(ext(p, q) for p, q in zip(a.busy, b.busy)),
        tuple(ext(p, q) for p, q in zip(a.peak_bytes, b.peak_bytes)),
    )


@dataclass
class PipelinePrice:
    """A pipeline priced on a solution: the decision, its step, per pipeline rank its peak bytes
    and state bytes, per chunk what the plan records (``Plan.stage_costs``), the schedule's
    figures (``Priced``)."""

    pipeline: Pipeline
    micro_batches: int
    step_s: float
    compute_s: float  # the busiest rank's compute
    bubble_s: float
    peak: tuple[float, ...]
    state: tuple[float, ...]
    stage_costs: tuple[dict, ...]
    timeline: Priced
    worst_state: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the fullest rank's param, grad, optimizer
    worst_activations: float = 0.0  # and its activations in flight at their peak


@dataclass
class _Region:
    fwd: float = 0.0  # seconds of the global batch's forward (before recomputation), times 3
    total: float = 0.0  # seconds of forward and backward (recomputation included)
    once: float = 0.0  # seconds once per step (the parameters' optimizer steps, reductions)
    act: float = 0.0  # activation bytes of one micro-batch (the traded tables')
    param: float = 0.0  # parameter state bytes: parameters, gradients, optimizer state
    grad: float = 0.0
    opt: float = 0.0
    recv: float = 0.0  # bytes of the global batch crossing into it (needing gradients)
    fixed_f: float = 0.0  # seconds its ops cost whatever their size (launches, GEMM overheads):
    fixed: float = 0.0  # paid by every micro-batch, forward and forward + backward


def _regions_costs(
    p: PipelineProblem, regions: Regions, chosen: frozenset[int] | None = None
) -> dict[int | str, _Region]:
    """Per block and per region outside the blocks: its seconds, bytes and state (``_Region``).
    ``chosen``: the blocks that recompute where ``p.trades`` recompute only some (``p.sides``): a
    member of a class in one of them is priced on the tables with every block recomputed, any
    other on those with none (else every member on ``p.tables``, the class total shared equally)."""
    infos, base, tables, picks, choice, trades = p.infos, p.base, p.tables, p.picks, p.choice, p.trades
    whole = none = tables
    if chosen is not None and p.sides is not None:
        whole, none = p.sides

    def side(m: str) -> CostTables:  # the tables member ``m`` (a node) is priced on
        return whole if chosen is not None and regions.node.get(m) in chosen else none

    mesh = tables.mesh_shape
    device, slow = p.cluster.device, p.cluster.compute_slowdown
    members = tables.classes.members if tables.classes else {v: [v] for v in tables.strategies}
    out: dict[int | str, _Region] = {r: _Region() for r in [PRO, EPI, *range(regions.blocks)]}
    for v, i in picks.items():
        info = infos[v]
        ms = members[v]
        if info.role is Role.PARAM or info.role is Role.BUFFER:
            for m in ms:
                where = regions.param.get(m, (PRO,))
                for r in where:
                    out[r].once += tables.node_cost[v][i] / len(ms) / len(where)
                if info.role is Role.PARAM and info.dtype and m in choice:
                    sb = param_state(infos[m], choice[m].out, mesh, trades, p.options.optimizer)
                    for r in where:  # a parameter several regions read: a copy where each runs
                        out[r].param += sb.param
                        out[r].grad += sb.grad
                        out[r].opt += sb.optimizer
            continue
        launch = device.kernel_launch_s + (device.matmul_overhead_s if info.target in MATMULS else 0.0)
        for m in ms:
            r = out[regions.node.get(m, EPI)]
            r.fixed_f += launch * slow
            r.fixed += launch * (3 if info.target in MATMULS else 2 if info.requires_grad else 1) * slow
            t = side(m)
            r.fwd += base.node_cost[v][i] / len(ms)
            r.total += t.node_cost[v][i] / len(ms)
            r.act += t.node_mem[v][i] / len(ms)
    params = {v for v in picks if infos[v].role in (Role.PARAM, Role.BUFFER)}
    for j, (e0, e) in enumerate(zip(base.edges, tables.edges)):
        if e.src not in picks:
            continue
        a = picks[e.src]
        if e.dst == "output" or e.dst not in picks:
            ms, b = members.get(e.src, [e.src]), None
        else:
            ms, b = members[e.dst], picks[e.dst]
        cost0 = e0.cost[a][b] if b is not None else min(e0.cost[a])
        for m in ms:
            em = side(m).edges[j] if b is not None else e
            cost = em.cost[a][b] if b is not None else min(em.cost[a])
            if not math.isfinite(cost):
                continue
            r = out[regions.node.get(m, EPI) if b is not None else EPI]
            if e.src in params:
                r.once += cost / len(ms)
            else:
                r.fwd += cost0 / len(ms)
                r.total += cost / len(ms)
                r.act += (em.mem[a][b] if b is not None else 0.0) / len(ms)
    for blk in p.blocks:
        for x in blk.inputs:
            info = infos.get(x)
            if info is None or not info.requires_grad or x not in choice or not info.dtype:
                continue
            out[blk.index].recv += info.out_bytes / volume_factor(choice[x].out, mesh)
    return out


def cut(costs: Sequence[float], pro: float, epi: float, chunks: int) -> tuple[int, ...]:
    """Cuts of blocks of ``costs`` seconds into ``chunks`` contiguous non-empty chunks (the first
    also runs ``pro``, the last ``epi``) that minimize the slowest chunk: bisection over the
    bottleneck, each tried by filling chunks greedily."""
    n = len(costs)

    def fill(limit: float) -> tuple[int, ...] | None:
        cuts, load, c = [], pro, 0
        for i, t in enumerate(costs):
            left = n - i  # blocks from i on
            must_cut = left == chunks - 1 - c  # one block for each chunk still to come
            if (load + t > limit or must_cut) and i > (cuts[-1] if cuts else 0) - (0 if cuts else 1):
                if c == chunks - 1:
                    return None
                if i == (cuts[-1] if cuts else 0):
                    return None  # an empty chunk
                cuts.append(i)
                c += 1
                load = 0.0
            load += t
            if load > limit and not must_cut:
                return None
        if c != chunks - 1 or load + epi > limit:
            return None
        return tuple(cuts)

    lo = max(max(costs, default=0.0), (sum(costs) + pro + epi) / chunks)
    hi = sum(costs) + pro + epi
    best = Pipeline.even_cuts(n, chunks)
    if fill(hi * (1 + 1e-9)) is None:
        return best
    for _ in range(50):
        mid = (lo + hi) / 2
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
        if hi - lo <= 1e-6 * hi:
            break
    got = fill(hi * (1 + 1e-9))
    return got if got is not None else best


def _level(extras: Sequence[float], budget: float) -> list[float]:
    """Water-filling: shares ``b_i = max(level - extras[i], 0)`` of ``budget`` (the shares of the
    lightest first), so that ``extras[i] + b_i`` is one level wherever ``b_i > 0``."""
    order = sorted(range(len(extras)), key=extras.__getitem__)
    level = 0.0
    for m in range(len(order), 0, -1):
        level = (budget + sum(extras[i] for i in order[:m])) / m
        if level >= extras[order[m - 1]]:
            break
    return [max(level - e, 0.0) for e in extras]


def rank_balanced_cut(costs: Sequence[float], pro: float, epi: float, stages: int, v: int) -> tuple[int, ...]:
    """Cuts of blocks of ``costs`` seconds into ``stages * v`` contiguous non-empty chunks, chunk
    ``c`` on rank ``c % stages`` (the first chunk also runs ``pro``, the last ``epi``), that give
    every rank the same work and, within a rank, its chunks the same: the blocks' seconds shared
    out by water-filling over the ranks (``pro`` and ``epi`` count on their ranks), then over each
    rank's chunks, and each cut placed where the blocks' running sum is nearest its chunk's share.

    With several chunks per rank the steady state runs at the busiest rank's pace and the bubble
    scales with the chunks' time (Narayanan et al. 2021, section 2.2.2): ``cut``'s slowest chunk can
    be the head's whatever the other chunks hold, and its greedy fill then packs the first chunks
    full and leaves the rest one block each, which no interleaved schedule runs well."""
    n, chunks = len(costs), stages * v
    extra = [0.0] * chunks
    extra[0] += pro
    extra[-1] += epi
    per_rank = _level([sum(extra[r::stages]) for r in range(stages)], sum(costs))
    share = [0.0] * chunks
    for r in range(stages):
        mine = list(range(r, chunks, stages))
        for c, b in zip(mine, _level([extra[c] for c in mine], per_rank[r])):
            share[c] = b
    cuts, target, at = [], 0.0, 0
    prefix = [0.0]
    for t in costs:
        prefix.append(prefix[-1] + t)
    for c in range(chunks - 1):
        target += share[c]
        lo, hi = at + 1, n - (chunks - 1 - c)  # a block for this chunk and each one after it
        at = min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - target), i))
        cuts.append(at)
    return tuple(cuts)


@dataclass(frozen=True)
class PipelineProblem:
    """A solution to price pipelines of ``stages`` stages on (``price_pipeline``): the graph and
    its nodes as the cost model priced them (``infos``), the tables without trades (``base``) and
    with them (``tables``: ``trades``, at its micro-batches, on one stage's devices), the ILP's
    picks and every node's strategy (``choice``), the model's repeated blocks, the whole
    ``cluster`` and the ``options``, ``limit`` bytes per device, ``extra_s`` the seconds the
    whole-model step adds beyond the tables (gradient buckets' adjustment, trade terms), divided
    among the stages, ``transient`` the bytes added to every rank's peak, and ``step_transient``
    those held beside a rank's state alone when the optimizer step ends (ZeRO-1's gathers in
    flight, ``GradSyncCost.step_gathers_bytes``: no activation is kept then). ``fixed``: price
    this pipeline (its schedule, chunks and cuts) as it is, whatever its memory
    (``autopar.reprice``)."""

    tg: TracedGraph
    infos: dict[str, NodeInfo]
    base: CostTables
    tables: CostTables
    picks: dict[str, int]
    choice: dict[str, Strategy]
    blocks: Sequence[Block]
    trades: Trades
    stages: int
    cluster: ClusterSpec
    options: SearchOptions
    limit: float
    extra_s: float
    transient: float
    fixed: Pipeline | None = None
    step_transient: float = 0.0
    # where ``trades`` recompute only some blocks (``Trades.recompute_blocks``): the traded tables
    # with every block recomputed and with none (``passes/trades.py:partial_sides``); each block is
    # priced on one or the other once a cut says which blocks lead their chunks
    sides: tuple[CostTables, CostTables] | None = None


def price_pipeline(p: PipelineProblem, why: list[str] | None = None) -> PipelinePrice | None:
    """The fastest pipeline of ``p.stages`` stages on the solution ``p.picks`` that fits
    ``p.limit`` per device (module docstring), or None; ``p.fixed`` priced as it is. ``why``:
    where given, what ruled each pipeline out is appended to it."""
    tables, picks, trades, stages, limit, fixed = p.tables, p.picks, p.trades, p.stages, p.limit, p.fixed
    regions = Regions.of(p.tg, p.blocks)
    costs = _regions_costs(p, regions)
    by_chosen: dict[frozenset[int], dict] = {}  # partial recomputation: the regions per chosen blocks
    k = trades.micro_batches
    mesh = tables.mesh_shape
    comm = CommModel(p.cluster, (stages, *mesh))
    top = max((row[picks[v]] for v, row in tables.node_peak.items() if v in picks), default=0.0) + p.transient
    n = regions.blocks
    best: PipelinePrice | None = None
    why = why if why is not None else []
    pairs = (
        [(fixed.schedule, fixed.virtual_stages)] if fixed is not None else schedules(p.options, stages, n, k)
    )
    if not pairs:
        why.append(
            f"no schedule runs {k} micro-batches on {stages} stages of {n} blocks (the interleaved ones need a "
            "multiple of the stages and two chunks of blocks per rank or more)"
        )

    def consider(schedule: Schedule, v: int, cuts: tuple[int, ...]) -> None:
        """``best`` becomes the pipeline of ``schedule`` with ``v`` chunks per rank cut at ``cuts``
        where it fits and is faster."""
        nonlocal best
        chunks = stages * v
        bounds = [0, *cuts, n]
        costs = by_chosen_costs(cuts)
        spans = [list(range(bounds[c], bounds[c + 1])) for c in range(chunks)]
        regs = [
            [*spans[c], *([PRO] if c == 0 else []), *([EPI] if c == chunks - 1 else [])]
            for c in range(chunks)
        ]
        # per micro-batch: the size-proportional part 1/k, the fixed part whole
        fixed_f = [sum(costs[r].fixed_f for r in rs) for rs in regs]
        fixed_s = [sum(costs[r].fixed for r in rs) for rs in regs]
        fwd = [max(sum(costs[r].fwd for r in rs) / 3 - ff, 0.0) / k + ff for rs, ff in zip(regs, fixed_f)]
        bwd = [
            max(sum(costs[r].total for r in rs) - fx, 0.0) / k + fx - f
            for rs, fx, f in zip(regs, fixed_s, fwd)
        ]
        fwd = [f + PIPELINE_ACTION_S for f in fwd]
        bwd = [b + PIPELINE_ACTION_S for b in bwd]
        act = [sum(costs[r].act for r in rs) for rs in regs]
        p2p = [comm.time(Collective.SEND_RECV, costs[bounds[c + 1]].recv / k, 0) for c in range(chunks - 1)]
        once = [0.0] * stages
        parts = [[0.0, 0.0, 0.0] for _ in range(stages)]  # per rank: parameters, gradients, optimizer
        for c, rs in enumerate(regs):
            rank = c % stages
            once[rank] += sum(costs[r].once for r in rs)
            for r in rs:
                parts[rank][0] += costs[r].param
                parts[rank][1] += costs[r].grad
                parts[rank][2] += costs[r].opt
        state = [sum(x) for x in parts]
        if schedule is Schedule.GPIPE and fixed is None:  # every micro-batch in flight: no need to simulate
            held = [k * sum(act[c] for c in range(r, chunks, stages)) for r in range(stages)]
            if max(state[r] + held[r] + top for r in range(stages)) > limit:
                why.append(f"{stages} stages, gpipe: its {k} micro-batches in flight pass the limit")
                return
        try:
            timeline = price_schedule(schedule, stages, v, k, fwd, bwd, p2p, act)
        except ScheduleError as e:  # torch's schedule does not run these counts (e.g. 1F1B with k < S)
            why.append(str(e))
            return
        step = timeline.makespan + max(once) + p.extra_s / stages
        peak = tuple(state[r] + max(timeline.peak_bytes[r] + top, p.step_transient) for r in range(stages))
        compute = max(timeline.busy)
        pipe = Pipeline(stages, schedule, v, cuts)
        fits = max(peak) <= limit or fixed is not None  # a given pipeline is priced as it is
        if not fits:
            why.append(f"{pipe.describe()}: its fullest rank needs {max(peak) / 2**30:.2f} GiB")
        if not fits or (best is not None and step >= best.step_s):
            return
        stage_costs = tuple(
            {
                "chunk": c,
                "rank": c % stages,
                "blocks": [bounds[c], bounds[c + 1]],
                "forward_s": fwd[c],
                "backward_s": bwd[c],
                "send_s": p2p[c] if c < chunks - 1 else 0.0,
                "activation_bytes": act[c],
                "state_bytes": sum(costs[r].param + costs[r].grad + costs[r].opt for r in regs[c]),
                "peak_memory_bytes": peak[c % stages],
            }
            for c in range(chunks)
        )
        worst = max(range(stages), key=peak.__getitem__)
        best = PipelinePrice(
            pipe, k, step, compute, timeline.makespan - compute, peak, tuple(state), stage_costs, timeline,
            tuple(parts[worst]), timeline.peak_bytes[worst],
        )  # fmt: skip

    def by_chosen_costs(cuts: tuple[int, ...]) -> dict:
        """The regions' costs with the blocks the cut ``cuts`` recomputes (the first
        ``trades.recompute_blocks`` of each rank's; every block's own where all or none do)."""
        if p.sides is None:
            return base_costs
        chosen = trades.recomputed(n, cuts, stages)
        if chosen not in by_chosen:
            by_chosen[chosen] = _regions_costs(p, regions, chosen)
        return by_chosen[chosen]

    base_costs = costs
    block_t = [costs[b].total for b in range(n)]
    for schedule, v in pairs:
        chunks = stages * v
        if chunks > n:
            continue
        if fixed is not None:
            options = [fixed.cuts]
        else:  # the least slowest chunk; with several chunks per rank, also the ranks balanced
            options = [cut(block_t, costs[PRO].total, costs[EPI].total, chunks)]
            if v > 1:
                options.append(rank_balanced_cut(block_t, costs[PRO].total, costs[EPI].total, stages, v))
        for cuts in dict.fromkeys(options):
            consider(schedule, v, cuts)
    return best
