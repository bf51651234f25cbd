"""Imported first by ``autopar``: torchao imported once with its start-up noise quieted.

torchao (FP8 linears; transformers imports it too wherever it is installed) warns once per
CUDA-only extension it cannot load, and torch once per enum torchao registers with ``_pytree``,
at every start of every rank. On a torch built without CUDA none of it bears on the run (the
demo printed twelve such lines over four ranks), so there torchao is imported here with those two
loggers at ERROR, and torch's notice about torchao's enums, which later torchao imports repeat, is
filtered out. On CUDA builds its messages stay.
"""

from __future__ import annotations

import importlib.util
import logging

import torch


def import_torchao_quietly() -> bool:
    """Import torchao as the module docstring says; whether this call imported it."""
    if torch.version.cuda is not None or importlib.util.find_spec("torchao") is None:
        return False
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install is reported where FP8 runs (codegen/float8.py)
        return False
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return True


class _TorchaoEnumNotice(logging.Filter):
    """Drops torch's notice that registering an Enum as a pytree constant is deprecated, where the
    Enum is torchao's (torchao registers its config enums on import; nothing for a user to do)."""

    def filter(self, record: logging.LogRecord) -> bool:
        cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
        module = getattr(cls, "__module__", "") or ""
        return not (module.startswith("torchao") and "is an Enum subclass" in str(record.msg))


if import_torchao_quietly():
    # the submodules transformers imports later (quantization, MoE training configs) register more
    logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumNotice())
