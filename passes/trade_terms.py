"""What a solution's memory-for-time trades cost beyond its (traded) cost tables, priced once the
placements are chosen (``trade_terms``; the prices: ``passes/trades.py``'s docstring, **Prices**):
ZeRO's gathers and their exposure behind compute, offload's host traffic and step, recomputation's
rematerialized block, micro-batches' reduce-scatters; and a lower bound on them before a solve
(``terms_lower_bound``). Split out of ``passes/trades.py``, which transforms the tables."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import CommModel
from autopar.cost_model.compute import BACKWARD_FACTOR, host_optimizer_step_time, optimizer_step_time
from autopar.cost_model.overlap import gathers_ahead_exposed_s
from autopar.options import Optimizer
from autopar.passes.analyze import NodeInfo
from autopar.passes.blocks import Block
from autopar.passes.costs import CostTables
from autopar.passes.offload import in_flight_bytes, parameter_offload_seconds
from autopar.passes.precision import compute_param_dtype, dtype_bytes
from autopar.passes.trace import Role
from autopar.passes.trades import in_block, param_nodes, param_state, piece_elems
from autopar.reshard import Collective
from autopar.trades import Offload, Recompute, Trades, ZeroStage


def zero_one_axes(trades: Trades | None) -> tuple[int, ...]:
    """The data axes whose gradient buckets ZeRO-1 reduce-scatters into its shares
    (``passes/grad_sync.py:scatters``); none below or above ZeRO-1."""
    if trades is None or trades.zero_stage != ZeroStage.OPTIMIZER:
        return ()
    return tuple(trades.data_axes)


@dataclass
class TradeTerms:
    """What a solution's trades cost besides its tables: seconds per trade (added to the step),
    a transient (bytes, added to the peak), the bytes each trade saved on the device, and the
    bytes kept in host memory. ``in_tables``: seconds a trade costs that the tables already hold
    (recomputation's forwards), for the report only."""

    seconds: dict[str, float] = field(default_factory=dict)
    in_tables: dict[str, float] = field(default_factory=dict)
    transient: float = 0.0
    bytes_saved: dict[str, float] = field(default_factory=dict)
    host_bytes: float = 0.0

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def costs(self) -> dict[str, dict[str, float]]:
        keys = sorted(set(self.seconds) | set(self.in_tables) | set(self.bytes_saved))
        return {
            k: {
                "seconds": self.seconds.get(k, 0.0) + self.in_tables.get(k, 0.0),
                "bytes_saved": self.bytes_saved.get(k, 0.0),
            }
            for k in keys
        }


def trade_terms(
    base: CostTables,
    tables: CostTables,
    choice: dict[str, int],
    infos: dict[str, NodeInfo],
    trades: Trades,
    cluster: ClusterSpec,
    optimizer: Optimizer,
    blocks: Sequence[Block],
) -> TradeTerms:
    """What ``trades`` cost on the solution ``choice`` beyond ``tables`` (module docstring):
    ``base`` are the tables without trades (for what they saved)."""
    terms = TradeTerms()
    mesh = tables.mesh_shape
    comm = CommModel(cluster, mesh)
    classes = tables.classes
    members = classes.members if classes else {v: [v] for v in tables.strategies}
    k = trades.micro_batches
    pos_block = {n: b.index for b in blocks for n in b.nodes}

    # per block (by index): forward compute seconds, and the bytes NONE would keep
    block_c = [0.0] * len(blocks)
    block_kept = [0.0] * len(blocks)
    for v, i in choice.items():
        ms = members[v]
        bs = [pos_block[m] for m in ms if m in pos_block]
        if not bs:
            continue
        for b in bs:
            block_c[b] += base.node_cost[v][i] / len(ms)
            # what recomputation rematerializes: what the block keeps without it, less with it
            block_kept[b] += (base.node_mem[v][i] - tables.node_mem[v][i] * k) / len(ms)
    params = param_nodes(infos, choice)
    # per block: its activations' collectives, forward and backward (an edge's collective and its
    # transpose, the same size: half of it runs in forward)
    block_comm = [0.0] * len(blocks)
    for e0, e1 in zip(base.edges, tables.edges):  # what the block's ops keep of their inputs
        if e0.dst == "output" or e0.src not in choice or e0.dst not in choice:
            continue
        ms = members[e0.dst]
        a, b_ = choice[e0.src], choice[e0.dst]
        for b in [pos_block[m] for m in ms if m in pos_block]:
            block_kept[b] += (e0.mem[a][b_] - e1.mem[a][b_] * (1 if e0.src in params else k)) / len(ms)
            if e0.src not in params:
                block_comm[b] += e0.cost[a][b_] / len(ms)

    # ZeRO: gathers and their exposure, host traffic under offload
    z = trades.zero_stage
    gather = {b.index: 0.0 for b in blocks}  # half-type (or param-type) bytes of a block's params
    gather_out = 0.0
    grads_full = {b.index: 0.0 for b in blocks}  # a block's whole gradient before its reduce-scatter
    grads_out = 0.0
    step_elems_host = 0.0
    # under offload, the host's optimizer step, tensor by tensor (each tensor's own overhead), in
    # host memory; never faster than the device's own step (on CPU ranks the host is the device)
    host_step = 0.0
    axis_parts = [a for a in trades.data_axes if mesh[a] > 1]
    d = math.prod(mesh[a] for a in axis_parts) if axis_parts else 1
    read = compute_param_dtype(trades.precision)
    cast_elems = 0.0  # elements of the half copies cast each step (below ZeRO-2)
    for v, i in choice.items():
        info = infos[v]
        if info.role is not Role.PARAM or not info.requires_grad:
            continue
        elems = piece_elems(info, tables.strategies[v][i].out, mesh)
        if read is not None and info.dtype is not None and info.dtype.is_floating_point:
            cast_elems += elems * len(members[v])  # of its fp32 master (``codegen/zero.py:_upcast``)
        # FSDP2 gathers the half copies (``MixedPrecisionPolicy.param_dtype``), ZeRO-1 the half
        # copies of the shares it steps (``codegen/zero_one.py``): ``compute_param_dtype``
        gbytes = elems * (4 if trades.precision.mixed else dtype_bytes(info.dtype))  # the masters' too
        cbytes = elems * dtype_bytes(read if read is not None else info.dtype)
        for m in members[v]:
            b = next((blk.index for blk in blocks if m in blk.params), None)
            if b is None:
                gather_out += cbytes
                grads_out += gbytes
            else:
                gather[b] += cbytes
                grads_full[b] += gbytes
            step_elems_host += gbytes
        if trades.offload is not Offload.NONE:
            shard = gbytes / (d if z else 1)
            host_step += len(members[v]) * max(
                host_optimizer_step_time(shard, optimizer.value, cluster.host_step_bandwidth, optimizer.name),
                optimizer_step_time(shard, optimizer.value, cluster.device, optimizer.name),
            )

    def ag(nbytes: float) -> float:
        return sum(comm.time(Collective.ALL_GATHER, nbytes, a) for a in axis_parts)

    def rs(nbytes: float) -> float:
        return sum(comm.time(Collective.REDUCE_SCATTER, nbytes, a) for a in axis_parts)

    if z and axis_parts:
        if z == ZeroStage.OPTIMIZER:  # behind the first micro-batch's forward, block by block
            windows = [0.0] + [(c / (1 + BACKWARD_FACTOR) + m / 2) / k for c, m in zip(block_c, block_comm)]
            gathers = [ag(gather_out)] + [ag(gather[b.index]) for b in blocks]
            terms.seconds["zero"] = gathers_ahead_exposed_s(gathers, windows, cluster.device.comm_overlap)
            # the buckets in flight (their gathered parameters, at most ZERO_ONE_IN_FLIGHT x
            # ZERO_ONE_BUCKET_BYTES, and the shares concatenated to send) live from the step into
            # the next forward: the peak counts them at the step's position, not flat
            # (``passes/grad_sync.py:zero_one_gathers_bytes``, ``GradSyncCost.step_gathers_bytes``)
        else:  # FSDP2, one group per block and the root's
            g = [ag(gather[b.index]) for b in blocks]
            fwd = g[0] + sum(max(0.0, g[j + 1] - block_c[j] / 3) for j in range(len(g) - 1)) if g else 0.0
            bwd = (
                g[-1] + sum(max(0.0, g[j] - 2 * block_c[j + 1] / 3) for j in range(len(g) - 1)) if g else 0.0
            )
            if z == ZeroStage.GRADIENTS:  # gathered in forward, kept through backward
                terms.seconds["zero"] = k * (ag(gather_out) + fwd)
            else:  # and gathered again in backward: two blocks' gathered parameters live at once
                terms.seconds["zero"] = k * (2 * ag(gather_out) + fwd + bwd)
                terms.transient += sum(sorted(gather.values())[-2:]) + gather_out
            # each micro-batch's gradient is reduce-scattered into the shard (codegen/zero.py); a
            # block's whole gradient, and the root's, live until their reduce-scatter
            terms.seconds["zero"] += (k - 1) * rs(grads_out + sum(grads_full.values()))
            terms.transient += max(grads_full.values(), default=0.0) + grads_out
        # what the stage shards, against the same trades without ZeRO (precision's masters aside)
        unsharded = dataclasses.replace(trades, zero_stage=ZeroStage.NONE, data_axes=(), offload=Offload.NONE)
        sharded = dataclasses.replace(trades, offload=Offload.NONE)
        saved = 0.0
        for v, i in choice.items():
            info = infos[v]
            if info.role is Role.PARAM and info.dtype is not None:
                spec = tables.strategies[v][i].out
                sb0 = param_state(info, spec, mesh, unsharded, optimizer)
                sb1 = param_state(info, spec, mesh, sharded, optimizer)
                saved += len(members[v]) * (
                    sb0.param + sb0.grad + sb0.optimizer - sb1.param - sb1.grad - sb1.optimizer
                )
        terms.bytes_saved["zero"] = saved
    if trades.offload is not Offload.NONE:
        shard = step_elems_host / (d if z else 1)  # bytes of the master pieces this device steps
        link = cluster.host_link
        if trades.offload is Offload.OPTIMIZER:
            traffic = 2 * shard  # gradients down, parameters up
            terms.seconds["offload"] = traffic / link.bandwidth + link.latency + host_step
        else:  # streamed block by block, in forward and backward (passes/offload.py)
            g = [ag(gather[b.index]) for b in blocks] if axis_parts else [0.0] * len(blocks)
            terms.seconds["offload"] = host_step + parameter_offload_seconds(
                g, [grads_full[b.index] / d for b in blocks], block_c, grads_out / d, link, k
            )
            if not axis_parts:  # one device: ZeRO-3 gathered nothing, the copies are the blocks in flight
                terms.transient += in_flight_bytes(
                    list(gather.values()), gather_out, list(grads_full.values()), grads_out
                )
        terms.host_bytes = shard * (optimizer.value + 2)  # the master shards, gradients and state
        terms.bytes_saved["offload"] = terms.host_bytes
    if trades.recompute is not Recompute.NONE and blocks:
        # backward rematerializes one block at a time: what NONE keeps of it that this does not
        remat = max(0.0, max(block_kept)) / k
        terms.transient += remat
        inside = in_block(tables, blocks)
        edges = sum(
            e1.cost[choice[e0.src]][choice[e0.dst]] - e0.cost[choice[e0.src]][choice[e0.dst]]
            for e0, e1 in zip(base.edges, tables.edges)
            if e0.dst in inside and e0.src in choice
        )
        terms.in_tables["recompute"] = edges + sum(
            tables.node_cost[v][i] - base.node_cost[v][i] for v, i in choice.items() if v in inside
        )
    if trades.recompute is not Recompute.NONE or k > 1:
        saved = activation_saving(base, tables, choice, infos)
        if trades.recompute is not Recompute.NONE and blocks:
            saved -= remat
        terms.bytes_saved["recompute" if trades.recompute is not Recompute.NONE else "micro_batches"] = saved
    if read is not None and z < ZeroStage.GRADIENTS and cast_elems:
        # the half copies the forward reads (``codegen/local_params.py``): each fp32 master read and
        # its copy written once a step (kept for every micro-batch and a pipeline's chunks), twice
        # where a single forward's recomputation casts its blocks' anew in backward. FSDP2's casts
        # (ZeRO-2/3) run in its gathers' copy-in and are not priced here
        casts = 2 if trades.recompute is not Recompute.NONE and k == 1 else 1
        per_elem = 4 + read.itemsize
        terms.seconds["precision"] = casts * cast_elems * per_elem / cluster.device.memory_bandwidth
    if k > 1:
        n_calls = sum(  # graph edges that reshard (an entry stands for ``count`` of them)
            e.count
            for e in tables.edges
            if e.src in choice and e.dst in choice and e.cost[choice[e.src]][choice[e.dst]] > 0
        )
        lat = max((lk.latency for lk in comm.links), default=0.0)
        terms.seconds["micro_batches"] = (k - 1) * n_calls * lat
    return terms


def terms_lower_bound(
    tables: CostTables,
    infos: dict[str, NodeInfo],
    trades: Trades,
    cluster: ClusterSpec,
    blocks: Sequence[Block],
    least: dict | None = None,
) -> float:
    """A lower bound on ``trade_terms(...).total_s`` over every choice on ``tables``: the seconds
    of ZeRO-2/3 that no compute hides, each parameter's piece at its smallest over its strategies
    (the root group's gathers, once per micro-batch and twice under ZeRO-3; the first block's
    forward gather and, under ZeRO-3, the last block's backward one, each exposed before any
    compute; every micro-batch but the last reduce-scattering the whole gradient). Every other
    term of ``trade_terms`` is at least zero and is left out, so the bound is 0 below ZeRO-2.

    It holds because the collectives' time does not fall as bytes grow (latency plus bytes over
    bandwidth, the least of such algorithms: ``cost_model/comm.py``); a link calibrated with
    size ranges (``LinkSpec.ranges``) is not held to that, and the bound is then 0.
    ``least``: a cache of the smallest pieces, per candidate (whose rungs share its strategies).
    ``tests/test_trades_bound.py`` holds it under the terms of every choice."""
    z = trades.zero_stage
    mesh = tables.mesh_shape
    axis_parts = [a for a in trades.data_axes if mesh[a] > 1]
    if z < ZeroStage.GRADIENTS or not axis_parts or not blocks:
        return 0.0
    comm = CommModel(cluster, mesh)
    links = [comm.links[a] for a in axis_parts] + [cluster.intra_node, cluster.inter_node]
    if any(link.ranges for link in links):
        return 0.0
    least = {} if least is None else least
    key = ("terms_lower_bound", trades.precision.mixed)
    if key not in least:
        classes = tables.classes
        members = classes.members if classes else {v: [v] for v in tables.strategies}
        block_of = {p: b.index for b in blocks for p in b.params}
        gather = [0.0] * len(blocks)
        gather_out = grads = 0.0
        for v, specs in tables.strategies.items():
            info = infos[v]
            if info.role is not Role.PARAM or not info.requires_grad:
                continue
            elems = min(piece_elems(info, s.out, mesh) for s in specs)
            cbytes = elems * (2 if trades.precision.mixed else dtype_bytes(info.dtype))
            grads += len(members[v]) * elems * (4 if trades.precision.mixed else dtype_bytes(info.dtype))
            for m in members[v]:
                b = block_of.get(m)
                if b is None:
                    gather_out += cbytes
                else:
                    gather[b] += cbytes
        least[key] = (gather, gather_out, grads)
    gather, gather_out, grads = least[key]

    def ag(nbytes: float) -> float:
        return sum(comm.time(Collective.ALL_GATHER, nbytes, a) for a in axis_parts)

    k = trades.micro_batches
    if z == ZeroStage.GRADIENTS:
        exposed = ag(gather_out) + ag(gather[0])
    else:
        exposed = 2 * ag(gather_out) + ag(gather[0]) + ag(gather[-1])
    reduced = (k - 1) * sum(comm.time(Collective.REDUCE_SCATTER, grads, a) for a in axis_parts)
    return k * exposed + reduced


def activation_saving(
    base: CostTables, tables: CostTables, choice: dict[str, int], infos: dict[str, NodeInfo]
) -> float:
    """Bytes the activations' terms lost from ``base`` to ``tables`` under ``choice`` (each
    counted where the tables charge it, summed: an upper bound on what the peak loses)."""
    saved = sum(
        base.node_mem[v][i] - tables.node_mem[v][i]
        for v, i in choice.items()
        if infos[v].role not in (Role.PARAM, Role.BUFFER)
    )
    for e0, e1 in zip(base.edges, tables.edges):
        a = choice.get(e0.src)
        b = 0 if e0.dst == "output" else choice.get(e0.dst)
        if a is not None and b is not None:
            saved += e0.mem[a][b] - e1.mem[a][b]
    return saved
