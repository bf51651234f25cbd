"""What every candidate of one search shares (``Problem``), and what a pass over the candidates
found (``Found``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from autopar.cluster import ClusterSpec
from autopar.errors import NoPlanFitsError
from autopar.options import SearchOptions
from autopar.passes.analyze import NodeInfo
from autopar.passes.blocks import Block
from autopar.passes.coarsen import Classes
from autopar.passes.costs import NodeTimer
from autopar.passes.data_region import DataRegion
from autopar.passes.dumps import Stages
from autopar.passes.ladder import Climb
from autopar.passes.mesh_solve import Solved
from autopar.passes.micro_batch_check import MicroBatchCheck
from autopar.passes.outcome import Entry
from autopar.passes.strategies import Strategy
from autopar.passes.trace import TracedGraph
from autopar.trades import Precision, Trades


@dataclass(frozen=True)
class Problem:
    """What every candidate of one search shares: the traced model and its analyses, the cluster,
    options and limits, and the caches filled as candidates are tried (``data_axis``: the
    data-parallel solution of one axis by its size; ``regions``: data-parallel regions by the
    ranks of the data axis, or why there is none)."""

    tg: TracedGraph
    infos: dict[str, NodeInfo]
    cinfos: dict[str, NodeInfo]  # as the cost model prices them (``passes/precision.py:half_infos``)
    classes: Classes | None
    blocks: list[Block]
    cluster: ClusterSpec
    options: SearchOptions
    precision: Precision
    batch: int | None
    limit: float  # bytes per device
    profiler: NodeTimer | None
    st: Stages
    micro: MicroBatchCheck
    model: torch.nn.Module
    example_inputs: object
    data_axis: dict[int | tuple, dict[str, Strategy] | NoPlanFitsError] = field(default_factory=dict)
    regions: dict[int, DataRegion | str] = field(default_factory=dict)
    # what the candidates' cost tables share (``passes/costs.py:build_costs``'s ``memos``): the
    # graph's kept tensors and gradient uses, and the edge pairs priced, by cluster, mesh and data
    # axes (candidates of one mesh under other axis roles price the same pairs again)
    table_memos: dict[tuple, object] = field(default_factory=dict)


@dataclass
class Found:
    """What one pass over the candidates found: each candidate's entry, the fastest plan that fits
    (None where none does) and the objective later candidates are pruned against, and what the
    error says when none fits."""

    candidates: list[Entry] = field(default_factory=list)
    best: Solved | None = None
    # the best objective so far: a candidate whose bound is no better is pruned
    objective: float = math.inf
    min_needed: float = math.inf
    refused_at_full_peak: bool = False
    refused_peak: float = math.inf  # the least full peak of the plans refused at it
    host_needed: float = math.inf  # the least host bytes per device of a plan refused for host memory
    tried: list[Trades] = field(default_factory=list)  # the rungs of the trades ladder considered
    # candidates whose roles no placement of some tensor satisfies, and why
    unplaceable: list[str] = field(default_factory=list)

    def add(self, climb: Climb) -> None:
        """A candidate's climb down its ladder: its entries, bounds and objective."""
        self.candidates.extend(climb.entries)
        self.min_needed = min(self.min_needed, climb.mem_needed)
        self.refused_at_full_peak |= climb.refused_at_full_peak
        self.refused_peak = min(self.refused_peak, climb.refused_peak)
        self.host_needed = min(self.host_needed, climb.host_needed)
        self.tried.extend(climb.tried)
        self.objective = climb.objective

    def offer(self, solved: Solved) -> None:
        """``solved`` becomes the best where it is faster (by more than rounding)."""
        if self.best is None or solved.t_step < self.best.t_step - 1e-12:
            self.best = solved
