"""A store whose path holds a character a glob reads ([ * ?) is read as that path: polars
takes a path as a pattern unless told, and a pattern that matched nothing read as an empty
store (every figure zero, said as correct), or matched another directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwarden.accounting.history import from_store
from gpuwarden.accounting.store.ingest import ingest
from tests.unit.test_acct_store_batches import FAILED
from tests.unit.test_acct_store_golden import DAY, T0, _events, _export, _record


@pytest.mark.parametrize("name", ["acct[prod]", "acct[1]", "a*b", "what?"])
def test_a_store_named_like_a_pattern_is_read_as_itself(tmp_path: Path, name: str) -> None:
    base = tmp_path / name
    base.mkdir()
    _export(base / "day.json", [_record(i, r) for i, r in enumerate(FAILED)], T0, T0 + DAY)
    raw = [("n01", T0 + 500, "health")]
    ingest(base / "store", [str(base / "day.json")], _events(raw), workers=1)
    hist = from_store(str(base / "store"))
    assert hist.records == len(FAILED)
    assert sum(hist.attribution.gpu_runs.values()) == len(FAILED)
    assert hist.attribution.last_end > 0 and len(hist.events) == 1
