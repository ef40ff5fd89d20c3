"""The year report's peak memory and time (issue 36): the store read writes its plain blamed
runs a batch at a time rather than holding them all to its end, a Blame has no __dict__ (the
report's cards hold one per blamed run), a fit's log-likelihood makes no per-entry array, the
entries and blames are grouped by node with a radix sort, and the store's records are made
without the frozen dataclass's __init__; every result is the one the old way gives."""

from __future__ import annotations

import pickle
import tracemalloc
from typing import Any

import numpy as np
import polars as pl

from gpuwarden.accounting import counted
from gpuwarden.accounting.attribution import Attribution
from gpuwarden.accounting.blames import Blame, Blames
from gpuwarden.accounting.incidence import IncidenceBuilder, grouped
from gpuwarden.accounting.rangetally import RangeTally
from gpuwarden.accounting.store import scan, schema
from gpuwarden.lemon.inference import fit
from gpuwarden.slurm.models import AcctJob

T0 = 1_700_000_000


def _gang_failures(n: int) -> list[AcctJob]:
    return [AcctJob(i, "j", "u", "FAILED", "", "gpu", "n[1-2]" if i % 2 else "n[3-5]", 1, 8, 1,
                    None, None, T0 + 100 * i, T0 + 100 * i + 50, None, "", "sbatch x.sh")
            for i in range(1, n + 1)]


def _stored(jobs: list[AcctJob]) -> Attribution:
    rows = [tuple(getattr(j, n) for n in schema.NAMES) for j in jobs]
    lf = pl.DataFrame(rows, schema=schema.SCHEMA, orient="row").lazy().with_row_index("rid")
    att = Attribution()
    scan.attribute(lf, att, {}, {}, {}, 3600.0, RangeTally())
    return att


def _columns(att: Attribution) -> tuple[Any, ...]:
    inc, b = att.incidence, att.blames
    return (list(b), list(b.run), list(inc.node), list(inc.ptr), list(inc.job),
            list(inc.end), list(inc.user), list(inc.script), dict(att.spread_by_size))


def test_plain_blamed_runs_are_written_a_batch_at_a_time(monkeypatch: Any) -> None:
    """Never more than `counted.FLUSH_AT` held at once (a year's million were half a GiB of
    the report's peak), and the attribution the same as when all are written at the end."""
    jobs = _gang_failures(7)
    monkeypatch.setattr(counted, "FLUSH_AT", 10**9)
    whole = _columns(_stored(jobs))
    held: list[int] = []
    flush = counted.Judge.flush

    def watched(self: counted.Judge) -> None:
        held.append(len(self._plain))
        flush(self)

    monkeypatch.setattr(counted.Judge, "flush", watched)
    monkeypatch.setattr(counted, "FLUSH_AT", 2)
    assert _columns(_stored(jobs)) == whole
    assert max(held) == 2 and sum(held) == 7


def test_a_blame_has_slots_not_a_dict() -> None:
    """About 170 bytes a Blame with its floats, not 390: read back, compared, hashed and
    pickled as before."""
    b = Blames()
    b.add_run(b.numbers(("n1", "n2")), 0.5, 7, 10.0, "r", 2, False, 3.0, 8)
    got = next(b.firsts())
    assert not hasattr(got, "__dict__")
    assert got == Blame("n1", 0.5, 7, 10.0, "r", 2, False, 3.0, 8)
    assert pickle.loads(pickle.dumps(got)) == got and hash(got) == hash(Blame(*_fields(got)))
    b.add_runs([b.numbers((f"m{i}",)) for i in range(10_000)], [1.0] * 10_000,
               list(range(10_000)), [float(T0 + i) for i in range(10_000)], ["x"] * 10_000,
               [1] * 10_000, [True] * 10_000, [float(T0)] * 10_000, [8] * 10_000)
    tracemalloc.start()
    try:
        kept = list(b.firsts())
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(kept) == 10_001 and size / len(kept) < 250


def _fields(b: Blame) -> tuple[Any, ...]:
    return (b.node, b.weight, b.job_id, b.at, b.reason, b.size, b.pinned, b.started, b.gpus)


def test_a_fits_loglik_makes_no_per_entry_array() -> None:
    """200,000 entries: a count of them by row made 16 bytes an entry (3 MB here; at a year,
    the peak of the report); the rows' flags reduced in place make none, with the same
    log-likelihood."""
    b = IncidenceBuilder()
    nodes = [f"n{i}" for i in range(400)]
    for r in range(4000):
        b.add_plain_failures([r], [float(r)], [1.0], [3], [b.node_numbers(
            nodes[(r * 7) % 350:(r * 7) % 350 + 50])], ["u"], [""], [False])
    b.add_failure(None, 1.0, 0.0, 0, [], [])  # a row without entries
    inc = b.freeze({n: 100.0 for n in nodes})
    f = fit(inc)
    counted_rows = np.bincount(inc.entry_row(), weights=f.use, minlength=inc.rows) > 0
    if f.bg_use is not None:
        counted_rows |= f.bg_use > 0
    with np.errstate(divide="ignore"):
        want = (float(np.log(f.row_rate[counted_rows]).sum())
                - float((f.rate * inc.node_hours).sum())
                - float((f.background * inc.bucket_hours).sum()))
    tracemalloc.start()
    try:
        got = f.loglik(inc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == want
    assert peak < 4 * len(inc.node)


def test_grouping_by_node_is_the_stable_argsort() -> None:
    """As uint16 up to 65,536 nodes (numpy's radix sort), as given beyond: the same order."""
    rng = np.random.default_rng(7)
    for n in (1, 3, 12_500, 1 << 16, (1 << 16) + 1, 100_000):
        codes = rng.integers(0, n, 50_000).astype(np.int32)
        codes[:100] = n - 1
        got = grouped(codes, n)
        assert got.dtype == np.int32
        assert got.tolist() == np.argsort(codes, kind="stable").tolist()
    assert grouped(np.zeros(0, dtype=np.int64), 0).tolist() == []


def test_the_stores_records_are_the_dataclasss() -> None:
    """Filled directly, each record equals (and hashes as) the one AcctJob(...) makes."""
    jobs = [*_gang_failures(3), AcctJob(9, "n", "u", "COMPLETED", "None", "p", "n1", 1, 0,
                                        None, 9, None, None, None, None)]
    df = pl.DataFrame([tuple(getattr(j, n) for n in schema.NAMES) for j in jobs],
                      schema=schema.SCHEMA, orient="row")
    got = schema.jobs(df)
    assert got == jobs and [hash(j) for j in got] == [hash(j) for j in jobs]
    assert [repr(j) for j in got] == [repr(j) for j in jobs]
    read = schema.jobs(df.select(*schema.READ))  # the unread columns as `schema.UNREAD`
    assert [(j.name, j.state_reason, j.num_nodes, j.signal) for j in read] == \
        [("", "", 0, None)] * len(jobs)
