r"""Pricing the memory-for-time trades (``autopar/trades.py``) and the ladder the search climbs.

Where they are decided: an **outer search around the ILP**, per mesh candidate. Each trade is one
choice for the whole step (not per op), there are few combinations, and each changes the
coefficients of the cost tables, not their structure: so every rung of the ladder below is the
same ILP on transformed tables (``apply_trades``), solved by ``passes/mesh_solve.py:solve_mesh``, and
what a trade costs that the tables cannot see until the placements are chosen (gathers exposed
behind compute, one block recomputed at a time) is priced on the solution (``passes/trade_terms.py:trade_terms``). An
ILP with the trades as variables would need products of trade and placement variables in every
memory row; the ladder keeps rows linear and each rung's solve as fast as the untraded one.

**The ladder** (``ladder``): rungs in order of the time they add, the first whose plan fits is
taken (a forced trade fixes its dimension):

    ZeRO 0 -> 1 -> 2 -> 3  (on data axes)  ->  + selective recompute  ->  + half the matmuls  ->  + full recompute
      ->  + micro-batches 2, 4, 8, ...  ->  + optimizer offload (ZeRO-2)  ->  + parameter offload (ZeRO-3)

and where memory binds, full recomputation of only the fewest blocks of each pipeline stage that
fit comes before full recomputation of every block (``Trades.recompute_blocks``, offered by
``passes/ladder.py:climb`` as it goes; ``partly_recomputed`` prices it).

ZeRO 1-2 cost (almost) nothing and save much; recomputation adds one forward of what it frees;
micro-batches add a collective's latency per micro-batch and the ZeRO-3 gathers again; offload
adds the host link's traffic. A rung whose memory lower bound (``memory_row.lower_bound_bytes``)
passes the limit is skipped without a solve.

**Prices** (per device; ``L`` the bytes of a parameter's local piece in its dtype, ``e`` its
elements, ``d`` the product of the data axes' sizes it is replicated over, ``q`` the optimizer's
state copies, ``b`` the master/optimizer bytes per element: 4 under mixed precision, else the
parameter's):

* parameter memory: ``e b`` (+ ``2e`` under mixed precision: the half copy the forward reads
  and backward keeps, ``codegen/local_params.py``) below ZeRO-2; from ZeRO-2 (FSDP2) a shard ``e b / d`` and, under ZeRO-2 only,
  the gathered parameter kept through the step (``2e`` under mixed precision, FSDP2 gathering in
  the half type); gradients ``e b / (d if ZeRO >= 2)`` (ZeRO-1's reduce-scatters leave ``1/d`` of
  them once backward has reduced each bucket, but the whole gradients are built first: priced
  whole, an upper bound); optimizer state ``q e b / (d if ZeRO >= 1)``.
  Offloaded (FSDP2's ``CPUOffloadPolicy``), the shards, gradients and optimizer state are in host
  memory (counted against ``ClusterSpec.host_memory_bytes``): under ``Offload.OPTIMIZER`` the
  device keeps ZeRO-2's gathered parameters only, under ``Offload.PARAMETERS`` ZeRO-3's blocks in
  flight only (its transient). The optimizer step runs on ``1/d`` of the elements
  from ZeRO-1 (``compute.optimizer_step_time``).
* ZeRO-1 all-gathers the updated parameters (their half copies under mixed precision, what the
  next forward reads: ``passes/precision.py:compute_param_dtype``; the owner keeps its share's fp32
  master) after the step, behind the next forward
  (``codegen/zero_one.py``; Megatron-LM's ``--overlap-param-gather``): the gathers run back to
  back from the step's end, bucket ``j``'s readers start once it has landed, and the windows they
  hide behind are the first micro-batch's forward (the gathers run once a step), block by block:
  a block's forward compute and the forward half of its activations' collectives, over ``k``;
  the parameters outside blocks (embeddings, head) gathered first, behind nothing
  (``cost_model/overlap.py:gathers_ahead_exposed_s``, at the device's ``comm_overlap``). ZeRO-2 gathers them before forward
  (one FSDP2 group per block, prefetched as ZeRO-3's forward gathers are) and reduce-scatters
  gradients; the gradient reduction is priced as
  the all-reduce buckets it replaces (``passes/grad_sync.py``, partly hidden behind backward): a
  reduce-scatter moves half the bytes, but how much of the all-reduce is already hidden is the
  buckets' business, so no credit is taken (an upper bound); ZeRO-3 gathers
  each block's parameters in forward and again in backward, the next block's gather prefetched
  behind this block's compute: exposed ``g_1 + sum_i max(0, g_{i+1} - c_i)`` (``c`` a block's
  forward, resp. backward, compute), and two blocks' gathered parameters live at once (a
  transient). Parameters outside blocks are gathered exposed. Under ZeRO 2 and 3 a block's whole
  gradient (and the root group's) lives until its reduce-scatter (a transient), and with
  micro-batches every micro-batch reduce-scatters (gradients accumulate sharded).
* recomputation: FULL keeps of each block only its output (the next block's input); SELECTIVE
  keeps the outputs of its matmuls and attention (Megatron's selective recomputation: what is
  recomputed is cheap elementwise work); HALF_MATMULS keeps those of every other matmul of a block
  (torchtitan's op-level policy, ``passes/blocks.py:alternate_matmuls``) and recomputes the rest,
  the matmuls' forward FLOPs among them; the bytes freed leave the tables; backward rematerializes
  one block at a time (a transient: the block's kept bytes as NONE counts them); the time added is
  the forward of every recomputed op and half of the block's reshard time (its forward collectives
  run again: selective recomputation saves only the matmuls' and attention's outputs). Recomputing
  only the first ``N`` blocks of each stage mixes each class's rows of the two (``partly_recomputed``).
* micro-batches ``k``: activations, inputs and their transients are ``1/k``; gradients live through
  the whole step (they accumulate from the first micro-batch's backward); compute and activation
  collectives keep their total (less efficient small GEMMs are not priced); each activation
  collective pays its latency ``k`` times; ZeRO-3 gathers run per micro-batch; gradients are
  reduced once.
* mixed precision: every value in the dtype the device's autocast gives it (matmuls and attention
  in the half type, at its peak; fp32 masters make an embedding's output, and what it feeds, fp32:
  ``passes/precision.py:half_infos``); masters, gradients and optimizer state fp32.
* offload: under ``Offload.OPTIMIZER`` the gradients go to host and the updated parameters come
  back over ``ClusterSpec.host_link`` (``(L_grad + L_param) / bw``); under ``Offload.PARAMETERS``
  every gather of a block copies its shards up first and every reduce-scatter its gradients down,
  per block, partly behind compute (``passes/offload.py``). Under both the optimizer step runs on the host,
  tensor by tensor, its memory traffic at the host memory's bandwidth shared by the node's devices
  (``ClusterSpec.host_step_bandwidth``; exposed). On one H200 such a step ran in 269 ms
  (``benchmarks/bench_gpu_trades.py``); its host step priced at the PCIe link's bandwidth instead
  would make it 834 ms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autopar.cluster import ClusterSpec
from autopar.cost_model.compute import (
    node_time,
    optimizer_step_time,
)
from autopar.options import Optimizer, SearchOptions
from autopar.passes.analyze import NodeInfo
from autopar.passes.blocks import Block, alternate_matmuls
from autopar.passes.costs import CostTables
from autopar.passes.memory_row import EdgeTrade, lower_bound_bytes
from autopar.passes.precision import dtype_bytes
from autopar.passes.trace import Role, TracedGraph
from autopar.placement import is_replicate, is_shard, volume_factor
from autopar.trades import Offload, Precision, Recompute, Trades, ZeroStage

# ops whose outputs selective recomputation keeps (Megatron: recompute the cheap work between them)
MATMULS = frozenset(
    f"aten.{op}"
    for op in (
        "mm.default", "addmm.default", "bmm.default", "baddbmm.default", "linear.default",
        "matmul.default", "_scaled_dot_product_efficient_attention.default",
        "_scaled_dot_product_flash_attention.default", "_scaled_dot_product_flash_attention_for_cpu.default",
        "scaled_dot_product_attention.default", "_scaled_dot_product_cudnn_attention.default",
    )
)  # fmt: skip
MAX_MICRO_BATCHES = 64


@dataclass(frozen=True)
class StateBytes:
    """Per device: parameters, gradients, optimizer state (device and host) of a parameter piece."""

    param: float
    grad: float
    optimizer: float
    host: float


def state_bytes(
    elems: float, dtype: torch.dtype | None, d: int, trades: Trades, optimizer: Optimizer, trainable: bool
) -> StateBytes:
    """The bytes of one parameter piece of ``elems`` elements replicated over data axes of ``d``
    devices (module docstring)."""
    item = dtype_bytes(dtype)
    master = 4 if trades.precision.mixed else item
    z = trades.zero_stage
    if not trainable:
        return StateBytes(elems * item, 0.0, 0.0, 0.0)
    if z >= ZeroStage.GRADIENTS:  # FSDP2: a shard per rank, gathered (in the half type) for use
        # ZeRO-2 keeps the gathered parameter through the step; ZeRO-3's gathers are transients
        gathered = elems * (2 if trades.precision.mixed else item) if z == ZeroStage.GRADIENTS else 0.0
        shard, g = elems * master / d, elems * master / d
        o = optimizer.value * elems * master / d
        if trades.offload is not Offload.NONE:  # CPUOffloadPolicy: shards, gradients, state on host
            return StateBytes(gathered, 0.0, 0.0, shard + g + o)
        return StateBytes(gathered + shard, g, o, 0.0)
    p = elems * master
    if trades.precision.mixed:
        p += elems * 2  # the half copy the forward reads, kept for backward
    g = elems * master
    o = optimizer.value * elems * master / (d if z >= ZeroStage.OPTIMIZER else 1)
    return StateBytes(p, g, o, 0.0)


def piece_elems(info: NodeInfo, spec, mesh: Sequence[int]) -> float:
    """Elements of the piece of ``info``'s tensor one device holds under ``spec``."""
    return info.out_bytes / dtype_bytes(info.dtype) / volume_factor(spec, mesh) if info.dtype else 0.0


def param_state(
    info: NodeInfo, spec, mesh: Sequence[int], trades: Trades, optimizer: Optimizer
) -> StateBytes:
    """``state_bytes`` of parameter ``info``'s piece under ``spec``, ZeRO over the trades' data
    axes it is replicated on."""
    d = zero_size(spec, mesh, trades)
    return state_bytes(piece_elems(info, spec, mesh), info.dtype, d, trades, optimizer, info.requires_grad)


def zero_size(spec, mesh: Sequence[int], trades: Trades) -> int:
    """Over how many devices ZeRO shards a parameter's state under ``spec``. ZeRO-1
    (``codegen/zero_one.py``) shards it over every data axis it is whole on (``data_size``); FSDP2
    (ZeRO-2/3) over all of the trades' data axes together, so on several (expert parallelism beside
    data parallelism) it shards only what is whole on all of them, and leaves the experts split on
    one of them whole on the others (``codegen/zero.py:sharded_params``)."""
    axes = [a for a in trades.data_axes if mesh[a] > 1]
    if trades.zero_stage >= ZeroStage.GRADIENTS and len(axes) > 1:
        return math.prod(mesh[a] for a in axes) if all(is_replicate(spec[a]) for a in axes) else 1
    return data_size(spec, mesh, trades.data_axes)


def data_size(spec, mesh: Sequence[int], data_axes: Sequence[int]) -> int:
    """How many devices of the data axes hold the same piece under ``spec`` (ZeRO shards over them)."""
    return math.prod(mesh[a] for a in data_axes if is_replicate(spec[a]))


def in_block(tables: CostTables, blocks: Sequence[Block]) -> dict[str, Block]:
    """Each of the tables' nodes inside one of ``blocks``, with its block: kept on ``tables`` per
    list of blocks (every rung with recomputation asks again). Read-only."""
    hit = tables.__dict__.get("_in_block")
    if hit is not None and hit[0] is blocks:
        return hit[1]
    where = {n: b for b in blocks for n in b.nodes}
    got = {v: where[v] for v in tables.strategies if v in where}
    tables.__dict__["_in_block"] = (blocks, got, tuple(sorted(got)))
    return got


def _in_block_key(tables: CostTables, in_block: dict[str, Block]) -> tuple[str, ...]:
    """``in_block``'s nodes, sorted: the key of what depends on which nodes are recomputed."""
    hit = tables.__dict__.get("_in_block")
    return hit[2] if hit is not None and hit[1] is in_block else tuple(sorted(in_block))


def apply_trades(
    tables: CostTables,
    tg: TracedGraph,
    infos: dict[str, NodeInfo],
    trades: Trades,
    cluster: ClusterSpec,
    optimizer: Optimizer,
    blocks: Sequence[Block],
    cuts: tuple[int, ...] = (),
    stages: int = 1,
) -> CostTables:
    """The tables as the step runs under ``trades`` (module docstring). ``infos``: as the tables
    were built (``half_infos`` under mixed precision). ``cuts``, ``stages``: the pipeline's chunks
    and ranks, where ``trades`` recompute only some blocks of each stage
    (``Trades.recompute_blocks``: ``partly_recomputed``).

    A parameter's rows depend on the trades but recomputation (``_traded_params``), an
    activation's on recomputation and micro-batches alone (``_traded_activations``), an edge's on
    those two too (``_traded_edges``): each part is kept on ``tables`` per the trades it reads, as
    the climb applies many trades to one candidate's tables (a DeepSeek-V3 search, 1,900), and
    the result's rows are those parts' lists, shared between the rungs that read them. Read-only."""
    if _untraded(trades):
        return tables
    if trades.recompute_blocks is not None:
        return partly_recomputed(tables, tg, infos, trades, cluster, optimizer, blocks, cuts, stages)
    in_block = _recomputed(tables, blocks, trades)
    edges = _traded_edges(tables, infos, in_block, trades.micro_batches)
    return _traded_rows(tables, infos, trades, cluster, optimizer, blocks, in_block, edges)


def traded_lower_bound(
    tables: CostTables,
    infos: dict[str, NodeInfo],
    trades: Trades,
    cluster: ClusterSpec,
    optimizer: Optimizer,
    blocks: Sequence[Block],
) -> float:
    """``lower_bound_bytes(apply_trades(...))`` without building the traded edges: the climb
    bounds every rung and solves few (a DeepSeek-V3 search on 2,048 H100 bounded 1,900 rungs and
    solved 170), and the traded edges, rebuilt per recomputation and micro-batch count, were most
    of ``apply_trades``. The edges' part is priced from their smallest terms as the trades change
    them (``memory_row.EdgeTrade``): the same float (``tests/test_memory_bound.py``)."""
    if _untraded(trades):
        return lower_bound_bytes(tables)
    if trades.recompute_blocks is not None:
        return _partial_lower_bound(tables, infos, trades, cluster, optimizer, blocks)
    k = trades.micro_batches
    in_block = _recomputed(tables, blocks, trades)
    rows = _traded_rows(tables, infos, trades, cluster, optimizer, blocks, in_block, tables.edges)
    return lower_bound_bytes(rows, _edge_trade(tables, infos, in_block, k))


def _partial_lower_bound(
    tables: CostTables,
    infos: dict[str, NodeInfo],
    trades: Trades,
    cluster: ClusterSpec,
    optimizer: Optimizer,
    blocks: Sequence[Block],
) -> float:
    """``traded_lower_bound`` of a partly recomputed step (``partly_recomputed``'s mix) without
    building either side's traded edges: the node rows are the two sides' rows mixed, and an edge
    the whole side zeroes keeps ``1 - f`` of the none side's bytes, ``f`` the share of the class
    it feeds that recomputes (an edge both sides keep alike is the none side's), which
    ``EdgeTrade.kept`` applies to its least term: the same float as the mixed tables' bound
    (``tests/test_partial_recompute.py``). Building both sides' traded edges and mixing them took
    a DeepSeek-V3 search on 1,024 H100 10 s of its 78 s over 335 partial rungs' bounds."""
    chosen = trades.recomputed(len(blocks), (), 1)
    only = _one_side(trades, chosen, len(blocks))
    if only is not None:
        return traded_lower_bound(tables, infos, only, cluster, optimizer, blocks)
    whole, none = sides(trades)
    in_whole = _recomputed(tables, blocks, whole)
    rows_w = _traded_rows(tables, infos, whole, cluster, optimizer, blocks, in_whole, tables.edges)
    rows_n = _traded_rows(tables, infos, none, cluster, optimizer, blocks, {}, tables.edges)
    share = recomputed_share(tables, blocks, chosen)
    mixed = dataclasses.replace(_mix(rows_n, rows_w, share), edges=tables.edges)
    zeroed = _edge_trade(tables, infos, in_whole, trades.micro_batches)
    f = np.array([share.get(e.dst, 0.0) for e in tables.edges], float)
    kept = np.where(zeroed.zero, 1.0 - f, 1.0)
    trade = EdgeTrade(np.zeros_like(zeroed.zero), zeroed.divide, zeroed.k, kept)
    return lower_bound_bytes(mixed, trade)


def sides(trades: Trades) -> tuple[Trades, Trades]:
    """``trades`` with every block recomputed, and with none (``Trades.recompute_blocks``'s two
    sides: a block of a partly recomputed step is priced as one or the other)."""
    whole = dataclasses.replace(trades, recompute_blocks=None)
    return whole, dataclasses.replace(whole, recompute=Recompute.NONE)


def _one_side(trades: Trades, chosen: frozenset[int], blocks: int) -> Trades | None:
    """The side of ``sides(trades)`` that prices the step alone where ``chosen`` (the blocks
    recomputed) is every one of ``blocks`` or none; None where the step mixes both."""
    whole, none = sides(trades)
    if len(chosen) == blocks:
        return whole
    return None if chosen else none


def partial_sides(
    tables: CostTables,
    tg,
    infos: dict[str, NodeInfo],
    trades: Trades,
    cluster: ClusterSpec,
    optimizer: Optimizer,
    blocks: Sequence[Block],
) -> tuple[CostTables, CostTables] | None:
    """The traded tables of ``sides(trades)`` where ``trades`` recompute part of the blocks (None
    otherwise): what a pipeline prices each block on once its cut is known
    (``passes/pipeline.py:price_pipeline``)."""
    if trades.recompute_blocks is None or trades.recompute is Recompute.NONE:
        return None
    whole, none = sides(trades)
    return (
        apply_trades(tables, tg, infos, whole, cluster, optimizer, blocks),
        apply_trades(tables, tg, infos, none, cluster, optimizer, blocks),
    )


def partly_recomputed(
    tables: CostTables,
    tg,
    infos: dict[str, NodeInfo],
    trades: Trades,
    cluster: ClusterSpec,
    optimizer: Optimizer,
    blocks: Sequence[Block],
    cuts: tuple[int, ...] = (),
    stages: int = 1,
) -> CostTables:
    """The tables under ``trades`` where they recompute only the first ``trades.recompute_blocks``
    blocks of each of ``stages`` ranks, the chunks cut at ``cuts`` (``Trades.recomputed``), the others kept whole as
    ``Recompute.NONE`` keeps them.

    Repeated blocks share their rows (``passes/coarsen.py``: a class's row is the sum over its
    ``n`` members, one per block), so a class whose members lie ``r`` in recomputed blocks and
    ``n - r`` in kept ones is priced as that mix: ``r / n`` of its row with every block recomputed
    and ``(n - r) / n`` of its row with none, per strategy, and so each edge by the class of the
    node it feeds. Every term of a row is a sum over the members (seconds, kept bytes), so the
    mix is exact for sums; the memory row, a sum of what is kept, is then an upper bound of the
    step's peak wherever in the step the kept blocks lie (Megatron recomputes the first ones).
    No block recomputed gives the ``NONE`` tables, every block the whole mode's, as they are."""
    chosen = trades.recomputed(len(blocks), cuts, stages)
    only = _one_side(trades, chosen, len(blocks))
    if only is not None:
        return apply_trades(tables, tg, infos, only, cluster, optimizer, blocks)
    w, k = partial_sides(tables, tg, infos, trades, cluster, optimizer, blocks)
    return _mix(k, w, recomputed_share(tables, blocks, chosen))


def recomputed_share(tables: CostTables, blocks: Sequence[Block], chosen: frozenset[int]) -> dict[str, float]:
    """Per class representative inside a block, the fraction of its members inside the blocks
    ``chosen`` (a member outside every block counts with its representative's block)."""
    inside = in_block(tables, blocks)
    where = {n: b.index for b in blocks for n in b.nodes}
    members = tables.classes.members if tables.classes else {}
    out = {}
    for v, blk in inside.items():
        ms = members.get(v, [v])
        out[v] = sum(1 for m in ms if where.get(m, blk.index) in chosen) / len(ms)
    return out


def _mix(none: CostTables, whole: CostTables, share: dict[str, float]) -> CostTables:
    """``none``'s rows mixed with ``whole``'s, ``share[v]`` of node ``v``'s (and of each edge
    into ``v``) from ``whole`` (``partly_recomputed``)."""

    def row(a: list, b: list, f: float) -> list:
        if a is b or f == 0.0:
            return a
        if f == 1.0:
            return b
        return [x if x == y or not (math.isfinite(x) and math.isfinite(y)) else (1 - f) * x + f * y
                for x, y in zip(a, b)]  # fmt: skip

    def rows(a: dict, b: dict) -> dict:
        return {v: row(r, b[v], share.get(v, 0.0)) if v in b else r for v, r in a.items()}

    def grid(a, b, f):
        if a is None or b is None or a is b:
            return a
        return [row(x, y, f) for x, y in zip(a, b)]

    edges = []
    for e0, e1 in zip(none.edges, whole.edges):
        f = share.get(e0.dst, 0.0)
        if e0 is e1 or f == 0.0:
            edges.append(e0)
        elif f == 1.0:
            edges.append(e1)
        else:
            edges.append(
                dataclasses.replace(
                    e0, cost=grid(e0.cost, e1.cost, f), mem=grid(e0.mem, e1.mem, f),
                    copy=grid(e0.copy, e1.copy, f), keep=grid(e0.keep, e1.keep, f),
                    peak=grid(e0.peak, e1.peak, f),
                )
            )  # fmt: skip
    return dataclasses.replace(
        none, node_cost=rows(none.node_cost, whole.node_cost), node_mem=rows(none.node_mem, whole.node_mem),
        node_peak=rows(none.node_peak, whole.node_peak), grad_mem=rows(none.grad_mem, whole.grad_mem),
        step_peak=rows(none.step_peak, whole.step_peak), edges=edges, node_keep={}, peak_at={}, mem_at={},
    )  # fmt: skip


def _untraded(trades: Trades) -> bool:
    """``trades`` change nothing in the tables: no trade, precision as the parameters, no data axes."""
    return trades == Trades(precision=Precision.PARAM) and not trades.data_axes


def _recomputed(tables: CostTables, blocks: Sequence[Block], trades: Trades) -> dict[str, Block]:
    """The nodes ``trades`` recompute, with their blocks (none without recomputation)."""
    return in_block(tables, blocks) if trades.recompute is not Recompute.NONE else {}


def _edge_trade(tables: CostTables, infos: dict[str, NodeInfo], in_block: dict, k: int) -> EdgeTrade:
    """Which of ``tables``' edges ``_traded_edges`` zeroes and divides (its rules, per edge)."""

    def make() -> EdgeTrade:
        params = {v for v in tables.strategies if infos[v].role in (Role.PARAM, Role.BUFFER)}
        zero, divide = [], []
        for e in tables.edges:
            src_param = e.src in params
            zero.append(e.dst in in_block and (src_param or e.src in in_block))
            divide.append(k > 1 and not src_param)
        return EdgeTrade(np.array(zero, bool), np.array(divide, bool), k)

    return _kept(tables, "_edge_trades", (_in_block_key(tables, in_block), k), make)


def _traded_rows(
    tables: CostTables,
    infos: dict[str, NodeInfo],
    trades: Trades,
    cluster: ClusterSpec,
    optimizer: Optimizer,
    blocks: Sequence[Block],
    in_block: dict[str, Block],
    edges: list,
) -> CostTables:
    """``tables`` with the nodes' rows traded (``apply_trades``) and ``edges``."""
    k = trades.micro_batches
    outs = _block_outputs(tables, blocks)
    params = _tradedparam_nodes(tables, infos, trades, cluster, optimizer)
    acts = _traded_activations(tables, infos, trades.recompute, k, in_block, outs, cluster, blocks)
    node_cost, node_mem, node_peak = {}, {}, {}
    for v in tables.node_cost:
        got = params.get(v) or acts.get(v)
        if got is None:  # a buffer: as built
            node_cost[v], node_mem[v] = tables.node_cost[v], tables.node_mem[v]
        else:
            node_cost[v], node_mem[v] = got[0], got[1]
    for v, row in tables.node_peak.items():
        got = acts.get(v)
        node_peak[v] = row if got is None else got[2]
    grad_mem = {v: params[v][2] if v in params else g for v, g in tables.grad_mem.items()}
    step_peak = {v: params[v][3] if v in params else p for v, p in tables.step_peak.items()}
    return dataclasses.replace(
        tables, node_cost=node_cost, node_mem=node_mem, node_peak=node_peak, grad_mem=grad_mem,
        step_peak=step_peak, edges=edges, node_keep={}, peak_at={}, mem_at={},
    )  # fmt: skip


def _block_outputs(tables: CostTables, blocks: Sequence[Block]) -> set[str]:
    hit = tables.__dict__.get("_block_outputs")
    if hit is not None and hit[0] is blocks:
        return hit[1]
    got = {n for b in blocks for n in b.outputs}
    tables.__dict__["_block_outputs"] = (blocks, got)
    return got


def _kept(tables: CostTables, name: str, key: tuple, make):
    """``make()`` kept on ``tables`` under ``name`` and ``key`` (the last ``_TRADED_PARTS_KEPT``)."""
    cache = tables.__dict__.setdefault(name, {})
    hit = cache.get(key)
    if hit is not None:
        return hit
    if len(cache) >= _TRADED_PARTS_KEPT:
        del cache[next(iter(cache))]
    got = cache[key] = make()
    return got


# how many variants of one table's parameter rows, and of its activation rows, are kept
_TRADED_PARTS_KEPT = 32


def _tradedparam_nodes(
    tables: CostTables, infos: dict[str, NodeInfo], trades: Trades, cluster: ClusterSpec, optimizer: Optimizer
) -> dict[str, tuple[list, list, list | None, list | None]]:
    """Each parameter's (seconds, bytes, gradient bytes, step temporaries) per strategy under
    ``trades``: they read its ZeRO stage, data axes, precision, offload and whether micro-batches
    accumulate the gradients, not its recomputation nor how many micro-batches."""
    key = (
        trades.zero_stage, trades.data_axes, trades.precision, trades.offload, trades.micro_batches > 1,
        optimizer, id(cluster.device), cluster.compute_slowdown,
    )  # fmt: skip

    def make():
        return {
            v: _param_rows(tables, infos[v], v, trades, cluster, optimizer)
            for v in tables.strategies
            if infos[v].role is Role.PARAM
        }

    hit = _kept(tables, "_traded_params", key, lambda: (cluster.device, make()))
    if hit[0] is not cluster.device:  # another device at a reused address
        tables.__dict__["_traded_params"][key] = hit = (cluster.device, make())
    return hit[1]


def _param_rows(tables: CostTables, info: NodeInfo, v: str, trades: Trades, cluster: ClusterSpec, optimizer):
    mesh = tables.mesh_shape
    n = tables.classes.count(v) if tables.classes else 1
    slow = cluster.compute_slowdown
    costs = list(tables.node_cost[v])
    mems = list(tables.node_mem[v])
    grads = list(tables.grad_mem[v]) if v in tables.grad_mem else None
    steps = list(tables.step_peak[v]) if v in tables.step_peak else None
    trainable = info.requires_grad
    for i, s in enumerate(tables.strategies[v]):
        vol = volume_factor(s.out, mesh)
        elems = piece_elems(info, s.out, mesh)
        d = zero_size(s.out, mesh, trades)
        sb = param_state(info, s.out, mesh, trades, optimizer)
        mems[i] = n * (sb.param + sb.optimizer)
        if grads is not None:
            grads[i] = n * sb.grad
            if (
                trades.micro_batches > 1
            ):  # accumulated over micro-batches: live from the first one's backward on
                mems[i] += grads[i]
                grads[i] = 0.0
        if trainable:
            master = 4 if trades.precision.mixed else dtype_bytes(info.dtype)
            shard = elems * master / (d if trades.zero_stage else 1)
            old = optimizer_step_time(info.out_bytes / vol, optimizer.value, cluster.device, optimizer.name)
            new = (
                0.0
                if trades.offload is not Offload.NONE  # on the host: trade_terms
                else optimizer_step_time(shard, optimizer.value, cluster.device, optimizer.name)
            )
            costs[i] += n * (new - old) * slow
            if steps is not None:
                steps[i] *= (
                    0.0 if trades.offload is not Offload.NONE else shard / max(info.out_bytes / vol, 1)
                )
    return costs, mems, grads, steps


def _traded_activations(
    tables: CostTables,
    infos: dict[str, NodeInfo],
    recompute: Recompute,
    k: int,
    in_block: dict[str, Block],
    outs: set[str],
    cluster: ClusterSpec,
    blocks: Sequence[Block],
) -> dict[str, tuple[list, list, list | None]]:
    """Each input's and activation's (seconds, bytes, transient bytes) per strategy under
    recomputation ``recompute`` of the blocks ``in_block`` and ``k`` micro-batches."""
    key = (
        recompute,
        k,
        _in_block_key(tables, in_block),
        id(cluster.device),
        cluster.compute_slowdown,
        id(blocks),
    )

    def make():
        again = (  # on a miss only: the cached rows already read it
            alternate_matmuls(blocks, lambda v: infos[v].target if v in infos else "")
            if recompute is Recompute.HALF_MATMULS
            else frozenset()
        )
        return {
            v: _activation_rows(
                tables,
                infos[v],
                v,
                recompute,
                k,
                in_block.get(v),
                v in outs,
                cluster,
                v in again,
            )  # fmt: skip
            for v in tables.strategies
            if infos[v].role not in (Role.PARAM, Role.BUFFER)
        }

    hit = _kept(tables, "_traded_activations", key, lambda: (cluster.device, blocks, make()))
    if hit[0] is not cluster.device or hit[1] is not blocks:  # others at reused addresses
        tables.__dict__["_traded_activations"][key] = hit = (cluster.device, blocks, make())
    return hit[2]


def _activation_rows(
    tables: CostTables,
    info: NodeInfo,
    v: str,
    recompute: Recompute,
    k: int,
    blk,
    keep_out: bool,
    cluster,
    again: bool = False,
):
    """Node ``v``'s (seconds, bytes, transient bytes) per strategy under ``recompute`` (``blk``: its
    block, None outside one; ``keep_out``: the block's output, kept; ``again``: a matmul that
    ``Recompute.HALF_MATMULS`` recomputes, ``passes/blocks.py:alternate_matmuls``)."""
    mesh = tables.mesh_shape
    n = tables.classes.count(v) if tables.classes else 1
    slow = cluster.compute_slowdown
    costs = list(tables.node_cost[v])
    mems = list(tables.node_mem[v])
    peaks = list(tables.node_peak[v]) if v in tables.node_peak else None
    for i, s in enumerate(tables.strategies[v]):
        m = mems[i]
        if blk is not None and info.role is not Role.INPUT:
            vol = volume_factor(s.out, mesh)
            if recompute is Recompute.FULL:
                m = n * info.out_bytes / vol if keep_out else 0.0
                costs[i] += n * _forward_s(info, tables, v, i, cluster) * slow
            else:  # selective: the matmuls' outputs (and attention's statistics) stay
                if (info.target in MATMULS and not again) or keep_out:
                    work = max([vol] + [volume_factor(x, mesh) for x in s.ins])
                    m = n * (
                        info.out_bytes / vol + (info.saved_temp_bytes / work if info.target in MATMULS else 0)
                    )
                else:
                    m = 0.0
                    costs[i] += n * _forward_s(info, tables, v, i, cluster) * slow
        # inputs and activations: per micro-batch
        m /= k
        if peaks is not None:
            peaks[i] /= k
        mems[i] = m
    return costs, mems, peaks


def _traded_edges(tables: CostTables, infos: dict[str, NodeInfo], in_block: dict, k: int) -> list:
    """``tables``' edges under recomputation of the blocks ``in_block`` and ``k`` micro-batches:
    what they hold and what their collectives cost then. They depend on no other trade, so the
    search's many trades on one table (ZeRO stages, offload, precision) share them: computed once
    per (blocks, k) and kept on ``tables``, the last ``_TRADED_EDGES_KEPT`` of them (a DeepSeek-V3's
    climb applied 1,501 trades, 60 ms each, most of it here). Read-only: a caller that changes an
    edge replaces it."""
    cache = tables.__dict__.setdefault("_traded_edges", {})
    key = (_in_block_key(tables, in_block), k)
    hit = cache.get(key)
    if hit is not None:
        return hit
    params = {v for v in tables.strategies if infos[v].role in (Role.PARAM, Role.BUFFER)}
    edges = []
    for e in tables.edges:
        e2 = e
        src_param = e.src in params
        inside = e.dst in in_block
        if inside and (src_param or e.src in in_block):
            zero = [[0.0] * len(row) for row in e.mem]
            # an activation's forward collectives run again (selective saves matmuls' outputs only);
            # a parameter's edge prices its gradient's reduction, which recomputation does not repeat
            add = 0.0 if src_param else 0.5
            e2 = dataclasses.replace(
                e2, mem=zero, copy=None if e.copy is None else zero,
                keep=None if e.keep is None else zero,
                cost=[[c * (1 + add) if math.isfinite(c) else c for c in row] for row in e.cost],
            )  # fmt: skip
        if k > 1 and not src_param:
            e2 = dataclasses.replace(
                e2, mem=[[m / k for m in row] for row in e2.mem],
                copy=None if e2.copy is None else [[m / k for m in row] for row in e2.copy],
                keep=None if e2.keep is None else [[m / k for m in row] for row in e2.keep],
                peak=None if e2.peak is None else [[m / k for m in row] for row in e2.peak],
            )  # fmt: skip
        edges.append(e2)
    if len(cache) >= _TRADED_EDGES_KEPT:  # bounded: a large model's edge tables are big
        del cache[next(iter(cache))]
    cache[key] = edges
    return edges


# how many (blocks, micro-batches) variants of one table's edges ``_traded_edges`` keeps
_TRADED_EDGES_KEPT = 24


def _forward_s(info: NodeInfo, tables: CostTables, v: str, i: int, cluster: ClusterSpec) -> float:
    """Seconds of one forward of node ``v`` under strategy ``i`` (a recomputation): kept on
    ``tables`` per (node, strategy, device), as every trade with recomputation asks again."""
    memo = tables.__dict__.setdefault("_forward_s", {})
    key = (v, i, id(cluster.device))
    hit = memo.get(key)
    if hit is None or hit[0] is not cluster.device:
        s = tables.strategies[v][i]
        k = s.work_divisor(tables.mesh_shape)
        t = node_time(info.flops, info.bytes, info.rate_dtype, cluster.device, k, False, op=info.target)
        hit = memo[key] = (cluster.device, t)
    return hit[1]


def param_nodes(infos: dict[str, NodeInfo], choice: dict[str, int]) -> set[str]:
    return {v for v in choice if infos[v].role in (Role.PARAM, Role.BUFFER)}


def batch_size(tg: TracedGraph, infos: dict[str, NodeInfo]) -> int | None:
    """The global batch: dim 0 of the inputs (None when inputs disagree or have no dims)."""
    dims = {infos[p.name].shape[0] for p in tg.placeholders if p.role is Role.INPUT and infos[p.name].shape}
    return dims.pop() if len(dims) == 1 else None


def micro_batch_ok(
    tg: TracedGraph, infos: dict[str, NodeInfo], choice: dict, tables: CostTables, k: int
) -> bool:
    """Every input still splits as the plan splits it when its batch is ``k`` times smaller."""
    if k == 1:
        return True
    b = batch_size(tg, infos)
    if b is None or b % k:
        return False
    for p in tg.placeholders:
        if p.role is not Role.INPUT or p.name not in choice:
            continue
        s = tables.strategies[p.name][choice[p.name]]
        parts = math.prod(n for q, n in zip(s.out, tables.mesh_shape) if is_shard(q) and q.dim == 0)
        if (b // k) % parts:
            return False
    return True


# how much time each trade tends to add, for the order rungs are tried in (the solve prices them)
_RANK_ZERO = {
    ZeroStage.NONE: 0.0,
    ZeroStage.OPTIMIZER: 0.05,
    ZeroStage.GRADIENTS: 0.1,
    ZeroStage.PARAMETERS: 1.0,
}
_RANK_RECOMPUTE = {
    Recompute.NONE: 0.0,
    Recompute.SELECTIVE: 1.0,
    Recompute.HALF_MATMULS: 1.8,
    Recompute.FULL: 2.5,
}
_RANK_OFFLOAD = {Offload.NONE: 0.0, Offload.OPTIMIZER: 3.0, Offload.PARAMETERS: 3.5}


def zero_axes(mesh: Sequence[int], data_axes: tuple[int, ...]) -> tuple[int, ...]:
    """The axes ZeRO shards over: ``data_axes`` (the data axes of more than one device); on a mesh
    of one device, its first axis: FSDP2 over one device shards nothing, but it offloads, and
    offload is what frees device memory there (``ladder`` offers ZeRO there only with it)."""
    if data_axes:
        return tuple(data_axes)
    return (0,) if math.prod(mesh) == 1 else ()


def ladder(
    options: SearchOptions,
    data_axes: tuple[int, ...],
    precision: Precision,
    batch: int | None,
    has_blocks: bool,
    one_device: bool = False,
) -> list[Trades]:
    """The rungs the search tries, in the order of the time they tend to add (module docstring):
    every combination the options allow (a forced trade fixes its dimension), ZeRO only over
    data axes (``zero_axes``), recomputation only where the model has repeated blocks,
    micro-batches only where they divide the batch. ``one_device``: the mesh is one device, where
    ZeRO (over no one else) is offered only with offload, unless forced. Two data axes (expert
    parallelism beside data parallelism, the batch split on both) take ZeRO over both: a
    parameter's state is sharded over the data axes it is whole on (``zero_size``)."""
    if options.zero_stage and not data_axes:
        return []
    zs = (
        [options.zero_stage]
        if options.zero_stage is not None
        else list(ZeroStage)
        if data_axes
        else [ZeroStage.NONE]
    )
    if one_device and options.zero_stage is None:
        zs = [z for z in zs if z is not ZeroStage.OPTIMIZER]  # ZeRO-1 offloads nothing
    rs = [options.recompute] if options.recompute is not None else (
        list(Recompute) if has_blocks else [Recompute.NONE]
    )  # fmt: skip
    part = options.recompute_blocks if has_blocks else None
    if part is not None:  # forced: every rung recomputes that many blocks of each stage
        rs = [r for r in rs if r is not Recompute.NONE]
    if options.micro_batches is not None:
        ks = [options.micro_batches]
    else:
        ks = [1] + [k for k in (2, 4, 8, 16, 32, MAX_MICRO_BATCHES) if batch and batch % k == 0]
    os_ = [options.offload] if options.offload is not None else list(Offload)
    rungs = [
        Trades(r, k, precision, z, o, data_axes if z else (), part)
        for z in zs
        for r in rs
        for k in ks
        for o in os_
        if o.stage is None or z == o.stage  # each offload runs with its one ZeRO stage (FSDP2's)
        if not (one_device and z and o is Offload.NONE and options.zero_stage is None)
    ]
    return sorted(
        rungs,
        key=lambda t: (
            _RANK_ZERO[t.zero_stage] + _RANK_RECOMPUTE[t.recompute] + 0.7 * math.log2(t.micro_batches)
            + _RANK_OFFLOAD[t.offload]
        ),
    )  # fmt: skip
