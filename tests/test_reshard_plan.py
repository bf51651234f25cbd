"""The reshard plan is what runs: the collectives the generated code calls, counted at the process
group, are the ones the cost model prices, step for step.

One process holds rank 0 of a fake process group of 8 ranks (``torch.testing``'s ``FakeStore``:
every collective is accepted and does nothing), so meshes of 1-3 axes of any shape up to 8 ranks
are built without spawning processes. For random placement pairs (each tensor dim split on one
mesh axis at most; shapes that divide evenly) and random Megatron "f" axes, the graph
``codegen/lower.py:emit_reshard`` generates runs forward and backward under the real
``codegen/collectives.py``; a dispatch mode records every c10d collective it issues: its kind, the
mesh axis of its group, its bytes, and whether autograd's backward issued it. That list must equal
``autopar.reshard.reshard_plan(...).collectives(requires_grad=True)``, which
``cost_model/comm.py:CommModel.reshard`` prices (forward in step order; backward in reverse, as
autograd runs it).

The backend is made to report "nccl" so that reduce-scatter runs as one (on gloo it runs as an
all-reduce and a slice, which the calibration prices as the reduce-scatter it stands for).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.codegen import collectives as C
from autopar.codegen.lower import emit_reshard
from autopar.cost_model.comm import CommModel
from autopar.placement import is_replicate, local_shape, spec_to_str
from autopar.reshard import Collective, Phase, reshard_plan

WORLD = 8
_KINDS = {
    "_allgather_base_": Collective.ALL_GATHER,
    "allgather_": Collective.ALL_GATHER,
    "allgather_into_tensor_coalesced_": Collective.ALL_GATHER,
    "allreduce_": Collective.ALL_REDUCE,
    "_reduce_scatter_base_": Collective.REDUCE_SCATTER,
    "reduce_scatter_": Collective.REDUCE_SCATTER,
}


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    made: dict[tuple[int, ...], DeviceMesh] = {}

    def mesh(shape: tuple[int, ...]) -> DeviceMesh:
        if shape not in made:
            made[shape] = DeviceMesh("cpu", torch.arange(math.prod(shape)).reshape(shape))
        return made[shape]

    yield mesh
    dist.destroy_process_group()


def _bytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes(t) for t in x)
    return 0


class _Counter(TorchDispatchMode):
    """Records each c10d collective: (kind, mesh axis, bytes, phase)."""

    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.axis_of = {mesh.get_group(a).group_name: a for a in range(mesh.ndim)}
        self.calls: list[tuple[Collective, int, int, Phase]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func._opname in _KINDS:
            kind = _KINDS[func._opname]
            group = next(
                dist.ProcessGroup.unbox(a)
                for a in args
                if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())
            )
            # priced at the full tensor over the axis: a gather's output (its first argument), an
            # all-reduce's tensor (its first), a reduce-scatter's input (its second)
            nbytes = _bytes(args[1] if kind is Collective.REDUCE_SCATTER else args[0])
            phase = Phase.BACKWARD if torch._C._current_autograd_node() is not None else Phase.FORWARD
            self.calls.append((kind, self.axis_of[group.group_name], nbytes, phase))
        return func(*args, **kwargs)


@st.composite
def _cases(draw):
    ndim = draw(st.integers(1, 3))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    if math.prod(mesh) > WORLD:
        mesh = tuple(min(n, 2) for n in mesh)
    rank = draw(st.integers(1, 3))

    def spec():
        out, used = [], set()
        for _ in mesh:
            choice = draw(st.sampled_from(["R", "P", *[f"S{d}" for d in range(rank) if d not in used]]))
            if choice.startswith("S"):
                used.add(int(choice[1:]))
                out.append(Shard(int(choice[1:])))
            else:
                out.append(Replicate() if choice == "R" else Partial())
        return tuple(out)

    src, dst = spec(), spec()
    f_axes = tuple(a for a in range(ndim) if is_replicate(dst[a]) and draw(st.booleans()))
    # every dim divides evenly under any placement: a multiple of the mesh's size
    shape = tuple(math.prod(mesh) * draw(st.integers(1, 2)) for _ in range(rank))
    return mesh, src, dst, f_axes, shape


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_cases())
def test_generated_code_runs_exactly_the_priced_collectives(meshes, monkeypatch, case):
    mesh_shape, src, dst, f_axes, shape = case
    mesh = meshes(mesh_shape)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(emit_reshard(g, x, src, dst, mesh_shape, f_axes))
    gm = fx.GraphModule(torch.nn.Module(), g)
    piece = torch.randn(local_shape(shape, src, mesh_shape), requires_grad=True)
    counter = _Counter(mesh)
    with C.bound_mesh(mesh), counter:
        y = gm(piece)
        y.backward(torch.ones_like(y))
    nbytes = math.prod(shape) * 4
    priced = reshard_plan(src, dst, mesh_shape, nbytes, f_axes).collectives(requires_grad=True)
    forward = [c for c in counter.calls if c[3] is Phase.FORWARD]
    backward = [c for c in counter.calls if c[3] is Phase.BACKWARD][::-1]  # autograd runs steps in reverse
    want = [(c.kind, c.axis, c.nbytes, c.phase) for c in priced]
    what = f"{spec_to_str(src)} -> {spec_to_str(dst)} on mesh {mesh_shape}, f on {f_axes}, shape {shape}"
    assert forward + backward == [w for w in want if w[3] is Phase.FORWARD] + [
        w for w in want if w[3] is Phase.BACKWARD
    ], what
    # the comm model prices exactly these calls
    comm = CommModel(_cluster(mesh_shape), mesh_shape)
    seconds, calls = comm.reshard(src, dst, nbytes, True, f_axes)
    assert calls == priced
    assert seconds == pytest.approx(sum(comm.time(c.kind, c.nbytes, c.axis) for c in priced), rel=1e-12)


def _cluster(mesh_shape):
    from autopar.cluster import ClusterSpec

    return ClusterSpec.preset("h100-sxm", devices_per_node=math.prod(mesh_shape))


def test_a_gather_absorbs_the_f_of_its_axis():
    """Megatron's "f" on an axis a gather to Replicate runs on becomes the gather's backward
    reduce-scatter; elsewhere it stays an all-reduce of the gradient."""
    S0, R = Shard(0), Replicate()
    plan = reshard_plan((S0, R), (R, R), (2, 2), 64.0, (0, 1))
    assert [(s.kind.value, s.axis, s.fused_f) for s in plan.steps] == [
        ("all_gather", 0, True),
        ("f", 1, False),
    ]
    calls = plan.collectives(requires_grad=True)
    assert [(c.kind, c.phase) for c in calls] == [
        (Collective.ALL_GATHER, Phase.FORWARD),
        (Collective.REDUCE_SCATTER, Phase.BACKWARD),
        (Collective.ALL_REDUCE, Phase.BACKWARD),
    ]
    assert plan.collectives(requires_grad=False) == calls[:1]


def test_transient_is_the_largest_step():
    """S(0) -> R on 4 ranks of a 64-byte tensor: the gather holds its 16-byte input and 64-byte
    output; with a gradient, the backward slice holds 64 + 16 bytes as well."""
    plan = reshard_plan((Shard(0),), (Replicate(),), (4,), 64.0)
    assert plan.transient(requires_grad=False) == 80.0
    assert plan.transient(requires_grad=False, keeps=True) == 16.0  # the output counts as kept
    assert plan.transient(requires_grad=True, keeps=True) == 80.0
    # along dim 1 the gather also holds its parts before concatenating them
    assert reshard_plan((Shard(1),), (Replicate(),), (4,), 64.0).transient(False) == 16 + 2 * 64


@settings(max_examples=150, deadline=None)
@given(case=_cases())
def test_the_generated_reshard_moves_the_values_to_the_target_placement(case):
    """Every rank of the mesh simulated in one process (``autopar.tools.simulate``, the collectives'
    own semantics): the pieces of a random tensor under ``src``, through the generated reshard, are
    the pieces of the same tensor under ``dst`` (replicas agree, partial sums add up). A step that
    slices a dim another axis still holds sharded puts the wrong rows on a rank (or fails)."""
    from autopar.tools.simulate import _assemble, _coords, _distribute, _run_lockstep

    mesh_shape, src, dst, f_axes, shape = case
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    coords = _coords(mesh_shape)
    pieces = _distribute(x, src, mesh_shape, torch.Generator().manual_seed(1))
    g = fx.Graph()
    ph = g.placeholder("x")
    g.output(emit_reshard(g, ph, src, dst, mesh_shape, f_axes))
    outs = _run_lockstep(g, [[pieces[c] for c in coords]], coords)
    got, spread = _assemble(dict(zip(coords, outs)), dst, mesh_shape)
    what = f"{spec_to_str(src)} -> {spec_to_str(dst)} on mesh {mesh_shape}, shape {shape}"
    assert spread < 1e-12, what
    torch.testing.assert_close(got, x, msg=what)


def test_a_dim_moving_to_another_axis_is_gathered_before_it_is_sliced_again():
    """(S(3), S(1)) -> (S(1), S(2)) on a 2 x 2 mesh: axis 0 wants dim 1, which axis 1 holds until
    its own step gathers it; the steps run axis 1 first (a Llama key's rotary product on a free
    link plans this; axis 0 first would slice a dim of one row into two)."""
    S1, S2, S3 = Shard(1), Shard(2), Shard(3)
    plan = reshard_plan((S3, S1), (S1, S2), (2, 2), 4 * 2 * 16 * 8 * 4.0)
    assert [(s.kind.value, s.axis, s.dim) for s in plan.steps] == [
        ("all_gather", 1, 1),
        ("chunk", 1, 2),
        ("all_gather", 0, 3),
        ("chunk", 0, 1),
    ]


@st.composite
def _nested_cases(draw):
    """Placement pairs on 2-3 axes where a dim may be split on several axes at once (nested, the
    lower axis outer, as DTensor nests them): expert parallelism beside data parallelism splits
    the batch so (``passes/strategies.py:nest_axes``)."""
    ndim = draw(st.integers(2, 3))
    mesh = tuple(draw(st.lists(st.integers(1, 2), min_size=ndim, max_size=ndim)))
    rank = draw(st.integers(1, 2))

    def spec():
        return tuple(
            draw(st.sampled_from([Replicate(), Partial(), *[Shard(d) for d in range(rank)]])) for _ in mesh
        )

    src, dst = spec(), spec()
    f_axes = tuple(a for a in range(ndim) if is_replicate(dst[a]) and draw(st.booleans()))
    shape = tuple(math.prod(mesh) * draw(st.integers(1, 2)) for _ in range(rank))
    return mesh, src, dst, f_axes, shape


@settings(max_examples=150, deadline=None)
@given(case=_nested_cases())
def test_a_dim_split_on_several_axes_moves_to_the_target_placement(case):
    """As above, with a dim split on several axes in the source, the target or both: the steps
    gather an inner axis before an outer one and slice an inner one only under its outer one."""
    test_the_generated_reshard_moves_the_values_to_the_target_placement.hypothesis.inner_test(case)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_nested_cases())
def test_a_nested_reshard_runs_exactly_the_priced_collectives(meshes, monkeypatch, case):
    test_generated_code_runs_exactly_the_priced_collectives.hypothesis.inner_test(meshes, monkeypatch, case)
