"""The year read's column ways (issue 36) say what the per-item ways say: a failed gang run's
node numbers joined as int32 arrays, the blamed runs of drained nodes read by column, their
spans and runs built by numpy."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.accounting.attribution import _Spans
from gpuwarden.accounting.blames import Blames
from gpuwarden.accounting.incidence import IncidenceBuilder
from gpuwarden.accounting.mttf import _Runs

NODES = ("n1", "n2", "n3", "m1")
run_st = st.tuples(
    st.lists(st.sampled_from(NODES), min_size=1, max_size=4),
    st.one_of(st.none(), st.integers(1, 10**6)), st.integers(0, 10**6).map(float),
    st.one_of(st.none(), st.integers(0, 10**6).map(float)), st.sampled_from([0, 1, 8]))


def _blames(runs: list[tuple[Any, ...]]) -> Blames:
    b = Blames()
    for nodes, job, at, started, gpus in runs:
        b.add_run(b.numbers(nodes), 1.0 / len(nodes), job, at, "r", 1, False, started, gpus)
    return b


@given(st.lists(run_st, max_size=12), st.lists(st.sampled_from(NODES), max_size=3))
def test_spans_on_are_the_blamed_runs_on_nodes_gives(runs: list[tuple[Any, ...]],
                                                     wanted: list[str]) -> None:
    b = _blames(runs)
    want: dict[str, list[tuple[float, float, int]]] = {}
    for node, started, at, gpus, job in b.on_nodes(wanted):
        if job is not None:
            want.setdefault(node, []).append((started if started is not None else at, at, gpus))
    got = {n: list(zip(*(c.tolist() for c in cols), strict=True))
           for n, cols in b.spans_on(wanted).items()}
    assert got == want


@given(st.lists(st.tuples(st.integers(0, 50).map(float), st.integers(0, 50).map(float),
                          st.sampled_from([1, 8])), min_size=1, max_size=12),
       st.lists(st.integers(-5, 110).map(float), max_size=10))
def test_spans_and_runs_by_numpy_answer_as_the_lists_do(runs: list[tuple[float, float, int]],
                                                        times: list[float]) -> None:
    lo = np.array([s for s, _, _ in runs])
    hi = np.array([e for _, e, _ in runs])
    gpus = np.array([g for _, _, g in runs], dtype=np.int64)
    spans, by_numpy = _Spans([(s - 3.0, e + 7.0) for s, e, _ in runs]), _Spans.of(lo - 3.0,
                                                                                  hi + 7.0)
    made, made_by_numpy = _Runs(list(runs)), _Runs.of(lo, hi, gpus)
    for t in times:
        assert by_numpy.holds(t) == spans.holds(t)
        assert made_by_numpy.around(t, 7.0) == made.around(t, 7.0)


@given(st.lists(st.lists(st.sampled_from(NODES), min_size=1, max_size=4), max_size=6))
def test_node_numbers_as_int32_arrays_are_added_as_lists_are(lists: list[list[str]]) -> None:
    by_list, by_array = Blames(), Blames()
    inc_list, inc_array = IncidenceBuilder(), IncidenceBuilder()
    if not lists:
        return
    k = len(lists)
    cols: tuple[Any, ...] = ([0.5] * k, list(range(1, k + 1)), [2.0] * k, ["r"] * k, [2] * k,
                             [False] * k, [1.0] * k, [8] * k)
    by_list.add_runs([by_list.numbers(n) for n in lists], *cols)
    by_array.add_runs([array("i", by_array.numbers(n)) for n in lists], *cols)
    assert list(by_list) == list(by_array)
    runs: tuple[Any, ...] = (list(range(k)), [1.0] * k, [0.5] * k, [2] * k)
    who: tuple[Any, ...] = (["u"] * k, ["", "s"] * k, [True] * k)
    inc_list.add_plain_failures(*runs, [inc_list.node_numbers(n) for n in lists],
                                *(c[:k] for c in who))
    inc_array.add_plain_failures(*runs, [array("i", inc_array.node_numbers(n)) for n in lists],
                                 *(c[:k] for c in who))
    a, b = inc_list.freeze({}), inc_array.freeze({})
    for name in ("ptr", "node", "flags", "user", "script", "gameable"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
