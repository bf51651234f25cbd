"""Mixture-of-experts models at published sizes: the plan the search picks, with expert parallelism
searched with every other dimension, its predicted MFU over the active parameters, and how long the
search takes. Models built on the meta device from their Hugging Face configs (no weights).

Rows (model, cluster, global batch in sequences of ``--seq`` tokens):

* Mixtral 8x7B (32 layers, 8 experts, top 2) on 8 and 64 H100;
* Qwen3-235B-A22B (94 layers, 128 experts, top 8) on 256 and 1,024 H100;
* DeepSeek-V3 671B (61 layers, 3 dense, 256 routed experts, top 8, one shared; MLA attention) on
  256 and 2,048 H100;
* the plain-torch MoE (``autopar/models/moe.py``) at Mixtral 8x7B's layer sizes, 2 layers, on 8
  H100, free and forced on a 4 x 2 mesh (expert x tensor): its gate and up are separate tensors;
* Mixtral 8x7B on 8 H100 forced on that 4 x 2 mesh: its packed gate-up stack split on its ``2I``
  dim on the tensor axis (expert tensor parallelism, ``passes/rules/experts.py``, with the weight
  stored permuted: ``autopar/lowerings/experts.py:PackedSplit``).

Per row: the search's seconds, its mesh and axis roles, the MoE layers' layout (experts split over
which axes, by all-to-all or as summands), pipeline and trades, the predicted step and peak, and
MFU = 6 N_active + 12 L H s (per token; N_active: the parameters a token passes through, the input
embedding left out) x tokens per second over the cluster's peak bf16 rate. Routing is priced
balanced (``autopar/lowerings/experts.py:SKEW``), as the Megatron-Bridge performance summary forces
its MoE benchmarks to be.

    .venv/bin/python benchmarks/bench_moe.py                 # every row
    .venv/bin/python benchmarks/bench_moe.py --rows mixtral-8  # one row
    .venv/bin/python benchmarks/bench_moe.py --rows plain-mixtral-2l-8,plain-mixtral-2l-8-ep4xt2  # not in "every"
    .venv/bin/python benchmarks/bench_moe.py --rows mixtral-8,mixtral-64,mixtral-8-ep4xt2
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import autopar
from autopar import Float8, Outputs, Precision


def _tf():
    import transformers

    return transformers


def mixtral():
    return _tf().MixtralForCausalLM, _tf().MixtralConfig(use_cache=False)


def qwen3_235b():
    cfg = _tf().Qwen3MoeConfig(
        hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536, intermediate_size=12288,
        vocab_size=151936, decoder_sparse_step=1, max_position_embeddings=40960, use_cache=False,
    )  # fmt: skip
    return _tf().Qwen3MoeForCausalLM, cfg


def deepseek_v3():
    cfg = _tf().DeepseekV3Config(
        hidden_size=7168, num_hidden_layers=61, first_k_dense_replace=3, intermediate_size=18432,
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
        n_group=8, topk_group=4, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
        use_cache=False,
    )  # fmt: skip
    return _tf().DeepseekV3ForCausalLM, cfg


def plain_mixtral():
    """The plain-torch MoE with Mixtral 8x7B's layer sizes (gate and up separate), 2 layers."""
    from types import SimpleNamespace

    from autopar.models.moe import PlainMoE

    cfg = SimpleNamespace(
        num_hidden_layers=2, hidden_size=4096, num_attention_heads=32, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096,
    )  # fmt: skip

    def build(c):
        return PlainMoE(
            vocab=c.vocab_size, hidden=c.hidden_size, heads=c.num_attention_heads, ffn=c.intermediate_size,
            layers=c.num_hidden_layers, experts=c.num_local_experts, top_k=c.num_experts_per_tok,
            max_seq=c.max_position_embeddings,
        )  # fmt: skip

    return build, cfg


# name -> (model, preset, nodes x 8 GPUs, global batch in sequences[, what the plan is told])
ROWS = {
    "mixtral-8": (mixtral, "h100-sxm", 1, 32),
    "mixtral-64": (mixtral, "h100-sxm", 8, 256),
    "qwen3-235b-256": (qwen3_235b, "h100-sxm", 32, 1024),
    "qwen3-235b-1024": (qwen3_235b, "h100-sxm", 128, 4096),
    "deepseek-v3-256": (deepseek_v3, "h100-sxm", 32, 1024),
    "deepseek-v3-2048": (deepseek_v3, "h100-sxm", 256, 8192),
    "plain-mixtral-2l-8": (plain_mixtral, "h100-sxm", 1, 32),
    "plain-mixtral-2l-8-ep4xt2": (
        plain_mixtral,
        "h100-sxm",
        1,
        32,
        {"mesh_shape": (4, 2), "axis_roles": (autopar.AxisRole.EXPERT, autopar.AxisRole.TENSOR)},
    ),  # fmt: skip
    "mixtral-8-ep4xt2": (
        mixtral,
        "h100-sxm",
        1,
        32,
        {"mesh_shape": (4, 2), "axis_roles": (autopar.AxisRole.EXPERT, autopar.AxisRole.TENSOR)},
    ),  # fmt: skip
}
# rows that are not published models, or force a layout: not run unless asked for by name
EXTRA_ROWS = ("plain-mixtral-2l-8", "plain-mixtral-2l-8-ep4xt2", "mixtral-8-ep4xt2")


def active_params(model, cfg) -> tuple[float, float]:
    """(all parameters, those one token passes through), the input embedding left out of both:
    of each stacked experts' weight ``[E, ...]`` a token uses ``top_k`` of ``E``."""
    top_k = cfg.num_experts_per_tok
    total = active = 0.0
    embed = (
        model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else model.embed.weight
    )
    for name, p in model.named_parameters():
        if p is embed:
            continue
        total += p.numel()
        if (".experts." in name or ".moe.w_" in name) and p.dim() == 3:
            active += p.numel() * top_k / p.shape[0]
        else:
            active += p.numel()
    return total, active


def row(name: str, seq: int) -> str:
    make, preset, nodes, batch, *told = ROWS[name]
    cls, cfg = make()
    with torch.device("meta"):
        model = cls(cfg)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    cluster = autopar.ClusterSpec.preset(preset, nodes, 8)
    total, active = active_params(model, cfg)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        plan = autopar.plan(
            model,
            cluster,
            {"input_ids": ids, "labels": ids},
            outputs=Outputs.LOSS,
            precision=Precision.BF16,
            float8=Float8.OFF,  # bf16 throughout, as the published runs it is set against
            **(told[0] if told else {}),
        )
    except autopar.AutoparError as e:
        return (
            f"| {name} | {nodes * 8} | {time.perf_counter() - t0:.1f} | {type(e).__name__}: {str(e)[:200]} |"
        )
    seconds = time.perf_counter() - t0
    # on a loaded machine the wall time counts the other jobs' too: the planning's own CPU time
    # (every thread of this process, the trace included) is printed beside the row, on stderr
    print(f"{name}: planning took {time.process_time() - c0:.1f} s of CPU", file=sys.stderr, flush=True)
    step = plan.predicted.step_time_s
    flops = (6 * active + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq) * batch * seq
    mfu = flops / step / (nodes * 8) / cluster.device.peak_flops_for("bfloat16")
    moe = [d for d in plan.decisions if d.op == "autopar.moe_experts.default"]
    layout = _moe_layout(plan, moe)
    pp = plan.pipeline.stages if plan.pipeline is not None else 1
    return (
        f"| {name} | {nodes * 8} | {total / 1e9:.0f}B / {active / 1e9:.1f}B | {seconds:.1f} | "
        f"{plan.mesh_shape} | {layout} | {pp} | {plan.trades.describe()} | "
        f"{step * 1e3:.0f} ms | {plan.predicted.peak_memory_bytes / 2**30:.1f} GiB | {100 * mfu:.1f}% |"
    )


def _moe_layout(plan, moe) -> str:
    if not moe:
        return "no MoE op"
    from autopar.placement import ExpertDispatch, is_shard, spec_from_str, via_from_str

    d = moe[0]
    experts = spec_from_str(d.inputs[3])
    via = via_from_str(d.via)
    parts = []
    for a, n in enumerate(plan.mesh_shape):
        if n > 1 and is_shard(experts[a]) and experts[a].dim == 0:
            on = via[a] if a < len(via) else None
            how = {
                ExpertDispatch.ALL_TO_ALL: "all-to-all",
                ExpertDispatch.NODE_ALL_TO_ALL: "all-to-all once per node",
            }.get(on, "summands")
            parts.append(f"EP{n} on axis {a} ({how})")
        elif n > 1 and is_shard(experts[a]):  # each expert's intermediate dim (passes/rules/experts.py)
            parts.append(f"ETP{n} on axis {a}")
    tokens = spec_from_str(d.inputs[0])
    split = [f"axis {a}" for a, p in enumerate(tokens) if is_shard(p) and plan.mesh_shape[a] > 1]
    return "; ".join(parts or ["experts whole"]) + (f"; tokens split on {', '.join(split)}" if split else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--rows", default=",".join(r for r in ROWS if r not in EXTRA_ROWS), help="comma-separated row names"
    )
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence (default 4096)")
    args = ap.parse_args()
    print(
        "| row | GPUs | params (all / active) | search [s] | mesh | MoE layout | stages | trades | step | peak | MFU |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.rows.split(","):
        print(row(name, args.seq), flush=True)


if __name__ == "__main__":
    main()
