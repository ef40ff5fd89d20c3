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

from gpuwarden.ckpt import codec, nodemetrics, nodescan
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.hooks import entry
from tests.promtext import parse, value
from tests.unit.test_ckpt_jobdirs import as_user
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
    return sum(f.stat().st_size for f in d.iterdir())


def test_bytes_steps_and_newest_save_are_what_tier_0_holds(roots: tuple[Path, Path]) -> None:
    mem, _ = roots
    for rank, step in ((0, 10), (0, 20), (1, 20)):
        save(mem, "job-7", rank, step, ALICE)
    save(mem, "job-7.peer", 2, 20, ALICE)  # a replica held for a rank on another node
    (mem / "job-7" / "rank-00000" / ".tmp-step-30").mkdir()  # a save in flight: not held
    before = time.time()
    got = nodescan.scan(str(mem), "", time.time())
    want = sum(step_bytes(mem, j, r, s) for j, r, s in
               (("job-7", 0, 10), ("job-7", 0, 20), ("job-7", 1, 20), ("job-7.peer", 2, 20)))
    assert (got.steps, got.bytes, got.skipped) == (4, want, 0)
    assert before - 60 < got.newest_save <= time.time()
    assert got.lag == {}  # no shared tier: no lag to report


def test_durable_lag_is_the_age_of_the_oldest_step_not_on_the_shared_tier(
        roots: tuple[Path, Path]) -> None:
    mem, shared = roots
    for step in (10, 20):
        save(mem, "job-7", 0, step, ALICE)
    save(mem, "job-8", 0, 5, BOB)
    save(shared, "job-7", 0, 10, ALICE)  # step 20 waits; Bob's job has nothing durable
    later = time.time() + 100
    lag = nodescan.scan(str(mem), str(shared), later).lag
    assert set(lag) == {str(ALICE % 8), str(BOB % 8)}
    assert all(100 <= v < 160 for v in lag.values()), lag
    save(shared, "job-7", 0, 20, ALICE)
    lag = nodescan.scan(str(mem), str(shared), later).lag
    assert lag[str(ALICE % 8)] == 0 and lag[str(BOB % 8)] >= 100


def test_what_another_user_plants_is_neither_followed_nor_counted(
        roots: tuple[Path, Path], tmp_path: Path) -> None:
    mem, shared = roots
    save(mem, "job-7", 0, 10, ALICE)
    # Mallory: a link to root's files as a job, a step of hers inside Alice's rank (she cannot
    # write there; root can, as a stand-in for any way it got there), a squatter's entry.
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "MANIFEST.json").write_bytes(b"x" * 10_000)
    os.symlink(secret, mem / "job-9")
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
    got = nodescan.scan(str(mem), str(shared), time.time() + 50)
    assert (got.steps, got.bytes) == (1, step_bytes(mem, "job-7", 0, 10))
    assert got.skipped == 3  # the link, her step in tier 0 and on the shared tier
    assert got.lag == {str(ALICE % 8): 0.0}  # step 10 is durable (Alice's own)


def test_the_scan_is_bounded_and_says_what_it_left(roots: tuple[Path, Path]) -> None:
    mem, _ = roots
    for job in range(1, 6):
        save(mem, f"job-{job}", 0, 1, ALICE)
    got = nodescan.scan(str(mem), "", time.time(), max_entries=12)
    assert got.steps < 5 and got.skipped > 0


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
    env, tmp, mem, _ = node
    save(mem, "job-7", 0, 10, ALICE)
    assert entry.periodic(env) == 0
    _, kinds = parse(tmp / "prom" / CKPT)
    assert kinds == {"gpuwarden_ckpt_tier0_bytes": "gauge", "gpuwarden_ckpt_tier0_steps": "gauge",
                     "gpuwarden_ckpt_last_save_timestamp_seconds": "gauge",
                     "gpuwarden_ckpt_durable_lag_seconds": "gauge",
                     "gpuwarden_ckpt_tier0_entries_skipped": "gauge",
                     "gpuwarden_ckpt_squatters_moved_total": "counter",
                     "gpuwarden_ckpt_stageins_total": "counter"}
    assert ckpt(tmp, "gpuwarden_ckpt_tier0_bytes") == step_bytes(mem, "job-7", 0, 10)
    assert ckpt(tmp, "gpuwarden_ckpt_tier0_steps") == 1
    assert ckpt(tmp, "gpuwarden_ckpt_durable_lag_seconds", user_bucket=str(ALICE % 8)) is not None
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


def test_a_scan_that_fails_leaves_its_series_out_and_never_the_counters(
        node, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    env, tmp, mem, _ = node
    os.chmod(mem, 0o777)  # not sticky: a spool anyone may swap entries in is refused
    assert entry.periodic(env) == 0
    assert ckpt(tmp, "gpuwarden_ckpt_tier0_bytes") is None
    assert ckpt(tmp, "gpuwarden_ckpt_squatters_moved_total") == 0
    assert "checkpoint tier 0" in caplog.text and "not read" in caplog.text


def test_a_hung_scan_is_given_up_at_its_deadline(monkeypatch: pytest.MonkeyPatch,
                                                 roots: tuple[Path, Path]) -> None:
    from gpuwarden.ckpt.childcall import ChildTimeout

    monkeypatch.setattr(nodescan, "scan", lambda *a, **k: time.sleep(30))
    start = time.monotonic()
    with pytest.raises(ChildTimeout):
        nodemetrics.scan_in_child(str(roots[0]), "", time.time(), 0.5)
    assert time.monotonic() - start < 5
