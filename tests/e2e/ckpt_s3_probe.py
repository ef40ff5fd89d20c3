"""Run inside a cluster node (python3 -I with the mounted tree on its path): exercise the
checkpoint tiers against node memory and the cluster's real S3 server; print one JSON result.

Usage: ckpt_s3_probe.py JOB MODE   MODE: roundtrip | kill-upload | kill-manifest | inspect
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from gpuwarden.ckpt import codec
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.names import step_dir
from gpuwarden.ckpt.restore import restore
from gpuwarden.ckpt.s3tier import S3Settings, S3Tier

for line in Path("/etc/gpuwarden-cluster/s3.env").read_text().splitlines():
    key, _, value = line.partition("=")
    os.environ[key] = value


def state(step: int) -> dict[str, object]:
    rng = np.random.default_rng(step)
    return {"weights": rng.standard_normal(6 << 20).astype(np.float32),  # 24 MiB
            "step": np.array([step], dtype=np.int64)}


def tiers(job: str) -> tuple[FsTier, S3Tier]:
    settings = S3Settings(bucket=os.environ["GPUWARDEN_S3_BUCKET"],
                          endpoint_url=os.environ["GPUWARDEN_S3_ENDPOINT"], part_size=8 << 20,
                          concurrency=4)
    # S3 manifests are authenticated with the job's key; this probe's runs (separate processes)
    # share one derived from the job name: a test key, not a secret.
    key = hashlib.sha256(f"ckpt-s3-probe:{job}".encode()).digest()
    return FsTier("shm", "/dev/shm/gpuwarden-ckpt", job), S3Tier("s3", settings, job, key=key)


def commit(t: FsTier | S3Tier, step: int, **kw: object) -> None:
    shards, data = codec.encode(state(step))
    t.commit(Manifest(JOB, step, 1, 0, tuple(shards), time.time(), {}), data, **kw)


JOB, MODE = sys.argv[1], sys.argv[2]
shm, s3 = tiers(JOB)
out: dict[str, object] = {}
if MODE == "roundtrip":
    commit(shm, 1)
    commit(s3, 1)
    shard = Path(shm.dir) / step_dir(1) / "weights"
    raw = bytearray(shard.read_bytes())
    raw[12345] ^= 0x40
    shard.write_bytes(bytes(raw))
    got = restore([shm, s3])
    assert got is not None
    out = {"step": got.step, "tier": got.tier, "skipped": list(got.skipped),
           "identical": bool(np.array_equal(got.state["weights"], state(1)["weights"]))}
elif MODE == "kill-upload":
    sent = [0]

    def progress(n: int) -> None:
        sent[0] += n
        if sent[0] > 12 << 20:  # part-way through the first shard's multipart upload
            os.kill(os.getpid(), signal.SIGKILL)
    commit(s3, 2, progress=progress)
elif MODE == "kill-manifest":
    real = s3.s3.put_object

    def put_object(**kw: object) -> object:
        if str(kw.get("Key", "")).endswith("MANIFEST.json"):
            os.kill(os.getpid(), signal.SIGKILL)  # every shard is up, the manifest is not
        return real(**kw)
    s3.s3.put_object = put_object
    commit(s3, 3)
else:
    got = restore([s3])
    out = {"steps": s3.steps(), "restored": got.step if got else None,
           "aborted_uploads": s3.gc_uploads(older_than_s=0)}
    for step in shm.steps():  # leave node memory as it was
        shm.delete(step)
print(json.dumps(out))
