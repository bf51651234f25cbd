"""autopar.launch.run_on_ranks: results come back, and failures say which rank and why."""

from __future__ import annotations

import multiprocessing.util
import os

import pytest

from autopar.launch import RankFailed, run_on_ranks


def _rank_then_dies_in_teardown(rank: int, world: int) -> int:
    if rank == 0:
        # as gloo's rare abort at process exit: after the report (a finalizer: a forked rank runs no
        # atexit handlers)
        multiprocessing.util.Finalize(None, os._exit, (3,), exitpriority=-100)
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


def _ranks_ran(rank: int, world: int) -> int:
    return rank + 100 * world


@pytest.mark.slow
def test_a_port_taken_before_rank_0_binds_it_starts_the_ranks_again(monkeypatch, caplog):
    """The race ``free_port`` leaves (another process binds the port before rank 0's store does):
    here the first port is held by a listening socket; the ranks start again on another, once, and
    a run whose every port is taken says so."""
    import socket

    from autopar import launch

    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        taken = held.getsockname()[1]
        ports = iter([taken])
        real = launch.free_port
        monkeypatch.setattr(launch, "free_port", lambda: next(ports, None) or real())
        with caplog.at_level("WARNING", logger="autopar.launch"):
            assert run_on_ranks(_ranks_ran, 2) == [200, 201]
        assert caplog.text.count("port was taken") == 1
        monkeypatch.setattr(launch, "free_port", lambda: taken)
        with pytest.raises(RankFailed, match=f"port was taken {launch.PORT_TRIES} times"):
            run_on_ranks(_ranks_ran, 2, timeout_s=30.0)
    finally:
        held.close()


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


def _interleaved_rank(rank: int, world: int):
    from fake_clock import FakeClock

    from autopar.tools import measure

    clock = FakeClock()
    measure.time = clock.module()  # this spawned process's own
    # seconds per step on this rank: "a" is slower on rank 1, "b" on rank 0
    cost = {"a": (0.002, 0.003), "b": (0.006, 0.005)}
    calls: list[str] = []

    def entry(name: str):
        def step():
            calls.append(name)
            clock.advance(cost[name][rank])
            if name == "b" and rank == 0 and calls.count("b") == 5:  # one timed step stalls
                clock.advance(1.0)

        return step

    times = measure.time_interleaved({"a": entry("a"), "b": entry("b")}, 4, warmup=1, steps_per_round=2)
    return times, calls


@pytest.mark.slow
def test_interleaved_rounds_shuffle_alike_on_every_rank_and_settle_before_timing():
    """Every rank runs the entries in the same order, shuffled per round; each entry runs one
    untimed step and its two timed ones together; on clocks that move only by the steps' known
    seconds, each figure is the slowest rank's step time, the median over rounds (one stalled
    step is out), the same on every rank."""
    (t0, calls0), (t1, calls1) = run_on_ranks(_interleaved_rank, 2)
    assert calls0 == calls1
    runs = [calls0[i : i + 3] for i in range(0, len(calls0), 3)]  # settle + 2 timed, per entry
    assert len(runs) == 2 * 5 and all(len(set(r)) == 1 for r in runs)
    firsts = [runs[2 * r][0][0] for r in range(5)]
    assert set(firsts) == {"a", "b"}  # the order changes between rounds
    for times in (t0, t1):
        assert times == pytest.approx({"a": 0.003, "b": 0.006}, rel=1e-9)
