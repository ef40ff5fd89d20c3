"""Checkpoint settings (the `[ckpt]` table): where each tier lives."""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuwarden.core.configload import require

_ABS = re.compile(r"^(/[A-Za-z0-9._@+-]+)+$")


def _plain_abs(path: str) -> bool:
    """Absolute, and no . or .. component: root writes or reads there, say where exactly."""
    return bool(_ABS.match(path)) and not {".", ".."} & set(path.split("/"))


@dataclass(frozen=True)
class CkptConfig:
    memory_root: str = "/dev/shm/gpuwarden-ckpt"  # noqa: S108 - tier 0; job dirs are private
    shared_root: str = ""  # tier 2, the parallel filesystem; empty: none
    s3_bucket: str = ""  # tier 3; empty: none
    s3_endpoint: str = ""  # empty: AWS
    s3_prefix: str = "gpuwarden-ckpt"
    part_size_mb: int = 64
    concurrency: int = 8
    # Restores from S3: each shard by ranged GETs of this size, this many at once (at most
    # s3_get_concurrency x s3_get_part_mb in memory ahead of the checksum).
    s3_get_part_mb: int = 16
    s3_get_concurrency: int = 16
    # S3 steps from before keyed shard digests (bound by xxh3_64 alone, which someone with the
    # bucket's credentials can collide): "restore" (with a warning each) or "refuse", once
    # every job writes digests.
    s3_legacy_steps: str = "restore"
    keep: int = 2
    ckpt_cost_s: float = 30.0  # for `ckpt interval` when the job has not measured its own
    mttf_h: float = 0.0  # fallback when the accounting history has no failures to measure
    # Tier 1: replicas of each rank's tier 0 in other nodes' memory, pushed over TCP and
    # authenticated with a per-job key. 0 replicas: no peer tier.
    peer_replicas: int = 1
    peer_port: int = 0  # 0: any free port (each rank publishes its own)
    peer_partner: str = "other-leaf"  # or "next-node"
    topology_conf: str = "/etc/slurm/topology.conf"  # leaf switches, for "other-leaf"
    agree_timeout_s: float = 300.0  # how long ranks wait for each other at start
    # Prolog stage-in: on a requeued job, copy the newest step every rank holds from the
    # shared tier (or S3) into the new nodes' tier 0 before the job starts.
    stage_in: bool = True
    stage_in_budget_s: float = 120.0
    # Without a shared tier, stage in from S3 (the index, then ranged GETs), as the job's user
    # with the nodes' credentials: boto3's default chain (an instance role), or the KEY=VALUE
    # file stage_in_s3_env (root's alone) read by root and handed to the copy in memory.
    stage_in_s3: bool = True
    stage_in_s3_env: str = ""
    # Sites without a shared filesystem: the site secret (root's, 0600, the same on every node)
    # the prolog derives each job's key from (ckpt.jobkey), and where it writes the job's key
    # for the job's user. Empty key_file: no derived keys.
    key_file: str = ""
    job_key_dir: str = "/run/gpuwarden-ckpt"

    def __post_init__(self) -> None:
        require(bool(_ABS.match(self.memory_root)), "memory_root", "an absolute directory")
        require(self.shared_root == "" or bool(_ABS.match(self.shared_root)), "shared_root",
                "an absolute directory or empty")
        require(5 <= self.part_size_mb <= 5120, "part_size_mb", "5 to 5120 (S3's limits)")
        require(1 <= self.concurrency <= 64, "concurrency", "1 to 64")
        require(1 <= self.s3_get_part_mb <= 64, "s3_get_part_mb", "1 to 64 (MiB per ranged GET)")
        require(1 <= self.s3_get_concurrency <= 64, "s3_get_concurrency",
                "1 to 64 (ranged GETs at once)")
        require(self.s3_legacy_steps in ("restore", "refuse"), "s3_legacy_steps",
                "restore or refuse")
        require(self.keep >= 1, "keep", "an integer >= 1")
        require(self.ckpt_cost_s > 0, "ckpt_cost_s", "seconds > 0")
        require(0 <= self.peer_replicas <= 8, "peer_replicas", "0 to 8")
        require(0 <= self.peer_port <= 65535, "peer_port", "a TCP port (0: any free one)")
        require(self.peer_partner in ("other-leaf", "next-node"), "peer_partner",
                "other-leaf or next-node")
        require(bool(_ABS.match(self.topology_conf)), "topology_conf", "an absolute path")
        require(self.agree_timeout_s > 0, "agree_timeout_s", "seconds > 0")
        require(0 < self.stage_in_budget_s <= 3600, "stage_in_budget_s", "seconds, 0 to 3600")
        require(self.stage_in_s3_env == "" or _plain_abs(self.stage_in_s3_env),
                "stage_in_s3_env", "an absolute path (no . or ..) or empty")
        require(self.key_file == "" or _plain_abs(self.key_file), "key_file",
                "an absolute path (no . or ..) or empty")
        require(_plain_abs(self.job_key_dir), "job_key_dir", "an absolute directory (no . or ..)")
        # S3 steps are authenticated with the job's key: without a shared tier to keep a
        # random one, only the site secret gives one.
        require(not self.s3_bucket or bool(self.shared_root or self.key_file), "key_file",
                "the site secret file (docs/checkpointing.md): s3_bucket without shared_root "
                "needs it, for the per-job key that authenticates S3 steps")
        require(self.mttf_h >= 0, "mttf_h", "hours >= 0 (0: measure from accounting)")

    def stage_in_source(self) -> str:
        """Where the prolog stages a requeued job's step from: "shared" (the shared tier),
        "s3" (no shared tier; S3 and ``stage_in_s3``), or "" (no stage-in)."""
        if not self.stage_in:
            return ""
        if self.shared_root:
            return "shared"
        return "s3" if self.s3_bucket and self.stage_in_s3 else ""
