"""The report's pipeline section: the plan's chunks and its schedule's timeline, re-simulated from the
plan (:func:`pipeline_timeline`) and drawn as a Gantt chart (:func:`timeline_svg`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from autopar.cost_model.pipeline import ScheduleError, Timeline, simulate_schedule
from autopar.plan import Plan
from autopar.report.svg import (
    fmt_bytes,
    fmt_ms,
    fmt_shape,
    fmt_time,
    html_table,
    is_num,
    num_cell,
    svg_doc,
    svg_legend,
    svg_rect,
    svg_text,
    text_cell,
    text_width,
)

# the most schedule actions the pipeline timeline draws (each 150-250 bytes of SVG: 4096 keep the
# picture under 1 MB); past it, the actions of the first micro-batches only
TIMELINE_MAX_EVENTS = 4096


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
                note += f", {fmt_bytes(timeline.peak_bytes[r])}"
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
    body = [svg_text(label_w, 14, title, size=13)]
    legend, legend_end = svg_legend(label_w, 34, [(_KIND_NAMES[k], TIMELINE_COLOURS[k][0]) for k in kinds])
    body += legend
    for r in range(ranks):
        y = top + r * row_h
        body.append(svg_text(label_w - 6, y + 15, f"rank {r}", "end"))
        body.append(
            f'<line x1="{label_w:.1f}" y1="{y + row_h:.1f}" x2="{label_w + plot_w:.1f}" y2="{y + row_h:.1f}" '
            'stroke="#eee"/>'
        )
        if notes[r]:
            body.append(svg_text(label_w + plot_w + 6, y + 15, notes[r], size=10))
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
        body.append(svg_rect(x, y + 2, w, row_h - 4, colour, tip))
        if w >= 7 * len(str(a.micro)) + 4:
            body.append(
                svg_text(x + w / 2, y + 15, str(a.micro), "middle", 10).replace(
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
            body.append(svg_text(x, axis_y + 16, fmt_time(i * step), "middle", 10))
        # the last tick's label, centred on the plot's right end, reaches half its width past it
        ticks_end = label_w + n * step * scale + text_width(fmt_time(n * step), 10) / 2
        caption = caption or (
            f"schedule's makespan {fmt_time(timeline.makespan)}, bubble {timeline.bubble_fraction * 100:.1f}% "
            f"of the ranks' time idle"
        )
    else:
        ticks_end = 0.0
        caption = caption or "no events"
    body.append(svg_text(label_w, axis_y + 38, caption))
    width = max(
        label_w + plot_w + right_w,
        label_w + text_width(title, 13) + 10,
        legend_end + 10,
        ticks_end + 10,
        label_w + text_width(caption) + 10,
    )
    return svg_doc(width, height, body, f"{title}: {caption}")


# -- the plan's pipeline -----------------------------------------------------------------------------------
def _chunk(c: dict) -> float:
    v = c.get("chunk")
    return float(v) if is_num(v) else math.inf


def _stage_costs(plan: Plan) -> list[dict]:
    return sorted(plan.stage_costs, key=_chunk)


def _cost(c: dict, key: str) -> float:
    v = c.get(key)
    return float(v) if is_num(v) else 0.0


def _blocks(c: dict) -> str:
    """A chunk's blocks ``[first, end)`` as ``first..last``."""
    b = c.get("blocks")
    if not isinstance(b, (list, tuple)) or len(b) != 2 or not all(is_num(x) for x in b):
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


def step_from_makespan(plan: Plan, timeline: Timeline) -> str:
    """How the predicted step follows from the schedule's makespan: the step is the makespan
    (``passes/pipeline.py``) plus what runs once per step on the fullest rank (its optimizer step
    and gradient reductions) and the whole model's terms divided among the stages (the trades'
    seconds, the gradient buckets' adjustment: less the reduction hidden behind backward and the
    reshards several ops share, which each chunk's price counts once per use). The last can take
    off more than the rest adds: the step is then shorter than the makespan."""
    step, makespan = plan.predicted.step_time_s, timeline.makespan
    rest = step - makespan
    sign = "+" if rest >= 0 else "−"
    text = (
        f"predicted step {fmt_ms(step)} = the schedule's makespan {fmt_ms(makespan)} (bubble "
        f"{timeline.bubble_fraction * 100:.1f}% of the ranks' time idle) {sign} {fmt_ms(abs(rest))} once per step "
        "(the optimizer, the gradient reductions and the trades' terms, less the gradient reduction hidden "
        "behind backward and the reshards several ops share, which the chunks' prices count at every use)"
    )
    if rest < 0:
        text += (
            ": here what is taken off exceeds what is added, so the step is shorter than the makespan "
            "of the chunks as priced"
        )
    return text


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
        f"step; each stage a mesh {escape(fmt_shape(plan.mesh_shape))} of {per_stage} devices (pipeline rank "
        f"<i>p</i> holds global ranks <i>p</i>·{per_stage} .. <i>p</i>·{per_stage} + {per_stage - 1})"
    )
    if timeline is not None:
        line += "; " + escape(step_from_makespan(plan, timeline))
    rows = [
        [
            text_cell(c.get("chunk", "?")),
            text_cell(c.get("rank", "?")),
            text_cell(_blocks(c)),
            num_cell(fmt_ms(c.get("forward_s"))),
            num_cell(fmt_ms(c.get("backward_s"))),
            num_cell(fmt_ms(c.get("send_s")) if i < len(costs) - 1 else "—"),
            num_cell(fmt_bytes(c.get("activation_bytes"))),
            num_cell(fmt_bytes(c.get("state_bytes"))),
            num_cell(fmt_bytes(c.get("peak_memory_bytes"))),
        ]
        for i, c in enumerate(costs)
    ]
    table = html_table(
        ["chunk", "pipeline rank", "blocks", "forward / micro-batch", "backward / micro-batch",
         "send to next", "activations / micro-batch", "parameter state", "rank's peak"],
        rows,
    )  # fmt: skip
    parts = [
        "<h2>Pipeline</h2>",
        f"<p>{line}.</p>",
        table,
        "<p>Blocks are the model's repeated blocks, numbered from 0; the first chunk also runs what precedes "
        "the first block (embeddings), the last chunk what follows the last (head, loss), and what lies "
        "between two blocks (an encoder's final norm, a decoder's embedding) runs with the block before it. "
        "Forward, backward and send per micro-batch, each including the schedule's per-action host time; the "
        "send carries the chunk's output forward and its gradient back. Parameter state: parameters, "
        "gradients and optimizer state of the chunk's parameters; the rank's peak: all of the rank's chunks, "
        "their activations in flight at the schedule's peak included.</p>",
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
