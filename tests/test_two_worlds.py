"""A process that initializes a second process group after destroying the first (a notebook, a
test suite, a job that restarts its group) builds ZeRO's FSDP2 modules on the new group as on the
first. DTensor caches its sharding propagation by mesh *value*, and a mesh of the new group equals
the old one's: without ``codegen/build.py:_forget_meshes`` a parameter came back from an op on the
old mesh object and FSDP2 refused it ("Expected param's DTensor mesh to be the same mesh passed to
fully_shard"), as when ``tests/test_trades_memory.py`` runs before ``tests/test_one_device.py``
in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autopar
from autopar import examples
from autopar.launch import free_port


def _train(tmp_path, name: str) -> list[float]:
    """Three Adam steps of a bf16 Llama under ZeRO-2 (FSDP2 over the one device) on a fresh world
    of one gloo rank; its losses."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, batch = examples.llama_tiny(batch=4, seq=32, layers=2, hidden=64, vocab=256)
        model = model.to(torch.bfloat16)
        pmodel = autopar.autoparallelize(
            model, autopar.ClusterSpec.local(), batch, zero_stage=2, offload=autopar.Offload.OPTIMIZER
        )
        opt = pmodel.optimizer(torch.optim.Adam, lr=1e-3)
        losses = []
        for _ in range(3):
            losses.append(float(pmodel.step(**batch)))
            opt.step()
            opt.zero_grad()
        return losses
    finally:
        dist.destroy_process_group()


def test_a_second_process_group_trains_as_the_first(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    first = _train(tmp_path, "first")
    second = _train(tmp_path, "second")
    assert first == second
    assert first[-1] < first[0]  # it trained
