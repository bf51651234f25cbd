"""The table prefetcher: each candidate's tables built one candidate ahead on a worker thread.

HiGHS releases the GIL while it solves, and the cost tables are Python: the next candidate's
tables (``passes/candidate_tables.py:prepare_candidate``) are built on a worker thread while this
one's ILPs solve. The plan, lines, dumps and entries are those of the search on one thread
(``tests/test_search_threads.py``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from autopar.cluster import ClusterSpec
from autopar.passes.background import Gate, owning, working
from autopar.passes.candidate_tables import Prepared, prepare_candidate
from autopar.passes.candidates import MeshRun, spmd_runs, stage_runs
from autopar.passes.experts import has_experts
from autopar.passes.pipeline import stage_counts
from autopar.passes.search_problem import Problem

# False: every candidate's tables built on the search's thread (the plan is the same either way)
PREFETCH_TABLES = True
# candidates built ahead of the one the search takes: more than 1 is slower (the worker then competes
# more for the search's idle time; with 3, the 70B on 1024 H100s planned in 20.9 s against 19.1 s
# with 1, on the 2-core dev VM, 2026-11-27; the 8B on 64 alike)
TABLES_AHEAD = 1


def table_order(pb: Problem) -> Iterator[tuple[MeshRun, ClusterSpec]]:
    """The candidates whose tables the search takes, in its order: the SPMD meshes (a mirror of an
    earlier mesh needs none), then each stage count's stage meshes."""
    for run, mirror in spmd_runs(pb.cluster, pb.options, has_experts(pb.tg)):
        if mirror is None:
            yield run, pb.cluster
    for stages in stage_counts(pb.cluster.world_size, len(pb.blocks), pb.options):
        sub, runs, _ = stage_runs(pb.cluster, pb.options, stages, has_experts(pb.tg))
        for run in runs:
            yield run, sub


class Prefetcher:
    """Each candidate's ``prepare_candidate``, built one candidate ahead on a worker thread while
    the search solves the one before (``PREFETCH_TABLES``): the worker runs only while the search's
    thread waits on HiGHS or on the worker (``passes/background.py``). It takes candidates in
    ``table_order``, the order the search asks for them; what building one said and dumped is
    replayed when the search takes it, so the search's lines and dumps come as without the thread.
    A candidate asked for out of that order is built on the spot. Not threaded with a profiler: its
    timings would share the core. A context manager: on exit the worker ends."""

    def __init__(self, pb: Problem):
        threaded = PREFETCH_TABLES and pb.profiler is None
        self.pb, self.order = pb, table_order(pb)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="autopar-tables") if threaded else None
        self.gate = Gate()
        self._owning = owning(self.gate) if threaded else contextlib.nullcontext()
        self.ahead: collections.deque[tuple[tuple[MeshRun, ClusterSpec], Future]] = collections.deque()

    def __enter__(self) -> Prefetcher:
        self._owning.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.gate.release()  # a worker waiting at a checkpoint finishes, and is not waited for long
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self._owning.__exit__(*exc)

    def _feed(self) -> None:
        """``TABLES_AHEAD`` candidates queued on the worker beyond those the search has taken."""
        while self.pool is not None and len(self.ahead) < TABLES_AHEAD:
            try:
                key = next(self.order)
            except Exception:  # noqa: BLE001 - StopIteration, or an error the search meets itself, in turn
                self.pool.shutdown(wait=False)
                self.pool = None
                return
            self.ahead.append((key, self.pool.submit(self._work, *key)))

    def _work(self, run: MeshRun, cluster: ClusterSpec) -> Prepared:
        with working(self.gate):  # on the worker: its checkpoints wait for the search to be idle
            return prepare_candidate(self.pb, run, cluster)

    def take(self, run: MeshRun, cluster: ClusterSpec) -> Prepared:
        """Candidate ``run``'s tables on ``cluster``; what building them said and dumped passed on
        (its entries and reasons are the caller's to record)."""
        self._feed()
        got = None
        while self.ahead and got is None:
            key, future = self.ahead.popleft()
            if key == (run, cluster):
                with self.gate.idle():
                    got = future.result()
            else:  # the search went another way than ``table_order``: that one is not needed
                future.cancel()
                with self.gate.idle():  # if it started, let it end
                    concurrent.futures.wait([future])
        self._feed()  # the next candidate's tables build while this one's ILPs solve
        if got is None:
            got = prepare_candidate(self.pb, run, cluster)
        for msg in got.said:
            self.pb.st.say(msg)
        for name, text in got.writes:
            self.pb.st.write(name, text)
        return got
