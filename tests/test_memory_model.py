"""The memory model against what runs: what analyze says each op keeps against autograd's saved
tensors in a real forward on CPU, the collectives' buffers against ``cost_model.memory``, and
plans' predicted peaks against the live tensor bytes ``LiveTensorTracker`` measures in a training step (one device in this process, two
gloo ranks in the slow tests)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

import autopar
from autopar.cost_model.memory import reshard_transient
from autopar.demo import train_step
from autopar.launch import free_port, run_on_ranks
from autopar.model_spec import load_model_spec
from autopar.passes.analyze import analyze
from autopar.passes.trace import trace
from autopar.placement import spec_from_str
from autopar.tools.measure import LiveTensorTracker, least_peak_step_memory, peak_step_memory

# -- what each op keeps for backward, against autograd in a real forward --------------------------


def _placeholder_value(node: fx.Node, infos, state: dict, target: str) -> torch.Tensor:
    """A real CPU value for a placeholder: the model's own parameter or buffer, else an input of
    the traced shape (random floats, index 0, masks that keep everything)."""
    if target in state:
        return state[target].detach().clone().requires_grad_(infos[node.name].requires_grad)
    v = node.meta["val"]
    if v.dtype.is_floating_point:
        return torch.randn(v.shape, dtype=v.dtype)
    return (
        torch.ones(v.shape, dtype=v.dtype) if v.dtype == torch.bool else torch.zeros(v.shape, dtype=v.dtype)
    )


class _SavedPerNode(fx.Interpreter):
    """Runs the traced graph forward on real tensors, with every tensor autograd saves for
    backward (``saved_tensors_hooks``) recorded under the node that was running."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.saved: dict[str, list[torch.Tensor]] = {}
        self.values: dict[str, object] = {}
        self._current = ""

    def run_node(self, n: fx.Node):
        self._current = n.name
        out = super().run_node(n)
        self.values[n.name] = out
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved.setdefault(self._current, []).append(t)
        return t


def _view(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _kept(node: fx.Node, run: _SavedPerNode) -> tuple[set[str], bool, int]:
    """What autograd kept while ``node`` ran: its input nodes kept (the same view of the same
    storage, else a view of an input's storage, as a decomposed op keeps a transposed weight),
    whether it kept its output, and the bytes of the other storages it kept."""
    from autopar.passes.rules import tensor_inputs

    ins = [(a.name, run.values[a.name]) for a in tensor_inputs(node)]
    outs = [t for t in pytree.tree_leaves(run.values[node.name]) if isinstance(t, torch.Tensor)]
    inputs, output, temps = set(), False, {}
    for t in run.saved.get(node.name, []):
        same = [name for name, v in ins if _view(v) == _view(t)]
        shared = [name for name, v in ins if _storage(v) == _storage(t)]
        if same or shared:
            inputs.add((same or shared)[0])
        elif any(_storage(o) == _storage(t) for o in outs):
            output = True
        else:
            temps[_storage(t)] = t.untyped_storage().nbytes()
    return inputs, output, sum(temps.values())


# T5's self-attention gets q/k/v as transposed views: autograd keeps a contiguous 16 KiB copy of
# one of them (a temporary), where analyze says the op keeps that input itself
T5_STRIDED_ATTENTION = (
    "analyze: T5's scaled_dot_product_attention keeps a copy of a strided input, not the input"
)


@pytest.mark.parametrize(
    "spec",
    [
        "gpt2_tiny()",
        "llama_tiny()",
        pytest.param("t5_tiny()", marks=pytest.mark.xfail(strict=True, reason=T5_STRIDED_ATTENTION)),
    ],
)
def test_what_analyze_says_each_op_keeps_is_what_autograd_keeps_in_a_real_forward(spec):
    """The traced graph run forward on CPU with the model's weights, autograd's saved tensors
    recorded per node: for every op that needs a gradient, the inputs analyze says it keeps, whether
    it keeps its output and the bytes of the other tensors it keeps are what autograd kept; and over
    the whole forward, the bytes of every distinct storage autograd holds for backward are the
    bytes of the distinct tensors analyze says are kept. (CPU attention runs the flash kernel.)"""
    from autopar.passes.rules import tensor_inputs

    model, inputs = load_model_spec(f"autopar.examples:{spec}")
    tg = trace(model, inputs)
    infos = analyze(tg)
    targets = {p.name: p.target for p in tg.placeholders}
    run = _SavedPerNode(tg.graph_module)
    args = [
        _placeholder_value(n, infos, tg.state, targets.get(n.name, ""))
        for n in tg.graph.nodes
        if n.op == "placeholder"
    ]
    with torch.autograd.graph.saved_tensors_hooks(run.pack, lambda t: t):
        run.run(*args)

    def root(name: str) -> str:  # the node whose storage a view node's output is
        while infos[name].view_of:
            name = infos[name].view_of
        return name

    checked, predicted_kept, predicted_temps = 0, set(), 0
    for n in tg.graph.nodes:
        info = infos[n.name]
        if (
            n.op != "call_function"
            or not isinstance(n.target, torch._ops.OpOverload)
            or not info.requires_grad
        ):
            continue
        ins = tensor_inputs(n)
        said = (
            {a.name for a, kept in zip(ins, info.saves_inputs) if kept},
            info.saves_output,
            info.saved_temp_bytes,
        )
        assert said == _kept(n, run), (n.name, str(n.target))
        predicted_kept |= {root(name) for name in said[0]} | ({root(n.name)} if info.saves_output else set())
        predicted_temps += info.saved_temp_bytes
        checked += 1
    assert checked > 20
    held = {_storage(t): t.untyped_storage().nbytes() for ts in run.saved.values() for t in ts}
    predicted = sum(infos[name].out_bytes for name in predicted_kept) + predicted_temps
    assert predicted == sum(held.values())


# -- predicted peaks against a measured step, one device -------------------------------------------


@pytest.fixture(scope="module")
def one_rank():
    """A gloo process group of one rank in this process (no collectives run)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "spec",
    [
        "mlp(batch=64, hidden=256, ffn=1024)",
        "gpt2_tiny(batch=8, seq=64, hidden=128, vocab=512)",
        "llama_tiny(batch=8, seq=64, hidden=128, vocab=512)",
        "t5_tiny()",
        "bert_tiny()",
        "palm_tiny()",
    ],
)
def test_the_predicted_peak_is_what_a_step_holds_on_one_device(one_rank, spec):
    """Parameters, gradients, what autograd keeps, the caller's outputs and each backward's
    transient, against the live tensor bytes of a training step (SGD; gradients set to None between
    steps, so the peak is inside backward, where the liveness rows over-count what backward has
    already freed: within the 10% target)."""
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=1)
    torch.manual_seed(0)
    model, inputs = load_model_spec(f"autopar.examples:{spec}")
    plan = autopar.plan(model, cluster, inputs, optimizer=autopar.Optimizer.SGD)
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
    train_step(pmodel, opt, inputs)
    measured = peak_step_memory(pmodel, lambda: train_step(pmodel, opt, inputs))
    assert plan.predicted.peak_memory_bytes == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("optimizer", [autopar.Optimizer.SGD, autopar.Optimizer.ADAM])
def test_the_optimizer_steps_temporaries_are_in_the_peak(one_rank, optimizer):
    """An mlp whose weights outweigh its activations peaks in Adam's step: the parameters, their
    gradients and two states, and the two temporaries of one weight's size that ``sqrt`` and the
    division of it make (SGD updates in place: its peak stays inside backward)."""
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=1)
    torch.manual_seed(0)
    model, inputs = load_model_spec("autopar.examples:mlp(batch=4, hidden=256, ffn=1024)")
    plan = autopar.plan(model, cluster, inputs, optimizer=optimizer)
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan)
    make = torch.optim.Adam if optimizer is autopar.Optimizer.ADAM else torch.optim.SGD
    opt = make(pmodel.parameters(), lr=1e-3)
    train_step(pmodel, opt, inputs)  # the first step makes Adam's states
    measured = peak_step_memory(pmodel, lambda: train_step(pmodel, opt, inputs))
    assert plan.predicted.peak_memory_bytes == pytest.approx(measured, rel=0.02)


# -- two gloo ranks ---------------------------------------------------------------------------------

# (from, to, needs a gradient, Megatron "f" on the axis) on a mesh of 2, a tensor of 8 x 6 float32
RESHARDS = [
    ("S(0)", "R", True, False), ("S(0)", "R", True, True), ("P", "R", True, False),
    ("R", "S(1)", True, False), ("P", "S(0)", True, False), ("R", "P", True, False),
    ("S(0)", "S(1)", True, False), ("S(1)", "P", True, False), ("R", "R", True, True),
    ("S(0)", "R", False, False),
]  # fmt: skip


def _collective_buffers(rank: int, world: int) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.codegen import collectives as C
    from autopar.codegen.lower import emit_reshard
    from autopar.placement import local_shape

    mesh = init_device_mesh("cpu", (world,))
    out = []
    for src, dst, rg, f in RESHARDS:
        s, d = spec_from_str(src), spec_from_str(dst)
        g = fx.Graph()
        x = g.placeholder("x")
        g.output(emit_reshard(g, x, s, d, (world,), (0,) if f else ()))
        run = fx.GraphModule(torch.nn.Module(), g)
        best = None
        # gloo's worker thread lets go of a collective's buffers at its own pace: the code's own
        # transient is the least of several runs (3 left a stale buffer in 2 of ~10 suite runs)
        for _ in range(8):
            dist.barrier()
            xin = torch.randn(local_shape((8, 6), s, (world,))).requires_grad_(rg)
            tracker = LiveTensorTracker()
            tracker.add_existing([xin])
            with tracker, C.bound_mesh(mesh):  # backward runs on the mesh its forward kept
                y = run(xin)
            peak = tracker.peak
            if rg:
                grad = torch.randn_like(y)
                tracker = LiveTensorTracker()
                tracker.add_existing([grad])
                with tracker:
                    torch.autograd.grad(y, xin, grad)
                peak = max(peak, tracker.peak)
            del y
            best = peak if best is None else min(best, peak)
        out.append(best)
    return out


@pytest.mark.slow
def test_collective_buffers_are_what_the_transient_model_says():
    """The most bytes a reshard holds at once (input, gathered parts, clones, outputs; forward or
    backward), as codegen's collectives run on 2 gloo ranks, is ``reshard_transient``."""
    measured = run_on_ranks(_collective_buffers, 2)[0]
    for (src, dst, rg, f), got in zip(RESHARDS, measured):
        want = reshard_transient(
            spec_from_str(src), spec_from_str(dst), 8 * 6 * 4, (2,), rg, (0,) if f else ()
        )
        assert got == want, (src, dst, rg, f, got, want)


SPEC = {
    "gpt2": "autopar.examples:gpt2_tiny(batch=8, seq=64, hidden=128, vocab=512)",
    "llama": "autopar.examples:llama_tiny(batch=8, seq=64, hidden=128, vocab=512)",
}
ROLES = {"DP": autopar.AxisRole.DATA, "TP": autopar.AxisRole.TENSOR}
# steps measured per plan, the least peak kept: gloo's worker thread held a gather's parts past
# their last use in all 3 steps of llama_tiny TP once in CI (+1.6 MB, 13.7 MB against 12.2)
STEPS = 5


def _step_peak(spec: str, cluster: autopar.ClusterSpec, path: str) -> tuple[int, torch.nn.Module]:
    """The plan at ``path`` built and stepped once, then the least peak of ``STEPS`` more steps
    (see _collective_buffers), and the module."""
    torch.manual_seed(0)
    model, inputs = load_model_spec(spec)
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
    train_step(pmodel, opt, inputs)
    return least_peak_step_memory(
        pmodel, lambda: train_step(pmodel, opt, inputs), STEPS, dist.barrier
    ), pmodel


def _measure_plans(rank: int, world: int, cluster_dict: dict, paths: dict) -> dict:
    cluster = autopar.ClusterSpec.from_dict(cluster_dict)
    return {key: _step_peak(SPEC[key[0]], cluster, path)[0] for key, path in paths.items()}


@pytest.mark.slow
def test_the_predicted_peak_is_what_a_step_holds_on_two_ranks(tmp_path):
    """Data and tensor parallel plans of GPT-2 and Llama: kept copies where consumers reshard, the
    gathered outputs, the collectives' buffers, against the measured step (max over the ranks)."""
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    plans, paths = {}, {}
    for model_name in SPEC:
        for role_name, role in ROLES.items():
            model, inputs = load_model_spec(SPEC[model_name])
            key = (model_name, role_name)
            plans[key] = autopar.plan(
                model, cluster, inputs, axis_roles=(role,), optimizer=autopar.Optimizer.SGD
            )
            paths[key] = str(tmp_path / f"{model_name}_{role_name}.json")
            plans[key].save(paths[key])
    ranks = run_on_ranks(_measure_plans, 2, cluster.to_dict(), paths)
    for key, plan in plans.items():
        measured = max(r[key] for r in ranks)
        assert plan.predicted.peak_memory_bytes == pytest.approx(measured, rel=0.03), (
            key,
            plan.predicted.peak_memory_bytes,
            measured,
        )


@pytest.mark.slow
def test_a_data_parallel_plan_holds_what_it_predicts(tmp_path):
    """A data-parallel plan (searched on a free link: on gloo's 1 ms the data role would gather
    the batch): its gradients are all-reduced after backward, in place; measured alone."""
    from harness import free_link_cpu

    model, inputs = load_model_spec(SPEC["llama"])
    plan = autopar.plan(
        model,
        free_link_cpu(2),
        inputs,
        axis_roles=(autopar.AxisRole.DATA,),
        optimizer=autopar.Optimizer.SGD,
        zero_stage=0,  # DDP's buckets, what this test holds to its prediction
    )
    assert sum(c.site is autopar.Site.BUCKET for d in plan.decisions for c in d.collectives) >= 10
    path = str(tmp_path / "dp.json")
    plan.save(path)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    # the least peak of up to 3 runs, as of STEPS steps within one: under load gloo's worker thread
    # held a finished bucket's all-reduce past its last use in all 5 steps of a run, twice in 12
    # runs of this file (+5.5%, 10.01 MB against 9.49); a wrong prediction is off in every run
    measured = math.inf
    for _ in range(3):
        ranks = run_on_ranks(_measure_plans, 2, cluster.to_dict(), {("llama", "DP"): path})
        measured = min(measured, max(r[("llama", "DP")] for r in ranks))
        if plan.predicted.peak_memory_bytes == pytest.approx(measured, rel=0.03):
            break
    assert plan.predicted.peak_memory_bytes == pytest.approx(measured, rel=0.03)


MLP = "autopar.examples:mlp(batch=4, hidden=256, ffn=1024)"  # 2 MiB of weights, little else
CAPS = (1, 600_000, None)  # a bucket per weight (no flattening), two buckets, one


def _bucket_peaks(rank: int, world: int, paths: dict) -> dict:
    from autopar.passes import grad_sync

    default = grad_sync.BUCKET_BYTES
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}
    for cap, path in paths.items():
        grad_sync.BUCKET_BYTES = default if cap is None else cap
        peak, pm = _step_peak(MLP, cluster, path)
        out[cap] = (peak, pm.grad_sync.num_buckets)
    grad_sync.BUCKET_BYTES = default
    return out


@pytest.mark.slow
def test_the_peak_counts_each_bucket_flattening_and_no_clone_of_a_bucketed_gradient(tmp_path, monkeypatch):
    """A data-parallel mlp whose weights outweigh its activations: the step peaks when backward
    flattens a bucket (the bucket's bytes on top of its gradients), and a gradient reduced in a
    bucket is never cloned the way an inline "f" clones it. One bucket, two, or one per weight
    (no flattening): each peak is the measured one."""
    from autopar.passes import grad_sync

    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    default = grad_sync.BUCKET_BYTES
    plans, paths = {}, {}
    for cap in CAPS:
        monkeypatch.setattr(grad_sync, "BUCKET_BYTES", default if cap is None else cap)
        model, inputs = load_model_spec(MLP)
        plans[cap] = autopar.plan(
            model, cluster, inputs, axis_roles=(autopar.AxisRole.DATA,), optimizer=autopar.Optimizer.SGD,
            zero_stage=0,  # DDP's buckets, what this test holds to its prediction
        )  # fmt: skip
        paths[cap] = str(tmp_path / f"cap_{cap}.json")
        plans[cap].save(paths[cap])
    ranks = run_on_ranks(_bucket_peaks, 2, paths)
    assert [ranks[0][cap][1] for cap in CAPS] == [4, 2, 1]
    peaks = [plans[cap].predicted.peak_memory_bytes for cap in CAPS]
    assert peaks[0] < peaks[1] < peaks[2]  # each flattening is a bigger bucket, later in backward
    for cap, predicted in zip(CAPS, peaks):
        measured = max(r[cap][0] for r in ranks)
        assert predicted == pytest.approx(measured, rel=0.01), cap


def test_a_plan_whose_bucket_flattening_passes_the_limit_is_refused():
    """The ILP's rows do not hold the buckets' flattening (the buckets follow from the choice);
    the search checks the chosen plan with it, and a limit one byte short of that peak leaves no
    data-parallel plan of the mlp, where the rows alone would have accepted one."""
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2).with_overrides(memory_reserve=0.0)
    model, inputs = load_model_spec(MLP)
    kw = dict(axis_roles=(autopar.AxisRole.DATA,), optimizer=autopar.Optimizer.SGD)
    kw |= dict(recompute=autopar.Recompute.NONE, micro_batches=1, zero_stage=0)  # no trade may make room
    peak = autopar.plan(model, cluster, inputs, **kw).predicted.peak_memory_bytes
    fits = autopar.plan(model, cluster, inputs, memory_limit_bytes=peak, **kw)
    assert fits.predicted.peak_memory_bytes <= peak
    with pytest.raises(autopar.NoPlanFitsError, match="gradient buckets"):
        autopar.plan(model, cluster, inputs, memory_limit_bytes=peak - 1, **kw)


def test_the_least_peak_of_a_few_steps_is_the_lean_steps_peak():
    """A step that now and then holds a tensor longer (as a collective backend's worker thread
    may) measures its own, lean peak: the least over the steps, with the barrier before each."""
    w = torch.nn.Linear(64, 64)
    calls, barriers = [], []

    def step():
        lingering = torch.ones(10_000) if len(calls) % 3 != 1 else None  # the 2nd of 3 steps is lean
        calls.append(lingering)  # kept to the end: lingers past the step's own work
        (w(torch.ones(8, 64)) ** 2).sum().backward()
        w.zero_grad(set_to_none=True)

    step()
    lean = peak_step_memory(w, step)  # the 2nd call: nothing lingers
    calls.clear()
    assert least_peak_step_memory(w, step, steps=3, barrier=lambda: barriers.append(1)) == lean
    assert len(barriers) == 3
    calls.clear()
    assert peak_step_memory(w, step) > lean  # a step where it lingers measures more


@pytest.mark.slow
def test_the_caller_holds_the_outputs_through_backward(tmp_path):
    """GPT-2 with a batch of 16, data parallel: the step peaks early in backward, the gathered
    logits still held by the caller. They are counted there, though made after every position
    backward has yet to reach (counted from where they are made, the peak is 3% short)."""
    spec = "autopar.examples:gpt2_tiny(batch=16, seq=64, hidden=128, vocab=256)"
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    model, inputs = load_model_spec(spec)
    plan = autopar.plan(
        model, cluster, inputs, axis_roles=(autopar.AxisRole.DATA,), optimizer=autopar.Optimizer.SGD
    )
    path = str(tmp_path / "dp.json")
    plan.save(path)
    ranks = run_on_ranks(_measure_plans_of, 2, spec, cluster.to_dict(), path)
    assert plan.predicted.peak_memory_bytes == pytest.approx(max(ranks), rel=0.02)


def _measure_plans_of(rank: int, world: int, spec: str, cluster_dict: dict, path: str) -> int:
    return _step_peak(spec, autopar.ClusterSpec.from_dict(cluster_dict), path)[0]
