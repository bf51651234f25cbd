"""The HTML plan report: written, parseable, escaped, with measured values and candidate charts."""

from __future__ import annotations

import math
from html.parser import HTMLParser

import pytest

from autopar.plan import NodeDecision, Plan, Predicted, SolverInfo
from autopar.report import render_report, write_report
from autopar.report.svg import fmt_time, rel_error

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
    # self-contained: no stylesheet or script from elsewhere, the decisions' filter inline
    assert "link" not in p.tags and p.tags.count("script") == 1 and "<script>" in doc
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
    assert EVIL not in doc
    p = _parse(doc)
    assert p.tags.count("script") == 1  # the decisions' filter, no other
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


# -- the pipeline section ------------------------------------------------------------------------------
def _section(doc: str, heading: str) -> str:
    start = doc.index(f"<h2>{heading}</h2>")
    end = doc.find("<h2>", start + 1)
    return doc[start : end if end >= 0 else len(doc)]


def _svg_root(html: str):
    import xml.etree.ElementTree as ET

    start, end = html.index("<svg"), html.index("</svg>") + len("</svg>")
    return ET.fromstring(html[start:end]), end - start


def _rects(root) -> int:
    return sum(1 for e in root.iter() if e.tag.endswith("}rect") or e.tag == "rect")


@pytest.fixture(scope="module")
def pipelined_plan():
    import autopar
    from autopar.examples import gpt2_tiny

    model, inputs = gpt2_tiny(batch=8, seq=16, layers=4, hidden=32, vocab=128)
    return autopar.plan(
        model, autopar.ClusterSpec.preset("cpu", devices_per_node=4), inputs, pipeline_stages=2,
        mesh_shape=(2,), axis_roles=(autopar.AxisRole.DATA,), schedule="1f1b",
    )  # fmt: skip


def _synthetic(plan: Plan, stages: int, schedule: str, virtual: int, micro_batches: int) -> Plan:
    """``plan`` with a pipeline of ``stages * virtual`` uniform two-block chunks (no planning)."""
    import dataclasses

    from autopar.trades import Pipeline

    chunks = stages * virtual
    costs = tuple(
        {"chunk": c, "rank": c % stages, "blocks": [2 * c, 2 * c + 2], "forward_s": 1e-3, "backward_s": 2e-3,
         "send_s": 1e-4 if c < chunks - 1 else 0.0, "activation_bytes": 2**20, "state_bytes": 2**28,
         "peak_memory_bytes": 2**33}
        for c in range(chunks)
    )  # fmt: skip
    return dataclasses.replace(
        plan,
        pipeline=Pipeline(stages, schedule, virtual, tuple(range(2, 2 * chunks, 2))),
        stage_costs=costs,
        trades=dataclasses.replace(plan.trades, micro_batches=micro_batches),
    )


def test_pipelined_plan_report_has_its_pipeline(pipelined_plan):
    from autopar.cost_model.pipeline import simulate_schedule
    from autopar.report.pipeline import pipeline_timeline

    plan = pipelined_plan
    assert plan.pipeline.stages == 2 and len(plan.stage_costs) == 2
    doc = render_report(plan)
    section = _section(doc, "Pipeline")
    text = " ".join(_parse(section).text)
    assert "2 stages × 1 chunk per rank = 2 chunks" in text and "1f1b" in text
    assert f"{plan.trades.micro_batches} micro-batches" in text and "mesh (2) of 2 devices" in text
    # the table: one row per chunk, blocks first..last
    body = section[section.index("<tbody>") : section.index("</tbody>")]
    assert body.count("<tr>") == plan.pipeline.chunks
    # the 4 blocks as the plan cut them (where depends on the cost model: never a chunk without one)
    (cut,) = plan.pipeline.cuts
    assert 0 < cut < 4
    assert f"<td>0..{cut - 1}</td>" in body and f"<td>{cut}..3</td>" in body
    # the timeline re-simulated from the plan alone, as the search priced it
    costs = sorted(plan.stage_costs, key=lambda c: c["chunk"])
    timeline = simulate_schedule(
        plan.pipeline.schedule, 2, 1, plan.trades.micro_batches, [c["forward_s"] for c in costs],
        [c["backward_s"] for c in costs], [costs[0]["send_s"]], [c["activation_bytes"] for c in costs],
    )  # fmt: skip
    assert pipeline_timeline(plan) == timeline
    assert timeline.makespan <= plan.predicted.step_time_s
    assert f"bubble {timeline.bubble_fraction * 100:.1f}%" in text
    root, _ = _svg_root(section)
    kinds = {e.action.kind for e in timeline.events}
    assert _rects(root) == len(timeline.events) + len(kinds)  # plus the legend's swatches
    tips = [e.text for e in root.iter() if e.tag.endswith("title")]
    assert any(t.startswith(f"F chunk 1 (blocks {cut}..3), micro-batch 0,") for t in tips)
    assert " drawn" not in text  # every action drawn


def test_interleaved_and_zero_bubble_timelines_draw_every_action(pipelined_plan):
    from autopar.report.pipeline import pipeline_timeline

    for schedule in ("interleaved_1f1b", "zero_bubble"):
        plan = _synthetic(pipelined_plan, 2, schedule, 2, 4)
        section = _section(render_report(plan), "Pipeline")
        assert section.count("<tr>") == 4 + 1  # the header and one row per chunk
        timeline = pipeline_timeline(plan)
        kinds = {e.action.kind for e in timeline.events}
        assert kinds == ({"F", "I", "W"} if schedule == "zero_bubble" else {"F", "B"})
        root, _ = _svg_root(section)
        assert _rects(root) == len(timeline.events) + len(kinds)


def test_huge_pipeline_timeline_is_capped():
    """512 micro-batches on 64 stages: 65536 actions; the picture draws the first micro-batches'."""
    from autopar.report.pipeline import TIMELINE_MAX_EVENTS, pipeline_timeline

    plan = _synthetic(_plan(), 64, "1f1b", 1, 512)
    doc = render_report(plan)
    section = _section(doc, "Pipeline")
    assert section.count("<tr>") == 64 + 1
    root, size = _svg_root(section)
    assert size < 2 * 2**20 and len(doc) < 3 * 2**20
    shown = TIMELINE_MAX_EVENTS // 128  # F and B of 64 chunks per micro-batch
    assert _rects(root) == shown * 128 + 2
    assert len(pipeline_timeline(plan).events) == 65536
    labels = " ".join(_parse(section).svg_text[0])
    assert f"micro-batches 0..{shown - 1} of 512 drawn" in labels
    assert f"only those of the first {shown} micro-batches are drawn" in " ".join(_parse(section).text)


def test_pipeline_costs_that_do_not_fit_give_a_note_not_an_error(pipelined_plan):
    import dataclasses

    plan = dataclasses.replace(pipelined_plan, stage_costs=pipelined_plan.stage_costs[:1])
    section = _section(render_report(plan), "Pipeline")
    assert "No timeline" in section and "<svg" not in section


def test_no_pipeline_no_pipeline_section():
    p = _parse(render_report(_plan()))
    assert "Pipeline" not in " ".join(p.text) and p.tags.count("svg") == 3


# -- mesh axes, the placement legend, node names ---------------------------------------------------------
class _Rows(HTMLParser):
    """The text of each row's cells, per <tr>."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self.rows[-1].append("")

    def handle_data(self, data):
        if self.rows and self.rows[-1]:
            self.rows[-1][-1] += data.replace("\xa0", " ")


def _table_rows(html: str) -> list[list[str]]:
    p = _Rows()
    p.feed(html[html.index("<table>") : html.index("</table>")])
    return p.rows[1:]  # less the header


def _mesh_plan(mesh, nodes, per, stages=1, roles=None) -> Plan:
    """``_plan()`` on ``mesh`` (one stage's) of a cluster of ``nodes`` x ``per`` devices."""
    import dataclasses

    from autopar.trades import Pipeline

    n = len(mesh)
    spec = ",".join(["S(0)"] + ["R"] * (n - 1))
    decisions = (
        NodeDecision("w", "placeholder", "param", "lin.weight", (16, 16), spec, (), module="lin"),
        NodeDecision("b", "placeholder", "param", "lin.bias", (16,), ",".join(["R"] * n), (), module="lin"),
        NodeDecision("x", "placeholder", "input", "x", (8, 16), ",".join(["R"] * n), ()),
    )
    cand = {"mesh_shape": list(mesh), "status": "Optimal", "objective": 0.0125}
    if roles is not None:
        cand["axis_roles"] = list(roles)
    return dataclasses.replace(
        _plan(candidates=(cand,)),
        mesh_shape=tuple(mesh),
        decisions=decisions,
        cluster={"name": "c", "nodes": nodes, "devices_per_node": per},
        pipeline=Pipeline(stages, "1f1b", 1, tuple(range(1, stages))),
    )


def _groups_cross_nodes(world_mesh, axis, per) -> bool:
    """Whether some group of ``axis`` holds ranks of two nodes: ranks laid out row-major over the
    whole world's mesh, node ``r // per`` holding rank ``r`` (as torchrun numbers them)."""
    import torch

    ranks = torch.arange(math.prod(world_mesh)).reshape(world_mesh)
    groups = ranks.movedim(axis, -1).reshape(-1, world_mesh[axis])
    return any(len({int(r) // per for r in g}) > 1 for g in groups)


@pytest.mark.parametrize(
    "mesh, nodes, per, stages",
    [((2, 2), 2, 2, 1), ((4, 2), 2, 4, 1), ((2, 2, 2), 2, 4, 1), ((8,), 2, 4, 1), ((2, 4), 1, 8, 1),
     ((4,), 2, 4, 2), ((2,), 4, 2, 4), ((1, 4), 1, 4, 1)],
)  # fmt: skip
def test_axes_table_says_which_axes_cross_nodes(mesh, nodes, per, stages):
    doc = render_report(_mesh_plan(mesh, nodes, per, stages))
    rows = _table_rows(_section(doc, "Mesh axes"))
    world = ((stages,) if stages > 1 else ()) + tuple(mesh)
    assert len(rows) == len(world)
    assert [r[0] for r in rows] == ["pipeline stages"] * (stages > 1) + [
        f"axis {a}" for a in range(len(mesh))
    ]
    for a, row in enumerate(rows):
        assert row[1] == str(world[a])
        assert row[3].startswith("yes") == _groups_cross_nodes(world, a, per), (world, a, row[3])
        if world[a] == 1:
            assert row[3] == "no (one device)"


def test_axes_table_roles_and_what_each_axis_splits():
    doc = render_report(_mesh_plan((2, 2), 2, 2, roles=("data", "tensor")))
    rows = _table_rows(_section(doc, "Mesh axes"))
    assert rows[0][2].startswith("data — data parallel") and rows[1][2].startswith("tensor — tensor parallel")
    # lin.weight is S(0) on axis 0 only; the input is whole; no op reads them
    assert rows[0][4] == "splits no op: 1 of 2 parameters sharded"
    assert rows[1][4] == "splits nothing — every rank runs the whole step"
    # no roles recorded (older plans, a free search): auto; no cluster size: unknown
    plan = _mesh_plan((2,), 1, 2)
    import dataclasses

    plan = dataclasses.replace(plan, cluster={"name": "c"})
    (row,) = _table_rows(_section(render_report(plan), "Mesh axes"))
    assert row[2].startswith("auto — any") and row[3] == "— (cluster size unknown)"


def test_placement_legend_explains_the_notation_the_plan_uses():
    import dataclasses

    section = _section(render_report(_mesh_plan((2, 2), 1, 4)), "Placement notation")
    text = " ".join(_parse(section).text)
    assert "one entry per mesh axis" in text and "S(0),R" in text
    assert [r[0] for r in _table_rows(section)] == ["R", "S(d)", "P"]
    assert "via" not in text
    # an attention run as a ring on axis 1: its algorithm explained
    plan = _plan()
    att = NodeDecision("sdpa", "aten.scaled_dot_product_attention.default", "activation", "", (8, 4, 16), "S(0)",
                       ("S(0)",), 1e-6, 0.0, via="ring")  # fmt: skip
    plan = dataclasses.replace(plan, decisions=plan.decisions + (att,))
    section = _section(render_report(plan), "Placement notation")
    rows = _table_rows(section)
    assert [r[0] for r in rows] == ["R", "S(d)", "P", "via ring"]
    assert "ring" in rows[-1][1]
    assert "via ring" in _section(render_report(plan), "All decisions (8)")


def test_nodes_named_by_module_and_op_with_the_graph_name_in_the_tooltip():
    import dataclasses

    plan = _plan()
    decisions = tuple(
        dataclasses.replace(d, module="model.layers.27.mlp.down_proj") if d.name == "linear_2" else d
        for d in plan.decisions
    )
    doc = render_report(dataclasses.replace(plan, decisions=decisions))
    chart = " ".join(_parse(doc).svg_text[1])
    assert "model.layers.27.mlp.down_proj · linear" in chart
    assert "(node linear_2, aten.linear.default)" in chart  # the label's tooltip
    assert "embedding_1" in chart  # no module recorded: its graph name
    section = _section(doc, "All decisions (7)")
    block = section[section.index('data-names="model.layers.27"') :]
    # in its block's group: named within the block, the op by its short name, the full one its tooltip
    assert _table_rows(block)[0][:2] == ["linear_2", "mlp.down_proj · linear"]
    assert 'title="aten.linear.default"' in block.split("</table>")[0]
    model_rows = _table_rows(section)  # the model's own group first: its inputs, its module-less ops
    assert [r[0] for r in model_rows] == ["w_embed", "w_proj", "x_in", "embedding_1", "add_evil", "loss_out"]
    assert model_rows[3][1] == "embedding" and model_rows[0][1] == "embed.weight (param)"


def test_long_labels_are_cut_from_the_head_and_charts_widen_for_them():
    from autopar.report import NODE_LABEL_CHARS, node_label, op_name
    from autopar.report.svg import text_width

    assert op_name("aten.linear.default") == "linear" and op_name("<built-in function getitem>") == "getitem"
    assert op_name("autopar.fused_rms_norm.default") == "fused_rms_norm"
    long = "model." + ".".join(f"block_{i}" for i in range(40))
    d = NodeDecision("mm_9", "aten.mm.default", "activation", "", (4, 4), "R", (), module=long)
    assert node_label(d) == f"{long} · mm"
    import dataclasses

    plan = dataclasses.replace(_plan(), decisions=(d,))
    root, _ = _svg_root(_section(render_report(plan), "Top 1 nodes by predicted time"))
    label = next(e for e in root.iter() if e.tag.endswith("text") and e.get("text-anchor") == "end")
    shown = label.text
    assert len(shown) == NODE_LABEL_CHARS and shown.startswith("…") and shown.endswith("block_39 · mm")
    # the label column holds it: it ends at the column's edge and starts inside the chart
    assert float(label.get("x")) - text_width(shown) >= 0


def test_a_section_whose_data_the_plan_lacks_says_so_and_the_rest_renders():
    """A hand-edited plan file: one candidate not a record, pipeline chunks without their costs."""
    import dataclasses

    plan = dataclasses.replace(_plan(), solver=dataclasses.replace(_plan().solver, candidates=("(2)",)))
    doc = render_report(plan)
    section = _section(doc, "Candidate mesh shapes")
    assert "This section is missing: the plan lacks the data it needs (AttributeError" in section
    text = " ".join(_parse(doc).text)
    for heading in ("Summary", "Mesh axes", "Parameter placements", "All decisions (7)"):
        assert heading in text, heading
    assert text.count("This section is missing") == 1


# -- layout on real-sized plans: units, memory parts, the pipeline's step, the candidates, the decisions --
@pytest.mark.parametrize(
    "b, want",
    [(512, "512 B"), (4096, "4.00 KiB"), (5 * 2**20, "5.00 MiB"), (184784386, "176 MiB"),
     (1000 * 2**20, "0.977 GiB"), (1.2 * 2**30, "1.20 GiB"), (12345 * 2**20, "12.1 GiB"), (None, "—")],
)  # fmt: skip
def test_fmt_bytes_three_significant_digits(b, want):
    from autopar.report.svg import fmt_bytes

    assert fmt_bytes(b) == want


def test_collectives_and_memory_in_binary_units():
    import dataclasses

    from autopar.plan import PlannedCollective, Site
    from autopar.reshard import Collective, Phase

    plan = _plan()
    big = PlannedCollective(Collective.ALL_REDUCE, 0, 47_710_208.0, Phase.BACKWARD, Site.BUCKET, 31)
    decisions = tuple(
        dataclasses.replace(d, collectives=(big,)) if d.name == "linear_2" else d for d in plan.decisions
    )
    predicted = dataclasses.replace(
        plan.predicted, peak_memory_bytes=12345 * 2**20, activation_bytes=12340 * 2**20
    )
    doc = render_report(dataclasses.replace(plan, decisions=decisions, predicted=predicted))
    assert "all_reduce@0 backward (bucket 31) 45.5 MiB" in doc and "47710208" not in doc
    summary = " ".join(_parse(_section(doc, "Summary")).text)
    assert "12.1 GiB" in summary and "12345" not in summary


def test_memory_parts_add_up_to_the_peak_and_name_the_rest():
    import dataclasses

    from autopar.report.memory import REST_PLAIN, memory_parts

    plan = _plan()
    predicted = dataclasses.replace(plan.predicted, peak_memory_bytes=9 * 2**20)  # 4 MiB beyond the parts
    m = memory_parts(dataclasses.replace(plan, predicted=predicted))
    assert sum(b for _, b, _ in m.parts) == m.peak == 9 * 2**20
    assert m.parts[-1][:2] == (REST_PLAIN, 4 * 2**20) and m.rank is None
    doc = render_report(dataclasses.replace(plan, predicted=predicted))
    section = _section(doc, "Predicted memory per device")
    assert f"{REST_PLAIN} 4.00 MiB" in " ".join(_parse(section).svg_text[0])
    assert "each device" in section
    summary = [r[:2] for r in _table_rows(_section(doc, "Summary"))]
    assert [f"· {REST_PLAIN}", "4.00 MiB"] in summary


def test_pipelined_memory_names_the_fullest_rank_and_its_working_memory(pipelined_plan):
    from autopar.report.memory import REST_PIPELINE, memory_parts, pipeline_rank_peaks

    plan = pipelined_plan
    m = memory_parts(plan)
    peaks = pipeline_rank_peaks(plan)
    assert len(peaks) == 2 and max(peaks) == pytest.approx(plan.predicted.peak_memory_bytes, abs=1)
    assert m.rank == peaks.index(max(peaks))
    assert (
        sum(b for _, b, _ in m.parts) == pytest.approx(m.peak) and m.peak == plan.predicted.peak_memory_bytes
    )
    assert [label for label, _, _ in m.parts][:4] == ["params", "grads", "optimizer", "activations"]
    section = _section(render_report(plan), "Predicted memory per device")
    text = " ".join(_parse(section).text)
    per = plan.mesh_shape[0]
    assert (
        f"pipeline rank {m.rank} (global ranks {m.rank * per}..{m.rank * per + per - 1}), the fullest of the 2"
        in text
    )
    if len(m.parts) == 5:
        assert m.parts[4][0] == REST_PIPELINE
    summary = _table_rows(_section(render_report(plan), "Summary"))
    assert f"peak memory of pipeline rank {m.rank} (the fullest)" in [r[0] for r in summary]


def test_the_pipelined_step_is_the_makespan_plus_what_runs_once(pipelined_plan):
    import dataclasses

    from autopar.report.pipeline import pipeline_timeline, step_from_makespan
    from autopar.report.svg import fmt_ms

    plan = pipelined_plan
    t = pipeline_timeline(plan)
    rest = plan.predicted.step_time_s - t.makespan
    text = " ".join(_parse(_section(render_report(plan), "Pipeline")).text)
    want = (
        f"predicted step {fmt_ms(plan.predicted.step_time_s)} = the schedule's makespan {fmt_ms(t.makespan)}"
    )
    assert want in text and f"+ {fmt_ms(rest)} once per step" in text
    # a step the whole model's adjustments made shorter than the makespan says so, and why
    shorter = dataclasses.replace(
        plan, predicted=dataclasses.replace(plan.predicted, step_time_s=t.makespan * 0.97)
    )
    line = step_from_makespan(shorter, t)
    assert f"− {fmt_ms(t.makespan * 0.03)} once per step" in line
    assert "the step is shorter than the makespan" in line and "reshards several ops share" in line


def test_zero_stage_0_says_no_zero():
    rows = _table_rows(_section(render_report(_plan()), "Memory-for-time trades"))
    zero = next(r for r in rows if r[0] == "ZeRO")
    assert zero[1].startswith("no ZeRO") and "stage 0" not in zero[1] and "—" not in zero[1]


def test_many_candidates_wrap_into_rows_with_whole_labels():
    from autopar.report import CHART_MAX_W

    cands = tuple(
        {"mesh_shape": [2, 2, 4], "status": "same as (2, 4, 2)" if i % 3 else "Optimal",
         "objective": 0.01 * (i + 1) if not i % 3 else None, "axis_roles": ["data", "auto", "auto"],
         "trades": {"zero_stage": 3, "recompute": "selective", "micro_batches": 16, "offload": "optimizer"},
         "pipeline": {"stages": 8}}
        for i in range(40)
    )  # fmt: skip
    doc = render_report(_plan(candidates=cands))
    root, _ = _svg_root(_section(doc, "Candidate mesh shapes"))
    assert float(root.get("width")) <= CHART_MAX_W
    labels = [e.text for e in root.iter() if e.tag.endswith("text")]
    assert labels.count("same as (2, 4, 2)") == 26 and labels.count("D/A/A P8 Z3 Rs k16 off") == 40
    assert not any("…" in t for t in labels)


def _block_plan(layers: int, odd: int | None = None) -> Plan:
    """``_plan()`` with ``layers`` repeated blocks of a linear and its weight; block ``odd``'s
    weight placed otherwise."""
    import dataclasses

    plan = _plan()
    decisions = list(plan.decisions)
    for i in range(layers):
        spec = "S(0)" if i == odd else "R"
        decisions += [
            NodeDecision(f"p_layers_{i}_fc_weight", "placeholder", "param", f"model.layers.{i}.fc.weight", (16, 16),
                         spec, (), 1e-6, 0.0, module=f"model.layers.{i}.fc"),
            NodeDecision(f"linear_{10 + i}", "aten.linear.default", "activation", "", (8, 4, 16), "S(0)",
                         ("S(0)", spec), 2e-6, 0.0, module=f"model.layers.{i}.fc"),
        ]  # fmt: skip
    return dataclasses.replace(plan, decisions=tuple(decisions))


def test_decisions_grouped_alike_blocks_as_one_with_a_filter():
    from autopar.report.decisions import decision_groups

    plan = _block_plan(12, odd=5)
    groups = decision_groups(plan)
    assert [g.members for g in groups] == [
        [""], ["model.layers.0", *(f"model.layers.{i}" for i in range(1, 5)), *(f"model.layers.{i}" for i in range(6, 12))],
        ["model.layers.5"],
    ]  # fmt: skip
    assert sum(len(g.rows) * len(g.members) for g in groups) == len(plan.decisions)
    section = _section(render_report(plan), f"All decisions ({len(plan.decisions)})")
    text = " ".join(_parse(section).text)
    assert "model.layers.{0..4, 6..11}: 11 blocks with the same decisions, model.layers.0's shown" in text
    assert section.count('<details class="dg"') == 3 and '<details class="dg" open' not in section
    assert 'id="decision-filter"' in section and "<script>" in section
    # names break only between the names of a path, never inside one
    assert "_<wbr>" not in render_report(plan)
    rows = _table_rows(section[section.index('data-names="model.layers.5"') :])
    assert rows[0][:2] == ["p_layers_5_fc_weight", "fc.weight (param)"] and rows[1][1] == "fc · linear"


def test_decisions_of_a_pipelined_plan_say_which_chunk_and_rank(pipelined_plan):
    from autopar.report.decisions import decision_groups

    plan = pipelined_plan
    (cut,) = plan.pipeline.cuts
    groups = decision_groups(plan)
    seen = set()
    for g in groups:
        blocks = [m for m in g.members if m.startswith("transformer.h.")]
        want = {0 if int(m.rsplit(".", 1)[1]) < cut else 1 for m in blocks}
        assert g.chunks == want or not blocks, (g.members, g.chunks)
        seen |= set(blocks)
    assert seen == {f"transformer.h.{i}" for i in range(4)}
    assert groups[0].members == [""] and not groups[0].chunks  # the model's own nodes: no one chunk
    assert "lm_head" in groups[-1].members[0] and groups[-1].chunks == {1}  # the head: with the last block
    text = " ".join(_parse(render_report(plan)).text)
    assert "chunk 1 on pipeline rank 1" in text
