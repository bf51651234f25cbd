"""Which implementation a kernel runs: Triton or its torch fallback.

``AUTOPAR_KERNELS`` (environment) chooses, read at each call:

* ``auto`` (default): Triton where the tensors are on a CUDA device and Triton imports; the torch
  fallback elsewhere (CPU ranks on gloo, a machine without Triton).
* ``triton``: Triton always. On CPU tensors this needs ``TRITON_INTERPRET=1`` (set before Triton is
  first imported): how the tests run the Triton code on a machine without a GPU.
* ``torch``: the fallback always (to compare the two, or to rule a kernel out while debugging).

Triton's modules are imported only when a Triton path first runs (``kernels/_triton_*.py``), so a
CPU-only run never pays Triton's import, and ``TRITON_INTERPRET`` set by a test before that first
call takes effect.
"""

from __future__ import annotations

import enum
import functools
import os

import torch

ENV = "AUTOPAR_KERNELS"


class Backend(enum.Enum):
    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"


def backend() -> Backend:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    try:
        return Backend(value)
    except ValueError:
        raise ValueError(
            f"{ENV}={value!r} is not one of {', '.join(b.value for b in Backend)}: unset it or pick one"
        ) from None


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether a kernel called on ``tensors`` runs its Triton implementation."""
    b = backend()
    if b is Backend.TORCH:
        return False
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if b is Backend.TRITON:
        if not triton_available():
            raise RuntimeError(f"{ENV}=triton but triton does not import: pip install triton")
        if not on_cuda and not interpreting():
            raise RuntimeError(
                f"{ENV}=triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
            )
        return True
    return on_cuda and triton_available()
