"""What every rank must share, checked across ranks, and the plan solved once per job.

autopar's contract is that every rank holds the same model (same weights), passes the same example
inputs and, at every call, the same full global batch: the module slices each rank's part itself.
Ranks that break it train silently wrong (different weights) or hang in a collective (different
plans). ``agree`` compares a cheap fingerprint of a value across ranks with one
``all_gather_object``, so that every rank sees every fingerprint and every rank raises the same
``CrossRankMismatchError`` (none is left waiting in a collective); ``fingerprint`` digests tensors
by shape, dtype, float64 sum and norm (equal for identical tensors, computed the same way on every
rank; on the tensor's own device, without a float64 copy of it).

``solve_once`` runs the search on rank 0 only and broadcasts the plan (or rank 0's error) to the
others: planning time no longer grows with the number of ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autopar.errors import AutoparError, CrossRankMismatchError, DistributedSetupError


def fingerprint(named: Iterable[tuple[str, object]]) -> tuple[str, dict[str, str]]:
    """(one digest of everything, a digest per name) of named tensors or plain values."""
    per = {}
    for name, value in named:
        h = hashlib.sha256()
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                t = leaf.detach()
                h.update(f"{tuple(t.shape)}|{t.dtype}".encode())
                if t.numel() and not t.is_meta:
                    x = t if t.dtype != torch.bool else t.to(torch.uint8)
                    total = x.sum(dtype=torch.float64).item()
                    norm = (
                        torch.linalg.vector_norm(x, dtype=torch.float64).item()
                        if x.is_floating_point()
                        else 0.0
                    )
                    h.update(f"{total!r}|{norm!r}".encode())
            else:
                h.update(repr(leaf).encode())
        per[name] = h.hexdigest()[:16]
    whole = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(per.items())).encode()).hexdigest()[:16]
    return whole, per


def agree(what: str, named: Iterable[tuple[str, object]], fix: str, group=None, key=None) -> None:
    """Raise ``CrossRankMismatchError`` on every rank unless every rank's ``named`` values match
    rank 0's (with ``key``: those of the first rank with the same key, e.g. the ranks fed the
    same slice of a batch); ``what`` names them in the message, ``fix`` says how to make them
    agree."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    whole, per = fingerprint(named)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (key, whole, per), group=group)
    first_of = {}
    for r, g in enumerate(gathered):
        first_of.setdefault(g[0], r)
    bad = [r for r, g in enumerate(gathered) if g[1] != gathered[first_of[g[0]]][1]]
    if not bad:
        return
    ref = gathered[first_of[gathered[bad[0]][0]]][2]
    first = gathered[bad[0]][2]
    names = [k for k in sorted(set(ref) | set(first)) if ref.get(k) != first.get(k)]
    raise CrossRankMismatchError(
        f"{what} differ between ranks: rank(s) {bad} differ from rank {first_of[gathered[bad[0]][0]]} "
        f"(first: {names[:3]}); {fix}"
    )


def solve_once(search: Callable[[], tuple], group=None) -> tuple:
    """``search()`` on rank 0 of ``group`` (the default group) only, its plan (``search()[1]``)
    sent to every rank; returns ``(traced graph or None, plan)``: None on the other ranks, which
    trace the model themselves. An error of rank 0's search is raised on every rank."""
    from autopar.plan import Plan

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return search()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    mine = dist.get_rank() == src
    payload: list = [None]
    traced = None
    failure: BaseException | None = None
    if mine:
        try:
            traced, plan = search()
            payload = [("plan", plan.to_dict())]
        except Exception as e:  # every rank must hear of it, or they wait for the plan forever
            failure = e
            payload = [("error", type(e) if isinstance(e, AutoparError) else None, str(e))]
    dist.broadcast_object_list(payload, src=src, group=group)
    kind, *rest = payload[0]
    if kind == "error":
        if failure is not None:
            raise failure
        cls, msg = rest
        if cls is None:
            raise DistributedSetupError(f"rank 0's search failed ({msg}); its traceback is on rank 0")
        raise cls(msg)
    return traced, Plan.from_dict(rest[0])
