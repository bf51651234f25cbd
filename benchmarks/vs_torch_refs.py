"""The models of ``bench_vs_torch.py`` and PyTorch's own way of running each layout on them.

Families: Hugging Face Llama, Qwen2 and GPT-2 (causal LMs built tiny from their configs, no
downloads, ``use_cache=False``, ``labels`` = ``input_ids``) and a plain-torch residual MLP (MSE
loss), each at two sizes (``SIZES``): ``tiny`` (host-bound: the step is Python and dispatch) and
``large`` (compute-bound: seconds of matmuls per step on one CPU core).

References (``reference(layout, ...)``), each a ``Runner`` whose ``step()`` trains one step:

* ``eager``: the model itself, on one rank;
* ``ddp``: ``DistributedDataParallel``, each rank its rows of the batch;
* ``zero2`` / ``zero3``: FSDP2, ``fully_shard`` per block, then the root
  (``reshard_after_forward`` False / True), each rank its rows;
* ``tp``: DTensor ``parallelize_module`` with a Megatron-style plan (``ColwiseParallel`` q/k/v and
  gate/up, ``RowwiseParallel`` o and down; embeddings, norms and head replicated), the whole batch
  on every rank;
* ``tp_sp``: the same with sequence parallelism, torchtitan's plan (``RotaryDecoder.sp_plan``):
  the embedding's output split on the sequence, ``SequenceParallel`` norms, the sequence gathered
  before attention and the MLP and reduce-scattered after, the head's input gathered;
* ``pp``: ``torch.distributed.pipelining``: a ``PipelineStage`` per rank from the model cut by hand
  before block ``cut`` (embeddings with the first half, final norm, head and loss with the
  second), run by the given schedule over the given micro-batches, the whole batch fed to stage 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

SIZES = {
    "tiny": dict(batch=8, seq=32, hidden=64, layers=2, inter=128, vocab=256, heads=8, kv=4),
    "large": dict(batch=8, seq=128, hidden=512, layers=4, inter=1536, vocab=4096, heads=8, kv=4),
}
LR = 1e-3


def _tf():
    import transformers

    return transformers


def _lm_inputs(s: dict) -> dict:
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


LM = dict(use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)


class ResidualMLP(nn.Module):
    """``layers`` residual blocks ``h + down(gelu(up(h)))``, a linear head, an MSE loss."""

    class Block(nn.Module):
        def __init__(self, hidden: int, inter: int):
            super().__init__()
            self.up = nn.Linear(hidden, inter)
            self.down = nn.Linear(inter, hidden)

        def forward(self, h):
            return h + self.down(F.gelu(self.up(h)))

    def __init__(self, hidden: int, inter: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(self.Block(hidden, inter) for _ in range(layers))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x, y):
        h = x
        for b in self.blocks:
            h = b(h)
        out = self.head(h)
        return F.mse_loss(out, y), out


# ------------------------------------------------------------------------------------- families


class Family:
    """How a reference reaches into a model: its blocks, its Megatron plan, its pipeline halves."""

    def build(self, s: dict) -> tuple[nn.Module, dict]:
        raise NotImplementedError

    def blocks(self, model) -> nn.ModuleList:
        raise NotImplementedError

    def tp_plan(self, model) -> dict | str:
        """parallelize_module's plan, or why the model has none."""
        raise NotImplementedError

    def sp_plan(self, model) -> dict | str:
        """``tp_plan`` with sequence parallelism, or why the model has none."""
        plan = self.tp_plan(model)
        return (
            plan if isinstance(plan, str) else "no norm between the blocks' matmuls to run on sequence shards"
        )

    def sp_inputs(self, inputs) -> dict:
        return inputs

    # pipeline halves: stage modules made of ``parts`` and a slice of ``blocks``
    def parts(self, model, first: bool, last: bool) -> dict:
        raise NotImplementedError

    def embed(self, parts, x):
        return x

    def ctx(self, parts, h, config):
        return None

    def block(self, blk, h, ctx):
        return blk(h)

    def head(self, parts, h):
        raise NotImplementedError

    def pp_loss(self, out, target):
        """The model's own loss of a micro-batch's output."""
        return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]).float(), target[:, 1:].reshape(-1))

    def pp_feed(self, inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(the first stage's input, the last stage's target)."""
        return inputs["input_ids"], inputs["labels"]

    def tied(self, model) -> tuple[str, str] | None:
        """(first stage's name, last stage's name) of a weight both halves read, else None."""
        return None


def _megatron(prefix: str, col: tuple[str, ...], row: tuple[str, ...]) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {f"{prefix}.{n}": ColwiseParallel() for n in col}
    plan.update({f"{prefix}.{n}": RowwiseParallel() for n in row})
    return plan


class RotaryDecoder(Family):
    """Llama-like Hugging Face causal LMs: ``model.layers``, rotary tables, a causal mask."""

    @staticmethod
    def config_kwargs(s) -> dict:
        """The config of size ``s`` in the keys Llama's and Qwen2's configs share."""
        return dict(
            num_hidden_layers=s["layers"], hidden_size=s["hidden"], intermediate_size=s["inter"],
            num_attention_heads=s["heads"], num_key_value_heads=s["kv"], vocab_size=s["vocab"],
            max_position_embeddings=s["seq"], attention_dropout=0.0, **LM,
        )  # fmt: skip

    def blocks(self, model):
        return model.model.layers

    def tp_plan(self, model):
        return _megatron(
            "model.layers.*",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
            ("self_attn.o_proj", "mlp.down_proj"),
        )

    def sp_plan(self, model):
        """torchtitan's: the residual stream split on the sequence between the blocks' matmuls
        (norms on the shards), gathered before attention and the MLP, reduce-scattered after."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
        )

        seq, whole = Shard(1), Replicate()
        layer = "model.layers.*"
        plan = self.tp_plan(model)
        plan.update({
            "model.embed_tokens": RowwiseParallel(input_layouts=whole, output_layouts=seq),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=whole),
            f"{layer}.input_layernorm": SequenceParallel(),
            f"{layer}.post_attention_layernorm": SequenceParallel(),
            f"{layer}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": seq}, desired_input_kwarg_layouts={"hidden_states": whole},
                use_local_output=True,
            ),
            f"{layer}.mlp": PrepareModuleInput(
                input_layouts=(seq,), desired_input_layouts=(whole,), use_local_output=True
            ),
            f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=seq),
        })  # fmt: skip
        return plan

    def sp_inputs(self, inputs):
        """The positions given: the model would count them on the embedding's sequence shard."""
        return {**inputs, "position_ids": torch.arange(inputs["input_ids"].shape[1]).unsqueeze(0)}

    def parts(self, model, first, last):
        d = {"rotary": model.model.rotary_emb}
        if first:
            d["embed"] = model.model.embed_tokens
        if last:
            d.update(norm=model.model.norm, lm_head=model.lm_head)
        return d

    def embed(self, parts, ids):
        return parts["embed"](ids)

    def ctx(self, parts, h, config):
        from transformers.masking_utils import create_causal_mask

        pos = torch.arange(h.shape[1]).unsqueeze(0)
        mask = create_causal_mask(
            config=config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
        )
        return dict(attention_mask=mask, position_ids=pos, position_embeddings=parts["rotary"](h, pos))

    def block(self, blk, h, ctx):
        return blk(h, **ctx)

    def head(self, parts, h):
        return parts["lm_head"](parts["norm"](h))


class Llama(RotaryDecoder):
    def build(self, s):
        cfg = _tf().LlamaConfig(**self.config_kwargs(s))
        return _tf().LlamaForCausalLM(cfg), _lm_inputs(s)


class Qwen2(RotaryDecoder):
    def build(self, s):
        cfg = _tf().Qwen2Config(**self.config_kwargs(s))
        return _tf().Qwen2ForCausalLM(cfg), _lm_inputs(s)


class GPT2(Family):
    def build(self, s):
        cfg = _tf().GPT2Config(
            n_layer=s["layers"], n_embd=s["hidden"], n_inner=s["inter"], n_head=s["heads"],
            vocab_size=s["vocab"], n_positions=s["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return _tf().GPT2LMHeadModel(cfg), _lm_inputs(s)

    def blocks(self, model):
        return model.transformer.h

    def tp_plan(self, model):
        return (
            "GPT-2's projections are Conv1D (q/k/v fused in c_attn, weights transposed): "
            "ColwiseParallel/RowwiseParallel take nn.Linear and nn.Embedding only"
        )

    def parts(self, model, first, last):
        t = model.transformer
        d = {}
        if first:
            d.update(wte=t.wte, wpe=t.wpe)
        if last:
            d.update(ln_f=t.ln_f, lm_head=model.lm_head)
        return d

    def embed(self, parts, ids):
        return parts["wte"](ids) + parts["wpe"](torch.arange(ids.shape[1]).unsqueeze(0))

    def ctx(self, parts, h, config):
        from transformers.masking_utils import create_causal_mask

        pos = torch.arange(h.shape[1]).unsqueeze(0)
        return create_causal_mask(
            config=config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
        )

    def block(self, blk, h, ctx):
        return blk(h, None, ctx)

    def head(self, parts, h):
        return parts["lm_head"](parts["ln_f"](h))

    def tied(self, model):
        return ("wte", "lm_head")  # the input embedding is the output projection


class MLP(Family):
    def build(self, s):
        g = torch.Generator().manual_seed(1)
        shape = (s["batch"], s["seq"], s["hidden"])
        x, y = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        return ResidualMLP(s["hidden"], s["inter"], s["layers"]), {"x": x, "y": y}

    def blocks(self, model):
        return model.blocks

    def tp_plan(self, model):
        return _megatron("blocks.*", ("up",), ("down",))

    def parts(self, model, first, last):
        return {"head": model.head} if last else {}

    def head(self, parts, h):
        return parts["head"](h)

    def pp_loss(self, out, target):
        return F.mse_loss(out, target)

    def pp_feed(self, inputs):
        return inputs["x"], inputs["y"]


FAMILIES: dict[str, Family] = {"llama": Llama(), "qwen2": Qwen2(), "gpt2": GPT2(), "mlp": MLP()}


def build(name: str, size: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)  # every rank, and both sides, build the same weights
    return FAMILIES[name].build(SIZES[size])


# ------------------------------------------------------------------------------------- runners


@dataclass
class Runner:
    """``step()`` trains one step and returns the loss this side computed; ``global_loss`` turns
    that into the loss of the whole batch (for the check; collective where each rank has its rows)."""

    step: Callable[[], torch.Tensor]
    global_loss: Callable[[torch.Tensor], float] = float


def make_optimizer(params, optimizer: str) -> torch.optim.Optimizer:
    return optimizer_class(optimizer)(params, lr=LR)


def optimizer_class(optimizer: str) -> type[torch.optim.Optimizer]:
    return {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]


def _loss(out) -> torch.Tensor:
    return out.loss if hasattr(out, "loss") else out[0]


def _plain(model, opt, inputs) -> Callable[[], torch.Tensor]:
    def step():
        loss = _loss(model(**inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def _rows(inputs: dict, rank: int, world: int) -> dict:
    b = next(iter(inputs.values())).shape[0]
    if b % world:
        raise ValueError(f"batch {b} does not split over {world} ranks")
    n = b // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in inputs.items()}


def _mean_over_ranks(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def reference(
    layout: str, name: str, size: str, optimizer: str, *, cut: int = 0, schedule: str = "", k: int = 1
):
    """PyTorch's own runner of ``layout`` on model ``name`` (module docstring); a string says why
    it has none."""
    model, inputs = build(name, size)
    fam = FAMILIES[name]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if layout == "eager":
        return Runner(_plain(model, make_optimizer(model.parameters(), optimizer), inputs))
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        opt = make_optimizer(ddp.parameters(), optimizer)
        return Runner(_plain(ddp, opt, _rows(inputs, rank, world)), _mean_over_ranks)
    if layout in ("zero2", "zero3"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        reshard = layout == "zero3"
        for blk in fam.blocks(model):
            fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        opt = make_optimizer(model.parameters(), optimizer)
        return Runner(_plain(model, opt, _rows(inputs, rank, world)), _mean_over_ranks)
    if layout in ("tp", "tp_sp"):
        plan = fam.tp_plan(model) if layout == "tp" else fam.sp_plan(model)
        if isinstance(plan, str):
            return plan
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
        feed = inputs if layout == "tp" else fam.sp_inputs(inputs)
        return Runner(_plain(model, make_optimizer(model.parameters(), optimizer), feed))
    if layout == "pp":
        return _pipeline(model, inputs, fam, optimizer, cut, schedule, k)
    raise ValueError(f"unknown layout {layout!r}")


class Stage(nn.Module):
    """Blocks ``[lo, hi)`` of a model, with its embeddings if ``first``, its head if ``last``."""

    def __init__(self, fam: Family, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self._fam, self._config, self.first, self.last = fam, getattr(model, "config", None), first, last
        self.parts = nn.ModuleDict(fam.parts(model, first, last))
        self.blocks = nn.ModuleList(list(fam.blocks(model))[lo:hi])

    def forward(self, x):
        h = self._fam.embed(self.parts, x) if self.first else x
        ctx = self._fam.ctx(self.parts, h, self._config)
        for blk in self.blocks:
            h = self._fam.block(blk, h, ctx)
        return self._fam.head(self.parts, h) if self.last else h


def _pipeline(model, inputs, fam: Family, optimizer: str, cut: int, schedule: str, k: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        return f"the hand-split reference pipeline is one rank per stage: world 2, not {world}"
    n = len(fam.blocks(model))
    first, last = rank == 0, rank == 1
    stage_mod = Stage(fam, model, 0 if first else cut, cut if first else n, first, last)
    stage = PipelineStage(stage_mod, rank, 2, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=k, loss_fn=fam.pp_loss)
    opt = make_optimizer(stage_mod.parameters(), optimizer)
    x, target = fam.pp_feed(inputs)
    tied = fam.tied(model)
    shared = stage_mod.parts[tied[0] if first else tied[1]].weight if tied else None

    def step():
        losses: list[torch.Tensor] = []
        if first:
            sched.step(x)
        else:
            sched.step(target=target, losses=losses)
        if shared is not None:  # the tied weight's two halves of its gradient, summed
            dist.all_reduce(shared.grad)
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.broadcast(loss, src=1)
        return loss

    return Runner(step)
