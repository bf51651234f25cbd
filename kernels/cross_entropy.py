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

Backward strategy (recompute; the search prices it: ``flop_counter`` formulas below). Autograd
saves only ``h``, ``weight`` and ``labels``, the op's own inputs, alive anyway: **zero** bytes
beyond them, against eager's ``4 N V``. The backward recomputes each chunk's logits: one extra
``h W^T`` matmul, ``2 N H V`` FLOPs (backward ``6 N H V`` against eager's ``4 N H V``), plus one more
read of the chunk's logits to recompute each row's log-sum-exp, which is not saved (saving it,
``4 N`` bytes, would make it a second output of the op, and spare that read only, never a matmul).
Its working set: one chunk (as the forward's; the gradient is written over the mm's output), an
fp32 accumulator for ``grad_weight`` (``4 V H`` bytes; each chunk's ``dz^T h`` is added into it by
the GEMM itself on CUDA, ``FP32_OUT_MM``, else through a ``V H e`` product), cast to
``weight.dtype`` at the end (``V H e``, the output); ``grad_h`` (``N H e``, the output) is written
chunk by chunk. The accumulator is read and written once per chunk (``8 V H`` bytes): fewer, larger
chunks are faster. On an H100, N = 8192, H = 4096, V = 128256, bf16, forward + backward: eager
11.74 GiB above its inputs, 51.1 ms; this op (Triton) with the default's 2092-row chunks 3.46 GiB,
54.6 ms; with 523-row chunks (a 256 MiB budget) 3.08 GiB, 74.3 ms (2 GiB of either is the
accumulator, 1 GiB the bf16 ``grad_weight`` itself). The alternative (Liger-kernel's: both
gradients computed during the forward and kept) holds ``N H e + 4 V H`` bytes from forward to
backward, a weight's worth per loss, to save the recomputing matmul.

``torch.ops.autopar.linear_cross_entropy(h, weight, labels, ignore_index=-100, reduction="mean",
chunk_rows=0)`` returns the 0-dim fp32 loss; reductions ``mean`` (over non-ignored labels: all
ignored gives nan, 0/0, as torch's) and ``sum``. The matmuls are torch's (``torch.mm`` in the input
dtype, as eager's); the per-chunk log-sum-exp, target logit and
softmax-minus-one-hot are a Triton kernel where ``use_triton(h)`` (``kernels/_triton_cross_entropy.py``),
else torch ops. The backward is itself an op, ``torch.ops.autopar.linear_cross_entropy_backward``,
with a fake implementation, so forward and backward run on meta tensors.

``vocab_parallel_linear_cross_entropy``: the same loss where each rank of ``group`` holds the rows
``[vocab_start, vocab_start + V / n)`` of ``weight`` (Megatron's vocabulary-parallel cross-entropy).
Per chunk, forward: local logits, their log-sum-exp ``lse_r`` and the target logit where the label
falls in the shard (0 elsewhere), then **2 all-reduces**: MAX of ``lse_r`` (``m``, a stabilizing
shift; any upper-ish bound of the row max works, and ``lse_r >= max_r``), and one SUM of the stacked
``[exp(lse_r - m), target_r]`` (``2 * rows`` fp32): ``lse = m + log(sum)``, the target logit from
the one rank holding it. The three reductions the textbook form names (row max, sum of exponentials,
target logit) are two collectives: the sums share one. Backward: no collective to form the
gradient of the local logits (the global ``lse``, ``4 N`` bytes, is saved from forward, with ``h``,
the shard and the labels); each rank
gets its own ``grad_weight`` shard and a partial ``grad_h`` (its vocabulary's share of
``dz W``), which is all-reduced (SUM) over the group, one asynchronous all-reduce per chunk of
rows, waited for at the end (it overlaps the next chunk's matmuls). Convention: **the returned
``grad_h`` is already summed over the group**: ``h`` is replicated over the group, and a caller
treats it so, with no further reduction. The loss is the full loss on every rank (not a partial
one), so every rank's ``loss.backward()`` seeds it with the same gradient.
"""

from __future__ import annotations

from collections.abc import Iterator

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
    scale: Tensor,
    vocab_start: int,
    ignore_index: int,
    out: Tensor,
    triton: bool,
) -> Tensor:
    """``out = scale * (exp(logits - lse) - onehot(label - vocab_start))``, 0 on ignored rows, in
    ``out``'s dtype; ``logits`` (fp32) is overwritten (``out`` may be ``logits`` itself)."""
    if triton:
        from autopar.kernels import _triton_cross_entropy as K

        return K.softmax_grad(logits, labels, lse, scale, vocab_start, ignore_index, out)
    g = logits.sub_(lse.unsqueeze(1)).exp_()
    hit, col = _hit(labels, vocab_start, logits.shape[1], ignore_index)
    g.scatter_add_(1, col.unsqueeze(1), -hit.to(g.dtype).unsqueeze(1))
    g.mul_(scale)
    # after the scaling: scale is inf for a mean over no labels, and those rows must stay 0
    g.masked_fill_((labels == ignore_index).unsqueeze(1), 0.0)
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
# tensor by the GEMM itself (CUDA): no product in the input dtype (``V H e`` bytes) written, read
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


def _scale(grad_loss: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """d loss / d (a row's loss), as a 0-dim fp32 tensor (no host sync)."""
    g = grad_loss.float()
    return g / (labels != ignore_index).sum() if reduction == "mean" else g


def _reduce(total: Tensor, labels: Tensor, ignore_index: int, reduction: str) -> Tensor:
    return total / (labels != ignore_index).sum() if reduction == "mean" else total


def _backward_chunks(
    grad_loss: Tensor,
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    lse: Tensor | None,
    vocab_start: int,
    ignore_index: int,
    reduction: str,
    rows: int,
    need_h: bool,
    need_weight: bool,
    on_grad_h_rows=None,
) -> tuple[Tensor, Tensor]:
    """The backward of both forms, chunk by chunk: ``lse`` the saved global log-sum-exp per row, or
    None to recompute it from each chunk's logits (single device). ``on_grad_h_rows(rows)`` is
    called with each chunk's rows of ``grad_h`` once they are written (the vocabulary-parallel
    all-reduce)."""
    triton = use_triton(h)
    scale = _scale(grad_loss, labels, ignore_index, reduction)
    grad_h = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else h.new_empty(0)
    acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
    if need_h or need_weight:
        for start, end in _chunks(h.shape[0], rows):
            low, logits = _project(h[start:end], weight, triton)
            lab = labels[start:end]
            chunk_lse = (
                lse[start:end] if lse is not None else _lse_target(logits, lab, 0, ignore_index, triton)[0]
            )
            g = _softmax_grad(logits, lab, chunk_lse, scale, vocab_start, ignore_index, low, triton)
            del logits  # an fp32 copy (torch ops, low precision): the gradient lives in the mm's output
            if need_h:
                torch.mm(g, weight, out=grad_h[start:end])
                if on_grad_h_rows is not None:
                    on_grad_h_rows(grad_h[start:end])
            if need_weight:
                _accumulate_mm(acc, g.t(), h[start:end])
    grad_weight = acc.to(weight.dtype) if need_weight else weight.new_empty(0)
    return grad_h, grad_weight


# --- the single-device op -------------------------------------------------------------------------


@torch.library.custom_op("autopar::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int = 0,
) -> Tensor:
    """``F.cross_entropy((h @ weight.T).float(), labels, ignore_index=, reduction=)`` without the
    ``[N, V]`` logits: ``chunk_rows`` rows at a time (module docstring). A 0-dim fp32 loss."""
    return _loss(h, weight, labels, ignore_index, reduction, chunk_rows)


def _loss(
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int = 0,
) -> Tensor:
    """The forward op's implementation (also what a test runs to see its allocations)."""
    _check(h, weight, labels, reduction, chunk_rows)
    triton = use_triton(h)
    rows = chunk_rows_for(h.shape[0], weight.shape[0], chunk_rows)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start, end in _chunks(h.shape[0], rows):
        _, logits = _project(h[start:end], weight, triton)
        lab = labels[start:end]
        lse, target = _lse_target(logits, lab, 0, ignore_index, triton)
        total += torch.where(lab != ignore_index, lse - target, 0.0).sum()
    return _reduce(total, labels, ignore_index, reduction)


@linear_cross_entropy.register_fake
def _(h, weight, labels, ignore_index=-100, reduction="mean", chunk_rows=0):
    _check(h, weight, labels, reduction, chunk_rows)
    return h.new_empty((), dtype=torch.float32)


@torch.library.custom_op("autopar::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad_loss: Tensor,
    h: Tensor,
    weight: Tensor,
    labels: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_rows: int,
    need_grad_h: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor]:
    """(grad of ``h``, grad of ``weight``) of ``linear_cross_entropy``, recomputing each chunk's
    logits and log-sum-exp; an unneeded one is an empty ``[0]`` tensor (its matmul skipped)."""
    return _grads(
        grad_loss, h, weight, labels, ignore_index, reduction, chunk_rows, need_grad_h, need_grad_weight
    )


def _grads(grad_loss, h, weight, labels, ignore_index, reduction, chunk_rows, need_grad_h, need_grad_weight):
    """The backward op's implementation (also what a test runs to see its allocations)."""
    _check(h, weight, labels, reduction, chunk_rows)
    rows = chunk_rows_for(h.shape[0], weight.shape[0], chunk_rows)
    return _backward_chunks(
        grad_loss, h, weight, labels, None, 0, ignore_index, reduction, rows, need_grad_h, need_grad_weight
    )


@linear_cross_entropy_backward.register_fake
def _(grad_loss, h, weight, labels, ignore_index, reduction, chunk_rows, need_grad_h, need_grad_weight):
    _check(h, weight, labels, reduction, chunk_rows)
    grad_h = h.new_empty(h.shape) if need_grad_h else h.new_empty(0)
    grad_weight = weight.new_empty(weight.shape) if need_grad_weight else weight.new_empty(0)
    return grad_h, grad_weight


def _setup_context(ctx, inputs, output) -> None:
    h, weight, labels, ignore_index, reduction, chunk_rows = inputs
    ctx.save_for_backward(h, weight, labels)
    ctx.args = (ignore_index, reduction, chunk_rows)


def _backward(ctx, grad_loss):
    h, weight, labels = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[:2]
    grad_h, grad_weight = torch.ops.autopar.linear_cross_entropy_backward(
        grad_loss, h, weight, labels, *ctx.args, need_h, need_w
    )
    return (grad_h if need_h else None, grad_weight if need_w else None, None, None, None, None)


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


@register_flop_formula(torch.ops.autopar.linear_cross_entropy)
def _forward_flops(h_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """The projection's ``2 N H V`` (the softmax's O(N V) is not a matmul: priced by bytes)."""
    return 2 * h_shape[0] * h_shape[1] * weight_shape[0]


@register_flop_formula(torch.ops.autopar.linear_cross_entropy_backward)
def _backward_flops(grad_shape, h_shape, weight_shape, labels_shape, *args, out_shape=None, **kwargs) -> int:
    """The recomputed projection (``2 N H V``) and each needed gradient's ``2 N H V``."""
    need = sum(s[0] > 0 for s in out_shape) if out_shape is not None else 2
    return 2 * h_shape[0] * h_shape[1] * weight_shape[0] * (1 + need)


# --- the vocabulary-parallel form -----------------------------------------------------------------


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight_shard, labels, vocab_start, group, ignore_index, reduction, chunk_rows):
        _check(h, weight_shard, labels, reduction, chunk_rows)
        triton = use_triton(h)
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
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
            sums = torch.stack([torch.exp(local_lse - shift), target])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            lse[start:end] = shift + torch.log(sums[0])
            total += torch.where(lab != ignore_index, lse[start:end] - sums[1], 0.0).sum()
        ctx.save_for_backward(h, weight_shard, labels, lse)
        ctx.args = (vocab_start, group, ignore_index, reduction, rows)
        return _reduce(total, labels, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad_loss):
        h, weight_shard, labels, lse = ctx.saved_tensors
        vocab_start, group, ignore_index, reduction, rows = ctx.args
        need_h, need_w = ctx.needs_input_grad[:2]
        pending = []  # one async all-reduce (SUM) of grad_h's rows per chunk, waited for at the end

        def all_reduce_rows(rows_of_grad_h: Tensor) -> None:
            pending.append(dist.all_reduce(rows_of_grad_h, op=dist.ReduceOp.SUM, group=group, async_op=True))

        grad_h, grad_weight = _backward_chunks(
            grad_loss,
            h,
            weight_shard,
            labels,
            lse,
            vocab_start,
            ignore_index,
            reduction,
            rows,
            need_h,
            need_w,
            on_grad_h_rows=all_reduce_rows,
        )
        for work in pending:
            work.wait()
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
    group: dist.ProcessGroup | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_rows: int = 0,
) -> Tensor:
    """The loss of ``h @ W.T`` over the whole vocabulary, where this rank of ``group`` holds
    ``weight_shard = W[vocab_start : vocab_start + V_r]`` and every rank the same ``h``, ``labels``
    (global ids). Returns the full loss on every rank. Backward: this rank's ``weight_shard``
    gradient, and ``h``'s gradient **summed over the group** (``h`` is replicated: no further
    reduction). Collectives (module docstring): 2 all-reduces per chunk forward, 1 (async) per
    chunk backward. Every rank must pass the same ``chunk_rows``; 0 derives it from the shard's
    rows, which agree where the shards have equal sizes (a vocabulary padded to a multiple of the
    group's size, as Megatron's): pass it explicitly for unequal shards."""
    return _VocabParallelLinearCrossEntropy.apply(
        h, weight_shard, labels, vocab_start, group, ignore_index, reduction, chunk_rows
    )
