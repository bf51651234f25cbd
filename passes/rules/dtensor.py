"""Per-axis options derived from PyTorch's DTensor sharding strategies, for ops autopar has no rule of
its own for (``RULES``).

DESIGN.md: "autopar's own rules where they do more, PyTorch's DTensor op strategies for the rest; an op
is replicated only where no strategy exists". DTensor keeps a registry of which placements an op
accepts (``DTensor._op_dispatcher.sharding_propagator``); this module asks it, offline, for one
node on a 1-D mesh of the axis size ``n`` and turns the answer into :class:`AxisOption`s:

* the query: each tensor input as a ``TensorMeta`` (shape, stride, dtype), with every placement it
  could arrive in (``Replicate``, ``Shard(d)`` for each dim, ``Partial()`` where floating), on a
  ``DeviceMesh`` built without a process group (planning needs no ``init_process_group``);
* the registries, in the propagator's own order: the single-dim strategies (rows of
  ``[outputs..., inputs...]`` placements for one mesh axis; most ops from torch 2.13 on), else the
  op strategy functions (an ``OpStrategy`` of ``OpSpec``s; most ops on torch 2.11), else the
  decomposition path (``DecompShardingStrategy``: CompositeImplicit ops that a pre-dispatch graph
  keeps, ``unflatten``, ``repeat_interleave``, ``max_pool2d``, ``group_norm``...). The older
  ``op_to_rules`` (convolution on torch 2.11) answers one input placement at a time: not asked;
* the answer: an ``OpSpec`` becomes ``AxisOption(out, ins)`` only where autopar can express it:
  ``Replicate``, ``Shard(d)`` and ``Partial`` with sum reduction (not ``_StridedShard``, nor
  ``Partial("avg"/"max")``, nor DTensor's masked or norm partials), one placement for all outputs,
  one per tensor input. All-Replicate is dropped (the expander adds it);
* a local check: the plain op, run on meta tensors of the local shapes an option implies, must give
  the local output shapes it claims. DTensor rewrites size arguments for local pieces (a view
  inside a decomposition, say); autopar runs the plain aten call on local pieces, so an option
  that needs such a rewrite is dropped.

Not asked: ops that write their inputs (a resharded input is a copy: the write would be lost),
random ops (the validator cannot check them), ops with no tensor input, and ops whose local call
DTensor's dispatcher rewrites (its tables of shape and size arguments: views, factories).
``DENY`` lists ops whose derived options the validator (``autopar/tools/validate.py``) found wrong;
``tests/test_dtensor_rules.py`` checks the ops users' models contain. Anything torch raises means no
options (logged once per op): a torch without some of these internals plans those ops replicated.
Results are cached per (op, axis size, tensor shapes / strides / dtypes, other arguments): the
search asks per node per mesh.

Uses torch's private ``torch.distributed.tensor._op_schema`` / ``_dtensor_spec`` /
``_decompositions`` types: the registry is only reachable through them (there is no public API to
query a strategy; torch's own ``_ops/strategy_validation.py`` does the same), and every use is
guarded so that an API change means no options, never a failed plan.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from autopar.passes.rules import AxisOption, writes_inputs

log = logging.getLogger(__name__)

# ops whose DTensor-derived options autopar's validator found wrong (with what it found); none yet
DENY: dict[Any, str] = {}

_CACHE: dict[tuple, tuple[AxisOption, ...]] = {}
_CACHE_MAX = 8192
_warned: set[str] = set()
_MESHES: dict[int, Any] = {}
_MAX_DECOMP_COMBOS = 512  # input placement combinations the decomposition path may trace per node


def options(node: fx.Node, axis_sizes: Iterable[int]) -> list[AxisOption]:
    """DTensor's per-axis options for ``node`` (an op with no rule in ``RULES``), the union over
    the axis sizes > 1 in ``axis_sizes``; ``[]`` where it has none autopar can express."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op in DENY or not _askable(op, node):
        return []
    sizes = sorted({int(n) for n in axis_sizes if int(n) > 1})
    out: list[AxisOption] = []
    for n in sizes:
        for o in _cached(node, n):
            if o not in out:
                out.append(o)
    return out


def _askable(op: torch._ops.OpOverload, node: fx.Node) -> bool:
    try:
        if writes_inputs(node) or torch.Tag.nondeterministic_seeded in getattr(op, "tags", ()):
            return False
        prop = _propagator()
        tables = ("op_to_shape_and_stride_idx", "op_to_scalar_shape_adjuster", "squeeze_op_to_dims_variant")
        return prop is not None and not any(op in (getattr(prop, t, None) or {}) for t in tables)
    except Exception:
        return False


def _cached(node: fx.Node, n: int) -> tuple[AxisOption, ...]:
    op = node.target
    try:
        key = (op, n, _key(node.args), _key(node.kwargs), _key(node.meta.get("val")))
        hash(key)
    except Exception:  # an unhashable argument: ask every time
        key = None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    try:
        found = tuple(_derive(node, n))
    except Exception as e:  # torch's registry refused or changed: no options, never a failed plan
        name = str(op)
        if name not in _warned:
            _warned.add(name)
            log.info("DTensor strategy for %s unavailable (%s: %s): replicated", name, type(e).__name__, e)
        found = ()
    if key is not None:
        if len(_CACHE) >= _CACHE_MAX:
            _CACHE.clear()
        _CACHE[key] = found
    return found


def _key(x):
    """A hashable description of args / outputs: tensors by shape, stride and dtype."""

    def leaf(a):
        if isinstance(a, fx.Node):
            a = a.meta.get("val")
        if isinstance(a, torch.Tensor):
            return ("T", tuple(a.shape), tuple(a.stride()), a.dtype)
        return a

    leaves, spec = pytree.tree_flatten(x)
    return (tuple(leaf(a) for a in leaves), str(spec))


def _propagator():
    try:
        from torch.distributed.tensor import DTensor

        return DTensor._op_dispatcher.sharding_propagator
    except Exception:
        return None


def _mesh(n: int):
    """A 1-D CPU mesh of ``n`` ranks seen from rank 0, with no process group (planning is offline)."""
    if n not in _MESHES:
        from torch.distributed.device_mesh import DeviceMesh

        _MESHES[n] = DeviceMesh("cpu", list(range(n)), _init_backend=False, _rank=0)
    return _MESHES[n]


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _derive(node: fx.Node, n: int) -> list[AxisOption]:
    op = node.target
    prop = _propagator()
    args = pytree.tree_map(_val, node.args)
    kwargs = pytree.tree_map(_val, node.kwargs)
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    outs = [t for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor)]
    if not tensors or not outs:
        return []
    single = (getattr(prop, "op_single_dim_strategy_funcs", None) or {}).get(op)
    if single is not None:
        found = _single_dim(op, single, args, kwargs, len(outs), len(tensors))
    elif op in (getattr(prop, "op_strategy_funcs", None) or {}):
        found = _op_strategy(op, prop.op_strategy_funcs[op], args, kwargs, n, len(outs))
    elif _has_decomp(op):
        found = _decomposed(op, prop, args, kwargs, n, len(outs))
    else:
        return []
    return [o for o in _convert(found, tensors, outs) if _runs_locally(op, args, kwargs, o, n, outs)]


def _meta(t: torch.Tensor):
    # private torch module: TensorMeta is the registry's description of a tensor
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    return TensorMeta(shape=t.shape, stride=t.stride(), dtype=t.dtype)


def _is_tensor_list(x) -> bool:
    return isinstance(x, (list, tuple)) and bool(x) and all(isinstance(t, torch.Tensor) for t in x)


def _single_dim(op, single, args, kwargs, n_out: int, n_in: int) -> list:
    """Single-dim strategies: rows of ``[outputs..., inputs...]`` placements for one mesh axis,
    from the tensors' metadata alone (a tensor list reads as a tuple, as ``OpSchema.args_meta``)."""

    def to_meta(x):
        if isinstance(x, torch.Tensor):
            return _meta(x)
        return tuple(_meta(t) for t in x) if _is_tensor_list(x) else x

    func = getattr(single, "func", single)
    rows = func(op, tuple(to_meta(a) for a in args), {k: to_meta(v) for k, v in kwargs.items()})
    found = []
    for row in rows:
        row = [_placeholder_to_shard(p) for p in row]
        if len(row) == n_out + n_in:
            found.append((row[:n_out], row[n_out:]))
    return found


def _op_strategy(op, strategy_func, args, kwargs, n: int, n_out: int) -> list:
    """Op strategy functions: given an ``OpStrategy`` per input (the placements it may arrive in),
    the ``OpSpec``s the op accepts. Some list every valid spec for any arrival (mm), others follow
    one (stack and cat follow the most sharded input): so ask once with every arrival, and once
    more per placement with every input arriving in it."""
    # private torch modules: the only way to the registry's types (see the module docstring)
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

    mesh = _mesh(n)

    def strategy(t: torch.Tensor, only: Placement | None):
        arrivals = _arrivals(t)
        if only is not None:  # every input in one placement (or Replicate where it has none such)
            arrivals = [only if only in arrivals else Replicate()]
        return OpStrategy(
            [OpSpec(DTensorSpec(mesh, (p,), tensor_meta=_meta(t)), input_specs=()) for p in arrivals]
        )

    def to_strategy(x, only):
        if isinstance(x, torch.Tensor):
            return strategy(x, only)
        return TupleStrategy([strategy(t, only) for t in x]) if _is_tensor_list(x) else x

    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    found = []
    for only in [None, *_arrivals(max(tensors, key=lambda t: t.dim()))]:
        schema = OpSchema(
            op,
            tuple(to_strategy(a, only) for a in args),
            {k: to_strategy(v, only) for k, v in kwargs.items()},
        )
        found += _specs(strategy_func(schema), n_out, len(tensors))
    return found


def _decomposed(op, prop, args, kwargs, n: int, n_out: int) -> list:
    """Ops DTensor shards through their decomposition (``DecompShardingStrategy``, which traces the
    decomposition for every candidate input placement): CompositeImplicit ops a pre-dispatch graph
    keeps (``unflatten``, ``repeat_interleave``, ``max_pool2d``...). Its candidates are the input
    placements seen plus every Shard dim: seeded once with Shard and once with Partial."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema

    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    combos = 1
    for t in tensors:
        combos *= t.dim() + 2
    if combos > _MAX_DECOMP_COMBOS:
        return []  # one traced decomposition per combination: too slow to plan with
    decomp = getattr(prop, "decomp_strategy", None)
    mesh = _mesh(n)
    found = []
    for seed in (Shard(0), Partial()):

        def spec(t: torch.Tensor, seed=seed):
            p = seed if seed in _arrivals(t) else Replicate()
            return DTensorSpec(mesh, (p,), tensor_meta=_meta(t))

        schema = OpSchema(
            op,
            pytree.tree_map_only(torch.Tensor, spec, args),
            pytree.tree_map_only(torch.Tensor, spec, kwargs),
        )
        if decomp is not None:  # torch 2.13: an instance on the propagator
            decomp.ensure_schema_info(op)
            result = decomp.propagate_strategy(schema)
        else:  # torch 2.11: static methods taking the propagator
            from torch.distributed.tensor._decompositions import DecompShardingStrategy

            DecompShardingStrategy.ensure_schema_info(op, prop)
            result = DecompShardingStrategy.propagate_strategy(schema, prop)
        found += _specs(result, n_out, len(tensors))
    return found


def _has_decomp(op) -> bool:
    try:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy

        return bool(DecompShardingStrategy.has_decomp(op))
    except Exception:
        return False


def _specs(result, n_out: int, n_in: int) -> list:
    """(output placements, input placements) of each ``OpSpec`` of an ``OpStrategy`` on a 1-D mesh."""
    from torch.distributed.tensor._op_schema import OpStrategy

    if not isinstance(result, OpStrategy):
        return []  # None, or a TupleStrategy (foreach-style ops): one spec per output, not expressible
    found = []
    for spec in result.strategies:
        out_specs = spec.output_specs
        if not isinstance(out_specs, (tuple, list)):  # one spec for every output (as DTensor reads it)
            out_specs = (out_specs,) * n_out
        out_pl = [None if s is None else _one(s.placements) for s in out_specs]
        if spec.input_specs is None:  # DTensor: every input follows the output
            in_pl = [out_pl[0]] * n_in
        else:
            in_pl = [None if s is None else _one(s.placements) for s in spec.input_specs]
        found.append((out_pl, in_pl))
    return found


def _runs_locally(op, args, kwargs, option: AxisOption, n: int, outs: list[torch.Tensor]) -> bool:
    """Does the plain op, called on local pieces (meta tensors) with the node's own non-tensor
    arguments, give outputs of the local shapes ``option`` claims? DTensor may rewrite an op's size
    arguments for local pieces (views, repeats inside a decomposition); autopar runs the plain call,
    so an option that needs a rewrite is dropped here. Values are the validator's business."""
    k = iter(option.ins)

    def local(t: torch.Tensor) -> torch.Tensor:  # in flattened (args, kwargs) order, as ``ins``
        return torch.empty(_local_shape(t.shape, next(k), n), dtype=t.dtype, device="meta")

    try:
        local_args, local_kwargs = pytree.tree_map_only(torch.Tensor, local, (args, kwargs))
        with torch.no_grad():
            got = op(*local_args, **local_kwargs)
        want = [_local_shape(t.shape, option.out, n) for t in outs]
    except Exception:  # no meta kernel, a size argument that no longer fits, an uneven shard
        return False
    got = [t for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor)]
    return len(got) == len(want) and all(tuple(g.shape) == w for g, w in zip(got, want))


def _local_shape(shape, p: Placement, n: int) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if type(p) is Shard and shape:
        d = p.dim % len(shape)
        if shape[d] % n:
            raise ValueError("uneven")
        return shape[:d] + (shape[d] // n,) + shape[d + 1 :]
    return shape


def _one(placements) -> Placement | None:
    return placements[0] if len(placements) == 1 else None


def _placeholder_to_shard(p):
    """A single-dim strategy's ``_ShardingPlaceholder(d)`` is any sharding of dim d: here ``Shard(d)``."""
    if p is not None and not isinstance(p, Placement) and isinstance(getattr(p, "dim", None), int):
        return Shard(p.dim)
    return p


def _arrivals(t: torch.Tensor) -> list[Placement]:
    """Every placement an input could arrive in on one axis."""
    out: list[Placement] = [Replicate()] + [Shard(d) for d in range(t.dim())]
    if t.dtype.is_floating_point:
        out.append(Partial())
    return out


def _expressible(p, t: torch.Tensor) -> bool:
    """Placements autopar's semantics cover (``rules/__init__.py``): exact types only, since
    ``_StridedShard`` is a ``Shard`` and DTensor's masked / norm partials are ``Partial``s."""
    if type(p) is Replicate:
        return True
    if type(p) is Shard:
        return 0 <= p.dim < t.dim() or -t.dim() <= p.dim < 0
    if type(p) is Partial:
        return p.reduce_op == "sum" and t.dtype.is_floating_point
    return False


def _convert(found, tensors: list[torch.Tensor], outs: list[torch.Tensor]) -> list[AxisOption]:
    result: list[AxisOption] = []
    for out_pl, in_pl in found:
        if len(in_pl) != len(tensors) or len(out_pl) != len(outs):
            continue
        present = [(p, t) for p, t in zip(out_pl, outs) if p is not None]
        if not present or any(not _expressible(p, t) for p, t in present):
            continue
        normal = {_normalize(p, t) for p, t in present}
        if len(normal) != 1:
            continue  # outputs placed differently: AxisOption has one placement for all of them
        if any(p is None or not _expressible(p, t) for p, t in zip(in_pl, tensors)):
            continue
        out = normal.pop()
        ins = tuple(_normalize(p, t) for p, t in zip(in_pl, tensors))
        if type(out) is Replicate and all(type(p) is Replicate for p in ins):
            continue
        option = AxisOption(out, ins)
        if option not in result:
            result.append(option)
    return result


def _normalize(p: Placement, t: torch.Tensor) -> Placement:
    if type(p) is Shard:
        return Shard(p.dim % t.dim())
    if type(p) is Partial:
        return Partial()
    return Replicate()
