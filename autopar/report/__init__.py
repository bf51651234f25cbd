"""A self-contained HTML report of a :class:`~autopar.plan.Plan`.

One file, no external scripts, styles or fonts (one inline script: the decisions' filter): tables
plus hand-made inline SVG charts (memory breakdown, the most expensive nodes, and predicted step
time per candidate mesh shape; for a pipelined plan its chunks and its schedule's timeline,
re-simulated from the plan), a table of the mesh's axes (size, role, whether its groups cross
nodes), a legend of the placement notation, and every decision grouped by block. Nodes are named
by the module they run in and their op (``transformer.h.0.mlp.c_fc · addmm``), their graph name
in the tooltip; bytes in binary units to 3 significant digits. No label is clipped: each chart
sizes its label columns and width from its longest label, measured in a monospace font (every
glyph 0.6 em), and cuts a node label past its limit with an ellipsis; no chart is wider than
``CHART_MAX_W`` (the candidates wrap into rows, their labels whole;
``tests/test_report_browser.py`` checks the rendered page in a headless browser). Each section
renders on its own: one whose data the plan lacks says so in its place. Pass ``measured`` (e.g.
``{"step_time_s": 0.012, "peak_memory_bytes": 3 << 30, "world_size": 8}``) to show measured values next to
the predictions with their relative error.

The drawing kit (number formatting, text width, SVG and table primitives) lives in
:mod:`autopar.report.svg`, the pipeline section and its timeline in :mod:`autopar.report.pipeline`,
the memory section in :mod:`autopar.report.memory`, the decisions in :mod:`autopar.report.decisions`.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from html import escape
from typing import Any

from autopar.cost_model.comm import crosses_nodes
from autopar.placement import Matmul2D, Matmul3D, OwnRows, SeqAttention
from autopar.plan import NodeDecision, Plan
from autopar.plan_axes import axis_line, replicated_line
from autopar.report.decisions import decisions_section, op_name
from autopar.report.memory import memory_parts, memory_section
from autopar.report.pipeline import pipeline_section
from autopar.report.svg import (
    dotted_cell,
    finite,
    fmt_bytes,
    fmt_err,
    fmt_ms,
    fmt_shape,
    fmt_time,
    html_table,
    is_num,
    num_cell,
    rel_error,
    short_head,
    svg_doc,
    svg_legend,
    svg_rect,
    svg_text,
    text_cell,
    text_width,
    unbroken_cell,
)

COMPUTE_COLOUR = "#4c78a8"
COMM_COLOUR = "#f58518"
CHOSEN_COLOUR = "#e45756"
OTHER_COLOUR = "#9ecae9"
TOP_NODES = 20
# the most parameter rows shown open; more are collapsed
PARAMS_OPEN = 40
# the widest a chart is drawn, in pixels: the page's body is at most 1,200 wide
CHART_MAX_W = 1100
# the longest node label drawn, in characters: longer module paths lose their head ("…layers.27.mlp")
NODE_LABEL_CHARS = 64

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1200px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;font-size:.9em;margin:.5em 0}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code{font-family:ui-monospace,monospace}.bad{color:#b00}svg{display:block;margin:.5em 0;max-width:100%;height:auto}
.nb{white-space:nowrap}details.dg{margin:.2em 0}details.dg summary{cursor:pointer;padding:2px 0}
"""


def node_label(d: NodeDecision) -> str:
    """How the report names a node: a parameter, buffer or input by its name in the model; an
    op by its module path and op (``transformer.h.0.mlp.c_fc · addmm``), by its graph name where
    it runs in the model itself or the plan does not say (older plans)."""
    if d.op == "placeholder":
        return d.target or d.name
    return f"{d.module} · {op_name(d.op)}" if d.module else d.name


# -- charts ----------------------------------------------------------------------------------------------
def nodes_svg(plan: Plan, top: int = TOP_NODES) -> str:
    """Horizontal bars of the ``top`` nodes by compute_s + comm_s, compute and communication stacked."""
    nodes = sorted(plan.decisions, key=lambda d: d.compute_s + d.comm_s, reverse=True)[:top]
    labels = [short_head(node_label(d), NODE_LABEL_CHARS) for d in nodes]
    values = [fmt_time(d.compute_s + d.comm_s) for d in nodes]
    # the label column and the room right of the longest bar as wide as their longest text
    label_w = 10 + max((text_width(x) for x in labels), default=0.0) + 6
    bar_w, row_h, top_pad = 420, 18, 24
    width = label_w + bar_w + 4 + max((text_width(v) for v in values), default=0.0) + 10
    height = top_pad + row_h * max(len(nodes), 1) + 10
    body, end = svg_legend(label_w, 14, [("compute", COMPUTE_COLOUR), ("communication", COMM_COLOUR)])
    biggest = max((d.compute_s + d.comm_s for d in nodes), default=0.0)
    if not nodes:
        body.append(svg_text(label_w, top_pad + 13, "no nodes"))
        end = max(end, label_w + text_width("no nodes"))
    for i, (d, label, value) in enumerate(zip(nodes, labels, values)):
        y = top_pad + i * row_h
        who = f"{node_label(d)} (node {d.name}, {d.op})"
        body.append(
            svg_text(label_w - 6, y + 13, label, "end").replace(
                "</text>", f"<title>{escape(who)}</title></text>"
            )
        )
        wc = bar_w * d.compute_s / biggest if biggest else 0.0
        wm = bar_w * d.comm_s / biggest if biggest else 0.0
        body.append(
            svg_rect(label_w, y + 2, wc, row_h - 4, COMPUTE_COLOUR, f"{who}: compute {fmt_time(d.compute_s)}")
        )
        body.append(
            svg_rect(label_w + wc, y + 2, wm, row_h - 4, COMM_COLOUR, f"{who}: comm {fmt_time(d.comm_s)}")
        )
        body.append(svg_text(label_w + wc + wm + 4, y + 13, value))
    return svg_doc(max(width, end + 10), height, body, f"top {len(nodes)} nodes by predicted time")


def _mesh_key(shape: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(n) for n in shape)
    except (TypeError, ValueError):
        return None


def candidates_svg(plan: Plan, max_width: float = CHART_MAX_W) -> str:
    """Vertical bars: predicted step time per candidate mesh shape, the chosen mesh highlighted; as
    many columns a row as fit ``max_width``, the rows on one scale, every label whole."""
    cands = list(plan.solver.candidates)
    chosen_i = chosen_candidate(plan)
    objs = [c.get("objective") for c in cands]
    biggest = max((o for o in objs if finite(o)), default=0.0)
    # each column's texts (size 11 or 10): value or why not solved, mesh, status, roles and trades
    cols = []
    for i, c in enumerate(cands):
        key = _mesh_key(c.get("mesh_shape"))
        label = fmt_shape(key) if key is not None else str(c.get("mesh_shape"))
        obj, status = c.get("objective"), str(c.get("status", ""))
        if finite(obj) and biggest > 0:
            value = fmt_ms(obj)
        else:  # not solved: infeasible, pruned by a bound, or the mirror image of another mesh
            value = "infeasible" if status.lower() == "infeasible" else "not solved"
        roles = c.get("axis_roles") or ()
        tag = "/".join(r[0].upper() for r in roles)  # e.g. a 3-axis mesh with its outer axis data parallel
        tag = (tag + " " + _trades_tag(c.get("trades"), c.get("pipeline"))).strip()
        cols.append((label + (" ★" if i == chosen_i else ""), value, status, tag, label))
    col_w = max(
        [90.0] + [max(text_width(col[0]), *(text_width(t, 10) for t in col[1:4])) + 10 for col in cols]
    )
    per_row = max(1, int((max_width - 20) // col_w))
    rows = max(1, -(-len(cands) // per_row))
    plot_h, top_pad, bottom = 120, 40, 56  # the legend sits above the first row's tallest bar's label
    pitch = 16 + plot_h + bottom  # a row: its tallest bar's label, the bars, the labels under them
    body, end = svg_legend(10, 14, [("chosen", CHOSEN_COLOUR), ("other", OTHER_COLOUR)])
    width = max(col_w * min(per_row, max(len(cands), 1)) + 20, 300, end + 10)
    for i, (c, (mesh, value, status, tag, label)) in enumerate(zip(cands, cols)):
        x = 10 + (i % per_row) * col_w
        base = top_pad + (i // per_row) * pitch + plot_h
        obj = c.get("objective")
        if finite(obj) and biggest > 0:
            h = max(plot_h * obj / biggest, 1.0)
            colour = CHOSEN_COLOUR if i == chosen_i else OTHER_COLOUR
            tip = f"mesh {label}: {fmt_ms(obj)} ({c.get('status', '')})"
            body.append(svg_rect(x + 10, base - h, col_w - 20, h, colour, tip))
            body.append(svg_text(x + col_w / 2, base - h - 4, value, "middle", 10))
        else:
            body.append(svg_text(x + col_w / 2, base - 4, value, "middle", 10))
        body.append(svg_text(x + col_w / 2, base + 16, mesh, "middle"))
        body.append(svg_text(x + col_w / 2, base + 32, status, "middle", 10))
        if tag:
            body.append(svg_text(x + col_w / 2, base + 46, tag, "middle", 10))
    for r in range(rows):
        base = top_pad + r * pitch + plot_h
        body.append(f'<line x1="5" y1="{base}" x2="{width - 5:.1f}" y2="{base}" stroke="#888"/>')
    height = top_pad + (rows - 1) * pitch + plot_h + bottom
    return svg_doc(width, height, body, "predicted step time per candidate mesh shape")


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
        if isinstance(c, dict) and _mesh_key(c.get("mesh_shape")) == chosen and c.get("trades", trades) == trades
        and c.get("pipeline", pipe) == pipe and finite(c.get("objective"))
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
        out.append(
            "R"
            + t["recompute"][0]
            + (f"/{t['recompute_blocks']}" if t.get("recompute_blocks") is not None else "")
        )
    if t.get("micro_batches", 1) > 1:
        out.append(f"k{t['micro_batches']}")
    if t.get("offload", "none") != "none":
        out.append({"optimizer": "off", "parameters": "offp"}.get(t["offload"], "off"))
    return " ".join(out)


def _float8_setting(plan: Plan) -> str:
    """How many of the plan's linears run FP8, per recipe (``autopar/lowerings/float8.py``)."""
    linears = sum(1 for d in plan.decisions if d.op == "aten.linear.default")
    per: dict[str, int] = {}
    for r in plan.float8_linears.values():
        per[r.value] = per.get(r.value, 0) + 1
    if not per:
        return f"none of {linears} linears: each in the plan's precision"
    each = ", ".join(f"{n} {r}" for r, n in per.items())
    return f"{each} of {linears} linears (torchao float8, scales' amax reduced over the axes that split them)"


def trades_table(plan: Plan) -> str:
    """The plan's memory-for-time trades: each setting, what it costs in step time and what it
    saves per device."""
    t = plan.trades
    mesh = plan.mesh_shape
    costs = plan.trade_costs
    axes = ", ".join(f"axis {a} ({mesh[a]} devices)" for a in t.data_axes) or "—"
    rows = [
        ("recomputation", f"{t.recompute.value} " + ("(per repeated block)" if t.recompute_blocks is None else
         f"(the first {t.recompute_blocks} repeated blocks of each pipeline stage, the rest kept whole)"), "recompute"),
        ("micro-batches", f"{t.micro_batches} per step, gradients reduced once", "micro_batches"),
        ("precision", {"param": "the parameters' dtype", "bf16": "bf16 compute, fp32 masters and optimizer state",
                       "fp16": "fp16 compute, fp32 masters and optimizer state"}[t.precision.value], "precision"),
        ("ZeRO", f"stage {int(t.zero_stage)} over {axes}" if int(t.zero_stage) else
         "no ZeRO: every data-parallel device keeps whole gradients and optimizer state", "zero"),
        ("offload", t.offload.what, "offload"),
        ("FP8 linears", _float8_setting(plan), "float8"),
    ]  # fmt: skip
    out = []
    for label, setting, key in rows:
        c = costs.get(key, {})
        out.append([
            text_cell(label), text_cell(setting),
            num_cell(fmt_ms(c["seconds"]) if "seconds" in c else "—"),
            num_cell(fmt_bytes(c["bytes_saved"]) if "bytes_saved" in c else "—"),
        ])  # fmt: skip
    return html_table(["trade", "setting", "step time added", "saved per device"], out)


def _summary_table(plan: Plan, measured: dict | None) -> str:
    p = plan.predicted
    rows: list[tuple[str, str, Any, str]] = [  # label, unit kind, predicted value, key in `measured`
        ("step time", "ms", p.step_time_s, "step_time_s"),
        ("· compute", "ms", p.compute_s, "compute_s"),
        ("· communication (exposed)", "ms", p.comm_s, "comm_s"),
        ("· gradient all-reduce hidden behind backward", "ms", p.grad_sync_hidden_s, "grad_sync_hidden_s"),
        ("peak memory / device", "mib", p.peak_memory_bytes, "peak_memory_bytes"),
    ]
    m = memory_parts(plan)
    if m.rank is not None:
        rows[-1] = (f"peak memory of pipeline rank {m.rank} (the fullest)", *rows[-1][1:])
    keys = {"params": "param_bytes", "grads": "grad_bytes", "optimizer": "optimizer_bytes",
            "activations": "activation_bytes"}  # fmt: skip
    for label, b, _ in m.parts:
        rows.append((f"· {label}", "mib", b, keys.get(label, "other_bytes")))
    rows.append(("world size", "int", plan.world_size, "world_size"))
    if plan.expert_skew is not None:  # the routing its MoE ops were priced at
        rows.append(
            ("experts: busiest rank's share of routed pairs / balanced", "x", plan.expert_skew, "expert_skew")
        )
    fmt = {
        "ms": fmt_ms,
        "mib": fmt_bytes,
        "int": lambda v: str(v) if is_num(v) else "—",
        "x": lambda v: f"{v:g}",
    }
    headers = ["quantity", "predicted"] + (
        ["measured", "rel. error (pred − meas) / meas"] if measured else []
    )
    out, used = [], set()
    for label, kind, pred, key in rows:
        cells = [text_cell(label), num_cell(fmt[kind](pred))]
        if measured:
            m = measured.get(key)
            used.add(key)
            cells += [
                num_cell(fmt[kind](m) if is_num(m) else "—"),
                num_cell(fmt_err(rel_error(pred, m)) if kind != "int" else "—"),
            ]
            if kind == "int" and is_num(m) and m != pred:
                cells[-1] = ('<span class="bad">mismatch</span>', True)
        out.append(cells)
    for key, m in (measured or {}).items():
        if key not in used and is_num(m):
            out.append([text_cell(key), num_cell("—"), num_cell(f"{m:.6g}"), num_cell("—")])
    return html_table(headers, out)


# -- mesh axes and the placement notation ---------------------------------------------------------------
# what each axis role of the search (autopar.AxisRole; passes/strategies.py) asks of an axis
ROLE_MEANING = {
    "data": "data parallel: parameters whole on each device, the inputs split on dim 0 (the batch)",
    "tensor": "tensor parallel: every parameter of two or more dims sharded, the inputs whole",
    "sequence": "sequence parallel: the inputs split on dim 1 (the sequence), attention's queries too",
    "expert": "expert parallel: the inputs split on dim 0 as on a data axis, every mixture-of-experts layer's "
    "experts split over the axis and its tokens sent to them by all-to-all",
    "auto": "any: the solver chose every placement",
}
SEQ_ATTENTION_MEANING = {
    SeqAttention.GATHER: "each device's query rows against every key: K and V all-gathered over the axis",
    SeqAttention.RING: "Q, K and V stay split; K/V blocks travel around the axis's ring of devices "
    "(ring attention)",
    SeqAttention.ALL_TO_ALL: "one all-to-all re-splits Q, K and V from the sequence to the heads and one "
    "turns the output back (DeepSpeed-Ulysses)",
}

OWN_ROWS_MEANING = (
    "an op of a data-parallel region (passes/data_region.py): each device runs it unchanged on its own rows of "
    "the batch, no collective inside; only the region's outputs are slices of the whole batch's values"
)
MATMUL_2D_MEANING = {
    Matmul2D.GATHERED: "a 2D tensor-parallel matmul on the two axes so marked (Optimus/SUMMA layout): input split "
    "by rows and K, weight by K and N; each device gathers its row's K blocks of the input and its column's of the "
    "weight (autopar/lowerings/matmul_nd.py)",
    Matmul2D.SUMMA: "a 2D tensor-parallel matmul on the two axes so marked, as SUMMA's steps: one block of the "
    "input broadcast along each row and one of the weight along each column per step, the next step's in flight "
    "while one computes; nothing gathered is kept (codegen/summa.py)",
    Matmul3D.GATHERED: "a 3D tensor-parallel matmul on the two axes so marked, one slice of a q x q x q cube "
    "(Colossal-AI's 3D layout): input split by a batch-like dim and K, weight by N and K; each device gathers the "
    "input's blocks of that dim over the first axis and reduce-scatters its partial output onto it over the second "
    "(autopar/lowerings/matmul_nd.py)",
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
    """What the plan does on mesh ``axis``, read off its placements (``autopar/plan_axes.py``)."""
    return axis_line(plan, axis).split(": ", 1)[1]


def _crosses(plan: Plan, mesh: tuple[int, ...], axis: int) -> str:
    """Whether ``axis`` of ``mesh`` (the whole world's: pipeline stages outermost) crosses nodes,
    as the cost model prices its collectives (``cost_model.comm.crosses_nodes``)."""
    c = plan.cluster if isinstance(plan.cluster, dict) else {}
    per = c.get("devices_per_node")
    if mesh[axis] == 1:
        return "no (one device)"
    if not is_num(per) or per < 1:
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
            text_cell("pipeline stages"), num_cell(str(pipe.stages)),
            text_cell(f"pipeline: a run of the model's blocks per stage, schedule {pipe.schedule.value}"),
            text_cell(_crosses(plan, world, 0)),
            text_cell(f"{pipe.chunks} chunks, {plan.trades.micro_batches} micro-batches; each stage a mesh {fmt_shape(mesh)}"),
        ])  # fmt: skip
    zero = int(plan.trades.zero_stage)
    for a, role in enumerate(axis_roles(plan)):
        meaning = ROLE_MEANING.get(role, role)
        if zero and a in plan.trades.data_axes:
            meaning += f"; ZeRO stage {zero} shards over it"
        crosses = _crosses(plan, world, len(world) - len(mesh) + a)
        rows.append([
            unbroken_cell(f"axis {a}"), num_cell(str(mesh[a])), text_cell(f"{role} — {meaning}"), text_cell(crosses),
            text_cell(_what_it_splits(plan, a)),
        ])  # fmt: skip
    return html_table(
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
        [("<code>R</code>", False), text_cell("replicated: every device of the axis holds the whole tensor (along that axis)")],
        [("<code>S(<i>d</i>)</code>", False), text_cell("sharded on tensor dim d (counted from 0): each device of the axis holds "
                                                 "an equal slice of that dim")],
        [("<code>P</code>", False), text_cell("partial: each device of the axis holds a partial sum; the tensor is their sum, "
                                       "reduced (all-reduce or reduce-scatter) where an op needs it whole")],
    ]  # fmt: skip
    vias = {v for d in plan.decisions if d.via for v in d.via.split(",") if v != "-"}
    for v in SeqAttention:
        if v.value in vias:
            rows.append([(f"<code>via {escape(v.value)}</code>", False), text_cell(SEQ_ATTENTION_MEANING[v])])
    if OwnRows.LOCAL.value in vias:
        rows.append([(f"<code>via {OwnRows.LOCAL.value}</code>", False), text_cell(OWN_ROWS_MEANING)])
    for v in (*Matmul2D, *Matmul3D):
        if v.value in vias:
            rows.append([(f"<code>via {v.value}</code>", False), text_cell(MATMUL_2D_MEANING[v])])
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
    return text + html_table(["notation", "meaning"], rows)


def _guarded(heading: str, draw: Callable[[], list[str]]) -> list[str]:
    """A section's HTML parts from ``draw``; where the plan lacks what it needs (a hand-edited or
    older plan file), its heading and a line naming what is missing instead, so the rest of the
    report still renders."""
    try:
        return draw()
    except Exception as e:  # noqa: BLE001 -- any gap in the plan's data costs one section, not the page
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return [
            f"<h2>{escape(heading)}</h2>",
            f'<p class="bad">This section is missing: the plan lacks the data it needs ({escape(why)}).</p>',
        ]


def _head_table(plan: Plan) -> str:
    c = plan.cluster if isinstance(plan.cluster, dict) else {}
    nodes, per = c.get("nodes"), c.get("devices_per_node")
    if is_num(nodes) and is_num(per):
        size = f"{nodes} × {per} = {nodes * per} devices"
    elif is_num(nodes) or is_num(per):
        size = f"{nodes if is_num(nodes) else '?'} nodes × {per if is_num(per) else '?'} devices"
    else:
        size = "size unknown"
    s = plan.solver
    return html_table(
        ["model", "cluster", "mesh", "solver", "fingerprint"],
        [
            [
                text_cell(plan.model),
                text_cell(f"{c.get('name', '?')} ({size})"),
                text_cell(f"{fmt_shape(plan.mesh_shape)} — {plan.world_size} devices"),
                text_cell(
                    f"{s.name}: {s.status}, {fmt_time(s.solve_time_s)}, {s.num_variables} vars, {s.num_constraints} constraints"
                ),
                (f"<code>{escape(plan.fingerprint[:16])}</code>", False),
            ]
        ],
    )


def _params_table(plan: Plan) -> str:
    """Each parameter's placement; past ``PARAMS_OPEN`` rows, collapsed under a line that counts them."""
    params = [d for d in plan.decisions if d.role == "param"]
    table = html_table(
        ["parameter", "shape", "placement"],
        [
            [
                dotted_cell(d.target),
                unbroken_cell(fmt_shape(d.shape)),
                (f"<code>{escape(d.output)}</code>", False),
            ]
            for d in params
        ],
    )
    if len(params) <= PARAMS_OPEN:
        return table
    placements = sorted({d.output for d in params})
    return (
        f"<details><summary>{len(params)} parameters, placed {', '.join(escape(x) for x in placements[:8])}"
        f"{', …' if len(placements) > 8 else ''} (click to open)</summary>{table}</details>"
    )


def _candidates_parts(plan: Plan) -> list[str]:
    cands = plan.solver.candidates
    if not cands:
        return []
    piped = any(int((c.get("pipeline") or {}).get("stages", 1)) > 1 for c in cands)
    return [
        "<h2>Candidate mesh shapes</h2>",
        candidates_svg(plan),
        "<p>Letters under a mesh: each axis's role in its search (D data parallel, A any placement, "
        "T tensor, S sequence) and the trades of that rung ("
        + ("P<i>n</i> <i>n</i> pipeline stages of that mesh, " if piped else "")
        + "Z<i>n</i> ZeRO stage <i>n</i>, Rs / Rh / Rf "
        "selective / half the matmuls / full recomputation, k<i>n</i> micro-batches, off optimizer offload, offp parameter offload).</p>",
    ]


def render_report(plan: Plan, *, measured: dict | None = None, title: str | None = None) -> str:
    """The report as one HTML string. A section whose data the plan lacks (a hand-edited or older
    plan file) says so in its place; the others render."""
    title = title or f"autopar plan: {plan.model}"
    sections: list[tuple[str, Callable[[], list[str]]]] = [
        ("Plan", lambda: [_head_table(plan)]),
        ("Summary", lambda: ["<h2>Summary</h2>", _summary_table(plan, measured)]),
        (
            "Mesh axes",
            lambda: [
                "<h2>Mesh axes</h2>",
                axes_table(plan),
                *([f"<p>{escape(why[0].upper() + why[1:])}.</p>"] if (why := replicated_line(plan)) else []),
            ],
        ),
        ("Placement notation", lambda: ["<h2>Placement notation</h2>", placement_legend(plan)]),
        ("Memory-for-time trades", lambda: ["<h2>Memory-for-time trades</h2>", trades_table(plan)]),
        ("Pipeline", lambda: pipeline_section(plan) if plan.pipeline.enabled else []),
        ("Predicted memory per device", lambda: memory_section(plan)),
        (
            "Top nodes by predicted time",
            lambda: [
                f"<h2>Top {min(TOP_NODES, len(plan.decisions))} nodes by predicted time</h2>",
                nodes_svg(plan),
                "<p>Each node named by the module it runs in and its op (its graph name in the tooltip); "
                "a parameter by its name.</p>",
            ],
        ),
        ("Candidate mesh shapes", lambda: _candidates_parts(plan)),
        ("Parameter placements", lambda: ["<h2>Parameter placements</h2>", _params_table(plan)]),
        ("All decisions", lambda: decisions_section(plan)),
    ]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
    ]
    for heading, draw in sections:
        parts += _guarded(heading, draw)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(
    plan: Plan, path: str | os.PathLike, *, measured: dict | None = None, title: str | None = None
) -> pathlib.Path:
    """Write the report to ``path`` (parent folders are created) and return the path."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_report(plan, measured=measured, title=title), encoding="utf-8")
    return out
