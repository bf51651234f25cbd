"""Typed errors. Each message says what went wrong and how to fix it."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class ClusterSpecError(AutoparError, ValueError):
    """A cluster description is invalid: the message names the field and the allowed values."""


class UnsupportedDeviceKindError(AutoparError, ValueError):
    """Something needed per device kind (autocast's fp32 ops, default kernels, ...) has no entry for
    the cluster's ``DeviceSpec.kind``: the message names the table to extend."""


class TraceError(AutoparError):
    """The model could not be captured as a graph: the message names the failing construct."""


class NoPlanFitsError(AutoparError):
    """No sharding plan fits the per-device memory: the message gives needed vs available bytes."""


class PlanMismatchError(AutoparError):
    """A saved plan was made for a different model, input shapes or cluster."""


class PlanFormatError(AutoparError, ValueError):
    """A plan file is not valid autopar plan JSON (or has an unsupported schema version)."""


class SolverError(AutoparError):
    """The ILP solver failed or returned no feasible solution."""


class DistributedSetupError(AutoparError, RuntimeError):
    """torch.distributed is not initialized or does not match the plan's mesh."""


class ModelSpecError(AutoparError, ValueError):
    """A MODEL_SPEC on the command line could not be loaded."""


class ProfilerDeviceError(AutoparError, ValueError):
    """Op profiling was asked for a device this machine does not have: the message says what to plan with."""


class ProfileCacheError(AutoparError, ValueError):
    """The op profile cache file is unreadable or not autopar's: the message names the file to delete."""


class UnpricedOpError(AutoparError):
    """An op's FLOPs or saved tensors could not be derived in strict analysis: the message names the
    op, the node, why, and the fix (a derivation in passes/analyze.py or an allow-list entry)."""


class CrossRankMismatchError(DistributedSetupError):
    """Ranks disagree on what every rank must share (the weights, the example inputs, the plan,
    the batch): the message says what differs, on which ranks, and how to make them agree."""


class CollectiveCallError(AutoparError, RuntimeError):
    """A collective call of the parallel module (``full_state_dict``, ``full_output``,
    ``full_grads``, and ``forward``, ``step``, backward where the plan issues collectives) was
    entered by some ranks of its mesh while the others made another call at that point, or did
    not come in time (the "save on rank 0" habit): raised on the ranks that came, naming the
    calls, the ranks and the fix, instead of a backend abort or a hang in a collective."""


class PeerFailedError(CollectiveCallError):
    """Another rank of the job failed in a collective call (``CollectiveCallError``) and aborted its
    process groups: raised on every other rank at its next collective call, or in place of the
    backend's error in the collective that rank left unjoined, naming the rank and what it raised
    (``codegen/failures.py``), instead of a hang."""


class ReferenceDataError(AutoparError, ValueError):
    """A file of measured op times (``autopar/tools/op_reference.py``) has a row no pricing knows, or
    too few rows to fit a figure: the message names the row or the figure."""


class CollectiveMatmulError(AutoparError, ValueError):
    """A collective matmul (``kernels/collective_matmul.py``) was given pieces it cannot cut: the
    message says which dim and how to fix it."""
