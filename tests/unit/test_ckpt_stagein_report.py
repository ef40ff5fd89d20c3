"""A stage-in that does not stage is seen (issue 37): the copying child's reasons come back to
the prolog over a bounded pipe, and the prolog logs one line per stage-in, at ERROR (syslog)
whenever a requeued job's ranks were not all staged; the node metric and a state record say
which outcome it was."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.ckpt import nodemetrics, stagein, stagereport
from gpuwarden.ckpt.names import step_dir
from gpuwarden.ckpt.stagein import Request
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.core import metrics
from tests.unit.test_ckpt_stagein import JOB, NOBODY, Inline, as_root, env_for, mem_steps, save
from tests.unit.test_ckpt_stagein import open_dir as open_dir  # the fixture, for the forks
from tests.unit.test_ckpt_stagein import tiers as tiers  # the fixture, for `staged`

NAME = "gpuwarden.ckpt.stagein"
copier = logging.getLogger("gpuwarden.ckpt.stagecopy")  # a module the child logs through


@pytest.fixture
def staged(request: pytest.FixtureRequest) -> tuple[CkptConfig, Path, Path]:
    """test_ckpt_stagein's shared tier: 4 ranks, step 10 the newest all of them hold; this
    node (c2 of c[1-2]) runs ranks 2-3."""
    return request.getfixturevalue("tiers")  # type: ignore[no-any-return]


def summaries(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    """The prolog's own stage-in lines at ``level`` (with Inline, the child's lines are here
    too: they are not from the parent's summary)."""
    return [r.getMessage() for r in caplog.records
            if r.name == NAME and r.levelno == level and getattr(r, "stagein_summary", False)]


def one_error(caplog: pytest.LogCaptureFixture) -> str:
    lines = summaries(caplog, logging.ERROR)
    assert len(lines) == 1, caplog.text
    return lines[0]


def saying(*messages: str, code: int | None = 1) -> Callable[[Callable[[], int], Request],
                                                            int | None]:
    """A fake runner whose "child" logs ``messages`` as warnings and exits ``code``."""
    def runner(work: Callable[[], int], req: Request) -> int | None:
        for m in messages:
            copier.warning("stage-in job %s: %s", req.job_id, m)
        return code
    return runner


# ---- in-process: the runner seam ---------------------------------------------------------------
def test_a_copy_that_warns_and_fails_is_one_error_line_with_its_reason(
        staged: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cfg, shared, _ = staged
    got = stagein.stage_in(cfg, env_for(), saying("rank 3: tier 0: No space left on device"))
    assert got == "failed"
    line = one_error(caplog)
    assert line.startswith("stage-in job 42: ")
    assert "NOT staged" in line and "exit 1" in line and str(shared) in line
    assert "rank 3: tier 0: No space left on device" in line


def test_a_copy_killed_by_a_signal_says_so(staged: tuple[CkptConfig, Path, Path],
                                          caplog: pytest.LogCaptureFixture) -> None:
    cfg, _, _ = staged
    assert stagein.stage_in(cfg, env_for(), saying(code=-9)) == "failed"
    assert "NOT staged" in one_error(caplog) and "killed by signal 9" in one_error(caplog)


def test_a_rank_that_fails_is_a_partial_stage_in_and_an_error(
        staged: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cfg, shared, mem = staged
    shard = shared / JOB / "rank-00003" / step_dir(10) / "weights"
    raw = bytearray(shard.read_bytes())
    raw[7] ^= 0x01
    shard.write_bytes(bytes(raw))
    got = stagein.attempt(cfg, env_for(), Inline())
    assert (got.outcome, got.coarse) == ("partial", "failed")
    assert mem_steps(mem, 2) == [10] and mem_steps(mem, 3) == []
    line = one_error(caplog)
    # The job, this node's ranks, the step, the durable source, and why.
    assert line.startswith(f"stage-in job 42: step 10 of ranks 2-3 into {mem} from {shared}: ")
    assert "1 of 2 ranks failed" in line and "NOT every rank staged" in line
    assert "rank 3 step 10 not staged" in line and "checksum mismatch" in line


def test_every_rank_staged_is_one_info_line(
        staged: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cfg, shared, mem = staged
    caplog.set_level(logging.INFO, NAME)
    got = stagein.attempt(cfg, env_for(), Inline())
    assert got.outcome == "staged" and not summaries(caplog, logging.ERROR)
    [line] = summaries(caplog, logging.INFO)
    assert line.startswith(f"stage-in job 42: step 10 of ranks 2-3 into {mem} from {shared}: "
                           "0.5 MiB in ")


def test_a_requeued_job_with_nothing_to_stage_says_why_at_info(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, NAME)  # the hooks' level
    cfg = CkptConfig(memory_root=str(tmp_path / "shm"), shared_root=str(tmp_path / "fsx"))
    got = stagein.attempt(cfg, env_for(), Inline())
    assert (got.outcome, got.coarse) == ("nothing", "")
    assert not summaries(caplog, logging.ERROR)
    [line] = summaries(caplog, logging.INFO)
    assert line == (f"stage-in job 42: nothing to stage from {tmp_path / 'fsx'}: no checkpoint "
                    f"of job-42 in {tmp_path / 'fsx'}")


def test_a_first_start_says_so_at_info_and_is_no_stage_in(
        staged: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cfg, _, _ = staged
    caplog.set_level(logging.INFO, NAME)
    runner = Inline()
    got = stagein.attempt(cfg, env_for(SLURM_JOB_RESTART_COUNT="0"), runner)
    assert got.outcome == "" and runner.calls == 0
    [line] = summaries(caplog, logging.INFO)
    assert "nothing to stage" in line and "SLURM_JOB_RESTART_COUNT=0" in line


def test_a_requeued_job_whose_request_is_unusable_is_an_error(
        staged: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    cfg, _, _ = staged
    got = stagein.attempt(cfg, env_for(SLURM_JOB_UID="root"), Inline())
    assert got.outcome == "failed"
    line = one_error(caplog)
    assert "NOT staged" in line and "skipped: SLURM_JOB_UID='root' is malformed" in line


def test_user_controlled_text_from_the_child_is_escaped(
        staged: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture) -> None:
    """A rank directory's name is the user's: a newline would forge a second syslog line."""
    cfg, _, _ = staged
    evil = "rank-dir 'x\n\x1b[2KERROR gpuwarden: all staged\r\u202e' refused \\n"
    stagein.stage_in(cfg, env_for(), saying(evil))
    line = one_error(caplog)
    assert not any(c in line for c in "\n\r\x1b\u202e")
    assert r"rank-dir 'x\n\x1b[2KERROR gpuwarden: all staged\r\u202e' refused \\n" in line


def test_a_flood_of_child_lines_is_bounded_and_the_outcome_still_comes_back(
        staged: tuple[CkptConfig, Path, Path], caplog: pytest.LogCaptureFixture,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _, _ = staged
    real = stagein.stage

    def flooding(req: Request, report: stagereport.Channel | None = None) -> int:
        for i in range(3000):
            copier.warning("stage-in job %s: line %05d %s", req.job_id, i, "x" * 300)
        return real(req, report)

    config = replace(Config(), ckpt=cfg, health=replace(Config().health,
                                                        state_dir=str(tmp_path / "state")))
    monkeypatch.setattr(stagein, "stage", flooding)
    monkeypatch.setattr(stagein, "run_as", Inline())
    caplog.set_level(logging.INFO, NAME)
    assert stagein.for_prolog(config, env_for()) == "staged"
    [line] = summaries(caplog, logging.INFO)
    assert "0.5 MiB in " in line  # the copy's outcome, past the flood
    assert len(line) <= stagereport.LINE_MAX and "line 00000" in line and "more" in line
    said = nodemetrics.last_stagein(str(tmp_path / "state"))
    assert said is not None
    assert sum(len(s) + 1 for s in said["said"]) <= stagereport.MAX_BYTES


def test_a_full_pipe_never_blocks_the_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child writes without blocking: a pipe nobody reads drops lines, never hangs."""
    monkeypatch.setattr(stagereport, "MAX_BYTES", 1 << 20)
    monkeypatch.setattr(stagereport, "PIPE_SIZE", 4096)  # as a user over quota gets
    with stagereport.Channel() as ch:
        start = time.monotonic()
        for i in range(2000):
            copier.warning("line %d %s", i, "y" * 200)
        assert time.monotonic() - start < 10
        report = ch.collect()
    assert report.said and report.cut
    assert sum(len(s) + 3 for s in report.said) <= 4096


def test_secrets_never_come_back_from_the_child() -> None:
    with stagereport.Channel(secrets=("hush-hush-42", "tok-77")) as ch:
        copier.warning("botocore said: signature for hush-hush-42 with token tok-77 refused")
        report = ch.collect()
    assert report.said == ("botocore said: signature for <redacted> with token <redacted> "
                           "refused",)


# ---- the metric and the state record ------------------------------------------------------------
def test_partial_and_nothing_are_counted_apart(tmp_path: Path) -> None:
    assert set(metrics.STAGEIN_OUTCOMES) == {"staged", "partial", "failed", "nothing"}
    state = tmp_path / "state"
    for outcome in ("partial", "nothing", "nothing"):
        nodemetrics.count(str(state), stagein=outcome)
    counts = json.loads((state / nodemetrics.COUNTS).read_text())
    samples = nodemetrics.samples("c2", None, counts)[metrics.STAGEINS]
    assert dict((o, v) for (_, o), v in samples) == {"staged": 0.0, "partial": 1.0,
                                                      "failed": 0.0, "nothing": 2.0}


def test_the_last_stage_in_is_recorded_for_people_and_tests(
        staged: tuple[CkptConfig, Path, Path], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _, _ = staged
    state = tmp_path / "state"
    config = replace(Config(), ckpt=cfg, health=replace(Config().health, state_dir=str(state)))
    monkeypatch.setattr(stagein, "run_as", saying("rank 2: the shared tier hung up"))
    assert stagein.for_prolog(config, env_for()) == "failed"
    last = nodemetrics.last_stagein(str(state))
    assert last is not None
    assert (last["job"], last["outcome"]) == ("42", "failed")
    assert "rank 2: the shared tier hung up" in last["line"]
    assert last["said"] == ["rank 2: the shared tier hung up"]
    assert oct(os.stat(state / nodemetrics.LAST_STAGEIN).st_mode & 0o777) == "0o600"
    # A first start is no stage-in: the record stays the last requeue's.
    assert stagein.for_prolog(config, env_for(SLURM_JOB_RESTART_COUNT="0")) == ""
    assert nodemetrics.last_stagein(str(state)) == last


# ---- the real fork: the child's lines are otherwise lost (its stdio is /dev/null) -------------
def forked_cfg(open_dir: Path, budget_s: float = 60.0) -> CkptConfig:
    shared = open_dir / "fsx"
    shared.mkdir(mode=0o1777, exist_ok=True)
    return CkptConfig(memory_root=str(open_dir / "shm"), shared_root=str(shared),
                      stage_in_budget_s=budget_s)


AS_NOBODY = {"SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY)}


@as_root
def test_a_forked_copy_that_warns_and_fails_is_an_error_with_its_reason(
        open_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def failing(req: Request, report: stagereport.Channel | None = None) -> int:
        copier.warning("stage-in job %s: rank 2: uid %d cannot read it", req.job_id, os.getuid())
        return 1

    monkeypatch.setattr(stagein, "stage", failing)
    assert stagein.stage_in(forked_cfg(open_dir), env_for(**AS_NOBODY)) == "failed"
    line = one_error(caplog)
    assert f"rank 2: uid {NOBODY} cannot read it" in line and "exit 1" in line


@as_root
def test_a_forked_copy_killed_at_the_budget_is_an_error_naming_it(
        open_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def hung(req: Request, report: stagereport.Channel | None = None) -> int:
        assert report is not None
        report.plan(20, range(2, 4), 3 << 20)
        copier.warning("stage-in job %s: rank 2: the shared tier is slow", req.job_id)
        time.sleep(600)  # a hung filesystem
        return 0

    monkeypatch.setattr(stagein, "stage", hung)
    start = time.monotonic()
    assert stagein.stage_in(forked_cfg(open_dir, 0.5), env_for(**AS_NOBODY)) == "failed"
    assert time.monotonic() - start < 10
    line = one_error(caplog)
    assert line.startswith("stage-in job 42: step 20 of ranks 2-3 ")
    assert "not done within stage_in_budget_s = 0.5 s" in line
    assert "rank 2: the shared tier is slow" in line


@as_root
def test_a_forked_copy_flooding_its_pipe_neither_blocks_nor_floods_the_prolog(
        open_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def flooding(req: Request, report: stagereport.Channel | None = None) -> int:
        for i in range(20000):  # about 4 MiB: a pipe holds 64 KiB
            copier.warning("stage-in job %s: line %05d %s", req.job_id, i, "z" * 200)
        return 1

    monkeypatch.setattr(stagein, "stage", flooding)
    start = time.monotonic()
    assert stagein.stage_in(forked_cfg(open_dir), env_for(**AS_NOBODY)) == "failed"
    assert time.monotonic() - start < 30  # the copy ended; it was not killed at the 60 s budget
    line = one_error(caplog)
    assert "exit 1" in line and "not done within" not in line
    assert len(line) <= stagereport.LINE_MAX and "line 00000" in line


@as_root
def test_a_forked_stage_in_with_nothing_to_stage_says_why(
        open_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, NAME)
    cfg = forked_cfg(open_dir)
    save(Path(cfg.shared_root), 0, 10)  # rank 0 only, of 4
    for dirpath, _, files in os.walk(Path(cfg.shared_root) / JOB):
        for name in [dirpath, *(os.path.join(dirpath, f) for f in files)]:
            os.chown(name, NOBODY, NOBODY)
    got = stagein.attempt(cfg, env_for(**AS_NOBODY))
    assert got.outcome == "nothing"
    [line] = summaries(caplog, logging.INFO)
    assert line == (f"stage-in job 42: nothing to stage from {cfg.shared_root}: no step is held "
                    f"by all 4 ranks in {cfg.shared_root}")
