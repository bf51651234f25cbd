"""Memory in bytes per device: what the collectives of a reshard allocate while they run.

Read off ``codegen/collectives.py`` (what runs), step by step in the order ``codegen/lower.py``
``emit_reshard`` takes the mesh axes (gathers and reductions first, then slices, then the "f" of
each remaining axis). With ``L`` the bytes this rank holds before a step and ``n`` the axis size:

============  ===========================================  ====================================
step          forward: live while it runs                  backward: live while it runs
============  ===========================================  ====================================
all-gather    input L + output n L, on dim 0; on another   gradient n L + slice L; fused with
              dim input L + parts n L + output n L         an "f" (reduce-scatter): n L + n L
              (``cat``)                                    (gloo: all-reduce's clone) + L
all-reduce    input L + clone L                            nothing (identity)
chunk         input L + contiguous slice L / n             gradient L / n + (parts L) + output L
reduce-scat.  input L + clone L + slice L / n (gloo)       gradient L / n + (parts L) + output L
to_partial    input L + clone (or zeros) L                 nothing (identity)
f             nothing (a view)                             gradient L + all-reduce's clone L
============  ===========================================  ====================================

A gather along dim 0 runs straight into its output (``all_gather_single``): no parts (those in
parentheses above are for gathers along other dims). S(d) -> S(e) is an all-gather and a chunk,
S(d) -> P an all-gather and a to_partial. A transient is the largest of these over the steps,
forward and backward (gradients only when the tensor needs one). In forward, the last step's
output is left out when the consumer keeps it for backward: it is then part of the memory kept
until backward (``passes/costs.py``), which the transient is added to. The input is always counted: a consumer that reshards a tensor usually
is not what keeps the original. NCCL's reduce-scatter allocates no more than gloo's all-reduce
+ slice, so the gloo figure is used for both.

Not modeled: the backend's worker thread holds a collective's tensors until it lets go of the
work, after the caller has been told it is done. On a host with more ranks than cores that can be
a while, and a gather's input (or its parts) then outlives its last use by a few ops.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor.placement_types import Placement

from autopar.placement import is_partial, is_replicate, is_shard, volume_factor


def _gathered(shard: Placement, full: float) -> float:
    """Bytes an all-gather of ``full`` bytes along ``shard``'s dim allocates: the output, and on a
    dim other than 0 the parts it concatenates (``codegen/collectives.py:_gather``)."""
    return full if shard.dim == 0 else 2 * full


def reshard_transient(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    nbytes: float,
    mesh_shape: Sequence[int],
    requires_grad: bool,
    f_axes: Sequence[int] = (),
    keeps: bool = False,
) -> float:
    """Largest bytes per device the collectives moving a tensor of ``nbytes`` (global) from ``src``
    to ``dst`` hold at once, forward or backward (see the module docstring); 0 when nothing runs.
    ``keeps``: the consumer keeps the resharded tensor until backward (its output is counted there)."""
    local = nbytes / volume_factor(src, mesh_shape)
    fwd: list[tuple[float, float]] = []  # (bytes live while the step runs, output bytes) per step
    bwd: list[float] = []
    f_axes = set(f_axes)
    order = sorted(range(len(src)), key=lambda a: not is_replicate(dst[a]))
    for a in order:
        s, d, n = src[a], dst[a], mesh_shape[a]
        if n == 1 or s == d:
            continue
        if is_shard(s) and (is_replicate(d) or is_shard(d) or is_partial(d)):
            full = local * n
            fwd.append((local + _gathered(s, full), full))  # all-gather (parts, then cat)
            if a in f_axes and is_replicate(d):  # fused with the "f": reduce-scatter backward
                f_axes.discard(a)
                bwd.append(2 * full + local)
            else:
                bwd.append(full + local)  # local slice of the gradient
            if is_shard(d):  # then a chunk of the gathered tensor
                fwd.append((full + local, local))
                bwd.append(local + _gathered(d, full))
            elif is_partial(d):  # then to_partial: a clone (or zeros)
                fwd.append((2 * full, full))
                local = full
            else:
                local = full
        elif is_partial(s) and is_replicate(d):
            fwd.append((2 * local, local))  # all-reduce of a clone
        elif is_replicate(s) and is_shard(d):
            fwd.append((local + local / n, local / n))  # contiguous slice
            bwd.append(local / n + _gathered(d, local))  # gradient all-gathered
            local = local / n
        elif is_partial(s) and is_shard(d):
            fwd.append((2 * local + local / n, local / n))  # all-reduce of a clone, then a slice
            bwd.append(local / n + _gathered(d, local))
            local = local / n
        elif is_replicate(s) and is_partial(d):
            fwd.append((2 * local, local))
    for a in f_axes:
        if mesh_shape[a] > 1:
            bwd.append(2 * local)  # the gradient and the clone all-reduced
    peak = 0.0
    for k, (live, out) in enumerate(fwd):
        peak = max(peak, live - (out if keeps and k == len(fwd) - 1 else 0.0))
    if requires_grad:
        peak = max([peak, *bwd])
    return peak
