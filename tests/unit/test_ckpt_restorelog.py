"""Restore times per tier (issue 16: the report's "parallel filesystem vs object store" said
"not in accounting" and showed nothing): each rank records its restore on the shared tier,
the report reads every job's records as untrusted input and puts each tier's median on the
page."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from gpuwarden.ckpt import restorelog
from gpuwarden.ckpt.job import JobCheckpointer, JobEnv
from gpuwarden.ckpt.restorelog import RestoreRecord, parse, per_tier, read_records
from gpuwarden.cli import cli
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.config.context import Context
from gpuwarden.lemon.scoring import ScoreConfig
from gpuwarden.report.build import build
from gpuwarden.report.tradeoffs import RestoreTimes
from tests.unit.test_report_numbers import LEAVES, OPTS, T0, history


def _coord(root: Path, job: str) -> Path:
    d = root / job / "coord"
    d.mkdir(parents=True, mode=0o700, exist_ok=True)
    (root / job).chmod(0o700)
    root.chmod(0o1777)
    return d


def _plant(coord: Path, rec: RestoreRecord) -> None:
    (coord / rec.name).write_text(json.dumps(rec.doc()))


def _rec(job: str = "job-1", rank: int = 0, tier: str = "shared", seconds: float = 2.0,
         run: str = "r1-s0", at: float = T0 + 3600) -> RestoreRecord:
    return RestoreRecord(job, rank, run, 10, tier, 1 << 30, seconds, at)


def test_a_rank_that_restores_records_its_tier_bytes_and_time(tmp_path: Path) -> None:
    cfg = CkptConfig(memory_root=str(tmp_path / "m"), shared_root=str(tmp_path / "s"),
                     peer_replicas=0)
    ck = JobCheckpointer(cfg, JobEnv("42", 0, 1, 0, "0", "n1"))
    ck.save(5, {"w": np.arange(1 << 16, dtype=np.float32)})
    assert ck.finish(5, timeout=60)
    again = JobCheckpointer(cfg, JobEnv("42", 0, 1, 1, "0", "n1"))
    got = again.restore()
    again.finish(None)
    assert got is not None and got.tier == "memory"
    records, skipped = read_records(str(tmp_path / "s"))
    assert skipped == []
    [r] = records
    assert (r.job, r.rank, r.run, r.step, r.tier) == ("job-42", 0, "r1-s0", 5, "memory")
    assert r.bytes == got.manifest.total_bytes >= 4 << 16 and 0 < r.seconds < 60


def test_each_tier_gets_its_median_p90_and_speed() -> None:
    recs = [_rec(job=f"job-{i}", tier="shared", seconds=s)
            for i, s in enumerate((1.0, 2.0, 3.0, 4.0, 100.0))]
    recs += [_rec(job="job-8", tier="s3", seconds=30.0), _rec(job="job-9", tier="memory",
                                                              seconds=0.5)]
    by = {t.tier: t for t in per_tier(recs)}
    assert list(by) == ["memory", "shared", "s3"]  # fastest tier first
    assert (by["shared"].restores, by["shared"].median_s, by["shared"].p90_s) == (5, 3.0, 100.0)
    assert by["s3"].median_gib_s == pytest.approx(1 / 30)


def test_a_job_of_many_ranks_is_one_restore_taking_its_slowest_ranks_time() -> None:
    # Each rank records its own read; the job waited for the slowest (the review counted an
    # 8-rank job as 8 restores at the median rank's time).
    recs = [_rec(rank=r, tier="memory" if r < 7 else "s3", seconds=20.0 + r * (r == 7) * 110 / 7)
            for r in range(8)]
    [t] = per_tier(recs)
    assert (t.tier, t.restores, t.median_s) == ("s3", 1, 130.0)


def test_a_record_too_deep_for_the_json_parser_is_skipped_not_fatal(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    coord = _coord(root, "job-1")
    (coord / _rec(rank=0).name).write_text("[" * 4000)
    _plant(coord, _rec(rank=1))
    records, skipped = read_records(str(root))
    assert [r.rank for r in records] == [1]
    assert len(skipped) == 1 and "not JSON" in skipped[0].why


@pytest.mark.parametrize(("doc", "why"), [
    ({"tier": "tape"}, "tier: expected one of"),
    ({"seconds": -1}, "seconds: expected a finite number"),
    ({"seconds": "1e400"}, "seconds: expected a finite number"),
    ({"bytes": True}, "bytes: expected a non-negative integer"),
    ({"job": "job-2"}, "found in job-1"),  # filed under another job's directory
    ({"job": "job-1\n\x1b[31mCRITICAL forged"}, r"names job 'job-1\\n"),  # no raw newline in a log
    ({"rank": 3}, "found as"),
    ({"extra": 1}, "expected exactly the fields"),
])
def test_a_malformed_record_names_what_is_wrong(doc: dict[str, object], why: str) -> None:
    body = {**_rec().doc(), **doc}
    with pytest.raises(restorelog.BadRecord, match=why):
        parse(json.dumps(body).encode(), "job-1", _rec().name)


def test_records_a_user_planted_as_links_fifos_or_another_users_files_are_skipped_and_named(
        tmp_path: Path) -> None:
    root = tmp_path / "shared"
    coord = _coord(root, "job-1")
    _plant(coord, _rec(rank=0))
    secret = tmp_path / "secret"
    secret.write_text(json.dumps(_rec(rank=1).doc()))
    os.symlink(secret, coord / _rec(rank=1).name)
    os.mkfifo(coord / _rec(rank=2).name)  # read without O_NONBLOCK, the report would hang
    _plant(coord, _rec(rank=3))
    os.chown(coord / _rec(rank=3).name, 4242, 4242)
    (coord / _rec(rank=4).name).write_text("x" * 5000)
    records, skipped = read_records(str(root))
    assert [r.rank for r in records] == [0]
    why = {Path(s.where).name: s.why for s in skipped}
    assert "a link" in why[_rec(rank=1).name]
    assert "not a regular file" in why[_rec(rank=2).name]
    assert "uid 4242" in why[_rec(rank=3).name]
    assert "5000 bytes" in why[_rec(rank=4).name]


def test_the_report_shows_each_tiers_median_restore_and_what_the_choice_is_worth() -> None:
    times = RestoreTimes("/fsx", per_tier([_rec(job="job-1", tier="shared", seconds=60.0),
                                           _rec(job="job-2", tier="s3", seconds=660.0)]),
                         skipped=1)
    rep = build(history(LEAVES), OPTS, ScoreConfig(), restores=times)
    t = next(t for t in rep.tradeoffs if t.key == "filesystem_vs_object_store")
    fig = {f.label: f.value for f in t.figures}
    assert fig["restore time from the parallel filesystem (median)"] == 60.0  # seconds
    assert fig["restore time from the object store (median)"] == 660.0
    # Runs 2 and 6 held 32 GPUs; 10 more minutes each: 32 * 10 / 60 GPU-hours.
    assert fig["object store instead of the filesystem, for these runs"] == 5.33
    assert any("1 restore records could not be read" in m for m in t.missing)


def test_report_reads_the_records_under_ckpt_root_and_refuses_a_missing_one(
        tmp_path: Path) -> None:
    from gpuwarden.accounting.calibrate import solve
    from gpuwarden.fleet.simulate import Fleet, write_history

    out = tmp_path / "hist"
    w = write_history(solve(), Fleet(nodes=128, days=2, seed=3), out)
    assert w.files
    args = ["report", "--from", str(out / "sacct"), "--events", str(out / "events.txt"),
            "-o", str(tmp_path / "r.html"), "--json", str(tmp_path / "r.json")]
    res = CliRunner().invoke(cli, [*args, "--ckpt-root", str(tmp_path / "nowhere")],
                             obj=Context())
    assert res.exit_code == 2 and "--ckpt-root" in res.output and "no such directory" in res.output
    root = tmp_path / "shared"
    doc = json.loads((out / "sacct").glob("*.json").__next__().read_text())
    at = float(doc["jobs"][0]["time"]["start"]) + 60
    _plant(_coord(root, "job-7"), _rec(job="job-7", seconds=90.0, at=at))
    res = CliRunner().invoke(cli, [*args, "--ckpt-root", str(root)], obj=Context())
    assert res.exit_code == 0, res.output
    t = next(t for t in json.loads((tmp_path / "r.json").read_text())["tradeoffs"]
             if t["key"] == "filesystem_vs_object_store")
    fig = {f["label"]: f["value"] for f in t["figures"]}
    assert fig["restore time from the parallel filesystem (median)"] == 90.0


def _hostile(root: Path, job: int, files: int, junk: bool = False) -> None:
    coord = _coord(root, f"job-{job}")
    for rank in range(files):
        rec = _rec(job=f"job-{job}", rank=rank)
        if junk:
            (coord / rec.name).write_text("{")
        else:
            _plant(coord, rec)
    for p in (root / f"job-{job}", coord, *coord.iterdir()):
        os.chown(p, 6666, 6666)


def test_one_user_filling_the_record_cap_leaves_the_other_users_restores_on_the_page(
        tmp_path: Path) -> None:
    # A hostile user files records in job directories of their own making: past their own
    # share they are left out, never the others' records.
    root = tmp_path / "shared"
    for j in range(10, 14):
        _hostile(root, j, 3)
    _plant(_coord(root, "job-2"), _rec(job="job-2", rank=0))  # older than all of them
    records, skipped = read_records(str(root), per_owner=5, in_all=7)
    assert [r.job for r in records if r.owner != 6666] == ["job-2"]
    assert sum(r.owner == 6666 for r in records) == 5
    assert {r.job for r in records if r.owner == 6666} == {"job-13", "job-12"}  # newest first
    whys = {s.why: (s.records, s.capped) for s in skipped}
    assert whys["1 record files not read: uid 6666 has used its share of 5"] == (1, True)
    assert whys["2 job directories of uid 6666 not read: it has used its share of 5 record "
                "files"] == (0, True)


def test_junk_files_use_up_their_owners_share_and_a_few_log_lines(tmp_path: Path) -> None:
    # Malformed files cost the share as records do, and past 20 lines the rest is one sum:
    # one user's junk never buries other users' lines nor grows without bound.
    root = tmp_path / "shared"
    for j in range(10, 60):
        _hostile(root, j, 20, junk=True)
    _plant(_coord(root, "job-2"), _rec(job="job-2", rank=0))
    records, skipped = read_records(str(root), per_owner=100)
    assert [r.job for r in records] == ["job-2"]
    listed = [s for s in skipped if "not JSON" in s.why]
    assert len(listed) == restorelog.LINES_PER_OWNER
    assert any(s.why.startswith("80 more records of uid 6666 left out") for s in skipped)
    assert any("45 job directories of uid 6666 not read" in s.why for s in skipped)
    assert len(skipped) < 30


def test_the_cap_in_all_says_it_is_the_cap_in_all(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    _hostile(root, 10, 3)
    _hostile(root, 5, 1)
    records, skipped = read_records(str(root), per_owner=100, in_all=2)
    assert len(records) == 2
    whys = [s.why for s in skipped]
    assert "1 records not counted: 2 records kept in all" in whys
    assert "1 older job directories not read: 2 records kept in all" in whys
