"""ZeRO 1-3, optimizer and parameter offload and mixed precision as the parallel module runs them
(``codegen/zero.py``), against the single-device model.

The parent plans each model once per mesh with ``autopar.plan`` and forces each configuration's
trades with ``dataclasses.replace(plan, trades=Trades(...))``; one spawn per world size builds every
configuration with ``autoparallelize(..., plan=path)`` and trains two Adam steps with
``pmodel.optimizer(torch.optim.Adam, lr=LR)``: the losses, the first step's full gradients (Adam
hardly sees a gradient's scale: these catch one reduced twice or never) and ``full_state_dict()``
equal the single-device model's (fp32: tight; bf16 mixed precision: against the model run on half
copies of its fp32 weights under ``torch.autocast("cpu", dtype=torch.bfloat16)``,
``harness.half_copy_forward``, as every ZeRO stage runs it, within bf16's precision).

World 2 is a (2,) data-parallel mesh, world 4 a (2, 2) data x tensor mesh (TP x ZeRO). Memory
moves as each stage says, per rank, measured as the bytes of the distinct local storages held
(``_bytes``) against ``whole``, the bytes of this rank's parameters without ZeRO (the plan's
tensor-parallel pieces): with ``d`` the data axis's size, the optimizer state held after the step
is ``2 whole / d`` from ZeRO-1 on (Adam's two moments; else ``2 whole``), the gradients ``whole / d``
from ZeRO-1 on (ZeRO-1 reduce-scatters its gradient buckets into the shares it steps; a
parameter reduced inline keeps its whole gradient, a few percent here), the parameters the forward leaves gathered ``whole / d`` under ZeRO-3 only (ZeRO-2
keeps them gathered until backward ends), the parameters held after the step ``whole / d`` from
ZeRO-2 on (FSDP2 keeps only the shards between steps), each within 10%. Parameters FSDP2 must not shard (their
gradient is whole already, ``codegen/zero.py``) stay whole: a few percent at most here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import D, T, assert_adam_state_close, half_copy_forward
from torch.distributed.tensor import DTensor

import autopar
from autopar.codegen.module import full_tensor
from autopar.examples import gpt2_tiny, llama_tiny, palm_tiny
from autopar.launch import run_on_ranks
from autopar.placement import volume_factor
from autopar.trades import Offload, Precision, Trades, TradesError, ZeroStage

LR = 1e-3
STEPS = 2
FP32 = dict(rtol=1e-4, atol=1e-5)
BF16_LOSS = dict(rtol=2e-2, atol=2e-2)
BF16_GRAD = dict(rtol=5e-2, atol=5e-3)
BF16_STATE = dict(rtol=2e-2, atol=2 * STEPS * LR + 2e-3)  # Adam moves a weight by about LR a step
MEMORY_TOLERANCE = 0.10
# FSDP2 groups per ZeRO stage on these 2-layer models: ZeRO 2 and 3 one per block and the root's
GROUPS = {1: 0, 2: 3, 3: 3}


def _qwen3_tiny():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.Qwen3Config(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=128, max_position_embeddings=64, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return tf.Qwen3ForCausalLM(cfg), {"input_ids": ids, "labels": ids}


MODELS = {
    "gpt2": lambda: gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "llama": lambda: llama_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "palm": lambda: palm_tiny(batch=4, seq=16, hidden=32, vocab=128),
    "qwen3": _qwen3_tiny,
}
MESHES = {2: ((2,), (D,)), 4: ((2, 2), (D, T))}
BF16 = Precision.BF16
# world -> configuration name -> (zero stage, precision, offload, models)
CONFIGS = {
    2: {
        "zero1": (1, Precision.PARAM, Offload.NONE, tuple(MODELS)),
        "zero2": (2, Precision.PARAM, Offload.NONE, tuple(MODELS)),
        "zero3": (3, Precision.PARAM, Offload.NONE, tuple(MODELS)),
        "zero3 offload": (3, Precision.PARAM, Offload.PARAMETERS, ("gpt2", "llama")),
        "zero1 bf16": (1, BF16, Offload.NONE, ("gpt2",)),
        "zero3 bf16": (3, BF16, Offload.NONE, ("llama", "palm")),
    },
    4: {  # TP x ZeRO; models whose (2, 2) plans solve in seconds (llama's and qwen3's take tens)
        "zero3": (3, Precision.PARAM, Offload.NONE, ("gpt2", "palm")),
        "zero2 offload": (2, Precision.PARAM, Offload.OPTIMIZER, ("palm",)),
    },
}


def _build(name):
    return MODELS[name]()


def _bytes(tensors) -> int:
    """Bytes of the distinct storages under ``tensors`` (a DTensor's: its local tensor's); a storage
    FSDP2 freed counts 0."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        t = t._local_tensor if isinstance(t, DTensor) else t
        s = t.untyped_storage()
        seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def _opt_state(opt):
    """Tensors of the optimizer state this rank holds (ZeRO-1: its shares' state)."""
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _plan_bytes(pmodel) -> int:
    """Bytes of this rank's pieces of the parameters under the plan's placements, before ZeRO."""
    total = 0
    for attr, spec in pmodel._state_specs.values():
        p = getattr(pmodel.local, attr)
        if isinstance(p, torch.nn.Parameter):
            if isinstance(p, DTensor) and p.device_mesh.ndim < pmodel.mesh.ndim:
                # torch < 2.13: FSDP2 shards the plan's piece on the data axis's own mesh, where
                # the piece is the whole
                total += p.numel() * p.element_size()
            else:
                total += p.numel() // volume_factor(spec, tuple(pmodel.mesh.shape)) * p.element_size()
    return total


def _full_grads(pmodel) -> dict[str, torch.Tensor]:
    """State-dict name -> the full gradient (FSDP2's shards gathered over the data axes, then the
    plan's pieces); collective. Adam's step hardly sees a gradient's scale: this sees a gradient
    reduced twice, or not at all."""
    full = {}
    for fqn, (attr, spec) in pmodel._state_specs.items():
        p = getattr(pmodel.local, attr)
        if isinstance(p, torch.nn.Parameter) and p.grad is not None:
            full[fqn] = full_tensor(p.grad, spec, pmodel.mesh).clone()
    return {name: full[fqn] for name, fqn in pmodel._aliases.items() if fqn in full}


def _rank(rank, world, jobs):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    results = {}
    for key, path in jobs:
        model, inputs = _build(key[0])
        pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
        opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
        whole = _plan_bytes(pmodel)
        losses, mem = [], {}
        for step in range(STEPS):
            out = pmodel(**inputs)
            if step == 0:
                mem["params_forward"] = _bytes(pmodel.parameters())
            out.loss.backward()
            losses.append(out.loss.detach().float())
            if step == 0:
                mem["grads"] = _bytes(p.grad for p in pmodel.parameters())
                grads = _full_grads(pmodel)
            before = [p.detach().clone() for p in pmodel.parameters()]
            opt.step()
            moved = any(not torch.equal(b, p.detach()) for b, p in zip(before, pmodel.parameters()))
            if step == 0:
                mem["optimizer"] = _bytes(_opt_state(opt))
                mem["params"] = _bytes(pmodel.parameters())
                state = _opt_state(opt)
                devices = {
                    "params": {p.device.type for p in pmodel.parameters()},
                    "grads": {p.grad.device.type for p in pmodel.parameters() if p.grad is not None},
                    "optimizer": {t.device.type for t in state if t.dim() > 0},
                    # the optimizer steps the module's parameters (ZeRO-1: through their shares)
                    "stepped": moved
                    and all(
                        any(q is p for q in pmodel.parameters())
                        for p in getattr(opt, "params", [p for g in opt.param_groups for p in g["params"]])
                    ),  # fmt: skip
                    "fsdp": len(pmodel.zero.fsdp_modules),
                    # mixed precision: fp32 masters and gradients, the forward in bf16
                    "dtypes": {p.dtype for p in pmodel.parameters()}
                    | {p.grad.dtype for p in pmodel.parameters() if p.grad is not None},
                    # computed in bf16: every value a bf16 (the traced graph may return an fp32 copy:
                    # Hugging Face's loss upcasts the logits, a no-op the fp32 trace made the output)
                    "half_logits": torch.equal(out.logits.float(), out.logits.bfloat16().float()),
                }
            opt.zero_grad()
        results[key] = (losses, grads, pmodel.full_state_dict(), whole, mem, devices)
    return results


def _reference(name: str, precision: Precision):
    """(losses, gradients of the first step, state after the steps) of the single-device model
    with the same Adam steps."""
    model, inputs = _build(name)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(STEPS):
        if precision is BF16:  # every ZeRO stage reads half copies of the fp32 masters
            out = half_copy_forward(model, inputs, torch.bfloat16)
        else:
            out = model(**inputs)
        loss = out.loss
        loss.backward()
        losses.append(loss.detach().float())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _expected(zero: int, whole: int, d: int) -> dict[str, float]:
    """Bytes each stage leaves per rank (module docstring)."""
    return {
        "optimizer": 2 * whole / (d if zero >= 1 else 1),
        # ZeRO-1 reduce-scatters its buckets into the shares (codegen/grad_sync.py), ZeRO-2/3 FSDP2
        "grads": whole / (d if zero >= 1 else 1),
        "params_forward": whole / (d if zero >= 3 else 1),
        "params": whole / (d if zero >= 2 else 1),  # FSDP2 keeps only the shards between steps
    }


def _run_world(world: int, tmp_path):
    mesh, roles = MESHES[world]
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    jobs, base = [], {}
    for name in MODELS:
        configs = {c: v for c, v in CONFIGS[world].items() if name in v[3]}
        if not configs:
            continue
        model, inputs = _build(name)
        base[name] = autopar.plan(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
        for config, (zero, precision, offload, _) in configs.items():
            trades = Trades(zero_stage=ZeroStage(zero), data_axes=(0,), precision=precision, offload=offload)
            path = tmp_path / f"{name}_{config.replace(' ', '_')}_{world}.json"
            dataclasses.replace(base[name], trades=trades).save(path)
            jobs.append(((name, config), str(path)))
    return jobs, run_on_ranks(_rank, world, jobs, timeout_s=600)


def _check(world: int, jobs, per_rank):
    d = MESHES[world][0][0]
    refs = {}
    report = []
    for (name, config), _ in jobs:
        zero, precision, offload, _ = CONFIGS[world][config]
        if (name, precision) not in refs:
            refs[(name, precision)] = _reference(name, precision)
        ref_losses, ref_grads, ref_state = refs[(name, precision)]
        loss_tol, grad_tol = (BF16_LOSS, BF16_GRAD) if precision is BF16 else (FP32, FP32)
        for rank, results in enumerate(per_rank):
            losses, grads, state, whole, mem, devices = results[(name, config)]
            where = f"{name} {config} world {world} rank {rank}"
            for step, (got, want) in enumerate(zip(losses, ref_losses)):
                torch.testing.assert_close(got, want, **loss_tol, msg=f"{where}: loss of step {step}")
            assert set(ref_grads) <= set(grads), f"{where}: no gradient for {set(ref_grads) - set(grads)}"
            for k in ref_grads:
                torch.testing.assert_close(
                    grads[k], ref_grads[k], **grad_tol, msg=f"{where}: gradient of {k}"
                )
            assert set(state) == set(ref_state), f"{where}: state names differ"
            for k in ref_state:
                label = f"{where}: {k} after {STEPS} steps"
                if precision is BF16:
                    torch.testing.assert_close(
                        state[k].float(), ref_state[k].float(), **BF16_STATE, msg=label
                    )
                else:
                    assert_adam_state_close(state[k], ref_state[k], LR, STEPS, label)
            for what, want in _expected(zero, whole, d).items():
                got = mem[what]
                assert abs(got / want - 1) <= MEMORY_TOLERANCE, (
                    f"{where}: {what} {got} bytes, expected {want:.0f} (whole {whole}, ZeRO-{zero} over {d} ranks)"
                )
            assert devices["dtypes"] == {torch.float32}, (
                f"{where}: parameters and gradients in {devices['dtypes']}"
            )
            assert devices["half_logits"] == (precision is BF16), (
                f"{where}: the forward ran in the wrong precision"
            )
            assert devices["stepped"], f"{where}: the optimizer's step did not update the module's parameters"
            assert devices["fsdp"] == GROUPS[zero], f"{where}: {devices['fsdp']} FSDP2 groups"
            if offload is not Offload.NONE:  # on CPU ranks the host is the device: where the plan puts them
                for what in ("params", "grads", "optimizer"):
                    assert devices[what] == {"cpu"}, f"{where}: {what} on {devices[what]}"
            if rank == 0:
                report.append(
                    f"{name} {config}: whole {whole} B, " + ", ".join(f"{k} {v} B" for k, v in mem.items())
                )
    print(f"\nworld {world} per-rank bytes (rank 0):\n" + "\n".join(report))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero_stages_offload_and_mixed_precision_match_the_single_device_model(world, tmp_path):
    jobs, per_rank = _run_world(world, tmp_path)
    _check(world, jobs, per_rank)


def test_each_offload_runs_with_its_one_zero_stage():
    """Offload runs through FSDP2, which needs the sharded parameters of ZeRO-2/3; the stage decides
    what the device keeps, so optimizer offload is ZeRO-2's and parameter offload ZeRO-3's."""
    for offload, stage in (
        (Offload.OPTIMIZER, ZeroStage.GRADIENTS),
        (Offload.PARAMETERS, ZeroStage.PARAMETERS),
    ):
        assert Trades(zero_stage=stage, data_axes=(0,), offload=offload).offload is offload
        for zero in set(ZeroStage) - {stage}:
            with pytest.raises(TradesError, match=f"needs zero_stage={int(stage)}"):
                Trades(zero_stage=zero, data_axes=(0,), offload=offload)
