"""``autopar.to_torch``: a plan's data- and tensor-parallel part as PyTorch's own ``DeviceMesh`` and
``parallelize_module`` plan, and the round trip: the exported plan, applied by PyTorch, trains one
SGD step to the same loss and weights as autopar's module and as one device."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import D, S, T
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import Replicate, Shard

import autopar
from autopar.examples import gpt2_tiny, llama_tiny, mlp
from autopar.export import DataParallel, ExportError, to_torch
from autopar.launch import run_on_ranks

LR = 0.1
MODELS = {
    "mlp": lambda: mlp(batch=8, hidden=16, ffn=32),
    "llama": lambda: llama_tiny(batch=4, seq=16, hidden=32, vocab=128, layers=2),
    # the loss taken by the loop from the logits: the model's own normalizes over the whole batch's
    # tokens, which data parallelism in PyTorch does not (``test_what_pytorch_s_plans_cannot_say...``)
    "llama logits": lambda: _logits_only(*llama_tiny(batch=4, seq=16, hidden=32, vocab=128, layers=2)),
    "llama long": lambda: llama_tiny(batch=2, seq=64, hidden=32, vocab=128, layers=1),
}


def _logits_only(model, inputs):
    return model, {"input_ids": inputs["input_ids"]}


def _cpu(world: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.preset("cpu", devices_per_node=world)


def _plan(name: str, mesh, roles, **kw) -> autopar.Plan:
    model, inputs = MODELS[name]()
    world = 1
    for n in mesh:
        world *= n
    kw.setdefault("zero_stage", 0)  # the layouts these tests name (ZeRO-1 is exported as FSDP2)
    return autopar.plan(model, _cpu(world), inputs, mesh_shape=mesh, axis_roles=roles, **kw)


def _style(style) -> tuple:
    return type(style).__name__, style.input_layouts, style.output_layouts


def test_a_tensor_parallel_mlp_is_colwise_then_rowwise():
    model, inputs = MODELS["mlp"]()
    tp = to_torch(_plan("mlp", (2,), (T,)), model, inputs)
    assert tp.mesh_shape == (2,) and tp.mesh_dim_names == ("tensor",) and tp.tensor_dim == "tensor"
    assert tp.data_dim is None and tp.data_parallel is DataParallel.NONE
    assert {k: _style(v) for k, v in tp.parallelize_plan.items()} == {
        "up": ("ColwiseParallel", (Replicate(),), (Shard(-1),)),
        "down": ("RowwiseParallel", (Shard(-1),), (Replicate(),)),
    }
    # an axis of one rank holds nothing split (whatever the plan writes there): a replica dim
    one = to_torch(_plan("mlp", (1, 2), (autopar.AxisRole.AUTO, T)), model, inputs)
    assert one.mesh_dim_names == ("replica", "tensor") and one.parallelize_plan.keys() == {"up", "down"}


def test_a_tensor_parallel_llama_exports_megatron_s_layout():
    model, inputs = MODELS["llama"]()
    plan = _plan("llama", (2,), (T,))
    tp = to_torch(plan, model, inputs)
    styles = tp.parallelize_plan
    for i in range(2):
        block = f"model.layers.{i}"
        for leaf in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            assert _style(styles[f"{block}.{leaf}"]) == ("ColwiseParallel", (Replicate(),), (Shard(-1),)), (
                leaf
            )
        for leaf in ("self_attn.o_proj", "mlp.down_proj"):
            assert _style(styles[f"{block}.{leaf}"]) == ("RowwiseParallel", (Shard(-1),), (Replicate(),)), (
                leaf
            )
    # the embedding's hidden split is gathered before the first norm; the head's logits before the loss
    assert isinstance(styles["model.embed_tokens"], ColwiseParallel)
    assert styles["model.embed_tokens"].output_layouts == (Replicate(),)
    assert isinstance(styles["lm_head"], ColwiseParallel) and styles["lm_head"].output_layouts == (
        Replicate(),
    )
    assert len(styles) == 2 * 7 + 2
    # the residual adds the plan takes as pending sums (the all-reduce after them) run on the
    # reduced values under PyTorch's plan, and the notes say so
    partial_adds = [d.name for d in plan.decisions if d.op == "aten.add.Tensor" and d.output == "P"]
    (note,) = [n for n in tp.notes if "run whole under PyTorch's plan" in n]
    assert partial_adds and all(name in note for name in partial_adds), (partial_adds, note)
    assert not any(
        isinstance(s, RowwiseParallel) and s.output_layouts != (Replicate(),) for s in styles.values()
    )


def test_a_data_parallel_plan_is_replicate_and_zero_3_is_fully_shard():
    model, inputs = MODELS["mlp"]()
    tp = to_torch(_plan("mlp", (2,), (D,)), model, inputs)
    assert tp.mesh_dim_names == ("data",) and tp.parallelize_plan == {}
    assert tp.data_parallel is DataParallel.REPLICATE
    z3 = to_torch(_plan("mlp", (2,), (D,), zero_stage=3), model, inputs)
    assert z3.data_parallel is DataParallel.FULLY_SHARD and z3.reshard_after_forward


def test_what_pytorch_s_plans_cannot_say_is_refused_by_name():
    model, inputs = MODELS["llama"]()
    # the loss is a mean over the whole batch's tokens (an all-reduce of the count inside the op):
    # averaging the ranks' means, as DDP does, is another number where ranks count other tokens
    with pytest.raises(
        ExportError, match=r"node cross_entropy_loss .* reduces over the whole batch inside the op"
    ):
        to_torch(_plan("llama", (2,), (D,)), model, inputs)
    with pytest.raises(
        ExportError, match=r"splits input input_ids on its dim 1 .*\(sequence or context parallelism\)"
    ):
        to_torch(_plan("llama", (2,), (S,)), model, inputs)
    gpt2, gpt2_inputs = gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128, layers=1)
    tied = autopar.plan(gpt2, _cpu(2), gpt2_inputs, mesh_shape=(2,), axis_roles=(T,))
    with pytest.raises(ExportError, match=r"transformer.wte.weight is used by .*tied weights"):
        to_torch(tied, gpt2, gpt2_inputs)
    pipelined = autopar.plan(model, _cpu(2), inputs, mesh_shape=(1,), pipeline_stages=2)
    with pytest.raises(ExportError, match="2 pipeline stages"):
        to_torch(pipelined, model, inputs)


class _Gated(torch.nn.Module):
    """An MLP whose hidden values are scaled by one learned gain: with the hidden split, the gain's
    gradient is a sum over the ranks. It returns a vector, not a scalar loss: a scalar's sum is
    priced off the step's path (``passes/use_price.py:deferred_output``), which makes gathering the
    hidden values the cheaper plan on 2 CPU ranks, where this test needs the split to meet the gain."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.gain = torch.nn.Parameter(torch.ones(1))
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(self.up(x) * self.gain).square().sum(0)


def test_a_whole_parameter_meeting_split_values_is_refused():
    """Under PyTorch's plan ``gain`` stays a plain tensor: its gradient would be one rank's part of
    the sum the plan all-reduces."""
    torch.manual_seed(0)
    model, inputs = _Gated(), (torch.randn(8, 16),)
    plan = autopar.plan(model, _cpu(2), inputs, mesh_shape=(2,), axis_roles=(T,))
    assert plan.parameter_placements["gain"] == "R" and plan.decision("mul").inputs == ("S(1)", "R")
    with pytest.raises(ExportError, match=r"node mul \(aten.mul.Tensor\) uses gain whole with values split"):
        to_torch(plan, model, inputs)


class _Normed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.bn = torch.nn.BatchNorm1d(16)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.bn(self.lin(x)), y)


def test_batch_statistics_over_the_whole_batch_are_refused_on_the_data_axis():
    """The plan's batch norm is synchronized over the data axis; DDP's would use each rank's rows."""
    torch.manual_seed(0)
    model, inputs = _Normed(), (torch.randn(8, 16), torch.randn(8, 16))
    plan = autopar.plan(model, _cpu(2), inputs, mesh_shape=(2,), axis_roles=(D,))
    with pytest.raises(
        ExportError, match=r"node batch_norm \(aten.batch_norm.default, module bn\) reduces over"
    ):
        to_torch(plan, model, inputs)


def test_a_plan_for_another_model_is_refused_before_anything_is_exported():
    model, inputs = MODELS["mlp"]()
    other, other_inputs = mlp(batch=8, hidden=16, ffn=64)
    plan = _plan("mlp", (2,), (T,))
    with pytest.raises(autopar.PlanMismatchError):
        to_torch(plan, other, other_inputs)


# -- the round trip on gloo ranks -----------------------------------------------------------------


def _loss(out, inputs):
    if getattr(out, "loss", None) is not None:
        return out.loss
    if hasattr(out, "logits"):  # next-token loss of the rows the rank has, a mean over them
        logits, ids = out.logits[:, :-1], inputs["input_ids"][:, 1:]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    return out[0]


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _rows(inputs, rank: int, parts: int):
    cut = lambda t: t.chunk(parts)[rank]  # noqa: E731
    return {k: cut(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(map(cut, inputs))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _round_trip_rank(rank, world, cases):
    """Per case: one SGD step with autopar's module and one with the exported plan applied by
    PyTorch; each gives (loss, full weights)."""
    import torch.distributed as dist

    results = {}
    for key, (name, path) in cases.items():
        model, inputs = MODELS[name]()
        plan = autopar.Plan.load(path)
        pm = autopar.autoparallelize(copy.deepcopy(model), _cpu(world), inputs, plan=plan)
        opt = torch.optim.SGD(pm.parameters(), lr=LR)
        loss = _loss(_call(pm, inputs), inputs)
        loss.backward()
        opt.step()
        ours = (loss.detach(), {k: v.detach() for k, v in pm.full_state_dict().items()})

        tp = to_torch(plan, model, inputs)
        mesh = tp.device_mesh("cpu")
        tm = tp.apply(copy.deepcopy(model), mesh)
        opt = torch.optim.SGD(tm.parameters(), lr=LR)
        feed = inputs
        if tp.data_dim is not None:
            dp = mesh[tp.data_dim]
            feed = _rows(inputs, dp.get_local_rank(), dp.size())
        loss = _loss(_call(tm, feed), feed)
        loss.backward()
        opt.step()
        loss = loss.detach().clone()
        if tp.data_dim is not None:  # each data-parallel rank's mean over its rows: their mean is the batch's
            dist.all_reduce(loss, group=mesh[tp.data_dim].get_group())
            loss /= mesh[tp.data_dim].size()
        theirs = (loss, {k: _full(v).detach() for k, v in tm.state_dict().items()})
        # how PyTorch holds each parameter: proof that the plan was applied, not a whole model trained
        held = {k: tuple(v.placements) for k, v in tm.named_parameters() if isinstance(v, DTensor)}
        results[key] = (ours, theirs, held, tp.data_parallel)
    return results


def _one_device(name: str):
    model, inputs = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = _loss(_call(model, inputs), inputs)
    loss.backward()
    opt.step()
    return loss.detach(), {k: v.detach() for k, v in model.state_dict().items()}


def _check(results, key: str, name: str):
    ref_loss, ref_weights = _one_device(name)
    for rank, per_rank in enumerate(results):
        ours, theirs, styles, dp = per_rank[key]
        for who, (loss, weights) in (("autopar", ours), ("exported", theirs)):
            label = f"{key} rank {rank} {who}"
            torch.testing.assert_close(
                loss, ref_loss, rtol=1e-5, atol=1e-6, msg=lambda m, label=label: f"{label}: {m}"
            )
            assert set(weights) == set(ref_weights), label
            for k, w in weights.items():
                torch.testing.assert_close(w, ref_weights[k], rtol=1e-4, atol=1e-5,
                                               msg=lambda m, label=label, k=k: f"{label} {k}: {m}")  # fmt: skip
        # the two steps also agree with each other to rounding
        for k, w in theirs[1].items():
            torch.testing.assert_close(w, ours[1][k], rtol=1e-5, atol=1e-6)
    return results[0][key]


@pytest.mark.slow
def test_the_exported_plans_train_as_autopar_and_one_device_on_2_ranks(tmp_path):
    cases = {"mlp tp": ("mlp", (2,), (T,)), "llama tp": ("llama", (2,), (T,)), "mlp dp": ("mlp", (2,), (D,))}
    paths = {}
    for key, (name, mesh, roles) in cases.items():
        path = tmp_path / f"{key.replace(' ', '_')}.json"
        _plan(name, mesh, roles).save(path)
        paths[key] = (name, str(path))
    # planned for H100s, where the search picks another layout than Megatron's (and fused kernels,
    # which the export leaves to PyTorch's aten ops): whatever it is, the export must run it alike
    model, inputs = MODELS["llama long"]()
    h100 = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=2)
    autopar.plan(model, h100, inputs, mesh_shape=(2,), axis_roles=(T,)).save(tmp_path / "h100.json")
    paths["llama h100 tp"] = ("llama long", str(tmp_path / "h100.json"))
    results = run_on_ranks(_round_trip_rank, 2, paths, timeout_s=300)
    _, _, held, dp = _check(results, "mlp tp", "mlp")
    assert held == {"up.weight": (Shard(0),), "up.bias": (Shard(0),), "down.weight": (Shard(1),),
                    "down.bias": (Replicate(),)} and dp is DataParallel.NONE  # fmt: skip
    _, _, held, _ = _check(results, "llama tp", "llama")
    assert held["model.layers.1.self_attn.q_proj.weight"] == (Shard(0),)
    assert held["model.layers.1.mlp.down_proj.weight"] == (Shard(1),)
    assert held["model.embed_tokens.weight"] == (Shard(1),) and held["lm_head.weight"] == (Shard(0),)
    assert "model.norm.weight" not in held  # no style: a plain parameter, whole on every rank
    _, _, held, dp = _check(results, "mlp dp", "mlp")
    assert dp is DataParallel.REPLICATE and set(held.values()) == {(Replicate(),)} and len(held) == 4
    _, _, held, _ = _check(results, "llama h100 tp", "llama long")
    assert held and all(p != (Replicate(),) for p in held.values())


@pytest.mark.slow
def test_a_data_by_tensor_mesh_trains_as_autopar_and_one_device_on_4_ranks(tmp_path):
    """2 x 2 (data, tensor): the tensor dim's styles inside, ``replicate`` (ZeRO 0) or FSDP2's
    ``fully_shard`` (ZeRO 3) over the data dim outside."""
    cases = {"mlp dp x tp": ("mlp", {}), "llama dp x tp zero 3": ("llama logits", {"zero_stage": 3})}
    paths = {}
    for key, (name, kw) in cases.items():
        path = tmp_path / f"{key.replace(' ', '_')}.json"
        _plan(name, (2, 2), (D, T), **kw).save(path)
        paths[key] = (name, str(path))
    results = run_on_ranks(_round_trip_rank, 4, paths, timeout_s=600)
    _, _, held, dp = _check(results, "mlp dp x tp", "mlp")
    assert dp is DataParallel.REPLICATE and held["up.weight"] == (Replicate(), Shard(0))
    _, _, held, dp = _check(results, "llama dp x tp zero 3", "llama logits")
    assert dp is DataParallel.FULLY_SHARD
    assert held["model.layers.0.mlp.down_proj.weight"] == (
        Shard(0),
        Shard(1),
    )  # FSDP's rows, the style's columns
