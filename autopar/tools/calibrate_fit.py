"""Fitting a link's figures to measured collectives (``autopar/tools/calibrate.py`` measures them).

A collective of kind ``k`` over ``n`` ranks on a tensor of ``B`` bytes (full size) is priced as a
ring (``cost_model/comm.py``)::

    t(B, n) = f(n) * B / bw + g(n) * lat                                          [s]

with ``B`` in bytes, ``bw`` the link's bus bandwidth in B/s and ``lat`` its latency in s:

* all-reduce:                                f = 2 (n-1)/n,  g = 2 (n-1)
* all-gather / reduce-scatter / all-to-all:  f =   (n-1)/n,  g =   (n-1)
* a point-to-point hop:                      f = 1,          g = 1

(``ring_coefficients``), linear in the unknowns ``x = (1/bw, lat)``. ``fit_link`` solves the
least-squares problem in *relative* terms, minimising ``sum_i ((f_i B_i x_0 + g_i x_1) / t_i - 1)^2``,
so small (latency-bound) and large (bandwidth-bound) messages weigh the same; the solution is
clamped to ``bw <= 1e15 B/s`` and ``lat >= 1e-9 s`` (when the unconstrained optimum is not positive
the other unknown is refitted alone). ``fit_errors`` gives each sample's relative error
``(predicted - measured) / measured``. ``fit_ranges`` fits one (bandwidth, latency) per collective
and size range between neighbouring sample sizes (``LinkSpec.ranges``), which the cost model
uses: transports change regime with message size and implement each collective their own way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autopar.cluster import LinkSpec

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_reduce_queued")  # what calibrate measures
_MAX_BANDWIDTH = 1e15  # B/s: clamp for a fit whose bandwidth term vanishes
_MIN_LATENCY = 1e-9  # s


@dataclass(frozen=True)
class Sample:
    """One measured collective: ``kind`` over ``n`` ranks on a tensor of ``nbytes`` (full size), ``seconds``."""

    kind: str
    nbytes: int
    n: int
    seconds: float


def ring_coefficients(kind: str, n: int) -> tuple[float, float]:
    """``(f, g)`` of ``t = f * B / bw + g * lat`` for ``kind`` over ``n`` ranks (as cost_model/comm.py)."""
    if kind in ("all_reduce", "all_reduce_queued"):
        return 2 * (n - 1) / n, 2.0 * (n - 1)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n, float(n - 1)
    if kind == "send_recv":
        return 1.0, 1.0
    raise ValueError(f"unknown collective kind {kind!r}; known: {KINDS + ('all_to_all', 'send_recv')}")


def predict_time(sample: Sample, link: LinkSpec, ranges: str | None = None) -> float:
    """``link``'s seconds for ``sample``, with the ranges named ``ranges`` (default: its kind's)."""
    f, g = ring_coefficients(sample.kind, sample.n)
    bw, lat = link.at(sample.nbytes, ranges or sample.kind)
    return f * sample.nbytes / bw + g * lat


def fit_ranges(samples: Sequence[Sample]) -> tuple[tuple[str, float, float, float], ...]:
    """One (bandwidth, latency) per collective and size range: ``fit_link`` on each collective's
    samples at two neighbouring sizes, applying up to the larger size (``LinkSpec.ranges``).
    Transports change regime with message size and implement each collective their own way
    (gloo's small all-reduce costs several times its all-gather), which one line per link cannot
    follow."""
    ranges = []
    for kind in dict.fromkeys(s.kind for s in samples):
        mine = [s for s in samples if s.kind == kind]
        sizes = sorted({s.nbytes for s in mine})
        for lo, hi in zip(sizes, sizes[1:]):
            link = fit_link([s for s in mine if s.nbytes in (lo, hi)], kind)
            ranges.append((kind, float(hi), link.bandwidth, link.latency))
    return tuple(ranges)


def fit_link(samples: Sequence[Sample], kind: str | None = None) -> LinkSpec:
    """Least-squares (relative error) fit of ``t = f(n) B / bw + g(n) lat`` to ``samples``.

    ``kind`` selects the samples of one collective (their formula); ``None`` fits all samples
    together, each with its own kind's ``f`` and ``g``. Returns a LinkSpec with positive, finite
    bandwidth (<= 1e15 B/s) and latency (>= 1e-9 s).
    """
    rows = [s for s in samples if (kind is None or s.kind == kind) and s.n > 1 and s.seconds > 0]
    if not rows:
        raise ValueError(f"fit_link: no usable samples (kind={kind!r}, n > 1, seconds > 0)")
    coeffs = [ring_coefficients(s.kind, s.n) for s in rows]
    a = torch.tensor(
        [[f * s.nbytes / s.seconds, g / s.seconds] for s, (f, g) in zip(rows, coeffs)], dtype=torch.float64
    )
    y = torch.ones(len(rows), dtype=torch.float64)
    x = torch.linalg.lstsq(a, y.unsqueeze(1)).solution.squeeze(1)
    inv_bw, lat = float(x[0]), float(x[1])
    if not (inv_bw > 0 and lat > 0):  # non-negative least squares in 2 unknowns: refit one alone
        col_bw, col_lat = a[:, 0], a[:, 1]
        if inv_bw <= 0:
            inv_bw, lat = 0.0, float(col_lat @ y / (col_lat @ col_lat))
        else:
            inv_bw, lat = float(col_bw @ y / (col_bw @ col_bw)), 0.0
    bandwidth = _MAX_BANDWIDTH if inv_bw <= 1 / _MAX_BANDWIDTH else 1.0 / inv_bw
    latency = max(lat, _MIN_LATENCY) if math.isfinite(lat) else _MIN_LATENCY
    return LinkSpec(bandwidth=bandwidth, latency=latency)


def fit_errors(samples: Sequence[Sample], link: LinkSpec) -> list[float]:
    """Relative error ``(predicted - measured) / measured`` of ``link`` on each sample."""
    return [(predict_time(s, link) - s.seconds) / s.seconds for s in samples]
