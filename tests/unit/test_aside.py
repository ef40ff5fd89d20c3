"""Work done in a forked child gives what it gives in place; a failing child's work is done
again in place (its error, its traceback); the lemon scoring's tests split so give the same
scores."""

from __future__ import annotations

import os

import pytest

from gpuwarden.accounting import aside
from gpuwarden.accounting.aside import Aside
from gpuwarden.accounting.attribution import attribute
from gpuwarden.lemon import scoring
from gpuwarden.lemon.scoring import ScoreConfig, score
from tests.unit.test_lemon_core import fleet_history


def _pid_and(x: int) -> tuple[int, int]:
    return os.getpid(), x * 2


def test_the_child_computes_and_the_caller_gets_its_value() -> None:
    pid, got = Aside(lambda: _pid_and(21)).result()
    assert got == 42
    assert pid != os.getpid()  # it ran in the child
    pid, got = Aside(lambda: _pid_and(21), fork=False).result()
    assert (pid, got) == (os.getpid(), 42)


def test_a_failing_child_is_done_again_here_and_raises_here() -> None:
    calls: list[int] = []

    def boom() -> int:
        calls.append(os.getpid())
        raise ValueError("no such node")
    with pytest.raises(ValueError, match="no such node"):
        Aside(boom).result()
    assert calls == [os.getpid()]  # the child's call is not the parent's list


def test_a_child_that_dies_is_done_again_here() -> None:
    def dies() -> int:
        if os.getpid() != parent:
            os._exit(9)
        return 7
    parent = os.getpid()
    assert Aside(dies).result() == 7


def test_a_result_that_does_not_pickle_is_computed_here() -> None:
    got = Aside(lambda: (lambda: 5)).result()
    assert got() == 5
    assert aside.log.name == "gpuwarden.accounting.aside"


def test_the_scoring_split_across_a_child_scores_every_node_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    att = attribute(fleet_history({"n3", "n17"}, seed=4, nodes=80, jobs=6000))
    alone = score(att, ScoreConfig())
    monkeypatch.setattr(scoring, "SPLIT_AT", 1)
    split = score(att, ScoreConfig())
    assert [(s.node, s.p_value, s.q_value, s.lemon, s.explanation) for s in split] == \
        [(s.node, s.p_value, s.q_value, s.lemon, s.explanation) for s in alone]
    assert any(s.lemon for s in split)
