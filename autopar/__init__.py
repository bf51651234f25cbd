"""autopar: automatic parallelization of unmodified PyTorch models.

pmodel = autopar.autoparallelize(model, cluster_spec, example_inputs)   # on every rank
plan = autopar.plan(model, cluster_spec, example_inputs)                # offline, no GPU needed
"""

from autopar.api import autoparallelize, plan, reprice, search
from autopar.cluster import ClusterSpec, DeviceKind, DeviceSpec, LinkSpec
from autopar.codegen.weights import Rank0Weights, WeightsError
from autopar.coverage import OpCoverage, coverage
from autopar.errors import (
    AutoparError,
    ClusterSpecError,
    CollectiveCallError,
    CrossRankMismatchError,
    DistributedSetupError,
    NoPlanFitsError,
    PeerFailedError,
    PlanFormatError,
    PlanMismatchError,
    TraceError,
    UnsupportedDeviceKindError,
)
from autopar.fusion import Kernel, KernelUse
from autopar.options import AxisRole, Optimizer, SearchOptions, SearchOptionsError
from autopar.placement import Outputs, SeqAttention
from autopar.plan import NodeDecision, Plan, PlannedCollective, Predicted, Site
from autopar.reshard import Collective, Phase
from autopar.trades import Offload, Pipeline, Precision, Recompute, Schedule, Trades, TradesError, ZeroStage

__all__ = [
    "AutoparError",
    "AxisRole",
    "ClusterSpec",
    "Collective",
    "ClusterSpecError",
    "CollectiveCallError",
    "DeviceKind",
    "DeviceSpec",
    "CrossRankMismatchError",
    "DistributedSetupError",
    "LinkSpec",
    "NoPlanFitsError",
    "NodeDecision",
    "PeerFailedError",
    "OpCoverage",
    "Optimizer",
    "Offload",
    "Precision",
    "Recompute",
    "Trades",
    "Pipeline",
    "Schedule",
    "TradesError",
    "ZeroStage",
    "Outputs",
    "Kernel",
    "KernelUse",
    "SeqAttention",
    "Plan",
    "PlanFormatError",
    "PlanMismatchError",
    "PlannedCollective",
    "Rank0Weights",
    "Phase",
    "Predicted",
    "SearchOptions",
    "SearchOptionsError",
    "Site",
    "TraceError",
    "UnsupportedDeviceKindError",
    "WeightsError",
    "autoparallelize",
    "coverage",
    "plan",
    "reprice",
    "search",
]
