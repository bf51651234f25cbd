"""What a rank holds while ``autoparallelize`` builds a model that it never holds whole.

A Llama of ``--hidden`` x ``--layers`` (vocabulary ``--vocab``) is saved once as a safetensors
checkpoint; ``--world`` gloo ranks then build a tensor-parallel module from the model on the meta
device, the weights coming from each source (``--sources``: the checkpoint ``file``, rank 0's
state dict ``rank0``, the model's initializers ``init``; the whole model's bytes, ``whole``, printed
for scale). Per rank, while
``autoparallelize`` runs:

* ``pieces``: the bytes of the rank's parameters and buffers once built (its shards);
* ``tensors``: the peak of the bytes held in live tensors (``LiveTensorTracker``: each storage
  counted from the op that made it until it is freed);
* ``anon``: the peak of the process's anonymous resident memory above its level before the call
  (``RssAnon``, sampled every millisecond: a lower bound of the true peak; file pages of the
  mapped checkpoint are not anonymous and are not counted);

against ``pieces + largest tensor`` (the bound the sharded sources keep: ``codegen/weights.py``)
and the whole model's bytes.

    .venv/bin/python benchmarks/bench_sharded_init.py [--hidden 1024 --layers 8 --vocab 32000 --world 4]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch

import autopar
from autopar.launch import run_on_ranks
from autopar.tools.measure import LiveTensorTracker


def _config(args):
    import transformers as tf

    return tf.LlamaConfig(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_attention_heads=max(args.hidden // 64, 1), num_key_value_heads=max(args.hidden // 256, 1),
        vocab_size=args.vocab, max_position_embeddings=256, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip


def _build(args, meta: bool):
    import transformers as tf

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return tf.LlamaForCausalLM(_config(args))
    return tf.LlamaForCausalLM(_config(args))


def _inputs(args):
    ids = torch.randint(0, args.vocab, (args.world, 32), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _Sampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.base, self.peak, self.stop = _anon(), 0, False

    def run(self):
        while not self.stop:
            self.peak = max(self.peak, _anon() - self.base)
            time.sleep(0.001)


def _rank(rank, world, args, source, plan_path, ckpt):
    model = _build(args, meta=True)
    weights = ckpt if source == "file" else None
    if source == "rank0":
        weights = autopar.Rank0Weights(_build(args, False).state_dict() if rank == 0 else None)
    inputs = _inputs(args)
    sampler = _Sampler()
    sampler.start()
    with LiveTensorTracker() as tracker:
        pmodel = autopar.autoparallelize(model, autopar.ClusterSpec.preset("cpu", devices_per_node=world), inputs,
                                         plan=plan_path, weights=weights)  # fmt: skip
    sampler.stop = True
    sampler.join()
    pieces = sum(
        t._local_tensor.numel() * t.element_size() for t in [*pmodel.parameters(), *pmodel.buffers()]
    )
    return pieces, tracker.peak, sampler.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--sources", default="file,rank0,init")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench_sharded_init_"))
    real = _build(args, meta=False)
    whole = sum(t.numel() * t.element_size() for t in real.state_dict().values())
    biggest = max(t.numel() * t.element_size() for t in real.state_dict().values())
    real.save_pretrained(out / "ckpt")
    del real
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=args.world)
    plan = autopar.plan(_build(args, meta=True), cluster, _inputs(args), mesh_shape=(args.world,),
                        axis_roles=(autopar.AxisRole.TENSOR,))  # fmt: skip
    plan.save(out / "plan.json")
    mib = 2**20
    print(
        f"Llama {args.hidden} x {args.layers}, vocab {args.vocab}: {whole / mib:.0f} MiB of state, largest tensor "
        f"{biggest / mib:.0f} MiB; {args.world} gloo ranks, tensor parallel; torch {torch.__version__}"
    )
    print(
        f"{'source':<7} {'pieces':>8} {'bound':>8} {'tensors':>8} {'anon':>8} {'tensors/bound':>14}  (MiB, worst rank)"
    )
    for source in args.sources.split(","):
        res = run_on_ranks(
            _rank, args.world, args, source, str(out / "plan.json"), str(out / "ckpt"), timeout_s=1800
        )
        pieces = max(r[0] for r in res)
        tensors = max(r[1] for r in res)
        anon = max(r[2] for r in res)
        bound = pieces + biggest
        print(
            f"{source:<7} {pieces / mib:>8.1f} {bound / mib:>8.1f} {tensors / mib:>8.1f} {anon / mib:>8.1f} "
            f"{tensors / bound:>14.2f}"
        )


if __name__ == "__main__":
    main()
