"""A plan applied where it was not made for says so first in the words that name the mistake:
"made for N devices, this job has M", then "made for another model" or "for other inputs",
before anything (the fused kernels' nodes, the graph's fingerprint) is compared."""

from __future__ import annotations

import pytest

import autopar
from autopar.examples import gpt2_tiny, llama_tiny
from autopar.launch import run_on_ranks
from autopar.passes.replay import traced_as_planned

H100x8 = autopar.ClusterSpec.preset("h100-sxm", devices_per_node=8)


@pytest.fixture(scope="module")
def gpt2_on_8():
    """A plan of another model for 8 H100s: it fuses kernels (the CUDA default)."""
    model, inputs = gpt2_tiny()
    plan = autopar.plan(model, H100x8, inputs)
    assert plan.world_size == 8 and plan.kernels
    return plan


@pytest.fixture(scope="module")
def llama_on_2():
    model, inputs = llama_tiny()
    return autopar.plan(model, autopar.ClusterSpec.preset("cpu", devices_per_node=2), inputs)


def test_another_model_is_named_before_its_kernels(gpt2_on_8):
    model, inputs = llama_tiny()
    with pytest.raises(autopar.PlanMismatchError) as e:
        traced_as_planned(model, inputs, gpt2_on_8)
    n_gpt2 = sum(1 for d in gpt2_on_8.decisions if d.role == "param")
    n_llama = len({id(p) for p in model.parameters()})
    msg = str(e.value)
    assert msg.startswith(
        f"this plan was made for another model: GPT2LMHeadModel with {n_gpt2} parameters, this is "
        f"LlamaForCausalLM with {n_llama} ("
    ), msg
    assert "fuses kernels" not in msg and msg.endswith("re-plan with autopar.plan(...) for this model")


def test_other_inputs_are_named_with_their_shapes(llama_on_2):
    model, _ = llama_tiny()
    _, inputs = llama_tiny(batch=4)
    with pytest.raises(autopar.PlanMismatchError) as e:
        traced_as_planned(model, inputs, llama_on_2)
    assert str(e.value).startswith(
        "this plan was made for other inputs (input 'input_ids': (8, 32) in the plan, (4, 32) here)"
    ), str(e.value)


def test_another_world_size_comes_first(llama_on_2, gpt2_on_8):
    model, inputs = llama_tiny()
    with pytest.raises(autopar.PlanMismatchError) as e:
        autopar.reprice(model, autopar.ClusterSpec.preset("cpu", devices_per_node=4), inputs, llama_on_2)
    assert str(e.value).startswith("this plan was made for 2 devices (mesh (2,)), this job has 4; "), str(
        e.value
    )
    # a plan of another model and another size: the size is named (check_matches, as api.py does)
    with pytest.raises(autopar.PlanMismatchError) as e:
        gpt2_on_8.check_matches("another fingerprint", 2)
    assert str(e.value).startswith("this plan was made for 8 devices (mesh "), str(e.value)
    assert "this job has 2; re-plan for 2 devices" in str(e.value)


def _apply(rank, world, path):
    model, inputs = llama_tiny()
    try:
        autopar.autoparallelize(model, autopar.ClusterSpec.local(), inputs, plan=path)
    except autopar.PlanMismatchError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_a_plan_for_8_devices_of_another_model_on_a_2_rank_job(gpt2_on_8, tmp_path):
    path = tmp_path / "plan.json"
    gpt2_on_8.save(path)
    for msg in run_on_ranks(_apply, 2, str(path), timeout_s=300):
        assert msg is not None and msg.startswith("this plan was made for 8 devices (mesh "), msg
        assert "this job has 2" in msg and "fuses kernels" not in msg
