"""Tests for autopar.plan: the Plan value, its JSON form, its errors, and reading it back as strategies."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopar
import autopar.examples
from autopar.errors import PlanFormatError
from autopar.passes.replay import choice_from_plan
from autopar.passes.trace import trace
from autopar.placement import Outputs, spec_from_str
from autopar.plan import SCHEMA_VERSION, NodeDecision, Plan, PlannedCollective, Predicted, Site, SolverInfo
from autopar.reshard import Collective, Phase

# ------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def mlp():
    return autopar.examples.mlp(batch=8, hidden=16, ffn=32)


@pytest.fixture(scope="module")
def cpu2():
    return autopar.ClusterSpec.preset("cpu", devices_per_node=2)


@pytest.fixture(scope="module")
def real_plan(mlp, cpu2):
    model, inputs = mlp
    return autopar.plan(model, cpu2, inputs)


def _tiny_plan(**over) -> Plan:
    """A hand-built one-axis plan with two decisions."""
    kw = dict(
        fingerprint="f" * 64,
        model="Tiny",
        cluster={"name": "cpu"},
        mesh_shape=(2,),
        decisions=(
            NodeDecision("w", "placeholder", "param", "lin.weight", (4, 4), "S(0)", ()),
            NodeDecision("mm", "aten.mm.default", "activation", "", (4, 4), "R", ("R", "S(0)"), 1e-6, 2e-6),
        ),
        predicted=Predicted(1e-3, 1024, 5e-4, 5e-4, 64, 64, 128, 768),
        solver=SolverInfo("PULP_CBC_CMD", "Optimal", 1e-3, 0.01),
    )
    kw.update(over)
    return Plan(**kw)


# ------------------------------------------------------------------------------------------ a real plan


def test_real_plan_save_load_roundtrip(real_plan, tmp_path):
    path = tmp_path / "plan.json"
    real_plan.save(path)
    loaded = Plan.load(path)
    assert loaded == real_plan
    assert loaded is not real_plan
    # the file is plain JSON with the documented top-level keys
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION == 4
    assert set(data) == {
        "schema_version", "fingerprint", "model", "cluster", "mesh_shape", "decisions", "predicted", "outputs",
        "trades", "trade_costs", "pipeline", "stage_costs", "solver", "kernels", "overlap_matmuls",
    }  # fmt: skip
    assert data["overlap_matmuls"] is False  # auto: off on CPU ranks (nothing overlaps there)
    # a loaded plan still answers lookups (the private index is rebuilt)
    for d in real_plan.decisions:
        assert loaded[d.name] == d


def test_real_plan_fields(real_plan, cpu2, mlp):
    model, _ = mlp
    # world size 2 with at most 2 mesh axes has the single candidate mesh (2,)
    assert real_plan.mesh_shape == (2,)
    assert real_plan.world_size == 2 == cpu2.world_size
    assert real_plan.model == type(model).__name__ == "MLP"
    assert real_plan.cluster == cpu2.to_dict()
    assert len(real_plan.fingerprint) == 64 and int(real_plan.fingerprint, 16) >= 0  # sha256 hex
    p = real_plan.predicted
    assert p.step_time_s > 0
    assert p.peak_memory_bytes > 0
    # four parameters: up (32x16 + 32) and down (16x32 + 16), fp32; at most the replicated size per device
    param_bytes_full = (32 * 16 + 32 + 16 * 32 + 16) * 4
    assert 0 < p.param_bytes <= param_bytes_full
    assert p.peak_memory_bytes >= p.param_bytes + p.grad_bytes + p.optimizer_bytes
    assert real_plan.solver.candidates and real_plan.solver.candidates[0]["mesh_shape"] == [2]


def test_real_plan_decision_lookup(real_plan):
    names = [d.name for d in real_plan.decisions]
    assert len(names) == len(set(names)), "decision names must be unique"
    assert "linear" in names and "linear_1" in names
    for d in real_plan.decisions:
        assert real_plan.decision(d.name) is d
        assert real_plan[d.name] is d
        assert len(d.output_spec) == len(real_plan.mesh_shape)
    with pytest.raises(KeyError, match="no_such_node"):
        real_plan.decision("no_such_node")
    with pytest.raises(KeyError, match="another_missing"):
        real_plan["another_missing"]


def test_real_plan_parameter_placements(real_plan, mlp):
    model, _ = mlp
    placements = real_plan.parameter_placements
    assert set(placements) == set(dict(model.named_parameters())) == {
        "up.weight", "up.bias", "down.weight", "down.bias",
    }  # fmt: skip
    for fqn, text in placements.items():
        spec = spec_from_str(text)
        assert len(spec) == len(real_plan.mesh_shape), fqn
    shapes = {d.target: d.shape for d in real_plan.decisions if d.role == "param"}
    assert shapes == {"up.weight": (32, 16), "up.bias": (32,), "down.weight": (16, 32), "down.bias": (16,)}


def test_real_plan_names_each_nodes_module(real_plan, mlp):
    """Each decision says where in the model it runs: the linears and their parameters the
    model's own submodules, the loss (computed in the model's forward) the model itself ("")."""
    model, _ = mlp
    modules = {name for name, _ in model.named_modules()}
    by_op = {}
    for d in real_plan.decisions:
        assert d.module in modules, (d.name, d.module)
        by_op.setdefault(d.op, set()).add(d.module)
    linears = {op: m for op, m in by_op.items() if "linear" in op or "addmm" in op}
    assert set().union(*linears.values()) == {"up", "down"}
    params = {d.target: d.module for d in real_plan.decisions if d.role == "param"}
    assert params == {"up.weight": "up", "up.bias": "up", "down.weight": "down", "down.bias": "down"}
    assert "" in by_op["aten.mse_loss.default"]
    assert {d.module for d in real_plan.decisions if d.role == "input"} == {""}


def test_a_plan_saved_without_modules_loads_with_none():
    """Plans saved before NodeDecision.module load, each module unknown ("")."""
    data = _tiny_plan(decisions=(
        NodeDecision("w", "placeholder", "param", "lin.weight", (4, 4), "S(0)", (), module="lin"),
    )).to_dict()  # fmt: skip
    assert data["decisions"][0]["module"] == "lin"
    del data["decisions"][0]["module"]
    assert Plan.from_dict(data).decisions[0].module == ""


def test_summary_mentions_parameters(real_plan):
    text = real_plan.summary()
    assert "MLP" in text
    for fqn in ("up.weight", "up.bias", "down.weight", "down.bias"):
        assert fqn in text


# ------------------------------------------------------------------------------------------ JSON round trip (hypothesis)

_placement = st.sampled_from(["R", "P", "S(0)", "S(1)", "S(2)", "S(3)"])
_time = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
_count = st.integers(min_value=0, max_value=2**40)
_text = st.text(min_size=0, max_size=12)
_collective = st.builds(
    lambda kind, axis, nbytes, phase, site, bucket: PlannedCollective(
        kind, axis, nbytes, phase, site, bucket if site is Site.BUCKET else None
    ),
    st.sampled_from(list(Collective)),
    st.integers(0, 2),
    _time,
    st.sampled_from(list(Phase)),
    st.sampled_from(list(Site)),
    st.integers(0, 100),
)


@st.composite
def _plans(draw) -> Plan:
    ndim = draw(st.integers(min_value=1, max_value=3))
    mesh = tuple(draw(st.lists(st.integers(1, 8), min_size=ndim, max_size=ndim)))
    spec = st.lists(_placement, min_size=ndim, max_size=ndim).map(",".join)
    names = draw(st.lists(st.text(min_size=1, max_size=10), max_size=6, unique=True))
    decisions = tuple(
        NodeDecision(
            name=name,
            op=draw(_text),
            role=draw(st.sampled_from(["param", "buffer", "input", "activation", "output"])),
            target=draw(_text),
            shape=tuple(draw(st.lists(st.integers(0, 4096), max_size=4))),
            output=draw(spec),
            inputs=tuple(draw(st.lists(spec, max_size=3))),
            compute_s=draw(_time),
            comm_s=draw(_time),
            collectives=tuple(draw(st.lists(_collective, max_size=3))),
            module=draw(_text),
        )
        for name in names
    )
    predicted = Predicted(
        step_time_s=draw(_time),
        peak_memory_bytes=draw(_count),
        compute_s=draw(_time),
        comm_s=draw(_time),
        param_bytes=draw(_count),
        grad_bytes=draw(_count),
        optimizer_bytes=draw(_count),
        activation_bytes=draw(_count),
    )
    solver = SolverInfo(
        name=draw(_text),
        status=draw(st.sampled_from(["Optimal", "Not Solved", "Infeasible"])),
        objective=draw(_time),
        solve_time_s=draw(_time),
        num_variables=draw(_count),
        num_constraints=draw(_count),
        candidates=tuple(
            {"mesh_shape": list(mesh), "status": "Optimal", "objective": draw(_time)}
            for _ in range(draw(st.integers(0, 2)))
        ),
    )
    return Plan(
        fingerprint=draw(st.text(alphabet="0123456789abcdef", min_size=0, max_size=64)),
        model=draw(_text),
        cluster={"name": draw(_text), "nodes": draw(st.integers(1, 8))},
        mesh_shape=mesh,
        decisions=decisions,
        predicted=predicted,
        solver=solver,
        outputs=draw(st.sampled_from([o.value for o in Outputs])),
        overlap_matmuls=draw(st.booleans()),
    )


@settings(max_examples=150, deadline=None)
@given(_plans())
def test_json_roundtrip(p):
    back = Plan.from_dict(json.loads(json.dumps(p.to_dict())))
    assert back == p
    assert back.mesh_shape == p.mesh_shape and isinstance(back.mesh_shape, tuple)
    for d in p.decisions:
        assert back[d.name] == d
        assert isinstance(back[d.name].shape, tuple) and isinstance(back[d.name].inputs, tuple)
    assert back.world_size == p.world_size


def test_equality_is_sensitive_to_each_part():
    base = _tiny_plan()
    assert _tiny_plan() == base
    assert _tiny_plan(fingerprint="0" * 64) != base
    assert _tiny_plan(mesh_shape=(2,), decisions=base.decisions[:1]) != base
    changed = dataclasses.replace(base.decisions[1], output="S(1)")
    assert _tiny_plan(decisions=(base.decisions[0], changed)) != base
    assert _tiny_plan(predicted=dataclasses.replace(base.predicted, step_time_s=2e-3)) != base


def test_outputs_mode_defaults_to_full_for_older_plans_and_rejects_unknown_modes():
    data = _tiny_plan().to_dict()
    assert data["outputs"] == "full"
    del data["outputs"]  # a plan saved before the option
    assert Plan.from_dict(data).outputs == "full"
    with pytest.raises(PlanFormatError, match="outputs must be one of"):
        Plan.from_dict({**data, "outputs": "sharded"})


def test_overlap_matmuls_is_off_for_older_plans_and_must_be_a_bool():
    """A plan saved before collective matmuls was priced without them: its module runs none."""
    data = _tiny_plan(overlap_matmuls=True).to_dict()
    assert data["overlap_matmuls"] is True and Plan.from_dict(data).overlap_matmuls is True
    del data["overlap_matmuls"]
    assert Plan.from_dict(data).overlap_matmuls is False
    assert "collective matmuls" in _tiny_plan(overlap_matmuls=True).summary()
    assert "collective matmuls" not in _tiny_plan().summary()
    with pytest.raises(PlanFormatError, match="overlap_matmuls must be true or false"):
        _tiny_plan(overlap_matmuls="yes")


# ------------------------------------------------------------------------------------------ errors


def test_load_not_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{ this is not json")
    with pytest.raises(autopar.PlanFormatError, match="not a JSON plan file"):
        Plan.load(path)


def test_load_json_but_not_a_plan(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(autopar.PlanFormatError):
        Plan.load(path)
    path.write_text(json.dumps({"schema_version": 1}))  # missing everything else
    with pytest.raises(autopar.PlanFormatError):
        Plan.load(path)


def test_schema_version_999(tmp_path):
    data = _tiny_plan().to_dict()
    data["schema_version"] = 999
    with pytest.raises(autopar.PlanFormatError, match="schema_version") as e:
        Plan.from_dict(data)
    assert "999" in str(e.value)
    path = tmp_path / "future.json"
    path.write_text(json.dumps(data))
    with pytest.raises(autopar.PlanFormatError, match="schema_version"):
        Plan.load(path)
    with pytest.raises(autopar.PlanFormatError, match="schema_version"):
        _tiny_plan(schema_version=999)


@pytest.mark.parametrize("bad", ["X(1)", "S(x)", "", "R;R", "Shard(0)"])
def test_bad_placement_text(bad):
    data = _tiny_plan().to_dict()
    data["decisions"][1]["output"] = bad
    with pytest.raises((ValueError, autopar.PlanFormatError), match="placement"):
        Plan.from_dict(data)
    data = _tiny_plan().to_dict()
    data["decisions"][1]["inputs"] = ["R", bad]
    with pytest.raises((ValueError, autopar.PlanFormatError), match="placement"):
        Plan.from_dict(data)
    with pytest.raises((ValueError, autopar.PlanFormatError)):
        NodeDecision("n", "op", "activation", "", (2,), bad, ())


def test_wrong_number_of_mesh_axes():
    data = _tiny_plan().to_dict()  # mesh (2,)
    data["decisions"][0]["output"] = "S(0),R"
    with pytest.raises(autopar.PlanFormatError, match="axes"):
        Plan.from_dict(data)
    data = _tiny_plan().to_dict()
    data["mesh_shape"] = [2, 2]  # every placement now has one axis too few
    with pytest.raises(autopar.PlanFormatError, match="axes"):
        Plan.from_dict(data)


def test_wrong_number_of_mesh_axes_in_inputs():
    data = _tiny_plan().to_dict()  # mesh (2,)
    data["decisions"][1]["inputs"] = ["R", "S(0),R"]
    with pytest.raises(autopar.PlanFormatError, match="'S\\(0\\),R' has 2 axes"):
        Plan.from_dict(data)


@pytest.mark.parametrize("mesh", [(), (0,), (2, -1)])
def test_bad_mesh_shape(mesh):
    with pytest.raises(autopar.PlanFormatError, match="mesh_shape"):
        _tiny_plan(mesh_shape=mesh, decisions=())


def test_negative_times_rejected():
    with pytest.raises(autopar.PlanFormatError, match="negative"):
        NodeDecision("n", "op", "activation", "", (2,), "R", (), compute_s=-1.0)
    with pytest.raises(autopar.PlanFormatError, match="negative"):
        NodeDecision("n", "op", "activation", "", (2,), "R", (), comm_s=-1e-9)
    with pytest.raises(autopar.PlanFormatError):
        Predicted(-1.0, 0, 0, 0, 0, 0, 0, 0)


def test_check_matches(real_plan):
    real_plan.check_matches(real_plan.fingerprint, real_plan.world_size)  # no error
    with pytest.raises(autopar.PlanMismatchError, match="different model"):
        real_plan.check_matches("other-fingerprint", real_plan.world_size)
    n = real_plan.world_size
    with pytest.raises(autopar.PlanMismatchError) as e:
        real_plan.check_matches(real_plan.fingerprint, n + 1)
    msg = str(e.value)
    assert f"{n} devices" in msg
    assert f"has {n + 1}" in msg


# ------------------------------------------------------------------------------------------ choice_from_plan


def test_choice_from_plan_covers_every_node(real_plan, mlp):
    model, inputs = mlp
    traced = trace(model, inputs)
    choice = choice_from_plan(traced, real_plan)
    expected = {n.name for n in traced.graph.nodes if n.op in ("placeholder", "call_function")}
    assert expected and set(choice) == expected
    for name, s in choice.items():
        d = real_plan[name]
        assert s.out == spec_from_str(d.output)
        assert s.ins == tuple(spec_from_str(x) for x in d.inputs)


def test_choice_from_plan_rejects_hand_edited_linear(real_plan, mlp):
    model, inputs = mlp
    traced = trace(model, inputs)
    d = real_plan["linear"]
    assert d.op == "aten.linear.default" and len(d.inputs) == 3
    # output sharded on the batch dim needs the activation input sharded too; "R,R,R" matches no rule
    bad = dataclasses.replace(d, output="S(0)", inputs=("R", "R", "R"))
    decisions = tuple(bad if x.name == "linear" else x for x in real_plan.decisions)
    edited = dataclasses.replace(real_plan, decisions=decisions)
    assert edited["linear"].output == "S(0)"
    with pytest.raises(autopar.PlanFormatError, match=r"node linear \("):
        choice_from_plan(traced, edited)


def test_choice_from_plan_missing_decision(real_plan, mlp):
    model, inputs = mlp
    traced = trace(model, inputs)
    decisions = tuple(x for x in real_plan.decisions if x.name != "gelu")
    edited = dataclasses.replace(real_plan, decisions=decisions)
    with pytest.raises(autopar.PlanFormatError, match="gelu"):
        choice_from_plan(traced, edited)


# ------------------------------------------------------------------------------------------ fingerprint


def test_fingerprint_stable_and_shape_sensitive():
    m8, in8 = autopar.examples.mlp(batch=8, hidden=16, ffn=32)
    fp_a = trace(m8, in8).fingerprint()
    fp_b = trace(m8, in8).fingerprint()
    assert fp_a == fp_b
    m8b, in8b = autopar.examples.mlp(batch=8, hidden=16, ffn=32)  # a fresh but identical model
    assert trace(m8b, in8b).fingerprint() == fp_a
    m4, in4 = autopar.examples.mlp(batch=4, hidden=16, ffn=32)
    assert trace(m4, in4).fingerprint() != fp_a
    m_wide, in_wide = autopar.examples.mlp(batch=8, hidden=16, ffn=64)
    assert trace(m_wide, in_wide).fingerprint() != fp_a


def test_plan_fingerprint_is_trace_fingerprint(real_plan, mlp):
    model, inputs = mlp
    assert real_plan.fingerprint == trace(model, inputs).fingerprint()


def test_a_schema_1_plan_loads_with_its_collectives_read_into_records(real_plan):
    """Plans saved before collectives were typed wrote them as text; they still load."""
    data = real_plan.to_dict()
    data["schema_version"] = 1
    data["decisions"][0]["collectives"] = [
        "all_gather@0",
        "all_reduce(bwd)@1",
        "all_reduce(in op)@0",
        "all_reduce(axis 0, overlapped, bucket 2)",
    ]
    first = Plan.from_dict(data).decisions[0]
    assert first.collectives == (
        PlannedCollective(Collective.ALL_GATHER, 0, 0.0, Phase.FORWARD, Site.INPUTS),
        PlannedCollective(Collective.ALL_REDUCE, 1, 0.0, Phase.BACKWARD, Site.INPUTS),
        PlannedCollective(Collective.ALL_REDUCE, 0, 0.0, Phase.FORWARD, Site.INSIDE),
        PlannedCollective(Collective.ALL_REDUCE, 0, 0.0, Phase.BACKWARD, Site.BUCKET, 2),
    )
    data["decisions"][0]["collectives"] = ["gather everything"]
    with pytest.raises(PlanFormatError, match="unreadable collective"):
        Plan.from_dict(data)


def test_summary_collapses_a_deep_pipelines_alike_chunks():
    """64 chunks on 16 ranks: the middle chunks, priced alike, are one line; each rank's peak once."""
    from autopar.trades import Pipeline

    def chunk(c: int, fwd: float) -> dict:
        return {"chunk": c, "rank": c % 16, "blocks": [3 * c, 3 * c + 3], "forward_s": fwd, "backward_s": 2 * fwd,
                "send_s": 1e-4, "activation_bytes": 2**20, "state_bytes": 2**30,
                "peak_memory_bytes": (60 + c % 16) * 2**30}  # fmt: skip

    costs = (chunk(0, 2e-3), *(chunk(c, 1e-3) for c in range(1, 63)), chunk(63, 3e-3))
    plan = _tiny_plan(
        pipeline=Pipeline(16, "interleaved_1f1b", 4, tuple(range(3, 192, 3))), stage_costs=costs
    )
    lines = plan._pipeline_lines()
    assert lines == [
        "  pipeline: 16 stages, interleaved_1f1b, 4 chunks per rank, mesh (2,) per stage",
        "    chunk 0: blocks 0..2, forward 2.000 ms + backward 4.000 ms per micro-batch",
        "    chunks 1-62: 3 blocks each (blocks 3..188), forward 1.000 ms + backward 2.000 ms per micro-batch",
        "    chunk 63: blocks 189..191, forward 3.000 ms + backward 6.000 ms per micro-batch",
        "    peak memory per pipeline rank: 60.00 (rank 0) to 75.00 GiB (rank 15)",
    ]
    assert "\n".join(lines) in plan.summary()
    # a few ranks: each rank's peak; small plans in MiB
    few = _tiny_plan(pipeline=Pipeline(2, "1f1b", 1, (1,)), stage_costs=(
        {"chunk": 0, "rank": 0, "blocks": [0, 1], "forward_s": 1e-3, "backward_s": 2e-3, "peak_memory_bytes": 3 * 2**20},
        {"chunk": 1, "rank": 1, "blocks": [1, 2], "forward_s": 1e-3, "backward_s": 2e-3, "peak_memory_bytes": 2**20},
    ))  # fmt: skip
    assert few._pipeline_lines()[1:] == [
        "    chunks 0-1: 1 block each (blocks 0..1), forward 1.000 ms + backward 2.000 ms per micro-batch",
        "    peak memory per pipeline rank: 3.00, 1.00 MiB",
    ]
    assert _tiny_plan()._pipeline_lines() == []
