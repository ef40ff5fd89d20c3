"""Accounting read at the same cost whatever its layout: compact `sacct --json` (jq -c, an
exporter without indentation) once made the fast reader stall, because "},{" is inside every
compact record and each false cut cost three failed ~1 MB decodes. Cost here is counted,
never timed: characters handed to the fast decoder, characters given to the span finder,
and standard-library decodes."""

from __future__ import annotations

import copy
import functools
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.accounting import fastdecode as acctfast
from gpuwarden.accounting import jsonspans
from gpuwarden.accounting import stream as acctstream
from gpuwarden.core.errors import SlurmParseError
from gpuwarden.slurm import parse
from gpuwarden.slurm.models import AcctJob

FIXTURE = Path(__file__).parent.parent / "fixtures" / "sacct.json"

# Text a record's strings may hold that looks like structure from outside a string.
TRICKY = ['},{', '},{"account":', '[', ']', '{"a": [1, {', 'say \\"hi\\"', 'back\\slash\\',
          'x}]}', '},\n    {\n      "account":', '/usr/bin/srun', 'naïve ✓ \u2028']


def export(n: int, tricky: bool = False) -> dict[str, Any]:
    """``n`` real records (the fixture's, renumbered); with ``tricky``, strings in each that
    hold brackets, quotes and the text between two records."""
    base = json.loads(FIXTURE.read_text())
    jobs = []
    for i in range(n):
        rec = copy.deepcopy(base["jobs"][i % len(base["jobs"])])
        rec["job_id"] = i + 1
        if tricky:
            rec["submit_line"] = "sbatch " + "".join(TRICKY[(i + k) % len(TRICKY)] for k in range(4))
            rec["name"] = TRICKY[i % len(TRICKY)]
            rec["comment"]["job"] = '"},{"' * (i % 3)
        jobs.append(rec)
    return {"jobs": jobs, "meta": base["meta"], "errors": [], "warnings": []}


def same_first_key_nested(doc: dict[str, Any]) -> dict[str, Any]:
    """Each record ends with a list of objects whose first key is the records' own first key
    ("account"): the text between two records then also occurs inside every record, so the
    reader must find where each ends by scanning."""
    for rec in doc["jobs"]:
        rec["licenses_used"] = [{"account": f"a{k}", "count": k} for k in range(40)]
    return doc


def _compact(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"))


def _slurm(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2)


LAYOUTS: dict[str, Callable[[dict[str, Any]], str]] = {
    "slurm": _slurm,
    "compact": _compact,
    "compact, spaces after , and :": json.dumps,
    "indent 4": lambda d: json.dumps(d, indent=4),
    "newlines, no indent": lambda d: json.dumps(d, indent=0),
    "tabs": lambda d: json.dumps(d, indent="\t"),
    "CRLF": lambda d: _slurm(d).replace("\n", "\r\n"),
    "escaped slashes": lambda d: _compact(d).replace("/", "\\/"),  # "/" is only in strings
    "UTF-8, not escaped": lambda d: json.dumps(d, separators=(",", ":"), ensure_ascii=False),
}


@functools.cache
def laid_out(n: int, layout: str, tricky: bool = False, nested: bool = False) -> str:
    doc = export(n, tricky)
    return LAYOUTS[layout](same_first_key_nested(doc) if nested else doc)


def read(text: str, fast: bool = True) -> list[Any]:
    stream = acctstream.AcctStream(acctstream.text_reader(io.BytesIO(text.encode())), "t",
                                   fast=fast)
    return [r if isinstance(r, AcctJob) else (type(r), str(r)) for r in stream]


def read_runs(text: str) -> list[AcctJob]:
    stream = acctstream.AcctStream(acctstream.text_reader(io.BytesIO(text.encode())), "t")
    return [r if isinstance(r, AcctJob) else r.job()  # type: ignore[attr-defined]
            for r in stream.runs() if not isinstance(r, Exception)]


def whole(text: str) -> list[Any]:
    return [r if isinstance(r, AcctJob) else (type(r), str(r))
            for r in parse.iter_acct_jobs(text)]


@dataclass
class Costs:
    decoded: int = 0  # characters handed to the fast decoder
    scanned: int = 0  # characters the span finder was given to look through
    slow: int = 0     # standard-library decodes (a record, or a retry of one)


# Standard-library decodes any read makes: the top-level keys ("jobs", "meta", "errors",
# "warnings") and the values besides "jobs", the first record (which shows the text between
# two records) and the last.
AROUND = 9


@pytest.fixture
def costs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Costs]:
    c = Costs()
    fast, spans, std = acctfast.DECODER, jsonspans.object_spans, acctstream._DECODE
    assert fast is not None

    def decoder(text: str, record: Callable[[Any], Any], lazy: bool) -> list[Any] | None:
        c.decoded += len(text)
        return fast(text, record, lazy)

    def object_spans(text: str, pos: int) -> tuple[list[tuple[int, int]], int]:
        c.scanned += len(text) - pos
        return spans(text, pos)

    def raw(text: str, pos: int) -> tuple[Any, int]:
        c.slow += 1
        return std(text, pos)
    monkeypatch.setattr(acctfast, "DECODER", decoder)
    monkeypatch.setattr(jsonspans, "object_spans", object_spans)
    monkeypatch.setattr(acctstream, "_DECODE", raw)
    yield c


@pytest.mark.parametrize("tricky", [False, True], ids=["plain", "tricky strings"])
@pytest.mark.parametrize("chunk", [997, 1 << 20])
def test_every_layout_of_the_same_records_reads_the_same(monkeypatch: pytest.MonkeyPatch,
                                                        chunk: int, tricky: bool) -> None:
    monkeypatch.setattr(acctstream, "CHUNK", chunk)
    want = whole(laid_out(60, "slurm", tricky))
    assert len(want) == 60 and all(isinstance(r, AcctJob) for r in want)
    for name in LAYOUTS:
        text = laid_out(60, name, tricky)
        assert read(text) == want, name
        assert read(text, fast=False) == want, name
        assert read_runs(text) == want, name
    if tricky:
        assert {r.name for r in want} >= set(TRICKY)


@pytest.mark.parametrize("tricky", [False, True], ids=["plain", "tricky strings"])
@pytest.mark.parametrize("nested", [False, True], ids=["", "nested like records"])
@pytest.mark.parametrize("chunk", [16384, 65536])  # a few records (~5 KB each) per chunk
@pytest.mark.parametrize("layout", ["slurm", "compact", "newlines, no indent", "CRLF",
                                    "escaped slashes"])
def test_reading_costs_about_one_pass_over_the_text_whatever_the_layout(
        monkeypatch: pytest.MonkeyPatch, costs: Costs, layout: str, chunk: int,
        nested: bool, tricky: bool) -> None:
    """The bug: compact records cost three failed decodes of a chunk each (26 s for 2,074)."""
    monkeypatch.setattr(acctstream, "CHUNK", chunk)
    text = laid_out(150, layout, tricky, nested)
    assert len(read(text)) == 150
    # At most one refused cut (the separator was inside a record): a chunk or two of waste.
    assert costs.decoded <= len(text) + 3 * chunk
    assert costs.scanned <= 2 * len(text) + 3 * chunk
    assert costs.slow <= AROUND  # not one per chunk


@pytest.mark.parametrize("layout", ["compact", "newlines, no indent"])
def test_when_the_text_between_records_also_occurs_inside_them_their_ends_are_scanned_for(
        costs: Costs, monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """A cut there is refused once; then each record's end is found by the span finder, and
    each character is still decoded about once."""
    monkeypatch.setattr(acctstream, "CHUNK", 8192)
    text = laid_out(200, layout, tricky=True, nested=True)
    assert read(text) == whole(text)
    assert costs.scanned >= len(text) // 2  # the ends were found by scanning
    assert costs.decoded <= len(text) + 3 * 8192
    assert costs.slow <= AROUND


@pytest.mark.parametrize("nested", [False, True], ids=["cut", "scanned"])
def test_a_record_nested_deeper_than_the_span_finder_looks_is_still_read(
        costs: Costs, nested: bool) -> None:
    doc = export(40)
    deep: Any = "bottom"
    for _ in range(jsonspans.MAX_DEPTH + 5):
        deep = {"in": [deep]}
    doc["jobs"][20]["extra"] = deep
    text = _compact(same_first_key_nested(doc) if nested else doc)
    assert read(text) == whole(text)
    assert costs.slow <= AROUND + 1  # that record, the slow way when scanning


def test_a_value_longer_than_many_chunks_is_decoded_a_few_times_not_once_per_chunk(
        costs: Costs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(acctstream, "CHUNK", 64)
    doc = export(3)
    doc["jobs"][1]["submit_line"] = "sbatch " + "x" * 200_000
    text = json.dumps(doc, separators=(",", ":"))
    assert read(text, fast=False) == whole(text)
    assert costs.slow <= 60  # doubling: about log2(200_000 / 64) tries per long value
    assert read(text) == whole(text)


def _until_error(text: str, fast: bool) -> tuple[list[Any], str]:
    got: list[Any] = []
    stream = acctstream.AcctStream(acctstream.text_reader(io.BytesIO(text.encode())), "t",
                                   fast=fast)
    with pytest.raises(SlurmParseError) as exc:
        got.extend(stream)
    return got, str(exc.value)


@pytest.mark.parametrize("layout", ["slurm", "compact"])
def test_a_broken_record_among_good_ones_is_the_same_clear_error_either_way(
        monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    monkeypatch.setattr(acctstream, "CHUNK", 4096)
    doc = export(120)
    doc["jobs"][90]["name"] = "BREAK-ME"
    broken = LAYOUTS[layout](doc).replace('"BREAK-ME"', "BREAK-ME")  # a bare word: not JSON
    fast, msg = _until_error(broken, fast=True)
    slow, slow_msg = _until_error(broken, fast=False)
    assert msg == slow_msg and msg.startswith("t: not JSON (") and "at character" in msg
    assert fast == slow and len(fast) >= 60  # the records before it were read
    assert str(broken.index("BREAK-ME")) in msg  # where it is


# Property: any records, any strings, any layout, any chunk size: the fast path, the slow
# path and a whole-document decode agree.
_odd = st.text(alphabet='{}[],:"\\/ aé✓\n\t\u2028', max_size=12)
_rec = st.fixed_dictionaries({
    "job_id": st.integers(1, 10**6), "name": _odd, "submit_line": _odd, "nodes": st.just("c1"),
    "state": st.fixed_dictionaries({"current": st.lists(st.sampled_from(
        ["COMPLETED", "FAILED", "NODE_FAIL"]), min_size=1, max_size=2)}),
    "tres": st.fixed_dictionaries({"allocated": st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["gres", "cpu"]), "name": st.one_of(st.sampled_from(["gpu", ""]), _odd),
        "count": st.integers(0, 8)}), max_size=3)}),
    "steps": st.lists(st.dictionaries(_odd, st.lists(_odd, max_size=2), max_size=2),
                      max_size=2),
})
_layout = st.sampled_from([{"separators": (",", ":")}, {"indent": 2}, {"indent": 0},
                           {"indent": "\t", "ensure_ascii": False}, {}])


@settings(max_examples=60, deadline=None)
@given(st.lists(_rec, min_size=1, max_size=12), _layout, st.sampled_from([16, 200, 4096]))
def test_any_records_in_any_layout_read_as_a_whole_document_reads(
        recs: list[dict[str, Any]], layout: dict[str, Any], chunk: int) -> None:
    text = json.dumps({"jobs": recs, "meta": {}}, **layout)
    saved = acctstream.CHUNK
    acctstream.CHUNK = chunk  # hypothesis runs many examples per test: no monkeypatch fixture
    try:
        want = whole(text)
        assert read(text) == want
        assert read(text, fast=False) == want
    finally:
        acctstream.CHUNK = saved


def _nest(levels: int) -> dict[str, Any]:
    """An object nested ``levels`` deep, itself included."""
    inner: Any = 1
    for _ in range(levels - 1):
        inner = [inner]
    return {"a": inner}


@pytest.mark.parametrize("text, objects, then", [
    ('[{"a": "},{"}, {"b": ["]", {"c": "\\"}"}]},3]', [{"a": "},{"}, {"b": ["]", {"c": '"}'}]}], "3"),
    ('[{"a": 1}\r\n,\t{"b": 2}]', [{"a": 1}], "{"),    # the last element is the caller's
    ('[{"a": 1}, {"b": "cut off', [{"a": 1}], "{"),       # ... as is one cut off
    ('[7, {"a": 1}, 8]', [], "7"),                         # ... or one that is not an object
    ('[{"a": "\\\\"}, {"b": "\\\\\\""}, 1]', [{"a": "\\"}, {"b": '\\"'}], "1"),
])
def test_the_span_finder_skips_strings_and_balances_brackets(
        text: str, objects: list[Any], then: str) -> None:
    spans, after = jsonspans.object_spans(text, 1)
    assert [json.loads(text[start:end]) for start, end in spans] == objects
    assert text[after:].lstrip()[:1] == then


def test_the_span_finder_looks_max_depth_levels_deep_and_no_further() -> None:
    deepest = "[" + json.dumps(_nest(jsonspans.MAX_DEPTH)) + ",1]"
    assert jsonspans.object_spans(deepest, 1)[0] == [(1, len(deepest) - 3)]
    deeper = "[" + json.dumps(_nest(jsonspans.MAX_DEPTH + 1)) + ",1]"
    assert jsonspans.object_spans(deeper, 1) == ([], 1)
