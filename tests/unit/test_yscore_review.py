"""Review findings on the year's fast paths (test first): the per-node evidence read from
the cached slices must equal `evidence` for any fit, and the incidence's column writers
must not misread what they are given."""

from __future__ import annotations

import dataclasses
from array import array

import numpy as np

from gpuwarden.accounting.incidence import IncidenceBuilder, int32s
from gpuwarden.lemon import inference
from tests.unit.test_yscore_evidence import _incidence


def _same_everywhere(inc: inference.Incidence, f: inference.Fit) -> list[int]:
    order, bounds = inc.by_node()
    differ = []
    for n in range(len(inc.names)):
        e = order[bounds[n]:bounds[n + 1]]
        a, b = inference.node_evidence(inc, f, n, e), inference.evidence(inc, f, n, e)
        if (a.rows.tolist() != b.rows.tolist() or a.rest.tobytes() != b.rest.tobytes()
                or (a.weight is None) != (b.weight is None)
                or (a.weight is not None and b.weight is not None
                    and a.weight.tobytes() != b.weight.tobytes())):
            differ.append(n)
    return differ


def test_a_fit_weighing_some_runs_nan_gives_each_node_the_evidence_evidence_gives() -> None:
    _, inc = _incidence(3)
    keep = np.where(np.random.default_rng(0).random(len(inc.node)) < 0.3, 0.0, 1.0)
    keep[::7] = np.nan  # with some runs weighed nothing: the slices then drop runs
    assert _same_everywhere(inc, inference.fit(inc, keep=keep)) == []


def test_a_fit_with_the_plain_use_but_runs_weighed_nothing_is_not_read_as_plain() -> None:
    _, inc = _incidence(3)
    plain = inference.fit(inc)
    w = np.ones(inc.rows)
    w[::5] = 0.0
    assert _same_everywhere(inc, dataclasses.replace(plain, weight=w)) == []


def test_int32s_packs_rows_of_any_int_type_by_value() -> None:
    assert array("i", int32s([np.array([0, 1], dtype=np.int64), array("q", [2])])
                 ).tolist() == [0, 1, 2]
    assert array("i", int32s([[3, 4], array("i", [5])])).tolist() == [3, 4, 5]
    assert array("i", int32s([array("i", [7, 8]), array("i", [9])])).tolist() == [7, 8, 9]


def test_gameable_flags_may_be_numpy_bools() -> None:
    b = IncidenceBuilder()
    b.add_plain_failures([1, 2], [10.0, 20.0], [1.0, 1.0], [1, 1], [[0], [1]], ["u", "v"],
                         ["s", "t"], [np.True_, np.False_])
    assert list(b.gameable) == [1, 0]
