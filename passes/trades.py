r"""Pricing the memory-for-time trades (``autopar/trades.py``) and the ladder the search climbs.

Where they are decided: an **outer search around the ILP**, per mesh candidate. Each trade is one
choice for the whole step (not per op), there are few combinations, and each changes the
coefficients of the cost tables, not their structure: so every rung of the ladder below is the
same ILP on transformed tables (``apply_trades``), solved by ``passes/mesh_solve.py:solve_mesh``, and
what a trade costs that the tables cannot see until the placements are chosen (gathers exposed
behind compute, one block recomputed at a time) is priced on the solution (``trade_terms``). An
ILP with the trades as variables would need products of trade and placement variables in every
memory row; the ladder keeps rows linear and each rung's solve as fast as the untraded one.

**The ladder** (``ladder``): rungs in order of the time they add, the first whose plan fits is
taken (a forced trade fixes its dimension):

    ZeRO 0 -> 1 -> 2 -> 3  (on data axes)  ->  + selective recompute  ->  + half the matmuls  ->  + full recompute
      ->  + micro-batches 2, 4, 8, ...  ->  + optimizer offload (ZeRO-2)  ->  + parameter offload (ZeRO-3)

ZeRO 1-2 cost (almost) nothing and save much; recomputation adds one forward of what it frees;
micro-batches add a collective's latency per micro-batch and the ZeRO-3 gathers again; offload
adds the host link's traffic. A rung whose memory lower bound (``memory_row.lower_bound_bytes``)
passes the limit is skipped without a solve.

**Prices** (per device; ``L`` the bytes of a parameter's local piece in its dtype, ``e`` its
elements, ``d`` the product of the data axes' sizes it is replicated over, ``q`` the optimizer's
state copies, ``b`` the master/optimizer bytes per element: 4 under mixed precision, else the
parameter's):

* parameter memory: ``e b`` (+ ``2e`` under mixed precision: the half copy autocast makes and
  backward keeps) below ZeRO-2; from ZeRO-2 (FSDP2) a shard ``e b / d`` and, under ZeRO-2 only,
  the gathered parameter kept through the step (``2e`` under mixed precision, FSDP2 gathering in
  the half type); gradients ``e b / (d if ZeRO >= 2)`` (ZeRO-1's reduce-scatters leave ``1/d`` of
  them once backward has reduced each bucket, but the whole gradients are built first: priced
  whole, an upper bound); optimizer state ``q e b / (d if ZeRO >= 1)``.
  Offloaded (FSDP2's ``CPUOffloadPolicy``), the shards, gradients and optimizer state are in host
  memory (counted against ``ClusterSpec.host_memory_bytes``): under ``Offload.OPTIMIZER`` the
  device keeps ZeRO-2's gathered parameters only, under ``Offload.PARAMETERS`` ZeRO-3's blocks in
  flight only (its transient). The optimizer step runs on ``1/d`` of the elements
  from ZeRO-1 (``compute.optimizer_step_time``).
* ZeRO-1 all-gathers the updated parameters (the fp32 masters under mixed precision, as the
  data-parallel all-reduce sends fp32 gradients: ``grad_dtype``) after the step, behind the next forward
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
  run again: selective recomputation saves only the matmuls' and attention's outputs).
* micro-batches ``k``: activations, inputs and their transients are ``1/k``; gradients live through
  the whole step (they accumulate from the first micro-batch's backward); compute and activation
  collectives keep their total (less efficient small GEMMs are not priced); each activation
  collective pays its latency ``k`` times; ZeRO-3 gathers run per micro-batch; gradients are
  reduced once.
* mixed precision: every value in the dtype the device's autocast gives it (matmuls and attention
  in the half type, at its peak; fp32 masters make an embedding's output, and what it feeds, fp32:
  ``half_infos``); masters, gradients and optimizer state fp32.
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
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec
from autopar.cost_model.comm import CommModel
from autopar.cost_model.compute import (
    BACKWARD_FACTOR,
    host_optimizer_step_time,
    node_time,
    optimizer_step_time,
)
from autopar.cost_model.overlap import gathers_ahead_exposed_s
from autopar.hardware import DeviceKind, per_kind
from autopar.options import Optimizer, SearchOptions
from autopar.passes.analyze import NodeInfo
from autopar.passes.blocks import Block, alternate_matmuls
from autopar.passes.costs import CostTables
from autopar.passes.half_reshard import casts_before_reshard
from autopar.passes.memory_row import EdgeTrade, lower_bound_bytes
from autopar.passes.offload import in_flight_bytes, parameter_offload_seconds
from autopar.passes.rules import tensor_inputs
from autopar.passes.trace import Role, TracedGraph
from autopar.placement import is_replicate, is_shard, volume_factor
from autopar.reshard import Collective
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


def _item(dtype: torch.dtype | None) -> int:
    return dtype.itemsize if dtype is not None else 0


def half_dtype(precision: Precision) -> torch.dtype:
    return torch.float16 if precision is Precision.FP16 else torch.bfloat16


# ZeRO-1's parameter all-gathers (``codegen/zero_one.py``): the bytes one gathers (the whole
# parameters of a bucket, every rank's shares), and how many run at once between a step and the
# forward reading them
ZERO_ONE_BUCKET_BYTES = 25 * 2**20
ZERO_ONE_IN_FLIGHT = 2


def grad_dtype(precision: Precision | None) -> torch.dtype | None:
    """The dtype of a floating parameter's gradient at run time where it is not the traced one:
    fp32 under mixed precision, whose parameters are fp32 masters (``codegen/zero.py``: a model
    traced in bf16 is upcast), so its data-parallel all-reduces and ZeRO-1's gathers send fp32."""
    return torch.float32 if precision is not None and precision.mixed else None


def zero_one_axes(trades: Trades | None) -> tuple[int, ...]:
    """The data axes whose gradient buckets ZeRO-1 reduce-scatters into its shares
    (``passes/grad_sync.py:scatters``); none below or above ZeRO-1."""
    if trades is None or trades.zero_stage != ZeroStage.OPTIMIZER:
        return ()
    return tuple(trades.data_axes)


def auto_precision(infos: dict[str, NodeInfo]) -> Precision:
    """The parameters' dtype for fp32 models (numerics as the user wrote them); bf16 mixed
    precision (fp32 masters and optimizer state) for half-precision ones, as they are trained."""
    dtypes = {i.dtype for i in infos.values() if i.role is Role.PARAM and i.requires_grad}
    return Precision.BF16 if dtypes and dtypes <= {torch.bfloat16, torch.float16} else Precision.PARAM


# CUDA autocast's op lists (torch's "Autocast Op Reference"), as a traced graph names them
# (overload packets): ops that run in the half type, and ops that run in fp32 whatever their inputs.
# The half type's also holds the fused output projection + loss and the mixture-of-experts op: the
# generated code casts their operands as autocast casts a linear's
# (kernels/cross_entropy.py, kernels/moe.py: autocast_operands)
AUTOCAST_HALF = frozenset(
    f"aten.{op}"
    for op in (
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "addr", "prelu",
        "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
) | {"autopar.linear_cross_entropy", "autopar.moe_experts"}  # fmt: skip
AUTOCAST_FP32 = frozenset(
    f"aten.{op}"
    for op in (
        "pow", "rsqrt", "reciprocal", "exp", "expm1", "log", "log1p", "log2", "log10", "acos", "asin", "cosh",
        "sinh", "tan", "erfinv", "softplus", "softmax", "_softmax", "log_softmax", "_log_softmax", "sum", "prod",
        "cumsum", "cumprod", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "norm",
        "linalg_vector_norm", "renorm", "dist", "cdist", "cross_entropy_loss", "nll_loss", "nll_loss_forward",
        "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss", "kl_div", "binary_cross_entropy_with_logits",
    )
)  # fmt: skip
# CPU autocast's fp32 ops (its own list: losses and a few reductions; ``pow``, softmax and the like
# keep their input's dtype there)
AUTOCAST_FP32_CPU = frozenset(
    f"aten.{op}"
    for op in (
        "prod", "cdist", "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "mse_loss",
        "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "margin_ranking_loss", "soft_margin_loss", "poisson_nll_loss",
    )
)  # fmt: skip
_CASTS = frozenset({"aten.to", "aten._to_copy", "prims.convert_element_type", "aten.type_as"})


# per device kind, its autocast's (half-type ops, fp32 ops): how ``torch.autocast(kind.value)``
# runs a traced graph's ops, which ``half_infos`` prices. A kind without an entry cannot be priced
# under mixed precision (UnsupportedDeviceKindError), never with another kind's lists.
AUTOCAST_BY_KIND: dict[DeviceKind, tuple[frozenset[str], frozenset[str]]] = {
    DeviceKind.CUDA: (AUTOCAST_HALF, AUTOCAST_FP32),
    DeviceKind.CPU: (AUTOCAST_HALF, AUTOCAST_FP32_CPU),
}


def autocast_device(cluster: ClusterSpec) -> DeviceKind:
    """The kind of device whose autocast the generated module runs under on ``cluster``
    (``cluster.device.kind``; ``codegen/zero.py`` autocasts on the runtime device's type)."""
    return cluster.device.kind


def _packet(target: str) -> str:
    return ".".join(str(target).split(".")[:2])


def half_infos(
    tg: TracedGraph, infos: dict[str, NodeInfo], precision: Precision, kind: DeviceKind
) -> dict[str, NodeInfo]:
    """Under mixed precision, every floating value in the dtype it runs in: the parameters are fp32
    masters and the graph runs under ``torch.autocast`` (``codegen/zero.py``), so, op by op, as
    the autocast of devices of ``kind`` does (``autocast_device``; its lists: ``AUTOCAST_BY_KIND``,
    UnsupportedDeviceKindError for a kind it lacks): its half-type ops (matmuls, attention) give
    the half type, its fp32 ops (CUDA's: ``pow``, ``rsqrt``, softmax, sums, losses, ...; the
    CPU's: losses) fp32, explicit casts what they cast to, and the
    rest the widest floating dtype among their inputs (a residual stream fed by an fp32 embedding
    stays fp32). Bytes (moved, kept, temporaries) follow the dtype. Parameters keep their traced
    dtype here (``apply_trades`` prices masters and copies). A value whose every use is an
    autocast GEMM moves through its reshards as its half copy (``NodeInfo.moved_dtype``,
    ``passes/half_reshard.py``). Halving every fp32 value instead prices a Llama's activations on an H200 at 7.7 GiB where a forward keeps 11.2 GiB
    (``benchmarks/bench_gpu_trades.py``)."""
    if not precision.mixed:
        return infos
    half = half_dtype(precision)
    where = "passes/trades.py AUTOCAST_BY_KIND"
    half_ops, fp32_ops = per_kind(AUTOCAST_BY_KIND, kind, "autocast op lists", where)
    runtime: dict[str, torch.dtype | None] = {}
    out = dict(infos)
    for node in tg.graph.nodes:
        info = infos.get(node.name)
        if info is None:
            continue
        traced = info.dtype
        if traced is None or not traced.is_floating_point:
            runtime[node.name] = traced
            continue
        if node.op == "placeholder":
            rt = torch.float32 if info.role is Role.PARAM else traced
        elif node.op != "call_function":
            rt = traced
        elif node.target is operator.getitem:  # an output of a multi-output op: as that op ran
            src = node.args[0]
            same = isinstance(src, fx.Node) and getattr(infos.get(src.name), "dtype", None) == traced
            rt = runtime.get(src.name) or traced if same else traced
        else:
            op = _packet(info.target)
            ins = [a for a in tensor_inputs(node) if runtime.get(a.name) is not None]
            # type promotion: tensors with dimensions decide over 0-dim ones
            ranked = [a for a in ins if infos[a.name].shape] or ins
            floats = {runtime[a.name] for a in ranked if runtime[a.name].is_floating_point}
            if op in half_ops:
                rt = half
            elif op in fp32_ops:
                rt = torch.float32
            elif op in _CASTS or not floats:
                rt = traced  # cast to what the trace says, or made from no floating input
            else:
                rt = max(floats, key=lambda d: (d.itemsize, d == traced))
        runtime[node.name] = rt
        # its reshards move the half copy every use casts it to (passes/half_reshard.py)
        moved = half if rt.itemsize > half.itemsize and casts_before_reshard(node) else None
        if info.role is Role.PARAM or (rt == traced and moved is None):
            continue
        r = rt.itemsize / traced.itemsize
        out[node.name] = dataclasses.replace(
            info, dtype=rt, bytes=int(info.bytes * r), saved_temp_bytes=int(info.saved_temp_bytes * r),
            grad_temp_bytes=int(info.grad_temp_bytes * r), moved_dtype=moved,
        )  # fmt: skip
    return out


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
    item = _item(dtype)
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
        p += elems * 2  # the half copy autocast makes, kept for backward
    g = elems * master
    o = optimizer.value * elems * master / (d if z >= ZeroStage.OPTIMIZER else 1)
    return StateBytes(p, g, o, 0.0)


def piece_elems(info: NodeInfo, spec, mesh: Sequence[int]) -> float:
    """Elements of the piece of ``info``'s tensor one device holds under ``spec``."""
    return info.out_bytes / _item(info.dtype) / volume_factor(spec, mesh) if info.dtype else 0.0


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


def _in_block(tables: CostTables, blocks: Sequence[Block]) -> dict[str, Block]:
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
) -> CostTables:
    """The tables as the step runs under ``trades`` (module docstring). ``infos``: as the tables
    were built (``half_infos`` under mixed precision).

    A parameter's rows depend on the trades but recomputation (``_traded_params``), an
    activation's on recomputation and micro-batches alone (``_traded_activations``), an edge's on
    those two too (``_traded_edges``): each part is kept on ``tables`` per the trades it reads, as
    the climb applies many trades to one candidate's tables (a DeepSeek-V3 search, 1,900), and
    the result's rows are those parts' lists, shared between the rungs that read them. Read-only."""
    if _untraded(trades):
        return tables
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
    k = trades.micro_batches
    in_block = _recomputed(tables, blocks, trades)
    rows = _traded_rows(tables, infos, trades, cluster, optimizer, blocks, in_block, tables.edges)
    return lower_bound_bytes(rows, _edge_trade(tables, infos, in_block, k))


def _untraded(trades: Trades) -> bool:
    """``trades`` change nothing in the tables: no trade, precision as the parameters, no data axes."""
    return trades == Trades(precision=Precision.PARAM) and not trades.data_axes


def _recomputed(tables: CostTables, blocks: Sequence[Block], trades: Trades) -> dict[str, Block]:
    """The nodes ``trades`` recompute, with their blocks (none without recomputation)."""
    return _in_block(tables, blocks) if trades.recompute is not Recompute.NONE else {}


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
    params = _traded_params(tables, infos, trades, cluster, optimizer)
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


def _traded_params(
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
            master = 4 if trades.precision.mixed else _item(info.dtype)
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
        t = node_time(info.flops, info.bytes, info.dtype, cluster.device, k, False, op=info.target)
        hit = memo[key] = (cluster.device, t)
    return hit[1]


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
    params = _params(infos, choice)
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
    for v, i in choice.items():
        info = infos[v]
        if info.role is not Role.PARAM or not info.requires_grad:
            continue
        elems = piece_elems(info, tables.strategies[v][i].out, mesh)
        # FSDP2 gathers the half copies (``MixedPrecisionPolicy.param_dtype``), ZeRO-1 the fp32
        # masters it steps (``codegen/zero_one.py``)
        gbytes = elems * (4 if trades.precision.mixed else _item(info.dtype))  # the masters' too
        cbytes = (
            gbytes
            if z == ZeroStage.OPTIMIZER
            else elems * (2 if trades.precision.mixed else _item(info.dtype))
        )
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
        inside = _in_block(tables, blocks)
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
            cbytes = elems * (2 if trades.precision.mixed else _item(info.dtype))
            grads += len(members[v]) * elems * (4 if trades.precision.mixed else _item(info.dtype))
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


def _params(infos: dict[str, NodeInfo], choice: dict[str, int]) -> set[str]:
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
    if options.micro_batches is not None:
        ks = [options.micro_batches]
    else:
        ks = [1] + [k for k in (2, 4, 8, 16, 32, MAX_MICRO_BATCHES) if batch and batch % k == 0]
    os_ = [options.offload] if options.offload is not None else list(Offload)
    rungs = [
        Trades(r, k, precision, z, o, data_axes if z else ())
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
