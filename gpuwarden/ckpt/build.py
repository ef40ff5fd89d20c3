"""The storage tiers the `[ckpt]` config names, fastest first: node memory, the shared
filesystem, S3 (peers are added by a running job, see `job`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.config.ckpt import CkptConfig

if TYPE_CHECKING:
    from gpuwarden.ckpt.jobkey import JobKeys


def tiers(cfg: CkptConfig, job: str, rank: int, owner: int | None = None,
          s3_key: bytes | None = None, s3_keys: JobKeys | None = None) -> list[Any]:
    """``owner``: the job's user, whom the filesystem tiers hold every file to (None: whoever
    runs this; `fstier.ANY_JOB_USER` for root's commands). ``s3_keys``: the job's keys, which
    authenticate S3 manifests (every key id a step may name: derived keys from before a
    rotation, a shared tier's ``peer.key``); ``s3_key``: a shared tier's ``peer.key`` alone.
    Neither: S3 steps are refused, none written."""
    out: list[Any] = [FsTier("memory", cfg.memory_root, job, rank, owner, map_reads=True)]
    if cfg.shared_root:
        out.append(FsTier("shared", cfg.shared_root, job, rank, owner))
    if cfg.s3_bucket:
        from gpuwarden.ckpt.s3tier import S3Settings, S3Tier  # noqa: PLC0415 - boto3 only if used

        settings = S3Settings(cfg.s3_bucket, cfg.s3_prefix, cfg.s3_endpoint or None,
                              cfg.part_size_mb << 20, cfg.concurrency,
                              get_part_size=cfg.s3_get_part_mb << 20,
                              get_concurrency=cfg.s3_get_concurrency,
                              legacy_steps=cfg.s3_legacy_steps)
        out.append(S3Tier("s3", settings, job, rank, key=s3_key, keys=s3_keys))
    return out
