"""Mixed precision as the generated module runs it, for the cost model: the dtype every value of
the traced graph has at run time under ``torch.autocast`` (``half_infos``: the autocast op lists
per device kind), the half type, and the dtype of the parameters' gradients and masters.

Split out of ``passes/trades.py`` (which prices the trades themselves, precision among them)."""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec
from autopar.hardware import DeviceKind, per_kind
from autopar.passes.analyze import NodeInfo
from autopar.passes.half_reshard import casts_before_reshard
from autopar.passes.rules import tensor_inputs
from autopar.passes.trace import Role, TracedGraph
from autopar.trades import Precision


def dtype_bytes(dtype: torch.dtype | None) -> int:
    """Bytes an element of ``dtype`` takes (0 for no dtype)."""
    return dtype.itemsize if dtype is not None else 0


def half_dtype(precision: Precision) -> torch.dtype:
    return torch.float16 if precision is Precision.FP16 else torch.bfloat16


def grad_dtype(precision: Precision | None) -> torch.dtype | None:
    """The dtype of a floating parameter's gradient at run time where it is not the traced one:
    fp32 under mixed precision, whose parameters are fp32 masters (``codegen/zero.py``: a model
    traced in bf16 is upcast), so its data-parallel all-reduces and ZeRO-1's gathers send fp32."""
    return torch.float32 if precision is not None and precision.mixed else None


def compute_param_dtype(precision: Precision | None) -> torch.dtype | None:
    """The dtype the forward reads floating parameters in where it is not the traced one: the half
    type under mixed precision, at every ZeRO stage (FSDP2's ``MixedPrecisionPolicy.param_dtype``
    under ZeRO-2/3, the half copies of ``codegen/local_params.py`` otherwise), so embeddings and
    norms output half and the residual stream is half. ZeRO-1's all-gathers after the step send
    it too (``codegen/zero_one.py``): what the next forward reads is the half copy of the masters.
    One rule for the runtime and the prices (``half_infos``, ``passes/grad_sync.py``)."""
    return half_dtype(precision) if precision is not None and precision.mixed else None


def auto_precision(infos: dict[str, NodeInfo]) -> Precision:
    """The parameters' dtype for fp32 models (numerics as the user wrote them); bf16 mixed
    precision (fp32 masters and optimizer state) for half-precision ones, as they are trained."""
    dtypes = {i.dtype for i in infos.values() if i.role is Role.PARAM and i.requires_grad}
    return Precision.BF16 if dtypes and dtypes <= {torch.bfloat16, torch.float16} else Precision.PARAM


# CUDA autocast's op lists (torch's "Autocast Op Reference"), as a traced graph names them
# (overload packets): ops that run in the half type, and ops that run in fp32 whatever their inputs.
# The half type's also holds the fused output projection + loss and the mixture-of-experts op: the
# generated code casts their operands as autocast casts a linear's
# (kernels/cross_entropy.py, kernels/moe.py: autocast_operands)
AUTOCAST_HALF = frozenset(
    f"aten.{op}"
    for op in (
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "addr", "prelu",
        "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
) | {"autopar.linear_cross_entropy", "autopar.moe_experts"}  # fmt: skip
AUTOCAST_FP32 = frozenset(
    f"aten.{op}"
    for op in (
        "pow", "rsqrt", "reciprocal", "exp", "expm1", "log", "log1p", "log2", "log10", "acos", "asin", "cosh",
        "sinh", "tan", "erfinv", "softplus", "softmax", "_softmax", "log_softmax", "_log_softmax", "sum", "prod",
        "cumsum", "cumprod", "layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "norm",
        "linalg_vector_norm", "renorm", "dist", "cdist", "cross_entropy_loss", "nll_loss", "nll_loss_forward",
        "nll_loss2d_forward", "mse_loss", "l1_loss", "smooth_l1_loss", "kl_div", "binary_cross_entropy_with_logits",
    )
)  # fmt: skip
# CPU autocast's fp32 ops (its own list: losses and a few reductions; ``pow``, softmax and the like
# keep their input's dtype there)
AUTOCAST_FP32_CPU = frozenset(
    f"aten.{op}"
    for op in (
        "prod", "cdist", "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "mse_loss",
        "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy",
        "binary_cross_entropy_with_logits", "margin_ranking_loss", "soft_margin_loss", "poisson_nll_loss",
    )
)  # fmt: skip
_CASTS = frozenset({"aten.to", "aten._to_copy", "prims.convert_element_type", "aten.type_as"})


# per device kind, its autocast's (half-type ops, fp32 ops): how ``torch.autocast(kind.value)``
# runs a traced graph's ops, which ``half_infos`` prices. A kind without an entry cannot be priced
# under mixed precision (UnsupportedDeviceKindError), never with another kind's lists.
AUTOCAST_BY_KIND: dict[DeviceKind, tuple[frozenset[str], frozenset[str]]] = {
    DeviceKind.CUDA: (AUTOCAST_HALF, AUTOCAST_FP32),
    DeviceKind.CPU: (AUTOCAST_HALF, AUTOCAST_FP32_CPU),
}


def autocast_device(cluster: ClusterSpec) -> DeviceKind:
    """The kind of device whose autocast the generated module runs under on ``cluster``
    (``cluster.device.kind``; ``codegen/zero.py`` autocasts on the runtime device's type)."""
    return cluster.device.kind


def _packet(target: str) -> str:
    return ".".join(str(target).split(".")[:2])


def half_infos(
    tg: TracedGraph, infos: dict[str, NodeInfo], precision: Precision, kind: DeviceKind
) -> dict[str, NodeInfo]:
    """Under mixed precision, every floating value in the dtype it runs in: the parameters are fp32
    masters, read by the forward as half copies at every ZeRO stage (``compute_param_dtype``), and
    the graph runs under ``torch.autocast`` (``codegen/zero.py``), so, op by op, as
    the autocast of devices of ``kind`` does (``autocast_device``; its lists: ``AUTOCAST_BY_KIND``,
    UnsupportedDeviceKindError for a kind it lacks): its half-type ops (matmuls, attention) give
    the half type, its fp32 ops (CUDA's: ``pow``, ``rsqrt``, softmax, sums, losses, ...; the
    CPU's: losses) fp32, explicit casts what they cast to, and the
    rest the widest floating dtype among their inputs (a residual stream fed by the half embedding
    is half; one an fp32 op or cast feeds is fp32), a device move (``passes/trace.py:
    device_moves_keep_dtype``) its input's. Bytes (moved, kept, temporaries) follow the dtype.
    Parameters keep their traced dtype and bytes here (``apply_trades`` prices masters and the
    half copies); their reshards move the half copy (``moved_dtype``). A value whose every use is an
    autocast GEMM moves through its reshards as its half copy (``NodeInfo.moved_dtype``,
    ``passes/half_reshard.py``). Halving every fp32 value instead prices a Llama's activations on an H200 at 7.7 GiB where a forward keeps 11.2 GiB
    (``benchmarks/bench_gpu_trades.py``)."""
    if not precision.mixed:
        return infos
    half = half_dtype(precision)
    where = "passes/precision.py AUTOCAST_BY_KIND"
    half_ops, fp32_ops = per_kind(AUTOCAST_BY_KIND, kind, "autocast op lists", where)
    runtime: dict[str, torch.dtype | None] = {}
    out = dict(infos)
    for node in tg.graph.nodes:
        info = infos.get(node.name)
        if info is None:
            continue
        traced = info.dtype
        if traced is None or not traced.is_floating_point:
            runtime[node.name] = traced
            continue
        if node.op == "placeholder":
            # the forward reads a parameter as its half copy (compute_param_dtype)
            rt = half if info.role is Role.PARAM else traced
        elif node.op != "call_function":
            rt = traced
        elif node.target is operator.getitem:  # an output of a multi-output op: as that op ran
            src = node.args[0]
            same = isinstance(src, fx.Node) and getattr(infos.get(src.name), "dtype", None) == traced
            rt = runtime.get(src.name) or traced if same else traced
        else:
            op = _packet(info.target)
            ins = [a for a in tensor_inputs(node) if runtime.get(a.name) is not None]
            # type promotion: tensors with dimensions decide over 0-dim ones
            ranked = [a for a in ins if infos[a.name].shape] or ins
            floats = {runtime[a.name] for a in ranked if runtime[a.name].is_floating_point}
            if op in half_ops:
                rt = half
            elif op in fp32_ops:
                rt = torch.float32
            elif op == "aten.to" and "dtype" in node.kwargs and node.kwargs["dtype"] is None and floats:
                rt = max(floats, key=lambda d: d.itemsize)  # a device move keeps its input's dtype
            elif op in _CASTS or not floats:
                rt = traced  # cast to what the trace says, or made from no floating input
            else:
                rt = max(floats, key=lambda d: (d.itemsize, d == traced))
        runtime[node.name] = rt
        # its reshards move the half copy every use casts it to (passes/half_reshard.py)
        moved = half if rt.itemsize > half.itemsize and casts_before_reshard(node) else None
        if info.role is Role.PARAM:
            # its bytes stay the traced ones (``apply_trades`` prices masters and the half copy);
            # its reshards move the half copy the forward reads
            if traced.itemsize > half.itemsize:
                out[node.name] = dataclasses.replace(info, moved_dtype=half)
            continue
        if rt == traced and moved is None:
            continue
        r = rt.itemsize / traced.itemsize
        out[node.name] = dataclasses.replace(
            info, dtype=rt, bytes=int(info.bytes * r), saved_temp_bytes=int(info.saved_temp_bytes * r),
            grad_temp_bytes=int(info.grad_temp_bytes * r), moved_dtype=moved,
        )  # fmt: skip
    return out
