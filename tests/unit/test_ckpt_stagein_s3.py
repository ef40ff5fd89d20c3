"""Issue 37, step 8 (docs/design/object-store-sites.md 4.2): the prolog's stage-in from S3 on a
site without a shared tier. The child (the job's user) lists the job's authenticated index once,
picks the newest step every rank holds, verifies this node's ranks' manifests (MAC first), walks
back at most 3 steps, and downloads with ranged GETs into tier 0, committed as the shared-tier
copy is. The job's keys are derived by root before the fork and reach the child in memory only;
so do the optional credentials of ``stage_in_s3_env``."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import codec, s3tier, stagein, stagein_s3
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.jobkey import JobKeys, derive, format_keys
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.restore import restore
from gpuwarden.ckpt.s3index import marker_name
from gpuwarden.ckpt.s3tier import MAC, S3Settings, S3Tier
from gpuwarden.ckpt.stagein import Request
from gpuwarden.ckpt.tier import MANIFEST
from gpuwarden.config import Config
from gpuwarden.config.ckpt import CkptConfig
from tests.unit.test_ckpt_stagein import NOBODY, Inline, env_for, mem_steps, rank_state

from .fake_s3 import FakeS3
from .test_ckpt_s3_keyed import forge_xxh3

JOB = "job-42"
BUCKET, PREFIX = "site-bucket", "gpuwarden-ckpt"
CLUSTER = "c1"
SITE = [("k1", bytes(range(1, 33)))]
BASE = f"{PREFIX}/{JOB}"


@pytest.fixture(autouse=True)
def _legacy_warnings_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A legacy step is warned of once per process: each test starts with none seen, whatever
    ran before it in this worker."""
    monkeypatch.setattr(s3tier, "_LEGACY_SEEN", set())


def job_keys(uid: int = os.getuid(), job: str = "42") -> JobKeys:
    return JobKeys.of(derive(SITE, CLUSTER, job, uid))


def s3_tier(s3: FakeS3, rank: int, keys: JobKeys | None) -> S3Tier:
    return S3Tier("s3", S3Settings(BUCKET, PREFIX), JOB, rank, s3=s3, keys=keys)


def put_step(s3: FakeS3, rank: int, step: int, keys: JobKeys, world: int = 4) -> None:
    shards, data = codec.encode(rank_state(rank, step))
    m = Manifest(JOB, step, world, rank, tuple(shards), time.time(), {})
    s3_tier(s3, rank, keys).commit(m, data)


def step_key(rank: int, step: int, name: str) -> str:
    return f"{BASE}/rank-{rank:05d}/step-{step:012d}/{name}"


class Clients:
    """The S3 client factory, faked: the FakeS3, and the arguments it was made with."""

    def __init__(self, s3: FakeS3, check: Callable[[], None] = lambda: None) -> None:
        self.s3, self.check = s3, check
        self.credentials: list[dict[str, str]] = []

    def __call__(self, settings: S3Settings, credentials: Mapping[str, str]) -> FakeS3:
        self.check()
        self.credentials.append(dict(credentials))
        return self.s3


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[CkptConfig, FakeS3,
                                                                                 Path, Clients]]:
    """4 ranks on c[1-2] (this node c2: ranks 2-3); steps 10 and 20 held by all, 30 by all but
    rank 1: 20 is the newest every rank holds."""
    key_file = tmp_path / "ckpt.key"
    key_file.write_bytes(format_keys(SITE))
    key_file.chmod(0o600)
    s3 = FakeS3(page_size=7)
    keys = job_keys()
    for rank in range(4):
        for step in (10, 20, 30):
            if (rank, step) != (1, 30):
                put_step(s3, rank, step, keys)
    mem = tmp_path / "shm"
    cfg = CkptConfig(memory_root=str(mem), s3_bucket=BUCKET, s3_prefix=PREFIX,
                     key_file=str(key_file), s3_get_part_mb=1)
    clients = Clients(s3)
    monkeypatch.setattr(stagein_s3, "make_client", clients)
    yield cfg, s3, mem, clients


def run(cfg: CkptConfig, runner: stagein.Runner | None = None, **env: str) -> str:
    return stagein.stage_in(cfg, env_for(**env), runner or Inline(), cluster=CLUSTER)


def assert_restores(mem: Path, rank: int, step: int) -> None:
    got = restore([FsTier("memory", str(mem), JOB, rank)])
    assert got is not None and got.step == step
    assert np.array_equal(got.state["weights"], rank_state(rank, step)["weights"])
    assert got.state["optimizer"] == rank_state(rank, step)["optimizer"]


# ---- the request ------------------------------------------------------------------------------
def test_without_a_shared_tier_the_request_is_for_s3(site: tuple[Any, ...]) -> None:
    cfg = site[0]
    req = stagein.parse_request(cfg, env_for())
    assert req is not None and req.source == "s3"
    assert stagein.parse_request(replace(cfg, stage_in_s3=False), env_for()) is None
    assert stagein.parse_request(replace(cfg, stage_in=False), env_for()) is None
    # A shared tier stays the source where there is one (today's stage-in).
    shared = stagein.parse_request(replace(cfg, shared_root="/fsx"), env_for())
    assert shared is not None and shared.source == "shared"


# ---- selection --------------------------------------------------------------------------------
def test_the_newest_step_with_every_ranks_index_marker_is_staged(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    cfg, s3, mem, clients = site
    caplog.set_level(logging.INFO, "gpuwarden.ckpt")
    s3.calls.clear()
    assert run(cfg) == "staged"
    assert [mem_steps(mem, r) for r in range(4)] == [[], [], [20], [20]]
    for r in (2, 3):
        assert_restores(mem, r, 20)
    # One LIST, of the index: no LIST per rank, nothing of the other node's ranks read.
    assert [c for c in s3.calls if c[0] == "list"] == [("list", f"{BASE}/index/")]
    assert not [k for op, k in s3.calls if op == "get" and "/rank-0000" in k
                and not k.startswith((f"{BASE}/rank-00002/", f"{BASE}/rank-00003/"))]
    # The MAC is read before the manifest.
    gets = [k for op, k in s3.calls if op == "get" and k.startswith(f"{BASE}/rank-00002/")]
    assert gets[:2] == [step_key(2, 20, MAC), step_key(2, 20, MANIFEST)]
    line = [r.message for r in caplog.records if "of ranks 2-3" in r.message]
    assert line and line[0].startswith(f"stage-in job 42: step 20 of ranks 2-3 into {mem} from "
                                       f"s3://{BUCKET}/{PREFIX}: 0.5 MiB in ")
    assert clients.credentials == [{}]  # boto3's default chain
    # A second prolog on the same node fetches nothing.
    caplog.clear()
    s3.calls.clear()
    run(cfg)
    assert "2 of 2 ranks already there" in caplog.text
    assert not [k for op, k in s3.calls if op == "get" and "/index/" not in k]


def test_planted_index_names_and_manifests_are_never_selected(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    cfg, s3, mem, _ = site
    caplog.set_level(logging.INFO, "gpuwarden.ckpt")
    bob = job_keys(uid=NOBODY + 1)
    for rank in range(4):
        put_step(s3, rank, 40, bob)  # bob's whole step 40: markers and MACs under his key
        # A marker with a wrong tag, and a manifest with a valid digest and no MAC or marker.
        good = marker_name(job_keys().signing, JOB, rank, 50, 4)
        s3.put_object(Bucket=BUCKET, Key=f"{BASE}/index/{good[:-4]}0000", Body=b"")
        shards, _ = codec.encode(rank_state(rank, 60))
        raw = Manifest(JOB, 60, 4, rank, tuple(shards), 1.0, {}).to_json().encode()
        s3.put_object(Bucket=BUCKET, Key=step_key(rank, 60, MANIFEST), Body=raw)
    s3.calls.clear()
    assert run(cfg) == "staged"
    assert [mem_steps(mem, r) for r in (2, 3)] == [[20], [20]]
    assert "8 index names refused" in caplog.text
    fetched = {k.split("/")[3] for op, k in s3.calls if op == "get" and "/step-" in k}
    assert fetched == {"step-000000000020"}  # nothing planted was even read


def test_this_nodes_mac_failure_walks_back_to_the_next_complete_step(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    cfg, s3, mem, _ = site
    caplog.set_level(logging.INFO, "gpuwarden.ckpt")
    put_step(s3, 1, 30, job_keys())  # 30 complete now
    s3.objects[step_key(3, 30, MAC)] = b"k1:" + b"0" * 64  # rank 3's step 30 not authentic
    s3.objects[step_key(0, 30, MAC)] = b"garbage"  # the other node's rank: not ours to check
    assert run(cfg) == "staged"
    assert [mem_steps(mem, r) for r in (2, 3)] == [[20], [20]]
    assert "rank 3 step 30" in caplog.text and "not authenticated with this job's key" in caplog.text
    assert "walking back" in caplog.text


def test_another_nodes_broken_rank_does_not_stop_this_node(
        site: tuple[CkptConfig, FakeS3, Path, Clients]) -> None:
    cfg, s3, mem, _ = site
    put_step(s3, 1, 30, job_keys())
    s3.objects[step_key(0, 30, MAC)] = b"garbage"
    assert run(cfg) == "staged"
    assert [mem_steps(mem, r) for r in (2, 3)] == [[30], [30]]


def test_at_most_three_steps_are_tried_then_stage_in_gives_up(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    cfg, s3, mem, _ = site
    keys = job_keys()
    for rank in range(4):
        put_step(s3, rank, 40, keys)
    put_step(s3, 1, 30, keys)  # complete: 40, 30, 20, 10
    for step in (40, 30, 20):
        del s3.objects[step_key(2, step, MAC)]
    s3.calls.clear()
    assert run(cfg) == "failed"
    assert [mem_steps(mem, r) for r in (2, 3)] == [[], []]
    assert "gave up after 3 steps (40, 30, 20)" in caplog.text
    assert not [k for op, k in s3.calls if op == "get" and "step-000000000010" in k]


def test_a_flooded_index_is_read_up_to_a_cap_and_that_is_logged(
        site: tuple[CkptConfig, FakeS3, Path, Clients], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Names sort by step: junk under step 0 comes first and fills the cap; stage-in stops
    there, says so, and stages nothing rather than list without end."""
    cfg, s3, mem, _ = site
    monkeypatch.setattr(stagein_s3, "MAX_INDEX_NAMES", 50)
    for i in range(500):
        s3.put_object(Bucket=BUCKET, Key=f"{BASE}/index/step-000000000000/junk-{i:05d}", Body=b"")
    s3.calls.clear()
    assert run(cfg) == ""
    assert mem_steps(mem, 2) == []
    assert "stopped after 50 names" in caplog.text
    # The pages after the cap were never asked for.
    assert len([c for c in s3.calls if c[0] == "list-page"]) <= 50 // 7 + 1


def test_an_index_that_cannot_be_listed_is_a_logged_failure(
        site: tuple[CkptConfig, FakeS3, Path, Clients], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    cfg, s3, mem, _ = site
    from .fake_s3 import client_error

    def refuse(_op: str) -> Any:
        raise client_error("AccessDenied", "ListObjectsV2", 403)

    monkeypatch.setattr(s3, "get_paginator", refuse)
    assert run(cfg) == "failed"
    assert "cannot list" in caplog.text and mem_steps(mem, 2) == []


def test_a_corrupt_shard_fails_that_rank_only(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    cfg, s3, mem, _ = site
    raw = bytearray(s3.objects[step_key(3, 20, "weights")])
    raw[9] ^= 1
    s3.objects[step_key(3, 20, "weights")] = bytes(raw)
    assert run(cfg) == "failed"
    assert [mem_steps(mem, r) for r in (2, 3)] == [[20], []]
    assert "rank 3 step 20 not staged" in caplog.text
    assert "shard weights: content does not match its keyed digest" in caplog.text
    leftovers = os.listdir(mem / JOB / "rank-00003")
    assert leftovers == []  # a failed copy removes its temp directory


def test_a_shard_forged_with_the_same_xxh3_is_never_staged(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    """Another user, with the bucket's credentials, replaces rank 3's weights with bytes of the
    same size and xxh3_64 (the hostile review): the keyed digest refuses them as they land, and
    tier 0 never holds them (the job restores from S3 itself, which walks back)."""
    cfg, s3, mem, _ = site
    key = step_key(3, 20, "weights")
    forged = forge_xxh3(s3.objects[key], np.full(224, 666.0, "<f4").tobytes())
    s3.objects[key] = forged
    assert run(cfg) == "failed"
    assert [mem_steps(mem, r) for r in (2, 3)] == [[20], []]
    assert f"s3://{BUCKET}/{BASE}/rank-00003/step-000000000020: shard weights: content does " \
           "not match its keyed digest: changed by someone without the job's key" in caplog.text
    assert os.listdir(mem / JOB / "rank-00003") == []
    # The job, agreeing on step 20 (what every rank holds), restores an older one instead.
    got = restore([s3_tier(s3, 3, job_keys())], at_most=20)
    assert got is not None and got.step == 10


def test_a_legacy_step_is_staged_and_logged_as_legacy(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    """Steps written before the keyed digests (a MAC of the manifest alone) are staged as
    before: a job checkpointed before an upgrade is staged after it, with a warning."""
    cfg, s3, mem, _ = site
    kid, key = job_keys().signing
    for rank in range(4):
        raw = s3.objects[step_key(rank, 20, MANIFEST)]
        mac = hmac.new(key, b"gpuwarden-s3-manifest\0" + raw, hashlib.sha256).hexdigest()
        s3.objects[step_key(rank, 20, MAC)] = f"{kid}:{mac}".encode()
    assert run(cfg) == "staged"
    assert [mem_steps(mem, r) for r in (2, 3)] == [[20], [20]]
    for r in (2, 3):
        assert_restores(mem, r, 20)
    # The tier's own warnings (the prolog's summary line may quote them: at INFO, seen when
    # an earlier test left the root logger at INFO).
    legacy = [r.message for r in caplog.records
              if r.name == "gpuwarden.ckpt.s3tier" and "legacy step" in r.message]
    assert len(legacy) == 2 and all("only by their xxh3_64" in m for m in legacy)


# ---- who copies, with what ----------------------------------------------------------------------
def test_the_copy_refuses_to_run_as_anyone_but_the_jobs_user(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    cfg, s3, mem, _ = site
    s3.calls.clear()
    other = NOBODY if os.getuid() != NOBODY else 0
    assert run(cfg, SLURM_JOB_UID=str(other), SLURM_JOB_GID=str(other)) == "failed"
    assert "refusing to copy as uid" in caplog.text
    assert not [c for c in s3.calls if c[0] != "put"] and not (mem / JOB).exists()


class ForkedAsUser:
    """The real runner (`stagein.run_as`: fork, kill at the budget); as root the child becomes
    the job's user, otherwise it runs as we are (setgroups needs root)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        if os.geteuid() != 0:
            monkeypatch.setattr(stagein, "_child", _unprivileged_child)

    def __call__(self, work: Callable[[], int], req: Request) -> int | None:
        return stagein.run_as(work, req)


def _unprivileged_child(work: Callable[[], int], req: Request) -> None:  # pragma: no cover
    code = 2
    try:
        code = work()
    finally:
        os._exit(code)


JOB_UID = NOBODY if os.geteuid() == 0 else os.getuid()


def _c_environ() -> list[bytes]:
    """The C library's environment, which os.putenv changes behind os.environ's back."""
    env = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    out: list[bytes] = []
    i = 0
    while env[i] is not None:
        out.append(env[i] or b"")
        i += 1
    return out


def _as_job_user() -> dict[str, str]:
    if os.geteuid() == 0:
        return {"SLURM_JOB_UID": str(NOBODY), "SLURM_JOB_GID": str(NOBODY)}
    return {}


@pytest.fixture
def open_site(site: tuple[CkptConfig, FakeS3, Path, Clients], tmp_path: Path) -> Iterator[
        tuple[CkptConfig, FakeS3, Path, Clients]]:
    """`site` with tier 0 where the job's user (nobody, as root) can reach it."""
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="gpuwarden-stagein-s3-"))
    base.chmod(0o755)
    cfg, s3, _, clients = site
    if os.geteuid() == 0:  # the job is nobody's: its steps under nobody's job key
        s3.objects.clear()
        for rank in range(4):
            for step in (10, 20):
                put_step(s3, rank, step, job_keys(JOB_UID))
    mem = base / "shm"
    yield replace(cfg, memory_root=str(mem)), s3, mem, clients
    shutil.rmtree(base, ignore_errors=True)


def test_the_key_never_reaches_the_childs_argv_or_environment(
        open_site: tuple[CkptConfig, FakeS3, Path, Clients], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    cfg, _, mem, clients = open_site
    env_file = tmp_path / "s3.env"
    env_file.write_text("AWS_ACCESS_KEY_ID=AKIDEXAMPLE\nAWS_SECRET_ACCESS_KEY=hush-hush-42\n")
    env_file.chmod(0o600)
    secrets = [job_keys(JOB_UID).signing[1].hex(), "hush-hush-42"]

    def check() -> None:  # in the child, before it reads S3
        seen = [repr(sys.argv).encode(), repr(dict(os.environ)).encode(), *_c_environ()]
        for name in ("environ", "cmdline"):
            # After setuid the child's /proc entries are root's (not dumpable): read them
            # where allowed (always, when the tests run unprivileged).
            with contextlib.suppress(PermissionError):
                seen.append(Path(f"/proc/self/{name}").read_bytes())
        for secret in secrets:
            if any(secret.encode() in blob for blob in seen):
                raise AssertionError("a secret in the child's argv or environment")
        if os.geteuid() == 0:
            raise AssertionError("the copy runs as root")

    clients.check = check
    got = run(replace(cfg, stage_in_s3_env=str(env_file), stage_in_budget_s=60),
              ForkedAsUser(monkeypatch), **_as_job_user())
    assert got == "staged"
    assert [mem_steps(mem, r) for r in (2, 3)] == [[20], [20]]
    if os.geteuid() == 0:  # the staged files are the job user's
        staged = mem / JOB / "rank-00002" / "step-000000000020"
        for p in [mem / JOB, staged, *staged.iterdir()]:
            assert os.lstat(p).st_uid == NOBODY, p
    assert not any(s in repr(dict(os.environ)) for s in secrets)


def test_a_copy_killed_at_its_budget_leaves_no_visible_step(
        open_site: tuple[CkptConfig, FakeS3, Path, Clients], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    cfg, s3, mem, _ = open_site
    hang = threading.Event()

    def stuck(key: str, span: tuple[int, int] | None) -> None:
        if key == step_key(2, 20, "optimizer"):
            hang.wait(600)  # S3 stuck in rank 2's download

    s3.on_get = stuck
    start = time.monotonic()
    got = run(replace(cfg, stage_in_budget_s=1.5, s3_get_part_mb=1), ForkedAsUser(monkeypatch),
              **_as_job_user())
    assert got == "failed" and time.monotonic() - start < 30
    assert "not done within stage_in_budget_s" in caplog.text
    assert [mem_steps(mem, r) for r in (2, 3)] == [[], []]


def test_credentials_from_the_env_file_are_used_and_never_logged(
        site: tuple[CkptConfig, FakeS3, Path, Clients], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    cfg, _, mem, clients = site
    caplog.set_level(logging.DEBUG)
    env_file = tmp_path / "s3.env"
    env_file.write_text("# the nodes' stage-in credentials\nAWS_ACCESS_KEY_ID=AKIDEXAMPLE\n"
                        "AWS_SECRET_ACCESS_KEY=hush-hush-42\nAWS_SESSION_TOKEN=tok-77\n\n"
                        "AWS_DEFAULT_REGION=eu-west-1\n")
    env_file.chmod(0o600)
    seen: list[str] = []

    class Showing(Inline):
        def __call__(self, work: Callable[[], int], req: Request) -> int | None:
            seen.append(repr(req))
            return super().__call__(work, req)

    assert run(replace(cfg, stage_in_s3_env=str(env_file)), Showing()) == "staged"
    assert clients.credentials == [{"aws_access_key_id": "AKIDEXAMPLE",
                                    "aws_secret_access_key": "hush-hush-42",
                                    "aws_session_token": "tok-77", "region_name": "eu-west-1"}]
    key_hex = job_keys().signing[1].hex()
    for secret in ("hush-hush-42", "tok-77", key_hex):
        assert secret not in caplog.text and secret not in seen[0]
    assert mem_steps(mem, 2) == [20]


@pytest.mark.parametrize(("text", "mode", "why"), [
    ("AWS_SECRET_ACCESS_KEY=hush-hush-42\n", 0o640, "readable or writable by group or others"),
    ("AWS_SECRET_ACCESS_KEY=hush-hush-42\nHOME=/tmp\n", 0o600, "line 2: HOME is not one of"),
    ("AWS_SECRET_ACCESS_KEY hush-hush-42\n", 0o600, "line 1: expected KEY=VALUE"),
])
def test_an_unfit_env_file_is_refused_without_showing_its_values(
        site: tuple[CkptConfig, FakeS3, Path, Clients], tmp_path: Path, text: str, mode: int,
        why: str, caplog: pytest.LogCaptureFixture) -> None:
    cfg, _, mem, _ = site
    env_file = tmp_path / "s3.env"
    env_file.write_text(text)
    env_file.chmod(mode)
    runner = Inline()
    assert run(replace(cfg, stage_in_s3_env=str(env_file)), runner) == "failed"
    assert runner.calls == 0 and not (mem / JOB).exists()
    assert why in caplog.text and "hush-hush-42" not in caplog.text


def test_an_env_file_that_is_a_link_is_refused(
        site: tuple[CkptConfig, FakeS3, Path, Clients], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    cfg = site[0]
    real = tmp_path / "real.env"
    real.write_text("AWS_ACCESS_KEY_ID=x\n")
    real.chmod(0o600)
    (tmp_path / "s3.env").symlink_to(real)
    runner = Inline()
    assert run(replace(cfg, stage_in_s3_env=str(tmp_path / "s3.env")), runner) == "failed"
    assert runner.calls == 0 and "s3.env" in caplog.text


def test_an_unreadable_site_key_skips_stage_in_with_the_reason(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    cfg = site[0]
    Path(cfg.key_file).chmod(0o644)
    runner = Inline()
    assert run(cfg, runner) == "failed"
    assert runner.calls == 0 and "readable or writable by group or others" in caplog.text


def test_a_requeue_without_any_s3_step_is_nothing_to_do(
        site: tuple[CkptConfig, FakeS3, Path, Clients], caplog: pytest.LogCaptureFixture) -> None:
    cfg, s3, _, _ = site
    caplog.set_level(logging.INFO, "gpuwarden.ckpt")
    s3.objects.clear()
    assert run(cfg) == ""
    assert "no step is held by every rank" in caplog.text


def test_for_prolog_stages_from_s3_with_the_clusters_name(
        site: tuple[CkptConfig, FakeS3, Path, Clients], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, _, mem, _ = site
    monkeypatch.setattr(stagein, "run_as", Inline())
    config = Config()
    config = replace(config, ckpt=cfg, cluster=replace(config.cluster, name=CLUSTER))
    assert stagein.for_prolog(config, env_for()) == "staged"
    assert mem_steps(mem, 3) == [20]


# ---- the prolog gives S3 stage-in its time, and the fast gate lets it happen ---------------------
def test_the_prologs_limit_and_fast_gate_know_s3_stage_in(tmp_path: Path) -> None:
    """Both asked only for shared_root: on an S3-only site the fast gate let a requeued job
    skip the full prolog (no stage-in at all) and the prolog's limit left it no time."""
    from gpuwarden.health import fastgate
    from gpuwarden.hooks import cli as hcli
    from tests.unit.test_fastgate import Site

    s3_only = CkptConfig(s3_bucket=BUCKET, key_file="/etc/gpuwarden/ckpt.key")
    cfg = replace(Config(), ckpt=s3_only)
    assert hcli.stage_in_s(cfg, "prolog") == s3_only.stage_in_budget_s
    assert hcli.stage_in_s(replace(cfg, ckpt=replace(s3_only, stage_in_s3=False)), "prolog") == 0

    node = Site(tmp_path)
    text = node.config.read_text()
    node.config.write_text(text.replace(f'shared_root = "{node.fsx}"',
                                        f's3_bucket = "{BUCKET}"\nkey_file = "/etc/gpuwarden/x.key"'))
    node.verdict()
    assert fastgate.remember(node.environ) == ""
    assert "requeued" in node.check(SLURM_JOB_RESTART_COUNT="1")
    # A first run still goes the full way, for the job's key (test_fastgate).
    assert "checkpoint key" in node.check(SLURM_JOB_RESTART_COUNT="0")


def test_the_childs_client_reads_nothing_from_the_users_home(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy runs as the job's user, and Slurm gives the prolog no HOME: that user's
    ~/.aws/config must not steer the client that carries root's stage-in credentials (an
    endpoint_url of theirs would receive root's signed requests and session token)."""
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "config").write_text(
        "[default]\nendpoint_url = http://attacker.example:8080\nregion = eu-west-9\n"
        "ca_bundle = /tmp/attacker-ca.pem\n")
    (home / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = AKIAUSERS\naws_secret_access_key = users\n")
    monkeypatch.setenv("HOME", str(home))
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to ask here
    creds = {"aws_access_key_id": "AKIAROOTSTAGEIN", "aws_secret_access_key": "s" * 40,
             "region_name": "us-east-1"}
    c = stagein_s3.make_client(S3Settings("site-bucket"), creds)
    assert "attacker" not in c.meta.endpoint_url and c.meta.region_name == "us-east-1"
    assert c._get_credentials().access_key == "AKIAROOTSTAGEIN"
    # Without credentials of root's (an instance role), the user's file is not read either.
    bare = stagein_s3.make_client(S3Settings("site-bucket"), {})
    assert "attacker" not in bare.meta.endpoint_url
    creds_found = bare._get_credentials()
    assert creds_found is None or creds_found.access_key != "AKIAUSERS"
