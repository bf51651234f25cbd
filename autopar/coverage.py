"""Which ops of a model have sharding rules, and which fall back to replication; and which ops'
FLOPs or saved tensors could not be derived.

    autopar coverage MODEL_SPEC [--json]
    autopar.coverage(model, example_inputs) -> list[OpCoverage]

An op without a rule of autopar's own takes the options PyTorch's DTensor strategies give it
(``passes/rules/dtensor.py``; listed as "DTensor", asked for an axis of 2 ranks); an op with neither
is replicated (and priced as such), never guessed: this lists them so that a user sees where the
search has no choice. An op whose FLOPs or saved tensors analysis could not
derive (``NodeInfo.unpriced``: no meta kernel, say) is priced at a fallback (0 FLOPs; every input
kept for backward): this lists it with the reason. ``operator.getitem`` is not listed: it takes the
placement of the op it reads from.
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import asdict, dataclass

from autopar.passes.analyze import analyze
from autopar.passes.rules import RULES, functional_twin
from autopar.passes.rules.dtensor import options as dtensor_options
from autopar.passes.trace import trace


@dataclass(frozen=True)
class OpCoverage:
    op: str
    count: int  # nodes of the traced graph calling it
    has_rule: bool  # False: always replicated
    # why its FLOPs / saved tensors are a fallback ("flops: ...", "saved tensors: ..."); () derived
    unpriced: tuple[str, ...] = ()
    # no rule of its own, but every node of it has options derived from DTensor's strategies
    dtensor: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def _has_rule(target) -> bool:
    """A rule of its own, or, for an in-place op, its out-of-place twin's (``in_place_options``)."""
    return target in RULES or functional_twin(target) in RULES


def coverage(model, example_inputs) -> list[OpCoverage]:
    """Every distinct op of the traced model with its node count, whether it has a sharding rule,
    and why its FLOPs or saved tensors could not be derived (on any of its nodes)."""
    tg = trace(model, example_inputs)
    infos = analyze(tg, strict=False)  # list what strict analysis would refuse
    counts: Counter = Counter()
    targets = {}
    why: dict[str, set[str]] = {}
    derived: dict[str, bool] = {}
    for n in tg.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            op = str(n.target)
            counts[op] += 1
            targets[op] = n.target
            why.setdefault(op, set()).update(infos[n.name].unpriced)
            if not _has_rule(n.target):
                derived[op] = derived.get(op, True) and bool(dtensor_options(n, (2,)))
    rows = [
        OpCoverage(op, c, _has_rule(targets[op]), tuple(sorted(why[op])), derived.get(op, False))
        for op, c in counts.items()
    ]
    return sorted(
        rows, key=lambda r: (r.has_rule and not r.unpriced, r.has_rule or r.dtensor, -r.count, r.op)
    )


def format_table(rows: list[OpCoverage]) -> str:
    width = max((len(r.op) for r in rows), default=10)
    lines = [f"{'op':{width}s}  {'nodes':>5s}  {'rule':15s}  FLOPs and saved tensors"]
    for r in rows:
        rule = "yes" if r.has_rule else "DTensor" if r.dtensor else "NO (replicated)"
        priced = f"NOT DERIVED: {'; '.join(r.unpriced)}" if r.unpriced else "derived"
        lines.append(f"{r.op:{width}s}  {r.count:5d}  {rule:15s}  {priced}")
    missing = [r for r in rows if not r.has_rule and not r.dtensor]
    derived = [r for r in rows if r.dtensor]
    unpriced = [r for r in rows if r.unpriced]
    n_nodes = sum(r.count for r in rows)
    lines.append(
        f"{len(rows)} ops, {n_nodes} nodes; {len(missing)} ops ({sum(r.count for r in missing)} nodes) have no rule"
        f" (replicated); {len(derived)} ops ({sum(r.count for r in derived)} nodes) take DTensor's strategies"
    )
    lines.append(
        f"{len(unpriced)} ops ({sum(r.count for r in unpriced)} nodes) have FLOPs or saved tensors that "
        "could not be derived (priced at 0 FLOPs / every input kept for backward)"
    )
    return "\n".join(lines)
