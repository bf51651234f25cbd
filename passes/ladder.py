"""One candidate down its ladder of trades (``climb``), for SPMD and pipeline candidates alike.

The rungs (``passes/trades.py:ladder``: ZeRO stage, recomputation, micro-batches, offload, at the
plan's precision) come cheapest first; each is one ILP on the candidate's tables transformed by
its trades. How a rung's tables are made and how it is priced is the candidate's (a ``Pricer``:
``passes/rungs.py``); what the ladder does with each is the same for every candidate:

* a rung the pricer does not admit (its micro-batches do not split the batch) is skipped;
* so is a rung that relieves no more memory in any trade than one that had no plan or passed the
  limit (``relieves_no_more``), and one whose time bound is at least that of a rung pruned by its
  bound (``costs_no_less``);
* a rung whose memory lower bound passes the limit is skipped without a solve;
* where memory binds (the rung without recomputation has no plan or passes the limit) and the
  rung with full recomputation of every block is next, the rung that recomputes only the fewest
  blocks of each stage whose memory lower bound fits (``Trades.recompute_blocks``, found by
  bisection on that bound: memory falls with each block recomputed) is priced first, and where
  it has no plan one half-way to every block, ``MAX_PARTIAL_RUNGS`` at most
  (``MAX_PARTIAL_RUNGS_PER_CLIMB`` in all; ``_partial_rung``): Megatron-LM's ``--recompute-num-layers``, which pays the recomputation of
  only as many blocks as the memory needs. The rung of every block is priced after them all the
  same (a partial rung that fits does not end the climb), so no plan is slower for them;
* after ``MAX_EMPTY_RUNGS`` rungs with no plan, only rungs with more room every way than one of
  them are solved (``relieves_more``);
* the rest are priced; each priced rung's ``Lesson`` says what it teaches about the rungs after
  it, and the climb ends after ``RUNGS_SOLVED`` rungs that fit (or have a plan no better than the
  best) or at a rung after which none can win; but while the best plan that fit came within
  ``TIGHT`` of the memory limit, up to ``RUNGS_SOLVED_TIGHT``: its placement may be the one that
  fits rather than the fastest, and a later rung, with more room, can place the ops faster
  (Megatron's 32B layout on 384 H100: the first rung's 1.51 s plan fits at 91% of the memory with
  every linear row-parallel; four micro-batches leave room for the column-parallel one, 1.36 s).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from autopar.passes.costs import CostTables
from autopar.passes.memory_row import lower_bound_bytes
from autopar.passes.mesh_solve import Solved
from autopar.passes.outcome import Entry
from autopar.trades import Recompute, Trades, ZeroStage

# per candidate mesh, how many trades rungs that fit are solved before the next mesh: the ladder
# puts the cheapest first (a later one can win where the first fits only with a worse placement,
# rarely: each solve of a large mesh costs seconds)
RUNGS_SOLVED = 1
# a plan whose peak is within this fraction of the memory limit may have been bent by the limit
# (the ILP's memory row counts the tables' liveness; a solution whose full peak, with its buckets'
# flattening and its optimizer's temporaries, passed the limit is solved again under a lower row,
# passes/mesh_solve.py): the climb goes on to up to RUNGS_SOLVED_TIGHT plans that fit
TIGHT = 0.85
RUNGS_SOLVED_TIGHT = 4
# after this many rungs of one candidate had no plan, only rungs with more room every way than one
# of them are solved (each empty rung of a large mesh is a solve of seconds)
MAX_EMPTY_RUNGS = 4
# per rung of full recomputation, how many rungs recomputing only part of its blocks are solved,
# and per climb (a long ladder has a rung of full recomputation per ZeRO stage, micro-batch count
# and offload; each partial rung of a large mesh is a solve of seconds)
MAX_PARTIAL_RUNGS = 2
MAX_PARTIAL_RUNGS_PER_CLIMB = 4


class Lesson(enum.Enum):
    """What a priced rung teaches the ladder about the rungs after it."""

    FITS = "fits"  # a plan that fits: counts toward RUNGS_SOLVED
    BEATEN = "beaten"  # it has a plan, no better than the best: counts toward RUNGS_SOLVED too
    SLOW = "slow"  # its time lower bound passes the best: rungs that cost no less are skipped
    LAST = "last"  # no later rung can win: the climb ends
    NO_PLAN = "no plan"  # the ILP found none: rungs that relieve no more are skipped
    TOO_BIG = "too big"  # past the memory limit: rungs that relieve no more are skipped
    NOTHING = "nothing"  # nothing learnt: the next rung


@dataclass(frozen=True)
class RungTables:
    """A rung's tables: the candidate's transformed by the rung's trades (``traded``), and the
    rows the ILP solves (``ilp``: the same, or a pipeline stage's rows of them)."""

    traded: CostTables
    ilp: CostTables
    # the memory lower bound of ``ilp`` where the climb computed it (``_bound``; the same float as
    # ``lower_bound_bytes(ilp)``, ``tests/test_memory_bound.py``): ``solve_mesh`` takes it as is
    needed: float | None = None


@dataclass(frozen=True)
class Rung:
    """A priced rung: what it teaches, its entry in the candidate list (None: none), the memory it
    needs at least, its plan where one fits and the objective later candidates are then pruned
    against. ``about``: the trades the lesson is about where the pricer changed the rung's (its
    micro-batches); ``restart``: the candidate again from these rungs (its tables changed)."""

    lesson: Lesson
    entry: Entry | None = None
    mem_needed: float = math.inf
    solved: Solved | None = None
    objective: float = math.inf
    refused_at_full_peak: bool = False
    refused_peak: float = math.inf  # the full peak of a plan refused at it (inf: none)
    about: Trades | None = None
    restart: tuple[Trades, ...] | None = None
    peak: float = 0.0  # a plan's predicted peak bytes per device (where one fits)
    host_needed: float = math.inf  # host bytes per device of a plan refused for host memory (inf: none)


class Pricer(Protocol):
    """How one candidate's rungs are tabled and priced (``passes/rungs.py``)."""

    def admits(self, trades: Trades) -> bool: ...

    def tables(self, trades: Trades) -> RungTables: ...

    # optional: ``bound(trades) -> float``, the rung's memory lower bound without its tables (``_bound``)

    def price(self, trades: Trades, tables: RungTables, best_objective: float) -> Rung: ...


@dataclass
class Climb:
    """What one candidate's climb found: its entries, its plans that fit (in order), the least
    memory a rung needed, whether a plan failed at its full peak (and the least such peak), the
    rungs it considered (each the pricer admits: solved, bounded or shown no better than one that
    was), and the best objective after it."""

    objective: float
    entries: list[Entry] = field(default_factory=list)
    solved: list[Solved] = field(default_factory=list)
    mem_needed: float = math.inf
    refused_at_full_peak: bool = False
    refused_peak: float = math.inf
    host_needed: float = math.inf  # the least host bytes per device of a plan refused for host memory
    tried: list[Trades] = field(default_factory=list)


def climb(
    rungs: Iterable[Trades], pricer: Pricer, limit: float, best_objective: float, partial_blocks: int = 0
) -> Climb:
    """Down the ladder ``rungs`` of one candidate (module docstring), pruned against
    ``best_objective`` and the plans it finds. ``partial_blocks``: the most repeated blocks one
    pipeline stage holds (of the model, without stages), where the climb may offer rungs that
    recompute part of them (0: none; ``_partial_rung``)."""
    out = Climb(best_objective)
    todo = list(rungs)
    known: dict[Trades, tuple[float, RungTables | None]] = {}  # bounds computed ahead (``_refused``)
    if _refused(todo, pricer, limit, known, out):
        return out
    short: list[Trades] = []  # rungs the ILP found no plan on
    over: list[Trades] = []  # rungs past the memory limit
    slow: list[Trades] = []  # rungs whose time lower bound is no better than the best
    solved = 0
    tight = False  # the best plan that fit came within TIGHT of the limit
    finishing = False  # the climb has ended but for the sharded-step siblings left in ``todo``
    partial: dict[Trades, int] = {}  # per rung of full recomputation, its partial rungs offered
    while todo:
        trades = todo.pop(0)
        if not pricer.admits(trades):
            continue
        offered = sum(partial.values())
        if (
            partial_blocks > 1
            and offered < MAX_PARTIAL_RUNGS_PER_CLIMB
            and trades not in partial
            and _memory_binds(trades, short + over)
        ):
            partial[trades] = 0
            part = _partial_rung(pricer, trades, partial_blocks, limit, known)
            if part is not None:
                partial[trades] = 1
                todo[:0] = [part, trades]
                continue
        out.tried.append(trades)
        if any(relieves_no_more(trades, t) for t in short + over):
            continue  # a rung with at least this much room each way had no plan
        if any(costs_no_less(trades, t) for t in slow):
            continue  # its bound is at least a pruned rung's, and the best only falls
        needed, tables = known.pop(trades) if trades in known else _bound(pricer, trades)
        if needed > limit:  # cheap: no solve, no entry
            out.mem_needed = min(out.mem_needed, needed)
            over.append(trades)
            continue
        if len(short) >= MAX_EMPTY_RUNGS and not any(relieves_more(trades, t) for t in short):
            continue
        tables = tables if tables is not None else pricer.tables(trades)
        rung = pricer.price(trades, replace(tables, needed=needed), out.objective)
        if rung.restart is not None:
            todo, short, over, slow = list(rung.restart), [], [], []
            known.clear()  # bounds of the tables before the restart
            continue
        out.mem_needed = min(out.mem_needed, rung.mem_needed)
        out.refused_at_full_peak |= rung.refused_at_full_peak
        out.refused_peak = min(out.refused_peak, rung.refused_peak)
        out.host_needed = min(out.host_needed, rung.host_needed)
        if rung.entry is not None:
            out.entries.append(rung.entry)
        about = rung.about if rung.about is not None else trades
        whole = replace(trades, recompute_blocks=None)
        if (
            rung.lesson in (Lesson.NO_PLAN, Lesson.TOO_BIG, Lesson.NOTHING)
            and trades.recompute_blocks is not None
            and partial.get(whole, MAX_PARTIAL_RUNGS) < MAX_PARTIAL_RUNGS
            and sum(partial.values()) < MAX_PARTIAL_RUNGS_PER_CLIMB
        ):
            # the fewest blocks its bound allowed had no plan (a pipeline's solve that finds none
            # teaches NOTHING): half-way to every block, once
            more = (trades.recompute_blocks + partial_blocks + 1) // 2
            if more < partial_blocks:
                partial[whole] += 1
                todo.insert(0, replace(trades, recompute_blocks=more))
        if rung.lesson is Lesson.NO_PLAN:
            short.append(about)
        elif rung.lesson is Lesson.TOO_BIG:
            over.append(about)
        elif rung.lesson is Lesson.SLOW:
            slow.append(about)
        elif rung.lesson is Lesson.LAST:
            break
        elif rung.lesson is Lesson.FITS or rung.lesson is Lesson.BEATEN:
            if rung.lesson is Lesson.FITS:
                if rung.objective < out.objective:
                    tight = rung.peak >= TIGHT * limit
                out.objective = min(out.objective, rung.objective)
                out.solved.append(rung.solved)
            if partial_blocks > 1 and trades.recompute_blocks is not None:
                # an offered partial rung: the rung of every block after it is still priced (its
                # placement can differ and win: Llama 3 405B's interleaved stages under 55 GiB)
                continue
            solved += 1
            if not finishing and solved >= (RUNGS_SOLVED_TIGHT if tight else RUNGS_SOLVED):
                # later rungs tend to add time (passes/trades.py:ladder), but a higher ZeRO stage
                # that shards the optimizer's step can take less: those of this rung are solved
                # too, and then the climb ends
                finishing = True
                todo = [t for t in todo if rung.lesson is Lesson.FITS and sharded_step_sibling(t, trades)]
    return out


def _memory_binds(trades: Trades, failed: list[Trades]) -> bool:
    """``trades`` recompute every block fully, and the same rung without recomputation is known
    to have no plan or to pass the memory limit (it relieves no more than one of ``failed``)."""
    if trades.recompute is not Recompute.FULL or trades.recompute_blocks is not None:
        return False
    bare = replace(trades, recompute=Recompute.NONE)
    return any(relieves_no_more(bare, t) for t in failed)


def _partial_rung(pricer: Pricer, trades: Trades, blocks: int, limit: float, known: dict) -> Trades | None:
    """``trades`` recomputing only the fewest of each stage's ``blocks`` (the first ones) whose
    memory lower bound fits ``limit``: bisection over ``1 .. blocks - 1``, as each block recomputed
    lowers the bound (``passes/trades.py:partly_recomputed``: the rows mix the kept and recomputed
    blocks); None where even ``blocks - 1`` do not fit, or every block's bound passes the limit.
    ``log2(blocks) + 1`` bounds, kept in ``known`` for the climb."""

    def fits(n: int | None) -> bool:
        t = replace(trades, recompute_blocks=n)
        if t not in known:
            known[t] = _bound(pricer, t)
        return known[t][0] <= limit

    if not fits(None) or not fits(blocks - 1):
        return None
    lo, hi = 0, blocks - 1  # lo: not known to fit (none recomputed: memory binds), hi: fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return replace(trades, recompute_blocks=hi)


def _refused(rungs: list[Trades], pricer: Pricer, limit: float, known: dict, out: Climb) -> bool:
    """Whether the whole ladder is past the memory limit, shown by its *top* rungs alone (those
    no other rung relieves more than: every rung relieves no more than one of them), each bounded
    past the limit: ``climb`` skips a rung that relieves no more than one past the limit, and
    with every top past it would skip or bound past it every rung. Then ``out`` is what that
    climb gives (every admitted rung tried, the least bound needed, no entry) and True. Else
    False, the bounds computed kept in ``known`` for the climb (the same floats).

    Only for ladders without ZeRO-3, whose gathered blocks are the one trade whose bytes do not
    only fall as it climbs (``relieves_no_more``): there a top could need more than a rung under
    it. A pipeline candidate's ladder (ZeRO 0-1, at its micro-batches) has one top, ZeRO-1 with
    full recomputation, and most stage meshes of a large model fit at no rung: DeepSeek-V3 on 256
    H100, 41 of 53 pipeline climbs, each of whose 8 rungs built its traded tables and stage rows
    to be bounded. ``tests/test_ladder_refused.py``: the climb's result is the same as without
    this, and the pipeline rows' bound falls as rungs relieve more."""
    admitted = [t for t in rungs if pricer.admits(t)]
    if not admitted or any(t.zero_stage >= ZeroStage.PARAMETERS for t in admitted):
        return False
    tops = [
        t for t in admitted if not any(relieves_more(u, t) and not relieves_no_more(u, t) for u in admitted)
    ]
    least = math.inf
    for t in tops:
        known[t] = _bound(pricer, t)
        if known[t][0] <= limit:
            return False
        least = min(least, known[t][0])
    out.tried.extend(admitted)
    out.mem_needed = least
    return True


def _bound(pricer: Pricer, trades: Trades) -> tuple[float, RungTables | None]:
    """The rung's memory lower bound (``memory_row.lower_bound_bytes`` of the rows its ILP solves),
    and its tables where they were built for it: a pricer with a ``bound`` of its own gives it
    without them (``passes/rungs.py:SpmdRungs.bound``: most rungs are bounded, few solved)."""
    bound = getattr(pricer, "bound", None)
    if bound is not None:
        return bound(trades), None
    tables = pricer.tables(trades)
    return lower_bound_bytes(tables.ilp), tables


def sharded_step_sibling(a: Trades, b: Trades) -> bool:
    """Rung ``a`` is rung ``b`` with a higher ZeRO stage of 1 or 2: the same recomputation,
    micro-batches, precision and offload. Its optimizer steps ``1/d`` of the state (and ZeRO-2
    reduce-scatters the gradients instead of all-reducing them), against an all-gather of the
    parameters: where the step is long it is the faster plan, which the ladder's order (lower
    stages first) would not try once a lower one fits (Megatron's 1.7B on 48 H100: ZeRO-1 priced
    6% faster than ZeRO-0; MPT's 1B on 512 H100: ZeRO-2 2% faster than ZeRO-1)."""
    return (
        b.zero_stage < a.zero_stage
        and a.zero_stage in (ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS)
        and (a.recompute, a.recompute_blocks, a.micro_batches, a.precision, a.offload)
        == (b.recompute, b.recompute_blocks, b.micro_batches, b.precision, b.offload)
    )


def relieves_no_more(a: Trades, b: Trades) -> bool:
    """Rung ``a`` frees no more memory than ``b`` in any trade (so where ``b`` has no plan, nor
    has ``a``: each trade's bytes only fall as it climbs, ZeRO-3's gathered blocks aside)."""
    return (
        a.zero_stage <= b.zero_stage
        and recomputes_no_more(a, b)
        and a.micro_batches <= b.micro_batches
        and (a.offload.value == "none" or b.offload.value != "none")
    )


def costs_no_less(a: Trades, b: Trades) -> bool:
    """Rung ``a``'s time lower bound is at least ``b``'s: the same ZeRO stage, offload and
    precision, and at least as much recomputation (forwards run again) and as many micro-batches
    (each pays its collectives' latency, and ZeRO-3 its gathers); so where ``b`` was pruned by its
    bound, so is ``a`` (``tests/test_search_prune.py`` checks the bounds are so ordered)."""
    return (
        a.zero_stage == b.zero_stage
        and a.offload is b.offload
        and a.precision is b.precision
        and a.data_axes == b.data_axes
        and recomputes_no_more(b, a)
        and a.micro_batches >= b.micro_batches
    )


def relieves_more(a: Trades, b: Trades) -> bool:
    """Rung ``a`` frees at least as much as ``b`` in every trade and more in one."""
    return relieves_no_more(b, a) and a != b


_RECOMPUTE_ORDER = {"none": 0, "selective": 1, "half_matmuls": 2, "full": 3}


def recomputes_no_more(a: Trades, b: Trades) -> bool:
    """Rung ``a``'s recomputation frees no more memory, and adds no more time, than ``b``'s: none
    at all, or a mode no further up the order (``_RECOMPUTE_ORDER``) over no more blocks of each
    stage (``Trades.recompute_blocks``, None: every block). A partial rung and a whole one of a
    lower mode (full on 4 blocks of 16, selective on all) are not ordered."""
    if a.recompute is Recompute.NONE:
        return True
    blocks_a = math.inf if a.recompute_blocks is None else a.recompute_blocks
    blocks_b = math.inf if b.recompute_blocks is None else b.recompute_blocks
    return _RECOMPUTE_ORDER[a.recompute.value] <= _RECOMPUTE_ORDER[b.recompute.value] and blocks_a <= blocks_b
