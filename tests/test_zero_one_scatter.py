"""ZeRO-1 reduce-scatters its gradient buckets into the optimizer's shares (``codegen/grad_sync.py``,
``passes/grad_sync.py:scatters``), on gloo.

The parent plans GPT-2 (tiny) with ZeRO-1 forced on a (2,) data mesh (world 2), a (3,) one (world
3: no dim divides by 3, so every share is cut unevenly, as ``torch.chunk`` and DTensor cut), a (2, 2) data x
tensor mesh, a (2, 2) mesh whose two axes both split the batch (ZeRO-1 over both: shares cut
over 4 ranks, reduce-scattered one axis after the other), and ``examples.mlp`` on two (2, 2)
meshes: 9 -> 6 -> 9 features on data x tensor, where the column-parallel weight's tensor-parallel
piece has 3 rows, cut over the data axis unevenly and strided (DTensor's ``_StridedShard(0)``, as
FSDP2 cuts over tensor parallelism; Megatron's 32B layout has such pieces: 896 rows over 48), and
8 -> 6 -> 8 on data x data, where the first weight's 6 rows do not divide by 4 shares, so its
shares cut its 8 columns (``Shard(1)`` on both axes). Each rank trains three Adam steps; the
second step's backward runs twice without zeroing (gradients accumulated onto the shares the first
left). Checked against one device: after the first backward, ``full_grads()`` equals the model's
gradients and ``pmodel.clip_grad_norm_`` its total norm (the shares read as ``DTensor``s), and
every parameter of a reduce-scattered bucket has a ``.grad`` of this rank's share of its piece
(``torch.chunk``'s cut on the dim the shares cut; a parameter reduced inline, not in a bucket,
keeps its whole gradient); the
losses, Adam's first moments gathered whole from the shares' ``DTensor`` state
(``optimizer_state_dict``: the shares' placements say where each piece is) and the full state after
the steps (``harness.assert_adam_state_close``); the optimizer state saved with ``dcp.save``
(each rank its shares, where their placements say) and read back whole with no process group
holds those moments. The plan's buckets marked ``scatter`` are
the ones the runtime reduce-scatters, and their count is what ran.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import D, T, assert_adam_state_close
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import autopar
from autopar.codegen import zero_one
from autopar.examples import gpt2_tiny, mlp
from autopar.launch import run_on_ranks
from autopar.placement import is_replicate, local_shape
from autopar.trades import Trades, ZeroStage

LR = 1e-3
STEPS = 3
MESHES = {  # mesh, axis roles, ZeRO-1's data axes, model
    "d2": ((2,), (D,), (0,), "gpt2"),
    "d3": (
        (3,),
        (D,),
        (0,),
        "gpt2",
    ),  # no dim divides by 3: uneven shares (torch.chunk's cut), padded collectives
    "d2t2": ((2, 2), (D, T), (0,), "gpt2"),
    "d2d2": ((2, 2), (D, D), (0, 1), "gpt2"),
    # the column-parallel weight [6, 9] stored R,S(0): 3 rows a piece, cut strided and uneven
    "d2t2_mlp": ((2, 2), (D, T), (0,), "mlp9"),
    # the weight [6, 8] replicated: 6 rows do not divide by 4 shares over two axes, its columns do
    "d2d2_mlp": ((2, 2), (D, D), (0, 1), "mlp8"),
}
BUILDS = {
    "gpt2": lambda: gpt2_tiny(batch=12, seq=16, hidden=32, vocab=128),
    "mlp9": lambda: mlp(batch=8, hidden=9, ffn=6),
    "mlp8": lambda: mlp(batch=8, hidden=8, ffn=6),
}


def _loss(model, inputs):
    """The loss of a Hugging Face model (keyword inputs) or of ``examples.mlp`` (positional)."""
    if isinstance(inputs, dict):
        return model(**inputs).loss
    return model(*inputs)[0]


def _reference(name):
    """One device: the first backward's gradients and norm, the losses and the state after the
    steps, the second step's gradient accumulated over two backwards."""
    model, inputs = BUILDS[name]()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, grads, norm = [], None, None
    for step in range(STEPS):
        for _ in range(2 if step == 1 else 1):
            loss = _loss(model, inputs)
            loss.backward()
            losses.append(loss.item())
        if step == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters()}
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
        opt.step()
        opt.zero_grad()
        if step == STEPS - 1:  # the moments before the last zero_grad
            names = {id(p): k for k, p in model.named_parameters()}
            moments = {names[id(p)]: st["exp_avg"].clone() for p, st in opt.state.items()}
    return losses, grads, norm, moments, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(rank, world, path, name, ckpt):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    model, inputs = BUILDS[name]()
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
    opt = pmodel.optimizer(torch.optim.Adam, lr=LR)
    sync = pmodel.grad_sync
    out = dict(losses=[], scattered=[], dims=set(), strided=[])
    for step in range(STEPS):
        for _ in range(2 if step == 1 else 1):
            loss = _loss(pmodel, inputs)
            loss.backward()
            out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = pmodel.full_grads()
            out["norm"] = pmodel.clip_grad_norm_(1e9).item()  # reads, scales by 1
            for b in sync._buckets:
                if b.scatter:  # (.grad's shape, this rank's share's: torch.chunk's cut of the dim)
                    d = math.prod(pmodel.mesh.size(a) for a in b.scatter)
                    r = zero_one.share_index(pmodel.mesh, b.scatter)
                    for p in b.params:
                        dim = b.dims[id(p)]
                        local = p._local_tensor
                        chunks = torch.arange(local.shape[dim]).chunk(d)
                        want = list(local.shape)
                        want[dim] = len(chunks[r]) if r < len(chunks) else 0
                        out["scattered"].append(
                            (tuple(p.grad._local_tensor.shape), tuple(want), local.shape[dim])
                        )
                        out["dims"].add(dim)
                        strided = type(p.grad.placements[b.scatter[0]]).__name__ == "_StridedShard"
                        out["strided"].append((strided, local.shape[dim]))
        opt.step()
        opt.zero_grad()
    # Adam's first moments, each gathered whole from the shares' DTensor state
    out["moments"] = {
        k: v["exp_avg"].full_tensor()
        for k, v in pmodel.optimizer_state_dict(opt)["state"].items()
        if "exp_avg" in v
    }
    out["scatters"] = sync.scatters
    out["reductions"] = sync.reductions
    out["planned"] = sum(1 for b in sync._buckets if b.scatter)
    out["full"] = pmodel.full_state_dict()
    # each rank writes its shares' state where their placements say (a sharded checkpoint)
    dcp.save({"optim": pmodel.optimizer_state_dict(opt)}, checkpoint_id=ckpt)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MESHES))
def test_zero_one_reduce_scatters_into_shares_and_trains_as_one_device(case, tmp_path):
    mesh, roles, data, name = MESHES[case]
    world = math.prod(mesh)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    model, inputs = BUILDS[name]()
    plan = autopar.plan(model, cluster, inputs, mesh_shape=mesh, axis_roles=roles)
    path = tmp_path / f"zero1_{case}.json"
    dataclasses.replace(plan, trades=Trades(zero_stage=ZeroStage.OPTIMIZER, data_axes=data)).save(path)
    ckpt = tmp_path / "ckpt"
    per_rank = run_on_ranks(_rank, world, str(path), name, str(ckpt), timeout_s=300)
    losses, grads, norm, moments, state = _reference(name)
    # the checkpoint read back whole, with no process group: every share's state in its place
    dcp_to_torch_save(ckpt, tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt")["optim"]["state"]
    for k, m in moments.items():
        torch.testing.assert_close(
            saved[k]["exp_avg"], m, rtol=1e-4, atol=1e-7, msg=f"{case}: saved exp_avg {k}"
        )
    for rank, r in enumerate(per_rank):
        where = f"{case} rank {rank}"
        assert r["planned"] > 0, f"{where}: no bucket planned as a reduce-scatter"
        # one backward in steps 0 and 2, two in step 1: each scattered bucket reduced once a backward
        assert r["scatters"] == 4 * r["planned"], where
        # each .grad this rank's share of its piece, cut as torch.chunk (and DTensor) cut it
        assert r["scattered"] and all(got == want for got, want, _ in r["scattered"]), (where, r["scattered"])
        if case == "d3":
            assert any(rows % 3 for _, _, rows in r["scattered"]), f"{where}: no uneven share"
        if case == "d2t2_mlp":  # the column-parallel weight's 3-row pieces: strided, uneven shares
            assert any(s and rows % 2 for s, rows in r["strided"]), (where, r["strided"])
        if case == "d2d2_mlp":  # the first weight's shares cut its columns
            assert r["dims"] == {0, 1}, (where, r["dims"])
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses), rtol=1e-4, atol=1e-5)
        for k, g in grads.items():
            torch.testing.assert_close(r["grads"][k], g, rtol=1e-4, atol=1e-6, msg=f"{where}: grad {k}")
        assert r["norm"] == pytest.approx(norm, rel=1e-4), where
        assert set(r["moments"]) == set(moments), where
        for k, m in moments.items():
            torch.testing.assert_close(r["moments"][k], m, rtol=1e-4, atol=1e-7, msg=f"{where}: exp_avg {k}")
        for k, v in state.items():
            assert_adam_state_close(r["full"][k], v, LR, STEPS, f"{where} {k}")


def _dtensor_indices(shape, mesh_shape, coord, placements) -> list[list[int]]:
    """Per dim, the global indices of the piece DTensor places at mesh coordinate ``coord``, by its
    own per-placement cut (``_get_shard_size_and_offsets``, what ``compute_local_shape_and_global_offset``
    and so checkpoints use), all of them rather than the first."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    idx = [torch.arange(n) for n in shape]
    for a, q in enumerate(placements):
        if isinstance(q, (Shard, _StridedShard)):
            size, off = _get_shard_size_and_offsets(
                len(idx[q.dim]), mesh_shape[a], coord[a], q, idx[q.dim], shape[q.dim], False
            )
            idx[q.dim] = off if size else torch.arange(0)  # an empty piece: no indices
    return [i.tolist() for i in idx]


def _fake_param(shape, spec, mesh_shape):
    """What ``zero_one.share_placements`` reads of a parameter, without a process group."""
    return SimpleNamespace(
        placements=spec, device_mesh=SimpleNamespace(size=lambda a: mesh_shape[a]), dim=lambda: len(shape)
    )


def _share_indices(shape, spec, mesh_shape, coord, on, dim):
    """Per dim, the global indices of the share at ``coord``: ``torch.chunk``'s cut on ``dim`` of
    the rank's piece (``zero_one.share_of``), share ``share_index`` of ``d``."""
    idx = _dtensor_indices(shape, mesh_shape, coord, spec)
    mesh = SimpleNamespace(size=lambda a: mesh_shape[a], get_local_rank=lambda a: coord[a])
    r, d = zero_one.share_index(mesh, on), math.prod(mesh_shape[a] for a in on)
    idx[dim] = zero_one.share_of(torch.tensor(idx[dim], dtype=torch.long), d, r).tolist()
    return idx


def test_share_cut_rule_is_dtensors_own_placement():
    """``passes/grad_sync.py:share_cut_of`` against DTensor's own cut: on (2, 2) and (2, 2, 2)
    meshes, for every even placement of small 1-D and 2-D parameters (each axis R, S(0) or S(1))
    and every set of one or two data axes, wherever the rule cuts shares, each rank's share
    (``torch.chunk``'s cut of its piece on the chosen dim) is exactly the piece DTensor's placement
    for it (``zero_one.share_placements``: ``Shard``, ``_StridedShard``) names, the pieces
    checkpoints and ``full_tensor`` read. And it cuts wherever it can: where it passes over dim 0
    (several axes not dividing it), DTensor's nested cut of dim 0 differs from the shares'. Named
    cases: Megatron's 32B column-parallel weight (DP 48 over TP-8 pieces of 896 rows: dim 0,
    strided and uneven) and a weight replicated on two data axes whose rows do not divide by their
    product (its columns)."""
    from torch.distributed.tensor import Replicate, Shard

    from autopar.passes.grad_sync import share_cut_of

    checked, dims, refused = 0, set(), 0
    for mesh_shape in [(2, 2), (2, 2, 2)]:
        coords = list(itertools.product(*(range(n) for n in mesh_shape)))
        datas = [c for k in (1, 2) for c in itertools.combinations(range(len(mesh_shape)), k)]
        for shape in [(6,), (3,), (5,), (4, 6), (6, 8), (2, 3), (5, 4), (12, 2), (6, 9)]:
            kinds = [Replicate()] + [Shard(k) for k in range(len(shape))]
            for spec in itertools.product(kinds, repeat=len(mesh_shape)):
                try:
                    local_shape(shape, spec, mesh_shape)
                except ValueError:  # plans split evenly only
                    continue
                for data in datas:
                    on, dim = share_cut_of(shape, spec, data, mesh_shape)
                    where = (mesh_shape, shape, spec, data, on, dim)
                    if on:
                        placements = zero_one.share_placements(_fake_param(shape, spec, mesh_shape), on, dim)
                        for c in coords:
                            want = _share_indices(shape, spec, mesh_shape, c, on, dim)
                            assert _dtensor_indices(shape, mesh_shape, c, placements) == want, (where, c)
                            checked += 1
                        dims.add(dim)
                    whole = [a for a in data if is_replicate(spec[a]) and mesh_shape[a] > 1]
                    later = (
                        any(
                            b > whole[0] and b not in whole and isinstance(q, Shard) and q.dim == 0
                            for b, q in enumerate(spec)
                        )
                        if whole
                        else True
                    )
                    if len(whole) > 1 and not later and (on, dim) != (tuple(whole), 0):
                        # not cut on dim 0: DTensor's nested cut there is not the shares'
                        placements = zero_one.share_placements(
                            _fake_param(shape, spec, mesh_shape), tuple(whole), 0
                        )
                        assert any(
                            _dtensor_indices(shape, mesh_shape, c, placements)
                            != _share_indices(shape, spec, mesh_shape, c, tuple(whole), 0)
                            for c in coords
                        ), where
                        refused += 1
    assert checked > 1000 and dims == {0, 1} and refused > 10, (checked, dims, refused)
    col, rep = (Replicate(), Shard(0)), (Replicate(), Replicate())
    assert share_cut_of((7168, 5120), col, (0,), (48, 8)) == ((0,), 0)  # 896 rows over 48
    assert share_cut_of((6, 9), col, (0,), (2, 2)) == ((0,), 0)  # 3 rows over 2
    assert share_cut_of((6, 8), rep, (0, 1), (2, 2)) == ((0, 1), 1)  # 6 rows over 4: its 8 columns
    assert share_cut_of((6, 9), rep, (0, 1), (2, 2)) == ((), 0)  # neither divides by 4
    assert share_cut_of((6,), rep, (0, 1), (2, 2)) == ((), 0)  # a bias has no other dim
    assert share_cut_of((6, 8), col, (0, 1), (2, 2)) == ((0,), 0)  # whole on the data axis 0 only


def test_slots_lay_out_each_share_contiguous():
    """``zero_one.slots_of``: row ``q`` is share ``q`` (``torch.chunk``'s cut on the dim) flattened,
    zero-padded to ``slot_elements``, on dim 0 and on another dim, even and uneven."""
    x = torch.arange(4 * 7 * 3, dtype=torch.float32).view(4, 7, 3)
    for dim, d in [(0, 2), (0, 3), (1, 3), (1, 7), (2, 2), (1, 8)]:
        slots = zero_one.slots_of(x, d, dim)
        chunks = x.chunk(d, dim)
        c = chunks[0].shape[dim]
        assert slots.shape == (d, c * x.numel() // x.shape[dim]), (dim, d)
        for q in range(d):
            part = chunks[q].reshape(-1) if q < len(chunks) else x.new_zeros(0)
            assert torch.equal(slots[q, : part.numel()], part), (dim, d, q)
            assert not slots[q, part.numel() :].any(), (dim, d, q)
            assert torch.equal(zero_one.share_of(x, d, q, dim).reshape(-1), part), (dim, d, q)
