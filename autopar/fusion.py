"""The fused kernels a plan may substitute for aten patterns, and the record of one substitution.

Vocabulary only: ``passes/fuse.py`` finds the patterns and rewrites the traced graph,
``kernels/`` holds the ops (``torch.ops.autopar.*``), the plan records each ``KernelUse`` so that a
saved plan re-applied to the same model rewrites the same nodes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from autopar.errors import AutoparError


class Kernel(enum.Enum):
    """A fused kernel (``kernels/``) and the aten pattern it replaces.

    * ``RMS_NORM``: ``x.float() * rsqrt(mean(x.float()**2, -1) + eps)``, times a weight (Llama,
      Mistral, Qwen; ``1 + weight`` for Gemma), with the residual ``add`` before it when there is
      one (``autopar::rms_norm``: returns the normalized value and the sum).
    * ``LAYER_NORM``: ``layer_norm(a + b)``, the sum also returned (the residual stream of
      pre-norm models: GPT-2, GPT-NeoX, the PaLM-style model).
    * ``SWIGLU``, ``GEGLU``: ``silu(gate) * up``, ``gelu(gate) * up``.
    * ``ROPE``: ``x * cos + rotate_half(x) * sin`` (Hugging Face's rotary embedding, on q and k).
    * ``LINEAR_CROSS_ENTROPY``: ``cross_entropy(linear(h, W).float().view(-1, V), labels)`` where
      the logits feed nothing else: computed in chunks of rows, never holding the full logits.
    """

    RMS_NORM = "rms_norm"
    LAYER_NORM = "layer_norm"
    SWIGLU = "swiglu"
    GEGLU = "geglu"
    ROPE = "rope"
    LINEAR_CROSS_ENTROPY = "linear_cross_entropy"


class KernelsError(AutoparError, ValueError):
    """A kernels option that names no kernel; the message lists them."""


def coerce_kernels(value) -> frozenset[Kernel] | None:
    """``SearchOptions.kernels`` as a set: None (auto), ``"all"``, ``"none"``, or kernels (members
    or their values, as an iterable or one comma-separated string)."""
    if value is None or value == "auto":
        return None
    if value == "all":
        return frozenset(Kernel)
    if value == "none" or value == ():
        return frozenset()
    items: Iterable = value.split(",") if isinstance(value, str) else value
    out = set()
    for v in items:
        try:
            out.add(v if isinstance(v, Kernel) else Kernel(str(v).strip()))
        except ValueError:
            raise KernelsError(
                f"kernels: {v!r} is not one of {[k.value for k in Kernel]} (or 'all', 'none', 'auto')"
            ) from None
    return frozenset(out)


@dataclass(frozen=True)
class KernelUse:
    """One substitution: the fused op's node and the traced nodes it stands for."""

    kernel: Kernel
    node: str
    replaced: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"kernel": self.kernel.value, "node": self.node, "replaced": list(self.replaced)}

    @classmethod
    def from_dict(cls, d: dict) -> KernelUse:
        return cls(Kernel(d["kernel"]), d["node"], tuple(d["replaced"]))
