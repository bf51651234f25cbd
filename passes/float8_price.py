"""Which linears the cost tables may price as FP8, and what one costs run FP8
(``autopar/lowerings/float8.py`` describes the run; ``codegen/float8.py`` runs it with torchao)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.cluster import DeviceSpec
from autopar.cost_model.comm import CommModel
from autopar.cost_model.compute import float8_linear_time
from autopar.lowerings import Phase
from autopar.lowerings.float8 import cast_elements as float8_casts
from autopar.lowerings.float8 import describe as describe_float8
from autopar.passes.analyze import NodeInfo
from autopar.passes.op_price import item_of, local_gemm_min_dim, priced_calls
from autopar.passes.strategies import Strategy
from autopar.placement import volume_factor
from autopar.trades import Float8


@functools.cache
def has_torchao() -> bool:
    """Is torchao's float8 training installed (what ``codegen/float8.py`` runs FP8 linears with)?"""
    import importlib.util

    try:
        return importlib.util.find_spec("torchao.float8") is not None
    except ModuleNotFoundError:
        return False


@dataclass(frozen=True)
class Float8Offer:
    """Which linears the cost tables may price as FP8 (``autopar/lowerings/float8.py``).

    * ``recipes``: what an eligible linear may take; the tables price each and keep the cheapest of
      them and the linear's own precision (``forced``: the cheapest recipe, whatever its own costs);
    * ``half_only``: only linears that compute in a half type (auto: FP8 replaces bf16 GEMMs, not
      an fp32 model's);
    * ``nodes``: exactly these linears with these recipes (repricing a plan, ``passes/reprice.py``).
    """

    recipes: tuple[Float8, ...] = ()
    forced: bool = False
    half_only: bool = True
    nodes: tuple[tuple[str, Float8], ...] | None = None

    @classmethod
    def of(cls, option: Float8 | None, device: DeviceSpec) -> Float8Offer | None:
        """The offer of ``SearchOptions.float8``: auto (None) both recipes where the device has an
        FP8 rate (``DeviceSpec.float8_flops``) and torchao, which runs them, is installed (a
        dependency; an install without it, as on a machine given wheels by hand, plans no FP8
        rather than a module that cannot run), none elsewhere; a recipe forced on any device."""
        if option is None:
            return cls((Float8.TENSORWISE, Float8.ROWWISE)) if device.float8_flops and has_torchao() else None
        if option is Float8.OFF:
            return None
        return cls((option,), forced=True, half_only=False)

    @classmethod
    def given(cls, nodes: dict[str, Float8]) -> Float8Offer | None:
        return cls(nodes=tuple(sorted(nodes.items()))) if nodes else None

    def recipes_for(self, name: str, dtype: torch.dtype | None) -> tuple[Float8, ...]:
        if self.nodes is not None:
            r = dict(self.nodes).get(name)
            return (r,) if r is not None else ()
        if self.half_only and dtype not in (torch.bfloat16, torch.float16):
            return ()
        return self.recipes

    @property
    def must(self) -> bool:
        return self.forced or self.nodes is not None


def float8_choice(
    offer: Float8Offer,
    name: str,
    info: NodeInfo,
    ns,
    infos,
    device: DeviceSpec,
    k: int,
    s: Strategy,
    comm: CommModel,
    slow: float,
    own_s: float,
) -> tuple[Float8 | None, float, float]:
    """The recipe a linear under ``s`` runs (None: its own precision, which costs ``own_s``), its
    compute seconds and its amax all-reduces' seconds: the cheapest of the offered recipes, taken
    where it beats ``own_s`` or where the offer forces it."""
    best: tuple[float, Float8, float, float] | None = None
    for recipe in offer.recipes_for(name, info.dtype):
        priced = float8_price(ns.node, s, info, ns.inputs, infos, device, k, comm, recipe)
        if priced is None:
            continue
        t8, t_in = priced[0] * slow, priced[1]
        if best is None or t8 + t_in < best[0]:
            best = (t8 + t_in, recipe, t8, t_in)
    if best is None or (not offer.must and best[0] >= own_s):
        return None, 0.0, 0.0
    return best[1], best[2], best[3]


def float8_price(
    node: fx.Node,
    s: Strategy,
    info: NodeInfo,
    inputs: list[fx.Node],
    infos,
    device: DeviceSpec,
    k: int,
    comm: CommModel,
    recipe: Float8,
) -> tuple[float, float] | None:
    """A linear run FP8 with ``recipe`` under ``s`` (``autopar/lowerings/float8.py``): its compute
    seconds on one rank (``compute.float8_linear_time``: the scaled GEMMs and the cast kernels) and
    its amax all-reduces' (the comm model's price of the description's calls); None where it may
    not run FP8."""
    plan = describe_float8(node, s, comm.mesh_shape, recipe)
    if plan is None:
        return None
    fresh = info.grad_new or (True,) * len(inputs)
    new = [a for a, f in zip(inputs, fresh) if f and infos[a.name].requires_grad]
    casts = [(e, phase is Phase.BACKWARD) for e, phase in float8_casts(node, s, comm.mesh_shape)]
    bias = len(inputs) > 2
    t = float8_linear_time(
        info.flops, info.dtype, device, k, info.requires_grad, casts, new_grads=len(new),
        min_dim=local_gemm_min_dim(info.target, inputs, s, comm.mesh_shape),
        bias_elements=info.out_bytes / volume_factor(s.out, comm.mesh_shape) / max(item_of(info.dtype), 1)
        if bias else 0.0,
    )  # fmt: skip
    t_in = sum(sec for _, sec in priced_calls(plan, comm, t))
    return t, t_in
