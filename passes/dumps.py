"""Where one search's progress lines and stage dumps go (``Stages``), and the dumps' texts.

A search says what each stage did (``Stages.say``: the ``autopar`` logger and the caller's
``progress`` callback) and, with a dump folder (``dump_dir``, or the ``AUTOPAR_DUMP_DIR``
environment variable), writes each stage's output there (``Stages.write``): the tab-separated
tables below, the solver's choices and the plan as JSON. A ``Recorder`` keeps both instead, for
work done ahead on another thread and replayed in the search's order (``passes/prefetch.py``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from autopar.passes.analyze import NodeInfo
from autopar.passes.coarsen import Classes
from autopar.passes.costs import CostTables
from autopar.passes.strategies import NodeStrategies
from autopar.placement import spec_to_str

log = logging.getLogger("autopar")


class Stages:
    """Progress lines and dumps of one search."""

    def __init__(self, progress: Callable[[str], None] | None, dump_dir: str | os.PathLike | None):
        self.progress_fn = progress
        dump_dir = dump_dir or os.environ.get("AUTOPAR_DUMP_DIR")
        self.dump = Path(dump_dir) if dump_dir else None
        if self.dump:
            self.dump.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()

    def say(self, msg: str) -> None:
        log.info(msg)
        if self.progress_fn is not None:
            self.progress_fn(msg)

    def write(self, name: str, text: str) -> None:
        if self.dump:
            (self.dump / name).write_text(text)


class Recorder(Stages):
    """A ``Stages`` that keeps its lines (``said``) and dumps (``writes``) instead of passing them
    on; with no ``dump`` folder it keeps no dumps."""

    def __init__(self, dump: Path | None = None):
        self.dump, self.said, self.writes = dump, [], []
        self.progress_fn, self.t0 = None, time.perf_counter()

    def say(self, msg: str) -> None:
        self.said.append(msg)

    def write(self, name: str, text: str) -> None:
        if self.dump:
            self.writes.append((name, text))


def size_text(nbytes: float) -> str:
    """Bytes in a unit that shows the figure: 1.50 GiB, 12.3 MiB, 800 KiB, 12 B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def infos_tsv(infos: dict[str, NodeInfo]) -> str:
    """``2_analyze.tsv``: per node its role, op, shape, dtype, FLOPs and bytes."""
    rows = ["name\trole\ttarget\tshape\tdtype\tflops\tbytes\trequires_grad"]
    for i in infos.values():
        rows.append(
            f"{i.name}\t{i.role.value}\t{i.target}\t{i.shape}\t{i.dtype}\t{i.flops:.0f}\t{i.bytes}\t{i.requires_grad}"
        )
    return "\n".join(rows) + "\n"


def classes_tsv(classes: Classes) -> str:
    """``2_coarsen.tsv``: per class of repeated-block twins its representative and members."""
    rows = ["representative\tcount\tmembers"]
    for rep, members in classes.members.items():
        rows.append(f"{rep}\t{len(members)}\t{','.join(members)}")
    return "\n".join(rows) + "\n"


def strategies_tsv(strats: dict[str, NodeStrategies]) -> str:
    """``3_strategies_<mesh>.tsv``: per node each strategy's output and input placements."""
    rows = ["node\tindex\toutput\tinputs"]
    for name, ns in strats.items():
        for k, s in enumerate(ns.strategies):
            rows.append(f"{name}\t{k}\t{spec_to_str(s.out)}\t{' '.join(spec_to_str(x) for x in s.ins)}")
    return "\n".join(rows) + "\n"


def costs_tsv(tables: CostTables) -> str:
    """``3_costs_<mesh>.tsv``: per variable node and strategy, seconds and bytes; per edge, its
    (source, destination) matrix of seconds, one row per source strategy."""
    rows = ["kind\tname\tstrategy\toutput\tseconds\tbytes"]
    for v, ss in tables.strategies.items():
        for k, s in enumerate(ss):
            rows.append(
                f"node\t{v}\t{k}\t{spec_to_str(s.out)}\t{tables.node_cost[v][k]!r}\t{tables.node_mem[v][k]!r}"
            )
    for e in tables.edges:
        for a, row in enumerate(e.cost):
            rows.append(
                f"edge\t{e.src}->{e.dst}\t{a}\t\t{' '.join(repr(c) for c in row)}\t{' '.join(repr(m) for m in e.mem[a])}"
            )
    return "\n".join(rows) + "\n"
