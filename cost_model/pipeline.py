"""Pipeline schedules priced by simulation: the step's makespan (bubble included) and each rank's
peak activation memory, for the schedules ``torch.distributed.pipelining`` runs.

The step is cut into ``C = S * v`` chunks (``S`` pipeline ranks, ``v`` chunks per rank), chunk
``c`` on rank ``c % S`` (torch's looped placement, ``stage_index = rank + i * S``), and the batch
into ``k`` micro-batches. :func:`schedule_order` gives, per rank, the order of the compute actions
torch's schedule class runs (``F`` forward, ``B`` backward; zero bubble splits ``B`` into ``I``,
the input gradient, and ``W``, the weight gradient):

* ``GPIPE`` (``ScheduleGPipe``): ``F0 .. F(k-1)``, then ``B0 .. B(k-1)``.
* ``ONE_F_ONE_B`` (``Schedule1F1B``, ``k >= S``): ``min(k, S - r)`` forwards, then one backward
  one forward while forwards remain, then the remaining backwards.
* ``INTERLEAVED_1F1B`` (``ScheduleInterleaved1F1B``, Megatron's order relaxed to any ``k`` with
  ``k % max(1, k // S) == 0``): ``p = k // max(1, k // S)`` micro-batches per round; the i-th
  forward of a rank runs local chunk ``(i // p) % v``, the j-th backward local chunk
  ``v - 1 - (j // p) % v``, each chunk's micro-batches in order; ``w = min((v-1) p + 2 (S-1-r), k v)``
  warm-up forwards, then ``F B`` pairs, then the remaining backwards.
* ``ZERO_BUBBLE`` (``ScheduleInterleavedZeroBubble``, ZB-1P): the same with ``I`` for ``B``, a
  warm-up of ``(v-1) p + (S-1-r)`` forwards, and after the j-th ``I`` (``j >= r``) the ``W`` of
  the ``(j-r)``-th: rank ``r`` defers its weight gradients by ``r`` backwards into the bubble.

:func:`simulate` runs an order as a list schedule: each rank runs its actions in order, one at a
time, each as soon as the rank is free and its inputs have arrived::

    start F(c, m) >= end F(c-1, m) + p2p[c-1]                (activations from upstream)
    start B(c, m) >= end B(c+1, m) + p2p[c],  end F(c, m)    (gradient from downstream; the last
                                                              chunk's B follows its own F: loss)
    start W(c, m) >= end I(c, m);  upstream waits on I only
    durations: F = fwd[c], B = bwd[c], I = (1 - wgrad_fraction) bwd[c], W = wgrad_fraction bwd[c]

``p2p[c]`` counts only between chunks on different ranks. A rank holds ``act_bytes[c]`` from the
end of ``F(c, m)`` until the end of ``B(c, m)`` (zero bubble: of ``W(c, m)``, conservatively: ``I``
frees the activations only ``W`` does not need, which this model does not split). Memory is
counted per rank along its own order, so peaks do not depend on the durations.

It reproduces the published numbers (tests/test_pipeline_schedule.py), uniform chunks of forward
``f`` and backward ``b``, no p2p:

    GPipe, 1F1B:        makespan = (k + S - 1) (f + b),    bubble fraction = (S - 1) / (k + S - 1)
    in flight (peak):   GPipe k;  1F1B min(S - r, k) on rank r
    interleaved, v chunks of f/v, b/v, k a multiple of S (Narayanan et al. 2021):
                        makespan = (k + (S - 1) / v) (f + b)
    in flight (peak):   interleaved min(w + 1, k v) on rank r (w its warm-up above);
                        zero bubble min((v-1) p + S, k v) on every rank (W deferred r backwards)

With uniform chunks interleaving never lengthens the step (against 1F1B's with the same work per
rank) and zero bubble never lengthens interleaved's; with unbalanced ranks interleaving can lose
(about 7% of random cases with S <= 8, v <= 4 do): simulate, don't assume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.trades import Schedule


class ScheduleError(AutoparError, ValueError):
    """A pipeline schedule cannot run as asked (bad stage, chunk or micro-batch counts, an order
    missing or repeating an action, or deadlocking): the message says what to change."""


KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    """One compute action: ``kind`` F, B, I or W of global chunk ``chunk`` on micro-batch ``micro``."""

    kind: str
    chunk: int
    micro: int

    def __str__(self) -> str:  # torch's notation: 3F2 = chunk 3's forward of micro-batch 2
        return f"{self.chunk}{self.kind}{self.micro}"


@dataclass(frozen=True)
class Event:
    """An action as simulated: on ``rank`` from ``start`` to ``end`` seconds."""

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """A simulated step. ``events`` sorted by rank then start; per rank: ``peak_bytes`` of kept
    activations, ``peak_in_flight`` (most (chunk, micro-batch) forwards done whose backward is
    not: B, or W for zero bubble), ``busy`` seconds of compute."""

    events: tuple[Event, ...]
    makespan: float
    peak_bytes: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    busy: tuple[float, ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time: ``1 - mean(busy) / makespan``."""
        if self.makespan <= 0 or not self.busy:
            return 0.0
        return 1.0 - sum(self.busy) / len(self.busy) / self.makespan

    @property
    def ranks(self) -> int:
        return len(self.busy)


# -- orders ------------------------------------------------------------------------------------------
def _check_counts(schedule: Schedule, stages: int, virtual: int, micro_batches: int) -> None:
    for name, n in (("stages", stages), ("virtual", virtual), ("micro_batches", micro_batches)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ScheduleError(f"pipeline {name} must be a positive integer, got {n!r}")
    multi = schedule in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)
    if multi and virtual < 2:
        raise ScheduleError(
            f"schedule {schedule.value} runs several chunks per rank: virtual must be >= 2, got {virtual}; "
            "use schedule 1f1b or gpipe for one chunk per rank"
        )
    if not multi and virtual != 1:
        raise ScheduleError(
            f"schedule {schedule.value} runs one chunk per rank: virtual must be 1, got {virtual}; "
            f"use schedule interleaved_1f1b or zero_bubble for {virtual} chunks per rank"
        )
    if schedule is Schedule.ONE_F_ONE_B and micro_batches < stages:
        # Schedule1F1B's constructor refuses it
        raise ScheduleError(
            f"schedule 1f1b needs at least as many micro-batches as stages: got {micro_batches} micro-batches "
            f"for {stages} stages; use >= {stages} micro-batches, or schedule gpipe"
        )
    if multi:
        rounds = max(1, micro_batches // stages)
        if micro_batches % rounds:
            # ScheduleInterleaved1F1B's / ScheduleInterleavedZeroBubble's constructors refuse it
            ok = sorted(
                {_valid_multi_micro(stages, micro_batches, +1), _valid_multi_micro(stages, micro_batches, -1)}
            )
            raise ScheduleError(
                f"schedule {schedule.value} needs the micro-batch count to be a multiple of its rounds "
                f"(max(1, micro_batches // stages) = {rounds}): got {micro_batches} micro-batches for "
                f"{stages} stages; use {' or '.join(map(str, ok))} (a multiple of {stages} always works)"
            )


def _valid_multi_micro(stages: int, k: int, step: int) -> int:
    while k > 1 and k % max(1, k // stages):
        k += step
    return max(k, 1)


def _interleaved_rank(
    rank: int, stages: int, virtual: int, micro_batches: int, zero_bubble: bool
) -> list[Action]:
    rounds = max(1, micro_batches // stages)
    per_round = micro_batches // rounds
    total = virtual * micro_batches  # forwards (and backwards) on this rank
    hops = stages - 1 - rank
    warmup = min((virtual - 1) * per_round + (hops if zero_bubble else 2 * hops), total)

    def fwd_chunk(i: int) -> int:
        return (i // per_round) % virtual * stages + rank

    def bwd_chunk(j: int) -> int:
        return (virtual - 1 - (j // per_round) % virtual) * stages + rank

    # the i-th forward / j-th backward of the rank: the chunk's next micro-batch in order
    fwd = []
    nxt: dict[int, int] = {}
    for i in range(total):
        c = fwd_chunk(i)
        fwd.append((c, nxt.get(c, 0)))
        nxt[c] = nxt.get(c, 0) + 1
    bwd = []
    nxt = {}
    for j in range(total):
        c = bwd_chunk(j)
        bwd.append((c, nxt.get(c, 0)))
        nxt[c] = nxt.get(c, 0) + 1

    out = [Action("F", c, m) for c, m in fwd[:warmup]]
    done_w = 0

    def backward(j: int) -> None:
        nonlocal done_w
        c, m = bwd[j]
        out.append(Action("I" if zero_bubble else "B", c, m))
        if zero_bubble and j >= rank:  # ZB-1P: rank r runs its weight gradients r backwards late
            wc, wm = bwd[done_w]
            out.append(Action("W", wc, wm))
            done_w += 1

    for i in range(warmup, total):  # steady state: one forward, one backward
        out.append(Action("F", *fwd[i]))
        backward(i - warmup)
    for j in range(total - warmup, total):  # cool-down: the backwards left
        backward(j)
    if zero_bubble:
        out += [Action("W", *bwd[j]) for j in range(done_w, total)]
    return out


def schedule_order(
    schedule: Schedule, stages: int, virtual: int, micro_batches: int
) -> dict[int, list[Action]]:
    """Per pipeline rank ``0 .. stages-1``, the compute actions torch's schedule class runs, in
    order (module docstring). Chunk ``c`` lives on rank ``c % stages``. Raises
    :class:`ScheduleError` for counts torch's schedule refuses."""
    schedule = Schedule(schedule)
    _check_counts(schedule, stages, virtual, micro_batches)
    k = micro_batches
    order: dict[int, list[Action]] = {}
    for r in range(stages):
        if schedule is Schedule.GPIPE:
            order[r] = [Action("F", r, m) for m in range(k)] + [Action("B", r, m) for m in range(k)]
        elif schedule is Schedule.ONE_F_ONE_B:
            warmup = min(k, stages - r)
            acts = [Action("F", r, m) for m in range(warmup)]
            for m in range(k):
                acts.append(Action("B", r, m))
                if warmup + m < k:
                    acts.append(Action("F", r, warmup + m))
            order[r] = acts
        else:
            order[r] = _interleaved_rank(r, stages, virtual, k, schedule is Schedule.ZERO_BUBBLE)
    return order


# -- simulation --------------------------------------------------------------------------------------
def _per_chunk(name: str, values: Sequence[float], chunks: int, lengths: tuple[int, ...]) -> list[float]:
    vals = [float(x) for x in values]
    if len(vals) not in lengths:
        want = " or ".join(str(n) for n in lengths)
        raise ScheduleError(
            f"{name} needs one value per chunk ({want} values for {chunks} chunks), got {len(vals)}"
        )
    bad = [i for i, x in enumerate(vals) if not x >= 0 or x == float("inf")]
    if bad:
        raise ScheduleError(f"{name}[{bad[0]}] = {vals[bad[0]]!r}: times and bytes must be finite and >= 0")
    return vals


def _check_order(order: Mapping[int, Sequence[Action]], chunks: int) -> tuple[dict[int, int], dict, set]:
    """Chunk -> rank, (chunk, micro) -> kinds seen, and the (chunk, micro)s split in I and W."""
    home: dict[int, int] = {}
    seen: dict[tuple[int, int], list[str]] = {}
    for r, acts in order.items():
        for a in acts:
            if a.kind not in KINDS:
                raise ScheduleError(f"rank {r}: action {a} has kind {a.kind!r}; kinds are {', '.join(KINDS)}")
            if not 0 <= a.chunk < chunks:
                raise ScheduleError(
                    f"rank {r}: action {a} names chunk {a.chunk}, but fwd/bwd give times for chunks 0..{chunks - 1}"
                )
            if home.setdefault(a.chunk, r) != r:
                raise ScheduleError(
                    f"chunk {a.chunk} runs on ranks {home[a.chunk]} and {r}: a chunk lives on one rank"
                )
            seen.setdefault((a.chunk, a.micro), []).append(a.kind)
    micros = {m for _, m in seen}
    split = set()
    for c in range(chunks):
        for m in sorted(micros):
            kinds = sorted(seen.get((c, m), []))
            if kinds == ["B", "F"]:
                continue
            if kinds == ["F", "I", "W"]:
                split.add((c, m))
                continue
            raise ScheduleError(
                f"chunk {c}, micro-batch {m} has actions {kinds or 'none'}: each (chunk, micro-batch) needs one F "
                "and one B, or one F, one I and one W"
            )
    return home, seen, split


def simulate(
    order: Mapping[int, Sequence[Action]],
    fwd: Sequence[float],
    bwd: Sequence[float],
    p2p: Sequence[float] = (),
    act_bytes: Sequence[float] = (),
    wgrad_fraction: float = 0.5,
) -> Timeline:
    """Run ``order`` (rank -> its actions, e.g. :func:`schedule_order`'s) with ``fwd[c]`` /
    ``bwd[c]`` seconds per micro-batch of chunk ``c``, ``p2p[c]`` seconds to send chunk ``c``'s
    output to chunk ``c+1`` (and its gradient back; ``C-1`` or ``C`` values, the last unused; 0
    when omitted or on the same rank), ``act_bytes[c]`` bytes kept per micro-batch from chunk
    ``c``'s forward to its backward; ``wgrad_fraction`` of ``bwd`` is W's when it is split.
    Raises :class:`ScheduleError` when the order is malformed or deadlocks."""
    chunks = len(fwd)
    if chunks == 0:
        raise ScheduleError("fwd is empty: give one forward time per chunk")
    f = _per_chunk("fwd", fwd, chunks, (chunks,))
    b = _per_chunk("bwd", bwd, chunks, (chunks,))
    p = _per_chunk("p2p", p2p, chunks, (0, chunks - 1, chunks)) if len(p2p) else [0.0] * chunks
    mem = _per_chunk("act_bytes", act_bytes, chunks, (0, chunks)) if len(act_bytes) else [0.0] * chunks
    wf = float(wgrad_fraction)
    if not 0.0 <= wf <= 1.0:
        raise ScheduleError(f"wgrad_fraction must be in [0, 1], got {wgrad_fraction!r}")
    ranks = sorted(order)
    if ranks != list(range(len(ranks))):
        raise ScheduleError(f"order must have ranks 0..{len(ranks) - 1}, got {ranks}")
    home, _, split = _check_order(order, chunks)

    def lag(c: int) -> float:  # chunk c -> c+1 transfer
        return 0.0 if home.get(c) == home.get(c + 1) else p[c]

    def needs(a: Action) -> list[tuple[tuple[str, int, int], float]]:
        c, m = a.chunk, a.micro
        if a.kind == "F":
            return [(("F", c - 1, m), lag(c - 1))] if c > 0 else []
        if a.kind == "W":
            return [(("I", c, m), 0.0)]
        deps = [(("F", c, m), 0.0)]
        if c < chunks - 1:
            deps.append((("G", c + 1, m), lag(c)))  # G: the input gradient, B's or I's
        return deps

    def duration(a: Action) -> float:
        if a.kind == "F":
            return f[a.chunk]
        if a.kind == "B":
            return b[a.chunk]
        return (wf if a.kind == "W" else 1.0 - wf) * b[a.chunk]

    end: dict[tuple[str, int, int], float] = {}
    ptr = dict.fromkeys(ranks, 0)
    free = dict.fromkeys(ranks, 0.0)
    events: dict[int, list[Event]] = {r: [] for r in ranks}
    remaining = sum(len(order[r]) for r in ranks)
    while remaining:
        progressed = False
        for r in ranks:
            acts = order[r]
            while ptr[r] < len(acts):
                a = acts[ptr[r]]
                deps = needs(a)
                if any(key not in end for key, _ in deps):
                    break
                start = max([free[r]] + [end[key] + t for key, t in deps])
                stop = start + duration(a)
                end[(a.kind, a.chunk, a.micro)] = stop
                if a.kind in ("B", "I"):
                    end[("G", a.chunk, a.micro)] = stop
                free[r] = stop
                events[r].append(Event(r, a, start, stop))
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = []
            for r in ranks:
                if ptr[r] < len(order[r]):
                    a = order[r][ptr[r]]
                    missing = [key for key, _ in needs(a) if key not in end]
                    wait = [f"{c}{k}{m}" if k != "G" else f"{c}B{m} or {c}I{m}" for k, c, m in missing]
                    stuck.append(f"rank {r} at {a} waits on {', '.join(wait)}")
            raise ScheduleError(
                f"the order deadlocks: {'; '.join(stuck)}. Reorder so each rank runs an action only after "
                "the actions it depends on can run (forwards upstream first, backwards downstream first)"
            )

    peak_bytes, peak_in_flight, busy = [], [], []
    for r in ranks:
        held = 0.0
        n = 0
        top_b = 0.0
        top_n = 0
        for a in order[r]:
            key = (a.chunk, a.micro)
            if a.kind == "F":
                held += mem[a.chunk]
                n += 1
                top_b, top_n = max(top_b, held), max(top_n, n)
            elif a.kind == "W" or (a.kind == "B" and key not in split):
                held -= mem[a.chunk]
                n -= 1
        peak_bytes.append(top_b)
        peak_in_flight.append(top_n)
        busy.append(sum(e.end - e.start for e in events[r]))
    all_events = tuple(e for r in ranks for e in events[r])
    makespan = max((e.end for e in all_events), default=0.0)
    return Timeline(all_events, makespan, tuple(peak_bytes), tuple(peak_in_flight), tuple(busy))


def simulate_schedule(
    schedule: Schedule,
    stages: int,
    virtual: int,
    micro_batches: int,
    fwd: Sequence[float],
    bwd: Sequence[float],
    p2p: Sequence[float] = (),
    act_bytes: Sequence[float] = (),
    wgrad_fraction: float = 0.5,
) -> Timeline:
    """:func:`simulate` of :func:`schedule_order`: the price of one pipelined step."""
    if len(fwd) != stages * virtual:
        raise ScheduleError(
            f"{stages} stages x {virtual} chunks per rank = {stages * virtual} chunks, but fwd has {len(fwd)} times"
        )
    order = schedule_order(schedule, stages, virtual, micro_batches)
    return simulate(order, fwd, bwd, p2p, act_bytes, wgrad_fraction)


def schedule_figures(
    schedule: Schedule,
    stages: int,
    virtual: int,
    micro_batches: int,
    fwd: Sequence[float],
    bwd: Sequence[float],
    p2p: Sequence[float] = (),
    act_bytes: Sequence[float] = (),
    wgrad_fraction: float = 0.5,
) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """(makespan, busy seconds per rank, peak bytes per rank) of :func:`simulate_schedule`, the
    same run without its events or its checks of the order (``schedule_order``'s are well formed):
    what the search prices each candidate with, several times per plan, at up to hundreds of
    thousands of actions."""
    chunks = stages * virtual
    if len(fwd) != chunks or len(bwd) != chunks:
        raise ScheduleError(
            f"{stages} stages x {virtual} chunks per rank need {chunks} forward and backward times"
        )
    order = schedule_order(schedule, stages, virtual, micro_batches)
    k = micro_batches
    f, b = [float(x) for x in fwd], [float(x) for x in bwd]
    lag = [float(p2p[c]) if c < len(p2p) and stages > 1 else 0.0 for c in range(chunks)]
    lag = [0.0 if (c + 1) % stages == c % stages else lag[c] for c in range(chunks)]  # same rank
    mem = [float(act_bytes[c]) if c < len(act_bytes) else 0.0 for c in range(chunks)]
    wf = float(wgrad_fraction)
    split = any(a.kind == "I" for acts in order.values() for a in acts)
    # end times by key: F at c*k+m, input gradient (B or I) at the next block, W after that
    n = chunks * k
    f_end, g_end = [-1.0] * n, [-1.0] * n
    # per rank: (kind, chunk, micro, key) compiled once
    plans = {
        r: [(a.kind, a.chunk, a.micro, a.chunk * k + a.micro) for a in acts] for r, acts in order.items()
    }
    ranks = sorted(plans)
    ptr = dict.fromkeys(ranks, 0)
    free = dict.fromkeys(ranks, 0.0)
    busy = dict.fromkeys(ranks, 0.0)
    i_end: dict[int, float] = {}
    remaining = sum(len(p) for p in plans.values())
    makespan = 0.0
    while remaining:
        progressed = False
        for r in ranks:
            acts, i, t_free = plans[r], ptr[r], free[r]
            while i < len(acts):
                kind, c, m, key = acts[i]
                if kind == "F":
                    if c > 0:
                        dep = f_end[key - k]
                        if dep < 0:
                            break
                        start = max(t_free, dep + lag[c - 1])
                    else:
                        start = t_free
                    t = f[c]
                    t_free = start + t
                    f_end[key] = t_free
                elif kind == "W":
                    dep = i_end.get(key, -1.0)
                    if dep < 0:
                        break
                    t = wf * b[c]
                    t_free = max(t_free, dep) + t
                else:  # B or I: after its forward and the next chunk's input gradient
                    dep = f_end[key]
                    if dep < 0:
                        break
                    if c < chunks - 1:
                        nxt = g_end[key + k]
                        if nxt < 0:
                            break
                        dep = max(dep, nxt + lag[c])
                    t = b[c] if kind == "B" else (1.0 - wf) * b[c]
                    t_free = max(t_free, dep) + t
                    g_end[key] = t_free
                    if kind == "I":
                        i_end[key] = t_free
                busy[r] += t
                i += 1
                remaining -= 1
                progressed = True
            ptr[r], free[r] = i, t_free
            makespan = max(makespan, t_free)
        if not progressed:
            raise ScheduleError(
                f"the {schedule.value} order deadlocks on {stages} stages (simulate() says where)"
            )
    peaks = []
    for r in ranks:
        held = top = 0.0
        for kind, c, _m, _key in plans[r]:
            if kind == "F":
                held += mem[c]
                top = max(top, held)
            elif kind == "W" or (kind == "B" and not split):
                held -= mem[c]
        peaks.append(top)
    return makespan, tuple(busy[r] for r in ranks), tuple(peaks)
