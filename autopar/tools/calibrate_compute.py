"""Measure one device's compute figures for ``cost_model/compute.py`` (``autopar calibrate``).

Run with the thread count the ranks use, on as many ranks at once as the host has cores
(``autopar/tools/calibrate.py``), in lockstep (``lockstep``: the ranks meet before each timing, loop
each op as many times, and go on running it until every rank's timing is over), so the figures
are one rank's own while the others run the same op, as the ranks of a step do (at their own
pace, one rank's matmuls could run beside another's pointwise ops, or alone while it waits, and
time faster than a step runs them):

* per-op overhead ``launch`` [s], as a traced model pays it: ``_OpMix`` (an embedding, a
  pre-norm transformer block with causal attention and a GELU MLP, a vocabulary head and a
  cross-entropy loss, at sizes where arithmetic is a few percent of the time) traced by
  ``passes/trace.py`` and its aten graph run forward and backward as a training step runs it. The
  cost model charges each op node ``launch`` forward and, where it needs a gradient, once more
  backward, and one per further use whose gradient backward sums (``passes/costs.py``; a
  ``getitem`` is free), so ``launch = (t_step - step_overhead) / launches``. Views, reshapes,
  multi-output ops and the autograd engine's per-node work make this a few times the figure of
  a chain of one op repeated (``launch_chain``, below);
* ``launch_chain`` [s]: a chain of 60 tiny ops (mul, add, tanh on 8 elements) called through
  their aten overloads (``torch.ops.aten.mul.Tensor``: the generated module's calls) forward and
  backward, ``t_chain / (60 * 2)``: the fixed part taken off the per-element and per-FLOP tables
  below, which time one op at a time the same way;
* memory bandwidth ``mem_bw`` [B/s], as a training step sees it: ``STEP_LIVE`` float32 tensors
  of ``n`` bytes are live (more than a core's cache holds); each op multiplies two of them made a
  few and many ops before into a fresh tensor, which joins them while the oldest is freed
  (activations made, kept, and released). ``mem_bw = 3 n / (t - t_1)`` per op, with ``t_1`` an
  ``add`` on one element (dispatch, no autograd), the median over ``n`` in ``STEP_SIZES``
  (slower than ``torch.add(a, b, out=c)`` on one reused buffer, and close to what an
  elementwise op inside a traced step streams);
* FLOP/s: ``torch.nn.functional.linear`` of fp32 operands, an ``(m, k)`` input and an ``(n, k)``
  weight, forward and backward (gradients of input and weight) as a training step runs it,
  ``F = 3 * 2 m k n`` FLOPs (a forward and two backward matmuls, each writing a fresh output),
  over ``MATMUL_SHAPES``: squares, and the tall, thin GEMMs of a transformer's projections (many
  tokens against a narrow hidden size), which run below squares of the same FLOPs, and skinny
  ones (16-64 rows, a data-parallel rank's few tokens), which run slower still. The fit
  (``fit_matmul``) ``t = F / (rate * d / (d + D)) + c``, ``d`` the shape's smallest size, gives
  the effective rate ``rate`` [FLOP/s] of a large GEMM and ``matmul_dim_half = D`` [elements],
  and the intercept ``c`` gives each GEMM's fixed cost ``matmul_overhead_s``
  (``matmul_overhead``; three small shapes pin it). The roofline
  prices a large GEMM at ``F / (peak * EFF_MAX)``, so the peak stored is ``rate / EFF_MAX``: the
  cost model then predicts the measured rates;
* in-place bandwidth ``inplace_bw`` [B/s], as an optimizer's step streams it: ``STEP_LIVE``
  tensors of ``n`` bytes, each op adding one into another in place (``a.add_(b)``, SGD's update),
  cycling through them so that none is in a core's cache; ``inplace_bw = 3 n / (t - t_1)``, the
  median over ``STEP_SIZES`` (above ``mem_bw`` on CPUs: nothing fresh to write into);
* pointwise table ``pointwise_s`` [s per element of the op's largest tensor]: each op of
  ``POINTWISE_OPS`` on ``POINTWISE_NUMEL`` float32 elements (rows of 256 for the ops that reduce
  a last dim: softmax, layer_norm, cross-entropy over 256 classes), forward
  (``t_f``) and forward + backward (``t_fb``) through autograd:
  ``p_fwd = (t_f - launch) / E``, ``p_bwd = (t_fb - t_f - launch) / E``. The size is the activations'
  of the models this project runs on CPU (``cost_model/compute.py`` takes the larger of these
  figures and the roofline);
* per-FLOP table ``per_flop_s`` [s per forward FLOP]: each op of ``PER_FLOP_OPS``
  (``scaled_dot_product_attention`` of ``ATTENTION_SHAPE`` with a boolean causal mask, as traced
  decoders call it), forward and forward + backward as
  above, divided by the forward FLOPs ``FlopCounterMode`` counts for the same call on the meta device
  (as ``passes/analyze.py`` counts a graph node's);
* optimizer cost per parameter tensor ``optimizer_param_s`` [s]: ``step()`` of each optimizer of
  ``OPTIMIZERS`` (PyTorch's defaults for the device) over ``OPT_TENSORS`` tiny tensors and over 4:
  ``(t_many - t_4) / (OPT_TENSORS - 4)``, what each further tensor adds beyond its bytes;
* per-step overhead ``step_overhead_s`` [s]: a whole training step of a one-op model with one
  8-element parameter (``(w * x).sum()``, ``backward()``, SGD ``step()``, ``zero_grad()``) less
  what the cost model already charges for it (2 ops x 2 launches, one SGD tensor): the autograd
  engine's start and the optimizer's Python around its per-tensor work.

What these figures came to on the development machine: ``benchmarks/README.md`` ("Readings of
the development VM" and "Cost-model accuracy").
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from autopar.cost_model.compute import EFF_MAX, T_HALF

aten = torch.ops.aten

LAUNCH_CHAIN_OPS = 60
POINTWISE_NUMEL = 2**18
ROW = 256  # last dim of the ops that normalize over it (softmax, layer_norm)
STEP_LIVE = 48
STEP_SIZES = (2**20, 2**22)  # bytes per tensor
ATTENTION_SHAPE = (4, 4, 128, 32)  # batch, heads, sequence, head dim
OPT_TENSORS = 36
# (m, k, n) of the matmul samples: squares, and a transformer's projections (tokens x hidden)
MATMUL_SHAPES = ((128, 64, 128), (256, 128, 64), (256, 128, 128),
                 (128, 128, 128), (256, 256, 256), (384, 384, 384), (512, 512, 512),
                 (2048, 128, 128), (512, 128, 512), (512, 512, 128), (512, 128, 2048),
                 (16, 512, 1024), (32, 512, 1024), (64, 512, 1024))  # fmt: skip
MATMUL_SHAPES_QUICK = ((96, 96, 96), (192, 192, 192), (288, 288, 288), (512, 64, 512), (16, 256, 512))
# the values of matmul_dim_half the fit tries (elements)
DIM_HALF_GRID = (0, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# passes.costs.Optimizer names -> the torch optimizer that the name prices (device defaults)
OPTIMIZERS: dict[str, Callable[[list], torch.optim.Optimizer]] = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=1e-3),
    "SGD_MOMENTUM": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
    "ADAM": lambda ps: torch.optim.Adam(ps, lr=1e-3),
}


def _row(f: Callable) -> Callable:
    return lambda x: f(x.view(-1, ROW))


# op name (str of the aten overload, as NodeInfo.target holds it) -> how to call it on a float tensor
POINTWISE_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "aten.tanh.default": aten.tanh.default,
    "aten.exp.default": aten.exp.default,
    "aten.log.default": aten.log.default,
    "aten.sigmoid.default": aten.sigmoid.default,
    "aten.silu.default": aten.silu.default,
    "aten.gelu.default": aten.gelu.default,
    "aten.erf.default": aten.erf.default,
    "aten.sin.default": aten.sin.default,
    "aten.cos.default": aten.cos.default,
    "aten.rsqrt.default": aten.rsqrt.default,
    "aten.sqrt.default": aten.sqrt.default,
    "aten.softmax.int": _row(lambda x: aten.softmax.int(x, -1)),
    "aten.log_softmax.int": _row(lambda x: aten.log_softmax.int(x, -1)),
    "aten.layer_norm.default": _row(lambda x: aten.layer_norm.default(x, [ROW])),
    "aten.cross_entropy_loss.default": _row(
        lambda x: aten.cross_entropy_loss.default(
            x, torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        )
    ),
}


def _attention(device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """q, k, v (needing gradients) and a boolean causal mask, as traced decoder models call it."""
    b, _, s, _ = ATTENTION_SHAPE
    mask = torch.ones(s, s, dtype=torch.bool, device=device).tril().expand(b, 1, s, s)
    return [torch.rand(ATTENTION_SHAPE, device=device) for _ in range(3)], [mask]


# op name -> (inputs maker: (tensors needing a gradient, other tensors), call): timed per forward
# FLOP (FlopCounterMode on the same call)
PER_FLOP_OPS: dict[str, tuple[Callable, Callable]] = {
    "aten.scaled_dot_product_attention.default": (
        _attention,
        lambda q, k, v, mask: aten.scaled_dot_product_attention.default(q, k, v, mask),
    ),
}


def trimmed_mean(values: Sequence[float], trim: float = 0.025) -> float:
    """Mean without the lowest and highest ``trim`` fraction. A step pays every collective's
    expected time, stalls included: the mean, not the median, predicts a sum of many of them;
    the trim drops only rare outliers (a preempted process), not the stalls that come in one
    call of a few."""
    v = sorted(values)
    k = int(len(v) * trim)
    v = v[k : len(v) - k] or v
    return sum(v) / len(v)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Lockstep:
    """Ranks that measure at once, kept on the same op: ``barrier()`` before each op's timed
    samples, ``agree(n)``, every rank's largest count of calls per sample, and ``finished()``,
    called by a rank whose timed samples are over: it returns a poll that is True once every
    rank's are (until then the rank goes on calling the op, so that no rank's samples run beside
    a rank gone idle)."""

    barrier: Callable[[], None]
    agree: Callable[[int], int]
    finished: Callable[[], Callable[[], bool]]


_LOCKSTEP: contextvars.ContextVar[Lockstep | None] = contextvars.ContextVar("lockstep", default=None)


@contextlib.contextmanager
def lockstep(ranks: Lockstep) -> Iterator[None]:
    """Within the block, ``median_time`` and ``_inner_for`` keep the ranks of ``ranks`` together
    (every one of them must run the same measurements in the same order)."""
    token = _LOCKSTEP.set(ranks)
    try:
        yield
    finally:
        _LOCKSTEP.reset(token)


def median_time(fn: Callable[[], object], device: torch.device, repeats: int, inner: int = 1) -> float:
    """Median seconds of one ``fn()`` over ``repeats`` samples of ``inner`` calls, after one call.

    In ``lockstep``, the samples start together on every rank, and a rank whose samples are over
    keeps calling ``fn`` (untimed) until every rank's are: each sample runs with every other rank
    busy, as a step's ranks are from its start to its end. (Ranks that stopped at their last
    sample would leave the slower ranks' last samples the host to themselves, and the figures
    would come out faster than a step runs: ``benchmarks/README.md``.)"""
    fn()
    sync(device)
    ranks = _LOCKSTEP.get()
    if ranks is not None:
        ranks.barrier()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        ts.append((time.perf_counter() - t0) / inner)
    if ranks is not None:
        done = ranks.finished()
        while not done():
            fn()
        sync(device)
    return statistics.median(ts)


def _inner_for(fn: Callable[[], object], device: torch.device, target_s: float = 2e-3) -> int:
    """Calls per sample so that one sample lasts about ``target_s`` (timer resolution, noise); in
    ``lockstep``, the largest of the ranks' counts."""
    t0 = time.perf_counter()
    fn()
    sync(device)
    inner = max(1, min(1000, int(target_s / max(time.perf_counter() - t0, 1e-7))))
    ranks = _LOCKSTEP.get()
    return ranks.agree(inner) if ranks is not None else inner


def measure_launch(device: torch.device, repeats: int, inner: int) -> float:
    x0 = torch.ones(8, device=device, requires_grad=True)
    c = torch.full((8,), 0.999, device=device)

    def chain():  # through the aten overloads, as the generated module calls its ops
        y = x0
        for i in range(LAUNCH_CHAIN_OPS // 3):
            y = aten.tanh.default(aten.add.Tensor(aten.mul.Tensor(y, c), i))
        y.sum().backward()

    return median_time(chain, device, repeats, inner) / (LAUNCH_CHAIN_OPS * 2)


class _OpMix(torch.nn.Module):
    """The op mix of a traced transformer, tiny: what ``measure_graph_launch`` runs."""

    def __init__(self, vocab: int = 16, dim: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        x = x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def measure_graph_launch(device: torch.device, repeats: int, step_overhead: float) -> tuple[float, int]:
    """``(launch, launches)`` of the module docstring: ``_OpMix``'s traced graph, forward and
    backward."""
    import operator

    from autopar.passes.analyze import analyze  # passes import the cost model: not at module level
    from autopar.passes.costs import grad_uses
    from autopar.passes.trace import Role, trace
    from autopar.tools.validate import placeholder_values

    torch.manual_seed(0)
    model = _OpMix().to(device)
    ids = torch.randint(0, 16, (2, 4), device=device)
    labels = torch.randint(0, 16, (2, 4), device=device)
    tg = trace(model, (ids, labels))
    infos = analyze(tg)
    launches = sum(
        1 + infos[n.name].requires_grad
        for n in tg.graph.nodes
        if n.op == "call_function" and n.target is not operator.getitem
    )
    # and backward's sums of gradients from several uses (``accumulate_time``)
    launches += sum(max(u - 1, 0) for u in grad_uses(tg, infos).values())
    args = placeholder_values(tg, (ids, labels), seed=0)  # in the graph's placeholder order
    role = {p.name: p.role for p in tg.placeholders}
    params = [
        a.requires_grad_()
        for a, n in zip(args, tg.graph.find_nodes(op="placeholder"))
        if role[n.name] is Role.PARAM
    ]

    def step():
        torch.utils._pytree.tree_leaves(tg.graph_module(*args))[0].backward()
        for w in params:
            w.grad = None

    t = median_time(step, device, repeats, _inner_for(step, device))
    return max(t - step_overhead, 0.0) / launches, launches


def _add_time(numel: int, device: torch.device, repeats: int) -> float:
    bufs = [torch.ones(numel, device=device) for _ in range(3)]

    def add():
        torch.add(bufs[0], bufs[1], out=bufs[2])

    return median_time(add, device, repeats, _inner_for(add, device))


def _step_bandwidth(nbytes: int, device: torch.device, repeats: int, dispatch: float) -> float:
    """B/s of an elementwise op as a step runs it (see the module docstring)."""
    live = collections.deque(torch.rand(nbytes // 4, device=device) for _ in range(STEP_LIVE))

    def op():
        live.append(torch.mul(live[-3], live[-STEP_LIVE // 2]))
        live.popleft()

    for _ in range(2 * STEP_LIVE):  # every live tensor made by an op, as in a step
        op()
    t = median_time(op, device, repeats, STEP_LIVE)
    return 3 * nbytes / max(t - dispatch, 1e-9)


def _over_step_sizes(bandwidth: Callable, device: torch.device, repeats: int) -> float:
    """The median over ``STEP_SIZES`` of ``bandwidth(nbytes, device, repeats, dispatch)``, with
    ``dispatch`` the time of an ``add`` on one element."""
    dispatch = _add_time(1, device, repeats)
    return statistics.median(bandwidth(n, device, repeats, dispatch) for n in STEP_SIZES)


def measure_memory_bandwidth(device: torch.device, repeats: int = 7) -> float:
    """``mem_bw`` of the module docstring [B/s]: the median over ``STEP_SIZES``."""
    return _over_step_sizes(_step_bandwidth, device, repeats)


def _inplace_bandwidth(nbytes: int, device: torch.device, repeats: int, dispatch: float) -> float:
    """B/s of an in-place update as an optimizer runs it (see the module docstring)."""
    live = [torch.rand(nbytes // 4, device=device) for _ in range(STEP_LIVE)]
    k = 0

    def op():
        nonlocal k
        live[k % STEP_LIVE].add_(live[(k + STEP_LIVE // 2) % STEP_LIVE], alpha=1e-3)
        k += 1

    t = median_time(op, device, repeats, STEP_LIVE)
    return 3 * nbytes / max(t - dispatch, 1e-9)


def measure_inplace_bandwidth(device: torch.device, repeats: int = 7) -> float:
    """``inplace_bw`` of the module docstring [B/s]: the median over ``STEP_SIZES``."""
    return _over_step_sizes(_inplace_bandwidth, device, repeats)


def measure_pointwise(device: torch.device, repeats: int, launch: float) -> dict[str, list[float]]:
    """``{op: [forward, backward] seconds per input element]}`` for ``POINTWISE_OPS``."""
    out: dict[str, list[float]] = {}
    x = (torch.rand(POINTWISE_NUMEL, device=device) + 0.5).requires_grad_(True)
    for name, op in POINTWISE_OPS.items():
        y = op(x)
        g = torch.ones_like(y)

        def fwd(op=op):
            op(x)

        def fwd_bwd(op=op, g=g):
            torch.autograd.backward(op(x), g)

        t_f = median_time(fwd, device, repeats, _inner_for(fwd, device))
        t_fb = median_time(fwd_bwd, device, repeats, _inner_for(fwd_bwd, device))
        x.grad = None
        n = x.numel()
        out[name] = [max(t_f - launch, 0.0) / n, max(t_fb - t_f - launch, 0.0) / n]
    return out


def measure_per_flop(device: torch.device, repeats: int, launch: float) -> dict[str, list[float]]:
    """``{op: [forward, backward] seconds per forward FLOP]}`` for ``PER_FLOP_OPS``."""
    out: dict[str, list[float]] = {}
    for name, (make, call) in PER_FLOP_OPS.items():
        grads, others = make(device)
        grads = [t.requires_grad_(True) for t in grads]
        args = grads + others
        y = call(*args)
        with FlopCounterMode(display=False) as counter:  # on meta, as passes/analyze.py counts a node
            call(*(torch.empty(a.shape, dtype=a.dtype, device="meta") for a in args))
        flops = float(counter.get_total_flops())
        if flops <= 0:
            continue  # this torch counts no FLOPs for the op: the graph's nodes have none either
        g = torch.ones_like(y)

        def fwd(call=call, args=args):
            call(*args)

        def fwd_bwd(call=call, args=args, g=g, grads=grads):
            torch.autograd.backward(call(*args), g)
            for a in grads:
                a.grad = None

        t_f = median_time(fwd, device, repeats, _inner_for(fwd, device))
        t_fb = median_time(fwd_bwd, device, repeats, _inner_for(fwd_bwd, device))
        out[name] = [max(t_f - launch, 0.0) / flops, max(t_fb - t_f - launch, 0.0) / flops]
    return out


def _optimizer_step_time(make, tensors: int, device: torch.device, repeats: int) -> float:
    params = [torch.zeros(8, device=device, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = make(params)
    return median_time(opt.step, device, repeats, _inner_for(opt.step, device))


def measure_optimizer(device: torch.device, repeats: int) -> dict[str, float]:
    """``optimizer_param_s`` of the module docstring: seconds per further parameter tensor."""
    out = {}
    for name, make in OPTIMIZERS.items():
        many = _optimizer_step_time(make, OPT_TENSORS, device, repeats)
        few = _optimizer_step_time(make, 4, device, repeats)
        out[name] = max(many - few, 0.0) / (OPT_TENSORS - 4)
    return out


def measure_step_overhead(device: torch.device, repeats: int, launch: float, sgd_param: float) -> float:
    """``step_overhead_s`` of the module docstring [s]."""
    w = torch.ones(8, device=device, requires_grad=True)
    x = torch.full((8,), 0.5, device=device)
    opt = OPTIMIZERS["SGD"]([w])

    def step():
        (w * x).sum().backward()
        opt.step()
        opt.zero_grad()

    t = median_time(step, device, repeats, _inner_for(step, device))
    return max(t - 4 * launch - sgd_param, 0.0)


def measure_compute(device: torch.device | str = "cpu", quick: bool = False) -> dict:
    """Every compute figure of the module docstring, for ``device``.

    Returns ``{"peak_flops": rate / EFF_MAX, "flops_effective": rate, "memory_bandwidth": ...,
    "inplace_bandwidth": ...,
    "kernel_launch_s": ..., "pointwise_s": {op: [fwd, bwd]}, "per_flop_s": {op: [fwd, bwd]},
    "optimizer_param_s": {name: s}, "step_overhead_s": ..., "matmul": [((m, k, n), flops, seconds), ...],
    "matmul_intercept_s": ...}``; the keys named as DeviceSpec fields are those fields.
    """
    dev = torch.device(device)
    repeats = 3 if quick else 7
    launch = measure_launch(dev, repeats, inner=5 if quick else 20)
    mem_bw = measure_memory_bandwidth(dev, repeats)
    inplace_bw = measure_inplace_bandwidth(dev, repeats)
    points = [
        matmul_sample(shape, dev, repeats) for shape in (MATMUL_SHAPES_QUICK if quick else MATMUL_SHAPES)
    ]
    optimizer = measure_optimizer(dev, repeats)
    overhead = measure_step_overhead(dev, repeats, launch, optimizer["SGD"])
    graph_launch, _ = measure_graph_launch(dev, repeats, overhead)
    kernel_launch = max(graph_launch, launch)
    return {
        **matmul_figures(points, kernel_launch),
        "memory_bandwidth": mem_bw,
        "inplace_bandwidth": inplace_bw,
        "kernel_launch_s": kernel_launch,
        "launch_chain_s": launch,
        "pointwise_s": measure_pointwise(dev, repeats, launch),
        "per_flop_s": measure_per_flop(dev, repeats, launch),
        "optimizer_param_s": optimizer,
        "step_overhead_s": overhead,
    }


def matmul_sample(shape: tuple[int, int, int], device: torch.device, repeats: int) -> tuple:
    """``((m, k, n), F, t)``: ``torch.nn.functional.linear`` of an ``(m, k)`` input and an
    ``(n, k)`` weight, forward and backward (gradients of both), ``F = 3 * 2 m k n`` FLOPs,
    ``t`` its ``median_time``."""
    m, k, n = shape
    x = torch.randn(m, k, device=device, requires_grad=True)
    w = torch.randn(n, k, device=device, requires_grad=True)
    g = torch.randn(m, n, device=device)

    def train() -> None:
        torch.nn.functional.linear(x, w).backward(g)
        x.grad = w.grad = None

    return (shape, 3 * 2.0 * m * k * n, median_time(train, device, repeats))


def matmul_figures(points: list, launch: float) -> dict:
    """The matmul figures of ``measure_compute`` from its samples ``((m, k, n), F, t)`` and the
    device's per-op ``launch``: ``fit_matmul``'s rate (as ``peak_flops = rate / EFF_MAX``),
    intercept and ``D``, and ``matmul_overhead``."""
    rate, intercept, dim_half = fit_matmul(points)
    return {
        "peak_flops": rate / EFF_MAX,
        "flops_effective": rate,
        "matmul": points,
        "matmul_intercept_s": float(intercept),
        "matmul_dim_half": dim_half,
        "matmul_overhead_s": matmul_overhead(intercept, launch),
    }


def matmul_overhead(intercept: float, launch: float) -> float:
    """``DeviceSpec.matmul_overhead_s`` from the fitted intercept ``c`` of a linear's forward and
    backward (``fit_matmul``): three GEMMs, less what the cost model charges that linear beyond
    its FLOPs otherwise (two ``launch``, forward and backward, and three ``T_HALF / EFF_MAX``):
    ``o = max(0, (c - 2 launch - 3 T_HALF / EFF_MAX) / 3)``."""
    return max(0.0, (intercept - 2 * launch - 3 * T_HALF / EFF_MAX) / 3)


def fit_matmul(points: list) -> tuple[float, float, float]:
    """``(rate, c, D)`` of ``t = F / (rate * d / (d + D)) + c`` over matmul samples
    ``((m, k, n), F, t)``, ``d = min(m, k, n)``: for each ``D`` of ``DIM_HALF_GRID`` the line in
    ``x = F (d + D) / d`` of least squared relative error (small and large samples weigh alike),
    with ``c >= 0`` (a fixed cost is not negative: else the line through the origin), and the
    ``D`` whose line has the least error."""
    fl = torch.tensor([p[1] for p in points], dtype=torch.float64)
    ts = torch.tensor([p[2] for p in points], dtype=torch.float64)
    dims = torch.tensor([float(min(p[0])) for p in points], dtype=torch.float64)
    ones = torch.ones_like(ts)
    best = None
    for half in DIM_HALF_GRID:
        x = fl * (dims + half) / dims / ts  # each row divided by its t: relative errors
        design = torch.stack([x, 1 / ts], dim=1)
        slope, c = (float(v) for v in torch.linalg.lstsq(design, ones.unsqueeze(1)).solution.squeeze(1))
        if c < 0:
            slope, c = float(x @ ones / (x @ x)), 0.0
        if not slope > 0:
            continue
        err = float((x * slope + c / ts - 1).pow(2).sum())
        if best is None or err < best[0]:
            best = (err, 1.0 / slope, c, float(half))
    if best is None:  # degenerate fits (noise): the largest matmul's rate, no skinny loss
        return float(fl[-1] / ts[-1]), 0.0, 0.0
    return best[1], best[2], best[3]


def median_compute(figures: Sequence[dict]) -> dict:
    """One ``measure_compute`` result from several ranks': the median of each number and of each
    entry of the per-op tables; the matmul figures fitted once to each shape's median time (the
    fit's rate, intercept and ``D`` trade off, so their medians need not fit together)."""
    out = dict(figures[0])
    for key, value in figures[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(f[key] for f in figures)
        elif isinstance(value, dict):
            out[key] = {
                op: [statistics.median(f[key][op][i] for f in figures) for i in range(len(v))]
                if isinstance(v, (list, tuple))
                else statistics.median(f[key][op] for f in figures)
                for op, v in value.items()
            }
    if all(f.get("matmul") for f in figures):
        shapes = [(p[0], p[1]) for p in figures[0]["matmul"]]
        pooled = [
            (mkn, fl, statistics.median(f["matmul"][i][2] for f in figures))
            for i, (mkn, fl) in enumerate(shapes)
        ]
        out.update(matmul_figures(pooled, out["kernel_launch_s"]))
    return out
