"""What a year's read holds per node list (its peak set the report's memory): each node's
name once however many lists name it, and a list's names as a set only where a run needs it."""

from __future__ import annotations

from gpuwarden.accounting.counted import _List
from gpuwarden.slurm.hostranges import expanded, names, ranges


def test_lists_naming_the_same_node_hold_one_string_for_it() -> None:
    a = names(ranges("gpu[0001-0004]") or ())
    b = names(ranges("gpu[0003-0006,0009]") or ())
    c = names(ranges("gpu0003") or ())
    assert a[2] == b[0] == c[0] == "gpu0003"
    assert a[2] is b[0] is c[0]
    assert a == ("gpu0001", "gpu0002", "gpu0003", "gpu0004")


def test_a_lists_set_of_names_is_made_only_when_a_run_asks() -> None:
    facts = _List("n[01-03]", {"n02": []})
    assert facts._scope is None
    assert facts.names == expanded("n[01-03]") and facts.with_events == ("n02",)
    assert "n03" in facts.scope and facts.scope == frozenset({"n01", "n02", "n03"})
    assert facts._scope is facts.scope
