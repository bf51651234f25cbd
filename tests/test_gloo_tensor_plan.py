"""On CPU ranks a tensor-parallel residual MLP keeps its residual stream whole, as Megatron's plan
does, rather than split on the sequence between blocks (reduce-scatter after each block, all-gather
before the next).

Gloo has no reduce-scatter: codegen runs an all-reduce and a slice (``codegen/collectives.py:
_reduce_scatter``), so the sequence-parallel form costs an all-reduce and an all-gather per block
and direction where Megatron's costs one all-reduce. Priced as a ring reduce-scatter (half an
all-reduce), the two looked equal and the search took the sequence split for its smaller
elementwise work: 1.85x DTensor's ``parallelize_module`` step at worlds 2 and 4
(``benchmarks/bench_vs_torch.py``, ``benchmarks/README.md``). Now priced as the all-reduce it runs
(``cost_model/comm.py``: ``NATIVE_REDUCE_SCATTER``), the plan runs no reduce-scatter and no
all-gather. On GPUs (NCCL, a reduce-scatter of its own) nothing changes: the sequence split is
priced as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.reshard import Collective

T = autopar.AxisRole.TENSOR


class ResidualMLP(nn.Module):
    """``benchmarks/vs_torch_refs.py``'s: blocks ``h + down(gelu(up(h)))``, a head, an MSE loss."""

    def __init__(self, hidden: int = 64, inter: int = 128, layers: int = 2):
        super().__init__()
        self.up = nn.ModuleList(nn.Linear(hidden, inter) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(inter, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, hidden)

    def forward(self, x, y):
        h = x
        for up, down in zip(self.up, self.down):
            h = h + down(F.gelu(up(h)))
        return F.mse_loss(self.head(h), y)


@pytest.mark.parametrize("world", [2, 4])
def test_cpu_tensor_parallel_mlp_runs_no_reduce_scatter(world):
    torch.manual_seed(0)
    x, y = torch.randn(8, 32, 64), torch.randn(8, 32, 64)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    plan = autopar.plan(
        ResidualMLP(), cluster, (x, y), mesh_shape=(world,), axis_roles=(T,), zero_stage=0, micro_batches=1,
        outputs=autopar.Outputs.LOSS, recompute=autopar.Recompute.NONE,
    )  # fmt: skip
    kinds = {c.kind for d in plan.decisions for c in d.collectives}
    assert Collective.ALL_REDUCE in kinds  # tensor parallel: the blocks' partial sums
    assert not kinds & {Collective.REDUCE_SCATTER, Collective.ALL_GATHER}, kinds
