"""The parallel module's state as checkpoints and training loops see it: under the model's own
names, with the plan's placements.

The module's parameters and buffers are ``DTensor``s (``codegen/build.py``): each carries its
placements on the module's mesh (FSDP2's shards over the data axis on top, under ZeRO-2/3). So:

* ``state_dict`` maps each of the original model's state-dict names (tied names included) to the
  module's own tensor, detached: sharded, never gathered. ``torch.distributed.checkpoint``
  (``dcp.save``) writes each rank's pieces with their places in the whole; ``dcp.load`` into the
  ``state_dict`` of a module built from any other plan (another mesh, other placements, another
  ZeRO stage) reads each rank's new pieces in place, resharding as it reads.
* ``optimizer_state_dict`` is the optimizer's state keyed the same way (the layout of torch's
  ``get_optimizer_state_dict``: ``{"state": {name: {...}}, "param_groups": [{..., "params":
  [names]}]}``), its tensors the optimizer's own (``DTensor``s of the parameter's placements, or
  of its ZeRO-1 share's, ``codegen/zero_one.py``); state not made yet (no step taken) is made first
  by a step with zero gradients and a zero learning rate, as torch's does, so that ``dcp.load``
  has tensors to read into. ``load_optimizer_state_dict`` puts a loaded one back (the
  hyperparameters and any tensor not read in place).
* ``clip_grad_norm_`` is the norm of all gradients of the whole model: torch's
  ``clip_grad_norm_`` on the module's parameters gives it where they all live on one mesh (every
  plan without pipeline stages, on torch >= 2.13); this one also sums over pipeline stages and
  over the meshes of FSDP2 on older torch.

Why by hand: torch's ``get_state_dict`` / ``set_state_dict`` name state by the module's attribute
paths, which here are the generated module's (``local.block_0.p__model__layers__0__...``) and
change with the plan (blocks split or not, pipeline chunks), so a checkpoint would not load under
another plan; the names here are the model's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class IncompatibleKeys(NamedTuple):
    """What ``load_state_dict`` returns, as ``torch.nn.Module.load_state_dict`` does."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def model_state_dict(
    tensors: dict[str, torch.Tensor],
    aliases: dict[str, str],
    attrs: dict[str, str],
    extra: dict[str, torch.Tensor],
    keep_vars: bool = False,
) -> dict[str, torch.Tensor]:
    """Every original state-dict name -> this rank's tensor (``tensors``: attribute -> tensor,
    ``attrs``: canonical name -> attribute, ``aliases``: name -> canonical name; ``extra``: state the
    graph never reads, kept as it was). Names whose tensor this rank does not hold (another
    pipeline stage's) are left out."""
    out = {}
    for name, fqn in aliases.items():
        attr = attrs.get(fqn)
        if attr is not None and attr in tensors:
            t = tensors[attr]
            out[name] = t if keep_vars else t.detach()
        elif attr is None and name in extra:
            out[name] = extra[name]
    return out


@torch.no_grad()
def load_model_state_dict(
    tensors: dict[str, torch.Tensor],
    aliases: dict[str, str],
    attrs: dict[str, str],
    state_dict: dict[str, torch.Tensor],
    strict: bool = True,
) -> tuple[list[str], list[str]]:
    """Copy ``state_dict`` (original names; whole tensors, or ``DTensor``s in any placements) into
    this rank's tensors; returns (missing, unexpected) names, raising ``KeyError`` on either when
    ``strict``. A ``DTensor`` that is this rank's own tensor (``dcp.load`` read into it) is left."""
    missing, unexpected = [], [k for k in state_dict if k not in aliases]
    for name, fqn in aliases.items():
        attr = attrs.get(fqn)
        if attr is None or attr not in tensors:
            continue
        if name not in state_dict:
            missing.append(name)
            continue
        dst, src = tensors[attr], state_dict[name]
        if _local(src) is _local(dst) or (isinstance(src, DTensor) and src.data_ptr() == dst.data_ptr()):
            continue
        _assign(dst, src, name)
    if strict and (missing or unexpected):
        raise KeyError(f"load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return missing, unexpected


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both ``DTensor``s on one mesh with one placement each axis (or both plain, of one shape)."""
    if isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    if not isinstance(a, DTensor):
        return a.shape == b.shape
    return a.device_mesh == b.device_mesh and a.placements == b.placements


def _assign(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(
            f"{name}: shape {tuple(src.shape)} in the state dict, {tuple(dst.shape)} in the module"
        )
    if isinstance(src, DTensor):
        if (
            isinstance(dst, DTensor)
            and src.device_mesh == dst.device_mesh
            and src.placements == dst.placements
        ):
            _local(dst).copy_(_local(src))
            return
        src = src.full_tensor()  # other placements: whole, then this rank's piece (one tensor at a time)
    if isinstance(dst, DTensor):
        from torch.distributed.tensor import distribute_tensor

        piece = distribute_tensor(src.to(dst.device), dst.device_mesh, dst.placements, src_data_rank=None)
        _local(dst).copy_(_local(piece))
    else:
        dst.copy_(src)


# ------------------------------------------------------------------------------------------------
# optimizer state
# ------------------------------------------------------------------------------------------------


def _stepped(opt) -> list[torch.Tensor]:
    """The tensors ``opt`` keeps state for, in its groups' order (ZeRO-1: the shares)."""
    return [p for g in opt.param_groups for p in g["params"]]


def _names(opt, params: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The canonical name of each tensor ``_stepped(opt)`` lists: ``params`` gives (name, module
    parameter) pairs; ZeRO-1's shares are named after their parameters."""
    by_id = {id(p): n for n, p in params}
    shares = getattr(opt, "shares", {})
    for pid, share in shares.items():
        if pid in by_id:
            by_id[id(share)] = by_id[pid]
    names = []
    for t in _stepped(opt):
        if id(t) not in by_id:
            raise ValueError(
                "the optimizer holds a tensor that is not one of the parallel module's parameters: build it with "
                "pmodel.optimizer(cls, **kwargs)"
            )
        names.append(by_id[id(t)])
    return names


@torch.no_grad()
def _make_state(opt) -> None:
    """Make an optimizer's lazily created state (a step with zero gradients and a zero learning
    rate, as ``torch.distributed.checkpoint.state_dict`` does), where it has none yet."""
    inner = getattr(opt, "inner", opt)
    if inner.state:
        return
    params = getattr(opt, "params", _stepped(opt))
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in opt.param_groups]
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    opt.step()
    wait = getattr(opt, "wait", None)
    if wait is not None:  # ZeRO-1's gathers of this step: landed now, not over what a load writes next
        wait()
    for g, lr in zip(opt.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def optimizer_state_dict(opt, params: Iterable[tuple[str, torch.Tensor]]) -> dict:
    """``opt``'s state under canonical parameter names (module docstring)."""
    _make_state(opt)
    names = _names(opt, params)
    tensors = _stepped(opt)
    state = {name: dict(opt.state[t]) for name, t in zip(names, tensors) if t in opt.state}
    groups, i = [], 0
    for g in opt.param_groups:
        n = len(g["params"])
        groups.append({k: v for k, v in g.items() if k != "params"} | {"params": names[i : i + n]})
        i += n
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_optimizer_state_dict(
    opt, params: Iterable[tuple[str, torch.Tensor]], state_dict: dict, exact: frozenset[str] = frozenset()
) -> None:
    """Put ``state_dict`` (``optimizer_state_dict``'s layout) into ``opt``: each state tensor
    copied into the optimizer's own (resharded where its placements differ), the groups'
    hyperparameters set. ``exact``: parameters whose state must come in the optimizer's own
    placements (a weight the module keeps permuted: another plan's would be in another order)."""
    _make_state(opt)
    names = _names(opt, params)
    for name, t in zip(names, _stepped(opt)):
        saved = state_dict["state"].get(name)
        if saved is None:
            continue
        mine = opt.state[t]
        for k, v in saved.items():
            if k not in mine or not isinstance(v, torch.Tensor):
                mine[k] = v
            elif v is not mine[k] and _local(v) is not _local(mine[k]):
                if name in exact and mine[k].dim() and not _same_layout(v, mine[k]):
                    raise ValueError(
                        f"load_optimizer_state_dict: {name}.{k} belongs to a weight kept permuted (its gate and up "
                        "halves split by expert tensor parallelism): only state saved by a module of this plan "
                        "(optimizer_state_dict()) is in that order"
                    )
                _assign(mine[k], v, f"optimizer state {name}.{k}")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"the optimizer has {len(opt.param_groups)} parameter groups, the state dict {len(saved_groups)}"
        )
    for g, saved in zip(opt.param_groups, saved_groups):
        for k, v in saved.items():
            if k == "params":
                continue
            if isinstance(g.get(k), torch.Tensor) and isinstance(v, torch.Tensor):
                g[k].copy_(v)
            else:
                g[k] = v


# ------------------------------------------------------------------------------------------------
# gradient clipping
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def total_grad_norm(
    params: Iterable[torch.Tensor], norm_type: float, pipeline_group=None, pieces: Mapping | None = None
) -> torch.Tensor:
    """The norm of every gradient of the whole model: per mesh, torch's ``get_total_norm`` of the
    ``DTensor`` gradients (which reduces over the mesh), combined, and over ``pipeline_group``
    (the stages' ranks) where given. ``pieces``: ``id(parameter) -> (the module's mesh, copies)``
    for parameters whose ``DTensor`` covers only the rank's piece of the plan (FSDP2 on torch <
    2.13 shards a piece over the data axis's own mesh: ``codegen/zero.py``): their local gradients
    are reduced over the module's mesh, each element counted once (``copies``: the ranks that hold
    the same piece)."""
    norm_type = float(norm_type)
    pieces = pieces or {}
    by_mesh: dict[object, list[torch.Tensor]] = {}
    spread: dict[object, list[tuple[torch.Tensor, int]]] = {}
    for p in params:
        if p.grad is None:
            continue
        if id(p) in pieces:
            mesh, copies = pieces[id(p)]
            spread.setdefault(mesh, []).append((_local(p.grad), copies))
            continue
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        by_mesh.setdefault(key, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        n = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    norms += [_spread_norm(grads, mesh, norm_type) for mesh, grads in spread.items()]
    device = norms[0].device if norms else torch.device("cpu")
    total = (
        torch.linalg.vector_norm(torch.stack([n.to(device).float() for n in norms]), norm_type)
        if norms
        else torch.zeros((), device=device)
    )
    if pipeline_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pipeline_group)
        else:
            total = total.pow(norm_type)
            dist.all_reduce(total, group=pipeline_group)
            total = total.pow(1.0 / norm_type)
    return total


def _spread_norm(grads: list[tuple[torch.Tensor, int]], mesh, norm_type: float) -> torch.Tensor:
    """The norm of local gradient pieces spread over ``mesh``'s ranks, each held by ``copies``
    ranks: the local sums of ``|g|^p / copies`` summed over every axis of the mesh (a maximum for
    the infinity norm, where copies do not matter)."""
    device = grads[0][0].device
    if math.isinf(norm_type):
        n = torch.stack(
            [g.detach().abs().max().float() for g, _ in grads if g.numel()]
            or [torch.zeros((), device=device)]
        ).max()
        op = dist.ReduceOp.MAX
    else:
        n = torch.zeros((), device=device)
        for g, copies in grads:
            n = n + torch.linalg.vector_norm(g.detach().float(), norm_type).pow(norm_type) / copies
        op = dist.ReduceOp.SUM
    for d in range(mesh.ndim):
        dist.all_reduce(n, op=op, group=mesh.get_group(d))
    return n if math.isinf(norm_type) else n.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grads(params: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by ``min(1, max_norm / (total + 1e-6))`` (torch's rule), in place on
    the local pieces (a uniform scale: no communication)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [_local(p.grad) for p in params if p.grad is not None]
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
