"""Published, measured training runs of transformers, dense and mixture-of-experts: the rows of
``bench_published.py``.

Each ``Run`` holds what its source states (model shape, precision, sequence, global batch, the
layout, the measured throughput and how the source counts it) and nothing else: a field the source
does not give is None, and the bench leaves that decision to autopar's search. Every figure is
cited in ``source``; a run whose figures could not be read in a source named here is left out.

Sources (read in the files named; the paper figures were checked against these copies):

* [SC21] Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC'21, Table 1 (weak scaling, A100 80GB, seq 2048, vocab 51,200): the figures as
  the NVIDIA/Megatron-LM README published them (``images/cases_april2021.png`` at commit
  2e90a342f5: hidden, layers, model-parallel size, GPUs, batch, achieved TFLOP/s per GPU), the
  layout of each row from ``examples/academic_paper_scripts/sc21/run_table_1.sh`` (TP, PP, MBS,
  GBS, heads, ``--activations-checkpoint-method uniform``, ``--num-layers-per-virtual-pipeline-stage``)
  and ``CONFIG.sh`` (``--fp16``). FLOPs: the paper's 96 B s l h^2 (1 + s/6h + V/16lh), which
  counts full recomputation (a second forward) and the whole s^2 attention.
* [SAR] Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022:
  Table 3 (configurations: TP, PP, GPUs, global and micro batch; interleaved schedule with 3
  chunks per rank for 175B and 530B) and Table 5 (MFU with sequence parallelism and selective
  recomputation), as transcribed in a public note (search index file id 55271916660); the four
  MFUs also in the Megatron-LM README at commit 2e90a342f5 ("measured using a data parallel size
  of one"). MFU: 72 B s l h^2 (1 + s/6h + V/12lh) over 312 TFLOP/s (Appendix A, Eq. 7).
* [MCORE] NVIDIA/Megatron-LM README (2026-08 snapshot, d98e8a64), "Performance Benchmarking",
  ``images/model_table.png``: GPT models 2B-462B on H100, seq 4096, vocab 131,072, DP 48, with
  TP/PP/batch and per-GPU TFLOP/s (Megatron-Core r0.8.0, ``images/strong_scaling.png``); overlap
  of DP (``--overlap-grad-reduce``, ``--overlap-param-gather``, which needs the distributed
  optimizer: ZeRO-1), TP and PP communication. Micro-batch, schedule and recomputation are not
  given. FLOPs: ``num_floating_point_operations`` of ``megatron/training/training.py`` at the
  README's commit f2e5db402c (2024-07): 12 B s L h^2 ((1 + g/a + s/h) q/h + f/h + V/2Lh), i.e.
  72 B s L h^2 (1 + s/6h + V/12Lh) for these MHA, 4h-MLP models: no recomputation, whole s^2.
* [LLAMA3] Dubey et al., "The Llama 3 Herd of Models", 2024, Table 4 (405B on H100: GPUs, TP, CP,
  PP, DP, seq, batch per DP rank, 16M tokens per batch, TFLOP/s per GPU, MFU), the GPUs / TP / CP
  / PP / tokens / TFLOP/s columns as shown in Balaji, SC'24 ("Herding Llamas"), transcribed at
  glennklockwood.com/garden/llama-3.1; the 8K pre-training and 128K long-context stages as the
  paper describes them. The table gives neither the schedule, micro-batch, recomputation nor
  FSDP stage; its FLOP count is not stated: counted here as 6 N + 12 L h s per token (N without
  the input embedding; PaLM appendix B, as Meta's torchtitan counts).
* [TT] pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (Tables 1, 3: Llama 3.1
  8B, FSDP, bf16, selective "op" activation checkpointing, tokens/s per GPU, memory) and
  ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (bf16 vanilla-TP rows), with each run's
  ``train_configs/llama3_{8b,70b}.toml`` at the commit it names (seq 8192). Grand Teton hosts:
  H100 96GB HBM2e at 500 W, 400 Gb/s RDMA per GPU (``docs/performance.md``): priced on the
  ``h100-96gb`` preset (its bandwidth and memory; the 500 W cap is not priced). The eager rows
  ran torch's unfused ops: priced with no fused kernels (``kernels="none"``).
  ``benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md``: Llama 3.1 8B on H200, Float8.
* [MPT] mosaicml/llm-foundry ``scripts/train/benchmarking/README.md`` (commit 49521837, 2024-04):
  MPT on A100 and H100, FSDP sharding strategy, activation checkpointing, micro-batch, gradient
  accumulation, global batch, tokens/s per GPU, MFU; model shapes from
  ``scripts/train/yamls/pretrain/mpt-*.yaml`` (vocab 50,368, 4h MLP, tied embeddings; the
  table's parameter counts include learned positions).
* [BRIDGE] NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary-archive.md``, 25.11 container,
  DGX-B200 pre-training (Llama 3 8B, FP8).
* [DGXC] NVIDIA/dgxc-benchmarking ``deepseek_v3/pretraining/README.md`` (commit 1f6d9f40e4), "H100
  Performance": DeepSeek-V3 671B in BF16 (NeMo 25.04, Megatron-Core) on 512 and 1,024 H100, seq
  4096, TP2, PP 8 / 16, EP64 (ETP1), DP32, VP1, micro-batch 1, global batch 4,096 / 8,192; training
  step 48.948 / 52.04 s (iterations 11-44), 174.02 / 163.7 TFLOP/s per GPU by NeMo's own count.
  Compared here as tokens/s per GPU from the step time (seq x GBS / step / GPUs), which no FLOP
  convention enters. The model: ``bench_moe.deepseek_v3`` (its Hugging Face config, MTP left out as
  the recipe's table lists none). The dispatcher: the launcher runs NeMo's
  ``scripts/performance/llm/pretrain_deepseek_v3.py``, which adds ``MegatronTokenDropCallback``
  (capacity factor 1, padded), and that callback asserts Megatron's ``"alltoall"`` dispatcher: the
  flat all-to-all, forced here (``Run.dispatch``), not DeepEP's dispatch once per node.
* [MZOO] yanring/Megatron-MoE-ModelZoo ``best_practice/Qwen3/readme.md`` (commit c1ad0b5c89), the
  Megatron-Core MoE team's measured runs on 256 H100 (NVLink 4, InfiniBand 8 x 50 GB/s): Qwen3-235B-A22B
  in BF16, seq 4096, global batch 2,048, the "cross-node EP" row without 1F1B A2A overlap: DeepEP
  dispatcher, TP2, EP32 (ETP1, EDP1), PP8 with 4 virtual stages, DP16, micro-batch 1, selective
  recomputation of the norms and the activation, step 19.7 s (245 TFLOP/s per GPU by its count).
  Compared as tokens/s per GPU from the step time. Not given: the ZeRO stage (left to the search).
  The model: ``bench_moe.qwen3_235b``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar import Float8, Precision, Recompute, Schedule, ZeroStage
from autopar.placement import ExpertDispatch

MEASURES = {
    "tflops": "TFLOP/s per GPU",
    "mfu": "MFU",
    "tokens": "tokens/s per GPU",
}

# how a source counts FLOPs (``bench_published.flops`` computes each)
FLOP_COUNTS = {
    "sc21": "96 B s l h^2 (1 + s/6h + V/16lh): full recomputation and whole s^2 attention counted",
    "megatron": "72 B s l h^2 (1 + s/6h + V/12lh): no recomputation, whole s^2 attention",
    "palm": "6 N + 12 L h s per token (N without input embedding): no recomputation, whole s^2",
    "tokens": "tokens, no FLOPs",
}


@dataclass(frozen=True)
class Run:
    """One published run. ``model``: keyword arguments of ``autopar.examples.gpt3`` or ``llama``
    (``family``) less batch and sequence; ``batch``: global batch in sequences. Layout fields
    None: not given by the source (the search chooses). ``measured`` in ``measure``
    (``MEASURES``), counted as ``flops`` says (``FLOP_COUNTS``). ``memory_gib``: the published
    peak memory per GPU, where given. ``unpriceable``: why autopar cannot express the run."""

    name: str
    source: str
    cluster: str  # preset:nodes x devices per node
    family: str  # "gpt" | "llama" | "deepseek_v3" (``bench_moe``'s config; ``model`` empty)
    model: dict
    seq: int
    batch: int
    precision: Precision
    measured: float
    measure: str
    flops: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    # expert parallelism: the experts split over ``ep`` ranks (Megatron folds it over TP x DP)
    ep: int = 1
    schedule: Schedule | None = None
    virtual: int | None = None
    mbs: int | None = None
    recompute: Recompute | None = None
    zero: ZeroStage | None = None
    sp: bool | None = None  # Megatron sequence parallelism over the TP group
    # whether the run overlapped its tensor-parallel collectives with the matmuls next to them
    # (Transformer Engine's userbuffers, torchtitan's async TP), as ``autopar.plan``'s
    # ``overlap_matmuls``: False where the source ran them blocking (Megatron-LM before TE's TP
    # overlap, 2021-22: [SC21], [SAR]; torchtitan's "vanilla TP" rows); None: autopar's choice
    tp_overlap: bool | None = None
    memory_gib: float | None = None
    unpriceable: str | None = None
    notes: str = ""
    bf16_params: bool = field(default=False)  # "pure" bf16: parameters and optimizer state in bf16
    # the fused kernels the run's implementation had, as ``autopar.plan``'s ``kernels`` ("none": an
    # eager run of torch's own ops); None: autopar's choice (every kernel on a GPU)
    kernels: str | None = None
    # how the run dispatched tokens to experts: ExpertDispatch.ALL_TO_ALL for Megatron's "alltoall"
    # dispatcher (forced: no dispatch once per node); None: autopar's choice (DeepEP's runs)
    dispatch: ExpertDispatch | None = None
    # how the run computed attention: "sdpa" (FlashAttention, fused) or "eager" (the s^2 scores
    # materialized, as Megatron-LM did before FlashAttention: [SC21]). [SAR]'s runs materialized them
    # too, but its selective recomputation recomputes exactly that core, keeping no s^2 tensor;
    # autopar's SELECTIVE keeps every matmul's output, the scores included, so those rows take
    # "sdpa", which keeps none either (eager: the 530B row does not fit)
    attention: str = "sdpa"
    # FP8 linears as the run had them (torchao's float8 training, Transformer Engine's current
    # scaling: one scale per tensor); OFF: none, and the search may not add them either
    float8: Float8 = Float8.OFF


F16, B16 = Precision.FP16, Precision.BF16
FULL, SEL, NONE = Recompute.FULL, Recompute.SELECTIVE, Recompute.NONE
OP = Recompute.HALF_MATMULS  # torchtitan's selective op-level checkpointing (its default option)
Z0, Z1, Z2, Z3 = ZeroStage.NONE, ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS
S1, SI = Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B


def _sc21(size, hidden, layers, heads, tp, pp, mbs, gbs, gpus, tflops, virtual=None):
    """A row of [SC21] Table 1: fp16, full ("uniform") recomputation, DDP (no ZeRO), TP within a
    node, the pipeline across nodes, the rest data parallel."""
    return Run(
        f"sc21-{size}-{gpus}xa100", "[SC21] Table 1; run_table_1.sh", f"a100-80gb:{gpus // 8}x8", "gpt",
        dict(layers=layers, hidden=hidden, heads=heads, vocab=51200), 2048, gbs, F16, tflops, "tflops", "sc21",
        tp=tp, pp=pp, dp=gpus // (tp * pp), schedule=(SI if virtual else S1) if pp > 1 else None,
        virtual=virtual if pp > 1 else None, mbs=mbs, recompute=FULL, zero=Z0, sp=False,
        attention="eager", tp_overlap=False,
    )  # fmt: skip


def _sar(size, hidden, layers, heads, pp, gbs, mbs, gpus, mfu, virtual=None):
    """A row of [SAR] Tables 3 and 5: TP 8, sequence parallelism, selective recomputation, no DP."""
    return Run(
        f"sar-{size}-{gpus}xa100", "[SAR] Tables 3, 5", f"a100-80gb:{gpus // 8}x8", "gpt",
        dict(layers=layers, hidden=hidden, heads=heads, vocab=51200), 2048, gbs, B16, mfu, "mfu", "megatron",
        tp=8, pp=pp, dp=1, schedule=(SI if virtual else S1) if pp > 1 else None, virtual=virtual, mbs=mbs,
        recompute=SEL, zero=Z0, sp=True, tp_overlap=False,
        notes="mixed precision (type not stated; bf16 priced, fp16 is priced the same)",
    )  # fmt: skip


def _mcore(size, heads, hidden, layers, tp, pp, gpus, gbs, tflops):
    """A row of [MCORE]: DP 48, distributed optimizer (ZeRO-1), bf16 (MFU is over the bf16 peak);
    micro-batch, schedule and recomputation left to the search."""
    return Run(
        f"mcore-{size}-{gpus}xh100", "[MCORE] model_table.png", f"h100-sxm:{gpus // 8}x8", "gpt",
        dict(layers=layers, hidden=hidden, heads=heads, vocab=131072), 4096, gbs, B16, tflops, "tflops", "megatron",
        tp=tp, pp=pp, dp=gpus // (tp * pp), zero=Z1, sp=tp > 1 or None,
        notes="tied embeddings priced (the source's count has an untied head)",
    )  # fmt: skip


def _mpt(size, hidden, layers, heads, seq, gpus, preset, mbs, ga, gbs, tps, zero, ac, pure):
    """A row of [MPT]: FSDP over every GPU (FULL_SHARD: ZeRO-3, SHARD_GRAD_OP: ZeRO-2), activation
    checkpointing of every block (full) or none; ``pure``: MP mode PURE (bf16 parameters)."""
    return Run(
        f"mpt-{size}-{gpus}x{preset.split('-')[0]}{'-40gb' if preset == 'a100-40gb' else ''}",
        "[MPT] README tables", f"{preset}:{max(gpus // 8, 1)}x{min(gpus, 8)}", "gpt",
        dict(layers=layers, hidden=hidden, heads=heads, vocab=50368), seq, gbs, B16, tps, "tokens", "tokens",
        dp=gpus, mbs=mbs, recompute=FULL if ac else NONE, zero=zero, bf16_params=pure,
        notes=f"gradient accumulation {ga}" + ("; bf16 parameters (MP mode PURE)" if pure else ""),
    )  # fmt: skip


L8B = dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8)
L70B = dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8)
L405B = dict(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8)

RUNS: tuple[Run, ...] = (
    # [SC21] Table 1 (A100 80GB)
    _sc21("1.7b", 2304, 24, 24, 1, 1, 16, 512, 32, 137),
    _sc21("7.5b", 4096, 36, 32, 4, 1, 16, 512, 128, 142),
    _sc21("18b", 6144, 40, 48, 8, 1, 8, 1024, 256, 135),
    _sc21("39b", 8192, 48, 64, 8, 2, 4, 1536, 512, 138),
    _sc21("76b", 10240, 60, 80, 8, 4, 2, 1792, 1024, 140, virtual=3),
    _sc21("145b", 12288, 80, 96, 8, 8, 2, 2304, 1536, 148, virtual=2),
    _sc21("310b", 16384, 96, 128, 8, 16, 1, 2160, 1920, 155, virtual=2),
    _sc21("530b", 20480, 105, 128, 8, 35, 1, 2520, 2520, 163, virtual=3),
    _sc21("1t", 25600, 128, 160, 8, 64, 1, 3072, 3072, 163),
    # [SAR] Tables 3 and 5 (A100 80GB, DP 1)
    _sar("22b", 6144, 48, 64, 1, 4, 4, 8, 0.415),
    _sar("175b", 12288, 96, 96, 8, 64, 1, 64, 0.514, virtual=3),
    _sar("530b", 20480, 105, 128, 35, 280, 1, 280, 0.560, virtual=3),
    _sar("1t", 25600, 128, 160, 64, 512, 1, 512, 0.563),
    # [MPT] (A100 80GB / 40GB, H100 80GB), seq 2048
    _mpt("7b", 4096, 32, 32, 2048, 8, "a100-80gb", 6, 2, 96, 4641, Z3, False, False),
    _mpt("13b", 5120, 40, 40, 2048, 128, "a100-40gb", 16, 1, 2048, 1972, Z3, True, True),
    _mpt("70b", 8192, 80, 64, 2048, 64, "a100-80gb", 8, 4, 2048, 410, Z3, True, True),
    _mpt("13b", 5120, 40, 40, 2048, 8, "h100-sxm", 2, 1, 16, 4792, Z3, False, False),
    _mpt("1b", 2048, 24, 16, 2048, 512, "h100-sxm", 12, 1, 6144, 39837, Z2, False, False),
    _mpt("70b", 8192, 80, 64, 2048, 512, "h100-sxm", 8, 1, 4096, 1007, Z3, True, False),
    # [MCORE] weak scaling on H100, DP 48
    _mcore("1.7b", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _mcore("32b", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _mcore("70b", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _mcore("177b", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _mcore("462b", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
    # [TT] torchtitan, Llama 3.1 on H100 (Grand Teton), bf16, seq 8192
    Run("tt-llama3-8b-8xh100", "[TT] llama3_h100_202412 Table 1 (FSDP, eager)", "h100-96gb:1x8", "llama", L8B,
        8192, 16, B16, 5762, "tokens", "tokens", dp=8, mbs=2, recompute=OP, zero=Z3, memory_gib=82.4,
        kernels="none", notes="torchtitan's op-level selective checkpointing"),
    Run("tt-llama3-8b-128xh100", "[TT] llama3_h100_202412 Table 3 (FSDP, eager)", "h100-96gb:16x8", "llama", L8B,
        8192, 256, B16, 5605, "tokens", "tokens", dp=128, mbs=2, recompute=OP, zero=Z3, memory_gib=67.0,
        kernels="none", notes="torchtitan's op-level selective checkpointing"),
    Run("tt-llama3-8b-64xh100", "[TT] asyncTP_llama3_h100_2025-06 (bf16, vanilla TP)", "h100-96gb:8x8", "llama", L8B,
        8192, 96, B16, 4378, "tokens", "tokens", tp=8, dp=8, mbs=12, recompute=OP, zero=Z3, tp_overlap=False,
        notes="torch.compile; torchtitan's op-level selective checkpointing"),
    Run("tt-llama3-70b-256xh100", "[TT] asyncTP_llama3_h100_2025-06 (bf16, vanilla TP)", "h100-96gb:32x8", "llama",
        L70B, 8192, 512, B16, 597.3, "tokens", "tokens", tp=8, dp=32, mbs=16, recompute=FULL, zero=Z3, tp_overlap=False,
        notes="torch.compile"),
    # [LLAMA3] Table 4 (H100 80GB, 700 W)
    Run("llama3-405b-8192xh100", "[LLAMA3] Table 4 row 1", "h100-sxm:1024x8", "llama", L405B, 8192, 2048, B16,
        430, "tflops", "palm", tp=8, pp=16, dp=64, mbs=None,
        notes="FSDP over DP (stage not given); schedule, micro-batch, recomputation left to the search"),
    Run("llama3-405b-16384xh100", "[LLAMA3] Table 4 row 2", "h100-sxm:2048x8", "llama", L405B, 8192, 2048, B16,
        400, "tflops", "palm", tp=8, pp=16, dp=128,
        notes="FSDP over DP (stage not given); schedule, micro-batch, recomputation left to the search"),
    Run("llama3-405b-16384xh100-cp16", "[LLAMA3] Table 4 row 3", "h100-sxm:2048x8", "llama", L405B, 131072, 128,
        B16, 380, "tflops", "palm", tp=8, pp=16, dp=8, cp=16,
        notes="128K context; FSDP stage, schedule, micro-batch, recomputation left to the search"),
    # [DGXC] DeepSeek-V3 671B, BF16, on H100: its experts over 64 ranks
    Run("dgxc-deepseek-v3-512xh100", "[DGXC] H100 Performance", "h100-sxm:64x8", "deepseek_v3", {}, 4096, 4096,
        B16, 4096 * 4096 / 48.948 / 512, "tokens", "tokens", tp=2, pp=8, dp=32, ep=64,
        schedule=S1, mbs=1, zero=Z1, dispatch=ExpertDispatch.ALL_TO_ALL,
        notes="EP64 folded over TP2 x DP32 in the run: priced as one 64-way expert axis, the dense "
              "layers data parallel over it (autopar splits experts over one mesh axis, a tensor dim "
              "over one); distributed optimizer (ZeRO-1); recomputation left to the search; the "
              "flat all-to-all dispatcher (NeMo's MegatronTokenDropCallback, which the performance "
              "script adds, asserts Megatron's 'alltoall' dispatcher)"),
    Run("dgxc-deepseek-v3-1024xh100", "[DGXC] H100 Performance", "h100-sxm:128x8", "deepseek_v3", {}, 4096,
        8192, B16, 4096 * 8192 / 52.04 / 1024, "tokens", "tokens", tp=2, pp=16, dp=32, ep=64,
        schedule=S1, mbs=1, zero=Z1, dispatch=ExpertDispatch.ALL_TO_ALL,
        notes="as the 512-GPU row, with 16 stages"),
    # [MZOO] Qwen3-235B-A22B on 256 H100: its experts over 32 ranks
    Run("mzoo-qwen3-235b-256xh100", "[MZOO] Qwen3 readme, cross-node EP (DeepEP)", "h100-sxm:32x8", "qwen3_moe", {},
        4096, 2048, B16, 4096 * 2048 / 19.7 / 256, "tokens", "tokens", tp=2, pp=8, dp=16, ep=32,
        schedule=SI, virtual=4, mbs=1, recompute=SEL,
        notes="EP32 folded over TP2 x DP16 in the run: priced as one 32-way expert axis, the dense "
              "layers data parallel over it; 'norm, act' recomputation as selective (matmul outputs "
              "kept); ZeRO stage left to the search"),
    # FP8 linears (torchao's tensorwise float8 training; Transformer Engine's current scaling)
    Run("trainy-llama3-8b-32xh200", "[TT] llama3-8b_h200_202506_trainy-whitefiber (4 nodes)", "h200:4x8", "llama",
        L8B, 8192, 64, B16, 10938, "tokens", "tokens", dp=32, mbs=2, recompute=OP, zero=Z3, memory_gib=47.96,
        float8=Float8.TENSORWISE, notes="Float8 linears (torchao, tensorwise)"),
    Run("bridge-llama3-8b-8xb200", "[BRIDGE] 25.11, DGX-B200", "b200:1x8", "llama", L8B, 8192, 128, B16, 30624,
        "tokens", "tokens", dp=8, mbs=2, zero=Z0, float8=Float8.TENSORWISE,
        notes="FP8 current scaling (per tensor) priced as torchao's tensorwise recipe"),
)  # fmt: skip

BY_NAME = {r.name: r for r in RUNS}
assert len(BY_NAME) == len(RUNS), "run names must be unique"
