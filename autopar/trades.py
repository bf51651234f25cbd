"""Memory-for-time trades: the decisions of a plan besides each op's placement.

A ``Trades`` value says, for the whole step:

* ``recompute``: which activations of each repeated block are recomputed in backward instead of
  kept (``Recompute.NONE`` / ``SELECTIVE``, Megatron's selective recomputation: the matmul
  outputs are kept, everything between them recomputed / ``HALF_MATMULS``: the same, and every
  other matmul of a block recomputed too, torchtitan's op-level selective checkpointing
  (``passes/blocks.py:alternate_matmuls``) / ``FULL``: only each block's inputs kept);
* ``recompute_blocks``: None, every repeated block recomputes under ``recompute``; ``N``, only the
  first ``N`` blocks of each pipeline stage (of the model, without stages) do, the others keep
  every activation (as ``Recompute.NONE``): Megatron-LM's ``--recompute-method block
  --recompute-num-layers N``, which recomputes the first ``N`` layers of each stage
  (``recomputed_blocks``);
* ``micro_batches``: the global batch runs as this many micro-batches per step (gradient
  accumulation); one micro-batch's activations are live at a time, gradients are reduced once;
* ``precision``: ``Precision.PARAM`` computes in the parameters' dtype and keeps the optimizer state
  in it; ``BF16`` / ``FP16`` are mixed precision: fp32 master parameters, gradients and optimizer
  state, the forward and backward under ``torch.autocast`` in the half type;
* ``zero_stage``: ZeRO over the plan's data-parallel axes (``data_axes``): 1 shards the optimizer
  state, 2 also the gradients (reduce-scattered), 3 also the parameters (gathered before use,
  freed after forward, gathered again in backward);
* ``offload``: what lives in host memory, both run by FSDP2's ``CPUOffloadPolicy``
  (``codegen/zero.py``), which keeps the sharded parameters (the fp32 masters), their gradients
  and so the optimizer state on the host and runs the optimizer's step there; the two differ in
  what the device keeps during the step, which is the ZeRO stage's:
  ``Offload.OPTIMIZER`` (ZeRO-2 only) keeps the gathered parameters (in the compute dtype) on the
  device from forward through backward: ZeRO-Offload's split (Ren et al. 2021), the device holds
  what it computes with, the host the masters, gradients and optimizer state;
  ``Offload.PARAMETERS`` (ZeRO-3 only) keeps on the device only the blocks in flight: each
  repeated block's parameters are copied from the host and gathered just before use, the next
  block's prefetched, and freed after, in forward and again in backward (Colossal-AI's Gemini,
  ZeRO-Infinity's parameter offload). Each offload needs its one stage, so no two
  ``(zero_stage, offload)`` pairs run the same code.

``SearchOptions`` holds one field per trade (None: the search chooses, ``passes/trades.py``);
the plan records the chosen ``Trades`` and what each costs and saves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from autopar.errors import AutoparError


class TradesError(AutoparError, ValueError):
    """A trade out of range; the message says which and what is allowed."""


class Recompute(enum.Enum):
    NONE = "none"
    SELECTIVE = "selective"
    HALF_MATMULS = "half_matmuls"
    FULL = "full"


class Precision(enum.Enum):
    PARAM = "param"  # the parameters' own dtype, no master copy
    BF16 = "bf16"  # fp32 master parameters and optimizer state, bf16 compute
    FP16 = "fp16"  # the same with fp16 compute (and a loss scaler in the user's loop)

    @property
    def mixed(self) -> bool:
        return self is not Precision.PARAM


class Float8(enum.Enum):
    """FP8 linears, a precision decision per linear (``autopar/lowerings/float8.py``): a linear that
    runs FP8 casts its input, weight and output gradient to ``float8_e4m3fn`` with dynamic scales
    and runs its three GEMMs as scaled matmuls (torchao's float8 training); everything else keeps
    the plan's precision. ``TENSORWISE``: one scale per tensor (torchao's ``"tensorwise"`` recipe);
    ``ROWWISE``: one per row of each GEMM operand along its reduced dim (``"rowwise"``, scales
    rounded down to powers of 2). ``OFF``: no linear runs FP8. ``SearchOptions.float8`` None
    (auto) lets the search choose per linear where the device has an FP8 rate."""

    OFF = "off"
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"

    @classmethod
    def parse(cls, value, error: type[Exception] = None) -> Float8:
        """A member, or the member whose value is ``value``; ``error`` (TradesError) otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            raise (error or TradesError)(
                f"float8 must be one of {[m.value for m in cls]} (or None: auto), got {value!r}"
            ) from None


class Offload(enum.Enum):
    NONE = "none"
    OPTIMIZER = "optimizer"  # masters, gradients, state on the host; the gathered on the device
    PARAMETERS = "parameters"  # the same, and the device holds only the blocks in flight (ZeRO-3)

    @property
    def stage(self) -> ZeroStage | None:
        """The one ZeRO stage this offload runs with (None: any)."""
        return _OFFLOAD_STAGE.get(self)

    @property
    def what(self) -> str:
        """What it keeps in host memory, for summaries and reports."""
        return _OFFLOAD_WHAT[self]


class ZeroStage(enum.IntEnum):
    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


_OFFLOAD_STAGE = {Offload.OPTIMIZER: ZeroStage.GRADIENTS, Offload.PARAMETERS: ZeroStage.PARAMETERS}
_OFFLOAD_WHAT = {
    Offload.NONE: "nothing",
    Offload.OPTIMIZER: "optimizer state and masters in host memory",
    Offload.PARAMETERS: "parameters, gradients and optimizer state in host memory, streamed per block",
}

# the trades that are closed sets, by field name (``Trades`` and ``SearchOptions`` both hold them)
ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "recompute": Recompute,
    "precision": Precision,
    "zero_stage": ZeroStage,
    "offload": Offload,
}


def offload_stage_text(offload: Offload, zero_stage) -> str:
    """Why ``offload`` does not run with ``zero_stage``, and what to pass instead."""
    other = next(o for o, z in _OFFLOAD_STAGE.items() if o is not offload)
    return (
        f"offload={offload.value} needs zero_stage={int(offload.stage)} (FSDP2 offloads its sharded state; "
        f"the stage decides what the device keeps: {offload.what}), got zero_stage={int(zero_stage)}; "
        f"pass zero_stage={int(offload.stage)}, offload={other.value} with zero_stage={int(other.stage)}, "
        "or leave either None (auto)"
    )


def coerce(name: str, value, error: type[Exception] = TradesError):
    """``value`` as the enum of trade ``name`` (its member, or a member's value: ``"full"``, ``3``);
    ``error`` naming the allowed values otherwise."""
    kind = ENUM_FIELDS[name]
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        raise error(f"{name} must be one of {[m.value for m in kind]}, got {value!r}") from None


@dataclass(frozen=True)
class Trades:
    """The trades of one plan (module docstring). ``data_axes``: the mesh axes ZeRO shards over
    (the plan's data-parallel axes; empty when it has none, and then ``zero_stage`` is 0)."""

    recompute: Recompute = Recompute.NONE
    micro_batches: int = 1
    precision: Precision = Precision.PARAM
    zero_stage: ZeroStage = ZeroStage.NONE
    offload: Offload = Offload.NONE
    data_axes: tuple[int, ...] = ()
    recompute_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ENUM_FIELDS:
            object.__setattr__(self, name, coerce(name, getattr(self, name)))
        check_recompute_blocks(self.recompute_blocks, self.recompute)
        if (
            isinstance(self.micro_batches, bool)
            or not isinstance(self.micro_batches, int)
            or self.micro_batches < 1
        ):
            raise TradesError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        object.__setattr__(self, "data_axes", tuple(int(a) for a in self.data_axes))
        if self.offload.stage is not None and self.zero_stage != self.offload.stage:
            raise TradesError(offload_stage_text(self.offload, self.zero_stage))
        if self.zero_stage and not self.data_axes:
            raise TradesError(
                f"zero_stage {int(self.zero_stage)} needs a data-parallel mesh axis to shard over; "
                "give axis_roles with AxisRole.DATA, or zero_stage=0"
            )

    @property
    def is_default(self) -> bool:
        return self == Trades(data_axes=self.data_axes)

    def describe(self) -> str:
        """One line for summaries and progress: only what differs from the default."""
        parts = []
        if self.recompute is not Recompute.NONE:
            parts.append(f"recompute {self.recompute.value}")
            if self.recompute_blocks is not None:
                parts[-1] += f" on the first {self.recompute_blocks} blocks per stage"
        if self.micro_batches > 1:
            parts.append(f"{self.micro_batches} micro-batches")
        if self.precision.mixed:
            parts.append(f"{self.precision.value} mixed precision")
        if self.zero_stage:
            parts.append(f"ZeRO-{int(self.zero_stage)} over axes {list(self.data_axes)}")
        if self.offload is not Offload.NONE:
            parts.append(f"{self.offload.value} offloaded to host")
        return ", ".join(parts) or "no trades"

    def to_dict(self) -> dict[str, Any]:
        return {
            "recompute": self.recompute.value,
            "micro_batches": self.micro_batches,
            "precision": self.precision.value,
            "zero_stage": int(self.zero_stage),
            "offload": self.offload.value,
            "data_axes": list(self.data_axes),
        } | ({} if self.recompute_blocks is None else {"recompute_blocks": self.recompute_blocks})

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Trades:
        if not d:
            return cls()
        blocks = d.get("recompute_blocks")  # absent in plans before partial recomputation: every block
        return cls(
            Recompute(d.get("recompute", "none")),
            int(d.get("micro_batches", 1)),
            Precision(d.get("precision", "param")),
            ZeroStage(int(d.get("zero_stage", 0))),
            Offload(d.get("offload", "none")),
            tuple(d.get("data_axes", ())),
            None if blocks is None else int(blocks),
        )

    def recomputed(self, n_blocks: int, cuts: tuple[int, ...] = (), stages: int = 1) -> frozenset[int]:
        """The indices of the blocks (of ``n_blocks``, in pipeline chunks cut at ``cuts`` over
        ``stages`` ranks) that recompute under these trades (``recomputed_blocks``)."""
        if self.recompute is Recompute.NONE:
            return frozenset()
        return recomputed_blocks(n_blocks, self.recompute_blocks, cuts, stages)


def check_recompute_blocks(n, recompute, error: type[Exception] = TradesError) -> None:
    """``error`` where ``n`` (``Trades.recompute_blocks``) is not None or a count >= 0, or is given
    without recomputation (``recompute`` None, auto, passes)."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise error(
            f"recompute_blocks must be a count of blocks >= 0 per pipeline stage (or None: every block), got {n!r}"
        )
    if recompute is not None and Recompute(recompute) is Recompute.NONE:
        raise error(
            f"recompute_blocks={n} says how many blocks recompute, but recompute is none: pass recompute="
            "full (or selective, half_matmuls) with it, or recompute_blocks=None"
        )


def recomputed_blocks(
    n_blocks: int, n: int | None, cuts: tuple[int, ...] = (), stages: int = 1
) -> frozenset[int]:
    """The blocks (indices of ``n_blocks`` repeated blocks) that recompute when ``n`` of each
    pipeline stage do (``Trades.recompute_blocks``): the first ``n`` blocks each pipeline rank
    holds, in the order it runs its chunks (the chunks cut at ``cuts``, chunk ``c`` on rank
    ``c % stages``: ``Pipeline``; no cuts: one chunk, the model). ``n`` None: every block.
    Megatron-LM's block method recomputes the first ``--recompute-num-layers`` of each stage's
    layers (``TransformerBlock._checkpointed_forward``); counted per rank rather than per chunk
    under an interleaved schedule, so that a stage's count means the same with any number of
    chunks (the search bounds a stage's memory before it picks the schedule).
    """
    if n is None:
        return frozenset(range(n_blocks))
    bounds = [0, *cuts, n_blocks]
    chunks = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    out: list[int] = []
    for rank in range(max(stages, 1)):
        mine = [i for c in chunks[rank :: max(stages, 1)] for i in c]
        out.extend(mine[:n])
    return frozenset(out)


# -- pipeline stages ------------------------------------------------------------------------------


class Schedule(enum.Enum):
    """The pipeline schedules torch.distributed.pipelining runs (``codegen/pipeline.py``)."""

    GPIPE = "gpipe"  # every micro-batch's forward, then every backward (ScheduleGPipe)
    ONE_F_ONE_B = "1f1b"  # warm-up forwards, then one forward one backward (Schedule1F1B)
    INTERLEAVED_1F1B = "interleaved_1f1b"  # 1F1B over v chunks per rank (ScheduleInterleaved1F1B)
    ZERO_BUBBLE = (
        "zero_bubble"  # backward split in input and weight gradients (ScheduleInterleavedZeroBubble)
    )

    @property
    def multi_chunk(self) -> bool:
        """Runs several chunks (virtual stages) per rank."""
        return self in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)


@dataclass(frozen=True)
class Pipeline:
    """A plan's pipeline: the step cut into ``stages * virtual_stages`` chunks at repeated-block
    boundaries, chunk ``c`` run by pipeline rank ``c % stages`` (torch's looped placement), the
    schedule ordering each rank's forwards and backwards of ``Trades.micro_batches`` micro-batches.

    ``cuts``: the first block (``passes/blocks.py`` index) of each chunk after the first, rising;
    what precedes the first block (embeddings) runs in chunk 0, what lies between two blocks (an
    encoder's final norm) with the block before it, what follows the last (head, loss) in the last
    chunk. ``stages == 1``: no pipeline. The plan's ``mesh_shape`` is one stage's mesh;
    the devices are ``stages`` such meshes, pipeline rank ``p`` holding global ranks
    ``p * M .. p * M + M - 1`` (``M`` the stage mesh's size): the pipeline is the outermost axis."""

    stages: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    cuts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", coerce_schedule(self.schedule))
        for name in ("stages", "virtual_stages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TradesError(f"pipeline {name} must be a positive integer, got {v!r}")
        object.__setattr__(self, "cuts", tuple(int(c) for c in self.cuts))
        if self.stages > 1:
            if self.schedule.multi_chunk and self.virtual_stages < 2:
                raise TradesError(
                    f"schedule {self.schedule.value} runs several chunks per rank: virtual_stages must be >= 2, "
                    f"got {self.virtual_stages}; or use schedule 1f1b / gpipe"
                )
            if not self.schedule.multi_chunk and self.virtual_stages != 1:
                raise TradesError(
                    f"schedule {self.schedule.value} runs one chunk per rank: virtual_stages must be 1, got "
                    f"{self.virtual_stages}; use schedule interleaved_1f1b for {self.virtual_stages} chunks per rank"
                )
            if len(self.cuts) != self.chunks - 1:
                raise TradesError(
                    f"a pipeline of {self.chunks} chunks needs {self.chunks - 1} cuts, got {list(self.cuts)}"
                )
            if any(b <= a for a, b in zip(self.cuts, self.cuts[1:])) or (self.cuts and self.cuts[0] < 1):
                raise TradesError(f"pipeline cuts must rise from 1, got {list(self.cuts)}")

    @property
    def enabled(self) -> bool:
        return self.stages > 1

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual_stages

    def chunk_of_block(self, index: int) -> int:
        """The chunk block ``index`` runs in."""
        return sum(1 for c in self.cuts if c <= index)

    def rank_of_chunk(self, chunk: int) -> int:
        return chunk % self.stages

    def describe(self) -> str:
        if not self.enabled:
            return "no pipeline"
        v = f", {self.virtual_stages} chunks per rank" if self.virtual_stages > 1 else ""
        return f"{self.stages} stages, {self.schedule.value}{v}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": self.stages,
            "schedule": self.schedule.value,
            "virtual_stages": self.virtual_stages,
            "cuts": list(self.cuts),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Pipeline:
        if not d:
            return cls()
        return cls(
            int(d.get("stages", 1)),
            Schedule(d.get("schedule", "1f1b")),
            int(d.get("virtual_stages", 1)),
            tuple(d.get("cuts", ())),
        )

    @staticmethod
    def even_cuts(blocks: int, chunks: int) -> tuple[int, ...]:
        """Cuts giving ``chunks`` chunks of as equal a number of ``blocks`` as can be (the first
        chunks one block more)."""
        if chunks > blocks:
            raise TradesError(
                f"{chunks} pipeline chunks need at least as many repeated blocks, the model has {blocks}; "
                "use fewer pipeline_stages (or virtual stages)"
            )
        q, r = divmod(blocks, chunks)
        cuts, at = [], 0
        for c in range(chunks - 1):
            at += q + (1 if c < r else 0)
            cuts.append(at)
        return tuple(cuts)


def coerce_schedule(value, error: type[Exception] = TradesError) -> Schedule:
    if isinstance(value, Schedule):
        return value
    try:
        return Schedule(value)
    except ValueError:
        raise error(f"schedule must be one of {[s.value for s in Schedule]}, got {value!r}") from None
