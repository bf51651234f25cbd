"""What a plan does on each mesh axis, read off its placements: the lines ``Plan.summary`` and the
report print, and the axes on which anything is split at all.

Per mesh axis ``a`` of size ``n > 1``, over the plan's compute decisions (every node but the
parameters, buffers and inputs):

* an op is *split* on ``a`` where its output or one of its inputs is ``Shard`` or ``Partial`` on
  ``a``, or it runs as an op of a data-parallel region there (``OwnRows``);
* a matmul (``linear``, ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``matmul``) is *tensor parallel*
  on ``a`` where its weight operand is sharded on ``a`` (for a batched matmul: on one of its two
  matrix dims, not a batch dim);
* an op is *batch split* where its output is sharded on dim 0, or it runs on its own rows;
* a norm (an op whose name says ``norm``) is *sequence parallel* where its output, of three or
  more dims, is sharded on dim 1, on an axis with tensor-parallel matmuls;
* a mixture-of-experts op (``autopar.moe_experts``) is *expert parallel* where its experts are
  split on ``a``: by all-to-all where its tokens are split too, else each rank's summand;
* parameters are *sharded* where their stored placement is ``Shard`` on ``a`` (on an axis
  with no tensor-parallel matmul they are gathered whole for the matmuls that read them).

The axis is *data parallel* where an input is split on dim 0 and some op is batch split, and
*sequence parallel* where (not data parallel) an input is split on dim 1.

An axis where no op is split and no parameter sharded splits nothing: every rank runs the whole
step there, whatever the inputs' placements say (an input split on the batch that every consumer
takes whole is gathered back before anything runs on it). A plan whose every axis splits nothing
says why: the fastest candidate of the search that certainly splits (an axis role other than
``auto``, or pipeline stages) and its predicted step, or its bound where a bound pruned it
(``Plan.solver.candidates``).
"""

from __future__ import annotations

import math
from typing import Any

from autopar.placement import ExpertDispatch, OwnRows, is_partial, is_shard, via_from_str

# ``autopar.plan.Plan`` and ``NodeDecision``, by name only: ``Plan.summary`` calls this module
Plan = NodeDecision = Any

# matmul ops -> the index of the weight operand among the decision's tensor inputs
MATMULS = {
    "aten.linear.default": 1,
    "aten.mm.default": 1,
    "aten.addmm.default": 2,
    "aten.bmm.default": 1,
    "aten.baddbmm.default": 2,
    "aten.matmul.default": 1,
}
_BATCHED = {"aten.bmm.default", "aten.baddbmm.default", "aten.matmul.default"}
_STATE = {"param", "buffer", "input"}
MOE = "autopar.moe_experts.default"


def _dim(p, rank: int) -> int:
    """A ``Shard``'s dim, negative dims counted from ``rank``."""
    return p.dim % rank if rank else p.dim


def _split_on(d: NodeDecision, a: int) -> bool:
    specs = (d.output_spec, *d.input_specs)
    if any(is_shard(s[a]) or is_partial(s[a]) for s in specs):
        return True
    via = via_from_str(d.via)
    return a < len(via) and via[a] is OwnRows.LOCAL


def _weight_split(d: NodeDecision, a: int) -> bool:
    k = MATMULS[d.op]
    if k >= len(d.inputs):
        return False
    p = d.input_specs[k][a]
    if not is_shard(p):
        return False
    if d.op not in _BATCHED:
        return True
    rank = len(d.shape)
    return rank < 2 or _dim(p, rank) >= rank - 2


def _batch_split(d: NodeDecision, a: int) -> bool:
    p = d.output_spec[a]
    if is_shard(p) and _dim(p, len(d.shape)) == 0:
        return True
    via = via_from_str(d.via)
    return a < len(via) and via[a] is OwnRows.LOCAL


def _seq_norm(d: NodeDecision, a: int) -> bool:
    p = d.output_spec[a]
    return "norm" in d.op and len(d.shape) >= 3 and is_shard(p) and _dim(p, len(d.shape)) == 1


def compute_decisions(plan: Plan) -> list[NodeDecision]:
    """The decisions of ops that compute (not parameters, buffers or inputs)."""
    return [d for d in plan.decisions if d.role not in _STATE and d.op != "placeholder"]


def split_axes(plan: Plan) -> tuple[int, ...]:
    """The mesh axes of more than one device on which the plan splits some op or shards some
    parameter (module docstring); on the others every rank runs the whole step."""
    ops = compute_decisions(plan)
    params = [d for d in plan.decisions if d.role == "param"]
    return tuple(
        a
        for a, n in enumerate(plan.mesh_shape)
        if n > 1 and (any(_split_on(d, a) for d in ops) or any(is_shard(d.output_spec[a]) for d in params))
    )


def axis_line(plan: Plan, a: int) -> str:
    """What the plan does on mesh axis ``a``, in one line (module docstring)."""
    n = plan.mesh_shape[a]
    head = f"axis {a} (size {n})"
    zero = int(plan.trades.zero_stage) if a in plan.trades.data_axes else 0
    zero_text = f"; ZeRO-{zero}" if zero else ""
    if n == 1:
        return f"{head}: one device, nothing to split"
    ops = compute_decisions(plan)
    params = [d for d in plan.decisions if d.role == "param"]
    split = [d for d in ops if _split_on(d, a)]
    sharded = [d for d in params if is_shard(d.output_spec[a])]
    if not split and not sharded:
        return f"{head}: splits nothing — every rank runs the whole step{zero_text}"
    mms = [d for d in ops if d.op in MATMULS]
    tp = [d for d in mms if _weight_split(d, a)]
    batch = [d for d in split if _batch_split(d, a)]
    norms = [d for d in ops if "norm" in d.op]
    seq_norms = [d for d in norms if _seq_norm(d, a)] if tp else []
    input_dims = {
        _dim(d.output_spec[a], len(d.shape))
        for d in plan.decisions
        if d.role == "input" and d.shape and is_shard(d.output_spec[a])
    }
    data = bool(batch) and 0 in input_dims
    seq = 1 in input_dims and not data
    if tp:
        what = (
            "data and tensor parallel"
            if data
            else "tensor and sequence parallel"
            if seq
            else "tensor parallel"
        )
    elif data:
        what = "data parallel"
    elif seq:
        what = "sequence parallel"
    elif split:
        what = f"splits {len(split)} of {len(ops)} ops"
    else:
        what = "splits no op"
    parts = []
    if tp:
        parts.append(f"{len(tp)} of {len(mms)} matmuls split on their weights")
    if seq:
        parts.append(f"the inputs' sequence split, {len(split)} of {len(ops)} ops split")
    if batch:
        parts.append(f"batch split on {len(batch)} of {len(ops)} ops")
    if seq_norms:
        parts.append(f"sequence parallel norms ({len(seq_norms)} of {len(norms)})")
    moe = [d for d in ops if d.op == MOE]
    ep = [d for d in moe if _expert_split(d, a)]
    if ep:
        on = _via_on(ep[0], a)
        how = (
            "by all-to-all"
            if ExpertDispatch.ALL_TO_ALL in on
            else "by all-to-all, once per node then inside it"
            if ExpertDispatch.NODE_ALL_TO_ALL in on
            else "tokens whole, outputs summed"
        )
        what = "expert parallel" + (" and data parallel" if data else "") if what == "data parallel" else what
        parts.append(f"experts of {len(ep)} of {len(moe)} MoE layers split ({how})")
    etp = [d for d in moe if _expert_tensor_split(d, a)]
    if etp:
        parts.append(
            f"each expert's intermediate dim split in {len(etp)} of {len(moe)} MoE layers (expert tensor parallel)"
        )
    if sharded:
        expert_w = sum(1 for d in ep + etp for s in d.input_specs[3:] if is_shard(s[a]))
        rest = len(sharded) - expert_w
        gathered = ", gathered whole for the matmuls" if mms and not tp and rest > 0 else ""
        parts.append(f"{len(sharded)} of {len(params)} parameters sharded{gathered}")
    elif params:
        parts.append("parameters whole")
    if (data or seq) and len(sharded) < len(params):
        parts.append("gradients reduce-scattered" if zero >= 2 else "gradients all-reduced")
    return f"{head}: {what}: {', '.join(parts)}{zero_text}"


def _expert_split(d: NodeDecision, a: int) -> bool:
    """Are the experts of MoE decision ``d`` split on axis ``a`` (their dim ``E``)?"""
    return len(d.input_specs) > 3 and is_shard(d.input_specs[3][a]) and d.input_specs[3][a].dim == 0


def _expert_tensor_split(d: NodeDecision, a: int) -> bool:
    """Is each expert of MoE decision ``d`` split on its intermediate dim on axis ``a`` (expert tensor
    parallelism, ``passes/rules/experts.py``)?"""
    return len(d.input_specs) > 3 and is_shard(d.input_specs[3][a]) and d.input_specs[3][a].dim != 0


def _via_on(d: NodeDecision, a: int) -> tuple:
    via = via_from_str(d.via)
    return (via[a],) if a < len(via) else ()


def axis_lines(plan: Plan) -> list[str]:
    """One line per mesh axis (``axis_line``)."""
    return [axis_line(plan, a) for a in range(len(plan.mesh_shape))]


def _parallel_candidate(c: dict) -> bool:
    """A candidate that certainly splits: an axis role other than ``auto``, or pipeline stages."""
    roles = c.get("axis_roles") or ()
    return any(r != "auto" for r in roles) or int(c.get("pipeline_stages") or 1) > 1


def _figure(c: dict) -> tuple[float, str] | None:
    """A candidate's predicted step (its objective) where it was solved, else the larger of its
    bounds where a bound pruned it ("at least"); None where it has neither (no plan fits it)."""
    obj = c.get("objective")
    if isinstance(obj, (int, float)) and math.isfinite(obj):
        return float(obj), "predicted"
    if c.get("status") != "pruned":
        return None
    bounds = [b for b in (c.get("lower_bound"), c.get("lp_bound")) if isinstance(b, (int, float))]
    return (max(bounds), "at least") if bounds else None


def _label(c: dict) -> str:
    mesh = tuple(c.get("mesh_shape") or ())
    text = f"mesh {mesh}"
    roles = c.get("axis_roles") or ()
    if any(r != "auto" for r in roles):
        text += " with axis roles (" + ", ".join(str(r) for r in roles) + ")"
    stages = int(c.get("pipeline_stages") or 1)
    if stages > 1:
        text += f" in {stages} pipeline stages"
    return text


def replicated_line(plan: Plan) -> str | None:
    """Where the plan splits nothing on any axis of a world of more than one device: that every
    rank runs the whole step, and why (module docstring); None for a plan that splits something."""
    if plan.world_size == 1 or plan.pipeline.enabled or split_axes(plan):
        return None
    step = plan.predicted.step_time_s * 1e3
    priced = [(f, c) for c in plan.solver.candidates if _parallel_candidate(c) for f in [_figure(c)] if f]
    head = "no axis splits anything: every rank runs the whole step"
    if not priced:
        return (
            f"{head}; the search priced no candidate that must split (an axis role or pipeline stages), and on "
            f"the meshes it tried the solver found no split faster than {step:.3f} ms"
        )
    (seconds, kind), c = min(priced, key=lambda fc: fc[0][0])
    return (
        f"{head}, predicted fastest: the fastest split the search priced, {_label(c)}, takes {kind} "
        f"{seconds * 1e3:.3f} ms against this plan's {step:.3f} ms"
    )
