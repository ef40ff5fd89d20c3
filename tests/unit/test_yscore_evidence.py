"""The lemon part of a year's report made with fewer Python steps gives what the step-by-step
reading gives: each node's test evidence read from its slice of the incidence, the quantile
search started near its end, every annotated reason and every evidence row of the report."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting.attribution import Attribution, attribute
from gpuwarden.accounting.blames import Blames
from gpuwarden.accounting.incidence import Incidence
from gpuwarden.lemon import explain, inference
from gpuwarden.lemon.explain import LEFT, LEFT_OUT, LazyEvidence, RowIndex, RowView, annotate
from gpuwarden.lemon.inference import CHANCE, evidence, fit, gamma_p, node_evidence, poisson_upper
from gpuwarden.lemon.scoring import ScoreConfig, score
from gpuwarden.report import lemons
from tests.unit.test_lemon_explain_fast import gang_history


def _stepwise_upper(mean: float) -> float:
    """`poisson_upper` as it searched: from the mean's floor, one count at a time."""
    if not math.isfinite(mean):
        return math.inf
    k = math.floor(mean)
    while gamma_p(k + 1, mean) > CHANCE:
        k += 1
    return float(k)


def test_the_quantile_search_started_near_it_finds_what_the_search_from_the_mean_finds(
) -> None:
    rng = random.Random(5)
    means = ([rng.uniform(0, 400) for _ in range(2_000)] + [k / 4 for k in range(800)]
             + [0.0, 1e-12, 0.5, 1.0, 2.0, 3.0, 1e4, math.inf])
    for m in means:
        assert poisson_upper(m) == _stepwise_upper(m), m


def _incidence(seed: int) -> tuple[Attribution, Incidence]:
    jobs, drains = gang_history(seed)
    att = attribute(jobs, drains)
    inc = att.incidence.freeze({n: e.hours for n, e in att.exposure.items()})
    return att, inc


def _same_evidence(a: inference.Evidence, b: inference.Evidence) -> None:
    assert a.rest.tobytes() == b.rest.tobytes() and a.rows.tolist() == b.rows.tolist()
    assert a.user.tolist() == b.user.tolist() and a.script.tolist() == b.script.tolist()
    assert a.gameable.tolist() == b.gameable.tolist() and a.exposure == b.exposure
    assert (a.weight is None) == (b.weight is None)
    if a.weight is not None and b.weight is not None:
        assert a.weight.tobytes() == b.weight.tobytes()


@pytest.mark.parametrize("seed", [1, 2])
def test_a_nodes_evidence_from_its_slice_is_its_evidence_with_runs_left_out_or_not(
        seed: int) -> None:
    """On the plain fit, on one that leaves some runs out (weighs them nothing) and on one
    whose entries' use the slices cannot tell (read the old way)."""
    _, inc = _incidence(seed)
    order, bounds = inc.by_node()
    rng = np.random.default_rng(seed)
    keep = np.where(rng.random(len(inc.node)) < 0.3, 0.0, 1.0)
    plain = fit(inc)
    some_out = fit(inc, keep=keep, start=plain)
    assert not np.array_equal(some_out.use, plain.use)
    odd_use = plain.use.copy()
    odd_use[::3] = False
    odd = inference.Fit(plain.rate, plain.background, odd_use, plain.row_rate,
                        plain.iterations, plain.bg_use, plain.weight)
    for f in (plain, some_out, odd):
        for node in range(len(inc.names)):
            entries = order[bounds[node]:bounds[node + 1]]
            _same_evidence(node_evidence(inc, f, node, entries),
                           evidence(inc, f, node, entries))


def _noted_one_by_one(view: RowView, index: RowIndex, base: list[str], shares: list[float],
                      who: list[int]) -> list[str]:
    """The note of each run as `annotate` wrote it, one at a time."""
    out = []
    for b, s, w in zip(base, shares, who, strict=True):
        if s >= 0.5:
            note = f"{s:.0%} of it on this node"
        elif w == LEFT:
            note = LEFT_OUT
        else:
            note = f"explained by {view.label(w)} ({s:.0%} on this node)"
        out.append(index.reason(b, note))
    return out


_SHARES = st.one_of(st.floats(0, 1), st.sampled_from(
    [0.0, -0.0, 0.005, 0.015, 0.125, 0.5, 0.49999999999999994, 0.995, 1.0, 1.005,
     float("nan"), float("inf"), -0.25]))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["node failed", "job failed", "drain"]), _SHARES,
                          st.sampled_from([LEFT, explain.NONE, 0, 1, 2, 3, 4, 5])),
                max_size=40))
def test_notes_made_once_for_each_text_are_the_notes_made_one_by_one(
        runs: list[tuple[str, float, int]]) -> None:
    _, inc = _incidence(3)
    view = RowView.of(inc, fit(inc))
    index = RowIndex(inc)
    base = np.empty(len(runs), dtype=object)
    base[:] = [r for r, _, _ in runs]
    code = np.array([["node failed", "job failed", "drain"].index(r) for r, _, _ in runs],
                    dtype=np.int64)
    shares = np.array([s for _, s, _ in runs], dtype=np.float64)
    who = np.array([w for _, _, w in runs], dtype=np.int64)
    got = explain._noted(view, index, base, code, shares, who).tolist()
    assert got == _noted_one_by_one(view, index, [r for r, _, _ in runs],
                                    [s for _, s, _ in runs], [w for _, _, w in runs])


def _annotated_one_by_one(view: RowView, node: int, blames: Blames, places: list[int],
                          index: RowIndex, entries: np.ndarray) -> list[str]:
    """`annotate`'s reasons as it made them: each run's row looked up with the node's runs."""
    runs = [blames.run_of(i) for i in places]
    got = index.rows(np.array([blames.job[r] for r in runs], dtype=np.int64),
                     np.array([blames.at[r] for r in runs], dtype=np.float64))
    found = [(k, row) for k, row in enumerate(got.tolist()) if row >= 0]
    rows = np.array([row for _, row in found], dtype=np.int64)
    reasons = [blames.reason[r] for r in runs]
    noted = _noted_one_by_one(view, index, [reasons[k] for k, _ in found],
                              view.node_shares(rows, entries).tolist(),
                              view.explainers(rows, node).tolist())
    for (k, _), text in zip(found, noted, strict=True):
        reasons[k] = text
    return reasons


@pytest.mark.parametrize("seed", [3, 4, 7])
def test_every_nodes_annotated_evidence_reads_as_made_one_by_one(seed: int) -> None:
    att, inc = _incidence(seed)
    blames = att.blames
    view = RowView.of(inc, fit(inc))
    index = RowIndex(inc)
    order, bounds = inc.by_node()
    codes = blames.node_codes()
    checked = 0
    for node, name in enumerate(inc.names):
        number = blames.names.index(name) if name in blames.names else -1
        places = np.flatnonzero(codes == number)
        entries = order[bounds[node]:bounds[node + 1]]
        got = annotate(view, node, blames, places, index, entries)
        want = _annotated_one_by_one(view, node, blames, places.tolist(), index, entries)
        assert [b.reason for b in got] == want
        assert [p[2] for p in got.pieces()] == want
        c = got.columns()
        assert c.reason == want
        assert c.at.tolist() == [p[0] for p in got.pieces()]
        checked += len(want)
    assert checked > 100


def test_a_year_of_reports_evidence_rows_read_as_columns_are_the_rows_read_piece_by_piece(
) -> None:
    jobs, drains = gang_history(4)
    scored = score(attribute(jobs, drains), ScoreConfig())
    assert any(s.lemon for s in scored)
    for s in scored:
        if not isinstance(s.evidence, LazyEvidence):
            continue
        assert s.evidence.columns() is not None
        assert lemons._read(s.evidence) == lemons._evidence(lemons._pieces(s.evidence))


def test_weights_rounded_once_each_are_each_rounded() -> None:
    w = np.array([1 / 3, 0.0, -0.0, 0.5, 1 / 3, 0.0005, 0.0015, 2.675, float("nan"), -0.0,
                  1e300, 1 / 7])
    assert [repr(x) for x in lemons._rounded(w)] == [repr(round(x, 3)) for x in w.tolist()]
    assert lemons._rounded(np.zeros(0)) == []


def test_times_written_at_once_are_each_written() -> None:
    ts = [0.0, 1.0, 1_700_000_000.0, 1_700_000_000.5, -5.0, 253_402_300_799.0]
    assert lemons._whens(ts) == [lemons._when(t) for t in ts]
    whole = np.array([0.0, 86_400.0, 1_700_000_000.0])
    assert lemons._whens(whole) == [lemons._when(t) for t in whole.tolist()]
    assert lemons._whens(np.zeros(0)) == []
