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

from gpuwarden.ckpt import codec, jobsheld, nodemetrics, nodescan, stagein
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
def roots() -> Iterator[tuple[Path, Path, Path]]:
    """A tier-0 spool and a shared tier, both root's 1777, reachable by other uids, and root's
    state directory (where the prolog records the jobs it made directories for)."""
    base = tempfile.mkdtemp(prefix="gpuwarden-nodescan-")
    os.chmod(base, 0o755)
    mem, shared, state = Path(base) / "mem", Path(base) / "fsx", Path(base) / "state"
    for d in (mem, shared):
        d.mkdir()
        os.chmod(d, 0o1777)
    try:
        yield mem, shared, state
    finally:
        shutil.rmtree(base)


Roots = tuple[Path, Path, Path]


def started(state: Path, job: str, uid: int) -> None:
    """What the prolog records when it makes the job's directories (this run's start: now)."""
    jobsheld.record(str(state), job.removeprefix("job-"), uid, time.time())


def scan(roots: Roots, shared: bool = True, **kw: object) -> nodescan.Held:
    mem, fsx, state = roots
    return nodescan.scan(str(mem), str(fsx) if shared else "", str(state), **kw)  # type: ignore[arg-type]


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


def later() -> None:
    time.sleep(1.1)  # commit times (ctime, the kernel's) a second apart


def test_bytes_steps_and_newest_save_are_what_tier_0_holds(roots: Roots) -> None:
    mem, _, state = roots
    started(state, "job-7", ALICE)
    for rank, step in ((0, 10), (0, 20), (1, 20)):
        save(mem, "job-7", rank, step, ALICE)
    save(mem, "job-7.peer", 2, 20, ALICE)  # a replica held for a rank on another node
    (mem / "job-7" / "rank-00000" / ".tmp-step-30").mkdir()  # a save in flight: not held
    before = time.time()
    got = scan(roots, shared=False)
    want = sum(step_bytes(mem, j, r, s) for j, r, s in
               (("job-7", 0, 10), ("job-7", 0, 20), ("job-7", 1, 20), ("job-7.peer", 2, 20)))
    assert (got.steps, got.bytes, got.skipped, got.complete) == (4, want, 0, True)
    assert before - 60 < got.newest_save <= time.time()
    assert got.lag == {}  # no shared tier: no lag to report


def test_only_jobs_root_made_directories_for_are_read(roots: Roots) -> None:
    mem, _, state = roots
    started(state, "job-7", ALICE)
    save(mem, "job-7", 0, 10, ALICE)
    save(mem, "job-8", 0, 10, MALLORY)  # made by hand, no prolog: not a job of this node
    for i in range(3000):  # junk in the world-writable spool is never even listed
        (mem / f"junk-{i}").touch()
    got = scan(roots, shared=False)
    assert (got.steps, got.bytes, got.complete) == (1, step_bytes(mem, "job-7", 0, 10), True)


def test_a_record_whose_directories_are_gone_is_dropped(roots: Roots) -> None:
    _, _, state = roots
    started(state, "job-5", ALICE)  # a reboot emptied tier 0 since
    assert scan(roots, shared=False).steps == 0
    assert jobsheld.held(str(state)) == ([], 0)


def test_sparse_and_hard_linked_files_count_what_they_hold(roots: Roots) -> None:
    mem, _, state = roots
    started(state, "job-7", ALICE)
    save(mem, "job-7", 0, 10, ALICE)
    step = mem / "job-7" / "rank-00000" / f"step-{10:012d}"
    real = step_bytes(mem, "job-7", 0, 10)

    def inflate() -> None:
        with open(step / "sparse", "wb") as f:
            f.truncate(1 << 40)  # a terabyte that holds nothing
        for i in range(50):
            os.link(step / "MANIFEST.json", step / f"again-{i}")
    assert as_user(ALICE, inflate) == 0
    assert scan(roots, shared=False).bytes == real


def test_durable_lag_is_how_long_saves_went_on_without_the_shared_tier(roots: Roots) -> None:
    mem, shared, state = roots
    started(state, "job-7", ALICE)
    save(shared, "job-7", 0, 10, ALICE)
    later()
    save(mem, "job-7", 0, 10, ALICE)
    assert scan(roots).lag == {str(ALICE % 8): 0.0}  # caught up
    # The shared tier stops taking steps: tier 0 keeps only the newest (retention pruned the
    # older ones), and the lag is still the time since the last write-back.
    save(mem, "job-7", 0, 20, ALICE)
    later()
    save(mem, "job-7", 0, 30, ALICE)
    shutil.rmtree(mem / "job-7" / "rank-00000" / f"step-{10:012d}")
    shutil.rmtree(mem / "job-7" / "rank-00000" / f"step-{20:012d}")
    first = scan(roots).lag[str(ALICE % 8)]
    assert first >= 2.0
    # The job ends (its tier 0 kept for a requeue): the lag stays what it was, never grows.
    later()
    assert scan(roots).lag[str(ALICE % 8)] == first


def test_a_requeued_run_is_measured_from_its_own_start(roots: Roots) -> None:
    mem, shared, state = roots
    save(shared, "job-7", 0, 10, ALICE)  # the last run's durable step
    later()  # the job waits in the queue
    started(state, "job-7", ALICE)  # requeued: this run's prolog
    save(mem, "job-7", 0, 11, ALICE)  # its first save, not yet written back
    assert scan(roots).lag[str(ALICE % 8)] < 1.0  # not the time it waited


def test_with_nothing_durable_the_lag_runs_from_the_run_s_start(roots: Roots) -> None:
    mem, _, state = roots
    started(state, "job-8", BOB)
    later()
    save(mem, "job-8", 0, 5, BOB)  # no directory of job 8 on the shared tier at all
    assert scan(roots).lag[str(BOB % 8)] >= 1.0


def test_a_shared_tier_gone_is_nothing_durable_not_no_lag(roots: Roots) -> None:
    mem, shared, state = roots
    started(state, "job-7", ALICE)
    save(shared, "job-7", 0, 10, ALICE)
    later()
    save(mem, "job-7", 0, 20, ALICE)
    shutil.rmtree(shared)  # the mount gone: an empty mount point, no spool
    got = scan(roots)
    assert got.lag[str(ALICE % 8)] >= 1.0 and got.complete


def test_a_rank_root_may_not_read_on_the_shared_tier_has_no_lag(roots: Roots) -> None:
    mem, shared, state = roots
    started(state, "job-7", ALICE)
    save(mem, "job-7", 0, 10, ALICE)
    (shared / "job-7" / "rank-00000").mkdir(parents=True)  # as if squashed: not Alice's
    os.chown(shared / "job-7", ALICE, ALICE)
    os.chown(shared / "job-7" / "rank-00000", MALLORY, MALLORY)
    assert scan(roots).lag == {}  # unknown, never "lagging"


def test_what_another_user_plants_is_neither_followed_nor_counted(
        roots: Roots, tmp_path: Path) -> None:
    mem, shared, state = roots
    started(state, "job-7", ALICE)
    save(mem, "job-7", 0, 10, ALICE)
    # Mallory: a link to a tree shaped like a job in place of Alice's peer directory (followed,
    # it would add a step), a step of hers inside Alice's rank (she cannot write there; root
    # can, as a stand-in for any way it got there).
    save(tmp_path, "secret", 0, 1, 0)
    os.symlink(tmp_path / "secret", mem / "job-7.peer")
    planted = mem / "job-7" / "rank-00000" / f"step-{11:012d}"
    shutil.copytree(mem / "job-7" / "rank-00000" / f"step-{10:012d}", planted)
    for p in (planted, *planted.iterdir()):
        os.chown(p, MALLORY, MALLORY)
    # On the shared tier, a newer "durable" step of hers must not hide Alice's lag.
    save(shared, "job-7", 0, 10, ALICE)
    alien = shared / "job-7" / "rank-00000" / f"step-{99:012d}"
    shutil.copytree(shared / "job-7" / "rank-00000" / f"step-{10:012d}", alien)
    for p in (alien, *alien.iterdir()):
        os.chown(p, MALLORY, MALLORY)
    got = scan(roots)
    assert (got.steps, got.bytes) == (1, step_bytes(mem, "job-7", 0, 10))
    assert got.skipped == 2  # the link, her step in tier 0
    assert got.lag == {str(ALICE % 8): 0.0}  # step 10 is durable (Alice's own)


def test_one_user_s_huge_job_cannot_hide_another_s(roots: Roots) -> None:
    mem, shared, state = roots
    started(state, "job-7", ALICE)
    save(shared, "job-7", 0, 1, ALICE)
    later()
    save(mem, "job-7", 0, 2, ALICE)
    started(state, "job-100", MALLORY)  # her own job on the node, full of ranks
    d = mem / "job-100"
    d.mkdir(mode=0o700)
    for r in range(1200):
        (d / f"rank-{r:05d}").mkdir(mode=0o700)
        os.chown(d / f"rank-{r:05d}", MALLORY, MALLORY)
    os.chown(d, MALLORY, MALLORY)
    got = scan(roots, max_entries=200)
    assert got.skipped > 0 and got.complete  # her share ran out: her own, counted
    assert got.steps == 1 and got.lag[str(ALICE % 8)] >= 1.0  # Alice's job read whole


def test_an_owner_not_reached_in_time_makes_the_scan_incomplete(roots: Roots) -> None:
    mem, _, state = roots
    for job, uid in (("job-1", ALICE), ("job-2", BOB), ("job-3", MALLORY)):
        started(state, job, uid)
        save(mem, job, 0, 1, uid)
    ticks = iter(range(0, 100_000, 10))
    got = scan(roots, shared=False, time_s=5, mono=lambda: float(next(ticks)))
    assert not got.complete and got.steps < 3


def test_an_error_in_one_job_leaves_the_others_read(roots: Roots,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    mem, _, state = roots
    for job, uid in (("job-1", ALICE), ("job-2", MALLORY)):
        started(state, job, uid)
        save(mem, job, 0, 1, uid)
    real = nodescan._steps

    def steps(rank_fd: int, owner: int, *a: object, **k: object):  # type: ignore[no-untyped-def]
        if owner == MALLORY:
            raise FileNotFoundError("removed under the scan")
        return real(rank_fd, owner, *a, **k)  # type: ignore[arg-type]
    monkeypatch.setattr(nodescan, "_steps", steps)
    got = scan(roots, shared=False)
    assert got.steps == 1 and got.skipped == 1 and got.complete


@pytest.fixture
def node(node_env, roots: Roots):  # type: ignore[no-untyped-def]  # noqa: F811
    env, _, tmp = node_env
    mem, shared, _ = roots
    config: Config = env.config
    config = replace(config, health=replace(config.health, prom_dir=str(tmp / "prom")),
                     ckpt=CkptConfig(memory_root=str(mem), shared_root=str(shared)))
    return replace(env, config=config), tmp, mem, shared


def ckpt(tmp: Path, name: str, **labels: str) -> float | None:
    return value(tmp / "prom" / CKPT, name, node="c3", **labels)


def test_the_periodic_check_writes_the_node_s_checkpoint_series(node) -> None:  # type: ignore[no-untyped-def]
    env, tmp, mem, _ = node
    started(Path(env.config.health.state_dir), "job-7", ALICE)
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
    # Nothing on the shared tier yet: the lag runs from the run's start.
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
                                                 roots: Roots) -> None:
    from gpuwarden.ckpt.childcall import ChildTimeout

    monkeypatch.setattr(nodescan, "scan", lambda *a, **k: time.sleep(3600))  # a hung NFS
    with pytest.raises(ChildTimeout):
        nodemetrics.scan_in_child(str(roots[0]), "", str(roots[2]), 0.5)


@pytest.mark.parametrize(("code", "outcome"), [(0, "staged"), (1, "failed"), (2, "failed"),
                                               (None, "failed"), (stagein.NOTHING, "")])
def test_the_prolog_s_stage_in_outcome_is_what_the_copy_said(
        tmp_path: Path, code: int | None, outcome: str) -> None:
    cfg = CkptConfig(memory_root=str(tmp_path / "shm"), shared_root=str(tmp_path / "fsx"))
    assert stagein.stage_in(cfg, env_for(), lambda work, req: code) == outcome


def test_without_a_textfile_directory_the_prolog_records_nothing(node) -> None:  # type: ignore[no-untyped-def]
    env, _, _, _ = node
    env = replace(env, config=replace(env.config, health=replace(env.config.health,
                                                                 prom_dir="")),
                  environ={**env.environ, "SLURM_JOB_ID": "613", "SLURM_JOB_UID": str(ALICE),
                           "SLURM_JOB_GID": str(ALICE)})
    assert entry.prolog(env) == 0
    assert jobsheld.held(env.config.health.state_dir) == ([], 0)
