"""Where a step's collectives spend their time, against what the cost model charges for them.

Plans one model with one role on local gloo ranks (a calibrated ClusterSpec: ``--cluster FILE``,
or a calibration now), builds it on every rank and runs ``--steps`` SGD steps back to back. Every
collective the generated module calls (``torch.distributed.all_reduce`` and ``all_gather``, the
dim-0 gather ``codegen/collectives.py`` runs into its output, and the wait of each gradient
bucket's asynchronous all-reduce) is timed on every rank against one clock (``perf_counter``:
the ranks share the host). Per collective, in step order, the median over steps of

* ``spread``: the last rank's arrival less the first's (the compute the ranks did not do in
  step with each other; on a host with more ranks than cores, the cost model counts it in the
  compute slowdown, not in the collective);
* ``last->done``: from the last rank's arrival to the last rank's return (what the collective
  itself takes once every rank is in it);
* ``price``: the cost model's seconds for that collective and size on the plan's mesh
  (``CommModel.time``: the calibrated collectives, each what it adds to a loop of steps of
  0.5 ms of compute, on its own axis's group layout).

and, as calibration averages them (``trimmed_mean``: a step pays each collective's expected time,
its rare stalls included, which a median hides), the mean over steps of ``last->done`` and of
``own max``, the slowest rank's own time in the call (from its arrival to its return).

and per rank the step time and the seconds inside collectives. A bucket's all-reduce is issued
during backward and waited for when backward ends: its ``spread`` is over the issues and its
``last->done`` from the last issue to the last wait's return.

    .venv/bin/python benchmarks/bench_step_timeline.py --model llama_tiny --world 4 --plan DP
        [--cluster cluster.json] [--steps 20]

``--model`` takes the names of ``bench_cost_accuracy.py`` or a model spec
(``autopar.examples:mlp(batch=64)``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from bench_cost_accuracy import MODELS, PLANS  # this folder: the accuracy benchmark's cases

import autopar
from autopar.cost_model.comm import Collective, CommModel
from autopar.demo import train_step
from autopar.launch import run_on_ranks
from autopar.model_spec import load_model_spec
from autopar.tools.calibrate import run_calibration
from autopar.tools.calibrate_compute import trimmed_mean

WARMUP = 3


class _Recorder:
    """Wraps the collectives the generated module calls; ``events`` holds, per call, (name, kind,
    bytes of the full tensor, (group size, stride), start, end, index of the issue a wait belongs to or -1),
    times in ``perf_counter`` seconds."""

    def __init__(self):
        self.events: list[tuple[str, str, int, int, float, float, int]] = []

    def install(self) -> None:
        import autopar.codegen.collectives as C

        self._wrap(dist, "all_reduce", "all_reduce", lambda t, n: t.numel() * t.element_size())
        self._wrap(
            dist,
            "all_gather",
            "all_gather",
            lambda parts, n: sum(p.numel() * p.element_size() for p in parts),
        )
        # the dim-0 gather into its output, bound at import (``collectives.gather_into``)
        self._wrap(C, "gather_into", "all_gather", lambda out, n: out.numel() * out.element_size())

    def _wrap(self, owner, attr: str, kind: str, full_bytes) -> None:
        fn = getattr(owner, attr)
        rec = self

        def timed(first, *args, **kwargs):
            group = kwargs.get("group")
            n = dist.get_world_size(group)
            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
            layout = (n, ranks[1] - ranks[0] if n > 1 else 1)  # size and stride: the mesh axis
            nbytes = full_bytes(first, n)
            t0 = time.perf_counter()
            work = fn(first, *args, **kwargs)
            t1 = time.perf_counter()
            if not kwargs.get("async_op"):
                rec.events.append((f"{kind}[{nbytes}]", kind, nbytes, layout, t0, t1, -1))
                return work
            rec.events.append((f"{kind}[{nbytes}] issue", kind, nbytes, layout, t0, t1, -1))
            issue = len(rec.events) - 1
            return _TimedWork(work, rec, (f"{kind}[{nbytes}] wait", kind, nbytes, layout), issue)

        setattr(owner, attr, timed)


class _TimedWork:
    def __init__(self, work, rec: _Recorder, meta: tuple, issue: int):
        self._work, self._rec, self._meta, self._issue = work, rec, meta, issue

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        self._rec.events.append((*self._meta, t0, time.perf_counter(), self._issue))
        return out


def _rank(rank: int, world: int, spec: str, cluster_dict: dict, path: str, steps: int) -> list:
    """Per step: (start, end, events) of this rank."""
    cluster = autopar.ClusterSpec.from_dict(cluster_dict)
    torch.manual_seed(0)
    model, inputs = load_model_spec(spec)
    pmodel = autopar.autoparallelize(model, cluster, inputs, plan=path)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.01)
    for _ in range(WARMUP):
        train_step(pmodel, opt, inputs)
    rec = _Recorder()
    rec.install()
    dist.barrier()
    out = []
    for _ in range(steps):
        rec.events.clear()
        t0 = time.perf_counter()
        train_step(pmodel, opt, inputs)
        out.append((t0, time.perf_counter(), list(rec.events)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama_tiny")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--plan", choices=list(PLANS), default="DP")
    ap.add_argument("--cluster", default=None, help="a calibrated spec file (default: calibrate now)")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    spec = MODELS.get(args.model, args.model)
    if args.cluster:
        base = autopar.ClusterSpec.from_file(args.cluster)
    else:
        t0 = time.perf_counter()
        base = run_calibration(args.world).cluster
        print(f"calibrated on {args.world} gloo processes in {time.perf_counter() - t0:.1f} s")
    cluster = base.with_overrides(nodes=1, devices_per_node=args.world)
    model, inputs = load_model_spec(spec)
    plan = autopar.plan(model, cluster, inputs, axis_roles=PLANS[args.plan], optimizer=autopar.Optimizer.SGD)
    path = tempfile.mkstemp(prefix="timeline_", suffix=".json")[1]
    plan.save(path)
    p = plan.predicted
    print(
        f"{args.model} world {args.world} plan {args.plan} mesh {plan.mesh_shape}: predicted step "
        f"{p.step_time_s * 1e3:.2f} ms (compute {p.compute_s * 1e3:.2f}, communication {p.comm_s * 1e3:.2f})"
    )
    ranks = run_on_ranks(_rank, args.world, spec, cluster.to_dict(), path, args.steps)
    comm = CommModel(cluster, plan.mesh_shape)
    sizes = list(plan.mesh_shape)
    steps = len(ranks[0])
    for r, rows in enumerate(ranks):
        step = statistics.median(e - s for s, e, _ in rows)
        inside = statistics.median(sum(e[5] - e[4] for e in ev) for _, _, ev in rows)
        print(f"rank {r}: step {step * 1e3:.2f} ms, {inside * 1e3:.2f} ms of it inside collectives")
    counts = {len(ev) for rk in ranks for _, _, ev in rk}
    if len(counts) != 1:
        print(f"the ranks called different numbers of collectives per step ({sorted(counts)}): no table")
        return
    print(
        f"{'collective':<34} {'spread ms':>10} {'last->done ms':>14} {'mean':>7} {'own max mean':>13} {'price ms':>9}"
    )
    total_done = total_mean = total_own = total_price = 0.0
    for j in range(counts.pop()):
        name, kind, nbytes, layout, _, _, issue = ranks[0][0][2][j]
        spread = statistics.median(
            max(rk[i][2][j][4] for rk in ranks) - min(rk[i][2][j][4] for rk in ranks) for i in range(steps)
        )
        # an asynchronous all-reduce: from the last issue to the last wait's return
        start_j = issue if issue >= 0 else j
        dones = [
            max(rk[i][2][j][5] for rk in ranks) - max(rk[i][2][start_j][4] for rk in ranks)
            for i in range(steps)
        ]
        done, done_mean = statistics.median(dones), trimmed_mean(dones)
        own = trimmed_mean([max(rk[i][2][j][5] - rk[i][2][start_j][4] for rk in ranks) for i in range(steps)])
        if name.endswith(" issue"):
            print(f"{name:<34} {spread * 1e3:>10.2f} {'':>14} {'':>9}")
            continue
        axis = next((a for a, m in enumerate(sizes) if (m, math.prod(sizes[a + 1 :])) == tuple(layout)), 0)
        price = comm.time(Collective(kind), nbytes, axis)
        total_done, total_price = total_done + done, total_price + price
        total_mean, total_own = total_mean + done_mean, total_own + own
        print(
            f"{name:<34} {spread * 1e3:>10.2f} {done * 1e3:>14.2f} {done_mean * 1e3:>7.2f} "
            f"{own * 1e3:>13.2f} {price * 1e3:>9.2f}"
        )
    print(
        f"{'all':<34} {'':>10} {total_done * 1e3:>14.2f} {total_mean * 1e3:>7.2f} "
        f"{total_own * 1e3:>13.2f} {total_price * 1e3:>9.2f}"
    )


if __name__ == "__main__":
    main()
