"""The lemon scan and the fleet report read exports of every Slurm release's sacct: a record
without a field they need is skipped, and the log names the field and the data_parser version
(not a traceback, not a silent zero)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from gpuwarden.accounting import history

FIXTURES = Path(__file__).parent.parent / "fixtures" / "slurm_versions"


@pytest.mark.parametrize("version", ["v0.0.40", "v0.0.42", "v0.0.43", "v0.0.45"])
def test_every_release_reads_and_a_missing_field_is_named_with_its_version(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, version: str) -> None:
    doc = json.loads((FIXTURES / f"sacct_{version}.json").read_text())
    good = history.from_files([str(FIXTURES / f"sacct_{version}.json")], [], 3600)
    assert good.records == len(doc["jobs"]) and not good.attribution.skipped
    del doc["jobs"][0]["time"]["end"]
    export = tmp_path / "day.json"
    export.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING):
        bad = history.from_files([str(export)], [], 3600)
    assert bad.attribution.skipped == {f"{export}: malformed record": 1}
    assert f"data_parser {version}" in caplog.text and "jobs[0].time.end" in caplog.text
