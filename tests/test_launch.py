"""autopar.launch.run_on_ranks: results come back, and failures say which rank and why."""

from __future__ import annotations

import atexit
import os

import pytest

from autopar.launch import RankFailed, run_on_ranks


def _rank_then_dies_in_teardown(rank: int, world: int) -> int:
    if rank == 0:
        atexit.register(os._exit, 3)  # as gloo's rare abort at process exit: after the report
    return rank * 10


def _rank_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 broke")
    return rank


@pytest.mark.slow
def test_a_rank_that_dies_after_reporting_loses_nothing_and_a_failing_rank_is_named(caplog):
    with caplog.at_level("WARNING", logger="autopar.launch"):
        assert run_on_ranks(_rank_then_dies_in_teardown, 2) == [0, 10]
    assert "rank 0 reported its result, then exited with code 3" in caplog.text
    with pytest.raises(RankFailed, match=r"(?s)rank 1 failed.*ValueError: rank 1 broke"):
        run_on_ranks(_rank_fails, 2)


def _affinity(rank: int, world: int) -> tuple[list[int], int]:
    from autopar.cluster import usable_cores

    return sorted(os.sched_getaffinity(0)), usable_cores()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")
def test_each_rank_is_bound_to_one_core_round_robin():
    """Rank r runs on core r mod cores of the launcher's affinity (consecutive ranks on different
    cores), and still counts the launcher's cores as the host's (what calibrate records and
    ``compute_slowdown`` divides by); with ``pin_cores=False`` a rank may run anywhere the
    launcher may."""
    cores = sorted(os.sched_getaffinity(0))
    world = 4
    n = len(cores)
    assert run_on_ranks(_affinity, world) == [([cores[r % n]], n) for r in range(world)]
    assert run_on_ranks(_affinity, 2, pin_cores=False) == [(cores, n), (cores, n)]
