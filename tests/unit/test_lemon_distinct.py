"""The lemon fit over the failed runs' distinct hazards (issue 36, the year case): runs with the
same counted nodes, background use and job size merged into one weighted row give the fit the
per-run EM gives, on random incidences with repeated node lists, culprits, -w nodes, sources
left out and a rate held fixed."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting.incidence import Incidence, IncidenceBuilder
from gpuwarden.lemon import distinct
from gpuwarden.lemon.distinct import distinct_rows
from gpuwarden.lemon.inference import _design, _Em, design, fit

NODES = [f"n{i}" for i in range(6)]
LISTS = [("n0",), ("n1",), ("n0", "n1"), ("n1", "n0"), ("n2", "n3", "n4", "n5"),
         ("n0", "n1", "n2", "n3"), ("n5",), ("n4", "n4")]

failure_st = st.tuples(
    st.sampled_from(LISTS), st.lists(st.sampled_from(NODES), max_size=2),
    st.lists(st.sampled_from(NODES), max_size=2), st.sampled_from(["ann", "bob", "cy"]),
    st.sampled_from(["", "a.sh", "b.sh"]), st.booleans(), st.sampled_from([1, 2, 3]),
    st.sampled_from([0.0, 0.5, 2.0]), st.sampled_from([1.0, 1.0, 0.5, 0.0]))


def _incidence(failures: list[tuple[Any, ...]], hours: list[float]) -> tuple[Incidence,
                                                                              np.ndarray]:
    b = IncidenceBuilder()
    keep: list[float] = []
    for i, (nodes, culprits, named, user, script, gameable, size, h, k) in enumerate(failures):
        b.add_failure(i, float(i), h, size, nodes, [c for c in culprits if c in nodes],
                      [n for n in named if n in nodes], user, script, gameable)
        keep += [k] * len(nodes)
    for size in (1, 2, 3):
        b.add_hours(size, 10.0 * size)
    for u in ("ann", "bob", "cy"):
        b.add_source_hours(u, "a.sh", 5.0)
    return b.freeze(dict(zip(NODES, hours, strict=True))), np.array(keep)


hours_st = st.lists(st.sampled_from([0.0, 3.0, 40.0, 500.0]), min_size=6, max_size=6)


@settings(max_examples=150, deadline=None)
@given(st.lists(failure_st, min_size=1, max_size=40), hours_st, st.booleans(),
       st.integers(0, 2**32 - 1))
def test_the_merged_em_map_is_the_per_run_one(failures: list[tuple[Any, ...]],
                                              hours: list[float], with_keep: bool,
                                              seed: int) -> None:
    """Hazard per run, log-likelihood and an EM step at any rates: the same sums."""
    inc, keep = _incidence(failures, hours)
    row, use, bg_use, weight = _design(inc, keep if with_keep else None)
    merged = _Em.of(inc, row, use, bg_use, weight, None, merged=True)
    each = _Em.of(inc, row, use, bg_use, weight, None, merged=False)
    rng = np.random.default_rng(seed)
    rate = rng.exponential(0.01, len(inc.names)) * (rng.random(len(inc.names)) < 0.8)
    bg = rng.exponential(0.01, len(inc.bucket_hours))
    lam_m, lam_e = merged.hazard(rate, bg), each.hazard(rate, bg)
    assert np.array_equal(merged.per_run(lam_m), each.per_run(lam_e))  # the same sums, bit for bit
    assert np.isclose(merged.loglik(rate, bg, lam_m), each.loglik(rate, bg, lam_e),
                      rtol=1e-12, atol=1e-12)
    for got, want in zip(merged.step(rate, bg, lam_m), each.step(rate, bg, lam_e), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)
    assert len(merged.size) <= len(each.size)


@settings(max_examples=150, deadline=None)
@given(st.lists(failure_st, min_size=1, max_size=40), hours_st, st.booleans(),
       st.one_of(st.none(), st.tuples(st.integers(0, 5), st.sampled_from([0.0, 0.001, 0.05]))))
def test_the_merged_fit_is_the_per_run_fit(failures: list[tuple[Any, ...]], hours: list[float],
                                           with_keep: bool,
                                           fixed: tuple[int, float] | None) -> None:
    inc, keep = _incidence(failures, hours)
    k = keep if with_keep else None
    merged = fit(inc, keep=k, fixed=fixed)
    each = fit(inc, keep=k, fixed=fixed, merged=False)
    assert np.isclose(merged.loglik(inc), each.loglik(inc), rtol=1e-9, atol=1e-9)
    # Failures each node and the background are held for (what the scan shows).
    np.testing.assert_allclose(merged.rate * inc.node_hours, each.rate * inc.node_hours,
                               rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(merged.background * inc.bucket_hours,
                               each.background * inc.bucket_hours, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(merged.row_rate, each.row_rate, rtol=1e-6, atol=1e-12)
    np.testing.assert_array_equal(merged.use, each.use)


@settings(max_examples=150, deadline=None)
@given(st.lists(failure_st, min_size=1, max_size=40), hours_st, st.booleans())
def test_the_design_from_the_plain_one_is_the_design(failures: list[tuple[Any, ...]],
                                                     hours: list[float],
                                                     with_keep: bool) -> None:
    """Sources left out (``keep``) drop only the runs they weigh nothing in."""
    inc, keep = _incidence(failures, hours)
    k = keep if with_keep else None
    for got, want in zip(design(inc, k), _design(inc, k), strict=True):
        np.testing.assert_array_equal(got, want)


def test_repeated_runs_are_one_row_and_unlike_ones_stay_apart() -> None:
    """The same nodes in another order, or the same nodes with the background counted at
    another job size, are other hazards."""
    node = np.array([0, 1, 0, 1, 1, 0, 0, 1, 2, 0, 1], dtype=np.int64)
    row = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 5], dtype=np.int64)
    size = np.array([2, 2, 2, 3, 1, 2, 1])
    bg_use = np.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    take = np.array([True, True, True, True, True, True, False])
    got = distinct_rows(node, row, 7, size, bg_use, take)
    # rows 0 and 1 alike; 2 is (1, 0); 3 is at another size; 4 is n2 alone; 5 is (0, 1)
    # without the background: another hazard than row 0's; 6 is left out.
    assert got.of_run.tolist() == [0, 0, 1, 2, 3, 4, -1]
    assert got.reps.tolist() == [0, 2, 3, 4, 5]
    assert got.node.tolist() == [0, 1, 1, 0, 0, 1, 2, 0, 1]
    assert got.row.tolist() == [0, 0, 1, 1, 2, 2, 3, 4, 4]


def test_a_hash_collision_keeps_the_rows_apart(monkeypatch: Any) -> None:
    """Every row hashed alike: each is compared with the first entry by entry, so only
    truly equal rows merge."""
    monkeypatch.setattr(distinct, "_mix", lambda x: x & np.uint64(0))
    node = np.array([0, 1, 1, 0, 0, 1, 3], dtype=np.int64)
    row = np.array([0, 0, 1, 1, 2, 2, 3], dtype=np.int64)
    got = distinct.distinct_rows(node, row, 4, np.ones(4, dtype=np.int64), np.ones(4),
                                 np.ones(4, dtype=bool))
    assert got.of_run.tolist() == [0, 1, 0, 2]
