"""``passes/solver.py:edge_regret`` (the regrets ``fold_followers`` reads to fold a follower only
where its best response does not depend on its consumers) takes the differences over an edge's
distinct rows only: bit for bit the regrets over every row, on any costs, forbidden pairs (inf)
and repeated rows included."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.passes.solver import edge_regret


def _every_row(c: np.ndarray) -> np.ndarray:
    """The regrets over every pair of rows, as ``_dominant_responses`` took them before."""
    with np.errstate(invalid="ignore"):
        d = c[:, None, :] - c[None, :, :]
    d = np.where(np.isnan(d), 0.0, d)
    return d.max(axis=2)


values = st.one_of(
    st.floats(min_value=0.0, max_value=1e3, allow_nan=False),
    st.just(math.inf),
    st.sampled_from([0.0, 1.5, 2.25]),
)


@st.composite
def costs(draw) -> np.ndarray:
    """An edge's costs whose rows repeat: a few distinct rows, each standing for several strategies."""
    nc = draw(st.integers(1, 6))
    distinct = draw(st.lists(st.lists(values, min_size=nc, max_size=nc), min_size=1, max_size=5))
    pick = draw(st.lists(st.integers(0, len(distinct) - 1), min_size=1, max_size=12))
    return np.asarray([distinct[k] for k in pick], dtype=float)


@settings(max_examples=300, deadline=None)
@given(costs())
def test_regret_over_distinct_rows_is_the_regret_over_every_row(c):
    got, want = edge_regret(c), _every_row(c)
    assert got.shape == want.shape == (len(c), len(c))
    assert np.array_equal(got, want, equal_nan=True)
    assert got.tobytes() == want.tobytes()  # the same floats, signs of zeros included


def test_repeated_rows_are_taken_once_and_spread_back():
    c = np.asarray([[1.0, math.inf], [0.0, 2.0], [1.0, math.inf], [0.0, 2.0]])
    got = edge_regret(c)
    assert got[0, 1] == math.inf and got[1, 0] == -1.0 and got[0, 2] == 0.0  # inf - inf: no difference
    assert np.array_equal(got, _every_row(c))
