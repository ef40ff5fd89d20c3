"""Issue 37, step 7 (docs/design/object-store-sites.md 4.2, 6.2): the authenticated index. After
each rank's manifest, `S3Tier.commit` writes an empty marker
``<prefix>/<job>/index/step-S/rank-R.w<W>.<kid>.<tag>`` whose tag is a MAC under the job's key,
so that one LIST of ``<job>/index/`` tells the prolog which step every rank holds; anything
there the job's key did not make is refused (counted), never trusted, never raised."""

from __future__ import annotations

import numpy as np
import pytest

from gpuwarden.ckpt import codec, s3index
from gpuwarden.ckpt.jobkey import JobKeys, derive
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.s3index import Index, held_from_index, marker_name, verify
from gpuwarden.ckpt.s3tier import MAC, S3Settings, S3Tier
from gpuwarden.ckpt.tier import MANIFEST, TierError

from .fake_s3 import FakeS3

ALICE, BOB = 23456, 34567
A, B = ("ka", b"\x01" * 32), ("kb", b"\x02" * 32)
JOB = "job-612"
INDEX = f"gpuwarden-ckpt/{JOB}/index/"


def keys(*site: tuple[str, bytes], job: str = "612", uid: int = ALICE) -> JobKeys:
    return JobKeys.of(derive(site, "c1", job, uid))


def tier(s3: FakeS3, k: JobKeys | None, rank: int = 0) -> S3Tier:
    return S3Tier("s3", S3Settings("site-bucket"), JOB, rank, s3=s3, keys=k)


def commit(t: S3Tier, step: int, world: int) -> None:
    shards, data = codec.encode({"w": np.full(4, step, "<f4")})
    t.commit(Manifest(JOB, step, world, t.rank, tuple(shards), 1.0, {}), data)


# ---- names (pure) ------------------------------------------------------------------------------
def test_a_marker_name_verifies_under_the_key_that_made_it_and_states_what_it_covers() -> None:
    k = keys(A)
    name = marker_name(k.signing, JOB, rank=3, step=40, world=8)
    assert name.startswith("step-000000000040/rank-00003.w8.ka.") and len(name.split(".")[-1]) == 32
    m = verify(name, k, JOB)
    assert m is not None and (m.step, m.rank, m.world, m.kid) == (40, 3, 8, "ka")


@pytest.mark.parametrize("other", [
    {"job": "job-613"}, {"rank": 4}, {"step": 41}, {"world": 16},
])
def test_a_tag_covers_job_rank_step_and_world(other: dict[str, object]) -> None:
    """A name moved to another step, rank or world (or copied from another job) does not
    verify: the tag is over all four."""
    k = keys(A)
    fields: dict[str, object] = {"job": JOB, "rank": 3, "step": 40, "world": 8, **other}
    made = marker_name(k.signing, str(fields["job"]), int(str(fields["rank"])),
                       int(str(fields["step"])), int(str(fields["world"])))
    tag = made.rsplit(".", 1)[1]
    moved = marker_name(k.signing, JOB, 3, 40, 8).rsplit(".", 1)[0] + "." + tag
    assert verify(moved, k, JOB) is None


def test_names_not_made_with_this_jobs_keys_are_refused_and_counted_never_raised() -> None:
    k, bobs = keys(A), keys(A, uid=BOB)
    good = marker_name(k.signing, JOB, 0, 10, 2)
    planted = [
        marker_name(bobs.signing, JOB, 0, 30, 1),          # another user's job key, same kid
        marker_name(keys(B).signing, JOB, 0, 30, 1),       # a kid this job does not have
        marker_name(keys(A, job="613").signing, JOB, 0, 30, 1),  # another job's key
        good.rsplit(".", 1)[0] + "." + "0" * 32,           # a wrong tag
        good.upper(), good + "x", good + "/x", "x/" + good, good.replace(".w2.", ".w02."),
        good.replace("rank-00000", "rank-000000"), good.replace(".w2.", ".w0."),
        good.replace("step-000000000010", "step-10"), "", ".", "step-000000000010/",
        good.replace(".ka.", ".."), good.replace(".ka.", ".k.a."), "\0" * 40, "é" * 40,
    ]
    index = Index.read([*planted, good], k, JOB)
    assert [(m.step, m.rank, m.world) for m in index.markers] == [(10, 0, 2)]
    assert index.refused == len(planted)


def test_a_rank_outside_its_stated_world_is_refused() -> None:
    k = keys(A)
    signed = f"step-000000000010/rank-00002.w2.ka.{s3index.tag(k.signing[1], JOB, 2, 10, 2)}"
    index = Index.read([signed], k, JOB)
    assert index.markers == () and index.refused == 1
    with pytest.raises(ValueError, match="rank 2 of 2"):
        marker_name(k.signing, JOB, 2, 10, 2)


def test_the_shared_tier_key_names_its_markers_without_a_key_id() -> None:
    shared = JobKeys.shared(b"p" * 32)
    name = marker_name(shared.signing, JOB, 0, 5, 1)
    assert ".w1.." in name and verify(name, shared, JOB) is not None
    assert verify(name, keys(A), JOB) is None  # no shared-tier key: refused


def test_held_and_the_newest_step_every_rank_of_a_world_holds() -> None:
    k = keys(A)
    names = [marker_name(k.signing, JOB, r, s, 3) for r in range(3) for s in (10, 20)
             if (r, s) != (2, 20)]
    names.append(marker_name(k.signing, JOB, 0, 30, 3))
    assert held_from_index(names, k, JOB, 3) == {0: [10, 20, 30], 1: [10, 20], 2: [10]}
    index = Index.read(names, k, JOB)
    assert index.complete(3) == [10] and index.newest() == (10, 3)
    assert held_from_index(names, k, JOB, 4) == {} and index.complete(4) == []


def test_a_planted_step_is_never_selected() -> None:
    """Bob plants names for a newer step of alice's job, for every rank: with his own job's
    key, a kid alice's job has not, or a random tag. Alice's newest complete step stays hers."""
    k = keys(A)
    names = [marker_name(k.signing, JOB, r, 10, 2) for r in range(2)]
    for r in range(2):
        names += [marker_name(keys(A, uid=BOB).signing, JOB, r, 99, 2),
                  marker_name(keys(B).signing, JOB, r, 99, 2),
                  marker_name(k.signing, JOB, r, 99, 2).rsplit(".", 1)[0] + ".ab" * 16]
    index = Index.read(names, k, JOB)
    assert index.newest() == (10, 2) and index.refused == 6
    assert held_from_index(names, k, JOB, 2) == {0: [10], 1: [10]}


def test_a_newer_complete_step_under_another_world_size_wins() -> None:
    """A job requeued with another world size (elastic): each marker says its world, and the
    newest step one whole world holds is chosen, with that world."""
    k = keys(A)
    names = [marker_name(k.signing, JOB, r, 10, 4) for r in range(4)]
    names += [marker_name(k.signing, JOB, r, 20, 2) for r in range(2)]
    names += [marker_name(k.signing, JOB, r, 30, 4) for r in range(3)]
    assert Index.read(names, k, JOB).newest() == (20, 2)


# ---- S3Tier: written after the manifest, deleted before it, read with one LIST ----------------
def test_commit_writes_the_marker_after_the_manifest() -> None:
    s3, k = FakeS3(), keys(A)
    commit(tier(s3, k, rank=1), 10, world=2)
    puts = [key for op, key in s3.calls if op == "put"]
    step = f"gpuwarden-ckpt/{JOB}/rank-00001/step-000000000010/"
    marker = INDEX + marker_name(k.signing, JOB, 1, 10, 2)
    assert puts[-3:] == [step + MAC, step + MANIFEST, marker]
    assert s3.objects[marker] == b""


def test_delete_removes_the_marker_first() -> None:
    s3, k = FakeS3(), keys(A)
    t = tier(s3, k)
    commit(t, 10, world=1)
    commit(t, 20, world=1)
    s3.calls.clear()
    t.delete(10)
    deletes = [key for op, key in s3.calls if op == "delete"]
    assert deletes[0] == INDEX + marker_name(k.signing, JOB, 0, 10, 1)
    assert deletes[1].endswith("/step-000000000010/" + MANIFEST)
    assert not [key for key in s3.objects if "000000000010" in key]
    assert t.index().newest() == (20, 1)


def test_delete_removes_a_marker_made_under_a_rotated_key() -> None:
    s3 = FakeS3()
    commit(tier(s3, keys(A)), 10, world=1)
    t = tier(s3, keys(B, A))
    t.delete(10)
    assert not [key for key in s3.objects if key.startswith(INDEX)]


def test_delete_leaves_other_ranks_markers() -> None:
    s3, k = FakeS3(), keys(A)
    for r in (1, 10):
        commit(tier(s3, k, rank=r), 10, world=11)
    tier(s3, k, rank=1).delete(10)
    assert held_from_index([key[len(INDEX):] for key in s3.objects if key.startswith(INDEX)],
                           k, JOB, 11) == {10: [10]}


def test_one_paginated_list_gives_every_ranks_steps_and_counts_the_refused() -> None:
    s3, k = FakeS3(page_size=2), keys(A)
    for r in range(3):
        for step in (10, 20):
            commit(tier(s3, k, rank=r), step, world=3)
    s3.objects[INDEX + marker_name(keys(A, uid=BOB).signing, JOB, 0, 30, 3)] = b""
    s3.objects[INDEX + "step-000000000030/rank-00001.w3.ka." + "0" * 32] = b""
    s3.objects[INDEX + "junk"] = b""
    s3.calls.clear()
    index = tier(s3, k).index()
    assert [c for c in s3.calls if c[0] == "list"] == [("list", INDEX)]
    assert index.complete(3) == [20, 10] and index.newest() == (20, 3)
    assert index.refused == 3 and index.held(3) == {0: [10, 20], 1: [10, 20], 2: [10, 20]}


def test_without_keys_nothing_in_the_index_is_trusted() -> None:
    s3, k = FakeS3(), keys(A)
    commit(tier(s3, k), 10, world=1)
    index = tier(s3, None).index()
    assert index.markers == () and index.refused == 1


def test_an_index_that_cannot_be_listed_is_a_tier_error() -> None:
    s3 = FakeS3()

    def refuse(_op: str) -> object:
        from tests.unit.fake_s3 import client_error
        raise client_error("AccessDenied", "ListObjectsV2", 403)
    s3.get_paginator = refuse  # type: ignore[method-assign]
    with pytest.raises(TierError, match=f"cannot list s3://site-bucket/{INDEX}"):
        tier(s3, keys(A)).index()


def test_a_failed_marker_put_leaves_the_step_committed_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    """The marker only helps the prolog find the step: the step itself is whole (its manifest
    is there) and the job restores it; the warning says stage-in will not see it."""
    s3, k = FakeS3(), keys(A)
    put = s3.put_object

    def put_but_markers(Bucket: str, Key: str, Body: bytes) -> None:
        if Key.startswith(INDEX):
            from tests.unit.fake_s3 import client_error
            raise client_error("SlowDown", "PutObject", 503)
        put(Bucket, Key, Body)
    s3.put_object = put_but_markers  # type: ignore[method-assign]
    t = tier(s3, k)
    commit(t, 10, world=1)
    assert t.steps() == [10] and t.manifest(10).step == 10
    assert "index marker" in caplog.text and "stage-in" in caplog.text


def test_the_module_keeps_its_label_apart_from_the_manifest_macs() -> None:
    """A MANIFEST.mac's MACs, the shards' digest key and an index tag never share a label (a MAC
    of one is never the tag of another)."""
    from gpuwarden.ckpt import s3mac
    labels = [s3index.LABEL, s3mac.V1_LABEL, s3mac.V2_LABEL, s3mac.DIGEST_LABEL]
    assert len(set(labels)) == 4 and s3index.LABEL == b"gpuwarden-s3-index\0"
    assert s3mac.V1_LABEL == b"gpuwarden-s3-manifest\0"  # what earlier releases' MACs are under
