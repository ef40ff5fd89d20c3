"""Run inside a cluster container: create the bucket and write one object (S3 readiness)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> int:
    import boto3  # type: ignore[import-not-found,unused-ignore]  # noqa: PLC0415

    for line in Path("/etc/gpuwarden-cluster/s3.env").read_text().splitlines():
        key, _, value = line.partition("=")
        os.environ.setdefault(key, value)
    s3 = boto3.client(
        "s3",
        endpoint_url=os.environ["GPUWARDEN_S3_ENDPOINT"],
        region_name="us-east-1",
        config=boto3.session.Config(connect_timeout=3, read_timeout=5,
                                    retries={"max_attempts": 1}),
    )
    bucket = os.environ["GPUWARDEN_S3_BUCKET"]
    try:
        s3.head_bucket(Bucket=bucket)
    except Exception:
        s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="healthz", Body=b"ok")
    return 0 if s3.get_object(Bucket=bucket, Key="healthz")["Body"].read() == b"ok" else 1


if __name__ == "__main__":
    sys.exit(main())
