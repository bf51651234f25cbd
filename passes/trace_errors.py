"""What a model that cannot be traced did wrong, as ``TraceError`` says it: the user's line first
(the innermost frame of the traceback outside torch, autopar and Python's own library: a line of
the model's code, a Hugging Face model's included), then why, then what to do; and none of the
partial graphs torch.export prints to stderr when it fails."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import sysconfig
import traceback

# errors of a branch on a tensor's value, and what they mean in the words of a model's author
_DATA_DEPENDENT = ("GuardOnDataDependentSymNode", "DataDependentOutputException", "UserError")
# the packages whose frames are never the user's line (besides torch's, Python's own, autopar's)
_NOT_USER = ("/torch/", "/site-packages/torch", "/_pytest/", "/pluggy/")


def _own_dirs() -> tuple[str, ...]:
    """The folders of autopar's packages and of Python's standard library: frames there are not
    the user's."""
    names = ("autopar", "autopar.passes", "autopar.codegen", "autopar.cost_model", "autopar.kernels")
    dirs = [os.path.dirname(m.__file__) + os.sep for n in names if (m := sys.modules.get(n)) and m.__file__]
    return (*dirs, sysconfig.get_paths()["stdlib"] + os.sep)


def user_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code (not torch's, autopar's or Python's own) in the
    traceback of ``exc``: the model's line that failed to trace; None where there is none."""
    own = _own_dirs()
    frames = traceback.extract_tb(exc.__traceback__)
    user = [
        f for f in frames if not f.filename.startswith(own) and not any(p in f.filename for p in _NOT_USER)
    ]
    return user[-1] if user else None


def failure_reason(exc: BaseException) -> str:
    """What went wrong, in one line: the error's type and the first line of its message, with
    what a branch on a tensor's value means where that was it."""
    text = str(exc).strip()
    first = text.splitlines()[0].strip() if text else ""
    name = type(exc).__name__
    reason = f"{name}: {first}" if first else name
    if name in _DATA_DEPENDENT and "data-dependent" in text:
        reason = f"Python control flow or .item() on a tensor's value, which a trace cannot follow ({reason})"
    return reason


def _describe_failure(exc: BaseException) -> tuple[str, str]:
    """Where (the user's line: ``file:line in function``, then its source) and why a tracer failed."""
    f = user_frame(exc)
    where = f"{f.filename}:{f.lineno} in {f.name}\n      {(f.line or '').strip()}" if f else "an unknown line"
    return where, failure_reason(exc)


def untraceable(model, export_exc: BaseException, fx_exc: BaseException) -> str:
    """The error of a model neither tracer captures: the user's line first, then why (once where
    both tracers failed there for one reason), then what to do."""
    (w1, r1), (w2, r2) = _describe_failure(export_exc), _describe_failure(fx_exc)
    if (w1, r1) == (w2, r2):
        lines = [f"  at {w1}", f"  {r1}"]
    else:
        lines = [f"  at {w1}", f"  {r1} (torch.export)", f"  at {w2}", f"  {r2} (make_fx)"]
    return "\n".join([
        f"could not trace {type(model).__name__}:",
        *lines,
        "  Make that line traceable (no Python control flow on tensor values, no .item() / .tolist() in "
        "forward), or pass inputs that avoid it (e.g. use_cache=False for Hugging Face models).",
    ])  # fmt: skip


@contextlib.contextmanager
def no_partial_graphs():
    """torch.export prints the partial graph of a failed export to stderr (once per nested export
    wrapper, ``torch/export/_trace.py:_log_export_wrapper``): the error autopar raises names the
    user's line instead, and torch's warning that it found none for a data-dependent value (it
    did: ``user_frame``). What else is written to stderr meanwhile is passed on."""
    held = io.StringIO()
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    shapes_log.addFilter(_no_user_code_warning)
    try:
        with contextlib.redirect_stderr(held):
            yield
    except Exception as e:
        graph = getattr(e, "partial_fx_graph", None)
        text = held.getvalue()
        if graph:
            text = text.replace(f"{graph}\n", "")
        sys.stderr.write(text)
        raise
    finally:
        shapes_log.removeFilter(_no_user_code_warning)
    sys.stderr.write(held.getvalue())


def _no_user_code_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Unable to find user code")
