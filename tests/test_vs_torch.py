"""``benchmarks/bench_vs_torch.py`` times like against like: on 2 gloo ranks, autopar's forced plan
and PyTorch's own runner of the same layout (DDP, FSDP2, DTensor ``parallelize_module``, a
pipeline split by hand at the plan's cut) compute, at the first step, the loss the single-device
model computes. The model takes two inputs (``x``, ``y``), the second read only after the blocks:
under ZeRO-3 its slice lands in the first block's submodule (``codegen/blocks.py:split_blocks``).
No timing here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from autopar.launch import run_on_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_vs_torch as bench  # noqa: E402
import vs_torch_refs as refs  # noqa: E402

LAYOUTS = ("ddp", "zero3", "tp", "pp")
SCHEDULE, K = "gpipe", 2


def _rank(rank: int, world: int, jobs: list) -> dict:
    out = {}
    for layout, path, cut in jobs:
        got = bench.compare_once("mlp", "tiny", layout, world, path, "sgd", cut, SCHEDULE, K)
        out[layout] = got.get("losses", got.get("na"))
    return out


@pytest.fixture(scope="module")
def losses(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("vs_torch")
    jobs, cells = bench.plan_jobs(["mlp"], ["tiny"], LAYOUTS, 2, "sgd", SCHEDULE, K, tmp)
    assert cells == {}, cells
    return run_on_ranks(_rank, 2, [(key[2], path, cut) for key, path, cut in jobs], timeout_s=300)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_and_autopar_compute_the_models_loss(losses, layout):
    model, inputs = refs.build("mlp", "tiny")
    want = float(model(**inputs)[0].detach())
    for rank, res in enumerate(losses):
        ours, ref = res[layout]
        torch.testing.assert_close(ours, want, rtol=1e-4, atol=0, msg=f"rank {rank}: autopar {layout}")
        torch.testing.assert_close(ref, want, rtol=1e-4, atol=0, msg=f"rank {rank}: reference {layout}")
