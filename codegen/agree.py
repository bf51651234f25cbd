"""What every rank must share, checked across ranks, and the plan solved once per job.

autopar's contract is that every rank holds the same model (same weights), passes the same example
inputs and, at every call, the same full global batch: the module slices each rank's part itself.
Ranks that break it train silently wrong (different weights) or hang in a collective (different
plans). ``agree`` compares a cheap fingerprint of a value across ranks with one
``all_gather_object``, so that every rank sees every fingerprint and every rank raises the same
``CrossRankMismatchError`` (none is left waiting in a collective); ``fingerprint`` digests tensors
by shape, dtype, float64 sum and norm (equal for identical tensors, computed the same way on every
rank; on the tensor's own device, without a float64 copy of it).

``all_entered`` guards the module's collective methods that users are tempted to call on one rank
(``full_state_dict``, ``full_output``, ``full_grads``: "save on rank 0"): before any gathering,
each rank that enters one checks in through torch.distributed's store (the key-value store every
backend, gloo and NCCL alike, starts from: no collective, so nothing is left half-sent when a rank
never comes) and waits, for at most a timeout, for every rank of the mesh. The ranks that came
raise ``CollectiveCallError`` naming the call and the fix, instead of the backend's abort
("Received data size doesn't match expected size") or a hang; before raising they post the
failure and abort their process groups, so that every other rank raises ``PeerFailedError`` too,
at its next collective call or in the collective it waits in (``codegen/failures.py``): no rank is
left waiting for a call its peers will never make. Calls are numbered per process (per call name
and mesh), so repeated calls do not mix.

``agree_on_model`` checks the model's weights and the example inputs, ``agree_on_plan`` the
decisions of a plan each rank loaded or searched itself (``Plan.decision_parts``: not the seconds
or predicted figures of its search); ``solve_once`` runs the search on rank 0 only and broadcasts the plan (or rank
0's error) to the others: planning time does not grow with the number of ranks.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from autopar.codegen import failures
from autopar.codegen.feeding import input_names
from autopar.errors import AutoparError, CollectiveCallError, CrossRankMismatchError, DistributedSetupError
from autopar.passes.trace import normalize_inputs

ENTRY_TIMEOUT_S = 60.0  # how long a rank waits in ``all_entered`` for the others, by default
_next_call: dict[str, int] = {}  # this process's number of its next call, per call name and mesh


def fingerprint(named: Iterable[tuple[str, object]]) -> tuple[str, dict[str, str]]:
    """(one digest of everything, a digest per name) of named tensors or plain values."""
    per = {}
    for name, value in named:
        h = hashlib.sha256()
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                t = leaf.detach()
                h.update(f"{tuple(t.shape)}|{t.dtype}".encode())
                if t.numel() and not t.is_meta:
                    x = t if t.dtype != torch.bool else t.to(torch.uint8)
                    total = x.sum(dtype=torch.float64).item()
                    norm = (
                        torch.linalg.vector_norm(x, dtype=torch.float64).item()
                        if x.is_floating_point()
                        else 0.0
                    )
                    h.update(f"{total!r}|{norm!r}".encode())
            else:
                h.update(repr(leaf).encode())
        per[name] = h.hexdigest()[:16]
    whole = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(per.items())).encode()).hexdigest()[:16]
    return whole, per


def agree(what: str, named: Iterable[tuple[str, object]], fix: str, group=None, key=None) -> None:
    """Raise ``CrossRankMismatchError`` on every rank unless every rank's ``named`` values match
    rank 0's (with ``key``: those of the first rank with the same key, e.g. the ranks fed the
    same slice of a batch); ``what`` names them in the message, ``fix`` says how to make them
    agree."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    whole, per = fingerprint(named)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (key, whole, per), group=group)
    first_of = {}
    for r, g in enumerate(gathered):
        first_of.setdefault(g[0], r)
    bad = [r for r, g in enumerate(gathered) if g[1] != gathered[first_of[g[0]]][1]]
    if not bad:
        return
    ref = gathered[first_of[gathered[bad[0]][0]]][2]
    first = gathered[bad[0]][2]
    names = [k for k in sorted(set(ref) | set(first)) if ref.get(k) != first.get(k)]
    raise CrossRankMismatchError(
        f"{what} differ between ranks: rank(s) {bad} differ from rank {first_of[gathered[bad[0]][0]]} "
        f"(first: {names[:3]}); {fix}"
    )


def agree_on_model(model: torch.nn.Module, example_inputs) -> None:
    """``agree`` on what every rank must share before anything is solved or built: the model's
    weights and the example inputs (the full global batch)."""
    agree(
        "the model's weights", model.state_dict().items(),
        "every rank must build the same weights: call torch.manual_seed(...) with the same seed before building "
        "the model, or load the same checkpoint on every rank",
    )  # fmt: skip
    args, kwargs = normalize_inputs(example_inputs)
    agree(
        "the example inputs", zip(input_names(model, args, kwargs), pytree.tree_leaves((args, kwargs))),
        "pass the same full global batch on every rank: autopar slices each rank's part itself (do not give "
        "each rank its own shard, as DistributedDataParallel wants)",
    )  # fmt: skip


def agree_on_plan(plan) -> None:
    """Raise ``CrossRankMismatchError`` on every rank unless every rank's plan (a plan file each
    loaded, or a ``Plan`` each searched or passed in) takes rank 0's decisions
    (``Plan.decision_parts``: what the search measured or predicted, such as its seconds, may
    differ). The message names the first parts that differ and shows both ranks' values."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    parts = plan.decision_parts()
    texts = {k: json.dumps(v, sort_keys=True) for k, v in parts.items()}
    digests = {k: hashlib.sha256(t.encode()).hexdigest()[:16] for k, t in texts.items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (plan.decisions_fingerprint(), list(digests.items())))
    bad = [r for r, g in enumerate(gathered) if g[0] != gathered[0][0]]
    if not bad:
        return
    ref, first = dict(gathered[0][1]), dict(gathered[bad[0]][1])
    order = [k for k, _ in gathered[0][1]] + [k for k, _ in gathered[bad[0]][1] if k not in ref]
    names = [k for k in order if ref.get(k) != first.get(k)]
    # every rank computed the same names from the same digests: one more gather shows the values
    shown: list = [None] * dist.get_world_size()
    dist.all_gather_object(shown, [texts.get(k, "(none)") for k in names[:3]])

    def clip(text: str) -> str:
        return text if len(text) <= 120 else text[:117] + "..."

    each = "; ".join(
        f"{k}: rank 0 {clip(shown[0][i])}, rank {bad[0]} {clip(shown[bad[0]][i])}"
        for i, k in enumerate(names[:3])
    )
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    raise CrossRankMismatchError(
        f"the plans differ between ranks: rank(s) {bad} take other decisions than rank 0 in "
        f"{len(names)} part(s){more}: {each}; load the same plan on every rank, or search with the same "
        "model, cluster and options on every rank (or let autoparallelize search: rank 0 searches and sends "
        "its plan)"
    )


def all_entered(call: str, ranks: Sequence[int], fix: str, timeout_s: float = ENTRY_TIMEOUT_S) -> None:
    """Return once every rank of ``ranks`` (global ranks, e.g. a mesh's) has made its next
    collective call, and all made ``call``. Where some made another call at that point, raise
    ``CollectiveCallError`` on every rank, naming the calls and the ranks that made each; where
    some did not come within ``timeout_s`` seconds, raise it on the ranks that came, naming the
    others; ``fix`` says how to call ``call``. Either way the failure is posted and this process's
    groups aborted (``failures.fail_together``); a rank that comes to a call the others gave up
    on, or that waits while a rank fails elsewhere, raises ``PeerFailedError``. Cost when all
    come: a few round trips to the store per rank, and a wait for the last to arrive (which the
    collectives that follow would wait for anyway).

    The calls over one set of ranks are numbered in one sequence per process. Keys under
    ``autopar/entered/<ranks>/<number>``: ``calls`` ("rank=call;" per rank that came), ``n`` (how
    many came), ``go`` (the decision, set once: "go" or "mismatch" by the rank that makes ``n``
    ``len(ranks)``, "abandoned" by the first that timed out, "failed" by a rank that failed
    elsewhere); the rank that decides "go" deletes the previous call's keys, which every rank has
    left by then."""
    if not failures.failed_here() and (not dist.is_initialized() or len(ranks) < 2):
        return
    if failures.failed_here():
        raise failures.peer_failed(call, failures.peer_failure() or "")
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    scope = "autopar/entered/" + hashlib.sha256(repr(sorted(ranks)).encode()).hexdigest()[:12]
    seq = _next_call.get(scope, 0)
    _next_call[scope] = seq + 1
    key = f"{scope}/{seq}"
    store.append(f"{key}/calls", f"{me}={call};")
    arrived = store.add(f"{key}/n", 1)
    if arrived >= len(ranks):
        made = _calls(store.get(f"{key}/calls"))
        decided = store.compare_set(f"{key}/go", "", "go" if set(made.values()) == {call} else "mismatch")
    else:
        failures.waiting_on(f"{key}/go")
        try:
            store.wait([f"{key}/go"], timedelta(seconds=timeout_s))
        except RuntimeError:  # DistStoreError (FileStore's: RuntimeError): not every rank came
            pass
        decided = store.compare_set(f"{key}/go", "", "abandoned")
    if decided == b"go":
        if arrived == len(ranks) and seq > 0:
            for k in ("calls", "n", "go"):
                store.delete_key(f"{scope}/{seq - 1}/{k}")
        return
    if decided == b"failed" or (decided == b"abandoned" and arrived >= len(ranks)):
        # a rank failed elsewhere, or gave up on this call before this rank came
        raise failures.peer_failed(call, failures.peer_failure() or "")
    made = _calls(store.get(f"{key}/calls"))
    if decided == b"mismatch":
        each = "; ".join(
            f"{c} on rank(s) {sorted(r for r in made if made[r] == c)[:8]}"
            for c in dict.fromkeys(made.values())
        )
        what = f"the ranks of its mesh made different collective calls at the same point ({each})"
        failures.fail_together(f"{call}: {what}", wait_for_peers=False)
    else:
        missing = [r for r in ranks if r not in made]
        what = (
            f"rank(s) {missing[:8]}{' ...' if len(missing) > 8 else ''} of its mesh did not call it within "
            f"{timeout_s:g} s of rank(s) {sorted(made)[:8]}"
            if missing
            else f"its ranks did not all call it within {timeout_s:g} s of each other"
        )
        failures.fail_together(f"{call}: {what}")
    raise CollectiveCallError(
        f"{call} is a collective over every rank of the module's mesh ({len(ranks)} ranks), but {what}: "
        f"{fix} (pmodel.entry_timeout_s sets how long the ranks wait for each other; every rank of the job "
        "raises, and this process's groups are aborted)"
    )


def _calls(text: bytes) -> dict[int, str]:
    """``calls``' "rank=call;" entries as {rank: call}."""
    return {int(r): c for r, c in (e.split("=", 1) for e in text.decode().split(";") if e)}


FORWARD_FIX = (
    "every rank must run the module's forward, step and collective methods (full_state_dict, "
    "full_output, full_grads) in the same order"
)


def collective_section(call: str, fix: str = FORWARD_FIX) -> Callable:
    """Decorate a method of the parallel module that issues collectives (``forward``, ``step``):
    where ``self.check_calls`` and ``self.issues_collectives`` and it is not called inside another section, every rank
    must enter it together (``all_entered``, over ``self._collective_mesh()``, waiting
    ``self.entry_timeout_s``), so that a rank never blocks in a collective its peers will not
    join; where a peer's failure broke one of its collectives, ``PeerFailedError`` replaces the
    backend's error (``failures.run_section``)."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            if failures.section_depth() == 0 and self.check_calls and self.issues_collectives:
                all_entered(call, self._collective_mesh().mesh.flatten().tolist(), fix, self.entry_timeout_s)
            return failures.run_section(call, fn, self, *args, **kwargs)

        return run

    return wrap


def enter_backward(module, outs: list) -> None:
    """Make a backward through ``outs`` (a forward's flat outputs) enter "backward" on every rank
    (``all_entered``) before the backward's collectives run: a pre-hook on the autograd node of
    each output that requires grad, the first to run entering for all (the outputs are left as
    they are: a user may still modify them in place). Not inside a section (``step`` entered
    already), nor where the module issues no collectives."""
    if (
        failures.section_depth() > 1
        or not module.check_calls
        or not module.issues_collectives
        or not torch.is_grad_enabled()
    ):
        return
    nodes = {id(t.grad_fn): t.grad_fn for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    if not nodes:
        return
    entered = []

    def enter(grad_outputs):
        if not entered and failures.section_depth() == 0:
            entered.append(True)
            ranks = module._collective_mesh().mesh.flatten().tolist()
            all_entered("backward", ranks, FORWARD_FIX, module.entry_timeout_s)

    for node in nodes.values():
        node.register_prehook(enter)


def solve_once(search: Callable[[], tuple], group=None) -> tuple:
    """``search()`` on rank 0 of ``group`` (the default group) only, its plan (``search()[1]``)
    sent to every rank; returns ``(search()[0] or None, plan)``: the search's own result on rank 0,
    None on the other ranks, which replay the plan. An error of rank 0's search is raised on every
    rank."""
    from autopar.plan import Plan

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return search()
    src = dist.get_global_rank(group, 0) if group is not None else 0
    mine = dist.get_rank() == src
    payload: list = [None]
    found = None
    failure: BaseException | None = None
    if mine:
        try:
            found, plan = search()
            payload = [("plan", plan.to_dict())]
        except Exception as e:  # every rank must hear of it, or they wait for the plan forever
            failure = e
            payload = [("error", type(e) if isinstance(e, AutoparError) else None, str(e))]
    dist.broadcast_object_list(payload, src=src, group=group)
    kind, *rest = payload[0]
    if kind == "error":
        if failure is not None:
            raise failure
        cls, msg = rest
        if cls is None:
            raise DistributedSetupError(f"rank 0's search failed ({msg}); its traceback is on rank 0")
        raise cls(msg)
    return found, Plan.from_dict(rest[0])
