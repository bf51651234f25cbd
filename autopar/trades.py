"""Memory-for-time trades: the decisions of a plan besides each op's placement.

A ``Trades`` value says, for the whole step:

* ``recompute``: which activations of each repeated block are recomputed in backward instead of
  kept (``Recompute.NONE`` / ``SELECTIVE``, Megatron's selective recomputation: the matmul
  outputs are kept, everything between them recomputed / ``FULL``: only each block's inputs kept);
* ``micro_batches``: the global batch runs as this many micro-batches per step (gradient
  accumulation); one micro-batch's activations are live at a time, gradients are reduced once;
* ``precision``: ``Precision.PARAM`` computes in the parameters' dtype and keeps the optimizer state
  in it; ``BF16`` / ``FP16`` are mixed precision: fp32 master parameters, gradients and optimizer
  state, the forward and backward under ``torch.autocast`` in the half type;
* ``zero_stage``: ZeRO over the plan's data-parallel axes (``data_axes``): 1 shards the optimizer
  state, 2 also the gradients (reduce-scattered), 3 also the parameters (gathered before use,
  freed after forward, gathered again in backward);
* ``offload``: ``Offload.OPTIMIZER`` keeps the optimizer state (and its fp32 master parameters) in
  host memory and runs the optimizer's step there.

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
    FULL = "full"


class Precision(enum.Enum):
    PARAM = "param"  # the parameters' own dtype, no master copy
    BF16 = "bf16"  # fp32 master parameters and optimizer state, bf16 compute
    FP16 = "fp16"  # the same with fp16 compute (and a loss scaler in the user's loop)

    @property
    def mixed(self) -> bool:
        return self is not Precision.PARAM


class Offload(enum.Enum):
    NONE = "none"
    OPTIMIZER = "optimizer"  # optimizer state and master parameters in pinned host memory


class ZeroStage(enum.IntEnum):
    NONE = 0
    OPTIMIZER = 1
    GRADIENTS = 2
    PARAMETERS = 3


# the trades that are closed sets, by field name (``Trades`` and ``SearchOptions`` both hold them)
ENUM_FIELDS: dict[str, type[enum.Enum]] = {
    "recompute": Recompute,
    "precision": Precision,
    "zero_stage": ZeroStage,
    "offload": Offload,
}


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

    def __post_init__(self) -> None:
        for name in ENUM_FIELDS:
            object.__setattr__(self, name, coerce(name, getattr(self, name)))
        if (
            isinstance(self.micro_batches, bool)
            or not isinstance(self.micro_batches, int)
            or self.micro_batches < 1
        ):
            raise TradesError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        object.__setattr__(self, "data_axes", tuple(int(a) for a in self.data_axes))
        if self.offload is not Offload.NONE and self.zero_stage < ZeroStage.GRADIENTS:
            raise TradesError(
                f"offload={self.offload.value} needs zero_stage >= 2: the offloaded state is FSDP2's "
                "sharded parameters (codegen/zero.py); force zero_stage=2 or 3 with it, or leave either auto"
            )
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
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Trades:
        if not d:
            return cls()
        return cls(
            Recompute(d.get("recompute", "none")),
            int(d.get("micro_batches", 1)),
            Precision(d.get("precision", "param")),
            ZeroStage(int(d.get("zero_stage", 0))),
            Offload(d.get("offload", "none")),
            tuple(d.get("data_axes", ())),
        )
