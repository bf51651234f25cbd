"""MODEL_SPEC: ``path/to/file.py:function`` or ``package.module:function``, a callable returning
``(model, example_inputs)``; ``function(key=value, ...)`` passes keyword arguments (Python literals)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

from autopar.errors import ModelSpecError

_SPEC = re.compile(r"^(?P<mod>[^:]+):(?P<fn>[A-Za-z_][A-Za-z0-9_]*)(?:\((?P<kw>.*)\))?$")


def _parse_kwargs(text: str | None) -> dict:
    if not text:
        return {}
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}  # type: ignore[attr-defined]
    except (SyntaxError, ValueError) as e:
        raise ModelSpecError(f"bad keyword arguments {text!r}: use key=value with Python literals") from e
    if call.args or any(k.arg is None for k in call.keywords):  # f('x') or f(**d): not dropped silently
        raise ModelSpecError(
            f"bad arguments {text!r}: name every argument (key=value with Python literals), "
            "e.g. moe_tiny(family='mixtral')"
        )
    return kwargs


def load_model_spec(spec: str):
    """Return ``(model, example_inputs)`` from a MODEL_SPEC string."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise ModelSpecError(
            f"bad MODEL_SPEC {spec!r}: expected path/to/file.py:function or package.module:function "
            "(optionally function(key=value, ...)), e.g. autopar.examples:gpt2_tiny"
        )
    mod_name, fn_name, kwargs = m.group("mod"), m.group("fn"), _parse_kwargs(m.group("kw"))
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise ModelSpecError(f"MODEL_SPEC file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(mod_spec)  # type: ignore[arg-type]
        sys.modules[path.stem] = module
        mod_spec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise ModelSpecError(f"cannot import {mod_name!r} from MODEL_SPEC {spec!r}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ModelSpecError(f"{mod_name} has no callable {fn_name!r}")
    try:
        bound = inspect.signature(fn).bind(**kwargs)
    except TypeError as e:  # a misspelt keyword: say which ones the function takes
        params = ", ".join(str(p) for p in inspect.signature(fn).parameters.values())
        raise ModelSpecError(
            f"{mod_name}:{fn_name} does not take {sorted(kwargs)}: {e}; it takes ({params})"
        ) from None
    except ValueError:  # no signature to read (a builtin): let the call say
        bound = None
    result = fn(*bound.args, **bound.kwargs) if bound is not None else fn(**kwargs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ModelSpecError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
    return result
