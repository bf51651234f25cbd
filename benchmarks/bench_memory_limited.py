"""Planning under a memory limit, as a user short of memory plans: how long the search takes.

For each model (2 layers, hidden 32, built from its config: no downloads), on ``--devices`` cpu
devices (the ``cpu`` preset), the free plan first, then the plan under a memory limit of
``--fraction`` x the free plan's predicted peak (the limit such that the peak the search may use,
after the cluster's memory reserve, is that fraction). Printed per model: the seconds of each
search, the free plan's predicted step, peak and mesh, the limited plan's and its ZeRO stage, or
the error. With ``-v``
the limited search's progress lines, timed.

The models: Llama, Gemma 2 (sliding window and soft-capping), Cohere, Granite, a DeepSeek-V3-style
model (MLA attention, grouped routing, a shared expert), Mamba (selective state space), and the
Hugging Face models of ``bench_any_model.py`` named with ``--models``.

    .venv/bin/python benchmarks/bench_memory_limited.py                      # the six above
    .venv/bin/python benchmarks/bench_memory_limited.py --models gemma2,mamba -v
"""

from __future__ import annotations

import argparse
import time

import torch

import autopar

try:
    import bench_any_model as any_model
except ImportError:  # run as a module from the checkout's root
    from benchmarks import bench_any_model as any_model

H, L, HEADS = any_model.HIDDEN, any_model.LAYERS, any_model.HEADS
LM = any_model.LM


def _tf():
    return any_model._tf()


def _attention(**more) -> dict:
    return dict(
        num_hidden_layers=L, hidden_size=H, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=2, max_position_embeddings=64, **LM, **more,
    )  # fmt: skip


def llama():
    return any_model._lm(_tf().LlamaForCausalLM(_tf().LlamaConfig(**_attention())))


def gemma2():
    cfg = _tf().Gemma2Config(**_attention(head_dim=8, sliding_window=8, attention_dropout=0.0))
    return any_model._lm(_tf().Gemma2ForCausalLM(cfg))


def cohere():
    return any_model._lm(_tf().CohereForCausalLM(_tf().CohereConfig(**_attention())))


def granite():
    return any_model._lm(_tf().GraniteForCausalLM(_tf().GraniteConfig(**_attention())))


def deepseek_v3():
    cfg = _tf().DeepseekV3Config(
        **(_attention() | dict(num_key_value_heads=HEADS)), moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    return any_model._lm(_tf().DeepseekV3ForCausalLM(cfg))


def mamba():
    cfg = _tf().MambaConfig(
        num_hidden_layers=L, hidden_size=H, state_size=8, vocab_size=any_model.VOCAB, use_cache=False
    )
    return any_model._lm(_tf().MambaForCausalLM(cfg))


OWN = {f.__name__: f for f in (llama, gemma2, cohere, granite, deepseek_v3, mamba)}


def build(name: str):
    torch.manual_seed(0)
    return OWN[name]() if name in OWN else any_model.build(name)


def limited(name: str, devices: int, fraction: float, verbose: bool) -> str:
    model, inputs = build(name)
    spec = autopar.ClusterSpec.preset("cpu", devices_per_node=devices)
    t0 = time.perf_counter()
    free = autopar.plan(model, spec, inputs)
    t_free = time.perf_counter() - t0
    limit = fraction * free.predicted.peak_memory_bytes / (1 - spec.memory_reserve)
    t0 = time.perf_counter()
    progress = (
        (lambda s: print(f"    {time.perf_counter() - t0:7.2f} s  {s}", flush=True)) if verbose else None
    )
    try:
        p = autopar.plan(model, spec, inputs, memory_limit_bytes=limit, progress=progress)
        got = (
            f"{p.predicted.step_time_s * 1e3:.2f} ms, peak {p.predicted.peak_memory_bytes / 2**20:.3f} MiB, "
            f"mesh {p.mesh_shape}, ZeRO {int(p.trades.zero_stage)}"
        )
    except autopar.AutoparError as e:
        got = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    t_limited = time.perf_counter() - t0
    free_plan = (
        f"{free.predicted.step_time_s * 1e3:.2f} ms, peak {free.predicted.peak_memory_bytes / 2**20:.3f} MiB, "
        f"mesh {free.mesh_shape}"
    )
    return f"| {name} | {t_free:.1f} | {free_plan} | {t_limited:.1f} | {got} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(OWN), help="comma-separated model names")
    ap.add_argument("--devices", type=int, default=4, help="cpu devices (default 4)")
    ap.add_argument("--fraction", type=float, default=0.6, help="limit as a fraction of the free peak")
    ap.add_argument("-v", "--verbose", action="store_true", help="the limited search's progress lines")
    args = ap.parse_args()
    print(f"# {args.devices} cpu devices, limit {args.fraction} x the free plan's peak")
    print("| model | free search [s] | free plan | limited search [s] | limited plan |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        print(limited(name, args.devices, args.fraction, args.verbose), flush=True)


if __name__ == "__main__":
    main()
