"""The report's "All decisions" section: every node's decision, grouped by the module it runs in,
each group a collapsed ``<details>``, with a filter box.

A group is a repeated block (the module path up to its first index: ``model.layers.3``) or, outside
the blocks, the module's first two names (``model.embed_tokens``, ``lm_head``); the model's own
nodes (the inputs, the outputs, ops outside any module) are one group. Blocks whose decisions are
the same (placements, shapes, ops and prices alike, their names aside) are one group, its rows
the first block's: a 32-layer model's 1,400 decisions read as a dozen groups.

In a pipelined plan each group says which chunk and pipeline rank run it: the blocks numbered in
the order the graph first runs them, cut as ``Plan.stage_costs`` records, what precedes the first
block with the first chunk, what follows a block with that block's; the model's own nodes (its
inputs and outputs among them) belong to no one chunk.

The filter (a few lines of inline script, no external file) keeps the rows whose text, or whose
group's name, holds what is typed, and opens their groups.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html import escape
from typing import Any

from autopar.plan import NodeDecision, Plan, PlannedCollective
from autopar.report.svg import (
    dotted_cell,
    fmt_bytes,
    fmt_shape,
    fmt_time,
    html_table,
    is_num,
    num_cell,
)

# a module path's repeated block: everything up to its first index ("model.layers.3")
_BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")
MODEL_GROUP = ""

_FILTER_JS = """
(function(){
var f=document.getElementById('decision-filter'),c=document.getElementById('decision-count');
f.addEventListener('input',function(){
var q=f.value.trim().toLowerCase(),shown=0;
document.querySelectorAll('details.dg').forEach(function(g){
var all=q!==''&&g.dataset.names.indexOf(q)>=0,n=0;
g.querySelectorAll('tbody tr').forEach(function(r){
var m=q===''||all||r.textContent.toLowerCase().indexOf(q)>=0;
r.style.display=m?'':'none';if(m){n++;}});
g.style.display=n?'':'none';g.open=q!==''&&n>0;shown+=n;});
c.textContent=q===''?'':shown+' rows match';});
})();
"""


def group_of(module: str) -> str:
    """The group of a node that runs in ``module`` (module docstring)."""
    m = _BLOCK.match(module)
    if m:
        return m.group(1)
    return ".".join(module.split(".")[:2]) if module else MODEL_GROUP


def is_block(group: str) -> bool:
    return _BLOCK.match(group) is not None


def fmt_collective(c: Any, bucket: bool = True) -> str:
    """A planned collective with its bytes in a binary unit (``all_reduce@0 backward (inputs) 4.00 MiB``);
    ``bucket=False``: a gradient bucket's without its index."""
    if not isinstance(c, PlannedCollective):
        return str(c)
    where = c.site.value if c.bucket is None or not bucket else f"bucket {c.bucket}"
    return f"{c.kind.value}@{c.axis} {c.phase.value} ({where}) {fmt_bytes(c.nbytes)}"


def _inner(path: str, group: str) -> str:
    """``path`` within ``group`` (``model.layers.3.mlp.up_proj`` in ``model.layers.3``: ``mlp.up_proj``)."""
    if group and path.startswith(group + "."):
        return path[len(group) + 1 :]
    return "—" if path == group else path


def _signature(ds: list[NodeDecision], group: str) -> tuple:
    """What must match for two blocks to show as one: every decision but its names."""
    return tuple(
        (
            _inner(d.module, group), _inner(d.target, group) if d.role in ("param", "buffer") else d.target,
            d.op, d.role, d.shape, d.output, d.inputs, d.via, fmt_time(d.compute_s), fmt_time(d.comm_s),
            tuple(fmt_collective(c, bucket=False) for c in d.collectives),
        )
        for d in ds
    )  # fmt: skip


@dataclass
class Group:
    """Decisions shown together: ``members`` the groups they stand for (one, or blocks alike)."""

    members: list[str]
    rows: list[NodeDecision]
    chunks: set[int] = field(default_factory=set)


def _indices(members: list[str]) -> str:
    """``model.layers.0`` .. ``model.layers.15`` as ``model.layers.{0..15}`` (gaps as commas)."""
    head = members[0].rpartition(".")[0]
    nums = sorted(int(m.rpartition(".")[2]) for m in members)
    runs: list[list[int]] = []
    for n in nums:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return head + ".{" + ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in runs) + "}"


def _chunk_of_blocks(plan: Plan, order: list[str]) -> dict[str, int]:
    """Per group in ``order`` (graph order), the pipeline chunk that runs it (module docstring);
    empty without a pipeline or where the plan's chunks do not cover its blocks."""
    if not plan.pipeline.enabled:
        return {}
    spans = []
    for c in plan.stage_costs:
        b = c.get("blocks")
        if is_num(c.get("chunk")) and isinstance(b, (list, tuple)) and len(b) == 2 and all(map(is_num, b)):
            spans.append((int(b[0]), int(b[1]), int(c["chunk"])))
    if not spans:
        return {}
    blocks = [g for g in order if is_block(g)]
    last = max(spans)[2]
    if not blocks or max(s[1] for s in spans) != len(blocks):
        return {}
    out, chunk = {}, min(spans)[2]
    for g in order:
        if is_block(g):
            i = blocks.index(g)
            chunk = next((c for a, b, c in spans if a <= i < b), last)
        out[g] = chunk
    return out


def decision_groups(plan: Plan) -> list[Group]:
    """The plan's decisions in groups (module docstring), in graph order of their first node."""
    by_group: dict[str, list[NodeDecision]] = {}
    first_op: dict[str, int] = {}
    for i, d in enumerate(plan.decisions):
        g = MODEL_GROUP if d.role in ("input", "output") else group_of(d.module)
        by_group.setdefault(g, []).append(d)
        if d.op != "placeholder":
            first_op.setdefault(g, i)
    # the model's own nodes first (they span the whole step), then the groups as the graph runs them
    order = sorted(by_group, key=lambda g: (g != MODEL_GROUP, first_op.get(g, -1)))
    chunk = _chunk_of_blocks(plan, [g for g in order if g in first_op and g != MODEL_GROUP])
    groups: list[Group] = []
    alike: dict[tuple, Group] = {}
    for g in order:
        ds = by_group[g]
        key = (re.sub(r"\d+$", "#", g), _signature(ds, g)) if is_block(g) else None
        if key is not None and key in alike:
            alike[key].members.append(g)
        else:
            groups.append(Group([g], ds))
            if key is not None:
                alike[key] = groups[-1]
        if g in chunk:
            (alike[key] if key is not None else groups[-1]).chunks.add(chunk[g])
    return groups


def what(d: NodeDecision, group: str) -> str:
    """A node as the table names it inside ``group``: an op by its module and short op
    (``mlp.down_proj · linear``), a parameter or buffer by its name (``mlp.down_proj.weight (param)``),
    an input or output by its role."""
    if d.op == "placeholder":
        return f"{_inner(d.target, group) if d.target else d.name} ({d.role})"
    op = op_name(d.op)
    module = _inner(d.module, group) if d.module else "—"
    text = op if module == "—" else f"{module} · {op}"
    return text + (" (output)" if d.role == "output" else "")


def _row(d: NodeDecision, group: str) -> list[tuple[str, bool]]:
    return [
        (f'<span class="nb">{escape(d.name)}</span>', False),
        (f'<span title="{escape(d.op)}">{dotted_cell(what(d, group))[0]}</span>', False),
        (f'<span class="nb">{escape(fmt_shape(d.shape))}</span>', False),
        (
            f"<code>{escape(d.output)}</code>" + (f"<br><code>via {escape(d.via)}</code>" if d.via else ""),
            False,
        ),
        ("<br>".join(f"<code>{escape(i)}</code>" for i in d.inputs), False),
        num_cell(fmt_time(d.compute_s)),
        num_cell(fmt_time(d.comm_s)),
        ("<br>".join(escape(fmt_collective(c)) for c in d.collectives), False),
    ]


def op_name(op: str) -> str:
    """An op's short name: ``aten.linear.default`` -> ``linear``, ``<built-in function getitem>``
    -> ``getitem``."""
    if op.startswith("<built-in function ") and op.endswith(">"):
        return op[len("<built-in function ") : -1]
    parts = op.split(".")
    return parts[-2] if len(parts) >= 3 else op


def _summary(plan: Plan, g: Group) -> str:
    name = g.members[0] or "the model itself: inputs, outputs, ops outside any module"
    if len(g.members) > 1:
        name = (
            f"{_indices(g.members)}: {len(g.members)} blocks with the same decisions, {g.members[0]}'s shown"
        )
    compute = sum(d.compute_s for d in g.rows)
    comm = sum(d.comm_s for d in g.rows)
    each = " each" if len(g.members) > 1 else ""
    text = f"{len(g.rows)} nodes{each}, compute {fmt_time(compute)}{each}, comm {fmt_time(comm)}{each}"
    if plan.pipeline.enabled and g.chunks:
        stages = plan.pipeline.stages
        cs = sorted(g.chunks)
        ranks = sorted({c % stages for c in cs})
        text += (
            f"; chunk{'s' if len(cs) > 1 else ''} {', '.join(map(str, cs))} on pipeline "
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        )
    return f"<b>{escape(name)}</b> — {escape(text)}"


def decisions_section(plan: Plan) -> list[str]:
    """The section's HTML parts (module docstring)."""
    groups = decision_groups(plan)
    headers = [
        "node",
        "module · op (in the group)",
        "shape",
        "output",
        "inputs",
        "compute",
        "comm",
        "collectives",
    ]
    parts = [
        f"<h2>All decisions ({len(plan.decisions)})</h2>",
        f"<p>{len(plan.decisions)} nodes in {len(groups)} groups: one per repeated block (blocks with the same "
        "decisions as one), one per module outside the blocks, and the model's own nodes; "
        + ("each with the chunk and pipeline rank that run it; " if plan.pipeline.enabled else "")
        + "click a group to open it. Compute and comm per step; collectives with the bytes each moves.</p>",
        '<p><input id="decision-filter" type="search" size="48" '
        'placeholder="filter: a module, op, placement or collective" aria-label="filter the decisions"> '
        '<span id="decision-count"></span></p>',
    ]
    for g in groups:
        names = " ".join(g.members).lower()
        parts.append(
            f'<details class="dg" data-names="{escape(names)}"><summary>{_summary(plan, g)}</summary>'
            + html_table(headers, [_row(d, g.members[0]) for d in g.rows])
            + "</details>"
        )
    parts.append(f"<script>{_FILTER_JS}</script>")
    return parts
