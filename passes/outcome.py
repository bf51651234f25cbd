"""How each candidate of the outer search ended, as typed values: a ``Verdict`` per candidate (or
per rung of its trades ladder) and its ``Entry``, the record the plan keeps of it.

The search branches on the verdict; the plan's candidate list (``Plan.solver.candidates``, the
``5_select.json`` dump, the HTML report) is ``Entry.to_dict`` of each, made at the edge. Its
``status`` there: the solver's own status (``Optimal``, ``Feasible (time limit)``, ``Feasible
(node limit)`` with ``ilp_bound``) for a solved candidate, ``infeasible`` where no plan fits (with ``blocked`` where no strategy choice exists at
all), ``pruned`` where a bound passes the best plan so far (with ``lp_bound`` where the ILP's LP
relaxation did), ``no placement for its axis roles``, or ``same as (mesh)`` for a mesh whose axes
permute an earlier one's.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from autopar.options import AxisRole
from autopar.trades import Pipeline, Trades


class Verdict(enum.Enum):
    """How one candidate (or one rung of its trades ladder) ended."""

    SOLVED = "solved"  # a plan that fits
    INFEASIBLE = "infeasible"  # no plan fits the memory (or the batch's split, or the host's memory)
    BLOCKED = "blocked"  # no strategy choice at all under its axis roles: ``Entry.blocked`` says why
    BOUND_PRUNED = "bound pruned"  # its time lower bound is no better than the best so far
    LP_PRUNED = "lp pruned"  # its ILP's LP relaxation is no better: it has a plan, no better
    UNPLACEABLE = "unplaceable"  # its axis roles leave some tensor no placement
    MIRROR = "mirror"  # its axes permute an earlier candidate's, on the same links: not solved

    @property
    def infeasible(self) -> bool:
        """No plan (the report's ``infeasible``)."""
        return self is Verdict.INFEASIBLE or self is Verdict.BLOCKED

    @property
    def pruned(self) -> bool:
        """A bound passed the best plan so far (the report's ``pruned``)."""
        return self is Verdict.BOUND_PRUNED or self is Verdict.LP_PRUNED


@dataclass(frozen=True)
class Entry:
    """One candidate's record. ``mesh``, ``roles``: the candidate; ``lower_bound``, ``trades``:
    its time lower bound and the rung of the ladder solved (None for a candidate never solved:
    unplaceable or a mirror); ``objective``: its predicted step where it has a plan;
    ``solver_status``: the solver's status where solved; ``blocked``: why no choice exists;
    ``lp_bound``: the LP relaxation that pruned it; ``mirror_of``: the mesh it permutes;
    ``pipeline_stages``, ``pipeline``: a pipeline candidate's stage count and the pipeline priced."""

    mesh: tuple[int, ...]
    verdict: Verdict
    roles: tuple[AxisRole, ...] | None = None
    lower_bound: float | None = None
    trades: Trades | None = None
    objective: float | None = None
    solver_status: str = ""
    blocked: str = ""
    lp_bound: float | None = None
    mirror_of: tuple[int, ...] | None = None
    pipeline_stages: int | None = None
    pipeline: Pipeline | None = None
    # where the ILP's node limit stopped it (``passes/solver.py:MIP_NODE_LIMIT``): the least
    # objective its tree proved for the candidate's plans [s] (-inf: none); the plans between it
    # and ``objective`` were not explored
    ilp_bound: float | None = None

    def __post_init__(self):
        if self.verdict is Verdict.BLOCKED and not self.blocked:
            raise ValueError("a blocked candidate's entry says why (blocked=...)")
        if self.verdict is Verdict.MIRROR and self.mirror_of is None:
            raise ValueError("a mirrored candidate's entry names the mesh it permutes (mirror_of=...)")

    @property
    def status(self) -> str:
        """The report's status string."""
        if self.verdict is Verdict.SOLVED:
            return self.solver_status
        if self.verdict.infeasible:
            return "infeasible"
        if self.verdict.pruned:
            return "pruned"
        if self.verdict is Verdict.UNPLACEABLE:
            return "no placement for its axis roles"
        return f"same as {self.mirror_of}"

    def to_dict(self) -> dict:
        """The plan's record of the candidate (``Plan.solver.candidates``)."""
        roles = {"axis_roles": [r.value for r in self.roles]} if self.roles else {}
        if self.verdict is Verdict.MIRROR:
            return {"mesh_shape": list(self.mesh), "status": self.status, "objective": None}
        if self.verdict is Verdict.UNPLACEABLE:
            return {"mesh_shape": list(self.mesh), "status": self.status, "objective": None, **roles}
        out = {
            "mesh_shape": list(self.mesh),
            "lower_bound": self.lower_bound,
            "trades": self.trades.to_dict(),
        }
        out.update(roles)
        if self.lp_bound is not None:
            out["lp_bound"] = self.lp_bound
        if self.ilp_bound is not None:  # JSON has no -inf: None where the tree proved no bound
            out["ilp_bound"] = self.ilp_bound if self.ilp_bound > -math.inf else None
        out["status"] = self.status
        out["objective"] = self.objective
        if self.blocked:
            out["blocked"] = self.blocked
        if self.pipeline_stages is not None:
            out["pipeline_stages"] = self.pipeline_stages
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline.to_dict()
        return out
