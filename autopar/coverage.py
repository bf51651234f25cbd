"""Which ops of a model have sharding rules, and which fall back to replication.

    autopar coverage MODEL_SPEC [--json]
    autopar.coverage(model, example_inputs) -> list[OpCoverage]

An op without a rule is replicated (and priced as such), never guessed: this lists them so that
a user sees where the search has no choice. ``operator.getitem`` is not listed: it takes the
placement of the op it reads from.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import asdict, dataclass

from autopar.passes.rules import RULES
from autopar.passes.trace import trace


@dataclass(frozen=True)
class OpCoverage:
    op: str
    count: int  # nodes of the traced graph calling it
    has_rule: bool  # False: always replicated

    def to_dict(self) -> dict:
        return asdict(self)


def coverage(model, example_inputs) -> list[OpCoverage]:
    """Every distinct op of the traced model with its node count and whether it has a sharding rule."""
    tg = trace(model, example_inputs)
    counts: Counter = Counter()
    targets = {}
    for n in tg.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            counts[str(n.target)] += 1
            targets[str(n.target)] = n.target
    rows = [OpCoverage(op, c, targets[op] in RULES) for op, c in counts.items()]
    return sorted(rows, key=lambda r: (r.has_rule, -r.count, r.op))


def format_table(rows: list[OpCoverage]) -> str:
    width = max((len(r.op) for r in rows), default=10)
    lines = [f"{'op':{width}s}  {'nodes':>5s}  rule"]
    lines += [f"{r.op:{width}s}  {r.count:5d}  {'yes' if r.has_rule else 'NO (replicated)'}" for r in rows]
    missing = [r for r in rows if not r.has_rule]
    n_nodes = sum(r.count for r in rows)
    lines.append(
        f"{len(rows)} ops, {n_nodes} nodes; {len(missing)} ops ({sum(r.count for r in missing)} nodes) have no rule"
    )
    return "\n".join(lines)
