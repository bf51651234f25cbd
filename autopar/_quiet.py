"""Imported first by ``autopar``: torchao's start-up noise filtered, on torch builds without CUDA.

torchao (FP8 linears; transformers imports it too wherever it is installed) warns once per
CUDA-only extension it cannot load, and torch once per enum torchao registers with ``_pytree``,
at every start of every rank. On a torch built without CUDA none of it bears on the run (the
demo printed twelve such lines over four ranks), so there two logging filters drop exactly those
records, whenever torchao is imported; nothing is imported here. On CUDA builds they stay.
"""

from __future__ import annotations

import logging

import torch


class _CudaOnlyExtension(logging.Filter):
    """Drops torchao's warning that it could not load one of its compiled extensions."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load")


class _TorchaoEnumNotice(logging.Filter):
    """Drops torch's notice that registering an Enum as a pytree constant is deprecated, where the
    Enum is torchao's (torchao registers its config enums on import; nothing for a user to do)."""

    def filter(self, record: logging.LogRecord) -> bool:
        cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
        module = getattr(cls, "__module__", "") or ""
        return not (module.startswith("torchao") and "is an Enum subclass" in str(record.msg))


if torch.version.cuda is None:
    logging.getLogger("torchao").addFilter(_CudaOnlyExtension())
    logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumNotice())
