"""autopar: automatic parallelization of unmodified PyTorch models.

pmodel = autopar.autoparallelize(model, cluster_spec, example_inputs)   # on every rank
plan = autopar.plan(model, cluster_spec, example_inputs)                # offline, no GPU needed
torch_plan = autopar.to_torch(plan, model, example_inputs)              # PyTorch's own TP/DP plan
"""

from autopar import _quiet  # noqa: F401  (first: torchao's start-up noise, autopar/_quiet.py)
from autopar.api import autoparallelize, plan, reprice, search
from autopar.cluster import ClusterSpec, DeviceKind, DeviceSpec, LinkSpec
from autopar.codegen.feeding import InputsError
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
from autopar.export import DataParallel, ExportError, TorchPlan, to_torch
from autopar.fusion import Kernel, KernelUse
from autopar.options import AxisRole, Optimizer, SearchOptions, SearchOptionsError
from autopar.placement import Outputs, SeqAttention
from autopar.plan import NodeDecision, Plan, PlannedCollective, Predicted, Site
from autopar.reshard import Collective, Phase
from autopar.trades import (
    Float8,
    Offload,
    Pipeline,
    Precision,
    Recompute,
    Schedule,
    Trades,
    TradesError,
    ZeroStage,
)

__all__ = [
    "AutoparError",
    "AxisRole",
    "ClusterSpec",
    "Collective",
    "ClusterSpecError",
    "CollectiveCallError",
    "DeviceKind",
    "DeviceSpec",
    "DataParallel",
    "ExportError",
    "TorchPlan",
    "CrossRankMismatchError",
    "DistributedSetupError",
    "InputsError",
    "LinkSpec",
    "NoPlanFitsError",
    "NodeDecision",
    "PeerFailedError",
    "OpCoverage",
    "Optimizer",
    "Float8",
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
    "to_torch",
]
