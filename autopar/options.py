"""What a search is asked to do: one frozen value, passed through every stage.

``SearchOptions`` holds every choice a user (or a test) may force; ``autopar.plan``,
``autopar.autoparallelize`` and the CLI build one from their keyword arguments, and the search
(``passes/search.py``) reads it, never a copied list of keywords. The enums a user names there
(``AxisRole``, ``Optimizer``) live here too, below the passes that read them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

from autopar.errors import AutoparError
from autopar.fusion import Kernel, KernelsError, coerce_kernels
from autopar.placement import ExpertDispatch, Outputs, SeqAttention
from autopar.trades import (
    ENUM_FIELDS,
    Float8,
    Offload,
    Precision,
    Recompute,
    Schedule,
    Trades,
    TradesError,
    ZeroStage,
    check_recompute_blocks,
    coerce,
    coerce_schedule,
    offload_stage_text,
)


class SearchOptionsError(AutoparError, ValueError):
    """A search option out of range; the message says which and what is allowed."""


class AxisRole(enum.Enum):
    """What a mesh axis is used for (``passes/strategies.py`` says what each restricts)."""

    AUTO = "auto"
    DATA = "data"
    TENSOR = "tensor"
    SEQUENCE = "sequence"
    # DATA, and every mixture-of-experts op's experts split over the axis, its tokens sent to them
    # by all-to-all (expert parallelism); the other parameters whole, ZeRO shards them over it too
    EXPERT = "expert"

    @property
    def splits_batch(self) -> bool:
        """Does the axis split the batch (its inputs on their rows)?"""
        return self in (AxisRole.DATA, AxisRole.EXPERT)


class Optimizer(enum.Enum):
    """Optimizer state kept per parameter element, in copies of the parameter."""

    SGD = 0
    SGD_MOMENTUM = 1
    ADAM = 2


@dataclass(frozen=True)
class SearchOptions:
    """Every decision a search may be told to take, "auto" (None) by default.

    * ``mesh_shape``: the device mesh; None searches every mesh of up to 3 axes.
    * ``memory_limit_bytes``: the memory per device (default: the cluster device's); the plan's
      predicted peak stays under it less ``ClusterSpec.memory_reserve``.
    * ``time_limit_s``: the ILP solver's time limit per mesh.
    * ``expert_skew``: how unevenly a mixture of experts routes its tokens, priced: the busiest
      rank's share of the (token, expert) pairs over a balanced share (1, the default: balanced).
      Where experts are split, that rank's all-to-all bytes and expert matmuls grow by it; the plan
      records it (``Plan.expert_skew``).
    * ``axis_roles``: one ``AxisRole`` per mesh axis; None lets the solver choose every placement.
    * ``optimizer``: the optimizer whose state the memory model counts.
    * ``outputs``: ``Outputs.FULL`` (every output whole on every rank), ``Outputs.LOCAL`` (each
      rank's piece) or ``Outputs.LOSS`` (the loss alone: the other outputs are never computed).
    * ``coarsen``: repeated blocks share their ILP variables (``passes/coarsen.py``).
    * ``profile``: price ops by running them on this machine (``autopar.tools.profiler``) instead
      of the roofline.
    * the memory-for-time trades (``autopar/trades.py``), each None ("auto": the search chooses,
      ``passes/trades.py``) or forced: ``recompute`` (``Recompute``), ``micro_batches`` (int),
      ``precision`` (``Precision``; auto: the parameters' dtype for fp32 models, bf16 mixed
      precision for half-precision ones), ``zero_stage`` (0-3 or ``ZeroStage``), ``offload``
      (``Offload``: ``OPTIMIZER`` runs with ZeRO-2 only, ``PARAMETERS`` with ZeRO-3 only),
      ``recompute_blocks`` (how many repeated blocks of each pipeline stage recompute, the first
      ones: Megatron-LM's ``--recompute-num-layers``; None: every block where ``recompute`` is
      forced, else the search chooses every block or a part of them; forced, the search's rungs
      all recompute, in the mode ``recompute`` gives or it chooses).
    * pipeline stages (``autopar/trades.py:Pipeline``, ``passes/pipeline.py``), each None (auto) or
      forced: ``pipeline_stages`` (1: no pipeline; ``mesh_shape`` is then one stage's mesh, of
      ``world / pipeline_stages`` devices), ``schedule`` (``Schedule``), ``virtual_stages``
      (chunks per pipeline rank, for the interleaved schedules).
    * ``sequence_attention``: how attention runs where the plan splits its sequence over an axis
      (``SeqAttention``: K/V gathered, ring, or all-to-all); None lets the solver choose per
      attention by cost.
    * ``kernels``: the fused kernels substituted for their aten patterns (``autopar.fusion.Kernel``,
      ``passes/fuse.py``): None (auto) fuses every kernel where the cluster's devices are
      accelerators (Triton runs there) and none on CPUs; a set of kernels (or ``"all"``,
      ``"none"``) fuses exactly those on any device (the torch fallbacks run on CPUs).
    * ``overlap_matmuls``: run a linear and the all-gather before it, or the reduce-scatter after
      it, as one collective matmul whose ring hops overlap the matmul's chunks
      (``kernels/collective_matmul.py``; where it applies: ``passes/collective_matmul.py``), and
      price it so. None (auto): on where the devices overlap communication with compute
      (``DeviceSpec.comm_overlap`` > 0: GPUs), off on CPUs; False: off; True: on.
    * ``expert_dispatch``: how tokens travel to the experts where an axis splits them
      (``ExpertDispatch``). None (auto): the search chooses per MoE layer between the flat
      all-to-all and, where the expert axis spans nodes, the dispatch once per node (DeepEP's);
      ``ALL_TO_ALL``: the flat all-to-all only (Megatron's "alltoall" dispatcher: a run made with
      it is priced so). The dispatch once per node is not forced: it runs where the search finds it
      faster, and only where the axis spans whole nodes.
    * ``sequence_parallel``: True (the default) lets the search split the normalization layers
      (and so the residual stream around them) over a tensor axis, on the sequence, as Megatron-LM's
      ``--sequence-parallel`` does where that is cheaper; False keeps every normalization layer whole
      on every rank of a ``TENSOR`` axis, as Megatron-LM without it runs (each rank of the tensor
      group normalizes the whole sequence; a run made so is priced so).
    * ``float8``: FP8 linears (``autopar.trades.Float8``, ``autopar/lowerings/float8.py``), a
      precision decision per linear. None (auto): where the device has an FP8 rate
      (``DeviceSpec.float8_flops``: H100, H200, B200; not A100 or CPUs), each linear that computes
      in a half type runs FP8 with the cheaper recipe where that beats its own precision;
      ``OFF``: none; ``TENSORWISE`` / ``ROWWISE``: every linear that may run FP8 under its
      placement does, with that recipe, on any device (a CPU runs the scaled matmul too).
    """

    mesh_shape: tuple[int, ...] | None = None
    memory_limit_bytes: float | None = None
    time_limit_s: float | None = None
    axis_roles: tuple[AxisRole, ...] | None = None
    optimizer: Optimizer = Optimizer.ADAM
    outputs: Outputs = Outputs.FULL
    coarsen: bool = True
    profile: bool = False
    recompute: Recompute | None = None
    recompute_blocks: int | None = None
    micro_batches: int | None = None
    precision: Precision | None = None
    zero_stage: ZeroStage | None = None
    offload: Offload | None = None
    pipeline_stages: int | None = None
    schedule: Schedule | None = None
    virtual_stages: int | None = None
    sequence_attention: SeqAttention | None = None
    kernels: frozenset[Kernel] | None = None
    overlap_matmuls: bool | None = None
    expert_skew: float = 1.0
    float8: Float8 | None = None
    expert_dispatch: ExpertDispatch | None = None
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_parallel, bool):
            raise SearchOptionsError(
                f"sequence_parallel must be True or False, got {self.sequence_parallel!r}"
            )
        if self.float8 is not None:
            object.__setattr__(self, "float8", Float8.parse(self.float8, SearchOptionsError))
        try:
            object.__setattr__(self, "kernels", coerce_kernels(self.kernels))
        except KernelsError as e:
            raise SearchOptionsError(str(e)) from None
        if self.overlap_matmuls is not None and not isinstance(self.overlap_matmuls, bool):
            raise SearchOptionsError(
                f"overlap_matmuls must be True, False or None (auto), got {self.overlap_matmuls!r}"
            )
        for name, kind in (("sequence_attention", SeqAttention), ("expert_dispatch", ExpertDispatch)):
            if (v := getattr(self, name)) is not None:
                try:
                    object.__setattr__(self, name, kind(v))
                except ValueError:
                    raise SearchOptionsError(
                        f"{name} must be one of {[m.value for m in kind]} (or None: auto), got {v!r}"
                    ) from None
        if self.expert_dispatch not in (None, ExpertDispatch.ALL_TO_ALL):
            raise SearchOptionsError(
                f"expert_dispatch={self.expert_dispatch.value!r} cannot be forced: leave it None and the search "
                "dispatches once per node where the expert axis spans nodes and that is faster; "
                f"{ExpertDispatch.ALL_TO_ALL.value!r} forces the flat all-to-all"
            )
        for name in ("pipeline_stages", "virtual_stages"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise SearchOptionsError(f"{name} must be a positive integer (or None: auto), got {v!r}")
        if self.schedule is not None:
            object.__setattr__(self, "schedule", coerce_schedule(self.schedule, SearchOptionsError))
        for name in ENUM_FIELDS:  # None is "auto"
            if (v := getattr(self, name)) is not None:
                object.__setattr__(self, name, coerce(name, v, SearchOptionsError))
        if (
            self.offload is not None
            and self.offload.stage is not None
            and self.zero_stage is not None
            and self.zero_stage != self.offload.stage
        ):
            raise SearchOptionsError(offload_stage_text(self.offload, self.zero_stage))
        check_recompute_blocks(self.recompute_blocks, self.recompute, SearchOptionsError)
        if self.micro_batches is not None:
            try:
                Trades(micro_batches=self.micro_batches)
            except TradesError as e:
                raise SearchOptionsError(str(e)) from None
        if self.mesh_shape is not None:
            shape = tuple(self.mesh_shape)
            if not shape or any(int(n) != n or n < 1 for n in shape):
                raise SearchOptionsError(f"mesh_shape must be positive integers, got {self.mesh_shape!r}")
            object.__setattr__(self, "mesh_shape", tuple(int(n) for n in shape))
        if self.axis_roles is not None:
            roles = tuple(self.axis_roles)
            if not roles or not all(isinstance(r, AxisRole) for r in roles):
                raise SearchOptionsError(
                    f"axis_roles must be a non-empty sequence of autopar.AxisRole, got {self.axis_roles!r}"
                )
            if self.mesh_shape is not None and len(roles) != len(self.mesh_shape):
                raise SearchOptionsError(
                    f"axis_roles has {len(roles)} entries but mesh_shape {self.mesh_shape} has "
                    f"{len(self.mesh_shape)} axes: give one role per mesh axis"
                )
            object.__setattr__(self, "axis_roles", roles)
        for name in ("memory_limit_bytes", "time_limit_s"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or math.isnan(v) or v <= 0):
                raise SearchOptionsError(
                    f"{name} must be a positive number of {name.split('_')[-1]}, got {v!r}"
                )
        skew = self.expert_skew
        if not isinstance(skew, (int, float)) or math.isnan(skew) or skew < 1:
            raise SearchOptionsError(
                f"expert_skew is the busiest rank's share of a mixture of experts' routed tokens over a balanced "
                f"share: a number >= 1 (1: balanced), got {skew!r}"
            )
        if not isinstance(self.optimizer, Optimizer):
            raise SearchOptionsError(f"optimizer must be an autopar.Optimizer, got {self.optimizer!r}")
        if not isinstance(self.outputs, Outputs):
            raise SearchOptionsError(f"outputs must be an autopar.Outputs, got {self.outputs!r}")

    def fuses_matmuls(self, comm_overlap: float) -> bool:
        """Whether the plan runs collective matmuls: ``overlap_matmuls``, or (auto) where the
        device overlaps communication with compute at all (``DeviceSpec.comm_overlap`` above 0:
        GPUs; on CPU ranks nothing is hidden, so a ring only adds hops)."""
        if self.overlap_matmuls is not None:
            return self.overlap_matmuls
        return comm_overlap > 0

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, options: SearchOptions | None = None, **overrides) -> SearchOptions:
        """``options`` (default: all "auto") with the keyword arguments given replacing its fields;
        an unknown keyword is an error that lists the known ones."""
        unknown = sorted(set(overrides) - set(cls.names()))
        if unknown:
            raise TypeError(f"unknown search option(s) {unknown}; the options are {list(cls.names())}")
        base = options or cls()
        values = {f: getattr(base, f) for f in cls.names()}
        for k, v in overrides.items():
            values[k] = tuple(v) if k in ("mesh_shape", "axis_roles") and isinstance(v, Sequence) else v
        return cls(**values)
