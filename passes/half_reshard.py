"""Reshards in the half type: an fp32 activation whose every use is a GEMM moves as its half copy.

Under mixed precision (``torch.autocast``, fp32 masters; ``codegen/zero.py``) the residual stream
and the layer norms run in fp32 (a norm is one of autocast's fp32 ops, and the stream is fed by an
fp32 embedding: ``passes/precision.py:half_infos``). Under sequence parallelism each norm's output is
all-gathered over the tensor axis before the column-parallel linears that read it, and those
linears cast it to the half type anyway: autocast's GEMMs (``aten.linear``, ``mm``, ``matmul``,
...) cast every floating operand to the half type before they compute. So where *every* use of a
tensor is such a GEMM, the generated code casts it once, before its reshards, and the collectives
move the half-type copy (``codegen/lower.py``): half the bytes of the fp32 gather, and its backward
(the reduce-scatter of the input's gradient, or the "f" all-reduce) sums in the half type, as
Megatron-LM's sequence parallelism does (its activations are bf16 throughout). Forward values are
identical: ``gather(x).to(h) == gather(x.to(h))``; the gradient is summed over the group in the
half type before it is cast back to fp32 instead of after.

The cost tables price those reshards at the half type's bytes (``NodeInfo.moved_bytes``, set by
``half_infos``): their collectives, the copy the consumer keeps for backward and the transients.
A use that takes the tensor as it is (no collective) is unchanged: the GEMM casts it itself.

Only GEMMs qualify: they run the same aten op on local pieces under autocast. Attention and the
fused ops (ring attention's block math, the vocabulary-parallel loss) are left alone: their local
computation is not the one autocast casts.
"""

from __future__ import annotations

import torch
import torch.fx as fx

# autocast's half-type GEMMs (overload packets, as a traced graph names them): every floating
# operand is cast to the half type (torch's "Autocast Op Reference", CUDA and CPU alike)
HALF_GEMMS = frozenset(f"aten.{op}" for op in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear"))


def _packet(target) -> str:
    return ".".join(str(target).split(".")[:2])


def casts_before_reshard(node: fx.Node) -> bool:
    """Is ``node`` an op's floating output whose every use is an autocast GEMM (``HALF_GEMMS``), so
    that under mixed precision its reshards may move its half-type copy (module docstring)? False
    for placeholders (parameters, buffers, inputs keep their own path), the graph's outputs and
    any other use."""
    if node.op != "call_function":
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point or not node.users:
        return False
    return all(u.op == "call_function" and _packet(u.target) in HALF_GEMMS for u in node.users)
