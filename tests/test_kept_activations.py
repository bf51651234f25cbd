"""What the cost tables say a layer keeps for backward under bf16 mixed precision, against what
autograd saves in a real forward of the generated module (one gloo rank, CPU autocast).

Under mixed precision (fp32 masters, ``torch.autocast``) a Llama's residual stream is fp32 (the
fp32 embedding feeds it) and the fused ``autopar::rms_norm`` keeps only its residual sum; its
normed output is fp32 too, but nobody keeps it: each linear that reads it saves its own bf16
cast (autocast caches casts of leaf parameters only). The tables once charged the norm with both
of its outputs (the normed fp32 value it never keeps) and its linears with nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import Precision, Recompute
from autopar.examples import llama
from autopar.fusion import Kernel
from autopar.launch import free_port
from autopar.options import Optimizer
from autopar.passes.analyze import analyze
from autopar.passes.costs import build_costs, kept_for_backward
from autopar.passes.fuse import fuse
from autopar.passes.strategies import build_strategies
from autopar.passes.trace import Role, trace
from autopar.passes.trades import half_infos

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


def _model(layers: int):
    torch.manual_seed(0)
    return llama(layers=layers, **SHAPE)


def _tables_kept(layers: int) -> float:
    """Bytes the cost tables keep for backward on one device: nodes, edges, shared storages once."""
    model, inputs = _model(layers)
    tg = trace(model, inputs)
    fuse(tg, set(Kernel))
    infos = analyze(tg)
    cinfos = half_infos(tg, infos, Precision.BF16, CPU1.device.kind)
    roles = (autopar.AxisRole.DATA,)
    strats = build_strategies(tg, infos, (1,), roles)
    tables = build_costs(tg, cinfos, strats, CPU1, (1,), Optimizer.ADAM, roles)
    total = sum(
        tables.node_mem[v][0] for v in tables.strategies if infos[v].role in (Role.ACTIVATION, Role.INPUT)
    )
    shared: dict[str, float] = {}
    for e in tables.edges:
        total += e.mem[0][0]
        if e.owner:
            shared[e.owner] = max(shared.get(e.owner, 0.0), e.keep[0][0])
    return total + sum(shared.values())


def _saved(layers: int) -> tuple[int, int]:
    """(bytes of the storages autograd saves in one forward of the generated module, those of them
    that are bf16 casts of its parameters)."""
    model, inputs = _model(layers)
    plan = autopar.plan(
        model,
        CPU1,
        inputs,
        precision=Precision.BF16,
        recompute=Recompute.NONE,
        kernels="all",
        mesh_shape=(1,),
    )
    pmodel = autopar.autoparallelize(model, CPU1, inputs, plan=plan)
    from torch.distributed.tensor import DTensor

    local = [
        t._local_tensor if isinstance(t, DTensor) else t for t in [*pmodel.parameters(), *pmodel.buffers()]
    ]
    state = {t.untyped_storage().data_ptr() for t in local}
    weights = {tuple(p.shape) for p in local if p.dim() == 2}
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
    against the bytes autograd saves in the generated module's forward, less the bf16 casts of the
    layer's weights that autocast makes and autograd keeps (not activations: priced nowhere here).
    The two agree exactly: the fp32 residual sums of the two norms, each linear's bf16 cast of its
    input, attention's q, k, v, output and log-sum-exp, the rotary cos/sin, the MLP's three."""
    per_layer = _tables_kept(2) - _tables_kept(1)
    (all2, casts2), (all1, casts1) = _saved(2), _saved(1)
    measured = (all2 - casts2) - (all1 - casts1)
    assert casts2 > casts1 > 0  # the weight casts were told apart
    assert per_layer == measured, (per_layer, measured)
