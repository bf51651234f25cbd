"""Register every fused op of ``autopar.kernels`` in one call.

``kernels/__init__.py`` imports none of them (importing ``autopar.kernels`` stays free); a module
registers its ``torch.ops.autopar.*`` ops when imported. Generated code imports the modules it uses
(``autopar.kernels.norms`` ...) explicitly; ``load()`` is for callers that want all of them.
"""

from __future__ import annotations

import importlib
import importlib.util

MODULES = ("norms", "activations", "rope", "cross_entropy", "grouped_mm", "moe")


def load() -> None:
    """Import every kernel module present, registering its ops (idempotent)."""
    for name in MODULES:
        module = f"{__package__}.{name}"
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
