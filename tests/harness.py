"""The shared harness of the multi-process correctness suites.

The parent plans every (model, mode) offline and saves the plans; ONE spawn per world size
applies them all with ``autoparallelize(..., plan=path)``, runs two SGD steps with the model's
own loss, and returns the outputs of both steps, ``full_state_dict()`` and (rank 0) the
generated code and the mesh axes it runs collectives on (``collective_axes``). ``check_run``
compares them with the single-device model (fp32, rtol 1e-4, atol 1e-5: the logits' in units of
their largest), checks that a forced plan is what it claims to be, and that every plan runs
collectives on every mesh axis of more than one rank (a plan that replicates everything tests
nothing about parallelism).

A mode is ``(mesh shape, axis roles)``, roles None for the solver's own choice, optionally with a
third entry saying how the solver is made to choose parallelism on a toy model, where on the cpu
preset (gloo's ~1 ms per collective) replicating everything is rightly cheapest: ``SQUEEZED``
(a memory limit of ``SQUEEZE`` times the unconstrained plan's predicted peak) or ``FREE_LINK``
(``free_link_cpu``). A configuration that raises
(planning or on a rank) is reported by that configuration's test, with the traceback.

``build`` is a module-level function ``build(name) -> (model, inputs)`` of the test module, so
that spawned ranks can unpickle it.
"""

from __future__ import annotations

import dataclasses
import inspect
import traceback
from collections.abc import Callable

import torch

import autopar
from autopar.launch import run_on_ranks
from autopar.placement import R, spec_from_str

LR = 0.1
STEPS = 2
D, T, S = autopar.AxisRole.DATA, autopar.AxisRole.TENSOR, autopar.AxisRole.SEQUENCE
SQUEEZED, FREE_LINK = "squeezed", "free link"  # how an auto mode is planned (module docstring)
SQUEEZE = 0.7
# the functions of autopar.codegen.collectives the generated code calls with a mesh axis: each
# communicates over it, forward or backward (chunk's backward gathers, f's all-reduces, ...)
COLLECTIVE_FNS = (
    "all_gather", "chunk", "all_reduce", "all_reduce_deferred", "all_reduce_started", "mean_deferred", "reduce_scatter", "to_partial", "f", "batch_slice",
    "all_gather_linear", "linear_reduce_scatter",
)  # fmt: skip


def labelled(label: str):
    """``torch.testing.assert_close``'s ``msg``: ``label`` before its own account of the mismatch."""
    return lambda found: f"{label}: {found}"


def matmul_forms(m: int) -> list[tuple]:
    """(op, args) of each matmul form (3-D and 2-D linears with and without bias, mm, addmm with a
    bias row or a full matrix), sized to divide over any axes of an ``m``-rank mesh."""
    aten = torch.ops.aten
    rows, k, n = 4 * m, 2 * m, 3 * m
    x3, x2, w = torch.randn(m, 2 * m, k), torch.randn(rows, k), torch.randn(n, k)
    return [
        (aten.linear.default, (x3, w)),
        (aten.linear.default, (x3, w, torch.randn(n))),
        (aten.linear.default, (x2, w, torch.randn(n))),
        (aten.mm.default, (x2, torch.randn(k, n))),
        (aten.addmm.default, (torch.randn(n), x2, torch.randn(k, n))),
        (aten.addmm.default, (torch.randn(rows, n), x2, torch.randn(k, n))),
    ]


def rung_tables(model, inputs, cluster: autopar.ClusterSpec, mesh: tuple[int, ...]):
    """What the search's climb works on for ``model`` on ``mesh`` (axis 0 data parallel, coarsened
    classes, the automatic precision): the traced graph, its classes, the infos the cost model
    priced, the tables, the blocks and the ladder's rungs, as a namespace."""
    import types

    from autopar.options import AxisRole, Optimizer, SearchOptions
    from autopar.passes.analyze import analyze
    from autopar.passes.blocks import find_blocks
    from autopar.passes.coarsen import find_classes
    from autopar.passes.costs import build_costs
    from autopar.passes.precision import auto_precision, autocast_device, half_infos
    from autopar.passes.strategies import build_strategies, variable_nodes
    from autopar.passes.trace import trace
    from autopar.passes.trades import ladder

    tg = trace(model, inputs)
    infos = analyze(tg)
    classes = find_classes(tg, infos, variable_nodes(tg))
    precision = auto_precision(infos)
    cinfos = half_infos(tg, infos, precision, autocast_device(cluster))
    roles = (AxisRole.DATA,) + (AxisRole.AUTO,) * (len(mesh) - 1)
    strats = build_strategies(tg, infos, mesh, roles, only=set(classes.members))
    tables = build_costs(tg, cinfos, strats, cluster, mesh, Optimizer.ADAM, roles, classes)
    blocks = find_blocks(tg)
    batch = next(iter(inputs.values())).shape[0]
    rungs = ladder(SearchOptions(), (0,), precision, batch, bool(blocks))
    return types.SimpleNamespace(
        tg=tg, classes=classes, precision=precision, cinfos=cinfos, tables=tables, blocks=blocks, rungs=rungs
    )


def free_link_cpu(world: int) -> autopar.ClusterSpec:
    """CPU ranks on a link priced as free (no latency, 1 TB/s): the toy models of a test, whose ops
    take microseconds, are then data parallel wherever the batch splits; on loopback gloo's ~1 ms
    per collective they rightly stay replicated. For tests of what data parallelism runs. Its
    reduce-scatter is priced at the link's figures too (``ring_scatter_cpu``)."""
    return ring_scatter_cpu(world, autopar.LinkSpec(bandwidth=1e12, latency=0.0))


def ring_scatter_cpu(world: int, link: autopar.LinkSpec | None = None) -> autopar.ClusterSpec:
    """The ``cpu`` preset (on ``link``, default its own) whose link reduce-scatters at its own
    bandwidth and latency, as a ring does (half an all-reduce's bytes): how a reduce-scatter was
    priced on CPU ranks before gloo's was priced as the all-reduce it runs
    (``cost_model/comm.py:NATIVE_REDUCE_SCATTER``). For tests of layouts (sequence splits
    reduce-scattered into) that the gloo prices no longer choose; a link with figures measured for
    a reduce-scatter is priced by them (``autopar calibrate``)."""
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    link = link or cluster.intra_node
    ring = dataclasses.replace(
        link, ranges=(*link.ranges, ("reduce_scatter", 2.0**50, link.bandwidth, link.latency))
    )
    return cluster.with_overrides(intra_node=ring)


def collective_axes(pmodel) -> set[int]:
    """The mesh axes a parallel module runs collectives on: the ``axis`` argument of every call of
    ``autopar.codegen.collectives`` in its generated code (the graph ``pmodel.code`` prints), and
    the axes of its gradient buckets' all-reduces (``pmodel.grad_sync``: data-parallel axes)."""
    from autopar.codegen import collectives as C

    fns = {getattr(C, name) for name in COLLECTIVE_FNS}
    axes = set()
    for node in pmodel.local.graph.nodes:
        if node.op == "call_function" and node.target in fns:
            axes.add(int(inspect.signature(node.target).bind(*node.args, **node.kwargs).arguments["axis"]))
    if pmodel.grad_sync is not None:
        axes.update(pmodel.grad_sync.axes)
    return axes


def parallel_axes(mesh) -> set[int]:
    """The axes of ``mesh`` with more than one rank: the ones a parallel plan must communicate on."""
    return {a for a, n in enumerate(mesh) if n > 1}


def train(model, inputs, steps: int = STEPS) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """SGD steps with the model's own loss: (output type, loss, logits) of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    outs = []
    for _ in range(steps):
        out = model(**inputs)
        outs.append((type(out).__name__, out.loss.detach().clone(), out.logits.detach().clone()))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return outs


def sgd_losses(model, *args) -> list[torch.Tensor]:
    """The losses of ``STEPS`` SGD steps (``LR``) of ``model`` (a module or the parallel one) on
    ``args``, the model returning its loss."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(*args)
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return losses


def padded(model, inputs):
    """``(model, inputs)`` with right padding on the first row (its last 5 tokens): an
    ``attention_mask`` with zeros there, and the labels ignored (-100) there."""
    mask = torch.ones_like(inputs["input_ids"])
    mask[0, -5:] = 0
    return model, {**inputs, "attention_mask": mask, "labels": inputs["labels"].masked_fill(mask == 0, -100)}


def half_copy_forward(model, inputs: dict, dtype: torch.dtype = torch.bfloat16, device_type: str = "cpu"):
    """One forward of the single-device ``model`` as autopar runs mixed precision at every ZeRO
    stage (``codegen/local_params.py``, FSDP2's ``MixedPrecisionPolicy``): every floating parameter
    read as its half copy, cast once (tied ones once), under ``torch.autocast``; the gradients flow
    back through the casts into the fp32 parameters."""
    params = {n: p.to(dtype) if p.is_floating_point() else p for n, p in model.named_parameters()}
    with torch.autocast(device_type, dtype=dtype):
        return torch.func.functional_call(model, params, (), inputs, tie_weights=True)


def adam_reference(
    model, inputs, steps: int, lr: float, eps: float = 1e-8, half: torch.dtype | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device run a parallel one is checked against: ``steps`` Adam steps on the
    model's own loss; (the loss of every step, the state dict after them). A larger ``eps`` keeps
    Adam from blowing up rounding noise where a gradient is zero in exact arithmetic (attention's
    key bias: softmax ignores a shift shared by a row's scores). ``half``: mixed precision, each
    forward ``half_copy_forward`` in that type (fp32 masters: the model's parameters)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=eps)
    losses = []
    for _ in range(steps):
        loss = (half_copy_forward(model, inputs, half) if half is not None else model(**inputs)).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


# weights after Adam steps (``assert_adam_state_close``): at most one element in this many (and
# ADAM_FEW_MIN) may be off by the share of a step that rounding moves them
ADAM_FEW, ADAM_FEW_MIN = 256, 4


def assert_adam_state_close(got, want, lr: float, steps: int, label: str, rtol=1e-4, atol=1e-5) -> None:
    """A tensor of the state after ``steps`` Adam steps of rate ``lr`` equals the reference's.

    Adam moves a weight by ``lr * m / (sqrt(v) + eps)`` a step, about ``lr`` whatever the gradient's
    scale: where a gradient is within its rounding of zero (a sum that cancels), the order of the
    parallel sums moves its weight by a share of ``lr`` (up to ~1/45 of it over two steps here),
    not by the gradient's own tiny error; a few single elements of a tensor then pass ``atol``.
    So every element is held to a tenth of ``steps * lr``, and all but a few (one in ``ADAM_FEW``,
    at least ``ADAM_FEW_MIN``) to ``(rtol, atol)``. A wrong update is off on every element it
    touches: by about ``lr`` a step (a step missed, a shard stepped with another's moments: 10x the
    first bound) or by its gradient's error (on a share of the elements, not a few: the second)."""
    torch.testing.assert_close(got, want, rtol=rtol, atol=steps * lr / 10, msg=labelled(label))
    if not want.is_floating_point() or not want.numel():
        return
    g, w = got.detach().double(), want.detach().double()
    far = (g - w).abs() > atol + rtol * w.abs()
    few = max(ADAM_FEW_MIN, want.numel() // ADAM_FEW)
    worst = int(((g - w).abs() / (atol + rtol * w.abs())).argmax())
    assert int(far.sum()) <= few, (
        f"{label}: {int(far.sum())} of {want.numel()} elements differ by more than atol {atol:g} + rtol "
        f"{rtol:g} (at most {few} may: weights whose gradient is within rounding of zero); the worst, "
        f"flat index {worst}: {g.flatten()[worst].item():.6g} vs {w.flatten()[worst].item():.6g}"
    )


def assert_rank_as_reference(rank: int, res, ref, lr: float, steps: int) -> tuple[str, set[int] | None]:
    """One rank's ``adam_rank`` result against the single device's ``adam_reference`` ``ref``: it
    ran, its losses equal the reference's (rtol 1e-4) and its full state after the steps equals it
    (``assert_adam_state_close``). Returns its (generated code, collective axes) for the caller's
    own checks of the plan it ran."""
    assert not isinstance(res, str), f"rank {rank} failed:\n{res}"
    losses, state, code, axes = res
    ref_losses, ref_state = ref
    torch.testing.assert_close(
        torch.tensor(losses),
        torch.tensor(ref_losses),
        rtol=1e-4,
        atol=1e-5,
        msg=labelled(f"rank {rank} losses"),
    )
    assert set(state) == set(ref_state)
    for k in ref_state:
        assert_adam_state_close(state[k], ref_state[k], lr, steps, f"rank {rank} {k}")
    return code, axes


def assert_world_as_reference(per_rank, key, ref, lr: float, steps: int, mesh, code_has: str) -> None:
    """Every rank's ``adam_rank`` result for ``key`` against the single device's ``ref``
    (``assert_rank_as_reference``); its collectives span at least the mesh's parallel axes, and
    rank 0's generated code holds ``code_has``."""
    for rank, results in enumerate(per_rank):
        code, axes = assert_rank_as_reference(rank, results[key], ref, lr, steps)
        assert axes is None or axes >= parallel_axes(mesh)
        if rank == 0:
            assert code_has in code


def reference(build: Callable, name: str):
    model, inputs = build(name)
    outs = train(model, inputs)
    return outs, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(rank: int, world: int, build: Callable, jobs):
    results = {}
    for key, plan_path in jobs:
        model, inputs = build(key[0])
        cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
        try:
            pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan_path)
            code = pmodel.code if rank == 0 else ""
            results[key] = (train(pmodel, inputs), pmodel.full_state_dict(), code, collective_axes(pmodel))
        except Exception:  # noqa: BLE001 - reported by that configuration's test
            results[key] = traceback.format_exc()
    return results


def run_world(
    build: Callable, names, plans_for_world: dict, world: int, tmp_dir, edit: Callable | None = None
):
    """Plan every (name, mode) in the parent, run them all in one spawn: (plans, per-rank results).

    ``edit(mode, plan, model, inputs)`` may rewrite a plan before it is saved (any valid strategy
    must run correctly, chosen or not)."""
    jobs, plans = [], {}
    for name in names:
        model, inputs = build(name)
        for mode, (mesh, roles, *how) in plans_for_world.items():
            try:
                plan = _plan(model, inputs, world, mesh, roles, how[0] if how else None)
                if edit is not None:
                    plan = edit(mode, plan, model, inputs)
            except Exception:  # noqa: BLE001 - reported by that configuration's test
                plans[(name, mode)] = traceback.format_exc()
                continue
            path = tmp_dir / f"{name}_{mode}.json"
            plan.save(path)
            plans[(name, mode)] = plan
            jobs.append(((name, mode), str(path)))
    return plans, run_on_ranks(_rank, world, build, jobs, timeout_s=900)


def _plan(model, inputs, world: int, mesh, roles, how):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    if how == FREE_LINK:
        cluster = free_link_cpu(world)
    limit = None
    if how == SQUEEZED:
        free = autopar.plan(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
        limit = SQUEEZE * free.predicted.peak_memory_bytes / (1 - cluster.memory_reserve)
    # squeezed: the limit is to bend the placements, so the step stays one batch (micro-batches would
    # relieve it too: the trades ladder tries them where a plan fits tightly, passes/ladder.py)
    more = {"micro_batches": 1} if how == SQUEEZED else {}
    plan = autopar.plan(
        model, cluster, inputs, mesh_shape=mesh, axis_roles=roles, memory_limit_bytes=limit, **more
    )
    if limit is not None:
        assert plan.predicted.peak_memory_bytes <= SQUEEZE * free.predicted.peak_memory_bytes * (1 + 1e-9)
    return plan


def check_forced(plan, roles) -> None:
    """A forced plan is what it claims: DP replicates weights and splits the batch, TP splits every
    weight and replicates the inputs, SP replicates weights and splits the sequence."""
    for a, role in enumerate(roles or ()):
        params = [d for d in plan.decisions if d.role == "param" and len(d.shape) >= 2]
        inputs = [d for d in plan.decisions if d.role == "input"]
        if role is D:
            assert all(spec_from_str(d.output)[a] == R for d in params)
            assert all(str(spec_from_str(d.output)[a]) == "S(0)" for d in inputs)
        if role is T:
            assert all(spec_from_str(d.output)[a] != R for d in params)
            assert all(spec_from_str(d.output)[a] == R for d in inputs)
        if role is S:
            assert all(spec_from_str(d.output)[a] == R for d in params)
            assert all(str(spec_from_str(d.output)[a]) == "S(1)" for d in inputs)


def check_run(world_result, references, name: str, mode: str, plans_for_world: dict) -> None:
    """Every rank's outputs and trained weights equal the single-device model's."""
    plans, per_rank = world_result
    plan = plans[(name, mode)]
    assert not isinstance(plan, str), f"{name} {mode}: planning failed:\n{plan}"
    ref_outs, ref_state = references[name]
    for rank, results in enumerate(per_rank):
        res = results[(name, mode)]
        assert not isinstance(res, str), f"{name} {mode}: rank {rank} failed:\n{res}"
        outs, state, _, axes = res
        mesh = plans_for_world[mode][0]
        assert axes >= parallel_axes(mesh), (
            f"{name} {mode}: rank {rank} runs collectives on mesh axes {sorted(axes)} of {mesh}: "
            "a case meant to test parallelism must communicate on every axis of more than one rank"
        )
        for step, ((typ, loss, logits), (rtyp, rloss, rlogits)) in enumerate(zip(outs, ref_outs)):
            assert typ == rtyp, f"rank {rank}: the parallel module returns {typ}, the model {rtyp}"
            torch.testing.assert_close(loss, rloss, rtol=1e-4, atol=1e-5, msg=f"rank {rank} step {step} loss")
            # sums over the hidden size: an element near zero carries the rounding of the largest
            # terms, so atol is in units of max|logits| (a wrong shard is off by a share of it)
            scale = max(1.0, rlogits.abs().max().item())
            torch.testing.assert_close(
                logits, rlogits, rtol=1e-4, atol=1e-5 * scale, msg=f"rank {rank} step {step} logits"
            )
        assert set(state) == set(ref_state)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {k}")
    mesh, roles = plans_for_world[mode][:2]
    assert tuple(plan.mesh_shape) == mesh
    check_forced(plan, roles)


def code_of(world_result, name: str, mode: str) -> str:
    """The generated rank-local code of rank 0 for one configuration."""
    res = world_result[1][0][(name, mode)]
    assert not isinstance(res, str), res
    return res[2]


def adam_rank(rank, world, build, jobs, steps, lr, eps, check_output=None):
    """On each rank: per ``(key, plan path)`` of ``jobs`` (``key[0]`` names the model ``build``
    makes), the parallel module's losses of ``steps`` Adam steps on the model's own loss, its full
    state after them, rank 0's generated code ("" elsewhere: every graph's, a ZeRO-3 block's
    included) and the mesh axes its collectives ran on (None for a plan of micro-batches, pipelined
    or not, which trains by ``step``); or the traceback, reported by that configuration's test. ``check_output(out)``:
    asserts on every step's output."""
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    results = {}
    for key, path in jobs:
        try:
            model, inputs = build(key[0])
            pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
            loaded = autopar.Plan.load(path)
            # micro-batches (pipelined or not): the module's step runs them all and the backward
            pipelined = loaded.pipeline.stages > 1 or loaded.trades.micro_batches > 1
            opt = pmodel.optimizer(torch.optim.Adam, lr=lr, eps=eps)
            losses = []
            for _ in range(steps):
                if pipelined:
                    losses.append(float(pmodel.step(**inputs)))
                else:
                    out = pmodel(**inputs)
                    if check_output is not None:
                        check_output(out)
                    out.loss.backward()
                    losses.append(out.loss.item())
                opt.step()
                opt.zero_grad()
            graphs = [m.code for m in pmodel.modules() if isinstance(m, torch.fx.GraphModule)]
            code = "\n".join(graphs or [pmodel.code]) if rank == 0 else ""  # the module's own among them
            axes = None if pipelined else collective_axes(pmodel)
            results[key] = (losses, pmodel.full_state_dict(), code, axes)
        except Exception:  # noqa: BLE001 - reported by that configuration's test
            results[key] = traceback.format_exc()
    return results


def plan_and_train(
    world: int,
    build: Callable,
    cluster,
    cases: dict,
    tmp,
    steps: int,
    lr: float,
    eps: float,
    check_output=None,
    timeout_s: float = 900,
) -> tuple[dict, list]:
    """Each of ``cases`` (key -> ``autopar.plan`` options; ``key[0]`` names the model ``build``
    makes) planned on ``cluster``, saved under ``tmp`` and trained by ``adam_rank`` on ``world``
    gloo ranks, all in one spawn. Returns (key -> its plan, or where planning raised, the traceback
    that configuration's test reports; the ranks' ``adam_rank`` results)."""
    plans, jobs = {}, []
    for i, (key, options) in enumerate(cases.items()):
        try:
            model, inputs = build(key[0])
            plan = autopar.plan(model, cluster, inputs, **options)
        except Exception:  # noqa: BLE001 - reported by that configuration's test
            plans[key] = traceback.format_exc()
            continue
        path = tmp / f"{i}_{key[0]}.json"
        plan.save(path)
        plans[key] = plan
        jobs.append((key, str(path)))
    per_rank = run_on_ranks(adam_rank, world, build, jobs, steps, lr, eps, check_output, timeout_s=timeout_s)
    return plans, per_rank


def saved_bytes(pmodel, inputs) -> int:
    """Bytes of the unique storages autograd saves in one forward of ``pmodel`` (its own
    parameters and buffers left out); runs the backward after it."""
    from torch.distributed.tensor import DTensor

    state = {
        (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage().data_ptr()
        for t in [*pmodel.parameters(), *pmodel.buffers()]
    }
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = pmodel(**inputs).loss
    loss.backward()
    return sum(seen.values())


def kept_bytes(tables, infos, choice: dict[str, int]) -> float:
    """Bytes the cost tables keep for backward on one device under ``choice`` (indices into
    ``tables.strategies``, ``passes/replay.py:table_indices``): the activations' and inputs' nodes,
    every edge's (a consumer's resharded copy), and each storage several consumers keep, once
    (``Edge.keep``, its largest): what ``saved_bytes`` measures autograd keeping."""
    from autopar.passes.trace import Role

    total = sum(
        tables.node_mem[v][choice[v]]
        for v in tables.strategies
        if infos[v].role in (Role.ACTIVATION, Role.INPUT)
    )
    shared: dict[str, float] = {}
    for e in tables.edges:
        a, b = choice[e.src], (choice[e.dst] if e.dst in choice else 0)
        total += e.mem[a][b]
        if e.owner:
            shared[e.owner] = max(shared.get(e.owner, 0.0), e.keep[a][b])
    return total + sum(shared.values())


def force_matmuls(plan, model, inputs, fits):
    """``plan`` with every ``linear``/``mm``/``addmm`` that has a strategy ``fits(node, s)`` (the
    first such, in the order the search is offered them) running it, and each weight or bias whose
    only use is that matmul stored as the matmul takes it (so a 2D or 3D layout keeps it split
    over its grid): (the plan, how many matmuls, how many stored)."""
    import dataclasses

    from autopar.lowerings.matmul_nd import OPERANDS
    from autopar.passes.analyze import analyze
    from autopar.passes.rules import tensor_inputs
    from autopar.passes.strategies import build_strategies
    from autopar.passes.trace import trace
    from autopar.placement import spec_to_str, via_to_str

    tg = trace(model, inputs)
    allowed = build_strategies(tg, analyze(tg), plan.mesh_shape)
    chosen, stored = {}, {}
    for n in tg.graph.nodes:
        if n.op != "call_function" or n.target not in OPERANDS:
            continue
        s = next((s for s in allowed[n.name].strategies if fits(n, s)), None)
        if s is None:
            continue
        chosen[n.name] = s
        for k, inp in enumerate(tensor_inputs(n)):
            if inp.op == "placeholder" and k != OPERANDS[n.target][0] and len(inp.users) == 1:
                stored[inp.name] = s.ins[k]
    decisions = []
    for d in plan.decisions:
        if d.name in chosen:
            s = chosen[d.name]
            d = dataclasses.replace(
                d,
                output=spec_to_str(s.out),
                inputs=tuple(spec_to_str(x) for x in s.ins),
                via=via_to_str(s.via),
            )
        elif d.name in stored:
            d = dataclasses.replace(d, output=spec_to_str(stored[d.name]))
        decisions.append(d)
    return dataclasses.replace(plan, decisions=tuple(decisions)), len(chosen), len(stored)
