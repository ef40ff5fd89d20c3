"""Issue 6, scenarios 4 and 5 as Slurm jobs of ckpt/train.sbatch.

4: S3 is stopped for a minute mid-run: training goes on (the shared filesystem keeps getting
   every step), the write-back to S3 catches up when it returns, and nothing is lost.
5: node memory (tier 0) runs out: a clear error, the previous durable step intact, and the
   job, requeued once there is room, finishes from it bit-identical.
"""

from __future__ import annotations

import re
import time

import pytest

from devcluster.harness import JOBS_DIR, TRAIN_SBATCH, Harness
from tests.e2e.test_foundation import wait_for

pytestmark = pytest.mark.timeout(600)


def s3_env(h: Harness) -> dict[str, str]:
    text = h.exec("c1", ["cat", "/etc/gpuwarden-cluster/s3.env"]).check("s3.env").out
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_s3_away_for_a_minute_costs_no_training_and_loses_nothing(cluster: Harness) -> None:
    h = cluster
    env = s3_env(h)
    config = f"{JOBS_DIR}/ckpt-s3-{int(time.time())}.toml"
    h.sh("slurmctld", f"""cat > {config} <<'EOF'
[ckpt]
shared_root = "/fsx/gpuwarden-ckpt"
s3_bucket = "{env['GPUWARDEN_S3_BUCKET']}"
s3_endpoint = "{env['GPUWARDEN_S3_ENDPOINT']}"
part_size_mb = 5
EOF
chmod 0644 {config}""").check("job config")
    args = ["--steps", "80", "--every", "5", "--mb", "4", "--step-s", "1", "--config", config]
    expected = h.train_reference(2, args)
    creds = {k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    job = h.sbatch("-N2", "--gpus-per-node=8", name="train", script=[TRAIN_SBATCH, *args],
                   env=creds)
    wait_for(lambda: max(h.shared_steps(job, 1), default=0) >= 10, 180, "step 10 durable")
    h.stop("s3", timeout=2)
    away_at = max(h.shared_steps(job, 1))
    try:
        time.sleep(60)
        during = max(h.shared_steps(job, 1))
    finally:
        h.start("s3")
    # Training went on and the shared filesystem kept every step while S3 was away.
    assert during >= away_at + 30, (away_at, during)
    h.wait_job(job, timeout=400)
    assert h.train_finals(job, 2) == expected
    log = h.exec("slurmctld", ["cat", f"{JOBS_DIR}/train-{job}.out"]).out
    assert "will retry (training goes on)" in log, log[-2000:]
    for rank in range(2):
        listed = h.sh("c1", f"env $(cat /etc/gpuwarden-cluster/s3.env | xargs) gpuwarden "
                      f"--config {config} ckpt verify job-{job} --rank {rank}", timeout=120)
        assert listed.rc == 0, listed.out
        assert re.search(r"s3\s+step 80: ok", listed.out), listed.out  # caught up


def test_tier0_out_of_space_is_a_clear_error_and_the_durable_step_survives(
        cluster: Harness) -> None:
    h = cluster
    args = ["--steps", "20", "--every", "5", "--mb", "8", "--step-s", "1"]
    expected = h.train_reference(1, args)
    # Node memory is filled before the job starts, leaving room for one 8 MiB step and 6 MiB
    # more: step 5 fits, step 10 cannot (the previous steps stay until a new one is complete).
    # Filled while the job ran, the fill raced the job's own saves (fallocate failed when a
    # step landed between df and fallocate; under load a step could land before the fill).
    fill = h.sh("c3", "avail=$(df --output=avail -B1 /dev/shm | tail -1); "
                "fallocate -l $((avail - 14*1024*1024)) /dev/shm/filler && df -h /dev/shm")
    fill.check("fill /dev/shm")
    try:
        job = h.sbatch("-N1", "-w", "c3", "--gpus-per-node=8", name="train",
                       script=[TRAIN_SBATCH, *args])
        wait_for(lambda: 5 in h.shared_steps(job, 0), 120, "step 5 durable")
        h.wait_job(job, want=("FAILED",), timeout=120)
    finally:
        h.sh("c3", "rm -f /dev/shm/filler")
    log = h.exec("slurmctld", ["cat", f"{JOBS_DIR}/train-{job}.out"]).out
    assert re.search(r"memory: out of space writing step 10 .*the previous steps are intact",
                     log), log[-2000:]
    assert "Traceback" not in log
    verify = h.sh("c1", f"gpuwarden ckpt verify job-{job}")
    assert "shared   step 5: ok" in verify.out, verify.out
    # Room again: requeued, it resumes from step 5 and ends as if nothing happened.
    h.exec("slurmctld", ["scontrol", "requeue", str(job)]).check("requeue")
    h.wait_job(job, timeout=240)
    assert "restored step 5 from" in h.exec("slurmctld",
                                             ["cat", f"{JOBS_DIR}/train-{job}.out"]).out
    assert h.train_finals(job, 1) == expected
