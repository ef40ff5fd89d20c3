"""The blames' per-run columns at a year of a fleet (issue 36): a run's job id is a number in
an int64 column, and each distinct reason is kept once, however the runs were added; read
back they are the blames added (None for a drain without a job)."""

from __future__ import annotations

import pickle

from gpuwarden.accounting.blames import Blame, Blames


def _reason(size: int) -> str:
    return f"{size}-node job failed (exit 1)"  # a new string each call, as the rules make them


def test_each_distinct_reason_is_kept_once() -> None:
    b = Blames()
    b.add_run(b.numbers(["a", "b"]), 0.5, 7, 1.0, _reason(2), 2, False, 0.0, 8)
    b.add_runs([b.numbers(["a", "b"]), b.numbers(["c", "d"])], [0.5, 0.5], [8, 9],
               [2.0, 3.0], [_reason(2), _reason(2)], [2, 2], [False, False], [0.0, 1.0],
               [8, 8])
    other = Blames()
    other.add_run(other.numbers(["e", "f"]), 0.5, 10, 4.0, _reason(2), 2, False, 0.0, 8)
    b.extend(other)
    b.append(Blame("g", 1.0, None, 5.0, "health drain: x"))
    assert len({id(r) for r in b.reason}) == 2
    assert [x.reason for x in b.firsts()] == [_reason(2)] * 4 + ["health drain: x"]


def test_job_ids_are_an_int64_column_and_read_back() -> None:
    b = Blames()
    b.add_run(b.numbers(["a"]), 1.0, 10**12, 1.0, "r", 1, True, 0.0, 0)
    b.append(Blame("b", 1.0, None, 2.0, "health drain: x"))
    assert b.job.typecode == "q" and b.job.itemsize == 8
    assert [x.job_id for x in b] == [10**12, None]
    assert [j for *_, j in b.on_nodes(["a", "b"])] == [10**12, None]
    assert b.lone() == 1
    again = pickle.loads(pickle.dumps(b))
    assert list(again) == list(b)
    again.add_run(again.numbers(["c"]), 1.0, 3, 3.0, "r", 1, True, 0.0, 0)
    assert again.reason[0] is again.reason[2]
