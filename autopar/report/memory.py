"""The report's memory section: the predicted peak of one device split into parts that add up
to it, and which device that is.

The parts: the parameters, gradients and optimizer state (``Predicted.param_bytes``,
``grad_bytes``, ``optimizer_bytes``), the activations kept for backward (``activation_bytes``),
and what the peak holds beside them, its remainder, named as the search prices it
(``passes/solved_plan.py``):

* without a pipeline, the model's buffers and the inputs (their shards) and the trades'
  transients (ZeRO-3's gathered blocks, offload's staging buffers);
* in a pipeline, the rank's working memory: the largest transient of one op (its temporaries
  while it runs) and the trades' transients, on top of its chunks' state and the activations its
  schedule keeps in flight.

A pipelined plan's figures are the fullest pipeline rank's (``Plan.stage_costs``'s peaks), which
the section names with its global ranks and the other ranks' peaks.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from autopar.plan import Plan
from autopar.report.svg import fmt_bytes, is_num, svg_doc, svg_rect, svg_text, text_width

MEMORY_PARTS = (  # (label, Predicted attribute, colour)
    ("params", "param_bytes", "#4c78a8"),
    ("grads", "grad_bytes", "#72b7b2"),
    ("optimizer", "optimizer_bytes", "#54a24b"),
    ("activations", "activation_bytes", "#e45756"),
)
REST_COLOUR = "#bab0ac"
REST_PLAIN = "buffers, inputs and transients"
REST_PIPELINE = "working memory (largest op's temporaries, transients)"


@dataclass(frozen=True)
class MemoryParts:
    """One device's predicted peak in parts that add up to it (module docstring)."""

    peak: float
    parts: tuple[tuple[str, float, str], ...]  # (label, bytes, colour), the remainder last where > 0
    rank: int | None  # the pipeline rank shown (the fullest); None without a pipeline
    rank_peaks: tuple[float, ...] = ()  # each pipeline rank's peak


def pipeline_rank_peaks(plan: Plan) -> tuple[float, ...]:
    """Each pipeline rank's predicted peak, from ``Plan.stage_costs`` (empty where it lacks them)."""
    peaks: dict[int, float] = {}
    for c in plan.stage_costs:
        r, b = c.get("rank"), c.get("peak_memory_bytes")
        if is_num(r) and is_num(b):
            peaks[int(r)] = max(peaks.get(int(r), 0.0), float(b))
    if sorted(peaks) != list(range(plan.pipeline.stages)):
        return ()
    return tuple(peaks[r] for r in range(plan.pipeline.stages))


def memory_parts(plan: Plan) -> MemoryParts:
    """``plan``'s peak per device and its parts (module docstring)."""
    p = plan.predicted
    parts = [(label, max(float(getattr(p, attr)), 0.0), colour) for label, attr, colour in MEMORY_PARTS]
    peak = float(p.peak_memory_bytes)
    rest = peak - sum(b for _, b, _ in parts)
    piped = plan.pipeline.enabled
    if rest > 0:
        parts.append((REST_PIPELINE if piped else REST_PLAIN, rest, REST_COLOUR))
    rank = peaks = None
    if piped:
        peaks = pipeline_rank_peaks(plan)
        rank = max(range(len(peaks)), key=peaks.__getitem__) if peaks else None
    return MemoryParts(max(peak, sum(b for _, b, _ in parts)), tuple(parts), rank, peaks or ())


def who(plan: Plan, m: MemoryParts) -> str:
    """Which device the figures are: every device alike, or the fullest pipeline rank."""
    if not plan.pipeline.enabled:
        return "each device (the cost model prices every device of the mesh alike)"
    n = 1
    for s in plan.mesh_shape:
        n *= int(s)
    if m.rank is None:
        return "the fullest pipeline rank (the plan does not record which)"
    return (
        f"pipeline rank {m.rank} (global ranks {m.rank * n}..{m.rank * n + n - 1}), the fullest of the "
        f"{plan.pipeline.stages}"
    )


def memory_svg(plan: Plan) -> str:
    """A stacked horizontal bar of the peak's parts, as wide as the peak, and a legend, one part
    a line."""
    m = memory_parts(plan)
    x0, bar_w, row = 10, 740, 16
    body = []
    x = float(x0)
    for label, b, colour in m.parts:
        w = bar_w * b / m.peak if m.peak else 0.0
        body.append(svg_rect(x, 10, w, 28, colour, f"{label}: {fmt_bytes(b)}"))
        x += w
    if not m.peak:
        body.append(svg_text(x0 + bar_w / 2, 29, "no memory predicted", "middle"))
    end = x0 + bar_w
    y = 58
    lines = [(f"{label} {fmt_bytes(b)}", colour) for label, b, colour in m.parts]
    lines.append((f"peak {fmt_bytes(m.peak)}", ""))
    for text, colour in lines:
        if colour:
            body.append(f'<rect x="{x0}" y="{y - 9}" width="10" height="10" fill="{colour}"/>')
        body.append(svg_text(x0 + 14, y, text))
        end = max(end, x0 + 14 + text_width(text))
        y += row
    return svg_doc(end + 10, y - row + 10, body, f"predicted memory of {who(plan, m)}")


def memory_section(plan: Plan) -> list[str]:
    """The report's memory section (HTML parts): the chart, which device it shows, and, for a
    pipeline, every rank's peak."""
    m = memory_parts(plan)
    text = f"The predicted peak of {who(plan, m)}: {fmt_bytes(m.peak)}, its parts adding up to it. " + (
        "The remainder beside the state and the activations is the rank's working memory: the largest "
        "op's temporaries while it runs and the trades' transient buffers."
        if plan.pipeline.enabled
        else "The remainder beside the state and the activations holds the model's buffers, the inputs' "
        "shards and the trades' transient buffers."
    )
    if len(m.rank_peaks) > 1:
        text += (
            " Each pipeline rank's peak: "
            + ", ".join(f"rank {r} {fmt_bytes(b)}" for r, b in enumerate(m.rank_peaks))
            + "."
        )
    return ["<h2>Predicted memory per device</h2>", memory_svg(plan), f"<p>{escape(text)}</p>"]
