"""Suite-wide settings.

Strict analysis: an op whose FLOPs or saved tensors cannot be derived is an error in tests (an
``UnpricedOpError`` naming the op and the fix), never a quiet zero. Set at import, before any test
(or a subprocess it starts, which inherits the environment) analyzes a model.
"""

from __future__ import annotations

import os

from autopar.passes.analyze import STRICT_ENV

os.environ[STRICT_ENV] = "1"
