"""A plan's predicted step split into the parts a first-principles model of the same run prices
one by one (issue 42: Narayanan et al. 2021's compute, communication and bubble terms; Calculon).

``step_parts(plan)`` reads the plan's own prices, nothing new is priced here:

* per op family, the seconds of its nodes' forward and backward on one device (``NodeDecision.
  compute_s``): **matmuls** (the GEMM ops of ``cost_model/compute.py``), **attention**
  (``scaled_dot_product_attention`` and its kernels), **loss** (the output projection fused with
  its cross-entropy, or the loss alone), **norms and elementwise** (every other op: norms,
  activations, residual adds, rotary embeddings, copies), and **per-parameter work** (the
  parameters' own nodes: their optimizer steps and gradient accumulation);
* the collectives as priced before any overlap (``NodeDecision.comm_s``): **tensor and sequence
  parallel** (those of activations: resharding between ops and the collectives inside a lowering)
  and **data parallel** (those of parameters: gradient reduction, ZeRO's gathers);
* the trades' seconds (``Plan.trade_costs``: ZeRO's gathers and scatters, offload, micro-batches,
  recomputation; recomputation's are already in the parts above, ``IN_PARTS``: the forwards it
  runs again are in their ops' compute, the collectives it runs again in the exposed
  communication), the pipeline's **bubble** (``Predicted.bubble_s``), the communication left
  **exposed** after overlap (``Predicted.comm_s``) and the gradient reduction **hidden** behind
  backward (``Predicted.grad_sync_hidden_s``).

A pipelined plan's decisions price the whole model on one stage's mesh: its op families and
collectives are per device as if the stages split the work evenly (divided by the stage count),
the busiest rank's compute and its bubble are the schedule's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_model.compute import GEMM_OPS
from autopar.plan import Plan

ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "ring_attention")
LOSS_OPS = ("cross_entropy", "nll_loss")


def op_family(op: str, role: str = "activation") -> str:
    """The part of the step a decision's ``op`` (``NodeDecision.op``) counts in."""
    if role in ("param", "buffer", "input") or op == "placeholder":
        return "per-parameter work"
    if op in GEMM_OPS and "cross_entropy" not in op:
        return "matmuls"
    if any(k in op for k in ATTENTION_OPS):
        return "attention"
    if any(k in op for k in LOSS_OPS):
        return "loss"
    return "norms and elementwise"


FAMILIES = ("matmuls", "attention", "loss", "norms and elementwise", "per-parameter work")
# trades whose seconds the cost tables hold, so the op families above already count them
# (``passes/trade_terms.py:TradeTerms.in_tables``)
IN_PARTS = frozenset({"recompute"})


@dataclass(frozen=True)
class StepParts:
    """One device's predicted step in parts [s] (module docstring)."""

    step_s: float
    compute: dict[str, float]  # op family -> seconds (FAMILIES order)
    tensor_comm_s: float  # activations' collectives, priced before overlap
    data_comm_s: float  # parameters' collectives (gradient reduction, ZeRO gathers), before overlap
    trades: dict[str, float]  # trade -> seconds (Plan.trade_costs)
    bubble_s: float
    exposed_comm_s: float
    hidden_grad_sync_s: float
    stages: int

    def rows(self) -> list[tuple[str, float]]:
        """(part, seconds) in reading order."""
        out = [(f"compute: {k}", v) for k, v in self.compute.items()]
        out += [
            ("collectives: tensor / sequence parallel (before overlap)", self.tensor_comm_s),
            ("collectives: data parallel (before overlap)", self.data_comm_s),
        ]
        out += [
            (f"trade: {k}" + (" (in the parts above)" if k in IN_PARTS else ""), v)
            for k, v in self.trades.items()
        ]
        out += [
            ("pipeline bubble", self.bubble_s),
            ("communication exposed", self.exposed_comm_s),
            ("gradient reduction hidden behind backward", self.hidden_grad_sync_s),
            ("step", self.step_s),
        ]
        return out

    def describe(self) -> str:
        """One line: each nonzero part in ms."""
        return ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.rows() if v > 0)


def step_parts(plan: Plan) -> StepParts:
    """``plan``'s predicted step in parts (module docstring)."""
    stages = max(plan.pipeline.stages, 1)
    compute = dict.fromkeys(FAMILIES, 0.0)
    tensor = data = 0.0
    for d in plan.decisions:
        compute[op_family(d.op, d.role)] += d.compute_s / stages
        if d.role in ("param", "buffer"):
            data += d.comm_s / stages
        else:
            tensor += d.comm_s / stages
    p = plan.predicted
    return StepParts(
        step_s=p.step_time_s,
        compute=compute,
        tensor_comm_s=tensor,
        data_comm_s=data,
        trades={k: float(v.get("seconds", 0.0)) for k, v in plan.trade_costs.items()},
        bubble_s=p.bubble_s,
        exposed_comm_s=p.comm_s,
        hidden_grad_sync_s=p.grad_sync_hidden_s,
        stages=stages,
    )
