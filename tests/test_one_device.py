"""On one device the generated module trains as eager PyTorch does: on the CPU (gloo) and, on a CUDA
machine (skipped elsewhere), on its GPU (NCCL).

One process, world 1, as a user with one GPU runs autopar: Hugging Face GPT-2 and Llama and
the PaLM-style model, in bf16 (the plan's default for a half-precision model: fp32 master weights,
bf16 compute), against the same model in eager PyTorch (bf16 copies of fp32 weights under
``torch.autocast``, ``harness.half_copy_forward``): the losses of three Adam steps and the weights
after them, within bf16's precision. A Llama built on the meta device and loaded from a
``save_pretrained`` folder trains as the model that was saved. Every parameter, gradient and
optimizer state lives on the device.

CI has no GPU: the CUDA cases run on the GPU machines (``benchmarks/gpu_checks.sh``;
``benchmarks/README.md`` says when they last did).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from harness import half_copy_forward
from torch.distributed.tensor import Shard

import autopar
from autopar import examples
from autopar.launch import free_port

STEPS = 3
LR = 1e-3
BF16_LOSS = dict(rtol=2e-2, atol=2e-2)
BF16_STATE = dict(rtol=2e-2, atol=2 * STEPS * LR + 2e-3)  # Adam moves a weight by about LR a step


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
        ),
    ],
)
def device(request, tmp_path_factory):
    """The device type the process group of world 1 runs on (gloo on the CPU, NCCL on a GPU)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if request.param == "cuda":
        torch.cuda.set_device(0)
    store = tmp_path_factory.mktemp("store") / "pg"
    dist.init_process_group(
        "nccl" if request.param == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    yield request.param
    dist.destroy_process_group()


def _build(name: str):
    if name == "palm":
        model, batch = examples.palm_tiny(batch=4, seq=64, layers=2, hidden=128, heads=4, vocab=512)
    else:
        model, batch = getattr(examples, f"{name}_tiny")(batch=4, seq=64, layers=2, hidden=128, vocab=512)
    return model.to(torch.bfloat16), batch


def _eager(model, batch, device: str):
    """(losses, state) of eager PyTorch: fp32 weights read as bf16 copies under bf16 autocast
    (``harness.half_copy_forward``: how autopar runs mixed precision), Adam."""
    model = copy.deepcopy(model).float().to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = half_copy_forward(model, batch, torch.bfloat16, device).loss
        loss.backward()
        losses.append(loss.detach().float().cpu())
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _autopar(model, batch, device: str, home: str | None = None, **kw):
    """(losses, state, plan) of the generated module; every parameter, gradient and optimizer
    state is checked to live on ``home`` (a device type; default: the device). Parameters in host
    memory are pinned where CUDA is there (FSDP2's ``CPUOffloadPolicy`` copies them to the GPU)."""
    pmodel = autopar.autoparallelize(model, autopar.ClusterSpec.local(), batch, **kw)
    opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = pmodel.step(**batch)  # a CPU batch: the module moves it to its device
        losses.append(loss.detach().float().cpu())
        params = dict(pmodel.named_parameters())
        where = [(n, _local(p)) for n, p in params.items()]
        where += [(f"{n}.grad", _local(p.grad)) for n, p in params.items() if p.grad is not None]
        opt.step()
        names = {id(p): n for n, p in params.items()}
        where += [
            (f"{names.get(id(p), '?')}.{k}", _local(v))
            for p, s in opt.state.items()
            for k, v in s.items()
            if torch.is_tensor(v) and v.dim()
        ]
        opt.zero_grad()
        off = [f"{n} on {t.device}" for n, t in where if t.device.type != (home or device)]
        assert not off, f"{len(off)} of {len(where)} tensors off {home or device}: {off[:6]}"
        if kw.get("zero_stage", 0) >= 2:  # FSDP2 holds every parameter (its dim-0 shard of the device)
            mine = [n for n, p in params.items() if getattr(p, "placements", None) != (Shard(0),)]
            assert not mine, f"parameters FSDP2 does not hold: {mine[:6]}"
        if home == "cpu" and device == "cuda":
            assert all(_local(p).is_pinned() for p in pmodel.parameters()), "host parameters not pinned"
    state = {k: v.float().cpu() for k, v in pmodel.full_state_dict().items()}
    return losses, state, pmodel.plan


def _check(got, want, what):
    (g_losses, g_state), (w_losses, w_state) = got, want
    for step, (g, w) in enumerate(zip(g_losses, w_losses)):
        torch.testing.assert_close(g, w, **BF16_LOSS, msg=f"{what}: loss of step {step}")
    assert set(g_state) == set(w_state), f"{what}: state names differ"
    for k in w_state:
        torch.testing.assert_close(
            g_state[k], w_state[k], **BF16_STATE, msg=f"{what}: {k} after {STEPS} steps"
        )


@pytest.mark.parametrize("name", ["gpt2", "llama", "palm"])
def test_bf16_models_train_as_eager(device, name):
    model, batch = _build(name)
    want = _eager(model, batch, device)
    losses, state, plan = _autopar(model, batch, device)
    assert plan.trades.precision is autopar.Precision.BF16
    _check((losses, state), want, name)


@pytest.mark.parametrize(
    "trades",
    [
        dict(recompute=autopar.Recompute.FULL, micro_batches=2),
        dict(zero_stage=3, recompute=autopar.Recompute.SELECTIVE),
        dict(zero_stage=2, offload=autopar.Offload.OPTIMIZER),
        dict(zero_stage=3, offload=autopar.Offload.PARAMETERS, micro_batches=2),
    ],
    ids=["full-recompute-micro2", "zero3-selective", "zero2-offload", "zero3-param-offload-micro2"],
)
def test_trades_on_one_device_train_as_eager(device, trades):
    """The memory-for-time trades on one device: recomputation and micro-batches, FSDP2 over the
    one device, and optimizer and parameter offload (the fp32 masters, their gradients and Adam's state in host
    memory, pinned on a GPU: FSDP2's ``CPUOffloadPolicy``; the one ZeRO that pays on one device)
    train as eager PyTorch does."""
    model, batch = _build("llama")
    want = _eager(model, batch, device)
    offload = trades.get("offload", autopar.Offload.NONE) is not autopar.Offload.NONE
    losses, state, plan = _autopar(model, batch, device, home="cpu" if offload else None, **trades)
    assert plan.trades.zero_stage == trades.get("zero_stage", 0)
    assert plan.trades.micro_batches == trades.get("micro_batches", 1)
    assert plan.trades.offload is trades.get("offload", autopar.Offload.NONE)
    if offload:
        assert plan.predicted.optimizer_bytes == 0 and "offloaded to host" in plan.summary()
    _check((losses, state), want, f"llama with {trades}")


def test_a_meta_llama_loaded_from_a_checkpoint_folder_trains_as_the_saved_model(device, tmp_path):
    model, batch = _build("llama")
    model.save_pretrained(tmp_path / "ckpt")
    with torch.device("meta"):
        meta = type(model)(model.config).to(torch.bfloat16)
    losses, state, _ = _autopar(meta, batch, device, weights=str(tmp_path / "ckpt"))
    _check((losses, state), _eager(model, batch, device), "llama from a checkpoint")


@pytest.mark.parametrize("name", ["gpt2", "llama", "palm"])
def test_fused_kernels_train_as_eager(device, name):
    """Every kernel the model's patterns call for substituted (Triton on a GPU, where ``auto``
    fuses them all; the torch fallbacks on the CPU, where they are forced), the logits never
    computed (``Outputs.LOSS``): the same training as eager PyTorch's unfused model."""
    model, batch = _build(name)
    want = _eager(model, batch, device)
    kernels = None if device == "cuda" else "all"  # auto fuses on accelerators only
    losses, state, plan = _autopar(model, batch, device, kernels=kernels, outputs=autopar.Outputs.LOSS)
    fused = {u.kernel for u in plan.kernels}
    assert autopar.Kernel.LINEAR_CROSS_ENTROPY in fused and len(fused) >= 2, fused
    assert "fused kernels:" in plan.summary()
    _check((losses, state), want, f"{name} with fused kernels")


def test_the_generated_module_runs_under_torch_compile(device):
    """``torch.compile`` of the parallel module with fused kernels: its loss and gradients are
    eager PyTorch's. Inductor on a GPU; on the CPU, dynamo and AOTAutograd (``aot_eager``), which
    trace the module as Inductor does without its C++ build (about 50 s cold; Inductor on the CPU
    matched eager by hand too: ``torch.compile(pmodel)`` on this test's model)."""
    model, batch = examples.llama_tiny(batch=2, seq=32, layers=1, hidden=64, vocab=128)
    ref = copy.deepcopy(model).to(device)
    pmodel = autopar.autoparallelize(
        model, autopar.ClusterSpec.local(), batch, kernels="all", outputs=autopar.Outputs.LOSS
    )
    compiled = torch.compile(pmodel, backend="inductor" if device == "cuda" else "aot_eager")
    on = {k: v.to(device) for k, v in batch.items()}
    loss = compiled(**on).loss
    loss.backward()
    ref_loss = ref(**on).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads = {k: v.grad for k, v in ref.named_parameters()}
    got = pmodel.full_grads()
    for k, g in grads.items():
        torch.testing.assert_close(got[k].float().cpu(), g.float().cpu(), rtol=1e-4, atol=1e-5, msg=k)
