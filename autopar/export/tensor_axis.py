"""The tensor-parallel axis of a plan as ``parallelize_module`` styles: the traced graph walked in
order, each value's placement as PyTorch holds it compared with the one the plan computes with
(``autopar.export``'s docstring says the rules)."""

from __future__ import annotations

import torch
from torch import fx
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from autopar.export.layouts import ExportError, same, seq_attention, text, torch_layout
from autopar.passes.rules import tensor_inputs
from autopar.placement import Outputs, SeqAttention, is_partial, is_replicate, is_shard, via_from_str
from autopar.plan import NodeDecision, Plan

_OPS = {torch.nn.Linear: "aten.linear.default", torch.nn.Embedding: "aten.embedding.default"}
# (module type, weight's split dim) -> style; the weight is the op's tensor input WEIGHT_ARG[type]
_STYLE = {(torch.nn.Linear, 0): ColwiseParallel, (torch.nn.Linear, 1): RowwiseParallel,
          (torch.nn.Embedding, 1): ColwiseParallel, (torch.nn.Embedding, 0): RowwiseParallel}  # fmt: skip
_WEIGHT_ARG = {torch.nn.Linear: 1, torch.nn.Embedding: 0}
_DATA_ARG = {torch.nn.Linear: 0, torch.nn.Embedding: 1}


class TensorWalk:
    """The traced graph walked in order on tensor axis ``axis``: ``layout`` holds each value's
    placement as PyTorch holds it under the styles built so far (module docstring)."""

    def __init__(self, plan: Plan, model: torch.nn.Module, graph: fx.Graph, axis: int):
        self.plan, self.model, self.graph, self.t = plan, model, graph, axis
        self.layout: dict[fx.Node, Placement] = {}
        self.whole: list[str] = []  # nodes PyTorch computes whole where the plan splits them
        # per split value, the styled op nodes whose split output it comes from
        self.origin: dict[fx.Node, frozenset[fx.Node]] = {}
        self.gather: set[fx.Node] = set()  # styled op nodes that give their output whole
        # per whole value, the plain (unstyled) parameters it is computed from: their gradients
        # are whole only while every value they meet is
        self.params: dict[fx.Node, frozenset[str]] = {}

    def styles(self) -> dict[str, ParallelStyle]:
        """The styles; where the plan gathers a styled module's split output only further on, inside
        another module's forward, the module gives its output whole instead and the walk starts
        again (the values are the same; the ops between run whole)."""
        styled = self._styled_ops()
        while True:
            self.layout, self.origin, self.params, self.whole = {}, {}, {}, []
            try:
                return self._walk(styled)
            except _GatherEarlier as e:
                self.gather |= e.nodes

    def _walk(self, styled: dict[fx.Node, tuple[str, type]]) -> dict[str, ParallelStyle]:
        out: dict[str, ParallelStyle] = {}
        for n in self.graph.nodes:
            if n.op == "placeholder":
                self._placeholder(n)
            elif n.op == "call_function":
                if n in styled:
                    fqn, kind = styled[n]
                    out[fqn] = self._style(n, fqn, kind)
                else:
                    self._generic(n)
            elif n.op == "output":
                self._outputs(n)
        return out

    # -- the modules PyTorch's styles split ------------------------------------------------------
    def _styled_ops(self) -> dict[fx.Node, tuple[str, type]]:
        """Op node -> (module path, module type) of every module with a parameter split on the axis."""
        placeholders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        out: dict[fx.Node, tuple[str, type]] = {}
        weights = {
            d.target.rpartition(".")[0]: d.output_spec[self.t]
            for d in self.plan.decisions
            if d.role == "param" and d.target.endswith(".weight")
        }
        for d in self.plan.decisions:
            if d.role != "param" or is_replicate(d.output_spec[self.t]):
                continue
            fqn, _, leaf = d.target.rpartition(".")
            mod = self.model.get_submodule(fqn)
            kind = type(mod) if type(mod) in _OPS else None
            if kind is torch.nn.Linear and leaf == "bias" and not is_replicate(weights.get(fqn, Replicate())):
                continue  # checked with its weight (``_style``)
            if kind is None or leaf != "weight":
                raise ExportError(
                    f"the plan splits {d.target} ({type(mod).__name__}) as {d.output} on tensor axis {self.t}; "
                    "PyTorch's plan styles split only nn.Linear and nn.Embedding weights: plan with this "
                    "module's parameters replicated, or run the plan with autoparallelize"
                )
            users = list(placeholders[d.name].users)
            if len(users) != 1 or str(users[0].target) != _OPS[kind]:
                raise ExportError(
                    f"{d.target} is used by {[str(u.target) for u in users]}, not by one {_OPS[kind]} of its "
                    f"module {fqn}; a style splits a module that runs its weight once (fused kernels or tied "
                    "weights are not exported): run the plan with autoparallelize"
                )
            out[users[0]] = (fqn, kind)
        return out

    def _style(self, n: fx.Node, fqn: str, kind: type) -> ParallelStyle:
        d = self.plan.decision(n.name)
        ins = tensor_inputs(n)
        weight = self._param(ins[_WEIGHT_ARG[kind]])
        dim = weight.output_spec[self.t].dim % len(weight.shape)
        style = _STYLE[(kind, dim)]
        rowwise = style is RowwiseParallel
        for i, a in enumerate(ins):
            if i == _DATA_ARG[kind]:
                continue
            p = self._param(a)
            need, have = d.input_specs[i][self.t], p.output_spec[self.t]
            bias_ok = rowwise and i == 2 and is_replicate(have)  # added once after the sum: PyTorch's own
            if not bias_ok and not same(need, have, len(p.shape)):
                raise ExportError(
                    f"{fqn} ({style.__name__}) takes {p.target} as {text(need)} but stores it as "
                    f"{text(have)} on tensor axis {self.t}; PyTorch's style uses a parameter as stored: "
                    "run the plan with autoparallelize"
                )
        x = ins[_DATA_ARG[kind]]
        arrives = self.layout[x]
        ndim_x = _ndim(x)
        if is_partial(arrives):
            raise self._partial(x)
        if kind is torch.nn.Embedding and not is_replicate(arrives):
            raise self._reshard(n, _DATA_ARG[kind], arrives, Replicate(), ndim_x)
        want = d.input_specs[_DATA_ARG[kind]][self.t]
        takes = Shard(-1) if rowwise and kind is torch.nn.Linear else Replicate()
        if not same(want, takes, ndim_x):
            raise ExportError(
                f"{fqn} ({style.__name__}) takes its input as {text(want)} in the plan, the style as "
                f"{text(takes)}: run the plan with autoparallelize"
            )
        ndim = len(d.shape)
        out = Replicate() if n in self.gather else self._consumed_as(n, d)
        self.layout[n] = out
        self.origin[n] = frozenset((n,)) if is_shard(out) else frozenset()
        return style(
            input_layouts=torch_layout(arrives, ndim_x), output_layouts=torch_layout(out, ndim),
            use_local_output=True,
        )  # fmt: skip

    def _consumed_as(self, n: fx.Node, d: NodeDecision) -> Placement:
        """The one placement every consumer of ``n`` takes it in."""
        wanted = []
        for u in n.users:
            if u.op == "output":
                wanted.append(self._returned_as(d))
                continue
            du = self.plan.decision(u.name)
            wanted += [du.input_specs[i][self.t] for i, a in enumerate(tensor_inputs(u)) if a is n]
        # a pending sum taken on by its consumers is reduced at the module's output by PyTorch
        wanted = [Replicate() if is_partial(w) else w for w in wanted] or [d.output_spec[self.t]]
        first = wanted[0]
        if is_partial(first) or any(not same(w, first, len(d.shape)) for w in wanted):
            return Replicate()  # taken whole by some: the others run whole (``_generic``)
        return first

    def _returned_as(self, d: NodeDecision) -> Placement:
        p = d.output_spec[self.t]
        return Replicate() if self.plan.outputs != Outputs.LOCAL.value or is_partial(p) else p

    # -- every other node --------------------------------------------------------------------------
    def _placeholder(self, n: fx.Node) -> None:
        d = self.plan.decision(n.name)
        p = d.output_spec[self.t]
        if d.role == "input" and not is_replicate(p):
            raise ExportError(
                f"the plan splits input {d.target or d.name} as {text(p)} on tensor axis {self.t}; PyTorch "
                "gives every rank of the tensor dim the whole input: plan with AxisRole.TENSOR on that axis"
            )
        # a buffer stays whole under PyTorch's styles; the walk then sees where the plan splits it
        self.layout[n] = Replicate() if d.role == "buffer" else p
        if d.role == "param" and is_replicate(p):
            self.params[n] = frozenset((d.target,))

    def _generic(self, n: fx.Node) -> None:
        d = self.plan.decision(n.name)
        via = via_from_str(d.via)
        if self.t < len(via) and isinstance(via[self.t], SeqAttention):
            raise seq_attention(d, self.t)
        ins = tensor_inputs(n)
        have = [self.layout[a] for a in ins]
        for a, p in zip(ins, have):
            if is_partial(p):
                raise self._partial(a)
        need = [s[self.t] for s in d.input_specs]
        out = d.output_spec[self.t]
        carried = frozenset().union(*(self.params.get(a, ()) for a in ins))
        if all(same(h, w, _ndim(a)) for a, h, w in zip(ins, have, need)):
            if carried and any(is_shard(h) for h in have):
                raise ExportError(
                    f"node {n.name} ({d.op}{', module ' + d.module if d.module else ''}) uses "
                    f"{', '.join(sorted(carried))} whole with values split on tensor axis {self.t}: the plan sums "
                    "its gradient over the ranks; under PyTorch's plan it is a plain parameter (no style makes it "
                    "a DTensor) and would keep one rank's part: run the plan with autoparallelize"
                )
            if is_partial(out):
                raise self._partial(n)
            if is_shard(out) and not any(is_shard(h) for h in have):
                raise ExportError(
                    f"node {n.name} ({d.op}{', module ' + d.module if d.module else ''}) gives "
                    f"{text(out)} on tensor axis {self.t} from whole inputs; PyTorch runs it on the "
                    "whole tensors: run the plan with autoparallelize"
                )
            self.layout[n] = out
            self.params[n] = carried if is_replicate(out) else frozenset()
            self.origin[n] = (
                frozenset().union(*(self.origin.get(a, ()) for a in ins)) if is_shard(out) else frozenset()
            )
            return
        if all(is_replicate(h) for h in have):
            self.whole.append(n.name)  # the plan splits it; PyTorch computes it whole (the same values)
            self.layout[n] = Replicate()
            self.params[n] = carried
            return
        i = next(i for i, (a, h, w) in enumerate(zip(ins, have, need)) if not same(h, w, _ndim(a)))
        split = frozenset().union(*(self.origin.get(a, ()) for a, h in zip(ins, have) if is_shard(h)))
        if split and not split <= self.gather:
            raise _GatherEarlier(split)
        raise self._reshard(n, i, have[i], need[i], _ndim(ins[i]))

    def _outputs(self, n: fx.Node) -> None:
        for a in tensor_inputs(n):
            p = self.layout.get(a)
            if p is None or a.op == "placeholder":
                continue
            want = self._returned_as(self.plan.decision(a.name))
            if not same(p, want, _ndim(a)):
                if is_shard(p) and self.origin.get(a, frozenset()) - self.gather:
                    raise _GatherEarlier(self.origin[a])
                raise ExportError(
                    f"output {a.name} is {text(p)} on tensor axis {self.t} under PyTorch's plan and "
                    f"returned {text(want)} by the plan: run the plan with autoparallelize"
                )

    def _param(self, n: fx.Node) -> NodeDecision:
        d = self.plan.decision(n.name)
        if d.role not in ("param", "buffer"):
            raise ExportError(f"node {n.name} feeds a split module's parameter slot but is no parameter")
        return d

    def _partial(self, n: fx.Node) -> ExportError:
        d = self.plan.decision(n.name)
        return ExportError(
            f"node {n.name} ({d.module or d.op}) leaves a pending sum (Partial) on tensor axis {self.t} "
            "outside a RowwiseParallel module; PyTorch's styles reduce at the module's output: run the plan "
            "with autoparallelize"
        )

    def _reshard(self, n: fx.Node, i: int, have: Placement, need: Placement, ndim: int) -> ExportError:
        d = self.plan.decision(n.name)
        return ExportError(
            f"the plan reshards input {i} of node {n.name} ({d.op}{', module ' + d.module if d.module else ''}) "
            f"from {text(have)} to {text(need)} on tensor axis {self.t}, inside a module's forward; "
            "PyTorch's plan styles reshard only at a styled module's input or output: run the plan with "
            "autoparallelize"
        )


class _GatherEarlier(Exception):
    """The styled op nodes ``nodes`` give their output whole: the walk starts again."""

    def __init__(self, nodes: frozenset):
        super().__init__()
        self.nodes = nodes


def _ndim(n: fx.Node) -> int:
    """Dims of ``n``'s value (of its first tensor where it returns several, as plans place it)."""
    v = n.meta.get("val")
    if isinstance(v, (tuple, list)):
        v = next((t for t in v if isinstance(t, torch.Tensor)), None)
    return v.dim() if isinstance(v, torch.Tensor) else 0
