"""Any model, as a new user would try it: 16 model families no test names, each built tiny
from its config (no downloads), planned on the ``cpu`` preset and run on gloo ranks.

For each model, world size (2, 4) and mode:

- ``data``: forced data parallelism, ``mesh_shape=(world,), axis_roles=(DATA,)``;
- ``tensor``: forced tensor parallelism, ``mesh_shape=(world,), axis_roles=(TENSOR,)``;
- ``auto``: the solver's own mesh and placements;
- ``squeezed``: ``auto`` under a memory limit of 0.7 x the ``auto`` plan's predicted peak (on the
  cpu preset, gloo's ~1 ms per collective makes replicating a toy model cheapest; the limit forces
  sharding),

the parent plans, then ONE spawn of gloo ranks per world size applies every plan of that world
(``autoparallelize(..., plan=path)``), runs two SGD steps with the model's own loss and returns
the losses and outputs of both steps and ``full_state_dict()``. Each rank's are compared with the
single-device model's (fp32, rtol 1e-4, atol 1e-5).

The models: Gemma, Gemma 3, Phi-3, Qwen3, Qwen3-MoE, GPT-J, Bloom, Falcon, StableLM, Starcoder2,
OLMo (causal LMs, ``labels`` = ``input_ids``), GPT-2 with a sequence-classification head,
RoBERTa (masked LM) and DistilBERT (sequence classification), the last three with a padding
``attention_mask``; a plain-torch CNN (conv, BatchNorm2d, ReLU, max/average pooling, linear head,
cross-entropy); ``torch.nn.Transformer`` behind a linear head and an MSE loss. Batch 4, sequence
16, 2 layers, hidden 32, 4 heads, vocabulary 128. A plan with pipeline stages or micro-batches
trains with ``pmodel.step`` (it returns the loss alone): there the losses and the weights are
compared, not the outputs.

Batch norm: ``cnn_bn`` is the CNN as a user writes it, ``BatchNorm2d`` in train mode, which updates
its running statistics in forward (torch.export refuses the buffer mutation; autopar traces it with
make_fx instead, the in-place updates kept); ``cnn_bn_batch`` the same with
``track_running_stats=False`` (batch statistics, no buffers). Both are compared exactly, running
statistics included: batch norm's rule (``passes/rules/nn.py``) all-reduces the per-channel
statistics of a split batch (SyncBatchNorm), so its statistics are the single-device model's (not
those of each rank's piece, as under DDP), and the search plans no micro-batches for it (each
micro-batch would normalize with its own statistics: ``passes/micro_batch_check.py``).

Matrix cells: ``ok`` (every rank equals the single-device model), ``ok/R`` (equal, and the plan
replicates everything: nothing about parallelism was tested), ``planned`` / ``planned/R`` (with
``--only-plan``), ``PLAN`` (planning raised), ``RUN``
(a rank raised), ``DIFF`` (a rank differs); the first line of each error and the worst
difference follow the matrix.

    .venv/bin/python benchmarks/bench_any_model.py --only-plan            # plan only, worlds 2 and 4
    .venv/bin/python benchmarks/bench_any_model.py --world 2              # plan + run world 2
    .venv/bin/python benchmarks/bench_any_model.py --world 4 --models qwen3_moe,bloom --modes data -v
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.codegen.pipeline import PipelinedModule
from autopar.launch import PRELOAD_ENV, RankFailed, run_on_ranks
from autopar.placement import is_replicated, spec_from_str

BATCH, SEQ, VOCAB, HIDDEN, HEADS, LAYERS = 4, 16, 128, 32, 4, 2
LR, STEPS, RTOL, ATOL = 0.1, 2, 1e-4, 1e-5
SQUEEZE = 0.7
D, T = autopar.AxisRole.DATA, autopar.AxisRole.TENSOR
MODES = ("data", "tensor", "auto", "squeezed")
WORLDS = (2, 4)


def _tf():
    import transformers

    return transformers


def _ids(low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _lm(model) -> tuple[nn.Module, dict]:
    ids = _ids()
    return model, {"input_ids": ids, "labels": ids}


def _padded(pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (never ``pad`` but where padded) and the attention mask a tokenizer would give a
    batch of unequal lengths: rows 1 and 3 end in 4 and 7 pad tokens."""
    ids = _ids(low=3)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -4:] = 0
    mask[3, -7:] = 0
    return ids.masked_fill(mask == 0, pad), mask


def _classes(n: int = 3) -> torch.Tensor:
    return torch.randint(0, n, (BATCH,), generator=torch.Generator().manual_seed(2))


# the ids every causal LM's config needs inside a 128-token vocabulary
LM = dict(vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def gemma():
    cfg = _tf().GemmaConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64, attention_dropout=0.0, **LM,
    )  # fmt: skip
    return _lm(_tf().GemmaForCausalLM(cfg))


def gemma3():
    cfg = _tf().Gemma3TextConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, query_pre_attn_scalar=8,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0, **LM,
    )  # fmt: skip
    return _lm(_tf().Gemma3ForCausalLM(cfg))


def phi3():
    cfg = _tf().Phi3Config(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, max_position_embeddings=64, original_max_position_embeddings=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, **LM,
    )  # fmt: skip
    return _lm(_tf().Phi3ForCausalLM(cfg))


def qwen3():
    cfg = _tf().Qwen3Config(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_dropout=0.0, **LM,
    )  # fmt: skip
    return _lm(_tf().Qwen3ForCausalLM(cfg))


def qwen3_moe():
    cfg = _tf().Qwen3MoeConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, decoder_sparse_step=1, attention_dropout=0.0, **LM,
    )  # fmt: skip
    return _lm(_tf().Qwen3MoeForCausalLM(cfg))


def gptj():
    cfg = _tf().GPTJConfig(
        n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, rotary_dim=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, **LM,
    )  # fmt: skip
    return _lm(_tf().GPTJForCausalLM(cfg))


def bloom():
    cfg = _tf().BloomConfig(
        n_layer=LAYERS, hidden_size=HIDDEN, n_head=HEADS, hidden_dropout=0.0, attention_dropout=0.0, **LM
    )
    return _lm(_tf().BloomForCausalLM(cfg))


def falcon():
    cfg = _tf().FalconConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, max_position_embeddings=64,
        hidden_dropout=0.0, attention_dropout=0.0, **LM,
    )  # fmt: skip
    return _lm(_tf().FalconForCausalLM(cfg))


def stablelm():
    cfg = _tf().StableLmConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
        **LM,
    )  # fmt: skip
    return _lm(_tf().StableLmForCausalLM(cfg))


def starcoder2():
    cfg = _tf().Starcoder2Config(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=2, max_position_embeddings=64, residual_dropout=0.0, embedding_dropout=0.0,
        attention_dropout=0.0, **LM,
    )  # fmt: skip
    return _lm(_tf().Starcoder2ForCausalLM(cfg))


def olmo():
    cfg = _tf().OlmoConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
        max_position_embeddings=64, attention_dropout=0.0, **LM,
    )  # fmt: skip
    return _lm(_tf().OlmoForCausalLM(cfg))


def gpt2_cls():
    cfg = _tf().GPT2Config(
        n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, summary_first_dropout=0.0, num_labels=3, **LM,
    )  # fmt: skip
    ids, mask = _padded(pad=0)
    model = _tf().GPT2ForSequenceClassification(cfg)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": _classes()}


def roberta():
    cfg = _tf().RobertaConfig(
        num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=HEADS,
        vocab_size=VOCAB, max_position_embeddings=SEQ + 2 + 8, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )  # fmt: skip
    ids, mask = _padded(pad=1)
    labels = ids.clone()
    chosen = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(3)) < 0.3
    labels[~chosen | (mask == 0)] = -100  # the masked-LM positions: 30% of the real tokens
    return _tf().RobertaForMaskedLM(cfg), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def distilbert():
    cfg = _tf().DistilBertConfig(
        n_layers=LAYERS, dim=HIDDEN, hidden_dim=64, n_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    ids, mask = _padded(pad=0)
    model = _tf().DistilBertForSequenceClassification(cfg)
    return model, {"input_ids": ids, "attention_mask": mask, "labels": _classes()}


class CNN(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> max pool, twice; global average pool; linear head; CE loss."""

    def __init__(self, running_stats: bool = True, classes: int = 10):
        super().__init__()
        bn = dict(track_running_stats=running_stats)
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, **bn), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16, **bn), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Linear(16, classes)

    def forward(self, pixels, labels):
        logits = self.head(self.features(pixels))
        return F.cross_entropy(logits, labels), logits


def _cnn(running_stats: bool):
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(BATCH, 3, 16, 16, generator=g)
    labels = torch.randint(0, 10, (BATCH,), generator=g)
    return CNN(running_stats), {"pixels": pixels, "labels": labels}


def cnn_bn():
    return _cnn(running_stats=True)


def cnn_bn_batch():
    return _cnn(running_stats=False)


class Seq2Seq(nn.Module):
    """``torch.nn.Transformer`` (2 + 2 layers, causal decoder mask), a linear head and an MSE loss."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.Transformer(
            d_model=HIDDEN, nhead=HEADS, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
            dim_feedforward=64, dropout=0.0, batch_first=True,
        )  # fmt: skip
        self.head = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, src, tgt, target):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        y = self.head(self.transformer(src, tgt, tgt_mask=mask, tgt_is_causal=True))
        return F.mse_loss(y, target), y


def nn_transformer():
    g = torch.Generator().manual_seed(1)
    src, tgt, target = (torch.randn(BATCH, SEQ, HIDDEN, generator=g) for _ in range(3))
    return Seq2Seq(), {"src": src, "tgt": tgt, "target": target}


BUILDERS = {
    f.__name__: f
    for f in (
        gemma, gemma3, phi3, qwen3, qwen3_moe, gptj, bloom, falcon, stablelm, starcoder2, olmo,
        gpt2_cls, roberta, distilbert, cnn_bn, cnn_bn_batch, nn_transformer,
    )
}  # fmt: skip


def build(name: str):
    torch.manual_seed(0)  # every rank and the reference build the same weights
    return BUILDERS[name]()


def loss_and_outputs(out) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss and the other tensor outputs of a Hugging Face ``ModelOutput`` (``.loss``) or of a
    ``(loss, *outputs)`` tuple."""
    if isinstance(out, tuple):
        loss, rest = out[0], out[1:]
    else:
        loss, rest = out.loss, [v for k, v in out.items() if k != "loss"]
    return loss, [t.detach().clone() for t in rest if isinstance(t, torch.Tensor)]


def loss_of(out) -> torch.Tensor:
    return loss_and_outputs(out)[0]


def train(model, inputs) -> list[tuple[torch.Tensor, list[torch.Tensor] | None]]:
    """``STEPS`` SGD steps on the model's own loss: (loss, other outputs) of every step. A parallel
    module that runs micro-batches or pipeline stages trains with ``pmodel.step`` (the global
    batch; it returns the loss alone: outputs None)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    by_step = isinstance(model, PipelinedModule) or getattr(model, "micro_batches", 1) > 1
    steps = []
    for _ in range(STEPS):
        if by_step:
            loss, outs = model.step(**inputs, loss_fn=loss_of), None
        else:
            loss, outs = loss_and_outputs(model(**inputs))
            loss.backward()
        opt.step()
        opt.zero_grad()
        steps.append((loss.detach().clone(), outs))
    return steps


def reference(name: str):
    model, inputs = build(name)
    steps = train(model, inputs)
    return steps, {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------------------- planning


def mode_options(mode: str, world: int) -> dict:
    if mode == "data":
        return dict(mesh_shape=(world,), axis_roles=(D,))
    if mode == "tensor":
        return dict(mesh_shape=(world,), axis_roles=(T,))
    return {}


def cluster(world: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.preset("cpu", devices_per_node=world)


def plan_model(name: str, world: int, modes) -> dict:
    """mode -> Plan, or the traceback of the planning that raised."""
    model, inputs = build(name)
    spec = cluster(world)
    plans = {}
    for mode in modes:
        try:
            if mode == "squeezed":
                free = plans.get("auto")
                if free is None or isinstance(free, str):
                    free = autopar.plan(model, spec, inputs)
                limit = SQUEEZE * free.predicted.peak_memory_bytes / (1 - spec.memory_reserve)
                plans[mode] = autopar.plan(model, spec, inputs, memory_limit_bytes=limit)
            else:
                plans[mode] = autopar.plan(model, spec, inputs, **mode_options(mode, world))
        except Exception:  # noqa: BLE001 - reported in the matrix
            plans[mode] = traceback.format_exc()
    return plans


def replicates_all(plan) -> bool:
    """No pipeline, and every parameter, input and activation replicated (or a one-rank mesh)."""
    if plan.pipeline.stages > 1:
        return False
    if all(n == 1 for n in plan.mesh_shape):
        return True
    return all(is_replicated(spec_from_str(d.output)) for d in plan.decisions if d.output)


def describe(plan) -> str:
    """Mesh, pipeline, trades and how many parameters are split over an axis of more than one rank."""
    big = [a for a, n in enumerate(plan.mesh_shape) if n > 1]
    params = [d for d in plan.decisions if d.role == "param"]
    sharded = sum(1 for d in params if any(not is_replicated([spec_from_str(d.output)[a]]) for a in big))
    t = plan.trades
    trades = [f"ZeRO-{int(t.zero_stage)}"] if t.zero_stage else []
    trades += [f"{t.micro_batches} micro-batches"] if t.micro_batches > 1 else []
    trades += [f"recompute {t.recompute.value}"] if t.recompute.value != "none" else []
    trades += [f"offload {t.offload.value}"] if t.offload.value != "none" else []
    stages = f"{plan.pipeline.stages} pipeline stages of " if plan.pipeline.stages > 1 else ""
    return f"{stages}mesh {tuple(plan.mesh_shape)}, {sharded}/{len(params)} params sharded" + "".join(
        f", {x}" for x in trades
    )


# ----------------------------------------------------------------------------------------- running


def _rank(rank: int, world: int, jobs):
    results = {}
    for (name, mode), path in jobs:
        model, inputs = build(name)
        try:
            pmodel = autopar.autoparallelize(model, cluster(world), inputs, plan=path)
            results[(name, mode)] = (train(pmodel, inputs), pmodel.full_state_dict())
        except Exception:  # noqa: BLE001 - reported in the matrix
            results[(name, mode)] = traceback.format_exc()
    return results


def _excess(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want| - (atol + rtol |want|), max |got - want|): above 0 fails allclose."""
    diff = (got.double() - want.double()).abs()
    return float((diff - ATOL - RTOL * want.double().abs()).max()), float(diff.max())


def compare(name: str, per_rank: list, ref) -> str | None:
    """None when every rank equals the single-device run, else the worst difference."""
    ref_steps, ref_state = ref
    worst = (-float("inf"), 0.0, "")
    for rank, (steps, state) in enumerate(per_rank):
        pairs = []
        for step, ((loss, outs), (rloss, routs)) in enumerate(zip(steps, ref_steps)):
            pairs.append((f"step {step} loss", loss, rloss))
            if outs is None:  # pmodel.step: the loss alone
                continue
            if len(outs) != len(routs):
                return f"rank {rank} step {step}: {len(outs)} outputs, the model returns {len(routs)}"
            pairs += [(f"step {step} output {i}", o, r) for i, (o, r) in enumerate(zip(outs, routs))]
        if set(state) != set(ref_state):
            return f"rank {rank}: full_state_dict keys differ: {sorted(set(state) ^ set(ref_state))[:4]}"
        pairs += [(k, state[k], ref_state[k]) for k in ref_state]
        for what, got, want in pairs:
            if got.shape != want.shape:
                return f"rank {rank} {what}: shape {tuple(got.shape)}, the model's {tuple(want.shape)}"
            ex, diff = _excess(got, want)
            if ex > worst[0]:
                worst = (ex, diff, f"rank {rank} {what}")
    if worst[0] <= 0:
        return None
    return f"worst {worst[2]}: max |diff| {worst[1]:.3g}"


def first_line(tb: str) -> str:
    """The exception's own line of a traceback (its last line that is not indented)."""
    lines = [ln for ln in tb.strip().splitlines() if ln and not ln.startswith(" ")]
    return lines[-1][:240] if lines else tb[:240]


def run_world(names, modes, world: int, plans: dict, refs: dict, timeout_s: float) -> dict:
    """(name, mode) -> cell result: every plan that planned, run in one spawn of ``world`` ranks."""
    cells = {}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for name in names:
            for mode in modes:
                plan = plans[(name, mode, world)]
                if isinstance(plan, str):
                    continue
                path = Path(tmp) / f"{name}_{mode}.json"
                plan.save(path)
                jobs.append(((name, mode), str(path)))
        try:
            per_rank = run_on_ranks(_rank, world, jobs, timeout_s=timeout_s)
        except RankFailed as e:
            return {key: ("RUN", f"the spawn failed: {first_line(str(e))}") for key, _ in jobs}
    for key, _ in jobs:
        res = [r[key] for r in per_rank]
        failed = [(rank, r) for rank, r in enumerate(res) if isinstance(r, str)]
        if failed:
            rank, tb = failed[0]
            cells[key] = ("RUN", f"rank {rank}: {first_line(tb)}")
            continue
        diff = compare(key[0], res, refs[key[0]])
        if diff is not None:
            cells[key] = ("DIFF", diff)
        else:
            plan = plans[(*key, world)]
            by_step = "loss and weights compared (pmodel.step returns no outputs)"
            note = f"{describe(plan)}: {by_step}" if res[0][0][0][1] is None else None
            cells[key] = ("ok/R" if replicates_all(plan) else "ok", note)
    return cells


# ------------------------------------------------------------------------------------------ report


def print_matrix(names, modes, worlds, cells: dict) -> None:
    cols = [(mode, w) for w in worlds for mode in modes]
    width = max(len(n) for n in names) + 2
    print()
    print(" " * width + "  ".join(f"{m[:8]}/{w}".ljust(10) for m, w in cols))
    for name in names:
        row = [cells.get((name, m, w), ("-", None))[0].ljust(10) for m, w in cols]
        print(name.ljust(width) + "  ".join(row))
    print()
    for name in names:
        for m, w in cols:
            kind, detail = cells.get((name, m, w), ("-", None))
            if detail:
                print(f"{name} {m} world {w}: {kind}: {detail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only-plan", action="store_true", help="plan every configuration, run none")
    ap.add_argument("--world", type=int, action="append", help="a world size (repeatable; default 2 and 4)")
    ap.add_argument(
        "--models", default=",".join(BUILDERS), help="comma-separated, of: " + ", ".join(BUILDERS)
    )
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for one world's spawn")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each plan's mesh and sharding")
    args = ap.parse_args()
    names = [n for n in args.models.split(",") if n]
    modes = [m for m in args.modes.split(",") if m]
    worlds = tuple(args.world or WORLDS)
    unknown = [n for n in names if n not in BUILDERS] + [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown model or mode: {unknown}")
    os.environ.setdefault(PRELOAD_ENV, "transformers")  # the ranks' server imports it once

    plans, cells = {}, {}
    for world in worlds:
        t0 = time.perf_counter()
        for name in names:
            for mode, plan in plan_model(name, world, modes).items():
                plans[(name, mode, world)] = plan
                if isinstance(plan, str):
                    cells[(name, mode, world)] = ("PLAN", first_line(plan))
                else:
                    cells[(name, mode, world)] = ("planned/R" if replicates_all(plan) else "planned", None)
                    if args.verbose:
                        print(f"{name} {mode} world {world}: {describe(plan)}")
        print(f"world {world}: planned in {time.perf_counter() - t0:.0f} s", flush=True)
    if not args.only_plan:
        refs = {name: reference(name) for name in names}
        for world in worlds:
            t0 = time.perf_counter()
            for (name, mode), cell in run_world(names, modes, world, plans, refs, args.timeout).items():
                cells[(name, mode, world)] = cell
            print(f"world {world}: ran in {time.perf_counter() - t0:.0f} s", flush=True)
    print_matrix(names, modes, worlds, cells)


if __name__ == "__main__":
    main()
