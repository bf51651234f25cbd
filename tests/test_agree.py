"""What every rank must share, checked across ranks (``codegen/agree.py``), and one solve per job.

On 2 gloo ranks: ``autoparallelize`` without a plan searches on rank 0 only (its progress lines
appear there alone) and both ranks build the same plan; weights built without a common seed,
example inputs or plans that differ between ranks, and a first batch that differs (each rank fed
its own shard, the DistributedDataParallel habit), each raise ``CrossRankMismatchError`` on every
rank, naming what differs, instead of training silently wrong or hanging in a collective.
"""

from __future__ import annotations

import torch

import autopar
from autopar.examples import gpt2_tiny
from autopar.launch import run_on_ranks


def _tiny(shift: float = 0.0, batch_seed: int = 1):
    model, _ = gpt2_tiny(batch=4, seq=16, hidden=32, vocab=128)  # seeded: the same weights each time
    with torch.no_grad():
        model.lm_head.weight.add_(shift)  # tied to the token embeddings
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(batch_seed))
    return model, {"input_ids": ids, "labels": ids}


def _outcome(fn):
    try:
        fn()
        return ("ok", "")
    except autopar.CrossRankMismatchError as e:
        return ("mismatch", str(e))


def _rank(rank, world, plan_path):
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=world)
    out = {}

    # one solve per job: rank 0 searches (its progress lines), the others receive its plan
    lines: list[str] = []
    model, inputs = _tiny()
    pmodel = autopar.autoparallelize(model, cluster, inputs, progress=lines.append)
    out["solved"] = (bool(lines), pmodel.plan.to_dict())
    loss = pmodel(**inputs).loss  # the same batch on every rank: passes the first call's check
    out["loss"] = float(loss)

    # weights that differ (as without a common seed)
    model, inputs = _tiny(shift=0.01 * rank)
    out["weights"] = _outcome(lambda: autopar.autoparallelize(model, cluster, inputs, plan=plan_path))

    # example inputs that differ (each rank its own batch)
    model, inputs = _tiny(batch_seed=10 + rank)
    out["inputs"] = _outcome(lambda: autopar.autoparallelize(model, cluster, inputs, plan=plan_path))

    # plans that differ
    model, inputs = _tiny()
    plan = autopar.Plan.load(plan_path)
    if rank == 1:
        plan = autopar.Plan.from_dict({**plan.to_dict(), "outputs": "local"})
    out["plans"] = _outcome(lambda: autopar.autoparallelize(model, cluster, inputs, plan=plan))

    # the same example inputs, then each rank's own batch at the first call
    model, inputs = _tiny()
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=plan_path)
    _, mine = _tiny(batch_seed=20 + rank)
    out["batch"] = _outcome(lambda: pmodel(**mine))
    return out


def test_ranks_agree_and_one_rank_solves(tmp_path):
    model, inputs = _tiny()
    path = tmp_path / "plan.json"
    autopar.plan(model, autopar.ClusterSpec.preset("cpu", devices_per_node=2), inputs).save(path)
    results = run_on_ranks(_rank, 2, str(path), timeout_s=600)
    # rank 0 alone searched; both built its plan, and computed the same loss
    assert results[0]["solved"][0] and not results[1]["solved"][0]
    assert results[0]["solved"][1] == results[1]["solved"][1]
    assert results[0]["loss"] == results[1]["loss"]
    for key, what in [
        ("weights", "weights"),
        ("inputs", "example inputs"),
        ("plans", "plans"),
        ("batch", "batches"),
    ]:
        for rank in range(2):
            kind, msg = results[rank][key]
            assert kind == "mismatch", (key, rank, msg)
            assert what in msg and "rank(s) [1]" in msg, msg
    assert "manual_seed" in results[0]["weights"][1]
    assert "same full global batch" in results[0]["batch"][1]
    # the plans' message names the decision that differs, with both ranks' values
    assert 'outputs: rank 0 "full", rank 1 "local"' in results[0]["plans"][1], results[0]["plans"][1]


def test_fingerprints_see_what_differs():
    from autopar.codegen.agree import fingerprint

    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    b = {"w": torch.ones(3), "b": torch.tensor([0.0, 1e-6])}
    wa, pa = fingerprint(a.items())
    wb, pb = fingerprint(b.items())
    assert wa != wb and pa["w"] == pb["w"] and pa["b"] != pb["b"]
    assert fingerprint(a.items()) == fingerprint({k: v.clone() for k, v in a.items()}.items())
    # shape and dtype count too, not only values
    assert fingerprint([("x", torch.zeros(2, 3))])[0] != fingerprint([("x", torch.zeros(3, 2))])[0]
    assert (
        fingerprint([("x", torch.zeros(2))])[0] != fingerprint([("x", torch.zeros(2, dtype=torch.int64))])[0]
    )
