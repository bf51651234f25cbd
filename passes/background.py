"""Work a worker thread does in the search's idle time.

The search's own thread spends a fifth of its time in HiGHS, which releases the GIL while it
solves; building the next candidate's cost tables is Python. A worker thread that simply ran
beside the search would take the GIL half the time from the search's own Python (CPython switches
every few milliseconds), and win little (the 8B-on-64 plan on the 2-core dev VM: 6.83 s against
7.03 s without a worker; benchmarks/README.md, "Planning time at scale"). Here the
worker runs only while the search's thread is idle: inside a native call (``owner_idle``, around
HiGHS's ``run``) or waiting for the worker's result (``Gate.idle``). Between those it stops at its
next ``checkpoint`` (one per node or edge of the tables it builds).

Both ends find their gate in thread-local state: ``owning`` on the search's thread, ``working`` on
the worker's. Elsewhere (no search prefetching, or a thread of the caller's own) ``owner_idle``
and ``checkpoint`` do nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

# while a gate is owned: the GIL passed on within 1 ms of a waiting thread asking (CPython's
# default is 5 ms), so the search's thread gets it back soon after HiGHS returns
SWITCH_INTERVAL_S = 0.001

_local = threading.local()
_lock = threading.Lock()
_owned = 0  # gates owned, over all threads
_interval = 0.0  # the switch interval before the first of them


class Gate:
    """Open while its owner is idle (``idle``); a worker's ``wait`` blocks until then. ``release``
    opens it for good (the worker finishes what it started)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._depth = 0
        self._released = False

    @contextlib.contextmanager
    def idle(self) -> Iterator[None]:
        """The owner is idle for the block: the worker may run."""
        self._depth += 1
        self._open.set()
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and not self._released:
                self._open.clear()

    def wait(self) -> None:
        self._open.wait()

    def release(self) -> None:
        self._released = True
        self._open.set()


@contextlib.contextmanager
def owning(gate: Gate) -> Iterator[Gate]:
    """This thread owns ``gate`` for the block: its ``owner_idle`` calls open it. On exit it is
    released, so a worker still at a checkpoint goes on."""
    global _owned, _interval
    previous = getattr(_local, "owned", None)
    _local.owned = gate
    with _lock:
        if _owned == 0:
            _interval = sys.getswitchinterval()
            sys.setswitchinterval(min(_interval, SWITCH_INTERVAL_S))
        _owned += 1
    try:
        yield gate
    finally:
        _local.owned = previous
        gate.release()
        with _lock:
            _owned -= 1
            if _owned == 0:
                sys.setswitchinterval(_interval)


@contextlib.contextmanager
def working(gate: Gate) -> Iterator[None]:
    """This (worker) thread's ``checkpoint`` calls wait on ``gate`` for the block."""
    previous = getattr(_local, "working", None)
    _local.working = gate
    try:
        yield
    finally:
        _local.working = previous


def owner_idle() -> contextlib.AbstractContextManager:
    """Around a call that releases the GIL (a native solve): on a thread that owns a gate, its
    worker runs meanwhile."""
    gate = getattr(_local, "owned", None)
    return contextlib.nullcontext() if gate is None else gate.idle()


def checkpoint() -> None:
    """In a worker's loops: wait here until its gate's owner is idle (no wait on other threads)."""
    gate = getattr(_local, "working", None)
    if gate is not None:
        gate.wait()
