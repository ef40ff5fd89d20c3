"""Issue 38: checkpointing's node series (gpuwarden_ckpt.prom), from root's own reading of a
node's tier 0 and the shared tier: bytes and steps held, the newest save, durable lag per user
bucket; the prolog's squatters and stage-ins counted. What a user plants is never followed nor
counted as another's."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gpuwarden.ckpt import codec, nodemetrics, nodescan, stagein
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.hooks import entry
from tests.promtext import parse, value
from tests.unit.test_ckpt_jobdirs import as_user
from tests.unit.test_ckpt_stagein import env_for
from tests.unit.test_entry import node_env  # noqa: F401 - the fixture below uses it

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root reads the spools, as the hooks do")
ALICE, BOB, MALLORY = 23456, 23457, 12345  # buckets 0, 1 and 1 (uid mod 8)
CKPT = "gpuwarden_ckpt.prom"


@pytest.fixture
def roots() -> Iterator[tuple[Path, Path]]:
    """A tier-0 spool and a shared tier, both root's 1777, reachable by other uids."""
    base = tempfile.mkdtemp(prefix="gpuwarden-nodescan-")
    os.chmod(base, 0o755)
    mem, shared = Path(base) / "mem", Path(base) / "fsx"
    for d in (mem, shared):
        d.mkdir()
        os.chmod(d, 0o1777)
    try:
        yield mem, shared
    finally:
        shutil.rmtree(base)


def save(root: Path, job: str, rank: int, step: int, uid: int, size: int = 256) -> None:
    """A complete step as the job's user writes it (FsTier, the real layout)."""
    def work() -> None:
        shards, data = codec.encode({"w": np.zeros(size // 4, dtype=np.float32)})
        tier = FsTier("t", str(root), job, rank)
        tier.commit(Manifest(job.removesuffix(".peer"), step, 2, rank, tuple(shards),
                             time.time(), {}), data)
    for name in (job, f"{job}/rank-{rank:05d}"):
        if not (root / name).exists():
            (root / name).mkdir(mode=0o700)
            os.chown(root / name, uid, uid)
    assert as_user(uid, work) == 0


def step_bytes(root: Path, job: str, rank: int, step: int) -> int:
    d = root / job / f"rank-{rank:05d}" / f"step-{step:012d}"
    return sum(f.stat().st_blocks * 512 for f in d.iterdir())  # the memory they hold


def test_bytes_steps_and_newest_save_are_what_tier_0_holds(roots: tuple[Path, Path]) -> None:
    mem, _ = roots
    for rank, step in ((0, 10), (0, 20), (1, 20)):
        save(mem, "job-7", rank, step, ALICE)
    save(mem, "job-7.peer", 2, 20, ALICE)  # a replica held for a rank on another node
    (mem / "job-7" / "rank-00000" / ".tmp-step-30").mkdir()  # a save in flight: not held
    before = time.time()
    got = nodescan.scan(str(mem), "")
    want = sum(step_bytes(mem, j, r, s) for j, r, s in
               (("job-7", 0, 10), ("job-7", 0, 20), ("job-7", 1, 20), ("job-7.peer", 2, 20)))
    assert (got.steps, got.bytes, got.skipped, got.complete) == (4, want, 0, True)
    assert before - 60 < got.newest_save <= time.time()
    assert got.lag == {}  # no shared tier: no lag to report


def test_sparse_and_hard_linked_files_count_what_they_hold(roots: tuple[Path, Path]) -> None:
    mem, _ = roots
    save(mem, "job-7", 0, 10, ALICE)
    step = mem / "job-7" / "rank-00000" / f"step-{10:012d}"
    real = step_bytes(mem, "job-7", 0, 10)

    def inflate() -> None:
        with open(step / "sparse", "wb") as f:
            f.truncate(1 << 40)  # a terabyte that holds nothing
        for i in range(50):
            os.link(step / "MANIFEST.json", step / f"again-{i}")
    assert as_user(ALICE, inflate) == 0
    got = nodescan.scan(str(mem), "")
    assert got.bytes == real


def durable_then(shared: Path, job: str, step: int, uid: int) -> None:
    """A step on the shared tier, then a moment: what tier 0 commits next is later."""
    save(shared, job, 0, step, uid)
    time.sleep(1.1)  # a commit time (ctime, the kernel's) one second apart


def test_durable_lag_is_how_long_saves_went_on_without_the_shared_tier(
        roots: tuple[Path, Path]) -> None:
    mem, shared = roots
    durable_then(shared, "job-7", 10, ALICE)
    save(mem, "job-7", 0, 10, ALICE)
    assert nodescan.scan(str(mem), str(shared)).lag == {str(ALICE % 8): 0.0}  # caught up
    # The shared tier stops taking steps: tier 0 keeps only the newest (retention pruned the
    # older ones), and the lag is still the time since the last write-back.
    save(mem, "job-7", 0, 20, ALICE)
    time.sleep(1.1)
    save(mem, "job-7", 0, 30, ALICE)
    shutil.rmtree(mem / "job-7" / "rank-00000" / f"step-{10:012d}")
    shutil.rmtree(mem / "job-7" / "rank-00000" / f"step-{20:012d}")
    first = nodescan.scan(str(mem), str(shared)).lag[str(ALICE % 8)]
    assert first >= 2.0
    # The job ends (its tier 0 kept for a requeue): the lag stays what it was, never grows.
    time.sleep(1.1)
    assert nodescan.scan(str(mem), str(shared)).lag[str(ALICE % 8)] == first


def test_with_nothing_durable_yet_the_job_s_start_stands_for_the_last_write_back(
        roots: tuple[Path, Path]) -> None:
    mem, shared = roots
    (shared / "job-8").mkdir(mode=0o700)  # the prolog's, at the job's start
    os.chown(shared / "job-8", BOB, BOB)
    time.sleep(1.1)
    save(mem, "job-8", 0, 5, BOB)
    assert nodescan.scan(str(mem), str(shared)).lag[str(BOB % 8)] >= 1.0


def test_a_rank_root_cannot_read_on_the_shared_tier_has_no_lag(
        roots: tuple[Path, Path]) -> None:
    mem, shared = roots
    save(mem, "job-7", 0, 10, ALICE)
    (shared / "job-7" / "rank-00000").mkdir(parents=True)  # as if squashed: not Alice's
    os.chown(shared / "job-7", ALICE, ALICE)
    os.chown(shared / "job-7" / "rank-00000", MALLORY, MALLORY)
    assert nodescan.scan(str(mem), str(shared)).lag == {}  # unknown, never "lagging"


def test_what_another_user_plants_is_neither_followed_nor_counted(
        roots: tuple[Path, Path], tmp_path: Path) -> None:
    mem, shared = roots
    save(mem, "job-7", 0, 10, ALICE)
    # Mallory: a link to a tree shaped like a job (followed, it would add a step), a step of
    # hers inside Alice's rank (she cannot write there; root can, as a stand-in for any way it
    # got there), a squatter's entry moved aside.
    save(tmp_path, "secret", 0, 1, 0)
    os.symlink(tmp_path / "secret", mem / "job-9")
    planted = mem / "job-7" / "rank-00000" / f"step-{11:012d}"
    shutil.copytree(mem / "job-7" / "rank-00000" / f"step-{10:012d}", planted)
    for p in (planted, *planted.iterdir()):
        os.chown(p, MALLORY, MALLORY)
    (mem / ".squatted.job-3.12345.1").mkdir()
    # On the shared tier, a newer "durable" step of hers must not hide Alice's lag.
    save(shared, "job-7", 0, 10, ALICE)
    alien = shared / "job-7" / "rank-00000" / f"step-{99:012d}"
    shutil.copytree(shared / "job-7" / "rank-00000" / f"step-{10:012d}", alien)
    for p in (alien, *alien.iterdir()):
        os.chown(p, MALLORY, MALLORY)
    got = nodescan.scan(str(mem), str(shared))
    assert (got.steps, got.bytes) == (1, step_bytes(mem, "job-7", 0, 10))
    assert got.skipped == 3  # the link, her step in tier 0 and on the shared tier
    assert got.lag == {str(ALICE % 8): 0.0}  # step 10 is durable (Alice's own)


def test_one_user_s_many_directories_cannot_hide_another_s_job(
        roots: tuple[Path, Path]) -> None:
    mem, shared = roots
    durable_then(shared, "job-7", 1, ALICE)
    save(mem, "job-7", 0, 2, ALICE)
    for job in range(100, 160):  # Mallory's own job directories, each full of ranks
        d = mem / f"job-{job}"
        d.mkdir(mode=0o700)
        for r in range(20):
            (d / f"rank-{r:05d}").mkdir(mode=0o700)
            os.chown(d / f"rank-{r:05d}", MALLORY, MALLORY)
        os.chown(d, MALLORY, MALLORY)
    got = nodescan.scan(str(mem), str(shared), max_entries=200)
    assert not got.complete and got.skipped > 0  # her share ran out: said, not hidden
    assert got.steps == 1 and got.lag[str(ALICE % 8)] >= 1.0  # Alice's job read whole


def test_a_scan_past_its_time_stops_and_says_so(roots: tuple[Path, Path]) -> None:
    mem, _ = roots
    for job in range(1, 4):
        save(mem, f"job-{job}", 0, 1, ALICE)
    ticks = iter(range(1000))
    got = nodescan.scan(str(mem), "", time_s=5, mono=lambda: float(next(ticks)))
    assert not got.complete and got.steps < 3


@pytest.fixture
def node(node_env, roots: tuple[Path, Path]):  # type: ignore[no-untyped-def]  # noqa: F811
    env, _, tmp = node_env
    mem, shared = roots
    config: Config = env.config
    config = replace(config, health=replace(config.health, prom_dir=str(tmp / "prom")),
                     ckpt=CkptConfig(memory_root=str(mem), shared_root=str(shared)))
    return replace(env, config=config), tmp, mem, shared


def ckpt(tmp: Path, name: str, **labels: str) -> float | None:
    return value(tmp / "prom" / CKPT, name, node="c3", **labels)


def test_the_periodic_check_writes_the_node_s_checkpoint_series(node) -> None:  # type: ignore[no-untyped-def]
    env, tmp, mem, shared = node
    (shared / "job-7").mkdir(mode=0o700)  # the prolog's, at the job's start
    os.chown(shared / "job-7", ALICE, ALICE)
    save(mem, "job-7", 0, 10, ALICE)
    assert entry.periodic(env) == 0
    _, kinds = parse(tmp / "prom" / CKPT)
    assert kinds == {"gpuwarden_ckpt_tier0_bytes": "gauge", "gpuwarden_ckpt_tier0_steps": "gauge",
                     "gpuwarden_ckpt_last_save_timestamp_seconds": "gauge",
                     "gpuwarden_ckpt_durable_lag_seconds": "gauge",
                     "gpuwarden_ckpt_tier0_entries_skipped": "gauge",
                     "gpuwarden_ckpt_tier0_scan_complete": "gauge",
                     "gpuwarden_ckpt_squatters_moved_total": "counter",
                     "gpuwarden_ckpt_stageins_total": "counter"}
    assert ckpt(tmp, "gpuwarden_ckpt_tier0_bytes") == step_bytes(mem, "job-7", 0, 10)
    assert ckpt(tmp, "gpuwarden_ckpt_tier0_steps") == 1
    # Nothing on the shared tier yet: the lag runs from the job's start (its shared directory).
    assert ckpt(tmp, "gpuwarden_ckpt_durable_lag_seconds", user_bucket=str(ALICE % 8)) >= 0
    assert ckpt(tmp, "gpuwarden_ckpt_tier0_scan_complete") == 1
    assert ckpt(tmp, "gpuwarden_ckpt_squatters_moved_total") == 0
    assert not env.problems


def test_the_prolog_s_squatters_are_counted_and_shown_by_the_next_check(node) -> None:  # type: ignore[no-untyped-def]
    env, tmp, mem, shared = node
    env = replace(env, environ={**env.environ, "SLURM_JOB_ID": "612",
                                "SLURM_JOB_UID": str(ALICE), "SLURM_JOB_GID": str(ALICE)})
    for root in (mem, shared):
        (root / "job-612").mkdir()
        os.chown(root / "job-612", MALLORY, MALLORY)
    assert entry.prolog(env) == 0
    assert entry.periodic(replace(env, problems={})) == 0
    assert ckpt(tmp, "gpuwarden_ckpt_squatters_moved_total") == 2  # tier 0 and shared
    assert ckpt(tmp, "gpuwarden_ckpt_stageins_total", outcome="staged") == 0


def test_a_scan_that_fails_leaves_its_series_out_and_says_so(
        node, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    env, tmp, mem, _ = node
    os.chmod(mem, 0o777)  # not sticky: a spool anyone may swap entries in is refused
    assert entry.periodic(env) == 0
    assert ckpt(tmp, "gpuwarden_ckpt_tier0_bytes") is None
    assert ckpt(tmp, "gpuwarden_ckpt_tier0_scan_complete") == 0
    assert ckpt(tmp, "gpuwarden_ckpt_squatters_moved_total") == 0
    assert "checkpoint tier 0" in caplog.text and "not read" in caplog.text


@pytest.mark.timeout(60)
def test_a_hung_scan_is_given_up_at_its_deadline(monkeypatch: pytest.MonkeyPatch,
                                                 roots: tuple[Path, Path]) -> None:
    from gpuwarden.ckpt.childcall import ChildTimeout

    monkeypatch.setattr(nodescan, "scan", lambda *a, **k: time.sleep(3600))  # a hung NFS
    with pytest.raises(ChildTimeout):
        nodemetrics.scan_in_child(str(roots[0]), "", 0.5)


@pytest.mark.parametrize(("code", "outcome"), [(0, "staged"), (1, "failed"), (2, "failed"),
                                               (None, "failed"), (stagein.NOTHING, "")])
def test_the_prolog_s_stage_in_outcome_is_what_the_copy_said(
        tmp_path: Path, code: int | None, outcome: str) -> None:
    cfg = CkptConfig(memory_root=str(tmp_path / "shm"), shared_root=str(tmp_path / "fsx"))
    assert stagein.stage_in(cfg, env_for(), lambda work, req: code) == outcome
