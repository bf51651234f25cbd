"""The Plan: every decision the search took, with its predicted costs, as a frozen, versioned value.

JSON layout (schema_version 4; 3 is the same without "pipeline", 2 also without "trades" and
"trade_costs")::

    {
      "schema_version": 4,
      "fingerprint": "<sha256 of the traced graph: ops, shapes, dtypes, parameter names>",
      "model": "GPT2LMHeadModel",
      "cluster": {... ClusterSpec.to_dict() ...},
      "mesh_shape": [2, 2],
      "decisions": [
        {"name": "linear_3", "op": "aten.linear.default", "role": "activation", "target": "",
         "shape": [4, 16, 128], "output": "S(0),R", "inputs": ["S(0),R", "R,S(0)"],
         "compute_s": 1.2e-06, "comm_s": 0.0,
         "collectives": [{"kind": "all_reduce", "axis": 1, "nbytes": 4096.0, "phase": "backward",
                          "site": "inputs"}],
         "via": "", "module": "transformer.h.0.mlp.c_fc"},
                 (module: where in the model the node runs; absent in older plans: "")
        ...
      ],
      "predicted": {"step_time_s": ..., "peak_memory_bytes": ..., "compute_s": ..., "comm_s": ...,
                    "param_bytes": ..., "grad_bytes": ..., "optimizer_bytes": ..., "activation_bytes": ...},
      "outputs": "full",   (or "local": each rank returns its piece; absent in older plans: "full")
      "overlap_matmuls": true,   (linears run with the all-gather before or the reduce-scatter after
                 them as collective matmuls, kernels/collective_matmul.py; absent in older plans: false)
      "trades": {"recompute": "none", "micro_batches": 1, "precision": "param", "zero_stage": 0,
                 "offload": "none", "data_axes": []},   (autopar/trades.py; absent: none taken;
                 "recompute_blocks": N where only the first N blocks of each stage recompute)
      "trade_costs": {"zero": {"seconds": ..., "bytes_saved": ...}, ...},
      "pipeline": {"stages": 4, "schedule": "1f1b", "virtual_stages": 1, "cuts": [3, 6, 9]},
                 (autopar/trades.py:Pipeline; absent: no pipeline; mesh_shape is one stage's)
      "stage_costs": [{"chunk": 0, "blocks": [0, 3], "forward_s": ..., "backward_s": ...,
                       "peak_memory_bytes": ...}, ...],   (what the search priced per chunk)
      "solver": {"name": "PULP_CBC_CMD", "status": "Optimal", "objective": ..., "solve_time_s": ...,
                 "num_variables": ..., "num_constraints": ..., "candidates": [...mesh shapes tried...],
                 "time_limit_s": null},   (the ILP's time limit the search ran under; absent: none)
                 (a candidate whose ILP the node limit stopped: status "Feasible (node limit)" and
                 "ilp_bound", the least its unexplored plans can cost; SolverInfo.node_limit_line)
      "expert_skew": 1.0   (the routing skew MoE ops were priced at; absent: the model has none)
    }

Placements are written as text (``R``, ``S(d)``, ``P``), one per mesh axis, comma separated.
Collectives are typed records (``PlannedCollective``): the kind, the mesh axis, the bytes it is
priced at, forward or backward, and where in the step it runs (``Site``). Plans of schema 1 (the
same, with collectives written as text such as ``"all_reduce(bwd)@1"``) still load.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from autopar.errors import PlanFormatError, PlanMismatchError
from autopar.fusion import KernelUse
from autopar.placement import VIA_NAMES, Outputs, Spec, is_shard, spec_from_str, via_from_str
from autopar.plan_axes import axis_lines, replicated_line
from autopar.reshard import AxisGroup, Collective, CollectiveCall, Phase
from autopar.trades import Float8, Pipeline, Trades

FLOAT8_RECIPES = tuple(f.value for f in Float8 if f is not Float8.OFF)

SCHEMA_VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)


class Site(enum.Enum):
    """Where in a step a collective runs."""

    INPUTS = "inputs"  # brings a node's inputs to the placements it takes (and their gradients back)
    INSIDE = "inside"  # a lowering's own collective, after the op's local compute (a split loss)
    OUTPUTS = "outputs"  # brings the graph's outputs to the caller
    BUCKET = "bucket"  # a gradient bucket's all-reduce, overlapped with backward


@dataclass(frozen=True)
class PlannedCollective:
    """One collective of a plan: a reshard step's (``autopar/reshard.py``), a lowering's own, or a
    gradient bucket's (``bucket``: its index), priced at ``nbytes`` on mesh axis ``axis``."""

    kind: Collective
    axis: int
    nbytes: float
    phase: Phase
    site: Site
    bucket: int | None = None
    group: AxisGroup = AxisGroup.WHOLE  # a rail or a node of the axis's group (expert dispatch once per node)

    def __post_init__(self) -> None:
        if self.axis < 0 or self.nbytes < 0:
            raise PlanFormatError(f"collective {self}: axis and bytes must be >= 0")
        if (self.bucket is not None) != (self.site is Site.BUCKET):
            raise PlanFormatError(f"collective {self}: a bucket index goes with site 'bucket' only")

    @classmethod
    def of(cls, call: CollectiveCall, site: Site, bucket: int | None = None) -> PlannedCollective:
        return cls(call.kind, call.axis, call.nbytes, call.phase, site, bucket, call.group)

    def __str__(self) -> str:
        where = f"bucket {self.bucket}" if self.bucket is not None else self.site.value
        part = "" if self.group is AxisGroup.WHOLE else f" {self.group.value}"
        return f"{self.kind.value}@{self.axis}{part} {self.phase.value} ({where}) {self.nbytes:.0f} B"

    def to_dict(self) -> dict[str, Any]:
        d = {
            "kind": self.kind.value,
            "axis": self.axis,
            "nbytes": self.nbytes,
            "phase": self.phase.value,
            "site": self.site.value,
        }
        if self.bucket is not None:
            d["bucket"] = self.bucket
        if self.group is not AxisGroup.WHOLE:
            d["group"] = self.group.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str) -> PlannedCollective:
        if isinstance(d, str):
            return _legacy_collective(d)
        return cls(
            Collective(d["kind"]), int(d["axis"]), float(d["nbytes"]), Phase(d["phase"]), Site(d["site"]),
            d.get("bucket"), AxisGroup(d.get("group", AxisGroup.WHOLE.value)),
        )  # fmt: skip


_LEGACY_BUCKET = re.compile(r"^(\w+)\(axis (\d+), overlapped, bucket (\d+)\)$")
_LEGACY = re.compile(r"^(\w+)(?:\(([^)]*)\))?@(\d+)")


def _legacy_collective(text: str) -> PlannedCollective:
    """A schema-1 collective (``"all_gather@0"``, ``"all_reduce(bwd)@1"``, ``"all_reduce(in op)@0"``,
    ``"all_reduce(axis 0, overlapped, bucket 2)"``); those plans did not record bytes (0)."""
    m = _LEGACY_BUCKET.match(text)
    if m:
        return PlannedCollective(Collective(m[1]), int(m[2]), 0.0, Phase.BACKWARD, Site.BUCKET, int(m[3]))
    m = _LEGACY.match(text)
    if not m:
        raise PlanFormatError(
            f"unreadable collective {text!r} in a schema-1 plan; re-plan with `autopar plan`"
        )
    note = m[2] or ""
    phase = Phase.BACKWARD if "bwd" in note else Phase.FORWARD
    site = Site.INSIDE if "in op" in note else Site.INPUTS
    return PlannedCollective(Collective(m[1]), int(m[3]), 0.0, phase, site)


@dataclass(frozen=True)
class NodeDecision:
    """The strategy chosen for one graph node."""

    name: str
    op: str
    role: str  # "param" | "buffer" | "input" | "activation" | "output"
    target: str  # parameter / buffer FQN or user input name; "" for activations
    shape: tuple[int, ...]  # global shape of the (first) tensor output; () when not a tensor
    output: str  # placement text of the output, e.g. "S(0),R"
    inputs: tuple[str, ...]  # required placement of each tensor input, in argument order
    compute_s: float = 0.0
    comm_s: float = 0.0  # resharding into this node's inputs (forward + backward)
    collectives: tuple[PlannedCollective, ...] = ()
    # per mesh axis, the algorithm of an op whose placements do not say it ("ring,-": attention
    # on a sequence split, ``SeqAttention``); "" where there is none
    via: str = ""
    # the innermost module the node runs in, by its path in the model ("model.layers.3.mlp.down_proj"),
    # a parameter's or buffer's its owner's; "" for the model itself or where unknown (older plans)
    module: str = ""
    # a linear run FP8: its recipe ("tensorwise" / "rowwise", ``autopar.trades.Float8``;
    # ``autopar/lowerings/float8.py``); "" where it runs in the plan's precision (older plans: "")
    float8: str = ""

    def __post_init__(self) -> None:
        spec_from_str(self.output)  # validates
        if self.float8 and self.float8 not in FLOAT8_RECIPES:
            raise PlanFormatError(
                f"node {self.name}: float8 {self.float8!r} names no recipe: one of {list(FLOAT8_RECIPES)}, "
                "or '' for none"
            )
        for s in self.inputs:
            spec_from_str(s)
        try:
            via_from_str(self.via)
        except ValueError:
            raise PlanFormatError(
                f"node {self.name}: via {self.via!r} names no algorithm "
                f"({list(VIA_NAMES)}, '-' for none, one per mesh axis)"
            ) from None
        if self.compute_s < 0 or self.comm_s < 0:
            raise PlanFormatError(f"node {self.name}: negative predicted time")

    @property
    def output_spec(self) -> Spec:
        return spec_from_str(self.output)

    @property
    def input_specs(self) -> tuple[Spec, ...]:
        return tuple(spec_from_str(s) for s in self.inputs)


@dataclass(frozen=True)
class Predicted:
    """Predicted per-device costs of one training step (forward + backward + optimizer step)."""

    step_time_s: float
    peak_memory_bytes: int
    compute_s: float
    comm_s: float
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    # seconds of gradient all-reduce hidden behind backward compute (already out of step_time_s)
    grad_sync_hidden_s: float = 0.0
    # a pipelined plan's fullest rank's idle seconds in its schedule (the bubble; 0: no pipeline)
    bubble_s: float = 0.0

    def __post_init__(self) -> None:
        if self.step_time_s < 0 or self.peak_memory_bytes < 0:
            raise PlanFormatError("predicted costs must be non-negative")


@dataclass(frozen=True)
class SolverInfo:
    name: str
    status: str
    objective: float
    solve_time_s: float
    num_variables: int = 0
    num_constraints: int = 0
    # one entry per mesh shape tried: {"mesh_shape", "status", "objective", "lower_bound"}
    candidates: tuple[dict, ...] = ()
    lower_bound_s: float = 0.0  # no plan on the chosen mesh is faster: every op at its cheapest, free edges
    # the ILP's time limit per mesh the search ran under (``SearchOptions.time_limit_s``); None:
    # none, and the plan depends only on the model, the cluster and the options
    time_limit_s: float | None = None

    @property
    def time_limited(self) -> tuple[tuple[int, ...], ...]:
        """The meshes (of ``candidates``, and the chosen one) whose ILP the time limit stopped."""
        cut = [
            tuple(c.get("mesh_shape", ()))
            for c in self.candidates
            if "time limit" in str(c.get("status", ""))
        ]
        return tuple(dict.fromkeys(cut))

    def time_limit_line(self) -> str | None:
        """What the time limit means for the plan, for ``Plan.summary``; None without one."""
        if self.time_limit_s is None:
            return None
        cut = self.time_limited
        stopped = (
            f"it stopped the ILP of mesh(es) {', '.join(str(m) for m in cut[:4])}{' ...' if len(cut) > 4 else ''}"
            if cut or "time limit" in self.status
            else "no ILP reported hitting it"
        )
        return (
            f"  time limit: {self.time_limit_s:g} s per mesh ({stopped}); a search a time limit stops depends on "
            "the machine's speed and load, so another run can choose another plan: leave time_limit_s unset "
            "for a plan that depends only on the model, cluster and options"
        )

    @property
    def node_limited(self) -> tuple[dict, ...]:
        """The candidates (entries of ``candidates``) whose ILP the search's node limit stopped
        (``passes/solver.py:MIP_NODE_LIMIT``): each took its best plan so far."""
        return tuple(c for c in self.candidates if "node limit" in str(c.get("status", "")))

    def node_limit_line(self) -> str | None:
        """What the node limit left unexplored, for ``Plan.summary``; None where it stopped no ILP."""
        cut = self.node_limited
        if not cut:
            return None
        parts = []
        for c in cut[:4]:
            trades = Trades.from_dict(c.get("trades"))
            where = f"mesh {tuple(c.get('mesh_shape', ()))}" + (
                "" if trades.is_default else f" [{trades.describe()}]"
            )
            bound = c.get("ilp_bound")
            parts.append(
                f"{where} ({c['objective'] * 1e3:.3f} ms taken: its ILP's plans down to {bound * 1e3:.3f} ms not explored)"
                if bound is not None and c.get("objective") is not None
                else f"{where} (stopped before its root's bound: its other plans not explored)"
            )
        return (
            "  node limit: the ILP's branch and bound stopped at its node limit on "
            + "; ".join(parts)
            + (f" and {len(cut) - 4} more" if len(cut) > 4 else "")
            + " (a count of nodes, not seconds: the same inputs stop there under any load)"
        )

    @property
    def bound_gap(self) -> float:
        """Relative distance of the predicted step time from ``lower_bound_s`` (a loose bound: it ignores
        communication, so it stays large even for proven optima)."""
        return max(self.objective - self.lower_bound_s, 0.0) / self.objective if self.objective > 0 else 0.0

    @property
    def gap(self) -> float:
        """Optimality gap of the ILP over the plans it searches: 0 when the solver proved optimality,
        else (when a time limit stopped it) the gap to ``lower_bound_s``."""
        return 0.0 if self.status == "Optimal" else self.bound_gap


@dataclass(frozen=True)
class Plan:
    fingerprint: str
    model: str
    cluster: dict  # ClusterSpec.to_dict(); kept as plain data so a plan loads without the spec class
    mesh_shape: tuple[int, ...]
    decisions: tuple[NodeDecision, ...]
    predicted: Predicted
    solver: SolverInfo
    # how the module returns the outputs: "full" (gathered) or "local" (autopar.placement.Outputs)
    outputs: str = "full"
    # collective matmuls (passes/collective_matmul.py): priced by the plan, emitted by codegen
    overlap_matmuls: bool = False
    # the memory-for-time trades (autopar/trades.py) and, per trade, what it costs and saves:
    # {"recompute": {"seconds": ..., "bytes_saved": ...}, ...} (absent in older plans: none taken)
    trades: Trades = field(default_factory=Trades)
    trade_costs: dict = field(default_factory=dict)
    # pipeline stages (autopar/trades.py:Pipeline; stages == 1: none), and per chunk what the
    # search priced: its blocks, forward and backward seconds per micro-batch, peak bytes
    pipeline: Pipeline = field(default_factory=Pipeline)
    stage_costs: tuple = ()
    # the fused kernels substituted for aten patterns (passes/fuse.py): each one's node (its
    # decision is in ``decisions``) and the traced nodes it stands for; empty: none
    kernels: tuple[KernelUse, ...] = ()
    # the routing skew its mixture-of-experts ops were priced at (SearchOptions.expert_skew: the
    # busiest rank's share of the routed pairs over a balanced one); None: the model has none
    expert_skew: float | None = None
    schema_version: int = SCHEMA_VERSION
    _by_name: dict = field(default=None, repr=False, compare=False, hash=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.schema_version not in READABLE_VERSIONS:
            raise PlanFormatError(
                f"plan schema_version {self.schema_version} is not supported (this autopar reads "
                f"{list(READABLE_VERSIONS)}); re-plan with `autopar plan`"
            )
        if not isinstance(self.overlap_matmuls, bool):
            raise PlanFormatError(f"overlap_matmuls must be true or false, got {self.overlap_matmuls!r}")
        if self.outputs not in {o.value for o in Outputs}:
            raise PlanFormatError(
                f"outputs must be one of {[o.value for o in Outputs]}, got {self.outputs!r}"
            )
        if not self.mesh_shape or any(int(n) < 1 for n in self.mesh_shape):
            raise PlanFormatError(f"mesh_shape must be positive integers, got {self.mesh_shape}")
        for d in self.decisions:
            for text, spec in [(d.output, d.output_spec), *zip(d.inputs, d.input_specs)]:
                if len(spec) != len(self.mesh_shape):
                    raise PlanFormatError(
                        f"node {d.name}: placement {text!r} has {len(spec)} axes, mesh has {len(self.mesh_shape)}"
                    )
        object.__setattr__(self, "_by_name", {d.name: d for d in self.decisions})

    # -- reading ---------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Devices the plan runs on: its pipeline's stages times one stage's mesh."""
        n = self.pipeline.stages
        for s in self.mesh_shape:
            n *= s
        return n

    def decision(self, name: str) -> NodeDecision:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no node named {name!r} in this plan; see plan.decisions for the names") from None

    def __getitem__(self, name: str) -> NodeDecision:
        return self.decision(name)

    @property
    def parameter_placements(self) -> dict[str, str]:
        """Parameter FQN -> placement text: how each parameter is stored on the mesh."""
        return {d.target: d.output for d in self.decisions if d.role == "param"}

    def summary(self, max_rows: int = 40) -> str:
        p = self.predicted
        lines = [
            f"plan for {self.model} on mesh {tuple(self.mesh_shape)} ({self.world_size} devices, "
            f"{self.cluster.get('name', '?')})",
            *self._axis_lines(),
            f"  predicted step time {p.step_time_s * 1e3:.3f} ms (compute {p.compute_s * 1e3:.3f} ms, "
            f"communication {p.comm_s * 1e3:.3f} ms exposed, "
            f"{p.grad_sync_hidden_s * 1e3:.3f} ms of gradient all-reduce hidden behind backward)",
            f"  predicted peak memory per device {p.peak_memory_bytes / 2**20:.2f} MiB (params "
            f"{p.param_bytes / 2**20:.2f}, grads {p.grad_bytes / 2**20:.2f}, optimizer {p.optimizer_bytes / 2**20:.2f}, "
            f"activations {p.activation_bytes / 2**20:.2f})",
            f"  trades: {self.trades.describe()}"
            + "".join(
                f"; {k} {v.get('seconds', 0.0) * 1e3:+.3f} ms, {v.get('bytes_saved', 0.0) / 2**30:.3f} GiB saved"
                for k, v in self.trade_costs.items()
            ),
            *self._overlap_lines(),
            *self._attention_lines(),
            *self._kernel_lines(),
            *self._float8_lines(),
            *self._pipeline_lines(),
            *self._expert_lines(),
            f"  solver {self.solver.name}: {self.solver.status}, {self.solver.solve_time_s:.2f} s; lower bound "
            f"{self.solver.lower_bound_s * 1e3:.3f} ms; optimality gap {self.solver.gap:.1%}",
            *filter(None, [self.solver.time_limit_line(), self.solver.node_limit_line()]),
            "  parameter placements:",
        ]
        params = [d for d in self.decisions if d.role == "param"]
        for d in params[:max_rows]:
            lines.append(f"    {d.target:60s} {d.output}")
        if len(params) > max_rows:
            lines.append(f"    ... {len(params) - max_rows} more")
        return "\n".join(lines)

    def _axis_lines(self) -> list[str]:
        """What the plan does on each mesh axis, and where it splits nothing, why
        (``autopar/plan_axes.py``)."""
        lines = [f"  {line}" for line in axis_lines(self)]
        why = replicated_line(self)
        return lines + ([f"  {why}"] if why else [])

    def _expert_lines(self) -> list[str]:
        """The routing a plan with mixture-of-experts ops was priced for."""
        if self.expert_skew is None:
            return []
        how = (
            "balanced"
            if self.expert_skew == 1
            else f"the busiest rank {self.expert_skew:g}x a balanced share"
        )
        return [f"  experts: routing priced {how} (SearchOptions.expert_skew)"]

    def _overlap_lines(self) -> list[str]:
        if not self.overlap_matmuls:
            return []
        return ["  collective matmuls: linears overlap the all-gather before or reduce-scatter after them"]

    def _attention_lines(self) -> list[str]:
        """How attention runs where the plan splits its sequence: per algorithm and mesh axis, how
        many attention ops (K/V gathered is read off the placements: queries split, K/V whole)."""
        counts: dict[str, int] = {}
        for d in self.decisions:
            if not d.op.startswith("aten.scaled_dot_product_attention"):
                continue
            for a, v in enumerate(via_from_str(d.via)):
                if v is not None:
                    counts[f"{v.value} on axis {a}"] = counts.get(f"{v.value} on axis {a}", 0) + 1
            if not d.via and len(d.inputs) >= 3:
                q, k = d.input_specs[0], d.input_specs[1]
                rank = len(d.shape)
                for a, (pq, pk) in enumerate(zip(q, k)):
                    if is_shard(pq) and pq.dim % max(rank, 1) == rank - 2 and not is_shard(pk):
                        counts[f"gather on axis {a}"] = counts.get(f"gather on axis {a}", 0) + 1
        if not counts:
            return []
        each = ", ".join(f"{k} ({n} op{'s' if n != 1 else ''})" for k, n in counts.items())
        return [f"  attention on a split sequence: {each}"]

    @property
    def float8_linears(self) -> dict[str, Float8]:
        """The linears that run FP8, by node name, with their recipes (codegen reads them)."""
        return {d.name: Float8(d.float8) for d in self.decisions if d.float8}

    def _float8_lines(self) -> list[str]:
        """How many linears run FP8, per recipe, of how many linears, and their predicted seconds."""
        linears = [d for d in self.decisions if d.op == "aten.linear.default"]
        fp8 = [d for d in linears if d.float8]
        if not fp8:
            return []
        per: dict[str, list] = {}
        for d in fp8:
            c = per.setdefault(d.float8, [0, 0.0])
            c[0] += 1
            c[1] += d.compute_s
        each = ", ".join(f"{r} x{n} ({sec * 1e3:.3f} ms)" for r, (n, sec) in per.items())
        return [f"  FP8 linears: {len(fp8)} of {len(linears)}: {each}; the rest in the plan's precision"]

    def _kernel_lines(self) -> list[str]:
        """The fused kernels: per kernel, how many ops it replaced and their predicted seconds."""
        if not self.kernels:
            return []
        count: dict[str, list] = {}
        for u in self.kernels:
            c = count.setdefault(u.kernel.value, [0, 0, 0.0])
            c[0] += 1
            c[1] += len(u.replaced)
            d = self._by_name.get(u.node)
            c[2] += d.compute_s if d is not None else 0.0
        each = ", ".join(f"{k} x{n} ({ops} aten ops, {s * 1e3:.3f} ms)" for k, (n, ops, s) in count.items())
        return [f"  fused kernels: {each}"]

    def _pipeline_lines(self) -> list[str]:
        """The pipeline, one line per run of chunks priced alike (same block count, forward and
        backward as printed: a deep model's middle chunks are one line), then each rank's peak."""
        if not self.pipeline.enabled:
            return []
        lines = [f"  pipeline: {self.pipeline.describe()}, mesh {tuple(self.mesh_shape)} per stage"]
        costs = self.stage_costs  # in chunk order
        runs: list[list] = []  # [first chunk, last chunk, first block, last block, count, text]
        for c in costs:
            first, end = (list(c.get("blocks") or ()) + [0, 0])[:2]
            text = (
                f"forward {c.get('forward_s', 0.0) * 1e3:.3f} ms + backward {c.get('backward_s', 0.0) * 1e3:.3f} ms "
                "per micro-batch"
            )
            if runs and runs[-1][5] == text and runs[-1][4] == end - first and runs[-1][3] == first:
                runs[-1][1], runs[-1][3] = c.get("chunk"), end
            else:
                runs.append([c.get("chunk"), c.get("chunk"), first, end, end - first, text])
        for a, b, first, end, n, text in runs:
            if a == b:
                lines.append(f"    chunk {a}: blocks {first}..{end - 1}, {text}")
            else:
                lines.append(
                    f"    chunks {a}-{b}: {n} block{'s' if n != 1 else ''} each (blocks {first}..{end - 1}), {text}"
                )
        peaks: dict[int, float] = {}
        for c in costs:
            rank = c.get("rank", self.pipeline.rank_of_chunk(int(c.get("chunk", 0))))
            peaks.setdefault(int(rank), float(c.get("peak_memory_bytes", 0.0)))
        if peaks:
            unit, div = ("GiB", 2**30) if max(peaks.values()) >= 2**30 else ("MiB", 2**20)
            if len(peaks) <= 8:
                each = ", ".join(f"{v / div:.2f}" for _, v in sorted(peaks.items()))
                lines.append(f"    peak memory per pipeline rank: {each} {unit}")
            else:
                top = max(peaks, key=peaks.__getitem__)
                low = min(peaks, key=peaks.__getitem__)
                lines.append(
                    f"    peak memory per pipeline rank: {peaks[low] / div:.2f} (rank {low}) to "
                    f"{peaks[top] / div:.2f} {unit} (rank {top})"
                )
        return lines

    # -- decisions ---------------------------------------------------------------------------------
    def decision_parts(self) -> dict[str, Any]:
        """What this plan decides, part by part (name -> plain JSON-able value): everything that
        changes what the ranks run (the graph it was made for, the cluster, the mesh, each node's
        placements, collectives and algorithms, the outputs, collective matmuls, trades, pipeline,
        fused kernels), none of what the search measured or predicted (seconds, bytes, solver
        status, candidates, where in the model a node runs). Two plans with equal parts build the
        same module. Nodes are named ``node <name>``, in graph order."""
        parts: dict[str, Any] = {
            "model": self.fingerprint,
            "cluster": self.cluster,
            "mesh_shape": list(self.mesh_shape),
            "outputs": self.outputs,
            "overlap_matmuls": self.overlap_matmuls,
            "trades": self.trades.to_dict(),
            "pipeline": self.pipeline.to_dict(),
            "kernels": [u.to_dict() for u in self.kernels],
        }
        for d in self.decisions:
            parts[f"node {d.name}"] = {
                "op": d.op, "role": d.role, "target": d.target, "shape": list(d.shape), "output": d.output,
                "inputs": list(d.inputs), "via": d.via,
                "collectives": [
                    [c.kind.value, c.axis, c.phase.value, c.site.value, c.bucket] for c in d.collectives
                ],
            } | ({"float8": d.float8} if d.float8 else {})  # fmt: skip
        return parts

    def decisions_fingerprint(self) -> str:
        """A digest of ``decision_parts``: equal for plans that build the same module, whatever
        the search's timings, status or predicted figures."""
        text = json.dumps(self.decision_parts(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def decision_differences(self, other: Plan) -> list[str]:
        """The names of the ``decision_parts`` in which ``other`` differs from this plan, in this
        plan's order (the parts only ``other`` has last); empty: the same decisions."""
        mine, theirs = self.decision_parts(), other.decision_parts()
        names = list(mine) + [k for k in theirs if k not in mine]
        return [k for k in names if mine.get(k) != theirs.get(k)]

    # -- (de)serialization -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint,
            "model": self.model,
            "cluster": self.cluster,
            "mesh_shape": list(self.mesh_shape),
            "decisions": [
                {
                    **asdict(d),
                    "shape": list(d.shape),
                    "inputs": list(d.inputs),
                    "collectives": [c.to_dict() for c in d.collectives],
                }
                for d in self.decisions
            ],
            "predicted": asdict(self.predicted),
            "outputs": self.outputs,
            "overlap_matmuls": self.overlap_matmuls,
            "trades": self.trades.to_dict(),
            "trade_costs": self.trade_costs,
            "pipeline": self.pipeline.to_dict(),
            "stage_costs": [dict(c) for c in self.stage_costs],
            "kernels": [u.to_dict() for u in self.kernels],
            "solver": {**asdict(self.solver), "candidates": list(self.solver.candidates)},
            **({"expert_skew": self.expert_skew} if self.expert_skew is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        try:
            version = data["schema_version"]
            if version not in READABLE_VERSIONS:
                raise PlanFormatError(
                    f"plan schema_version {version} is not supported (this autopar reads "
                    f"{list(READABLE_VERSIONS)}); re-plan with `autopar plan`"
                )
            decisions = tuple(
                NodeDecision(
                    **{
                        **d,
                        "shape": tuple(d["shape"]),
                        "inputs": tuple(d["inputs"]),
                        "collectives": tuple(
                            PlannedCollective.from_dict(c) for c in d.get("collectives", ())
                        ),
                    }
                )
                for d in data["decisions"]
            )
            solver = dict(data["solver"])
            solver["candidates"] = tuple(solver.get("candidates", ()))
            return cls(
                fingerprint=data["fingerprint"],
                model=data["model"],
                cluster=data["cluster"],
                mesh_shape=tuple(int(x) for x in data["mesh_shape"]),
                decisions=decisions,
                predicted=Predicted(**data["predicted"]),
                solver=SolverInfo(**solver),
                outputs=data.get("outputs", Outputs.FULL.value),  # plans from before the option
                overlap_matmuls=data.get("overlap_matmuls", False),  # before it: none fused
                trades=Trades.from_dict(data.get("trades")),  # plans from before trades: none
                trade_costs=dict(data.get("trade_costs", {})),
                pipeline=Pipeline.from_dict(data.get("pipeline")),  # before pipelines: none
                stage_costs=tuple(dict(c) for c in data.get("stage_costs", ())),
                kernels=tuple(KernelUse.from_dict(u) for u in data.get("kernels", ())),
                expert_skew=data.get("expert_skew"),  # absent: no MoE op
                schema_version=SCHEMA_VERSION,  # read into this version's types
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, PlanFormatError):
                raise
            raise PlanFormatError(f"not a valid autopar plan: {e}") from e

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        try:
            with open(path) as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanFormatError(f"{path}: not a JSON plan file ({e})") from e
        return cls.from_dict(data)

    def check_world(self, world_size: int) -> None:
        """Raise PlanMismatchError unless this plan was made for ``world_size`` devices."""
        if world_size != self.world_size:
            mesh = tuple(self.mesh_shape)
            stages = f" x {self.pipeline.stages} pipeline stages" if self.pipeline.enabled else ""
            raise PlanMismatchError(
                f"this plan was made for {self.world_size} devices (mesh {mesh}{stages}), this job has {world_size}; "
                f"re-plan for {world_size} devices (autopar.plan(...) with a cluster of {world_size}) or launch "
                f"{self.world_size} processes"
            )

    def check_model(
        self, model: str, params: dict[str, tuple[int, ...]], inputs: dict[str, tuple[int, ...]]
    ) -> None:
        """Raise PlanMismatchError unless this plan was made for this model (its class name and its
        parameters by name and shape) and these inputs (by name and shape): read off the model as
        traced, before anything rewrites its graph as the plan's search did (inputs of one of the
        plan's micro-batches, as codegen traces them, match too)."""
        ours = {d.target: tuple(d.shape) for d in self.decisions if d.role == "param"}
        if model != self.model or ours != params:
            raise PlanMismatchError(
                f"this plan was made for another model: {self.model} with {len(ours)} parameters, this is {model} "
                f"with {len(params)} ({_first_difference('parameter', ours, params)}); re-plan with "
                "autopar.plan(...) for this model"
            )
        given = {d.target: tuple(d.shape) for d in self.decisions if d.role == "input"}
        k = self.trades.micro_batches  # codegen traces one micro-batch: 1/k of the plan's rows

        def same(a: tuple | None, b: tuple | None) -> bool:
            return a == b or (k > 1 and bool(a) and bool(b) and a[1:] == b[1:] and b[0] * k == a[0])

        if given.keys() != inputs.keys() or not all(same(given[n], inputs[n]) for n in given):
            raise PlanMismatchError(
                f"this plan was made for other inputs ({_first_difference('input', given, inputs)}); re-plan with "
                "autopar.plan(...) for these inputs, or pass the example inputs it was made for"
            )

    def check_matches(self, fingerprint: str, world_size: int) -> None:
        """Raise PlanMismatchError unless this plan was made for this many devices and this graph
        (the devices first: the cheaper and likelier mistake)."""
        self.check_world(world_size)
        if fingerprint != self.fingerprint:
            raise PlanMismatchError(
                f"this plan was made for a different model or input shapes (plan fingerprint {self.fingerprint[:12]}, "
                f"traced graph {fingerprint[:12]}); re-plan with autopar.plan(...) for this model and these inputs"
            )


def _first_difference(what: str, planned: dict, got: dict) -> str:
    """The first name whose shape differs between ``planned`` and ``got``, or that only one has."""
    for name in list(planned) + [n for n in got if n not in planned]:
        a, b = planned.get(name), got.get(name)
        if a != b:
            if a is None:
                return f"{what} {name!r} {b} is not in the plan"
            if b is None:
                return f"the plan's {what} {name!r} {a} is not in this one"
            return f"{what} {name!r}: {a} in the plan, {b} here"
    return "the same names and shapes"
