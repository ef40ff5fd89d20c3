"""The attribution's blames as columns (issue 36, the year case): read back, they are the
Blames that were added, in order, however they were added (a run's at once, one by one,
another attribution's merged in), and the column readers say what a walk over them says."""

from __future__ import annotations

import pickle
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.accounting.attribution import Attribution
from gpuwarden.accounting.blames import Blame, Blames
from gpuwarden.accounting.incidence import IncidenceBuilder

NODES = ("n1", "n2", "n3", "m1")

run_st = st.tuples(
    st.lists(st.sampled_from(NODES), max_size=4), st.sampled_from([1.0, 0.5, 0.25]),
    st.one_of(st.none(), st.integers(1, 10**12)), st.integers(0, 4 * 10**9).map(float),
    st.sampled_from(["node failure (NODE_FAIL)", "health drain: x", ""]),
    st.integers(0, 12), st.booleans(), st.one_of(st.none(), st.floats(0, 4e9)),
    st.sampled_from([0, 1, 8, 64]))
op_st = st.tuples(st.sampled_from(["run", "append", "extend", "merge", "batch"]), run_st)


def _blames(run: tuple[Any, ...]) -> list[Blame]:
    nodes, *fields = run
    return [Blame(n, *fields) for n in nodes]


@given(st.lists(op_st, max_size=25), st.lists(st.integers(-60, 60), max_size=5))
def test_blames_read_back_as_the_blames_added(ops: list[tuple[str, tuple[Any, ...]]],
                                              places: list[int]) -> None:
    got, model = Blames(), []
    firsts = []  # the first blame of each run added at once, or of each added alone
    for how, run in ops:
        made = _blames(run)
        if how == "run":
            got.add_run(got.numbers(run[0]), *run[1:])
            firsts += made[:1]
        elif how == "append":
            for b in made:
                got.append(b)
            firsts += made
        elif how == "extend":
            got.extend(made)
            firsts += made
        elif how == "batch":  # the run, and again at a later time, by column
            later = (*run[:3], run[3] + 1, *run[4:7], run[7] or 0.0, run[8])
            runs = [(*run[:7], run[7] or 0.0, run[8]), later]
            nodes, *cols = zip(*runs, strict=True)
            got.add_runs([got.numbers(n) for n in nodes], *cols)
            made = [b for r in runs for b in _blames(r)]
            firsts += [b for r in runs for b in _blames(r)[:1]]
        else:  # another attribution's, merged
            other = Blames()
            other.add_run(other.numbers(reversed(run[0])), *run[1:])
            got.extend(other)
            made = made[::-1]
            firsts += made[:1]
        model += made
    assert len(got) == len(model) and list(got) == model and got == model
    for k in places:
        if -len(model) <= k < len(model):
            assert got[k] == model[k]
    assert got[1:-1:2] == model[1:-1:2]
    assert list(got.firsts()) == firsts
    assert got.lone() == sum(1 for b in model if b.job_id is None)
    wanted = {"n1", "m1", "zz"}
    assert list(got.on_nodes(wanted)) == [(b.node, b.started, b.at, b.gpus, b.job_id)
                                          for b in model if b.node in wanted]
    assert [got.names[c] for c in got.node_codes().tolist()] == [b.node for b in model]
    back = pickle.loads(pickle.dumps(got))
    assert isinstance(back, Blames) and list(back) == model


def test_an_attribution_given_a_list_of_blames_keeps_them() -> None:
    b = Blame("n3", 1.0, 42, 100.0, "FAILED", 1, True, 50.0, 8)
    att = Attribution(blames=[b])  # type: ignore[arg-type]
    assert isinstance(att.blames, Blames) and att.blames == [b]
    assert att.merge(Attribution(blames=[b])).blames == [b, b]  # type: ignore[arg-type]


plain_st = st.tuples(st.integers(1, 10**9), st.floats(0, 4e9), st.floats(0, 100),
                     st.integers(1, 8), st.lists(st.sampled_from(NODES), min_size=1, max_size=4),
                     st.sampled_from(["ann", "bob"]), st.sampled_from(["", "a.sh"]),
                     st.booleans())


@given(st.lists(plain_st, max_size=6), st.lists(plain_st, max_size=6))
def test_plain_failures_by_column_are_the_ones_added_one_by_one(
        first: list[tuple[Any, ...]], then: list[tuple[Any, ...]]) -> None:
    one, cols = IncidenceBuilder(), IncidenceBuilder()
    for b in (one, cols):
        b.add_failure(7, 1.0, 1.0, 1, ["m1"], ["m1"])  # a row before
    for runs in (first, then):
        for job, end, hours, size, nodes, user, script, gameable in runs:
            one.add_plain_failure(job, end, hours, size, one.node_numbers(nodes), user, script,
                                  gameable)
        if runs:
            job, end, hours, size, nodes, user, script, gameable = zip(*runs, strict=True)
            cols.add_plain_failures(job, end, hours, size,
                                    [cols.node_numbers(n) for n in nodes], user, script,
                                    gameable)
    a, b = one.freeze({}), cols.freeze({})
    for name in ("ptr", "node", "flags", "hours", "end", "job", "user", "script", "size",
                 "gameable"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert (a.names, a.users, a.scripts) == (b.names, b.users, b.scripts)
