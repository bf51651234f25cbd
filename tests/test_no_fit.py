"""``NoPlanFitsError`` says what the smallest plan needs against the limit, which trades the search
already tried, and the fix that would help (``passes/no_fit.py``): on real models, checked against
what planning again with that fix gives."""

from __future__ import annotations

import re

import pytest

import autopar
from autopar.cli import main
from autopar.examples import llama_tiny

SCALE = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _bytes(value: str, unit: str) -> float:
    return float(value) * SCALE[unit]


def _cpu(n: int) -> autopar.ClusterSpec:
    return autopar.ClusterSpec.preset("cpu", devices_per_node=n).with_overrides(memory_reserve=0.0)


def _long_vocab_llama():
    """One sequence (a batch of 1) of a large vocabulary: the logits outweigh the model."""
    return llama_tiny(batch=1, seq=512, hidden=32, vocab=8192, layers=1)


def test_outputs_that_dominate_are_named_as_the_fix():
    model, inputs = _long_vocab_llama()
    cluster = _cpu(2)
    loss_only = autopar.plan(model, cluster, inputs, outputs=autopar.Outputs.LOSS)
    limit = loss_only.predicted.peak_memory_bytes
    with pytest.raises(autopar.NoPlanFitsError) as e:
        autopar.plan(model, cluster, inputs, memory_limit_bytes=limit)
    msg = str(e.value)
    m = re.search(
        r"the smallest plan (?:the solver found )?needs (?:at least )?([\d.]+) (\w+) per device", msg
    )
    assert m, msg
    assert _bytes(m[1], m[2]) > limit
    m = re.search(r"the limit is ([\d.]+) (\w+) ", msg)
    assert m and abs(_bytes(m[1], m[2]) - limit) <= 0.01 * limit, msg
    logits = 1 * 512 * 8192 * 4  # float32 logits, whole
    m = re.search(r"Would help: outputs=Outputs\.LOSS \(autopar plan --outputs loss\): the outputs besides the loss "
                  r"take ([\d.]+) (\w+) whole", msg)  # fmt: skip
    assert m, msg
    assert abs(_bytes(m[1], m[2]) - logits) <= 0.01 * logits
    # the batch of one splits over no data-parallel axis: ZeRO was never on offer, and the role
    # that would offer it is no fix
    assert "no ZeRO (the batch of 1 splits over no data-parallel axis)" in msg
    assert "AxisRole.DATA" not in msg
    # and the fix holds: with the loss alone, a plan fits that limit
    assert loss_only.predicted.peak_memory_bytes <= limit


def test_a_limit_under_every_plan_says_what_the_smallest_needs_and_what_was_tried(tmp_path, capsys):
    rc = main([
        "plan", "autopar.examples:gpt2_tiny", "--cluster", "cpu:1x2", "--memory-limit-gib", "0.001",
        "--out", str(tmp_path / "p.json"),
    ])  # fmt: skip
    assert rc != 0
    msg = capsys.readouterr().err
    assert "every plan the solver found passes it" not in msg
    m = re.search(
        r"the smallest plan (?:the solver found )?needs (?:at least )?([\d.]+) (\w+) per device", msg
    )
    assert m, msg
    limit = 0.001 * 2**30 * 0.9  # the cpu preset holds 10% in reserve
    assert _bytes(m[1], m[2]) > limit
    assert re.search(r"the limit is 943\.72 KiB", msg), msg
    # the trades the ladder climbed are named as tried, and none of them is suggested again
    tried = re.search(r"Already tried: ([^.]*)\.", msg)
    assert tried, msg
    assert "ZeRO stages 0, 1, 2, 3" in tried[1] and "recomputation none, selective, half_matmuls, full" in tried[1]
    assert "offload optimizer, parameters" in tried[1] and re.search(r"micro-batches 1, 2(, \d+)*", tried[1])
    advice = msg[tried.end() :]
    for already in ("zero_stage", "ZeRO", "AxisRole.DATA", "recompute=", "micro_batches", "offload="):
        assert already not in advice, msg
    assert re.search(r"(Try|Else try): more devices", advice), msg
