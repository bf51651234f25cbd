"""Trace: capture an unmodified model as a flat, aten-level FX graph.

Primary path: ``torch.export.export(..., strict=False)`` (training IR: keeps ``aten.linear``,
``aten.scaled_dot_product_attention``, ``aten.layer_norm``... which carry the sharding structure).
Fallback: ``torch.fx.experimental.proxy_tensor.make_fx(pre_dispatch=True)`` over a functional
call of the module, which also gives an aten-level graph.

Right after capture, ``passes/causal_mask.py`` turns an attention mask proven to be the causal one
(built from shapes alone, as Hugging Face's mask code does when traced) back into SDPA's
``is_causal=True``, so that every later step (analysis, rules, cost model, codegen) sees the call
eager PyTorch makes.

The result, :class:`TracedGraph`, has one placeholder per parameter, buffer, constant and user
input (in that order, each with its role), ``meta["val"]`` fake tensors on every node, and the
pytree specs needed to call it like the original module and to rebuild its output structure.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.fx.config
import torch.utils._pytree as pytree

from autopar.errors import TraceError
from autopar.passes.causal_mask import rewrite_causal_masks
from autopar.passes.experts import fold_experts
from autopar.passes.merged_rows import unmerge_row_reshapes
from autopar.passes.trace_errors import no_partial_graphs, untraceable


class Role(enum.Enum):
    PARAM = "param"
    BUFFER = "buffer"
    INPUT = "input"
    ACTIVATION = "activation"
    OUTPUT = "output"


@dataclass(frozen=True)
class PlaceholderInfo:
    name: str  # node name in the graph
    role: Role
    target: str  # FQN of the parameter / buffer, or the user input's path ("input_ids", "0", ...)


@dataclass
class TracedGraph:
    graph_module: fx.GraphModule
    placeholders: tuple[PlaceholderInfo, ...]
    in_spec: pytree.TreeSpec  # of (args, kwargs)
    out_spec: pytree.TreeSpec
    state: dict[str, torch.Tensor]  # FQN -> original parameter / buffer / constant tensor
    model_name: str
    tracer: str  # "torch.export" or "make_fx"
    # the fused kernels substituted into the graph (passes/fuse.py; autopar.fusion.KernelUse)
    kernels: tuple = ()

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def role_of(self, node_name: str) -> Role:
        for p in self.placeholders:
            if p.name == node_name:
                return p.role
        return Role.ACTIVATION

    def fingerprint(self) -> str:
        """sha256 over ops, shapes, dtypes and placeholder targets: identifies model + input shapes."""
        h = hashlib.sha256()
        for p in self.placeholders:
            h.update(f"{p.role.value}:{p.target};".encode())
        for n in self.graph.nodes:
            val = n.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
            dtype = str(val.dtype) if isinstance(val, torch.Tensor) else ""
            h.update(f"{n.op}:{_target_name(n.target)}:{shape}:{dtype};".encode())
        return h.hexdigest()


def module_path(node: fx.Node) -> str:
    """The innermost module a node was traced in, by its path in the model (``model.layers.3.mlp``,
    from the tracer's ``nn_module_stack``); "" for the model itself or where none was recorded
    (placeholders, nodes passes add without copying the stack)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0].removeprefix("L['self'].")


def _target_name(target) -> str:
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) and str(target) or repr(target)


def normalize_inputs(example_inputs) -> tuple[tuple, dict]:
    """Accept a tuple/list of positional tensors, a dict of keyword tensors, or a single tensor."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TypeError(
        f"example_inputs must be a tensor, a tuple of positional tensors or a dict of keyword tensors, "
        f"got {type(example_inputs).__name__}"
    )


def trace(
    model: torch.nn.Module,
    example_inputs,
    stack_traces: bool = False,
    causal_masks: bool = True,
    experts: bool = True,
) -> TracedGraph:
    """Capture ``model(*args, **kwargs)`` as a TracedGraph; raise TraceError naming what failed.

    ``stack_traces``: keep each node's source line in ``node.meta["stack_trace"]`` (for dumps);
    collecting them costs about a quarter of the tracing time. ``causal_masks``: rewrite attention
    masks proven causal into ``is_causal=True`` (``passes/causal_mask.py``); False keeps the graph
    as captured (to compare the two). ``experts``: make each mixture-of-experts layer one
    ``autopar::moe_experts`` op (``passes/experts.py``); False keeps its aten region."""
    args, kwargs = normalize_inputs(example_inputs)
    if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        # a model built on the meta device is traced on meta inputs: torch < 2.13's fake tensors
        # refuse an op mixing meta and CPU tensors (the embedding of CPU ids); the traced graph is
        # the one a model on the inputs' device gives (no cross-device copies of the inputs)
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    # a private switch of recent torch (2.11 has none: there, stack traces are always collected)
    if not hasattr(torch.fx.config, "do_not_emit_stack_traces"):
        tg = _trace(model, args, kwargs)
    else:
        previous = torch.fx.config.do_not_emit_stack_traces
        torch.fx.config.do_not_emit_stack_traces = not stack_traces
        try:
            tg = _trace(model, args, kwargs)
        finally:
            torch.fx.config.do_not_emit_stack_traces = previous
    if causal_masks:
        rewrite_causal_masks(tg.graph_module, recompile=False)
    if experts:
        fold_experts(tg.graph_module)
    unmerge_row_reshapes(tg.graph_module, recompile=False)
    device_moves_keep_dtype(tg.graph_module)
    # the passes above and the tracers' clean-ups edit the graph alone: its code is generated once
    # here (a recompile of a 32-layer Llama's graph costs a tenth of a second)
    tg.graph_module.recompile()
    return tg


def _trace(model: torch.nn.Module, args, kwargs) -> TracedGraph:
    try:
        return _trace_export(model, args, kwargs)
    except TraceError:
        raise
    except Exception as export_exc:  # noqa: BLE001 - any export failure falls back to make_fx
        try:
            return _trace_make_fx(model, args, kwargs)
        except Exception as fx_exc:  # noqa: BLE001
            raise TraceError(untraceable(model, export_exc, fx_exc)) from export_exc


def _trace_export(model, args, kwargs) -> TracedGraph:
    from torch.export.graph_signature import InputKind, OutputKind

    with no_partial_graphs():
        ep = torch.export.export(model, args, kwargs, strict=False)
    sig = ep.graph_signature
    bad_outputs = [o for o in sig.output_specs if o.kind != OutputKind.USER_OUTPUT]
    if bad_outputs:
        kinds = sorted({o.kind.name for o in bad_outputs})
        raise TraceError(
            f"{type(model).__name__} mutates state in forward ({', '.join(kinds)}: "
            f"{[o.target for o in bad_outputs][:3]}); autopar v0 supports models whose forward does not update "
            "buffers (e.g. put BatchNorm models in eval mode or replace BatchNorm by LayerNorm/GroupNorm)"
        )
    roles = {
        InputKind.PARAMETER: Role.PARAM,
        InputKind.BUFFER: Role.BUFFER,
        InputKind.CONSTANT_TENSOR: Role.BUFFER,
    }
    placeholders: list[PlaceholderInfo] = []
    state: dict[str, torch.Tensor] = {}
    user_paths = _user_input_paths(args, kwargs)
    user_i = 0
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            placeholders.append(PlaceholderInfo(spec.arg.name, Role.INPUT, user_paths[user_i]))
            user_i += 1
        elif spec.kind in roles:
            placeholders.append(PlaceholderInfo(spec.arg.name, roles[spec.kind], spec.target))
            if spec.kind == InputKind.PARAMETER:
                state[spec.target] = ep.state_dict[spec.target]
            elif spec.kind == InputKind.BUFFER:
                state[spec.target] = (
                    ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
                )
            else:
                state[spec.target] = ep.constants[spec.target]
        else:
            raise TraceError(f"unsupported exported input kind {spec.kind.name} for {spec.target}")
    gm = ep.graph_module
    _drop_asserts(gm)
    placeholders = _merge_tied(gm, placeholders, state)
    return TracedGraph(
        graph_module=gm,
        placeholders=tuple(placeholders),
        in_spec=ep.call_spec.in_spec,
        out_spec=ep.call_spec.out_spec,
        state=state,
        model_name=type(model).__name__,
        tracer="torch.export",
    )


def _user_input_paths(args, kwargs) -> list[str]:
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    return [pytree.keystr(path[1:]).strip("[]'\"") or "input" for path, _ in leaves]


def _merge_tied(
    gm: fx.GraphModule, placeholders: list[PlaceholderInfo], state: dict
) -> list[PlaceholderInfo]:
    """Tied weights (one tensor under two names) are lifted as two placeholders: keep the first one,
    so that the parallel module keeps a single parameter and sums the gradients of every use."""
    first: dict[int, PlaceholderInfo] = {}
    keep = []
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for p in placeholders:
        if p.role is Role.INPUT:
            keep.append(p)
            continue
        owner = first.setdefault(id(state[p.target]), p)
        if owner is p:
            keep.append(p)
            continue
        nodes[p.name].replace_all_uses_with(nodes[owner.name])
        gm.graph.erase_node(nodes[p.name])
        del state[p.target]
    return keep  # ``trace`` recompiles the root once


def device_moves_keep_dtype(gm: fx.GraphModule) -> None:
    """A ``x.to(device)`` is traced as ``aten.to.dtype_layout(x, dtype=<x's traced dtype>,
    device=...)``: a no-op in the trace, but under mixed precision, where ``x`` runs in the half
    type (GPT-2's position embedding, read as a half copy: ``codegen/local_params.py``), it would
    upcast it to the traced fp32 where eager PyTorch keeps its dtype. Such a node (a device given,
    the dtype its input's own in the trace) is given ``dtype=None``: the same value at the traced
    dtypes, the input's dtype at run time (``passes/precision.py:half_infos`` prices it so). An
    explicit cast (``x.to(torch.float32)``, ``aten.to.dtype``: RMSNorm's upcast) is left alone."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.aten.to.dtype_layout:
            continue
        src = n.args[0] if n.args else None
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        dtype = n.kwargs.get("dtype")
        if n.kwargs.get("device") is not None and isinstance(val, torch.Tensor) and dtype == val.dtype:
            n.kwargs = {**n.kwargs, "dtype": None}


_ASSERTS = (torch.ops.aten._assert_tensor_metadata.default, torch.ops.aten._assert_scalar.default)
# the higher-order op of a ``torch.autocast`` region: its first argument is the device type
AUTOCAST_REGION = getattr(torch.ops.higher_order, "wrap_with_autocast", None)


def _drop_asserts(gm: fx.GraphModule, recompile: bool = False) -> None:
    """Remove runtime metadata asserts: they check global shapes (and the trace-time device) and
    would fail on local shards. Higher-order ops' submodules (``torch.no_grad()`` and
    ``torch.autocast`` regions) are cleaned the same way, and recompiled; the root is recompiled
    with ``recompile`` (``trace`` does it once, after its own passes)."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _ASSERTS:
            gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    if recompile:
        gm.recompile()
    for _, sub in gm.named_children():
        if isinstance(sub, fx.GraphModule):
            _drop_asserts(sub, recompile=True)


def retarget_region(
    sub: fx.GraphModule,
    device: Callable[[fx.Graph], object],
    device_type: Callable[[fx.Graph], object] | None = None,
) -> fx.GraphModule:
    """A copy of a higher-order op's submodule (a ``torch.no_grad()`` or ``torch.autocast`` region
    the tracer kept as ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast``), nested regions
    included, with every ``torch.device`` argument replaced by ``device(graph)`` and every
    autocast region's device type by ``device_type(graph)`` (None: kept): a constant (the meta device, to
    probe it) or a node the function adds to ``graph`` (the rank's device, read at run time:
    ``codegen/lower.py``). The regions name the device they were traced on, which is not where
    they run."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    holder = torch.nn.Module()
    for n in sub.graph.nodes:
        if n.op == "call_function" and n.target in _ASSERTS:
            continue
        if n.op == "get_attr":
            value = getattr(sub, n.target)
            if isinstance(value, fx.GraphModule):
                value = retarget_region(value, device, device_type)
            setattr(holder, n.target, value)
        if n.op != "call_function":
            env[n] = g.node_copy(n, env.__getitem__)
            continue
        args, kwargs = pytree.tree_map(
            lambda a: device(g) if isinstance(a, torch.device) else a,
            pytree.tree_map_only(fx.Node, env.__getitem__, (n.args, n.kwargs)),
        )
        if n.target is AUTOCAST_REGION and AUTOCAST_REGION is not None and device_type is not None:
            args = (device_type(g), *args[1:])
        env[n] = g.create_node("call_function", n.target, tuple(args), kwargs, name=n.name)
        env[n].meta = dict(n.meta)
    g.lint()
    return fx.GraphModule(holder, g, class_name=type(sub).__name__)


def _trace_make_fx(model, args, kwargs) -> TracedGraph:
    from torch.fx.experimental.proxy_tensor import make_fx

    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    flat_inputs, in_spec = pytree.tree_flatten((args, kwargs))
    names_p, names_b = list(params), list(buffers)
    out_spec_box: list = []

    def fn(*flat):
        p = dict(zip(names_p, flat[: len(names_p)]))
        b = dict(zip(names_b, flat[len(names_p) : len(names_p) + len(names_b)]))
        a, k = pytree.tree_unflatten(list(flat[len(names_p) + len(names_b) :]), in_spec)
        out = torch.func.functional_call(model, {**p, **b}, a, k)
        leaves, spec = pytree.tree_flatten(out)
        out_spec_box.append(spec)
        return leaves

    gm = make_fx(fn, pre_dispatch=True, tracing_mode="fake")(
        *params.values(), *buffers.values(), *flat_inputs
    )
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    user_paths = _user_input_paths(args, kwargs)
    infos = (
        [PlaceholderInfo(n.name, Role.PARAM, t) for n, t in zip(phs, names_p)]
        + [PlaceholderInfo(n.name, Role.BUFFER, t) for n, t in zip(phs[len(names_p) :], names_b)]
        + [
            PlaceholderInfo(n.name, Role.INPUT, t)
            for n, t in zip(phs[len(names_p) + len(names_b) :], user_paths)
        ]
    )
    _drop_asserts(gm)
    return TracedGraph(
        graph_module=gm,
        placeholders=tuple(infos),
        in_spec=in_spec,
        out_spec=out_spec_box[-1],
        state={**{k: v for k, v in params.items()}, **buffers},
        model_name=type(model).__name__,
        tracer="make_fx",
    )


def graph_signature(tg: TracedGraph) -> list[tuple[str, str, str]]:
    """Each placeholder, op and output node as (name, kind, target), in order: two traces of a model
    with equal signatures are one graph (its decisions read from one onto the other by name)."""
    return [
        (n.name, n.op, str(n.target))
        for n in tg.graph.nodes
        if n.op in ("placeholder", "call_function", "output")
    ]


def keep_loss_only(tg: TracedGraph) -> None:
    """Drop every graph output but the first, which must be the loss (a floating scalar), and
    what only they read (``Outputs.LOSS``): the dropped outputs are returned as None."""
    out = next(n for n in tg.graph.nodes if n.op == "output")
    leaves, spec = pytree.tree_flatten(out.args[0])
    first = leaves[0] if leaves else None
    val = first.meta.get("val") if isinstance(first, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 0 or not val.dtype.is_floating_point:
        raise TraceError(
            f"outputs='loss' keeps the model's first output as its loss, but {tg.model_name}'s first output is "
            f"{'a tensor of shape ' + str(tuple(val.shape)) if isinstance(val, torch.Tensor) else repr(first)}, "
            "not a scalar: pass the labels so that the model returns its loss first (Hugging Face), or use "
            "outputs='full' or 'local'"
        )
    out.args = (pytree.tree_unflatten([first] + [None] * (len(leaves) - 1), spec),)
    tg.graph.eliminate_dead_code()
    tg.graph_module.recompile()
