"""What the search does for time alone changes nothing else: the cost tables built on a worker
thread while HiGHS solves (``passes/prefetch.py:Prefetcher``, ``passes/background.py``) give the plan,
candidates, progress lines and dumps of the search on one thread, also where the worker's order
is not the search's; the collector settings the search sets (``_young_garbage_only``) are put back,
when it raises too, and a caller's own frozen objects stay frozen."""

from __future__ import annotations

import gc
import re
import threading

import pytest
import torch

import autopar
from autopar.errors import NoPlanFitsError
from autopar.examples import llama, llama_tiny
from autopar.passes import background, prefetch


def _model():
    # 4 blocks on 16 devices: SPMD meshes of up to 3 axes and pipelines of 2 and 4 stages; a batch
    # of 6 leaves some meshes' data axes no placement (skipped, what building their tables says)
    with torch.device("meta"):
        return llama(layers=4, hidden=512, ffn=1024, heads=8, kv_heads=2, vocab=2048, batch=6, seq=512)


CLUSTER = autopar.ClusterSpec.preset("h100-sxm", nodes=2, devices_per_node=8)


def _plan(tmp_path, name):
    model, inputs = _model()
    lines: list[str] = []
    plan = autopar.plan(
        model, CLUSTER, inputs, outputs=autopar.Outputs.LOCAL, progress=lines.append, dump_dir=tmp_path / name
    )
    d = plan.to_dict()
    d["solver"].pop("solve_time_s")
    # seconds measured on the way (tracing, each solve, the whole) are the only lines that differ
    said = [re.sub(r"\d+\.\d+ s\b", "T s", line) for line in lines]
    dumps = {
        p.name: re.sub(r'"solve_time_s": [\d.e-]+', "", p.read_text())
        for p in sorted((tmp_path / name).iterdir())
    }
    return d, said, dumps


def test_tables_built_on_a_worker_plan_as_on_one_thread(tmp_path, monkeypatch):
    threaded = _plan(tmp_path, "threaded")
    assert any("pipeline stages" in line for line in threaded[1])  # pipeline candidates were taken too
    assert any("skipped" in line for line in threaded[1])  # and candidates with no placement
    monkeypatch.setattr(prefetch, "PREFETCH_TABLES", False)
    alone = _plan(tmp_path, "alone")
    assert threaded[0] == alone[0]
    assert threaded[1] == alone[1]
    assert threaded[2] == alone[2]
    assert any(name.startswith("3_costs_") for name in threaded[2])


def test_a_worker_out_of_the_search_order_is_not_waited_on(tmp_path, monkeypatch):
    """The worker's order reversed: every candidate the search asks for is built on the spot."""
    alone = _plan(tmp_path, "in_order")
    order = prefetch.table_order
    monkeypatch.setattr(prefetch, "table_order", lambda pb: iter(reversed(list(order(pb)))))
    built: list[str] = []
    prepare = prefetch.prepare_candidate

    def counted(pb, run, cluster):
        built.append(threading.current_thread().name)
        return prepare(pb, run, cluster)

    monkeypatch.setattr(prefetch, "prepare_candidate", counted)
    assert _plan(tmp_path, "reversed") == alone
    assert any(name == threading.current_thread().name for name in built)  # built on the spot


def test_the_collector_is_left_as_found():
    model, inputs = llama_tiny(batch=8, seq=32)
    cluster = autopar.ClusterSpec.preset("cpu", devices_per_node=2)
    before = gc.get_threshold(), gc.get_freeze_count()
    autopar.plan(model, cluster, inputs)
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
    with pytest.raises(NoPlanFitsError):
        autopar.plan(model, cluster, inputs, memory_limit_bytes=1024)
    assert (gc.get_threshold(), gc.get_freeze_count()) == before
    # a caller that froze objects itself keeps them frozen: the search freezes nothing more
    keep = [object() for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen >= len(keep)
        autopar.plan(model, cluster, inputs)
        # none added, none handed back (a few frozen objects may have died meanwhile)
        assert frozen // 2 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def _at_checkpoint(gate: background.Gate) -> tuple[threading.Thread, threading.Event]:
    """A worker thread of ``gate`` that has reached a checkpoint, and the event it sets past it."""
    arrived, passed = threading.Event(), threading.Event()

    def body():
        with background.working(gate):
            arrived.set()
            background.checkpoint()
        passed.set()

    t = threading.Thread(target=body)
    t.start()
    arrived.wait()
    return t, passed


def test_a_worker_runs_only_while_the_owner_is_idle():
    background.checkpoint()  # no gate: nothing to wait for
    gate = background.Gate()
    with background.owning(gate):
        background.checkpoint()  # the owner's own thread never waits
        t, passed = _at_checkpoint(gate)
        t.join(0.2)
        assert t.is_alive() and not passed.is_set()  # held at its checkpoint while the owner works
        with background.owner_idle():
            passed.wait()
        t.join()
        # another search's worker waits on its own gate, opened by its own owner's idle time only
        other = background.Gate()
        t2, done = _at_checkpoint(other)
        with background.owner_idle():  # this thread's idle time opens this thread's gate alone
            t2.join(0.2)
            assert not done.is_set()
        other.release()  # its owner's search ended
        t2.join()
        assert done.is_set()
    # released on exit: a worker arriving late does not wait
    late, passed = _at_checkpoint(gate)
    late.join()
    assert passed.is_set()
