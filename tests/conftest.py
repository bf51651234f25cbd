"""Suite-wide settings.

Hypothesis runs the same examples on every run (``derandomize``), with no per-example deadline: a
test drawing fresh examples each run may fail on one run and pass on the next, and a deadline is a
wall-clock bound that a busy 2-core machine trips; ``AUTOPAR_HYPOTHESIS_PROFILE=explore`` draws
fresh examples (still without deadlines) to hunt for new counterexamples.

Strict analysis: an op whose FLOPs or saved tensors cannot be derived is an error in tests (an
``UnpricedOpError`` naming the op and the fix), never a quiet zero. Set at import, before any test
(or a subprocess it starts, which inherits the environment) analyzes a model.
"""

from __future__ import annotations

import os

# the Triton kernels run here on CPU tensors through Triton's interpreter (kernels/dispatch.py). Set
# before the imports below: they import Triton (torch.utils.flop_counter does), and Triton decides at
# its import whether its own @jit functions (tl.sum, tl.max, ...) are interpretable; made before, a
# kernel calling them fails under the interpreter ("Cannot call @triton.jit'd outside of the scope
# of a kernel")
os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings  # noqa: E402

from autopar.launch import PRELOAD_ENV  # noqa: E402
from autopar.passes.analyze import STRICT_ENV  # noqa: E402

os.environ[STRICT_ENV] = "1"

# before the test modules import: the settings objects they build inherit from the loaded profile
settings.register_profile("suite", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("AUTOPAR_HYPOTHESIS_PROFILE", "suite"))
# rank processes start from a server that imported these once (autopar/launch.py): the model
# families the multi-process tests build
os.environ.setdefault(
    PRELOAD_ENV,
    "transformers,transformers.models.gpt2.modeling_gpt2,transformers.models.llama.modeling_llama,"
    "transformers.models.opt.modeling_opt,autopar.examples,autopar.models.palm,hypothesis",
)
