"""Issue 6 (in progress): the checkpoint tiers against node memory and the real S3 server."""

from __future__ import annotations

import json
import time

import pytest

from devcluster.cluster import SRC, VENV_PYTHON
from devcluster.harness import Harness

pytestmark = pytest.mark.timeout(300)
PROBE = f"{SRC}/tests/e2e/ckpt_s3_probe.py"


def probe(h: Harness, job: str, mode: str) -> tuple[int, dict[str, object]]:
    res = h.exec("c1", [VENV_PYTHON, PROBE, job, mode],
                 timeout=180)
    last = res.out.strip().splitlines()[-1] if res.out.strip() else "{}"
    return res.rc, json.loads(last) if last.startswith("{") else {}


def test_a_corrupt_memory_copy_restores_from_s3_and_killed_uploads_stay_invisible(
        cluster: Harness) -> None:
    job = f"e2e-{int(time.time())}"
    rc, out = probe(cluster, job, "roundtrip")
    assert rc == 0, out
    assert out["step"] == 1 and out["tier"] == "s3" and out["identical"] is True
    assert "shm step 1: shard weights: checksum mismatch" in out["skipped"][0]  # type: ignore[index]

    rc, _ = probe(cluster, job, "kill-upload")  # SIGKILL part-way through a multipart upload
    assert rc == 137
    rc, _ = probe(cluster, job, "kill-manifest")  # SIGKILL with every shard up, no manifest
    assert rc == 137
    rc, out = probe(cluster, job, "inspect")
    assert rc == 0, out
    assert out["steps"] == [1] and out["restored"] == 1
    assert out["aborted_uploads"] >= 1  # type: ignore[operator]
