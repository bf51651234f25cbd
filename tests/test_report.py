"""The HTML plan report: written, parseable, escaped, with measured values and candidate charts."""

from __future__ import annotations

import math
from html.parser import HTMLParser

import pytest

from autopar.plan import NodeDecision, Plan, Predicted, SolverInfo
from autopar.report import fmt_time, rel_error, render_report, write_report

EVIL = "<script>alert(1)</script>"


class _Collect(HTMLParser):
    """Records start tags, all text, and the text of the <text> labels inside each <svg>."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []
        self.svg_text: list[list[str]] = []
        self._svg_depth = 0
        self._in_label = False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "svg":
            if self._svg_depth == 0:
                self.svg_text.append([])
            self._svg_depth += 1
        elif tag == "text" and self._svg_depth:
            self._in_label = True

    def handle_endtag(self, tag):
        if tag == "svg":
            self._svg_depth -= 1
        elif tag == "text":
            self._in_label = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_label:
            self.svg_text[-1].append(data)


def _parse(doc: str) -> _Collect:
    p = _Collect()
    p.feed(doc)
    p.close()
    return p


def _plan(candidates=None, evil_name: str = "add_evil") -> Plan:
    decisions = (
        NodeDecision("w_embed", "placeholder", "param", "embed.weight", (64, 16), "S(0)", (), 0.0, 0.0),
        NodeDecision("w_proj", "placeholder", "param", "proj.weight", (16, 16), "R", (), 0.0, 0.0),
        NodeDecision("x_in", "placeholder", "input", "x", (8, 4), "S(0)", (), 0.0, 0.0),
        NodeDecision(
            "embedding_1",
            "aten.embedding.default",
            "activation",
            "",
            (8, 4, 16),
            "S(0)",
            ("S(0)", "S(0)"),
            2.0e-4,
            0.0,
        ),
        NodeDecision(
            "linear_2",
            "aten.linear.default",
            "activation",
            "",
            (8, 4, 16),
            "S(0)",
            ("S(0)", "R"),
            5.0e-4,
            3.0e-4,
            ("all_reduce@0 4096B",),
        ),
        NodeDecision(
            evil_name, "aten.add.Tensor", "activation", "", (8, 4, 16), "S(0)", ("S(0)", "S(0)"), 1e-6, 0.0
        ),
        NodeDecision("loss_out", "aten.mean.default", "output", "loss", (), "R", ("S(0)",), 1e-6, 2e-5),
    )
    if candidates is None:
        candidates = (
            {"mesh_shape": [2], "status": "Optimal", "objective": 0.0125},
            {"mesh_shape": [1], "status": "Infeasible", "objective": math.inf},
        )
    return Plan(
        fingerprint="f" * 64,
        model="TinyNet",
        cluster={"name": "test-cluster", "nodes": 1, "devices_per_node": 2},
        mesh_shape=(2,),
        decisions=decisions,
        predicted=Predicted(
            step_time_s=0.0125,
            peak_memory_bytes=5 * 2**20,
            compute_s=0.010,
            comm_s=0.0025,
            param_bytes=1 * 2**20,
            grad_bytes=1 * 2**20,
            optimizer_bytes=2 * 2**20,
            activation_bytes=1 * 2**20,
        ),
        solver=SolverInfo("PULP_CBC_CMD", "Optimal", 0.0125, 0.37, 40, 55, tuple(candidates)),
    )


def test_file_written_and_parses_with_svg_and_node_names(tmp_path):
    out = write_report(_plan(), tmp_path / "sub" / "report.html")
    assert out == tmp_path / "sub" / "report.html"
    assert out.is_file()
    doc = out.read_text(encoding="utf-8")
    assert doc == render_report(_plan())
    p = _parse(doc)
    assert p.tags.count("svg") == 3  # memory, top nodes, candidates
    assert "link" not in p.tags and "script" not in p.tags  # self-contained
    text = " ".join(p.text)
    for header in ("TinyNet", "test-cluster", "1 × 2 = 2 devices", "(2)", "PULP_CBC_CMD", "Optimal"):
        assert header in text, header
    node_chart = " ".join(p.svg_text[1])
    for name in ("embedding_1", "linear_2", "loss_out"):
        assert name in node_chart, name
    # the most expensive node is listed first in the node chart
    assert node_chart.index("linear_2") < node_chart.index("embedding_1")
    # predicted summary numbers with units
    assert "12.500 ms" in text and "5.00 MiB" in text and "2.00 MiB" in text
    # parameter placements table
    assert "embed.weight" in text and "proj.weight" in text
    assert "all_reduce@0 4096B" in text


def test_names_are_escaped(tmp_path):
    doc = write_report(_plan(evil_name=EVIL), tmp_path / "r.html", title=f"T {EVIL}").read_text()
    assert "<script>" not in doc
    p = _parse(doc)
    assert "script" not in p.tags
    assert EVIL in " ".join(p.text)  # shown, as text
    assert EVIL in " ".join(p.svg_text[1])  # and as a label in the node chart


def test_measured_values_and_relative_error():
    plain = render_report(_plan())
    doc = render_report(
        _plan(),
        measured={
            "step_time_s": 0.010,
            "peak_memory_bytes": 4 * 2**20,
            "world_size": 2,
            "tokens_per_s": 1234.5,
        },
    )
    text = " ".join(_parse(doc).text)
    assert "10.000 ms" in text and "4.00 MiB" in text
    # (12.5 - 10) / 10 = +25%; (5 - 4) / 4 = +25% as well; check both are there
    assert text.count("+25.0%") == 2
    assert "tokens_per_s" in text and "1234.5" in text
    assert "mismatch" not in text
    assert "+25.0%" not in plain and "tokens_per_s" not in plain
    assert "measured" not in " ".join(_parse(plain).text)
    wrong_world = render_report(_plan(), measured={"step_time_s": 0.010, "world_size": 4})
    assert "mismatch" in " ".join(_parse(wrong_world).text)


def test_candidates_chart():
    doc = render_report(
        _plan(
            candidates=(
                {"mesh_shape": [2], "status": "Optimal", "objective": 0.0125},
                {"mesh_shape": [1], "status": "Infeasible", "objective": None},
                {"mesh_shape": [7], "status": "Optimal", "objective": 0.02},
            )
        )
    )
    p = _parse(doc)
    chart = " ".join(p.svg_text[2])
    assert "(2) ★" in chart  # the chosen mesh, highlighted
    assert "(1)" in chart and "infeasible" in chart
    assert "(7)" in chart and "(7) ★" not in chart
    assert "20.000 ms" in chart
    assert doc.count('fill="#e45756"><title>mesh') == 1  # one highlighted bar


def test_no_candidates_no_chart_and_tolerant_cluster():
    plan = _plan(candidates=())
    plan = Plan(
        **{
            **{
                f: getattr(plan, f)
                for f in ("fingerprint", "model", "mesh_shape", "decisions", "predicted", "solver")
            },
            "cluster": {},
        }
    )
    p = _parse(render_report(plan))
    assert p.tags.count("svg") == 2
    assert "Candidate mesh shapes" not in " ".join(p.text)
    assert "size unknown" in " ".join(p.text)


@pytest.mark.parametrize(
    "s, want", [(0.0125, "12.500 ms"), (2.5, "2.500 s"), (3e-6, "3.000 µs"), (math.inf, "∞"), (None, "—")]
)
def test_fmt_time(s, want):
    assert fmt_time(s) == want


def test_rel_error():
    assert rel_error(12.0, 10.0) == pytest.approx(0.2)
    assert rel_error(1.0, 0.0) is None
    assert rel_error(None, 1.0) is None
