"""Issue 13 item 3: lemon scanning at scale. The fast decoder (msgspec) and the range tally of
exposure must give exactly what the standard library and per-node counting give."""

from __future__ import annotations

import io
import json
import logging
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.accounting import fastdecode as acctfast
from gpuwarden.accounting import history, rangetally
from gpuwarden.accounting import stream as acctstream
from gpuwarden.accounting.attribution import Attribution, attribute, attribute_runs, spread_exposure
from gpuwarden.accounting.rangetally import RangeTally
from gpuwarden.slurm.hostlist import expand
from gpuwarden.slurm.hostranges import expanded, ranges
from gpuwarden.slurm.models import AcctJob
from tests.unit.test_lemon_core import fleet_history, job, sacct_export

FIXTURES = Path(__file__).parent.parent / "fixtures"


def decoded(text: str, fast: bool) -> list[Any]:
    data = io.BytesIO(text.encode())
    out = acctstream.AcctStream(acctstream.text_reader(data), "t", fast=fast)
    return [r if isinstance(r, AcctJob) else (type(r), str(r)) for r in out]


def lazily(text: str) -> list[Any]:
    stream = acctstream.AcctStream(acctstream.text_reader(io.BytesIO(text.encode())), "t")
    return [r for r in stream.runs() if not isinstance(r, Exception)]


def summary(att: Attribution) -> tuple[Any, ...]:
    return (att.blames, {n: (e.jobs, round(e.hours, 9), dict(e.by_size))
                         for n, e in att.exposure.items() if e.jobs},
            att.skipped, att.runs_by_size, att.pinned_by_size, att.spread_by_size,
            att.gpu_runs, att.gpu_failures, att.first_start, att.last_end)


def both(text: str) -> tuple[list[Any], list[Any]]:
    return decoded(text, fast=False), decoded(text, fast=True)


def documents() -> list[str]:
    real = (FIXTURES / "sacct.json").read_text()
    return [real, json.dumps(json.loads(real)),  # as sacct prints it, and compact
            sacct_export(fleet_history({"n7"}, seed=3, jobs=400))]


@pytest.mark.parametrize("chunk", [300, 4096, 1 << 20])
@pytest.mark.parametrize("doc", range(3))
def test_fast_and_standard_decoders_give_the_same_records_and_attributions(
        monkeypatch: pytest.MonkeyPatch, chunk: int, doc: int) -> None:
    monkeypatch.setattr(acctstream, "CHUNK", chunk)
    slow, fast = both(documents()[doc])
    assert fast == slow and len(fast) > 5
    jobs = [r for r in fast if isinstance(r, AcctJob)]
    want = summary(attribute([r for r in slow if isinstance(r, AcctJob)]))
    assert summary(attribute(jobs)) == want
    runs = lazily(documents()[doc])  # what a scan reads: fields taken only when asked
    assert summary(attribute(runs)) == want
    assert [r if isinstance(r, AcctJob) else r.job() for r in runs] == jobs


def test_a_separator_inside_a_string_or_between_nested_objects_is_never_a_cut(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cut there would split a record: the decoder refuses it and an earlier one is used."""
    monkeypatch.setattr(acctstream, "CHUNK", 200)
    tricky = '},{"job_id": 99, "nodes": "c9"}'
    recs = [{"job_id": i, "nodes": f"c{i}", "state": {"current": ["FAILED"]},
             "submit_line": tricky * (i % 3), "name": "},\n{",
             "tres": {"allocated": [{"type": "gres", "name": "gpu", "count": 8},
                                    {"type": "node", "name": "", "count": 1}]},
             "time": {"start": 1_800_000_000, "end": 1_800_000_600}} for i in range(1, 60)]
    text = json.dumps({"jobs": recs, "meta": {}}, separators=(",", ":"))
    slow, fast = both(text)
    assert fast == slow
    assert [r.job_id for r in fast] == list(range(1, 60))
    assert summary(attribute(lazily(text))) == summary(attribute(fast))
    assert {r.gpus for r in fast} == {8}


def test_records_of_an_unexpected_shape_give_the_same_records_and_errors_either_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acctstream, "CHUNK", 256)
    odd: list[Any] = [
        {"job_id": "7", "nodes": "c1"}, {"job_id": True}, {"name": "no id"}, 12, None,
        {"job_id": {"set": True, "infinite": False, "number": 8}, "nodes": "c[1-2]",
         "state": {"current": "PENDING,REQUEUED"}, "time": {"start": 1.5, "end": None}},
        {"job_id": 9, "state": "FAILED", "exit_code": 3, "tres": {"allocated": None}},
        {"job_id": {"set": False, "number": 10}},
        {"job_id": 11, "time": {"start": {"set": True, "infinite": True, "number": 5}}},
    ]
    good = [{"job_id": 100 + i, "nodes": "c1", "state": {"current": ["COMPLETED"]}}
            for i in range(20)]
    text = json.dumps({"jobs": good + odd + good}, separators=(",", ":"))
    slow, fast = both(text)
    assert fast == slow
    assert sum(1 for r in fast if not isinstance(r, AcctJob)) == 6
    assert summary(attribute(lazily(text))) == summary(
        attribute([r for r in fast if isinstance(r, AcctJob)]))
    # NaN is JSON to the standard library only: the records around it still read the same.
    nan = text.replace('"job_id":9,', '"job_id":9,"x":NaN,')
    assert both(nan)[1] == both(nan)[0] == slow


def test_the_fast_decoder_is_used_and_the_log_says_which(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    assert acctfast.DECODER is not None and acctstream.decoder_name() == "msgspec"
    export = tmp_path / "sacct.json"
    export.write_text(sacct_export(fleet_history(set(), seed=1, jobs=50)))
    with caplog.at_level(logging.INFO, logger="gpuwarden.accounting.history"):
        history.from_files([str(export)], [])
    assert "decoding with msgspec" in caplog.text


heads = st.sampled_from(["n", "gpu-", "c.", ""])
tails = st.sampled_from(["", "-ib", ".x"])
items = st.tuples(st.integers(0, 120), st.integers(0, 5), st.booleans(), st.booleans())


def _item(lo: int, span: int, pad: bool, single: bool) -> str:
    w = 4 if pad else 0
    return str(lo).zfill(w) if single else f"{str(lo).zfill(w)}-{str(lo + span).zfill(w)}"


@given(heads, tails, st.lists(items, min_size=1, max_size=4))
def test_ranges_name_the_nodes_exactly_as_expand_does(head: str, tail: str,
                                                       its: list[Any]) -> None:
    text = f"{head}[{','.join(_item(*i) for i in its)}]{tail}"
    rs = ranges(text)
    assert rs is not None
    tally = RangeTally()
    tally.add(rs, 1, 60)
    got: Counter[str] = Counter()
    for name, _, runs, secs in tally.spread():
        got[name] += runs
        assert secs == 60 * runs
    assert got == Counter(expand(text))
    assert expanded(text) == tuple(expand(text))  # the same names in the same order


@pytest.mark.parametrize("fold_at", [2, 100_000])
def test_exposure_from_the_range_tally_matches_counting_each_node(
        monkeypatch: pytest.MonkeyPatch, fold_at: int) -> None:
    monkeypatch.setattr(rangetally, "FOLD_AT", fold_at)
    rng = random.Random(5)
    shapes = ["n[0001-0004]", "n0003", "n[3,0003]", "a[1-2],b[3-4]", "c[01-03]-ib",
              "gpu[1-2]x[1-2]", "n[0002-0003,0009]", "n0009"]
    jobs = [job(i, rng.choice(["COMPLETED", "FAILED", "TIMEOUT"]), rng.choice(shapes),
                start=1_800_000_000 + 600 * i, hours=rng.choice([0.5, 1.0, 2.25]))
            for i in range(300)]
    att = Attribution()
    tally = RangeTally()
    for lo in range(0, 300, 70):  # in batches, spread once, as history does
        attribute_runs(jobs[lo:lo + 70], {}, into=att, tally=tally)
    spread_exposure(att.exposure, tally)
    want: dict[str, list[float]] = {}
    for j in jobs:
        assert j.end_time is not None and j.start_time is not None
        for n in expand(j.nodes):
            w = want.setdefault(n, [0, 0.0])
            w[0] += 1
            w[1] += (j.end_time - j.start_time) / 3600
    assert {n: (e.jobs, round(e.hours, 9)) for n, e in att.exposure.items()} == {
        n: (int(c), round(h, 9)) for n, (c, h) in want.items()}
    assert summary(att)[2:] == summary(attribute(jobs))[2:]


def test_without_msgspec_the_standard_library_reads_the_same_and_the_log_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    export = tmp_path / "sacct.json"
    export.write_text(sacct_export(fleet_history({"n7"}, seed=3, jobs=400)))
    fast = history.from_files([str(export)], [])
    monkeypatch.setattr(acctfast, "DECODER", None)
    with caplog.at_level(logging.INFO, logger="gpuwarden.accounting.history"):
        slow = history.from_files([str(export)], [])
    assert "decoding with the standard library" in caplog.text
    assert slow.records == fast.records == 401
    assert summary(slow.attribution) == summary(fast.attribution)


@pytest.mark.parametrize("doc", range(3))
def test_the_lazy_runs_read_every_field_a_scan_reads_as_the_records_do(doc: int) -> None:
    # The report's tally reads the restart count of each run (a requeue's wait) off the lazy
    # records: it must be what the full record says.
    text = documents()[doc]
    full = [r for r in decoded(text, fast=True) if isinstance(r, AcctJob)]
    runs = lazily(text)
    fields = ("job_id", "user", "state", "nodes", "gpus", "exit_code", "start_time",
              "end_time", "failed_node", "submit_line", "restart_count")
    assert [tuple(getattr(r, f) for f in fields) for r in runs] == \
        [tuple(getattr(r, f) for f in fields) for r in full]
