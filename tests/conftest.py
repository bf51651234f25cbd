"""Suite-wide settings.

Strict analysis: an op whose FLOPs or saved tensors cannot be derived is an error in tests (an
``UnpricedOpError`` naming the op and the fix), never a quiet zero. Set at import, before any test
(or a subprocess it starts, which inherits the environment) analyzes a model.
"""

from __future__ import annotations

import os

from autopar.launch import PRELOAD_ENV
from autopar.passes.analyze import STRICT_ENV

os.environ[STRICT_ENV] = "1"
# the Triton kernels run here on CPU tensors through Triton's interpreter (kernels/dispatch.py)
os.environ.setdefault("TRITON_INTERPRET", "1")
# rank processes start from a server that imported these once (autopar/launch.py): the model
# families the multi-process tests build
os.environ.setdefault(
    PRELOAD_ENV,
    "transformers,transformers.models.gpt2.modeling_gpt2,transformers.models.llama.modeling_llama,"
    "transformers.models.opt.modeling_opt,autopar.examples,autopar.models.palm,hypothesis",
)
