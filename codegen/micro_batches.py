"""Micro-batches (gradient accumulation): the global batch run as ``k`` equal slices of dim 0.

A plan is made for the example inputs' full global batch ``B`` (its fingerprint names those
shapes). With ``plan.trades.micro_batches = k > 1`` a training step runs ``k`` micro-batches of
``b = B / k`` rows in turn: one micro-batch's activations live at a time, the gradients of the
``k`` backwards accumulate in ``.grad`` and are reduced across ranks once, after the last
(``codegen/grad_sync.py``, ``ParallelModule.step``).

The generated code is specialized to its input shapes, so the module is generated from the model
traced again on one micro-batch (``micro_batch_inputs``: the first ``b`` rows of every tensor
input). That trace must be the plan's graph with a smaller batch: the same nodes, under the same
names, calling the same ops (``check_same_graph``), so that the plan's per-node decisions read
onto it by name. Each placement that splits the batch over ``n`` ranks must split ``b``:
``b % n == 0`` (``micro_batch_inputs`` checks it on the plan's input placements; the per-node
strategies the rules allow for ``b`` are checked again when the decisions are read).

Every input a micro-batched step takes is split the same way (``split_batch``): each tensor leaf
on dim 0 into ``k`` equal parts, all leaves with the same dim 0; leaves that are not tensors are
passed to every micro-batch unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree

from autopar.errors import PlanMismatchError
from autopar.passes.trace import graph_signature
from autopar.placement import is_shard, spec_from_str


class MicroBatchError(PlanMismatchError, ValueError):
    """The inputs or the model do not split into the plan's micro-batches: the message says why
    and what to change."""


def batch_size(inputs, k: int) -> int:
    """The global batch (dim 0, the same for every tensor leaf of ``inputs``) that ``k``
    micro-batches split; raise MicroBatchError unless it exists and ``k`` divides it."""
    leaves, _ = pytree.tree_flatten_with_path(inputs)
    rows: dict[int, str] = {}
    for path, t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        name = pytree.keystr(path) or "input"
        if t.dim() == 0:
            raise MicroBatchError(
                f"micro_batches={k} splits every tensor input on dim 0 (the batch), but input {name} is a "
                "scalar; pass it as a Python number, or plan with micro_batches=1"
            )
        rows.setdefault(t.shape[0], name)
    if not rows:
        raise MicroBatchError(
            f"micro_batches={k} needs a tensor input to split on dim 0; the inputs have none"
        )
    if len(rows) > 1:
        sizes = ", ".join(f"{name}: {n}" for n, name in rows.items())
        raise MicroBatchError(
            f"micro_batches={k} splits every tensor input on dim 0, the batch, but the inputs disagree on "
            f"its size ({sizes}); give every tensor input the batch on dim 0, or plan with micro_batches=1"
        )
    (batch,) = rows
    if batch % k:
        fits = [d for d in range(2, batch + 1) if batch % d == 0]
        raise MicroBatchError(
            f"a batch of {batch} does not split into {k} equal micro-batches; use a batch that {k} divides "
            f"(e.g. {k * math.ceil(batch / k)}), or micro_batches among {fits or [1]}"
        )
    return batch


def split_batch(inputs, k: int) -> list:
    """``inputs`` (any pytree, e.g. ``(args, kwargs)``) as ``k`` micro-batches of the same
    structure: each tensor leaf's dim 0 in ``k`` equal, consecutive parts."""
    batch_size(inputs, k)
    leaves, spec = pytree.tree_flatten(inputs)
    parts = [t.chunk(k, dim=0) if isinstance(t, torch.Tensor) else (t,) * k for t in leaves]
    return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(k)]


def micro_batch_inputs(inputs, plan):
    """The example inputs of one micro-batch of ``plan`` (their first ``b`` rows, in the form
    ``inputs`` has: a tensor, a tuple of positional or a dict of keyword inputs), after checking
    that the batch splits into ``plan.trades.micro_batches`` parts and that every placement the plan
    gives an input splits ``b`` evenly over the ranks it shards the batch on."""
    k = plan.trades.micro_batches
    b = batch_size(inputs, k) // k
    for d in plan.decisions:
        if d.role != "input" or not d.shape:
            continue
        spec = spec_from_str(d.output)
        axes = [a for a, p in enumerate(spec) if is_shard(p) and p.dim % len(d.shape) == 0]
        n = math.prod(plan.mesh_shape[a] for a in axes)
        if b % n:
            raise MicroBatchError(
                f"micro-batches of {b} rows ({k} of a batch of {b * k}) do not split over the {n} ranks the plan "
                f"shards input {d.target or d.name} on (mesh axes {axes} of {tuple(plan.mesh_shape)}); use a "
                f"batch of a multiple of {k * n}, or fewer micro-batches"
            )
    return split_batch(inputs, k)[0]


def check_same_graph(full, micro, k: int) -> None:
    """Raise MicroBatchError unless ``micro`` (the model traced on one micro-batch) has the nodes
    of ``full`` (traced on the global batch, the plan's graph): same names, kinds and ops, in order."""
    a, b = graph_signature(full), graph_signature(micro)
    if a == b:
        return
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    plan_node = " ".join(a[i]) if i < len(a) else "(none)"
    micro_node = " ".join(b[i]) if i < len(b) else "(none)"
    raise MicroBatchError(
        f"the model traced on one of {k} micro-batches is not the graph the plan was made for: node {i} is "
        f"'{plan_node}' in the plan's graph and '{micro_node}' on the micro-batch ({len(a)} and {len(b)} nodes); "
        "the model's code depends on the batch size, so the plan's decisions cannot be read onto it. Plan with "
        "micro_batches=1, or with a batch that keeps the code path (e.g. more than one row per micro-batch)"
    )
