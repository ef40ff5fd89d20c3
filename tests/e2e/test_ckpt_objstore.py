"""Issue 37 through Slurm: tiered checkpointing on a site that chose an object store over a
parallel filesystem (the objstore cluster: node memory, peers and S3; no /fsx anywhere).

A 3-rank job with one spare (ckpt/train_spares.sbatch) loses a training node: the launcher
relaunches the step on the survivors and the spare, the survivors restore from their own memory
and the lost rank from its partner's replica, with no requeue, bit-identical.

S3 stopped while a job trains: training goes on in node memory, the writer catches up once S3
is back, and root's `ckpt verify` derives the job's keys to find the last step whole.

A 2-rank training job (ckpt/train.sbatch: the job's own coordinator on the batch host, each
job's key derived by the prolog from the site secret) loses its other node once step 10 is in
S3's authenticated index. Slurm requeues it, and the node it gets instead sorts before the
survivor, so the survivor's rank changes: rank 0 now runs on the new node and the survivor
holds rank 0's own steps but runs rank 1. Each node's prolog stages its new ranks' newest
common step from S3 into memory (FSx-linked-to-S3 style), every rank restores it from memory,
and the job ends bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import re

import pytest

from devcluster.harness import LOCAL_JOBS_DIR, TRAIN_SBATCH, Harness
from tests.e2e.test_ckpt_outages import s3_env
from tests.e2e.test_ckpt_requeue import hostnames, lose_node, ran_on
from tests.e2e.test_ckpt_spares import SPARES_SBATCH
from tests.e2e.test_foundation import wait_for
from tests.e2e.test_health import nodes

# The node-loss tests run on every release (`versions`); the S3 outage, which no Slurm
# behaviour touches, on the default release only.
pytestmark = [pytest.mark.timeout(600)]

_LIST = """
import os, sys, boto3
s3 = boto3.client("s3", endpoint_url=os.environ["GPUWARDEN_S3_ENDPOINT"])
got = s3.list_objects_v2(Bucket=os.environ["GPUWARDEN_S3_BUCKET"],
                         Prefix=f"gpuwarden-ckpt/job-{sys.argv[1]}/index/")
print("\\n".join(o["Key"] for o in got.get("Contents", [])))
"""


def indexed(h: Harness, job: int, env: dict[str, str]) -> dict[int, set[int]]:
    """The steps each rank's index marker names in S3 (whatever their tags: a listing)."""
    vars_ = " ".join(f"{k}={v}" for k, v in env.items())
    out = h.sh("c1", f"env {vars_} python3 -c '{_LIST}' {job}").out
    held: dict[int, set[int]] = {}
    for step, rank in re.findall(r"/step-(\d+)/rank-(\d+)\.", out):
        held.setdefault(int(rank), set()).add(int(step))
    return held


def logs(h: Harness, job: int) -> str:
    """The job's output from every node (each run's batch host writes its own part)."""
    return "".join(h.exec(n, ["cat", f"{LOCAL_JOBS_DIR}/train-{job}.out"]).out
                   for n in h.cluster.spec.node_names)


def syslog(h: Harness) -> str:
    """gpuwarden's lines in every node's syslog (the hooks' errors go there: Slurm discards
    the output of a prolog that exits 0) and each node's last stage-in (its outcome, line and
    what its child said), for a failure's message."""
    return "".join(f"{n}: {line}\n" for n in h.cluster.spec.node_names
                   for line in h.sh(n, "grep -a gpuwarden /var/log/syslog || true; "
                                       "cat /var/lib/gpuwarden/ckpt-stagein.json 2>/dev/null "
                                       "|| true").out.splitlines()[-20:]) + slurmd_prolog(h)


def slurmd_prolog(h: Harness) -> str:
    """What each node's slurmd said about prologs (it logs to the container's output)."""
    out = []
    for n in h.cluster.spec.node_names:
        try:
            text = h.container(n).logs(tail=400).decode(errors="replace")
        except Exception as exc:  # a failure's message must not hide the failure
            out.append(f"{n} slurmd: (its log could not be read: {exc})")
            continue
        out += [f"{n} slurmd: {line}" for line in text.splitlines()
                if re.search(r"(?i)prolog|requeue|stage", line)][-8:]
    return "\n".join(out) + "\n"


def no_fsx(h: Harness) -> None:
    for node in ("slurmctld", *h.cluster.spec.node_names):
        assert h.exec(node, ["test", "-e", "/fsx"]).rc != 0, f"{node} has a /fsx"


def at_step_10(h: Harness, job: int, env: dict[str, str], ranks: int) -> None:
    def held() -> bool:
        got = indexed(h, job, env)
        return len(got) == ranks and all(10 in s for s in got.values())
    wait_for(held, 240, f"step 10 of all {ranks} ranks in S3's index")


def start(h: Harness, world: int, nodes_: int, script: str,
          extra: dict[str, str] | None = None, steps: int = 60,
          every: int = 5) -> tuple[dict[str, str], list[str], int]:
    """A training job of ``world`` ranks on ``nodes_`` nodes with the jobs' S3 credentials, as a
    user submits it: (the cluster's S3 settings, an uninterrupted run's checksums, job id)."""
    env = s3_env(h)
    creds = {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    args = ["--steps", str(steps), "--every", str(every), "--mb", "4", "--step-s", "1"]
    expected = h.train_reference(world, args)
    job = h.sbatch(f"-N{nodes_}", "--gpus-per-node=8", name="train", script=[script, *args],
                   env={**creds, **(extra or {})})
    return env, expected, job


def finals(log: str, world: int) -> list[str | None]:
    """Each rank's final checksum, as the ranks printed it (no shared place to write it)."""
    got = dict(re.findall(r"rank (\d): final checksum (\w+)", log))
    return [got.get(str(r)) for r in range(world)]


@pytest.mark.versions
def test_a_lost_node_is_replaced_by_a_spare_without_a_shared_filesystem(
        objstore_cluster: Harness) -> None:
    h = objstore_cluster
    no_fsx(h)
    # A save every 5 steps: the survivors train on until the launcher stops them, saving more
    # than `keep` (2) steps under load (seen in CI with eight clusters on two cores). Node
    # memory still holds the step the lost rank's replica holds (tier 0 keeps the ranks'
    # published floor besides its newest `keep`), so the restore takes it at memory speed.
    env, expected, job = start(h, 3, 4, SPARES_SBATCH,
                               {"SPARES": "1", "LAUNCH_OPTS": "--deadline-s 5"}, every=5)
    at_step_10(h, job, env, 3)
    allocated = hostnames(h, h.job_fields(job)["NodeList"])
    # Not the first node: the batch script and the launcher run there (the requeue's case).
    victim = allocated[1]
    h.kill(victim)
    try:
        h.wait_job(job, timeout=400)
    finally:
        h.heal(victim)
    assert h.job_fields(job).get("Restarts", "0") == "0", "no requeue"
    log = logs(h, job)
    restored = re.findall(r"rank (\d): restored step (\d+) from (\w+)", log)
    assert len(restored) >= 3 and len({s for _, s, _ in restored}) == 1, log[-3000:]
    # Memory speed with no shared filesystem and no S3 read: the survivors from their own
    # node's memory, the lost rank (now on the spare) from its partner's replica.
    tiers = {int(r): tier for r, _, tier in restored}
    lost_rank = allocated.index(victim)
    assert tiers[lost_rank] == "peer" and all(
        t == "memory" for r, t in tiers.items() if r != lost_rank), f"{tiers}\n{syslog(h)}"
    assert finals(log, 3) == expected, "bit-identical"
    wait_for(lambda: not nodes(h)[victim].down, 180, f"{victim} back in service")


@pytest.mark.versions
def test_a_killed_node_without_a_shared_filesystem_costs_a_requeue_and_nothing_else(
        objstore_cluster: Harness) -> None:
    h = objstore_cluster
    no_fsx(h)
    # c1 held while the job starts, so the job runs on two later nodes. Before the loss every
    # other node is held instead and c1 freed: the requeued job can only get c1 and the
    # survivor, and c1 sorts first, so every rank moves (the survivor ran rank 0: it now runs
    # rank 1, beside rank 0's own steps and rank 1's replica, neither of which may be used).
    holders = [h.sbatch("-N1", "-w", "c1", "--exclusive", name="holder", wrap="sleep 600")]
    try:
        h.wait_job(holders[0], want=("RUNNING",))
        env, expected, job = start(h, 2, 2, TRAIN_SBATCH)
        at_step_10(h, job, env, 2)
        first = hostnames(h, h.job_fields(job)["NodeList"])
        assert "c1" not in first, first
        survivor = h.job_fields(job)["BatchHost"]
        victim = next(n for n in first if n != survivor)
        others = [n for n in h.cluster.spec.node_names if n not in ("c1", *first)]
        holders.append(h.sbatch(f"-N{len(others)}", "-w", ",".join(others), "--exclusive",
                                name="holder", wrap="sleep 600"))
        h.wait_job(holders[1], want=("RUNNING",))
        h.exec("slurmctld", ["scancel", str(holders[0])])
        wait_for(lambda: nodes(h)["c1"].state == ("IDLE",), 120, "c1 idle again")
        lose_node(h, job, victim)
    finally:
        h.exec("slurmctld", ["scancel", *map(str, holders)])
    log = logs(h, job)
    second = ran_on(h, log, 1)
    assert second == ["c1", survivor], (first, second)
    restored = re.findall(r"rank (\d): restored step (\d+) from (\w+) \(restart 1\)", log)
    assert len(restored) == 2, log[-3000:]
    assert len({step for _, step, _ in restored}) == 1, "every rank resumed from the same step"
    assert int(restored[0][1]) >= 10
    # Each node's prolog staged its ranks of that step from S3 into memory before the job
    # started, whichever ranks the node ran before.
    assert {tier for _, _, tier in restored} == {"memory"}, \
        f"{restored}\n{syslog(h)}\n{log[-4000:]}"
    assert finals(log, 2) == expected, "the resumed run ends bit-identical to an uninterrupted one"
    wait_for(lambda: not nodes(h)[victim].down, 180, f"{victim} back in service")


def newest_in_memory(h: Harness, host: str, job: int) -> int:
    """The newest step any rank holds in ``host``'s node memory (a listing)."""
    out = h.sh(host, f"ls -d /dev/shm/gpuwarden-ckpt/job-{job}/rank-*/step-* 2>/dev/null "
                     "|| true").out.split()
    return max((int(p.rsplit("step-", 1)[1]) for p in out), default=0)


def test_s3_away_without_a_shared_filesystem_costs_no_training_and_loses_nothing(
        objstore_cluster: Harness) -> None:
    """The fault trial of the shared-filesystem site, here: S3 is the only durable tier and is
    stopped; training goes on in node memory and peers, the writer retries, and once S3 is
    back it catches up; root's `ckpt verify` (keys derived from the site secret, the job's
    uid from Slurm) finds the last step whole."""
    h = objstore_cluster
    env, expected, job = start(h, 2, 2, TRAIN_SBATCH, steps=80)
    at_step_10(h, job, env, 2)
    batch = h.job_fields(job)["BatchHost"]
    h.stop("s3", timeout=2)
    try:
        away_at = newest_in_memory(h, batch, job)
        wait_for(lambda: newest_in_memory(h, batch, job) >= away_at + 30, 120,
                 "30 more steps saved to node memory while S3 is away")
    finally:
        h.start("s3")
    h.wait_job(job, timeout=400)
    log = logs(h, job)
    assert "will retry (training goes on)" in log, log[-2000:]
    assert finals(log, 2) == expected, "bit-identical"
    for rank in range(2):
        got = h.sh("c1", "env $(cat /etc/gpuwarden-cluster/s3.env | xargs) gpuwarden ckpt "
                         f"verify job-{job} --rank {rank}", timeout=120)
        assert got.rc == 0 and re.search(r"s3\s+step 80: ok", got.out), got.out
