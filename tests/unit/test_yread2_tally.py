"""The report's tally of the store's other runs keeps their blamable runs by column
(`RunTally._blamables`): the same as each record on its own, job ids past 31 bits included
(one by one there: `run_keys` is int64)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.slurm.models import AcctJob, NodeEvent
from tests.unit.test_report_collect_frame import _both, _tallies, events, records


@settings(max_examples=60, deadline=None)
@given(st.lists(records(), max_size=30), st.one_of(st.none(), events()), st.booleans(),
       st.sampled_from([0, 1 << 31, (1 << 40) + 3]))
def test_blamable_runs_by_column_are_each_records(jobs: list[AcctJob],
                                                  evs: list[NodeEvent] | None,
                                                  topology: bool, big: int) -> None:
    jobs = [dataclasses.replace(j, job_id=j.job_id + big * (k % 2))
            for k, j in enumerate(jobs)]
    one, cols = _both(jobs, evs, topology)
    assert _tallies(cols) == _tallies(one)


def test_run_keys_refuse_job_ids_whose_keys_would_not_fit() -> None:
    import numpy as np

    from gpuwarden.report.collect import run_key, run_keys
    ends = np.array([5, 6], dtype=np.int64)
    assert run_keys(np.array([1, (1 << 31) - 1], dtype=np.int64), ends).tolist() == [
        run_key(1, 5), run_key((1 << 31) - 1, 6)]
    assert run_keys(np.array([1, 1 << 31], dtype=np.int64), ends) is None
    assert run_keys(np.array([-1, 2], dtype=np.int64), ends) is None
