"""What the cost tables say a layer keeps for backward under bf16 mixed precision, against what
autograd saves in a real forward of the generated module (CPU autocast; one gloo rank, and two:
TP2, CP2 as a ring and as all-to-all).

Under mixed precision (fp32 masters read as bf16 copies, ``torch.autocast``: ``codegen/
local_params.py``, as FSDP2's ``MixedPrecisionPolicy`` runs every ZeRO stage) a Llama's residual
stream is bf16 (the bf16 embedding feeds it) and the fused ``autopar::rms_norm`` keeps only its
residual sum; its normed output, bf16 too, is kept by the linears that read it. The tables once
charged the norm with both of its outputs (the normed value it never keeps) and its linears with
nothing; before the half copies the stream was fp32 and each linear kept its own bf16 cast.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import kept_bytes

import autopar
from autopar import Precision, Recompute, SeqAttention
from autopar.examples import llama
from autopar.fusion import Kernel
from autopar.launch import free_port, run_on_ranks
from autopar.options import Optimizer
from autopar.passes.analyze import analyze
from autopar.passes.costs import build_costs
from autopar.passes.fuse import fuse
from autopar.passes.kept import kept_for_backward
from autopar.passes.precision import half_infos
from autopar.passes.replay import table_indices
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import trace

CPU1 = autopar.ClusterSpec.preset("cpu", devices_per_node=1)
# one head: attention's output transposed back is contiguous on every device (CPU's kernel lays
# it out otherwise than the traced one, which would add a copy the trace cannot see); rows
# (batch x sequence = 192) unlike any weight's dims, so a saved weight cast is told by its shape
SHAPE = dict(hidden=128, ffn=256, heads=1, kv_heads=1, batch=2, seq=96, vocab=320, dtype="bfloat16")


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(layers: int, shape=SHAPE):
    torch.manual_seed(0)
    return llama(layers=layers, **shape)


def _tables_kept(layers: int, plan=None, shape=SHAPE, cluster=CPU1, plan_roles=()) -> float:
    """Bytes the cost tables keep for backward on one device under ``plan``'s strategies (one
    device: the only one): nodes, edges, and each storage several consumers keep, once."""
    model, inputs = _model(layers, shape)
    tg = trace(model, inputs)
    fuse(tg, set(Kernel))
    infos = analyze(tg)
    cinfos = half_infos(tg, infos, Precision.BF16, cluster.device.kind)
    mesh = tuple(plan.mesh_shape) if plan is not None else (1,)
    roles = tuple(plan_roles) if plan is not None else (autopar.AxisRole.DATA,)
    strats = build_strategies(tg, infos, mesh, roles)
    tables = build_costs(tg, cinfos, strats, cluster, mesh, Optimizer.ADAM, roles)
    choice = table_indices(tables, plan) if plan is not None else dict.fromkeys(tables.strategies, 0)
    return kept_bytes(tables, infos, choice)


def _plan(layers: int, shape=SHAPE, cluster=CPU1, **layout):
    model, inputs = _model(layers, shape)
    return autopar.plan(
        model, cluster, inputs, precision=Precision.BF16, recompute=Recompute.NONE, kernels="all", **layout
    )


def _saved(layers: int, plan=None, shape=SHAPE, cluster=CPU1) -> tuple[int, int]:
    """(bytes of the storages autograd saves in one forward of the generated module, those of them
    that are the bf16 copies of its parameters the forward reads: ``codegen/local_params.py``)."""
    model, inputs = _model(layers, shape)
    plan = plan if plan is not None else _plan(layers, mesh_shape=(1,))
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan)
    from torch.distributed.tensor import DTensor

    local = [
        t._local_tensor if isinstance(t, DTensor) else t for t in [*pmodel.parameters(), *pmodel.buffers()]
    ]
    state = {t.untyped_storage().data_ptr() for t in local}
    weights = {tuple(p.shape) for p in local if p.dim() and p.is_floating_point()}
    seen: dict[int, tuple[int, bool]] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state:
            cast = t.dtype == torch.bfloat16 and tuple(t.shape) in weights
            seen[s.data_ptr()] = (s.nbytes(), cast)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pmodel(**inputs)
    out.loss.backward()
    return sum(b for b, _ in seen.values()), sum(b for b, c in seen.values() if c)


def test_analyze_says_the_fused_norm_keeps_its_residual_sum_alone():
    model, inputs = _model(1)
    tg = trace(model, inputs)
    fuse(tg, {Kernel.RMS_NORM})
    infos = analyze(tg)
    kept = kept_for_backward(tg, infos)
    norms = [i for i in infos.values() if i.target == "autopar.rms_norm.default" and i.requires_grad]
    assert norms
    for info in norms:
        assert info.saved_outputs == (False, True), info
        assert kept.at_node_bytes(info.name, info) == info.output_bytes(1) == info.out_bytes // 2


def test_a_layers_kept_bytes_are_what_autograd_saves_under_mixed_precision(one_rank):
    """Per layer (two layers less one: the embedding and the loss cancel), the tables' kept bytes
    against the bytes autograd saves in the generated module's forward, less the bf16 copies of the
    layer's parameters that the forward reads and autograd keeps (not activations: priced as
    parameter memory, ``passes/trades.py:state_bytes``). The two agree exactly: the bf16 residual
    sums of the two norms, each linear's input, attention's q, k, v, output and log-sum-exp, the
    rotary cos/sin, the MLP's three."""
    per_layer = _tables_kept(2) - _tables_kept(1)
    (all2, casts2), (all1, casts1) = _saved(2), _saved(1)
    measured = (all2 - casts2) - (all1 - casts1)
    assert casts2 > casts1 > 0  # the weight casts were told apart
    assert per_layer == measured, (per_layer, measured)


# two ranks: tensor parallel (two heads, one per rank: its attention output is contiguous), and
# context parallel as a ring (one head) and as all-to-all (two heads, one per rank after it)
LAYOUTS = {
    "tp2": (dict(SHAPE, heads=2, kv_heads=2), dict(mesh_shape=(2,), axis_roles=(autopar.AxisRole.TENSOR,))),
    "cp2-a2a": (
        dict(SHAPE, heads=2, kv_heads=2),
        dict(
            mesh_shape=(2,),
            axis_roles=(autopar.AxisRole.SEQUENCE,),
            sequence_attention=SeqAttention.ALL_TO_ALL,
        ),
    ),
    "cp2-ring": (
        SHAPE,
        dict(mesh_shape=(2,), axis_roles=(autopar.AxisRole.SEQUENCE,), sequence_attention=SeqAttention.RING),
    ),
}


def _saved_rank(rank, world, paths):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}
    for key, layers, path in paths:
        shape = LAYOUTS[key][0]
        out[(key, layers)] = _saved(layers, autopar.Plan.load(path), shape, cluster)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(LAYOUTS))
def test_a_layers_kept_bytes_on_two_ranks_are_what_autograd_saves(key, tmp_path):
    """As above, on each of two gloo ranks, for a tensor-parallel and a context-parallel layout:
    the tables' kept bytes per layer under the plan's strategies against each rank's saved bytes."""
    shape, layout = LAYOUTS[key]
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    plans, paths = {}, []
    for layers in (1, 2):
        plans[layers] = _plan(layers, shape, cluster, **layout)
        path = tmp_path / f"{key}{layers}.json"
        plans[layers].save(path)
        paths.append((key, layers, str(path)))
    attn = [d for d in plans[2].decisions if d.op == "aten.scaled_dot_product_attention.default"]
    # the layout is what it says: attention over the sequence by its algorithm, or its heads split
    assert attn and all((d.via != "") if key.startswith("cp") else d.output == "S(1)" for d in attn), attn
    roles = layout["axis_roles"]
    per_layer = _tables_kept(2, plans[2], shape, cluster, roles) - _tables_kept(
        1, plans[1], shape, cluster, roles
    )
    per_rank = run_on_ranks(_saved_rank, 2, paths, timeout_s=600)
    for got in per_rank:
        (all2, casts2), (all1, casts1) = got[(key, 2)], got[(key, 1)]
        measured = (all2 - casts2) - (all1 - casts1)
        assert per_layer == measured, (key, per_layer, measured)
