"""Rule 5's look-up (issue 36, the year case): whether a drain falls in a blamed run's window,
by bisection, says what looking at every run of the node says."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.accounting.attribution import _Spans

span_st = st.tuples(st.integers(0, 60), st.integers(0, 60)).map(lambda s: (float(s[0]),
                                                                          float(s[1])))


@given(st.lists(span_st, max_size=12), st.lists(st.integers(-5, 65), max_size=20))
def test_spans_hold_a_time_as_any_span_does(spans: list[tuple[float, float]],
                                            times: list[int]) -> None:
    got = _Spans(spans)
    for t in times:
        assert got.holds(float(t)) == any(lo <= t <= hi for lo, hi in spans)
