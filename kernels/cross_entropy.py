r"""Cross-entropy fused with the output projection, in chunks of rows, and its vocabulary-parallel form.

The language-model head and its loss, ``F.cross_entropy((h @ weight.T).float(), labels)``, with
``h`` ``[N, H]`` (N = batch x sequence tokens), ``weight`` ``[V, H]`` and labels ``[N]``:

.. math::

    z = h W^\top,\qquad \mathrm{lse}_i = \log \sum_v e^{z_{iv}},\qquad
    \ell_i = \mathrm{lse}_i - z_{i, y_i},\qquad
    L = \frac{1}{|\{i : y_i \ne \mathrm{ignore}\}|} \sum_{i : y_i \ne \mathrm{ignore}} \ell_i
    \ \text{(mean; sum: no division)}

    \frac{\partial L}{\partial z_i} = s\,(\mathrm{softmax}(z_i) - \mathrm{onehot}(y_i))
    \ \text{($0$ on ignored rows)},\quad
    s = \frac{g}{\mathrm{count}}\ \text{(mean)},\ g\ \text{(sum)},

    \nabla h = \frac{\partial L}{\partial z} W,\qquad
    \nabla W = \Big(\frac{\partial L}{\partial z}\Big)^{\!\top} h

with ``g`` the loss's incoming gradient and ``count`` the number of rows not ignored.

Memory. Eager materializes ``z`` (``N V e`` bytes, ``e`` the input's element size, then
``.float()``: ``4 N V`` more where ``e < 4``), keeps the fp32 log-probabilities (``4 N V``) for
backward, and its backward holds the fp32 gradients of the log-probabilities and of the logits
(``4 N V`` each) at once: ``12 N V`` bytes at its peak (fp32: measured exactly so by the tests),
4.2 GB per ``4 N V`` for N = 8192 tokens and Llama 3's V = 128256. Every row's loss needs only that
row's logits, so here ``chunk_rows`` rows at a time are projected, reduced and dropped: the logits
never exist beyond one chunk, ``c V e`` bytes (``c = chunk_rows``; the Triton kernels read the mm's
output in place, ``.to(float32)`` on load, the values ``.float()`` gives) or ``c V (e + 4)`` and a
``4 c V`` temporary with the torch ops. ``chunk_rows = 0`` picks ``c`` so that a chunk's fp32 logits
stay under ``CHUNK_BYTES``.

Backward strategy (recompute; the search prices it: ``flop_counter`` formulas below). The op
returns ``(loss, lse)``, ``lse`` the fp32 ``[N]`` log-sum-exp per row the forward computes anyway:
callers use output 0; ``lse`` is an output so that autograd saves it (``4 N`` bytes) with ``h``,
``weight`` and ``labels`` (the op's inputs, alive anyway) and the backward need not recompute it.
Its gradient, zeros or ``None`` in practice (nobody differentiates it), is honoured all the same:
``d lse_i / d z_i = softmax(z_i)``, one more term. The backward loops over **blocks of the
vocabulary** (``Vb`` rows of ``weight``, as many logits as one forward chunk: ``vocab_rows_for``,
``N Vb`` fp32 under ``CHUNK_BYTES``, a multiple of 128): the block's logits ``h W_blk^T``
(``[N, Vb]``, recomputed: one extra ``2 N H V`` over the blocks, backward ``6 N H V`` against
eager's ``4 N H V``) become their gradient in place (Triton; torch ops: through an fp32 copy),
``dz_blk = a * softmax - b * onehot`` (``b`` the loss's scale per row, 0 on ignored rows, ``a = b +
grad_lse``); the block's rows of ``grad_weight`` are complete at once, ``dz_blk^T h`` written in
``weight.dtype`` (no ``[V, H]`` fp32 accumulator), and ``grad_h`` sums ``dz_blk W_blk`` in an fp32
``[N, H]`` buffer (by the GEMM itself on CUDA, ``FP32_OUT_MM``, else through an ``N H e`` product),
cast to ``h.dtype`` at the end. Backward working set, above the inputs:

.. math::

    N V_b e\ (\text{block logits; } + 4 N V_b \text{ with the torch ops, } e < 4)
    + 4 N H\ (\text{grad\_h, fp32}) + V H e\ (\text{grad\_weight}) + N H e\ (\text{product, no fp32-out GEMM})

and at the end ``4 N H + V H e + N H e`` (the cast ``grad_h``). On an H100, N = 8192, H = 4096,
V = 128256, bf16 (``Vb`` = 32768, 4 blocks): 512 MiB + 128 MiB + 1002 MiB (+ 64 MiB) = 1.60 GiB
(1.67 GiB), the backward's, above the forward's 2092-row chunk (512 MiB): expected peak 1.6-1.7 GiB
against eager's 11.74 GiB (7x; measured 1642 MiB against 12024 MiB: ``benchmarks/bench_kernels.py``
in benchmarks/README.md). Row chunks with an fp32 ``[V, H]`` accumulator for ``grad_weight``
instead hold 3.46 GiB and take 54.6 ms against eager's 51.1 ms. The alternative
(Liger-kernel's: both gradients computed during the forward and kept) holds ``N H e + 4 V H``
bytes from forward to backward, a weight's worth per loss, to save the recomputing matmul.

``torch.ops.autopar.linear_cross_entropy(h, weight, labels, ignore_index=-100, reduction="mean",
chunk_rows=0) -> (loss, lse)``: the 0-dim fp32 loss; reductions ``mean`` (over non-ignored labels:
all ignored gives nan, 0/0, as torch's) and ``sum``. The matmuls are torch's (``torch.mm`` in the
input dtype, as eager's); the per-chunk log-sum-exp, target logit and softmax-minus-one-hot are a
Triton kernel where ``use_triton(h)`` (``kernels/_triton_cross_entropy.py``), else torch ops. The
backward is itself an op, ``torch.ops.autopar.linear_cross_entropy_backward(grad_loss, grad_lse,
h, weight, labels, lse, ignore_index, reduction, chunk_rows, need_grad_h, need_grad_weight) ->
(grad_h, grad_weight)``, with a fake implementation, so forward and backward run on meta tensors.

``vocab_parallel_linear_cross_entropy``: the same loss where each rank of ``group`` holds the rows
``[vocab_start, vocab_start + V / n)`` of ``weight`` (Megatron's vocabulary-parallel cross-entropy).
Per chunk, forward: local logits, their log-sum-exp ``lse_r`` and the target logit where the label
falls in the shard (0 elsewhere), then **2 all-reduces**: MAX of ``lse_r`` (``m``, a stabilizing
shift; any upper-ish bound of the row max works, and ``lse_r >= max_r``), and one SUM of the stacked
``[exp(lse_r - m), target_r]`` (``2 * rows`` fp32): ``lse = m + log(sum)``, the target logit from
the one rank holding it. The three reductions the textbook form names (row max, sum of exponentials,
target logit) are two collectives: the sums share one. Backward: no collective at all (the global ``lse``, ``4 N`` bytes, is saved from
forward, with ``h``, the shard and the labels): each rank gets its own ``grad_weight`` shard and
**its own share of** ``grad_h`` (its vocabulary's ``dz W_r``), **not** summed over the group: the
caller sums the shares. In autopar's generated code ``h`` is a Replicate input of an op split over
the axis, so codegen puts Megatron's "f" on it (identity forward, all-reduce of the gradient
backward), which does that sum; summing here too would double it. ``group`` may be a sequence of
process groups (a vocabulary split over several mesh axes): each all-reduce runs over every group
in turn (max then max, sum then sum). The loss is the full loss on every rank (not a partial one),
so every rank's ``loss.backward()`` seeds it with the same gradient.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from autopar.kernels.dispatch import use_triton

# a chunk's fp32 logits stay under this many bytes when chunk_rows = 0: rows = CHUNK_BYTES // (4 V).
CHUNK_BYTES = 2**30  # Llama 3's V = 128256: 2092 rows (measured against 256 MiB: module docstring)
REDUCTIONS = ("mean", "sum")


def chunk_rows_for(n: int, v: int, chunk_rows: int) -> int:
    """The rows of one chunk: ``chunk_rows``, or (0) as many as keep ``rows * v`` fp32 logits under
    ``CHUNK_BYTES``, at least 1, at most ``n``."""
    if chunk_rows < 0:
        raise ValueError(f"chunk_rows={chunk_rows}: a number of rows, or 0 to choose it from CHUNK_BYTES")
    rows = chunk_rows or CHUNK_BYTES // (4 * max(v, 1))
    return max(1, min(rows, n))


def autocast_operands(h: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``h`` and ``weight`` in the dtype autocast runs a linear in, where autocast is on for their
    device; as they are elsewhere. The fused op is a custom op and its backward an autograd
    function's, which autocast does not reach: called on fp32 masters under autocast its forward's
    matmuls would run in the half type and its backward's in fp32. Cast first, as eager's
    ``F.linear`` under autocast casts them, both run in the half type (the logits reduced in fp32
    either way), and the casts' backward hands fp32 gradients to the masters."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
        return h.to(dtype), weight.to(dtype)
    return h, weight


def _chunks(n: int, rows: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, rows):
        yield start, min(start + rows, n)


def _check(h: Tensor, weight: Tensor, labels: Tensor, reduction: str, chunk_rows: int) -> None:
    if h.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"linear_cross_entropy takes h [N, H], weight [V, H], labels [N]: got h {tuple(h.shape)}, "
            f"weight {tuple(weight.shape)}, labels {tuple(labels.shape)} (flatten the leading dims)"
        )
    if h.shape[1] != weight.shape[1] or h.shape[0] != labels.shape[0]:
        raise ValueError(
            f"linear_cross_entropy: h {tuple(h.shape)}, weight {tuple(weight.shape)} and labels "
            f"{tuple(labels.shape)} disagree (h [N, H], weight [V, H], labels [N])"
        )
    if h.dtype != weight.dtype:
        raise ValueError(f"linear_cross_entropy: h is {h.dtype}, weight {weight.dtype}: cast one")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"linear_cross_entropy: labels are class ids (an integer dtype), not {labels.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction={reduction!r}, one of {REDUCTIONS}")
    if chunk_rows < 0:
        raise ValueError(f"chunk_rows={chunk_rows}: a number of rows, or 0 to choose it from CHUNK_BYTES")


# --- one chunk: torch ops or the Triton kernel ---------------------------------------------------


def _hit(labels: Tensor, vocab_start: int, v: int, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(whether a row's label is in ``[vocab_start, vocab_start + v)`` and not ignored, its column)."""
    local = labels - vocab_start
    hit = (labels != ignore_index) & (local >= 0) & (local < v)
    return hit, torch.where(hit, local, 0)


def _lse_target(
    logits: Tensor, labels: Tensor, vocab_start: int, ignore_index: int, triton: bool
) -> tuple[Tensor, Tensor]:
    """Per row of the fp32 chunk ``logits`` ``[rows, v]``: (log-sum-exp, the label's logit where the
    label is in this vocabulary (``vocab_start`` on) and not ignored, else 0)."""
    if triton:
        from autopar.kernels import _triton_cross_entropy as K

        return K.lse_target(logits, labels, vocab_start, ignore_index)
    hit, col = _hit(labels, vocab_start, logits.shape[1], ignore_index)
    target = logits.gather(1, col.unsqueeze(1)).squeeze(1)
    return torch.logsumexp(logits, dim=1), torch.where(hit, target, 0.0)


def _softmax_grad(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    coef_softmax: Tensor,
    coef_onehot: Tensor,
    vocab_start: int,
    out: Tensor,
    triton: bool,
) -> Tensor:
    """``out = a * exp(logits - lse) - b * onehot(label - vocab_start)`` per row (``a``, ``b`` the
    fp32 ``[rows]`` coefficients: ``_row_coefficients``), in ``out``'s dtype; ``logits`` (fp32
    ``[rows, v]``, global columns ``vocab_start`` on) is overwritten (``out`` may be ``logits``)."""
    if triton:
        from autopar.kernels import _triton_cross_entropy as K

        return K.softmax_grad(logits, labels, lse, coef_softmax, coef_onehot, vocab_start, out)
    g = logits.sub_(lse.unsqueeze(1)).exp_().mul_(coef_softmax.unsqueeze(1))
    local = labels - vocab_start
    hit = (local >= 0) & (local < logits.shape[1])
    g.scatter_add_(1, torch.where(hit, local, 0).unsqueeze(1), -(coef_onehot * hit).unsqueeze(1))
    if out is not g:
        out.copy_(g)
    return out


def _project(h_chunk: Tensor, weight: Tensor, triton: bool) -> tuple[Tensor, Tensor]:
    """(the chunk's logits in the input dtype, as eager's mm makes them; the logits the reductions
    read: the same tensor for the Triton kernels, which load it ``.to(float32)``, the values
    ``.float()`` gives, with no fp32 copy; its ``.float()`` for the torch ops)."""
    low = torch.mm(h_chunk, weight.t())
    return low, low if triton else low.float()


# ``torch.addmm(..., out_dtype=torch.float32)``: a bf16/fp16 product accumulated into an fp32
# tensor by the GEMM itself (CUDA): no product in the input dtype (``N H e`` bytes) written, read
# back and added. Elsewhere, or where the running torch lacks it, the product and an in-place add.
FP32_OUT_MM = True


def _accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b``, ``acc`` fp32, ``a`` and ``b`` in the input dtype."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif FP32_OUT_MM and acc.is_cuda and "dtype_out" in torch.ops.aten.addmm.overloads():
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # the product in the input dtype, as eager's, summed in fp32 (no fp32 copy of it)
        acc.add_(torch.mm(a, b))


def _reduce(total: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    return total / (labels != ignore_index).sum() if reduction == "mean" else total


def _row_coefficients(
    grad_loss: Tensor, grad_lse: Tensor | None, labels: Tensor, ignore_index: int, reduction: str
) -> tuple[Tensor, Tensor]:
    """fp32 ``[N]`` (a, b) of ``dz_i = a_i softmax(z_i) - b_i onehot(y_i)``: ``b_i = s`` (the loss's
    gradient per row: ``g / count`` for mean, ``g`` for sum; 0 on ignored rows, even where ``s`` is
    inf, a mean over none) and ``a_i = b_i + grad_lse_i`` (``d lse_i / d z_i = softmax(z_i)``).
    No host sync."""
    valid = labels != ignore_index
    g = grad_loss.float()
    s = g / valid.sum() if reduction == "mean" else g
    b = torch.where(valid, s, 0.0)
    return (b if grad_lse is None else b + grad_lse.float()), b


def _backward_blocks(
    grad_loss: Tensor,
    grad_lse: Tensor | None,
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    lse: Tensor,
    vocab_start: int,
    ignore_index: int,
    reduction: str,
    block: int,
    need_h: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor]:
    """The backward of both forms, over blocks of ``block`` rows of ``weight`` (vocabulary entries),
    with ``lse`` the saved (global) log-sum-exp per row: each block's logits ``[N, block]`` are
    recomputed and turned into their gradient in place; that block's rows of ``grad_weight`` are
    complete at once (written in ``weight.dtype``, no accumulator), ``grad_h`` sums every block's
    ``dz W_blk`` in an fp32 ``[N, H]`` buffer, cast to ``h.dtype`` at the end."""
    triton = use_triton(h)
    coef_softmax, coef_onehot = _row_coefficients(grad_loss, grad_lse, labels, ignore_index, reduction)
    v = weight.shape[0]
    grad_weight = torch.zeros_like(weight) if need_weight else weight.new_empty(0)
    acc = None
    if need_h:
        acc = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    if need_h or need_weight:
        for start, end in _chunks(v, block):
            w_blk = weight[start:end]
            low, logits = _project(h, w_blk, triton)
            g = _softmax_grad(
                logits, labels, lse, coef_softmax, coef_onehot, vocab_start + start, low, triton
            )
            del logits  # an fp32 copy (torch ops, low precision): the gradient lives in the mm's output
            if need_weight:
                torch.mm(g.t(), h, out=grad_weight[start:end])
            if need_h:
                _accumulate_mm(acc, g, w_blk)
            del low, g
    grad_h = acc.to(h.dtype) if need_h else h.new_empty(0)  # fp32 h: the accumulator itself
    return grad_h, grad_weight


def vocab_rows_for(n: int, v: int, chunk_rows: int) -> int:
    """The vocabulary entries of one backward block: as many logits as one forward chunk holds
    (``chunk_rows * v``, or with 0 ``CHUNK_BYTES`` of fp32), ``// n`` rows each; a multiple of 128
    where that is at least 128 (aligned GEMM tiles); at least 1, at most ``v``."""
    budget = chunk_rows * v if chunk_rows else CHUNK_BYTES // 4
    block = budget // max(n, 1)
    if block >= 128:
        block -= block % 128
    return max(1, min(block, v))


# --- the single-device op -------------------------------------------------------------------------


@torch.library.custom_op("autopar::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int = 0,
) -> tuple[Tensor, Tensor]:
    """``F.cross_entropy((h @ weight.T).float(), labels, ignore_index=, reduction=)`` without the
    ``[N, V]`` logits: ``chunk_rows`` rows at a time (module docstring). Returns ``(loss, lse)``:
    the 0-dim fp32 loss, which callers use (output 0), and the fp32 ``[N]`` log-sum-exp per row,
    computed on the way, an output so that autograd saves it for the backward, which then need not
    recompute it (differentiable: ``d lse_i / d z_i = softmax(z_i)``)."""
    return _loss(h, weight, labels, ignore_index, reduction, chunk_rows)


def _loss(
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int = 0,
) -> tuple[Tensor, Tensor]:
    """The forward op's implementation (also what a test runs to see its allocations)."""
    _check(h, weight, labels, reduction, chunk_rows)
    triton = use_triton(h)
    rows = chunk_rows_for(h.shape[0], weight.shape[0], chunk_rows)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    for start, end in _chunks(h.shape[0], rows):
        _, logits = _project(h[start:end], weight, triton)
        lab = labels[start:end]
        chunk_lse, target = _lse_target(logits, lab, 0, ignore_index, triton)
        del logits
        lse[start:end] = chunk_lse
        total += torch.where(lab != ignore_index, chunk_lse - target, 0.0).sum()
    return _reduce(total, labels, ignore_index, reduction), lse


@linear_cross_entropy.register_fake
def _(h, weight, labels, ignore_index=-100, reduction="mean", chunk_rows=0):
    _check(h, weight, labels, reduction, chunk_rows)
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.shape[0], dtype=torch.float32)


@torch.library.custom_op("autopar::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_loss: Tensor,
    grad_lse: Tensor | None,
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    lse: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_rows: int,
    need_grad_h: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor]:
    """(grad of ``h``, grad of ``weight``) of ``linear_cross_entropy``, given the forward's ``lse``,
    over blocks of the vocabulary (``vocab_rows_for``); ``grad_lse`` None (nobody differentiated
    ``lse``) or its gradient, added as ``grad_lse_i * softmax(z_i)``; an unneeded gradient is an
    empty ``[0]`` tensor (its matmul skipped)."""
    return _grads(
        grad_loss,
        grad_lse,
        h,
        weight,
        labels,
        lse,
        ignore_index,
        reduction,
        chunk_rows,
        need_grad_h,
        need_grad_weight,
    )


def _grads(
    grad_loss,
    grad_lse,
    h,
    weight,
    labels,
    lse,
    ignore_index,
    reduction,
    chunk_rows,
    need_grad_h,
    need_grad_weight,
):
    """The backward op's implementation (also what a test runs to see its allocations)."""
    _check(h, weight, labels, reduction, chunk_rows)
    block = vocab_rows_for(h.shape[0], weight.shape[0], chunk_rows)
    return _backward_blocks(
        grad_loss,
        grad_lse,
        h,
        weight,
        labels,
        lse,
        0,
        ignore_index,
        reduction,
        block,
        need_grad_h,
        need_grad_weight,
    )


@linear_cross_entropy_backward.register_fake
def _(
    grad_loss,
    grad_lse,
    h,
    weight,
    labels,
    lse,
    ignore_index,
    reduction,
    chunk_rows,
    need_grad_h,
    need_grad_weight,
):
    _check(h, weight, labels, reduction, chunk_rows)
    grad_h = h.new_empty(h.shape) if need_grad_h else h.new_empty(0)
    grad_weight = weight.new_empty(weight.shape) if need_grad_weight else weight.new_empty(0)
    return grad_h, grad_weight


def _setup_context(ctx, inputs, output) -> None:
    h, weight, labels, ignore_index, reduction, chunk_rows = inputs
    ctx.save_for_backward(h, weight, labels, output[1])  # lse: an output, not recomputed
    ctx.args = (ignore_index, reduction, chunk_rows)


def _backward(ctx, grad_loss, grad_lse):
    h, weight, labels, lse = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[:2]
    grad_h, grad_weight = torch.ops.autopar.linear_cross_entropy_backward(
        grad_loss, grad_lse, h, weight, labels, lse, *ctx.args, need_h, need_w
    )
    return (grad_h if need_h else None, grad_weight if need_w else None, None, None, None, None)


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.autopar.linear_cross_entropy)
def _forward_flops(h_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """The projection's ``2 N H V`` (the softmax's O(N V) is not a matmul: priced by bytes)."""
    return 2 * h_shape[0] * h_shape[1] * weight_shape[0]


@register_flop_formula(torch.ops.autopar.linear_cross_entropy_backward)
def _backward_flops(
    grad_shape, grad_lse_shape, h_shape, weight_shape, *args, out_shape=None, **kwargs
) -> int:
    """The recomputed projection (``2 N H V``) and each needed gradient's ``2 N H V``."""
    need = sum(s[0] > 0 for s in out_shape) if out_shape is not None else 2
    return 2 * h_shape[0] * h_shape[1] * weight_shape[0] * (1 + need)


# --- the vocabulary-parallel form -----------------------------------------------------------------


def _groups(group) -> list:
    """``group`` as a list: one process group (None: the default), or a sequence of them."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return [group]
    return list(group)


def _all_reduce(t: Tensor, op, groups: list) -> None:
    """All-reduce over every group in turn (max then max, sum then sum): over their product, a
    vocabulary split over several mesh axes."""
    for g in groups:
        dist.all_reduce(t, op=op, group=g)


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight_shard, labels, vocab_start, group, ignore_index, reduction, chunk_rows):
        _check(h, weight_shard, labels, reduction, chunk_rows)
        triton = use_triton(h)
        groups = _groups(group)
        n, v_local = h.shape[0], weight_shard.shape[0]
        rows = chunk_rows_for(n, v_local, chunk_rows)
        lse = torch.empty(n, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start, end in _chunks(n, rows):
            _, logits = _project(h[start:end], weight_shard, triton)
            lab = labels[start:end]
            local_lse, target = _lse_target(logits, lab, vocab_start, ignore_index, triton)
            del logits
            shift = local_lse.clone()
            _all_reduce(shift, dist.ReduceOp.MAX, groups)
            sums = torch.stack([torch.exp(local_lse - shift), target])
            _all_reduce(sums, dist.ReduceOp.SUM, groups)
            lse[start:end] = shift + torch.log(sums[0])
            total += torch.where(lab != ignore_index, lse[start:end] - sums[1], 0.0).sum()
        ctx.save_for_backward(h, weight_shard, labels, lse)
        ctx.args = (vocab_start, ignore_index, reduction, vocab_rows_for(n, v_local, chunk_rows))
        return _reduce(total, labels, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight_shard, labels, lse = ctx.saved_tensors
        vocab_start, ignore_index, reduction, block = ctx.args
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h, grad_weight = _backward_blocks(
            grad_loss,
            None,
            h,
            weight_shard,
            labels,
            lse,
            vocab_start,
            ignore_index,
            reduction,
            block,
            need_h,
            need_w,
        )
        # grad_h: this rank's share (its vocabulary's dz W), no collective (docstring)
        return (
            grad_h if need_h else None,
            grad_weight if need_w else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def vocab_parallel_linear_cross_entropy(
    h: Tensor,
    weight_shard: Tensor,
    labels: Tensor,
    vocab_start: int,
    group: dist.ProcessGroup | Sequence[dist.ProcessGroup] | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int = 0,
) -> Tensor:
    """The loss of ``h @ W.T`` over the whole vocabulary, where this rank holds ``weight_shard =
    W[vocab_start : vocab_start + V_r]`` and every rank of ``group`` the same ``h``, ``labels``
    (global ids). ``group``: one process group (None: the default), or a sequence of them, a
    vocabulary split over several mesh axes (each all-reduce runs over every group in turn; the
    caller gives ``vocab_start``). Returns the full loss on every rank. Backward: this rank's
    ``weight_shard`` gradient, and **this rank's own share of** ``h``'s **gradient** (its
    vocabulary's ``dz W_r``), **not** summed over the group: the caller sums the shares, as
    autopar's generated code does through Megatron's "f" on ``h`` (identity forward, all-reduce of
    the gradient backward), which codegen puts on a Replicate input of an op split over the axis.
    Collectives (module docstring): 2 all-reduces per chunk forward (per group), none backward.
    Every rank must pass the same ``chunk_rows``; 0 derives it from the shard's rows, which agree
    where the shards have equal sizes (a vocabulary padded to a multiple of the group's size, as
    Megatron's): pass it explicitly for unequal shards."""
    return _VocabParallelLinearCrossEntropy.apply(
        h, weight_shard, labels, vocab_start, group, ignore_index, reduction, chunk_rows
    )
