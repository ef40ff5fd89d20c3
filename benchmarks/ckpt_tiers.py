"""Checkpoint tiers against the test cluster's real S3 server, each goal a ratio from one run.

Runs inside node c1 (Debian's numpy, boto3, xxhash; /dev/shm is tier 0), with a state of
`--mb` MiB of float32:
- stall: the training loop's wait in `Checkpointer.save` (tier 0, write-back behind) against
  a synchronous S3 save of the same state. Goal: <= 0.1.
- restore: from S3 against from tier 0, and against from a peer (a replica in node c2's memory,
  read over the cluster network with the job's HMAC checks); each reads, verifies and
  rebuilds the arrays. Goal: >= 13x (Gemini's figure, against remote object storage; here S3
  is SeaweedFS on the same machine, so the ratio measured is a floor, not the figure a site
  with remote S3 would see).
- upload: gpuwarden's S3 tier against boto3's own `upload_file` of the same bytes. Goal >= 0.9.
- memory: peak extra RSS during save + write-back, over the state size. Goal <= 1.25.
Needs `make cluster-up`.

    .venv/bin/python benchmarks/ckpt_tiers.py [--mb 256]
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time

import docker

from devcluster.cluster import Cluster
from devcluster.spec import from_env

_INSIDE = r'''
import json, os, resource, sys, time, tempfile
from pathlib import Path
import numpy as np
from gpuwarden.ckpt import codec
from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.s3tier import S3Settings, S3Tier, client

for line in Path("/etc/gpuwarden-cluster/s3.env").read_text().splitlines():
    k, _, v = line.partition("="); os.environ[k] = v
mb, mode, job = int(sys.argv[1]), sys.argv[2], sys.argv[3]
settings = S3Settings(bucket=os.environ["GPUWARDEN_S3_BUCKET"],
                      endpoint_url=os.environ["GPUWARDEN_S3_ENDPOINT"], part_size=16 << 20,
                      concurrency=4)
def rss_mb(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
state = {"w": np.random.default_rng(1).standard_normal(mb << 18).astype(np.float32)}
base = rss_mb()
out = {}
shm = FsTier("shm", "/dev/shm/gpuwarden-bench", job)
s3 = S3Tier("s3", settings, job)
if mode == "memory":
    ck = Checkpointer(job, shm, [s3], keep=1)
    ck.save(1, state); ck.wait_durable(1); ck.close()
    out = {"extra_mb": rss_mb() - base, "state_mb": mb}
else:
    t = time.perf_counter(); shards, data = codec.encode(state)
    s3.commit(Manifest(job, 1, 1, 0, tuple(shards), time.time(), {}), data)
    sync_s = time.perf_counter() - t
    ck = Checkpointer(job, shm, [s3], keep=2)
    t = time.perf_counter(); ck.save(2, state); stall_s = time.perf_counter() - t
    ck.wait_durable(2); ck.close()
    def timed_restore(tier):
        t = time.perf_counter(); m, d = tier.load(2)
        [codec.decode(x, d[x.name]) for x in m.shards]
        return time.perf_counter() - t
    t0_s = timed_restore(shm)
    s3_s = timed_restore(s3)
    # Tier 1: a replica in node c2's memory, served by a peer server there (started by the
    # caller with the same key), read over the cluster network with the job's HMAC checks.
    from gpuwarden.ckpt.peer import Address, PeerTier
    addr = Address("c2", int(sys.argv[5]))
    peer = PeerTier(bytes.fromhex(sys.argv[4]), job, 0, [addr], [addr], timeout=120)
    m2, d2 = shm.load(2)
    t = time.perf_counter(); peer.commit(m2, d2); push_s = time.perf_counter() - t
    del m2, d2
    peer.steps()
    peer_s = timed_restore(peer)
    with tempfile.NamedTemporaryFile(dir="/var/tmp") as f:
        f.write(memoryview(state["w"]).cast("B")); f.flush()
        from boto3.s3.transfer import TransferConfig
        cfg = TransferConfig(multipart_threshold=16 << 20, multipart_chunksize=16 << 20,
                             max_concurrency=4)
        raw = client(settings)
        t = time.perf_counter(); raw.upload_file(f.name, settings.bucket, job + "/raw", Config=cfg)
        boto_s = time.perf_counter() - t
    t = time.perf_counter(); shards, data = codec.encode(state)
    s3.commit(Manifest(job, 3, 1, 0, tuple(shards), time.time(), {}), data)
    ours_s = time.perf_counter() - t
    for s in shm.steps(): shm.delete(s)
    out = {"sync_s": sync_s, "stall_s": stall_s, "t0_s": t0_s, "s3_s": s3_s, "boto_s": boto_s,
           "ours_s": ours_s, "peer_s": peer_s, "push_s": push_s}
print(json.dumps(out))
'''


_PEER_SERVER = r'''
import sys, time
from gpuwarden.ckpt.peer import PeerServer
srv = PeerServer(bytes.fromhex(sys.argv[1]), sys.argv[2], "/dev/shm/gpuwarden-bench",
                 port=int(sys.argv[3]))
time.sleep(float(sys.argv[4]))
srv.stop()
'''
PEER_PORT = 47311


def inside(cluster: Cluster, mb: int, mode: str, job: str, key: str) -> dict[str, float]:
    res = cluster.exec("c1", ["python3", "-c", _INSIDE, str(mb), mode, job, key,
                              str(PEER_PORT)], timeout=600)
    res.check("benchmark")
    return json.loads(res.out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    args = ap.parse_args()
    cluster = Cluster(docker.from_env(timeout=600), from_env(), progress=lambda m: None)
    job = f"bench-{int(time.time())}"
    key = secrets.token_hex(32)
    cluster.container("c2").exec_run(
        ["python3", "-c", _PEER_SERVER, key, job, str(PEER_PORT), "600"], detach=True)
    time.sleep(2)
    try:
        r = inside(cluster, args.mb, "speed", job, key)
        mem = inside(cluster, args.mb, "memory", job + "-m", key)
    finally:
        cluster.exec("c2", ["bash", "-c", f"pkill -f 'PeerServer' ; rm -rf "
                            f"/dev/shm/gpuwarden-bench/{job}.peer"], timeout=30)  # noqa: S108 - in the node
    stall = r["stall_s"] / r["sync_s"]
    restore = r["s3_s"] / r["t0_s"]
    upload = r["boto_s"] / r["ours_s"]
    extra = mem["extra_mb"] / mem["state_mb"]
    print(f"state {args.mb} MiB, S3 = the cluster's SeaweedFS, node c1")
    print(f"stall per save   {r['stall_s']:7.2f} s vs synchronous S3 save {r['sync_s']:6.2f} s: "
          f"{stall:.3f} (goal <= 0.1)")
    print(f"restore          tier 0 {r['t0_s']:6.2f} s vs S3 {r['s3_s']:6.2f} s: "
          f"{restore:.1f}x faster (goal >= 13)")
    print(f"restore          peer (c2 -> c1) {r['peer_s']:6.2f} s vs S3 {r['s3_s']:6.2f} s: "
          f"{r['s3_s'] / r['peer_s']:.1f}x faster; replica push {r['push_s']:.2f} s")
    print(f"S3 upload        ours {r['ours_s']:6.2f} s vs boto3 upload_file {r['boto_s']:6.2f} "
          f"s: throughput {upload:.2f}x (goal >= 0.9)")
    print(f"peak extra RSS   {mem['extra_mb']:.0f} MiB for a {mem['state_mb']} MiB state: "
          f"{extra:.2f}x (goal <= 1.25)")
    ok = stall <= 0.1 and restore >= 13 and upload >= 0.9 and extra <= 1.25
    print("PASS" if ok else "FAIL (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
