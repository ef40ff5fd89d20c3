"""`gpuwarden ckpt ls JOB` lists every rank on every tier, each row saying which rank and where
(this host's memory, the replicas it holds for other ranks, the shared filesystem), not rank 0's
steps and this host's memory as if they were the job's."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import codec
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.listing import this_host
from gpuwarden.ckpt.manifest import Manifest
from tests.unit.test_ckpt_ownership import _cli as cli

JOB = "job-64"
HOST = this_host()


def save(root: Path, rank: int, *steps: int, namespace: str = JOB) -> None:
    tier = FsTier("t", str(root), namespace, rank)
    for step in steps:
        shards, data = codec.encode({"w": np.full((4,), step, dtype=np.float32)})
        tier.commit(Manifest(JOB, step, 4, rank, tuple(shards), time.time(), {}), data)


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """Ranks 2 and 3 ran on this host; it holds rank 0's replicas; /fsx has all four ranks,
    rank 3 one step behind."""
    shm, fsx = tmp_path / "shm", tmp_path / "fsx"
    for rank in (2, 3):
        save(shm, rank, 10, 20)
    save(shm, 0, 20, namespace=f"{JOB}.peer")
    for rank in range(3):
        save(fsx, rank, 10, 20)
    save(fsx, 3, 10)
    return tmp_path


def rows(out: str) -> list[list[str]]:
    return [line.split(None, 3) for line in out.splitlines()]


def test_every_rank_is_listed_with_its_rank_and_where(job: Path) -> None:
    code, out = cli(job)("ckpt", "ls", JOB)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split() == ["TIER", "RANK", "WHERE", "STEPS"]
    fsx = str(job / "fsx")
    body = [" ".join(line.split()) for line in lines[1:]]
    assert body == [
        f"memory 2-3 {HOST} 2 step(s): 10, 20",  # not rank 0: none of it ran here
        f"peer 0 {HOST} 1 step(s): 20",
        f"shared 0-2 {fsx} 2 step(s): 10, 20",
        f"shared 3 {fsx} 1 step(s): 10",
    ]


def test_one_rank_is_shown_when_asked_for_even_where_it_has_nothing(job: Path) -> None:
    code, out = cli(job)("ckpt", "ls", JOB, "--rank", "0")
    assert code == 0, out
    body = [" ".join(line.split()) for line in out.splitlines()[1:]]
    assert body == [f"memory 0 {HOST} 0 step(s): none", f"peer 0 {HOST} 1 step(s): 20",
                    f"shared 0 {job / 'fsx'} 2 step(s): 10, 20"]


def test_json_has_one_object_per_tier_and_rank(job: Path) -> None:
    code, out = cli(job)("ckpt", "ls", JOB, "--json")
    assert code == 0, out
    got = [(r["tier"], r["rank"], r["where"], r["steps"]) for r in json.loads(out)]
    assert got == [("memory", 2, HOST, [10, 20]), ("memory", 3, HOST, [10, 20]),
                   ("peer", 0, HOST, [20])] + [
        ("shared", r, str(job / "fsx"), [10, 20] if r < 3 else [10]) for r in range(4)]


def test_a_job_with_no_checkpoints_says_so_per_tier(tmp_path: Path) -> None:
    code, out = cli(tmp_path)("ckpt", "ls", JOB)
    assert code == 0, out
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [
        ["memory", "-"], ["peer", "-"], ["shared", "-"]]
    assert out.count(f"no steps of {JOB}") == 3


def test_a_planted_rank_link_is_listed_as_refused_never_followed(job: Path) -> None:
    elsewhere = job / "elsewhere"
    save(elsewhere, 5, 99)
    os.symlink(elsewhere / JOB / "rank-00005", job / "fsx" / JOB / "rank-00005")
    code, out = cli(job)("ckpt", "ls", JOB)
    assert code == 0, out
    [five] = [line for line in out.splitlines() if line.split()[:2] == ["shared", "5"]]
    # Step 99 is the link's target's: never listed (the test's own directory, which may be
    # pytest's "pytest-99", left out of the search).
    assert "unavailable" in five and "99" not in five.replace(str(job), "<job>")


def test_a_negative_rank_is_a_usage_error_not_a_traceback(job: Path) -> None:
    code, out = cli(job)("ckpt", "ls", JOB, "--rank", "-1")
    assert code == 2 and "--rank" in out and "Traceback" not in out


class ListingS3:
    """Keys and list_objects_v2 with a delimiter, as S3 groups them into common prefixes."""

    def __init__(self, fail: bool = False) -> None:
        from tests.unit.test_ckpt_s3tier import FakeS3

        self.inner, self.fail = FakeS3(), fail

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get_paginator(self, _op: str) -> Any:
        from botocore.exceptions import ClientError

        objects, fail = self.inner.objects, self.fail

        class Pages:
            def paginate(self, Bucket: str, Prefix: str,
                         Delimiter: str = "") -> list[dict[str, Any]]:
                if fail:
                    raise ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}},
                                      "ListObjectsV2")
                keys = sorted(k for k in objects if k.startswith(Prefix))
                if not Delimiter:
                    return [{"Contents": [{"Key": k} for k in keys]}]
                heads = sorted({Prefix + k[len(Prefix):].split(Delimiter)[0] + Delimiter
                                for k in keys if Delimiter in k[len(Prefix):]})
                return [{"CommonPrefixes": [{"Prefix": h} for h in heads]}]
        return Pages()


def test_s3_ranks_are_listed_from_the_buckets_prefixes() -> None:
    from gpuwarden.ckpt.listing import rows
    from gpuwarden.ckpt.s3tier import S3Settings, S3Tier

    fake = ListingS3()
    for rank, steps in ((0, (10, 20)), (1, (10, 20)), (7, (10,))):
        tier = S3Tier("s3", S3Settings("bkt", "ck"), JOB, rank, s3=fake, key=b"k" * 32)
        for step in steps:
            shards, data = codec.encode({"w": np.zeros(2, dtype=np.float32)})
            tier.commit(Manifest(JOB, step, 8, rank, tuple(shards), time.time(), {}), data)
    got = [(r.rank, r.where, r.steps) for r in rows([tier], None)]
    assert got == [(0, "s3://bkt/ck", (10, 20)), (1, "s3://bkt/ck", (10, 20)),
                   (7, "s3://bkt/ck", (10,))]
    fake.fail = True
    [row] = rows([tier], None)
    assert row.rank is None and "cannot list s3://bkt/ck/job-64/" in row.error


def test_a_step_kept_beyond_keep_for_another_rank_is_marked(tmp_path: Path) -> None:
    """keep = 2 (the default) and ranks 0-2 hold three steps: rank 3's newest is 10, the step a
    restart restores, so retention keeps it on every rank. `ls` says so instead of leaving
    three steps to look like a retention bug."""
    fsx = tmp_path / "fsx"
    for rank in range(3):
        save(fsx, rank, 10, 15, 20)
    save(fsx, 3, 10)
    code, out = cli(tmp_path)("ckpt", "ls", JOB)
    assert code == 0, out
    body = [" ".join(line.split()) for line in out.splitlines()[1:]]
    assert f"shared 0-2 {fsx} 3 step(s): 10, 15, 20; 10 (kept beyond keep=2: the newest step " \
           "rank 3 holds, which a restart restores)" in body, body
    assert f"shared 3 {fsx} 1 step(s): 10" in body, body
    code, out = cli(tmp_path)("ckpt", "ls", JOB, "--json")
    assert [r["needed"] for r in json.loads(out) if r["tier"] == "shared"] == [[10]] * 3 + [[]]
