"""Issue 37, step 5 (docs/design/object-store-sites.md, 2.3 and 6): a job of several ranks on
a site without a shared filesystem (node memory, peers, S3 and the prolog's per-job key) saves,
agrees and restores exactly as it does with one, meeting at the job's coordinator."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import jobkey, restorelog, s3tier
from gpuwarden.ckpt.coord import FileCoordinator
from gpuwarden.ckpt.coordnet import ENV_COORD, NetCoordinator
from gpuwarden.ckpt.coordsrv import CoordServer
from gpuwarden.ckpt.job import JobCheckpointer, JobEnv, JobEnvError
from gpuwarden.ckpt.jobkey import JobKeys
from gpuwarden.ckpt.peer import KEY_FILE
from gpuwarden.config.ckpt import CkptConfig

from .test_ckpt_s3tier import FakeS3

JOB_ID, JOB = "612", "job-612"
SITE = [("k1", b"\x07" * 32)]
BUCKET, PREFIX = "ckpt-bucket", "gpuwarden-ckpt"


class SharedS3(FakeS3):
    """One bucket every rank's client reaches, as boto3's do (its methods called from the
    ranks' writer threads at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def put_object(self, Bucket: str, Key: str, Body: bytes) -> None:
        with self.lock:
            self.objects[Key] = bytes(Body)

    def upload_fileobj(self, body: Any, bucket: str, key: str, Config: Any = None,
                       Callback: Any = None) -> None:
        data = body.read()
        with self.lock:
            self.objects[key] = data
        if Callback:
            Callback(len(data))

    def get_paginator(self, op: str) -> Any:
        with self.lock:
            snapshot = dict(self.objects)
        outer = self

        class Pages:
            def paginate(self, Bucket: str, Prefix: str) -> list[dict[str, Any]]:
                return [{"Contents": [{"Key": k} for k in sorted(snapshot)
                                      if k.startswith(Prefix) and k in outer.objects]}]
        return Pages()

    def delete_object(self, Bucket: str, Key: str) -> None:
        with self.lock:
            self.objects.pop(Key, None)

    def list_multipart_uploads(self, Bucket: str, Prefix: str) -> dict[str, Any]:
        return {"Uploads": []}

    def steps(self, rank: int) -> list[int]:
        base = f"{PREFIX}/{JOB}/rank-{rank:05d}/step-"
        return sorted(int(k[len(base):].split("/")[0]) for k in self.objects
                      if k.startswith(base) and k.endswith("/MANIFEST.json"))


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> SharedS3:
    s3 = SharedS3()
    monkeypatch.setattr(s3tier, "client", lambda _settings: s3)
    return s3


@pytest.fixture
def key_dir(tmp_path: Path) -> str:
    """The prolog's doing on every node: the job's key file, the job user's (ours), 0400."""
    d = str(tmp_path / "run" / "gpuwarden-ckpt")
    jobkey.write_job_keys(d, JOB_ID, os.geteuid(), os.getegid(),
                          jobkey.derive(SITE, "c1", JOB_ID, os.geteuid()))
    return d


def config(tmp_path: Path, node: str, key_dir: str, **kw: Any) -> CkptConfig:
    return CkptConfig(**{"memory_root": str(tmp_path / node), "s3_bucket": BUCKET,
                         "key_file": "/etc/gpuwarden/ckpt.key", "job_key_dir": key_dir,
                         "agree_timeout_s": 20, "keep": 2, **kw})


def state(step: int, rank: int) -> dict[str, Any]:
    return {"w": np.full((64, 32), step + rank / 10, dtype=np.float32), "tag": f"{step}".encode()}


def ranks(tmp_path: Path, key_dir: str, nodes: list[str], restarts: int,
          body: Callable[[JobCheckpointer], Any]) -> dict[int, Any]:
    """Each node's rank as a thread, meeting at a coordinator of their own as a batch
    script's wrapper starts it: its address in their environment, nothing passed in."""
    server = CoordServer(jobkey.read_job_keys(key_dir, JOB_ID).signing[1], JOB,
                         host="127.0.0.1")
    environ = {ENV_COORD: f"127.0.0.1:{server.port}"}
    out: dict[int, Any] = {}

    def run(r: int) -> None:
        ck = JobCheckpointer(config(tmp_path, nodes[r], key_dir),
                             JobEnv(JOB_ID, r, len(nodes), restarts, "0", nodes[r]),
                             host="127.0.0.1", environ=environ)
        try:
            assert isinstance(ck.coord, NetCoordinator)
            out[r] = body(ck)
        except BaseException as exc:
            out[r] = exc
        finally:
            ck.finish(timeout=30)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(nodes))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    finally:
        server.stop()
    for r, got in out.items():
        if isinstance(got, BaseException):
            raise AssertionError(f"rank {r}: {got!r}") from got
    return out


def train(ck: JobCheckpointer) -> int:
    for step in (10, 20):
        ck.save(step, state(step, ck.env.rank))
        assert ck.wait_durable(step, timeout=30)
    return step


def resume(ck: JobCheckpointer) -> tuple[int, str, bool]:
    got = ck.restore()
    assert got is not None
    want = state(got.step, ck.env.rank)
    return got.step, got.tier, bool(np.array_equal(got.state["w"], want["w"])
                                     and got.state["tag"] == want["tag"])


NODES = ["nodeA", "nodeB", "nodeC"]


@pytest.fixture
def trained(tmp_path: Path, key_dir: str, bucket: SharedS3) -> Iterator[SharedS3]:
    assert ranks(tmp_path, key_dir, NODES, 0, train) == {0: 20, 1: 20, 2: 20}
    assert [bucket.steps(r) for r in range(3)] == [[10, 20]] * 3
    yield bucket


def test_s3_bucket_without_shared_root_accepted_with_key_file(tmp_path: Path, key_dir: str,
                                                              bucket: SharedS3) -> None:
    ck = JobCheckpointer(config(tmp_path, "n1", key_dir), JobEnv(JOB_ID, 0, 1, 0, "0", "n1"))
    ck.save(5, state(5, 0))
    assert ck.finish(5, timeout=30)
    assert bucket.steps(0) == [5]
    mac = bucket.objects[f"{PREFIX}/{JOB}/rank-00000/step-{5:012d}/MANIFEST.mac"]
    assert mac.startswith(b"v2 k1:")  # signed with the prolog's derived key, its key id named


def test_three_ranks_without_a_shared_filesystem_restore_bit_identical_from_memory(
        tmp_path: Path, key_dir: str, trained: SharedS3) -> None:
    out = ranks(tmp_path, key_dir, NODES, 1, resume)
    assert out == {r: (20, "memory", True) for r in range(3)}
    assert not any((tmp_path / n / JOB / KEY_FILE).exists() for n in NODES)


def test_a_replaced_node_restores_from_its_peer(tmp_path: Path, key_dir: str,
                                                trained: SharedS3) -> None:
    shutil.rmtree(tmp_path / "nodeB")  # nodeB lost; nodeD takes rank 1
    out = ranks(tmp_path, key_dir, ["nodeA", "nodeD", "nodeC"], 1, resume)
    assert out == {0: (20, "memory", True), 1: (20, "peer", True), 2: (20, "memory", True)}


def test_a_requeue_onto_new_nodes_restores_from_s3_and_records_it_there(
        tmp_path: Path, key_dir: str, trained: SharedS3) -> None:
    out = ranks(tmp_path, key_dir, ["nodeD", "nodeE", "nodeF"], 1, resume)
    assert out == {r: (20, "s3", True) for r in range(3)}
    # The report's restore times: one record per rank beside the steps, under the job's key.
    keys = jobkey.read_job_keys(key_dir, JOB_ID)
    for r in range(3):
        name = f"restore-r1-s0.rank-{r}"
        raw = trained.objects[f"{PREFIX}/{JOB}/coord/{name}"]
        assert restorelog.mac_ok(keys, raw, trained.objects[f"{PREFIX}/{JOB}/coord/{name}.mac"])
        rec = restorelog.parse(raw, JOB, name)
        assert (rec.rank, rec.step, rec.tier) == (r, 20, "s3")
    other = JobKeys.of(jobkey.derive(SITE, "c1", "613", os.geteuid()))
    raw = trained.objects[f"{PREFIX}/{JOB}/coord/restore-r1-s0.rank-0"]
    assert not restorelog.mac_ok(other, raw,
                                 trained.objects[f"{PREFIX}/{JOB}/coord/restore-r1-s0.rank-0.mac"])


def test_a_corrupt_s3_copy_of_one_rank_walks_every_rank_back_together(
        tmp_path: Path, key_dir: str, trained: SharedS3) -> None:
    shard = f"{PREFIX}/{JOB}/rank-00001/step-{20:012d}/w"
    damaged = bytearray(trained.objects[shard])
    damaged[100] ^= 0xFF
    trained.objects[shard] = bytes(damaged)
    out = ranks(tmp_path, key_dir, ["nodeD", "nodeE", "nodeF"], 1, resume)
    assert out == {r: (10, "s3", True) for r in range(3)}


def test_several_ranks_without_the_coordinators_address_name_the_wrapper(
        tmp_path: Path, key_dir: str, bucket: SharedS3) -> None:
    with pytest.raises(JobEnvError, match=r"shared_root.*GPUWARDEN_CKPT_COORD.*"
                                          r"`gpuwarden ckpt coord --`"):
        JobCheckpointer(config(tmp_path, "n1", key_dir), JobEnv(JOB_ID, 0, 2, 0, "0", "n1"),
                        environ={})


def test_several_ranks_without_a_key_say_to_set_key_file(tmp_path: Path) -> None:
    cfg = CkptConfig(memory_root=str(tmp_path / "m"))
    with pytest.raises(JobEnvError, match=r"key_file") as err:
        JobCheckpointer(cfg, JobEnv(JOB_ID, 0, 2, 0, "0", "n1"),
                        environ={ENV_COORD: "127.0.0.1:9"})
    assert "gpuwarden ckpt coord" not in str(err.value)  # its address is there already


def test_a_missing_job_key_file_stops_the_rank_with_what_the_prolog_does(
        tmp_path: Path, bucket: SharedS3) -> None:
    cfg = config(tmp_path, "n1", str(tmp_path / "nokeys"))
    with pytest.raises(jobkey.JobKeyError, match="the prolog writes it"):
        JobCheckpointer(cfg, JobEnv(JOB_ID, 0, 1, 0, "0", "n1"))


def test_a_shared_site_that_adds_key_file_signs_with_it_and_still_reads_older_steps(
        tmp_path: Path, key_dir: str, bucket: SharedS3) -> None:
    shared = str(tmp_path / "fsx")
    before = CkptConfig(memory_root=str(tmp_path / "m1"), shared_root=shared,
                        s3_bucket=BUCKET, peer_replicas=0)
    ck = JobCheckpointer(before, JobEnv(JOB_ID, 0, 1, 0, "0", "n1"))
    ck.save(5, state(5, 0))
    assert ck.finish(5, timeout=30)
    assert not bucket.objects[f"{PREFIX}/{JOB}/rank-00000/step-{5:012d}/MANIFEST.mac"
                              ].startswith(b"v2 k1:")
    shutil.rmtree(Path(shared) / JOB / "rank-00000")  # only S3 holds step 5 now
    after = config(tmp_path, "m2", key_dir, shared_root=shared, peer_replicas=0)
    ck = JobCheckpointer(after, JobEnv(JOB_ID, 0, 1, 1, "0", "n2"))
    assert isinstance(ck.coord, FileCoordinator)
    got = ck.restore()
    assert got is not None and (got.step, got.tier) == (5, "s3")
    ck.save(6, state(6, 0))
    assert ck.finish(6, timeout=30)
    assert bucket.objects[f"{PREFIX}/{JOB}/rank-00000/step-{6:012d}/MANIFEST.mac"
                          ].startswith(b"v2 k1:")
