"""A self-contained HTML report of a :class:`~autopar.plan.Plan`.

One file, no external scripts, styles or fonts: tables plus hand-made inline SVG charts (memory breakdown,
the most expensive nodes, and predicted step time per candidate mesh shape; for a pipelined plan its
chunks and its schedule's timeline, re-simulated from the plan), a table of the mesh's axes (size,
role, whether its groups cross nodes) and a legend of the placement notation. Nodes are named by
the module they run in and their op (``transformer.h.0.mlp.c_fc · addmm``), their graph name in
the tooltip. No label is clipped: each chart sizes its label columns and width from its longest
label, measured in a monospace font (every glyph 0.6 em), and cuts a label past its limit with an
ellipsis (``tests/test_report_browser.py`` checks the rendered page in a headless browser). Pass
``measured`` (e.g.
``{"step_time_s": 0.012, "peak_memory_bytes": 3 << 30, "world_size": 8}``) to show measured values next to
the predictions with their relative error.
"""

from __future__ import annotations

import math
import os
import pathlib
import unicodedata
from collections.abc import Sequence
from html import escape
from numbers import Real
from typing import Any

from autopar.cost_model.comm import crosses_nodes
from autopar.cost_model.pipeline import ScheduleError, Timeline, simulate_schedule
from autopar.placement import SeqAttention, is_shard
from autopar.plan import NodeDecision, Plan

COMPUTE_COLOUR = "#4c78a8"
COMM_COLOUR = "#f58518"
CHOSEN_COLOUR = "#e45756"
OTHER_COLOUR = "#9ecae9"
MEMORY_PARTS = (  # (label, Predicted attribute, colour)
    ("params", "param_bytes", "#4c78a8"),
    ("grads", "grad_bytes", "#72b7b2"),
    ("optimizer", "optimizer_bytes", "#54a24b"),
    ("activations", "activation_bytes", "#e45756"),
)
TOP_NODES = 20
# the longest node label drawn, in characters: longer module paths lose their head ("…layers.27.mlp")
NODE_LABEL_CHARS = 64
# the charts' font: monospace, every glyph 0.6 em wide (DejaVu Sans Mono, Menlo, SF Mono, Courier),
# so a label's width is known before a browser draws it; CHAR_EM estimates it a little high
SVG_FONT = "ui-monospace,SFMono-Regular,Menlo,Consolas,'DejaVu Sans Mono','Liberation Mono',monospace"
CHAR_EM = 0.62
# the most schedule actions the pipeline timeline draws (each 150-250 bytes of SVG: 4096 keep the
# picture under 1 MB); past it, the actions of the first micro-batches only
TIMELINE_MAX_EVENTS = 4096

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code{font-family:ui-monospace,monospace}.bad{color:#b00}svg{display:block;margin:.5em 0}
"""


# -- number formatting ---------------------------------------------------------------------------
def _is_num(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _finite(x: Any) -> bool:
    return _is_num(x) and math.isfinite(x)


def fmt_time(s: Any) -> str:
    """Seconds with a readable unit (s, ms, µs, ns)."""
    if not _is_num(s):
        return "—"
    if math.isnan(s):
        return "—"
    if math.isinf(s):
        return "∞"
    a = abs(s)
    if a == 0:
        return "0 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if a >= scale:
            return f"{s / scale:.3f} {unit}"
    return f"{s / 1e-9:.1f} ns"


def fmt_ms(s: Any) -> str:
    return f"{s * 1e3:.3f} ms" if _finite(s) else fmt_time(s)


def fmt_mib(b: Any) -> str:
    return f"{b / 2**20:.2f} MiB" if _finite(b) else "—"


def rel_error(predicted: Any, measured: Any) -> float | None:
    """(predicted - measured) / measured, or None when it is not defined."""
    if not (_finite(predicted) and _finite(measured)) or measured == 0:
        return None
    return (predicted - measured) / measured


def _fmt_err(e: float | None) -> str:
    return "—" if e is None else f"{e * 100:+.1f}%"


def _shape(shape: Any) -> str:
    return "(" + ", ".join(str(int(n)) for n in shape) + ")" if shape is not None else "—"


# -- SVG helpers -------------------------------------------------------------------------------------
def _rect(x: float, y: float, w: float, h: float, colour: str, tip: str) -> str:
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{h:.1f}" fill="{colour}">'
        f"<title>{escape(tip)}</title></rect>"
    )


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 11) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}">{escape(s)}</text>'


def _svg(width: float, height: float, body: list[str], label: str) -> str:
    width, height = math.ceil(width), math.ceil(height)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="{escape(SVG_FONT)}" role="img" '
        f'aria-label="{escape(label)}">' + "".join(body) + "</svg>"
    )


def text_width(s: str, size: float = 11) -> float:
    """Pixels ``s`` takes at font size ``size`` in the charts' monospace font, estimated a little
    high (a wide East Asian character takes two cells)."""
    cells = sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in s)
    return cells * size * CHAR_EM


def _legend(x: float, y: float, items: list[tuple[str, str]]) -> tuple[list[str], float]:
    """Swatches and labels in a row from ``x``; the elements and where the row ends."""
    out = []
    for label, colour in items:
        out.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="10" height="10" fill="{colour}"/>')
        out.append(_text(x + 14, y, label))
        x += 14 + text_width(label) + 16
    return out, x - 16


def _short(s: str, n: int = 36) -> str:
    """``s`` cut to ``n`` characters, its tail replaced by an ellipsis."""
    return s if len(s) <= n else s[: n - 1] + "…"


def _short_head(s: str, n: int) -> str:
    """``s`` cut to ``n`` characters, its head replaced by an ellipsis: a module path keeps its
    innermost names."""
    return s if len(s) <= n else "…" + s[len(s) - n + 1 :]


def op_name(op: str) -> str:
    """An op's short name: ``aten.linear.default`` -> ``linear``, ``<built-in function getitem>``
    -> ``getitem``."""
    if op.startswith("<built-in function ") and op.endswith(">"):
        return op[len("<built-in function ") : -1]
    parts = op.split(".")
    return parts[-2] if len(parts) >= 3 else op


def node_label(d: NodeDecision) -> str:
    """How the report names a node: a parameter, buffer or input by its name in the model; an
    op by its module path and op (``transformer.h.0.mlp.c_fc · addmm``), by its graph name where
    it runs in the model itself or the plan does not say (older plans)."""
    if d.op == "placeholder":
        return d.target or d.name
    return f"{d.module} · {op_name(d.op)}" if d.module else d.name


# -- charts ----------------------------------------------------------------------------------------------
def memory_svg(plan: Plan) -> str:
    """Stacked horizontal bar of params / grads / optimizer / activations per device."""
    p = plan.predicted
    parts = [(label, max(float(getattr(p, attr)), 0.0), colour) for label, attr, colour in MEMORY_PARTS]
    total = sum(b for _, b, _ in parts)
    width, x0, bar_w = 760, 10, 740
    body = []
    x = float(x0)
    for label, b, colour in parts:
        w = bar_w * b / total if total else 0.0
        body.append(_rect(x, 10, w, 28, colour, f"{label}: {fmt_mib(b)}"))
        x += w
    if not total:
        body.append(_text(x0 + bar_w / 2, 29, "no memory predicted", "middle"))
    legend, end = _legend(x0, 58, [(f"{label} {fmt_mib(b)}", colour) for label, b, colour in parts])
    return _svg(max(width, end + x0), 70, body + legend, "predicted memory per device")


def nodes_svg(plan: Plan, top: int = TOP_NODES) -> str:
    """Horizontal bars of the ``top`` nodes by compute_s + comm_s, compute and communication stacked."""
    nodes = sorted(plan.decisions, key=lambda d: d.compute_s + d.comm_s, reverse=True)[:top]
    labels = [_short_head(node_label(d), NODE_LABEL_CHARS) for d in nodes]
    values = [fmt_time(d.compute_s + d.comm_s) for d in nodes]
    # the label column and the room right of the longest bar as wide as their longest text
    label_w = 10 + max((text_width(x) for x in labels), default=0.0) + 6
    bar_w, row_h, top_pad = 420, 18, 24
    width = label_w + bar_w + 4 + max((text_width(v) for v in values), default=0.0) + 10
    height = top_pad + row_h * max(len(nodes), 1) + 10
    body, end = _legend(label_w, 14, [("compute", COMPUTE_COLOUR), ("communication", COMM_COLOUR)])
    biggest = max((d.compute_s + d.comm_s for d in nodes), default=0.0)
    if not nodes:
        body.append(_text(label_w, top_pad + 13, "no nodes"))
        end = max(end, label_w + text_width("no nodes"))
    for i, (d, label, value) in enumerate(zip(nodes, labels, values)):
        y = top_pad + i * row_h
        who = f"{node_label(d)} (node {d.name}, {d.op})"
        body.append(
            _text(label_w - 6, y + 13, label, "end").replace(
                "</text>", f"<title>{escape(who)}</title></text>"
            )
        )
        wc = bar_w * d.compute_s / biggest if biggest else 0.0
        wm = bar_w * d.comm_s / biggest if biggest else 0.0
        body.append(
            _rect(label_w, y + 2, wc, row_h - 4, COMPUTE_COLOUR, f"{who}: compute {fmt_time(d.compute_s)}")
        )
        body.append(
            _rect(label_w + wc, y + 2, wm, row_h - 4, COMM_COLOUR, f"{who}: comm {fmt_time(d.comm_s)}")
        )
        body.append(_text(label_w + wc + wm + 4, y + 13, value))
    return _svg(max(width, end + 10), height, body, f"top {len(nodes)} nodes by predicted time")


def _mesh_key(shape: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(n) for n in shape)
    except (TypeError, ValueError):
        return None


def candidates_svg(plan: Plan) -> str:
    """Vertical bars: predicted step time per candidate mesh shape; the chosen mesh highlighted."""
    cands = list(plan.solver.candidates)
    chosen_i = chosen_candidate(plan)
    objs = [c.get("objective") for c in cands]
    biggest = max((o for o in objs if _finite(o)), default=0.0)
    # each column's texts (size 11 or 10): value or why not solved, mesh, status, roles and trades
    cols = []
    for i, c in enumerate(cands):
        key = _mesh_key(c.get("mesh_shape"))
        label = _shape(key) if key is not None else str(c.get("mesh_shape"))
        obj, status = c.get("objective"), str(c.get("status", ""))
        if _finite(obj) and biggest > 0:
            value = fmt_ms(obj)
        else:  # not solved: infeasible, pruned by a bound, or the mirror image of another mesh
            value = "infeasible" if status.lower() == "infeasible" else "not solved"
        roles = c.get("axis_roles") or ()
        tag = "/".join(r[0].upper() for r in roles)  # e.g. a 3-axis mesh with its outer axis data parallel
        tag = (tag + " " + _trades_tag(c.get("trades"), c.get("pipeline"))).strip()
        cols.append(
            (label + (" ★" if i == chosen_i else ""), value, _short(status, 14), _short(tag, 16), label)
        )
    col_w = max(
        [90.0] + [max(text_width(col[0]), *(text_width(t, 10) for t in col[1:4])) + 10 for col in cols]
    )
    plot_h, top_pad, bottom = 160, 40, 56  # the legend sits above the tallest bar's label
    body, end = _legend(10, 14, [("chosen", CHOSEN_COLOUR), ("other", OTHER_COLOUR)])
    width = max(col_w * len(cands) + 20, 300, end + 10)
    base = top_pad + plot_h
    for i, (c, (mesh, value, status, tag, label)) in enumerate(zip(cands, cols)):
        x = 10 + i * col_w
        obj = c.get("objective")
        if _finite(obj) and biggest > 0:
            h = max(plot_h * obj / biggest, 1.0)
            colour = CHOSEN_COLOUR if i == chosen_i else OTHER_COLOUR
            tip = f"mesh {label}: {fmt_ms(obj)} ({c.get('status', '')})"
            body.append(_rect(x + 10, base - h, col_w - 20, h, colour, tip))
            body.append(_text(x + col_w / 2, base - h - 4, value, "middle", 10))
        else:
            body.append(_text(x + col_w / 2, base - 4, value, "middle", 10))
        body.append(_text(x + col_w / 2, base + 16, mesh, "middle"))
        body.append(_text(x + col_w / 2, base + 32, status, "middle", 10))
        if tag:
            body.append(_text(x + col_w / 2, base + 46, tag, "middle", 10))
    body.append(f'<line x1="5" y1="{base}" x2="{width - 5:.1f}" y2="{base}" stroke="#888"/>')
    return _svg(width, base + bottom, body, "predicted step time per candidate mesh shape")


def chosen_candidate(plan: Plan) -> int | None:
    """The index in ``plan.solver.candidates`` of the plan itself: its mesh, trades and pipeline
    (older plans: none recorded), the fastest of those (a mesh solved twice, free and with axis 0
    data parallel, has two entries); None where none matches."""
    cands = plan.solver.candidates
    chosen = tuple(int(n) for n in plan.mesh_shape)
    trades = plan.trades.to_dict()
    pipe = plan.pipeline.to_dict()
    matches = [
        i for i, c in enumerate(cands)
        if _mesh_key(c.get("mesh_shape")) == chosen and c.get("trades", trades) == trades
        and c.get("pipeline", pipe) == pipe and _finite(c.get("objective"))
    ]  # fmt: skip
    return min(matches, key=lambda i: cands[i]["objective"], default=None)


def _trades_tag(t: dict | None, pipeline: dict | None = None) -> str:
    """A rung of the trades ladder in a few letters: P8 Z3 R(s|f) k4 off (P: pipeline stages)."""
    out = []
    if pipeline and int(pipeline.get("stages", 1)) > 1:
        out.append(f"P{int(pipeline['stages'])}")
    if not t:
        return " ".join(out)
    if t.get("zero_stage"):
        out.append(f"Z{t['zero_stage']}")
    if t.get("recompute", "none") != "none":
        out.append("R" + t["recompute"][0])
    if t.get("micro_batches", 1) > 1:
        out.append(f"k{t['micro_batches']}")
    if t.get("offload", "none") != "none":
        out.append("off")
    return " ".join(out)


def trades_table(plan: Plan) -> str:
    """The plan's memory-for-time trades: each setting, what it costs in step time and what it
    saves per device."""
    t = plan.trades
    mesh = plan.mesh_shape
    costs = plan.trade_costs
    axes = ", ".join(f"axis {a} ({mesh[a]} devices)" for a in t.data_axes) or "—"
    rows = [
        ("recomputation", f"{t.recompute.value} (per repeated block)", "recompute"),
        ("micro-batches", f"{t.micro_batches} per step, gradients reduced once", "micro_batches"),
        ("precision", {"param": "the parameters' dtype", "bf16": "bf16 compute, fp32 masters and optimizer state",
                       "fp16": "fp16 compute, fp32 masters and optimizer state"}[t.precision.value], "precision"),
        ("ZeRO", f"stage {int(t.zero_stage)} over {axes}", "zero"),
        ("offload", {"none": "nothing", "optimizer": "optimizer state and masters in host memory"}[t.offload.value],
         "offload"),
    ]  # fmt: skip
    out = []
    for label, setting, key in rows:
        c = costs.get(key, {})
        out.append([
            _t(label), _t(setting),
            _n(fmt_ms(c["seconds"]) if "seconds" in c else "—"),
            _n(fmt_mib(c["bytes_saved"]) if "bytes_saved" in c else "—"),
        ])  # fmt: skip
    return _table(["trade", "setting", "step time added", "saved per device"], out)


# -- tables ------------------------------------------------------------------------------------------------
def _table(headers: list[str], rows: list[list[tuple[str, bool]]]) -> str:
    """rows: cells as (already-escaped html, is_numeric)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if num else f"<td>{c}</td>" for c, num in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _t(s: Any) -> tuple[str, bool]:
    return escape(str(s)), False


def _n(s: str) -> tuple[str, bool]:
    return escape(s), True


def _dotted(s: str) -> tuple[str, bool]:
    """A dotted or underscored name (module path, op, graph name) that may wrap after each ``.``
    and ``_``, so that a table of long ones fits the page."""
    return escape(s).replace(".", ".<wbr>").replace("_", "_<wbr>"), False


def _unbroken(s: str) -> tuple[str, bool]:
    """Text kept on one line (a shape)."""
    return escape(s).replace(" ", "&nbsp;"), False


def _summary_table(plan: Plan, measured: dict | None) -> str:
    p = plan.predicted
    rows: list[tuple[str, str, Any, str]] = [  # label, unit kind, predicted value, key in `measured`
        ("step time", "ms", p.step_time_s, "step_time_s"),
        ("· compute", "ms", p.compute_s, "compute_s"),
        ("· communication (exposed)", "ms", p.comm_s, "comm_s"),
        ("· gradient all-reduce hidden behind backward", "ms", p.grad_sync_hidden_s, "grad_sync_hidden_s"),
        ("peak memory / device", "mib", p.peak_memory_bytes, "peak_memory_bytes"),
    ]
    for label, attr, _ in MEMORY_PARTS:
        rows.append((f"· {label}", "mib", getattr(p, attr), attr))
    rows.append(("world size", "int", plan.world_size, "world_size"))
    fmt = {"ms": fmt_ms, "mib": fmt_mib, "int": lambda v: str(v) if _is_num(v) else "—"}
    headers = ["quantity", "predicted"] + (
        ["measured", "rel. error (pred − meas) / meas"] if measured else []
    )
    out, used = [], set()
    for label, kind, pred, key in rows:
        cells = [_t(label), _n(fmt[kind](pred))]
        if measured:
            m = measured.get(key)
            used.add(key)
            cells += [
                _n(fmt[kind](m) if _is_num(m) else "—"),
                _n(_fmt_err(rel_error(pred, m)) if kind != "int" else "—"),
            ]
            if kind == "int" and _is_num(m) and m != pred:
                cells[-1] = ('<span class="bad">mismatch</span>', True)
        out.append(cells)
    for key, m in (measured or {}).items():
        if key not in used and _is_num(m):
            out.append([_t(key), _n("—"), _n(f"{m:.6g}"), _n("—")])
    return _table(headers, out)


# -- mesh axes and the placement notation ---------------------------------------------------------------
# what each axis role of the search (autopar.AxisRole; passes/strategies.py) asks of an axis
ROLE_MEANING = {
    "data": "data parallel: parameters whole on each device, the inputs split on dim 0 (the batch)",
    "tensor": "tensor parallel: every parameter of two or more dims sharded, the inputs whole",
    "sequence": "sequence parallel: the inputs split on dim 1 (the sequence), attention's queries too",
    "auto": "any: the solver chose every placement",
}
SEQ_ATTENTION_MEANING = {
    SeqAttention.GATHER: "each device's query rows against every key: K and V all-gathered over the axis",
    SeqAttention.RING: "Q, K and V stay split; K/V blocks travel around the axis's ring of devices "
    "(ring attention)",
    SeqAttention.ALL_TO_ALL: "one all-to-all re-splits Q, K and V from the sequence to the heads and one "
    "turns the output back (DeepSpeed-Ulysses)",
}


def axis_roles(plan: Plan) -> list[str]:
    """Per mesh axis, the role the search gave it (``AxisRole`` values): the chosen candidate's,
    else ``data`` on the trades' data axes and ``auto`` elsewhere."""
    i = chosen_candidate(plan)
    roles = plan.solver.candidates[i].get("axis_roles") if i is not None else None
    if isinstance(roles, (list, tuple)) and len(roles) == len(plan.mesh_shape):
        return [str(r) for r in roles]
    return ["data" if a in plan.trades.data_axes else "auto" for a in range(len(plan.mesh_shape))]


def _what_it_splits(plan: Plan, axis: int) -> str:
    """What the plan splits on mesh ``axis``, read off its placements: the inputs' dims and how
    many parameters are sharded."""
    params = [d for d in plan.decisions if d.role == "param"]
    sharded = sum(1 for d in params if is_shard(d.output_spec[axis]))
    dims = sorted(
        {
            d.output_spec[axis].dim
            for d in plan.decisions
            if d.role == "input" and is_shard(d.output_spec[axis])
        }
    )
    out = []
    if dims:
        out.append("inputs split on dim " + ", ".join(str(x) for x in dims))
    elif any(d.role == "input" for d in plan.decisions):
        out.append("inputs whole")
    if params:
        out.append(f"{sharded} of {len(params)} parameters sharded")
    return "; ".join(out) or "—"


def _crosses(plan: Plan, mesh: tuple[int, ...], axis: int) -> str:
    """Whether ``axis`` of ``mesh`` (the whole world's: pipeline stages outermost) crosses nodes,
    as the cost model prices its collectives (``cost_model.comm.crosses_nodes``)."""
    c = plan.cluster if isinstance(plan.cluster, dict) else {}
    per = c.get("devices_per_node")
    if mesh[axis] == 1:
        return "no (one device)"
    if not _is_num(per) or per < 1:
        return "— (cluster size unknown)"
    if crosses_nodes(mesh, axis, int(per)):
        return "yes: its devices lie on different nodes (inter-node link)"
    return "no: each group inside one node"


def axes_table(plan: Plan) -> str:
    """The mesh's axes, outermost first: size, the search's role, whether each crosses nodes
    (ranks row-major over the mesh, numbered node by node; a pipelined plan's stages outermost)
    and what the plan splits on it."""
    mesh = tuple(int(n) for n in plan.mesh_shape)
    pipe = plan.pipeline
    world = ((pipe.stages,) if pipe.enabled else ()) + mesh
    rows = []
    if pipe.enabled:
        rows.append([
            _t("pipeline stages"), _n(str(pipe.stages)),
            _t(f"pipeline: a run of the model's blocks per stage, schedule {pipe.schedule.value}"),
            _t(_crosses(plan, world, 0)),
            _t(f"{pipe.chunks} chunks, {plan.trades.micro_batches} micro-batches; each stage a mesh {_shape(mesh)}"),
        ])  # fmt: skip
    zero = int(plan.trades.zero_stage)
    for a, role in enumerate(axis_roles(plan)):
        meaning = ROLE_MEANING.get(role, role)
        if zero and a in plan.trades.data_axes:
            meaning += f"; ZeRO stage {zero} shards over it"
        crosses = _crosses(plan, world, len(world) - len(mesh) + a)
        rows.append([
            _unbroken(f"axis {a}"), _n(str(mesh[a])), _t(f"{role} — {meaning}"), _t(crosses),
            _t(_what_it_splits(plan, a)),
        ])  # fmt: skip
    return _table(
        ["axis", "devices", "role in the search", "crosses nodes", "what this plan splits on it"], rows
    )


def placement_legend(plan: Plan) -> str:
    """How to read the placements of the tables below: the notation, one entry per mesh axis, and
    (where the plan has any) the attention algorithms of a split sequence."""
    n = len(plan.mesh_shape)
    example = ",".join(["S(0)"] + ["R"] * (n - 1))
    each = f"<code>{example}</code>: tensor dim 0 split over axis 0" + (
        ", whole along " + ", ".join(f"axis {a}" for a in range(1, n)) if n > 1 else ""
    )
    rows = [
        [("<code>R</code>", False), _t("replicated: every device of the axis holds the whole tensor (along that axis)")],
        [("<code>S(<i>d</i>)</code>", False), _t("sharded on tensor dim d (counted from 0): each device of the axis holds "
                                                 "an equal slice of that dim")],
        [("<code>P</code>", False), _t("partial: each device of the axis holds a partial sum; the tensor is their sum, "
                                       "reduced (all-reduce or reduce-scatter) where an op needs it whole")],
    ]  # fmt: skip
    vias = {v for d in plan.decisions if d.via for v in d.via.split(",") if v != "-"}
    for v in SeqAttention:
        if v.value in vias:
            rows.append([(f"<code>via {escape(v.value)}</code>", False), _t(SEQ_ATTENTION_MEANING[v])])
    text = (
        f"<p>A placement has one entry per mesh axis, in axis order, comma separated ({each}). "
        "<i>output</i>: where a node's result lives; <i>inputs</i>: where each of its tensor inputs is brought "
        "before it runs; the collectives that bring them there are named <code>kind@axis</code>."
        + (
            " An attention whose sequence is split says how it runs: <code>via</code> one algorithm per mesh "
            "axis, <code>-</code> where none."
            if vias
            else ""
        )
        + "</p>"
    )
    return text + _table(["notation", "meaning"], rows)


def render_report(plan: Plan, *, measured: dict | None = None, title: str | None = None) -> str:
    """The report as one HTML string."""
    c = plan.cluster if isinstance(plan.cluster, dict) else {}
    nodes, per = c.get("nodes"), c.get("devices_per_node")
    if _is_num(nodes) and _is_num(per):
        size = f"{nodes} × {per} = {nodes * per} devices"
    elif _is_num(nodes) or _is_num(per):
        size = f"{nodes if _is_num(nodes) else '?'} nodes × {per if _is_num(per) else '?'} devices"
    else:
        size = "size unknown"
    s = plan.solver
    title = title or f"autopar plan: {plan.model}"
    head = _table(
        ["model", "cluster", "mesh", "solver", "fingerprint"],
        [
            [
                _t(plan.model),
                _t(f"{c.get('name', '?')} ({size})"),
                _t(f"{_shape(plan.mesh_shape)} — {plan.world_size} devices"),
                _t(
                    f"{s.name}: {s.status}, {fmt_time(s.solve_time_s)}, {s.num_variables} vars, {s.num_constraints} constraints"
                ),
                (f"<code>{escape(plan.fingerprint[:16])}</code>", False),
            ]
        ],
    )
    params = _table(
        ["parameter", "shape", "placement"],
        [
            [_t(d.target), _unbroken(_shape(d.shape)), (f"<code>{escape(d.output)}</code>", False)]
            for d in plan.decisions
            if d.role == "param"
        ],
    )
    decisions = _table(
        ["name", "module", "op", "role", "shape", "output", "inputs", "compute", "comm", "collectives"],
        [
            [
                _dotted(d.name),
                _dotted(d.module or "—"),
                _dotted(d.op),
                _t(d.role),
                _unbroken(_shape(d.shape)),
                (
                    f"<code>{escape(d.output)}</code>"
                    + (f"<br><code>via {escape(d.via)}</code>" if d.via else ""),
                    False,
                ),
                ("<br>".join(f"<code>{escape(i)}</code>" for i in d.inputs), False),
                _n(fmt_time(d.compute_s)),
                _n(fmt_time(d.comm_s)),
                ("<br>".join(escape(str(x)) for x in d.collectives), False),
            ]
            for d in plan.decisions
        ],
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        head,
        "<h2>Summary</h2>",
        _summary_table(plan, measured),
        "<h2>Mesh axes</h2>",
        axes_table(plan),
        "<h2>Placement notation</h2>",
        placement_legend(plan),
        "<h2>Memory-for-time trades</h2>",
        trades_table(plan),
        *(pipeline_section(plan) if plan.pipeline.enabled else ()),
        "<h2>Predicted memory per device</h2>",
        memory_svg(plan),
        f"<h2>Top {min(TOP_NODES, len(plan.decisions))} nodes by predicted time</h2>",
        nodes_svg(plan),
        "<p>Each node named by the module it runs in and its op (its graph name in the tooltip); "
        "a parameter by its name.</p>",
    ]
    if s.candidates:
        piped = any(int((c.get("pipeline") or {}).get("stages", 1)) > 1 for c in s.candidates)
        parts += [
            "<h2>Candidate mesh shapes</h2>",
            candidates_svg(plan),
            "<p>Letters under a mesh: each axis's role in its search (D data parallel, A any placement, "
            "T tensor, S sequence) and the trades of that rung ("
            + ("P<i>n</i> <i>n</i> pipeline stages of that mesh, " if piped else "")
            + "Z<i>n</i> ZeRO stage <i>n</i>, Rs / Rf "
            "selective / full recomputation, k<i>n</i> micro-batches, off optimizer offload).</p>",
        ]
    parts += [
        "<h2>Parameter placements</h2>",
        params,
        f"<h2>All decisions ({len(plan.decisions)})</h2>",
        decisions,
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def write_report(
    plan: Plan, path: str | os.PathLike, *, measured: dict | None = None, title: str | None = None
) -> pathlib.Path:
    """Write the report to ``path`` (parent folders are created) and return the path."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(plan, measured=measured, title=title), encoding="utf-8")
    return out


# -- pipeline schedule timeline --------------------------------------------------------------------------
# colour families, one shade per chunk a rank runs (its virtual stage): forward blue, backward (or
# its input-gradient half) orange, weight gradient green
TIMELINE_COLOURS = {
    "F": ("#4c78a8", "#7aa6d6", "#2f5b8a", "#a9c8ea"),
    "B": ("#f58518", "#ffad5c", "#c4620a", "#ffcf9e"),
    "I": ("#f58518", "#ffad5c", "#c4620a", "#ffcf9e"),
    "W": ("#54a24b", "#8ccf7e", "#3b7a34", "#bde5b3"),
}
_KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input grad)", "W": "weight grad"}


def _tick_step(span: float, most: int = 8) -> float:
    """A 1-2-5 step giving at most ``most`` intervals over ``span`` seconds."""
    raw = span / most
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def timeline_svg(
    timeline: Timeline,
    *,
    title: str = "pipeline schedule",
    chunk_labels: Sequence[str] | None = None,
    caption: str | None = None,
) -> str:
    """Gantt chart of a simulated pipeline step (``autopar.cost_model.pipeline.simulate``): one row
    per pipeline rank, time on x, one rectangle per forward / backward / weight-gradient action
    (labelled with its micro-batch when wide enough; the tooltip names chunk, micro-batch and
    times), each row's peak in-flight micro-batches at its end, and the makespan and bubble fraction
    in the caption. ``chunk_labels[c]`` replaces "chunk c" in the tooltips; ``caption`` replaces
    the caption (e.g. for a part of a step, whose own makespan and idle share mean nothing)."""
    ranks = max(len(timeline.busy), 1 + max((e.rank for e in timeline.events), default=-1))
    notes = []  # per rank, at the right of its row: its peak in-flight micro-batches and bytes
    for r in range(ranks):
        note = ""
        if r < len(timeline.peak_in_flight):
            note = f"{timeline.peak_in_flight[r]} in flight"
            if r < len(timeline.peak_bytes) and timeline.peak_bytes[r] > 0:
                note += f", {fmt_mib(timeline.peak_bytes[r])}"
        notes.append(note)
    label_w = 10 + text_width(f"rank {ranks - 1}") + 6
    plot_w, row_h = 760, 22
    right_w = 6 + max((text_width(n, 10) for n in notes), default=0.0) + 10
    top = 44  # title and legend above the rows
    axis_y = top + row_h * max(ranks, 1) + 4
    height = axis_y + 50
    span = timeline.makespan if timeline.makespan > 0 else 1.0
    scale = plot_w / span
    kinds = [k for k in ("F", "B", "I", "W") if any(e.action.kind == k for e in timeline.events)]
    shortest = min((e.end - e.start for e in timeline.events if e.end > e.start), default=1e-3)
    digits = min(6, max(2, 1 - math.floor(math.log10(shortest * 1e3))))  # tooltips tell events apart
    body = [_text(label_w, 14, title, size=13)]
    legend, legend_end = _legend(label_w, 34, [(_KIND_NAMES[k], TIMELINE_COLOURS[k][0]) for k in kinds])
    body += legend
    for r in range(ranks):
        y = top + r * row_h
        body.append(_text(label_w - 6, y + 15, f"rank {r}", "end"))
        body.append(
            f'<line x1="{label_w:.1f}" y1="{y + row_h:.1f}" x2="{label_w + plot_w:.1f}" y2="{y + row_h:.1f}" '
            'stroke="#eee"/>'
        )
        if notes[r]:
            body.append(_text(label_w + plot_w + 6, y + 15, notes[r], size=10))
    for e in timeline.events:
        a = e.action
        shades = TIMELINE_COLOURS.get(a.kind, ("#999999",))
        colour = shades[(a.chunk // max(ranks, 1)) % len(shades)]
        x, w = label_w + e.start * scale, (e.end - e.start) * scale
        y = top + e.rank * row_h
        name = (
            chunk_labels[a.chunk]
            if chunk_labels is not None and a.chunk < len(chunk_labels)
            else f"chunk {a.chunk}"
        )
        tip = (
            f"{a.kind} {name}, micro-batch {a.micro}, {e.start * 1e3:.{digits}f}-{e.end * 1e3:.{digits}f} ms"
        )
        body.append(_rect(x, y + 2, w, row_h - 4, colour, tip))
        if w >= 7 * len(str(a.micro)) + 4:
            body.append(
                _text(x + w / 2, y + 15, str(a.micro), "middle", 10).replace(
                    "<text ", '<text fill="#fff" ', 1
                )
            )
    body.append(
        f'<line x1="{label_w:.1f}" y1="{axis_y}" x2="{label_w + plot_w:.1f}" y2="{axis_y}" stroke="#888"/>'
    )
    if timeline.makespan > 0:
        step = _tick_step(span)
        n = int(span / step + 1e-9)
        for i in range(n + 1):
            x = label_w + i * step * scale
            body.append(f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" stroke="#888"/>')
            body.append(_text(x, axis_y + 16, fmt_time(i * step), "middle", 10))
        # the last tick's label, centred on the plot's right end, reaches half its width past it
        ticks_end = label_w + n * step * scale + text_width(fmt_time(n * step), 10) / 2
        caption = caption or (
            f"makespan {fmt_time(timeline.makespan)}, bubble {timeline.bubble_fraction * 100:.1f}% "
            f"of the ranks' time idle"
        )
    else:
        ticks_end = 0.0
        caption = caption or "no events"
    body.append(_text(label_w, axis_y + 38, caption))
    width = max(
        label_w + plot_w + right_w,
        label_w + text_width(title, 13) + 10,
        legend_end + 10,
        ticks_end + 10,
        label_w + text_width(caption) + 10,
    )
    return _svg(width, height, body, f"{title}: {caption}")


# -- the plan's pipeline -----------------------------------------------------------------------------------
def _chunk(c: dict) -> float:
    v = c.get("chunk")
    return float(v) if _is_num(v) else math.inf


def _stage_costs(plan: Plan) -> list[dict]:
    return sorted(plan.stage_costs, key=_chunk)


def _cost(c: dict, key: str) -> float:
    v = c.get(key)
    return float(v) if _is_num(v) else 0.0


def _blocks(c: dict) -> str:
    """A chunk's blocks ``[first, end)`` as ``first..last``."""
    b = c.get("blocks")
    if not isinstance(b, (list, tuple)) or len(b) != 2 or not all(_is_num(x) for x in b):
        return "?"
    first, end = int(b[0]), int(b[1])
    return f"{first}..{end - 1}" if end > first else "none"


def pipeline_timeline(plan: Plan) -> Timeline:
    """The plan's pipelined step re-simulated from the plan alone: its schedule, stages, chunks per
    rank and micro-batches, each chunk's recorded forward, backward, send and activation bytes per
    micro-batch (``Plan.stage_costs``, what the search simulated). :class:`ScheduleError` when the
    recorded costs do not fit the pipeline (a hand-edited plan)."""
    pipe = plan.pipeline
    costs = _stage_costs(plan)
    if [_chunk(c) for c in costs] != list(range(pipe.chunks)):
        raise ScheduleError(
            f"the plan's pipeline has {pipe.chunks} chunks but its stage_costs name chunks "
            f"{[c.get('chunk') for c in costs]}; re-plan to record them"
        )
    return simulate_schedule(
        pipe.schedule,
        pipe.stages,
        pipe.virtual_stages,
        plan.trades.micro_batches,
        [_cost(c, "forward_s") for c in costs],
        [_cost(c, "backward_s") for c in costs],
        [_cost(c, "send_s") for c in costs[:-1]],
        [_cost(c, "activation_bytes") for c in costs],
    )


def _first_micro_batches(timeline: Timeline, micro_batches: int, most: int) -> tuple[Timeline, int]:
    """``timeline`` cut to the events of its first micro-batches, at most ``most`` events (at least
    one micro-batch's), and how many micro-batches that is; the whole timeline when it fits."""
    if len(timeline.events) <= most:
        return timeline, micro_batches
    per_micro = max(len(timeline.events) // max(micro_batches, 1), 1)
    shown = max(most // per_micro, 1)
    events = tuple(e for e in timeline.events if e.action.micro < shown)
    busy = tuple(sum(e.duration for e in events if e.rank == r) for r in range(len(timeline.busy)))
    end = max((e.end for e in events), default=0.0)
    # the rows' notes keep the whole step's peaks
    return Timeline(events, end, timeline.peak_bytes, timeline.peak_in_flight, busy), shown


def pipeline_section(plan: Plan, max_events: int = TIMELINE_MAX_EVENTS) -> list[str]:
    """The report's "Pipeline" section (HTML parts): one line on the pipeline, a table of its
    chunks, the schedule's timeline re-simulated from the plan (:func:`pipeline_timeline`; the
    events of the first micro-batches only past ``max_events``)."""
    pipe = plan.pipeline
    k = plan.trades.micro_batches
    costs = _stage_costs(plan)
    per_stage = math.prod(int(n) for n in plan.mesh_shape)
    try:
        timeline: Timeline | None = pipeline_timeline(plan)
        error = ""
    except ScheduleError as e:
        timeline, error = None, str(e)
    line = (
        f"{pipe.stages} stages × {pipe.virtual_stages} chunk{'s' if pipe.virtual_stages > 1 else ''} per rank "
        f"= {pipe.chunks} chunks, schedule <code>{escape(pipe.schedule.value)}</code>, {k} micro-batches per "
        f"step; each stage a mesh {escape(_shape(plan.mesh_shape))} of {per_stage} devices (pipeline rank "
        f"<i>p</i> holds global ranks <i>p</i>·{per_stage} .. <i>p</i>·{per_stage} + {per_stage - 1})"
    )
    if timeline is not None:
        line += (
            f"; the schedule's makespan {escape(fmt_ms(timeline.makespan))} of the predicted step "
            f"{escape(fmt_ms(plan.predicted.step_time_s))}, bubble {timeline.bubble_fraction * 100:.1f}% "
            "of the ranks' time idle"
        )
    rows = [
        [
            _t(c.get("chunk", "?")),
            _t(c.get("rank", "?")),
            _t(_blocks(c)),
            _n(fmt_ms(c.get("forward_s"))),
            _n(fmt_ms(c.get("backward_s"))),
            _n(fmt_ms(c.get("send_s")) if i < len(costs) - 1 else "—"),
            _n(fmt_mib(c.get("activation_bytes"))),
            _n(fmt_mib(c.get("state_bytes"))),
            _n(fmt_mib(c.get("peak_memory_bytes"))),
        ]
        for i, c in enumerate(costs)
    ]
    table = _table(
        ["chunk", "pipeline rank", "blocks", "forward / micro-batch", "backward / micro-batch",
         "send to next", "activations / micro-batch", "parameter state", "rank's peak"],
        rows,
    )  # fmt: skip
    parts = [
        "<h2>Pipeline</h2>",
        f"<p>{line}.</p>",
        table,
        "<p>Blocks are the model's repeated blocks, numbered from 0; the first chunk also runs what precedes "
        "the first block (embeddings), the last chunk what follows the last (head, loss). Forward, backward "
        "and send per micro-batch, each including the schedule's per-action host time; the send carries the "
        "chunk's output forward and its gradient back. Parameter state: parameters, gradients and optimizer "
        "state of the chunk's parameters; the rank's peak: all of the rank's chunks, their activations in "
        "flight at the schedule's peak included.</p>",
    ]
    if timeline is None:
        parts.append(f'<p class="bad">No timeline: {escape(error)}</p>')
        return parts
    labels = [f"chunk {c.get('chunk', i)} (blocks {_blocks(c)})" for i, c in enumerate(costs)]
    shown, n = _first_micro_batches(timeline, k, max_events)
    title = f"{pipe.schedule.value}: {pipe.stages} ranks, {pipe.chunks} chunks, {k} micro-batches"
    if n < k:
        caption = (
            f"micro-batches 0..{n - 1} of {k} drawn ({len(shown.events)} of {len(timeline.events)} actions, "
            f"at their times in the whole step: {fmt_time(shown.makespan)} of its makespan "
            f"{fmt_time(timeline.makespan)}, bubble {timeline.bubble_fraction * 100:.1f}%)"
        )
        svg = timeline_svg(shown, title=title + f" (first {n} drawn)", chunk_labels=labels, caption=caption)
        note = (
            f"The step has {len(timeline.events)} actions; to keep this page small only those of the first "
            f"{n} micro-batches are drawn, where they run in the whole step (the gaps between them are the "
            "later micro-batches' actions). "
        )
    else:
        svg = timeline_svg(shown, title=title, chunk_labels=labels)
        note = ""
    parts += [
        svg,
        f"<p>{escape(note)}The timeline is re-simulated from the table above "
        "(<code>cost_model/pipeline.py</code>): one row per pipeline rank, one bar per forward (blue), "
        "backward (orange) or weight gradient (green) of a chunk's micro-batch, a shade "
        "per chunk of a rank (interleaved schedules); at the right each rank's most micro-batches in flight and "
        "their activation bytes. "
        "The rest of the predicted step runs once per step after it: the optimizer, the gradient "
        "reductions, the trades' terms.</p>",
    ]
    return parts
