"""The report's drawing kit: number, byte and time formatting, text width in the charts' font, inline
SVG primitives (rectangle, text, legend, the ``<svg>`` element) and HTML table cells.

Nothing here knows a plan: :mod:`autopar.report` and :mod:`autopar.report.pipeline` draw with it.
"""

from __future__ import annotations

import math
import unicodedata
from html import escape
from numbers import Real
from typing import Any

# the charts' font: monospace, every glyph 0.6 em wide (DejaVu Sans Mono, Menlo, SF Mono, Courier),
# so a label's width is known before a browser draws it; CHAR_EM estimates it a little high
SVG_FONT = "ui-monospace,SFMono-Regular,Menlo,Consolas,'DejaVu Sans Mono','Liberation Mono',monospace"
CHAR_EM = 0.62


# -- number formatting ---------------------------------------------------------------------------
def is_num(x: Any) -> bool:
    """A real number, not a bool."""
    return isinstance(x, Real) and not isinstance(x, bool)


def finite(x: Any) -> bool:
    """A real number, neither infinite nor NaN."""
    return is_num(x) and math.isfinite(x)


def fmt_time(s: Any) -> str:
    """Seconds with a readable unit (s, ms, µs, ns)."""
    if not is_num(s):
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
    """Seconds in milliseconds (``12.500 ms``); what is not finite as :func:`fmt_time` writes it."""
    return f"{s * 1e3:.3f} ms" if finite(s) else fmt_time(s)


def fmt_bytes(b: Any) -> str:
    """Bytes in a binary unit to 3 significant digits (``512 B``, ``4.00 KiB``, ``5.00 MiB``,
    ``176 MiB``, ``0.977 GiB``, ``1.20 GiB``): the smallest unit that keeps 3 digits or fewer;
    ``—`` where not finite."""
    if not finite(b):
        return "—"
    if abs(b) < 999.5:
        return f"{b:.0f} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        v = b / scale
        if abs(v) < 999.5 or unit == "TiB":
            break
    a = abs(v)
    digits = 3 if a < 0.9995 else 2 if a < 9.995 else 1 if a < 99.95 else 0
    return f"{v:.{digits}f} {unit}"


def rel_error(predicted: Any, measured: Any) -> float | None:
    """(predicted - measured) / measured, or None when it is not defined."""
    if not (finite(predicted) and finite(measured)) or measured == 0:
        return None
    return (predicted - measured) / measured


def fmt_err(e: float | None) -> str:
    """A relative error (:func:`rel_error`) in percent with its sign, ``—`` for None."""
    return "—" if e is None else f"{e * 100:+.1f}%"


def fmt_shape(shape: Any) -> str:
    """A tensor or mesh shape as ``(8, 4, 16)``, ``—`` for None."""
    return "(" + ", ".join(str(int(n)) for n in shape) + ")" if shape is not None else "—"


# -- SVG helpers -------------------------------------------------------------------------------------
def svg_rect(x: float, y: float, w: float, h: float, colour: str, tip: str) -> str:
    """A filled rectangle (a negative width drawn as 0) with ``tip`` as its tooltip."""
    return (
        f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 0.0):.1f}" height="{h:.1f}" fill="{colour}">'
        f"<title>{escape(tip)}</title></rect>"
    )


def svg_text(x: float, y: float, s: str, anchor: str = "start", size: int = 11) -> str:
    """The text ``s`` at (x, y), anchored ``start``, ``middle`` or ``end``."""
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}">{escape(s)}</text>'


def svg_doc(width: float, height: float, body: list[str], label: str) -> str:
    """An ``<svg>`` element of ``body``'s elements in the charts' font, its size rounded up,
    ``label`` its accessible name."""
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


def svg_legend(x: float, y: float, items: list[tuple[str, str]]) -> tuple[list[str], float]:
    """Swatches and labels in a row from ``x``; the elements and where the row ends."""
    out = []
    for label, colour in items:
        out.append(f'<rect x="{x:.1f}" y="{y - 9:.1f}" width="10" height="10" fill="{colour}"/>')
        out.append(svg_text(x + 14, y, label))
        x += 14 + text_width(label) + 16
    return out, x - 16


def short(s: str, n: int = 36) -> str:
    """``s`` cut to ``n`` characters, its tail replaced by an ellipsis."""
    return s if len(s) <= n else s[: n - 1] + "…"


def short_head(s: str, n: int) -> str:
    """``s`` cut to ``n`` characters, its head replaced by an ellipsis: a module path keeps its
    innermost names."""
    return s if len(s) <= n else "…" + s[len(s) - n + 1 :]


# -- tables ------------------------------------------------------------------------------------------------
def html_table(headers: list[str], rows: list[list[tuple[str, bool]]]) -> str:
    """rows: cells as (already-escaped html, is_numeric)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if num else f"<td>{c}</td>" for c, num in row) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def text_cell(s: Any) -> tuple[str, bool]:
    """A table cell of text (escaped)."""
    return escape(str(s)), False


def num_cell(s: str) -> tuple[str, bool]:
    """A table cell of a formatted number (escaped), right-aligned."""
    return escape(s), True


def dotted_cell(s: str) -> tuple[str, bool]:
    """A dotted name (a module path) that may wrap after each ``.``, never inside a name, so that a
    table of long ones fits the page."""
    return escape(s).replace(".", ".<wbr>"), False


def unbroken_cell(s: str) -> tuple[str, bool]:
    """Text kept on one line (a shape)."""
    return escape(s).replace(" ", "&nbsp;"), False
