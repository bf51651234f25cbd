"""``kernels/cross_entropy.py``: the output projection and cross-entropy fused in chunks of rows.

Against eager ``F.cross_entropy((h @ w.T).float(), labels, ...)``, loss and gradients of ``h`` and
``w``: fp32 tight (rtol 1e-5), bf16 at bf16's precision, on both backends (Triton through its
interpreter on CPU, and the torch fallback), reductions mean and sum, ignored rows, chunks that do
not divide the rows, a vocabulary that is not a power of two; hypothesis over shapes. On meta
tensors, forward and backward (the backward is an op with a fake implementation) and their FLOPs.
Peak memory against eager, measured by a dispatch mode that follows every storage's life. The
vocabulary-parallel form on 2 and 4 gloo ranks equals the single-device eager loss and gradients.
"""

from __future__ import annotations

import os
import weakref

import pytest
import torch
import torch.nn.functional as F
from harness import labelled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from autopar.kernels import cross_entropy as CE
from autopar.kernels.dispatch import ENV
from autopar.launch import run_on_ranks

IGNORE = -100
BACKENDS = ("triton", "torch")
# bf16 inputs: eager and the op both project in bf16; the chunked mm, the order of the softmax's
# sums and the fp32 accumulation of grad_weight (eager: one bf16 mm) differ by bf16's rounding
TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 1e-2)}  # (rtol, atol as a fraction of max|ref|)


def _inputs(n, hidden, v, dtype=torch.float32, seed=0, ignored_every=4):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(v, hidden, generator=g) / hidden**0.5).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    if ignored_every:
        labels[::ignored_every] = IGNORE
    return h, w, labels


def _eager(h, w, labels, reduction):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = F.cross_entropy((h @ w.T).float(), labels, ignore_index=IGNORE, reduction=reduction)
    return (loss.detach(), *torch.autograd.grad(loss, [h, w]))


def _fused(h, w, labels, reduction, chunk_rows):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss, lse = torch.ops.autopar.linear_cross_entropy(h, w, labels, IGNORE, reduction, chunk_rows)
    # the second output: each row's log-sum-exp, what the backward reads instead of recomputing it
    torch.testing.assert_close(lse, torch.logsumexp((h @ w.T).float(), 1).detach(), rtol=1e-5, atol=1e-5)
    return (loss.detach(), *torch.autograd.grad(loss, [h, w]))


def _assert_matches(got, ref, dtype, label=""):
    rtol, atol = TOL[dtype]
    for name, a, b in zip(("loss", "grad h", "grad w"), got, ref):
        assert a.dtype == b.dtype, (name, a.dtype, b.dtype)
        scale = b.abs().nan_to_num().max().item() if b.numel() else 0.0
        torch.testing.assert_close(
            a, b, rtol=rtol, atol=atol * scale, equal_nan=True, msg=labelled(f"{label} {name}")
        )


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv(ENV, request.param)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_matches_eager_forward_and_backward(backend, dtype, reduction):
    # 45 rows in chunks of 16 (the last one 13), V = 333, every 4th label ignored
    h, w, labels = _inputs(45, 24, 333, dtype)
    _assert_matches(_fused(h, w, labels, reduction, 16), _eager(h, w, labels, reduction), dtype)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_every_label_ignored_is_torchs_nan_or_zero(backend, reduction):
    h, w, labels = _inputs(6, 4, 10)
    labels[:] = IGNORE
    got, ref = _fused(h, w, labels, reduction, 4), _eager(h, w, labels, reduction)
    assert torch.isnan(ref[0]) if reduction == "mean" else ref[0] == 0  # torch's own answer: 0/0, 0
    _assert_matches(got, ref, torch.float32)
    assert not got[1].any() and not got[2].any()


def test_an_ignore_index_inside_the_vocabulary(backend):
    h, w, labels = _inputs(20, 8, 50, ignored_every=0)
    labels[::3] = 7  # class 7 is ignored where it is the label
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    ref = F.cross_entropy((h2 @ w2.T).float(), labels, ignore_index=7)
    ref = (ref.detach(), *torch.autograd.grad(ref, [h2, w2]))
    h3, w3 = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = torch.ops.autopar.linear_cross_entropy(h3, w3, labels, 7, "mean", 6)[0]
    _assert_matches((loss.detach(), *torch.autograd.grad(loss, [h3, w3])), ref, torch.float32)


def test_a_gradient_through_lse_is_added(backend):
    # nobody differentiates lse in practice; where one does, d lse_i / d z_i = softmax(z_i)
    h, w, labels = _inputs(21, 8, 70)
    r = torch.randn(21, generator=torch.Generator().manual_seed(1))
    h1, w1 = h.detach().requires_grad_(), w.detach().requires_grad_()
    z = (h1 @ w1.T).float()
    ref = F.cross_entropy(z, labels, ignore_index=IGNORE, reduction="sum") + (torch.logsumexp(z, 1) * r).sum()
    ref = (ref.detach(), *torch.autograd.grad(ref, [h1, w1]))
    h2, w2 = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss, lse = torch.ops.autopar.linear_cross_entropy(h2, w2, labels, IGNORE, "sum", 8)
    got = loss + (lse * r).sum()
    _assert_matches((got.detach(), *torch.autograd.grad(got, [h2, w2])), ref, torch.float32)


def _hypothesis(examples):
    return settings(
        max_examples=examples, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )


@st.composite
def _shapes(draw):
    n = draw(st.integers(1, 40))
    # at most 4 chunks (the Triton interpreter pays per launch); 0 = the automatic choice
    chunk = draw(st.one_of(st.just(0), st.integers(-(-n // 4), n + 3)))
    return (
        n,
        draw(st.integers(1, 12)),
        draw(st.integers(2, 300)),
        chunk,
        draw(st.sampled_from(["mean", "sum"])),
        draw(st.integers(0, 5)),
        draw(st.integers(0, 2**16)),
    )


def _check_shape(backend, shape):
    n, hidden, v, chunk, reduction, ignored_every, seed = shape
    with pytest.MonkeyPatch.context() as mp:  # hypothesis reruns the body: no function-scoped fixture
        mp.setenv(ENV, backend)
        h, w, labels = _inputs(n, hidden, v, seed=seed, ignored_every=ignored_every)
        _assert_matches(
            _fused(h, w, labels, reduction, chunk), _eager(h, w, labels, reduction), torch.float32
        )


@given(shape=_shapes())
@_hypothesis(12)
def test_matches_eager_on_any_shape_torch(shape):
    _check_shape("torch", shape)


@given(shape=_shapes())
@_hypothesis(5)  # the interpreter: ~0.1 s a kernel launch
def test_matches_eager_on_any_shape_triton(shape):
    _check_shape("triton", shape)


def test_chunk_rows_chosen_from_the_byte_budget(monkeypatch):
    v = 128256
    rows = CE.chunk_rows_for(10**6, v, 0)
    assert rows * v * 4 <= CE.CHUNK_BYTES < (rows + 1) * v * 4
    # the backward's vocabulary blocks: the same budget, [N, block] fp32, in multiples of 128
    assert CE.vocab_rows_for(8192, v, 0) == 32768 and CE.vocab_rows_for(10**6, v, 0) == 256
    assert CE.vocab_rows_for(45, 333, 16) == 118 and CE.vocab_rows_for(10, 5, 0) == 5
    assert CE.vocab_rows_for(10**12, v, 0) == 1
    assert CE.chunk_rows_for(7, v, 0) == 7 and CE.chunk_rows_for(7, 10**12, 0) == 1
    assert CE.chunk_rows_for(100, v, 30) == 30
    # a budget of 3 rows of fp32 logits: the automatic choice chunks, and still matches eager
    monkeypatch.setenv(ENV, "torch")
    monkeypatch.setattr(CE, "CHUNK_BYTES", 3 * 50 * 4)
    h, w, labels = _inputs(10, 8, 50)
    hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
    with _Counting() as mms:
        torch.autograd.grad(torch.ops.autopar.linear_cross_entropy(hg, wg, labels)[0], [hg, wg])
    # forward: 4 chunks of rows (3+3+3+1); backward: 4 blocks of 15 vocabulary entries (15+15+15+5),
    # 3 matmuls each
    assert mms.count == 4 + 4 * 3
    _assert_matches(_fused(h, w, labels, "mean", 0), _eager(h, w, labels, "mean"), torch.float32)


class _Counting(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm_.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@torch.library.register_torch_dispatch("autopar::linear_cross_entropy", _Counting)
def _count_inside_forward(mode, func, types, args, kwargs):
    with mode:  # the op's own aten calls, which the mode would otherwise see as one call
        return CE._loss(*args, **kwargs)


@torch.library.register_torch_dispatch("autopar::linear_cross_entropy_backward", _Counting)
def _count_inside_backward(mode, func, types, args, kwargs):
    with mode:
        return CE._grads(*args, **kwargs)


@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)], ids=["both", "h", "w"])
def test_meta_forward_backward_and_flops(need):
    n, hidden, v = 4096, 512, 128256  # no memory: shapes only
    h = torch.empty(n, hidden, device="meta", dtype=torch.bfloat16, requires_grad=need[0])
    w = torch.empty(v, hidden, device="meta", dtype=torch.bfloat16, requires_grad=need[1])
    labels = torch.empty(n, device="meta", dtype=torch.long)
    with FlopCounterMode(display=False) as flops:
        loss, lse = torch.ops.autopar.linear_cross_entropy(h, w, labels)
        grads = torch.autograd.grad(loss, [t for t in (h, w) if t.requires_grad])
    assert loss.shape == () and loss.dtype == torch.float32 and loss.device.type == "meta"
    assert lse.shape == (n,) and lse.dtype == torch.float32
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (h, w) if t.requires_grad]
    # forward 2NHV; backward: the recomputed projection and one 2NHV matmul per needed gradient
    assert flops.get_total_flops() == 2 * n * hidden * v * (2 + sum(need))


def test_opcheck(monkeypatch):
    monkeypatch.setenv(ENV, "torch")
    h, w, labels = _inputs(9, 4, 13)
    h.requires_grad_()
    w.requires_grad_()
    torch.library.opcheck(torch.ops.autopar.linear_cross_entropy.default, (h, w, labels, IGNORE, "sum", 4))


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long)), "flatten"),
        ((torch.zeros(2, 4), torch.zeros(5, 3), torch.zeros(2, dtype=torch.long)), "disagree"),
        ((torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2)), "integer"),
    ],
)
def test_bad_inputs_are_named(args, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.autopar.linear_cross_entropy(*args)


def test_bad_reduction_is_named():
    h, w, labels = _inputs(3, 4, 5)
    with pytest.raises(ValueError, match="reduction='none'"):
        torch.ops.autopar.linear_cross_entropy(h, w, labels, IGNORE, "none", 0)


# --- memory ------------------------------------------------------------------------------------


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages allocated under it and still alive (a weakref finalizer per tensor
    wrapper of a storage; views share it), and their peak. Storages of ``existing`` tensors (the
    inputs) are not counted, whatever views of them are made."""

    def __init__(self, existing):
        super().__init__()
        self.old = {t.untyped_storage()._cdata for t in existing}
        self.refs, self.sizes = {}, {}
        self.live = self.peak = 0

    def _release(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def track(self, out):
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.old:
                key = t.untyped_storage()._cdata
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                    self.live += self.sizes[key]
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(out)
        return out


@torch.library.register_torch_dispatch("autopar::linear_cross_entropy", _LiveBytes)
def _live_inside_forward(mode, func, types, args, kwargs):
    with mode:  # every allocation inside the op, not its output alone
        return CE._loss(*args, **kwargs)


@torch.library.register_torch_dispatch("autopar::linear_cross_entropy_backward", _LiveBytes)
def _live_inside_backward(mode, func, types, args, kwargs):
    with mode:
        return CE._grads(*args, **kwargs)


def _peak_bytes(step, h, w, labels) -> int:
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    with _LiveBytes([h, w, labels]) as mode:
        loss = step(h, w, labels)
        grads = torch.autograd.grad(loss, [h, w])
        del loss, grads
    return mode.peak


def test_peak_memory_is_a_fraction_of_eagers(monkeypatch):
    monkeypatch.setenv(ENV, "torch")  # what CPU tensors run (AUTOPAR_KERNELS=auto)
    n, hidden, v, chunk = 2048, 64, 8192, 256
    h, w, labels = _inputs(n, hidden, v)
    eager = _peak_bytes(
        lambda h, w, y: F.cross_entropy((h @ w.T).float(), y, ignore_index=IGNORE), h, w, labels
    )
    fused = _peak_bytes(
        lambda h, w, y: torch.ops.autopar.linear_cross_entropy(h, w, y, IGNORE, "mean", chunk)[0],
        h,
        w,
        labels,
    )
    logits, chunk_logits = 4 * n * v, 4 * chunk * v  # fp32 bytes
    grads = 4 * (n + v) * hidden
    # eager's backward holds the log-probabilities (saved), their gradient and the logits' at once
    assert eager >= 3 * logits
    # the op: forward, a chunk's logits and the logsumexp's temporary of the same size; backward, a
    # vocabulary block's logits (as many: [N, cV/N]) and the gradients (no [V, H] fp32 accumulator)
    assert fused <= 2 * chunk_logits + grads + 2**20
    ratio = eager / fused
    # the floor these derive, 3 * 4NV / (2 * 4cV + grads + 1 MiB): 192 / 19.5 MiB ~ 9.8 here (measured:
    # eager 192.0 MiB, fused 16.0 MiB, the forward's two chunk-sized buffers: 12.0); the bar is 4
    assert ratio >= 4, f"eager peak {eager / 2**20:.1f} MiB, fused {fused / 2**20:.1f} MiB: ratio {ratio:.2f}"


# --- vocabulary-parallel, on gloo ranks --------------------------------------------------------


# (name, n, hidden, v, chunk_rows, reduction, ignored_every, backend); V = 301 shards unevenly
VP_CASES = [
    ("mean", 37, 16, 320, 10, "mean", 4, "torch"),
    ("sum", 37, 16, 320, 0, "sum", 3, "torch"),
    ("uneven shards", 20, 8, 301, 7, "mean", 5, "torch"),
    ("triton", 20, 8, 256, 8, "mean", 4, "triton"),
]


def _shard(v: int, world: int, rank: int) -> tuple[int, int]:
    base, extra = divmod(v, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _vp_rank(rank, world, cases):
    import torch.distributed as dist

    # world 4 also as a 2 x 2 mesh, rank = 2 a + b, the vocabulary split over both axes: shard
    # 2 a + b = the rank's own, the all-reduces over the b-groups ([0, 1], [2, 3]) then the a-groups
    groups = {"world": dist.group.WORLD}
    if world == 4:
        along_b = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        along_a = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups["mesh 2x2"] = (along_b[rank // 2], along_a[rank % 2])
    out = {}
    for gname, group in groups.items():
        for name, n, hidden, v, chunk, reduction, ignored_every, backend in cases:
            if gname != "world" and backend != "torch":
                continue  # the groups are the collectives' business: one backend is enough
            os.environ[ENV] = backend
            h, w, labels = _inputs(n, hidden, v, ignored_every=ignored_every)
            start, end = _shard(v, world, rank)
            h = h.requires_grad_()
            shard = w[start:end].clone().requires_grad_()
            loss = CE.vocab_parallel_linear_cross_entropy(
                h, shard, labels, start, group, IGNORE, reduction, chunk
            )
            loss.backward()
            # each rank's own share of h's gradient: summed here, as the "f" on h does in autopar's code
            grad_h = h.grad.clone()
            dist.all_reduce(grad_h, group=dist.group.WORLD)
            out[gname, name] = (loss.detach(), grad_h, shard.grad, h.grad)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_single_device_eager(world):
    results = run_on_ranks(_vp_rank, world, VP_CASES, timeout_s=240)
    for name, n, hidden, v, _, reduction, ignored_every, _ in VP_CASES:
        h, w, labels = _inputs(n, hidden, v, ignored_every=ignored_every)
        loss, grad_h, grad_w = _eager(h, w, labels, reduction)
        for rank, res in enumerate(results):
            start, end = _shard(v, world, rank)
            for gname in ("world", "mesh 2x2") if world == 4 else ("world",):
                if (gname, name) not in res:
                    assert gname != "world" and name == "triton", (gname, name)
                    continue
                got_loss, got_h, got_w, own_h = res[gname, name]
                label = f"world {world} ({gname}) rank {rank} {name}"
                # the full loss on every rank; h's gradient once the ranks' shares are summed
                _assert_matches(
                    (got_loss, got_h, got_w), (loss, grad_h, grad_w[start:end]), torch.float32, label
                )
                # a share, not the sum: the caller's all-reduce (codegen's "f") must not be doubled
                assert not torch.allclose(own_h, grad_h), label


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cuda_compiled_triton_matches_eager(reduction, monkeypatch):
    """The compiled kernel on CUDA at a model-sized vocabulary (not a power of two, several chunks
    and vocabulary blocks) against eager cross-entropy on the same tensors: loss and both
    gradients, bf16 inputs."""
    monkeypatch.setenv(ENV, "triton")
    h, w, labels = (t.cuda() for t in _inputs(3000, 512, 50257, torch.bfloat16, seed=5))
    hg, wg = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss, _ = torch.ops.autopar.linear_cross_entropy(hg, wg, labels, IGNORE, reduction, 700)
    got = (loss.detach(), *torch.autograd.grad(loss, [hg, wg]))
    _assert_matches(got, _eager(h, w, labels, reduction), torch.bfloat16, f"cuda {reduction}")


def test_under_autocast_both_passes_project_in_the_half_type_as_eager_does(monkeypatch):
    """The generated code's fused loss under ``torch.autocast`` (fp32 masters, as the module runs
    mixed precision): its forward's and its backward's projections run in bf16, as eager's
    ``F.linear`` under autocast does, and loss and gradients (fp32, to the masters) equal eager's at
    bf16's precision. Without the operands' cast the backward, which autocast does not reach,
    projected in fp32."""
    from autopar.codegen import local_ops as L

    seen = []
    project = CE._project

    def recording(h_chunk, weight, triton):
        seen.append((h_chunk.dtype, weight.dtype))
        return project(h_chunk, weight, triton)

    monkeypatch.setattr(CE, "_project", recording)
    h, w, labels = _inputs(24, 16, 40)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = L.linear_cross_entropy(h1, w1, labels, IGNORE, "mean", 5)[0]
        want = F.cross_entropy(F.linear(h2, w2).float(), labels, ignore_index=IGNORE)
    got.backward()
    want.backward()
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}, seen
    assert h1.grad.dtype == w1.grad.dtype == torch.float32
    rtol, atol = TOL[torch.bfloat16]
    for a, b in ((got, want), (h1.grad, h2.grad), (w1.grad, w2.grad)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * b.abs().max().item())
