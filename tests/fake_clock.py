"""A clock that moves only when a test moves it, injected in place of a module's ``time``.

Tests of code that times things (calibration, profiling, interleaved step timing) replace the
module's clock with one of these and make the timed calls advance it by known seconds: the
figures the code returns are then exact, whatever else runs on the machine, and a test checks
the logic (what is timed, how samples are combined) rather than the machine's speed. Real
timings belong to ``benchmarks/``.
"""

from __future__ import annotations

import types


class FakeClock:
    """``now`` seconds; ``advance(s)`` moves it on. ``module()`` stands for the ``time`` module."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def module(self) -> types.SimpleNamespace:
        """What to set as a module's ``time`` attribute: its clock reads this one."""
        return types.SimpleNamespace(perf_counter=self, monotonic=self, time=self)
