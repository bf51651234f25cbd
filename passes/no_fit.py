"""Why no plan fits the memory limit, in the words a user acts on (``NoPlanFitsError``'s message):

1. what the smallest plan needs per device, against the limit: the least memory any candidate's
   bound proves it needs where that passes the limit, else the least full peak of the plans the
   solver found and refused at it (with their gradient buckets' flattening and their optimizer
   step's temporaries), else that every solve came back empty; and where a plan fit the device
   but its offloaded state passed the host memory (``ClusterSpec.host_memory_bytes`` shared by
   the node's devices), the least host memory such a plan needs against what a device gets;
2. the trades the search already tried (``Found.tried``: the rungs of the trades ladder,
   ``passes/ladder.py``, and the pipeline stage counts of its candidates), and where ZeRO was not
   among them because no candidate had a data-parallel axis, why;
3. the fix that would help: ``outputs=LOSS`` first where the outputs other than the loss (the
   logits of a language model) take at least the memory the smallest plan needs past the limit
   (dropping them could close the gap); then each trade the options forbid, more devices, a
   smaller batch or sequence, a larger limit.
"""

from __future__ import annotations

import math

import torch
from torch.utils import _pytree as pytree

from autopar.options import SearchOptions
from autopar.passes.dumps import size_text
from autopar.passes.search_problem import Found, Problem
from autopar.placement import Outputs
from autopar.trades import Offload, Recompute, ZeroStage


def no_fit_message(pb: Problem, found: Found) -> str:
    """The message of the ``NoPlanFitsError`` a search with no plan raises (module docstring)."""
    cluster, limit, options = pb.cluster, pb.limit, pb.options
    where = (
        f"({cluster.device.name}, {cluster.world_size} devices, {cluster.memory_reserve:.0%} of "
        "memory held in reserve)"
    )
    needed = math.inf
    if found.min_needed > limit and math.isfinite(found.min_needed):
        needed = found.min_needed
        head = f"no plan fits: the smallest plan needs at least {size_text(needed)} per device"
    elif math.isfinite(found.refused_peak):
        needed = found.refused_peak
        head = (
            f"no plan fits: the smallest plan the solver found needs {size_text(needed)} per device with its "
            "gradient buckets' flattening and its optimizer step's temporaries"
        )
    else:
        head = "no plan fits: the solver found no plan under the limit on any candidate"
    lines = [f"{head}, the limit is {size_text(limit)} {where}"]
    if math.isfinite(found.host_needed):
        share = cluster.host_memory_bytes / max(cluster.devices_per_node, 1)
        lines.append(
            f"A plan that fits the device offloads {size_text(found.host_needed)} per device to host memory, which "
            f"gives {size_text(share)} per device ({size_text(cluster.host_memory_bytes)} per node of "
            f"{cluster.devices_per_node} devices): host memory is short; give the cluster more host_memory_bytes"
        )
    lines.append("Already tried: " + tried_text(found, pb.batch))
    outputs = output_bytes(pb) if options.outputs is not Outputs.LOSS else 0
    if outputs and outputs >= needed - limit:
        lines.append(
            f"Would help: outputs=Outputs.LOSS (autopar plan --outputs loss): the outputs besides the loss take "
            f"{size_text(outputs)} whole, and the module then returns the loss alone and never holds them"
        )
    fixes = forbidden_trades(options, pb.batch) + [
        "more devices", "a smaller batch or sequence", "a larger memory_limit_bytes"
    ]  # fmt: skip
    lines.append(("Else try: " if len(lines) > 2 else "Try: ") + ", ".join(fixes))
    return ". ".join(lines)


def tried_text(found: Found, batch: int | None) -> str:
    """The trades the search tried, each over the values it took, in a few words."""
    tried = found.tried
    stages = sorted({int(c.pipeline_stages) for c in found.candidates if c.pipeline_stages})
    if not tried and not stages:
        return "no trade (no candidate got as far as its trades)"
    zeros = sorted({int(t.zero_stage) for t in tried})
    recompute = [r.value for r in Recompute if any(t.recompute is r for t in tried)]
    micro = sorted({t.micro_batches for t in tried})
    offloads = [o.value for o in Offload if o is not Offload.NONE and any(t.offload is o for t in tried)]
    parts = []
    if zeros and max(zeros) > 0:
        parts.append("ZeRO stages " + ", ".join(str(z) for z in zeros))
    elif tried:
        why = f"the batch of {batch} splits over no data-parallel axis" if batch is not None and batch < 2 else (
            "no candidate had a data-parallel axis"
        )  # fmt: skip
        parts.append(f"no ZeRO ({why})")
    if recompute:
        parts.append("recomputation " + ", ".join(recompute))
    if micro:
        parts.append("micro-batches " + ", ".join(str(k) for k in micro))
    if tried:
        parts.append("offload " + ", ".join(offloads) if offloads else "no offload")
    if stages:
        parts.append("pipeline stages " + ", ".join(str(s) for s in stages))
    return ", ".join(parts)


def forbidden_trades(options: SearchOptions, batch: int | None) -> list[str]:
    """The trades the options forbid that could free memory (each a setting to change)."""
    out = []
    if options.zero_stage is not None and options.zero_stage < ZeroStage.PARAMETERS:
        out.append("zero_stage=3 (or None: auto)")
    roles = options.axis_roles
    if roles is not None and not any(r.splits_batch for r in roles) and (batch or 0) > 1:
        out.append("axis_roles with AxisRole.DATA (ZeRO shards over data-parallel axes)")
    if options.recompute is not None and options.recompute is not Recompute.FULL:
        out.append("recompute=Recompute.FULL (or None)")
    if options.micro_batches is not None and (batch or 0) > options.micro_batches:
        out.append("more micro_batches (or None)")
    if options.offload is not None and options.offload is not Offload.PARAMETERS:
        out.append("offload=Offload.PARAMETERS (or None)")
    if options.precision is not None and options.precision.value == "param":
        out.append("precision=Precision.BF16")
    if options.pipeline_stages == 1 or options.mesh_shape is not None or options.axis_roles is not None:
        out.append("pipeline stages (pipeline_stages=None: auto, or a count)")
    return out


def output_bytes(pb: Problem) -> int:
    """Bytes of the graph's outputs besides its loss (its first output where that is a floating
    scalar; 0 where there is none: ``outputs=LOSS`` needs one), whole."""
    out = next(n for n in pb.tg.graph.nodes if n.op == "output")
    leaves = [x for x in pytree.tree_leaves(out.args[0]) if hasattr(x, "meta")]
    first = leaves[0].meta.get("val") if leaves else None
    if not isinstance(first, torch.Tensor) or first.dim() != 0 or not first.dtype.is_floating_point:
        return 0
    total = 0
    for x in leaves[1:]:
        val = x.meta.get("val")
        if isinstance(val, torch.Tensor):
            total += val.numel() * val.element_size()
    return total
