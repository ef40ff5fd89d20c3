"""The e2e session: one fresh cluster for the whole run, driven through the docker SDK.

Without Docker the e2e tests skip with the reason; with CI=true they fail instead.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from gpuwarden.devcluster.cluster import Cluster
from gpuwarden.devcluster.harness import Harness
from gpuwarden.devcluster.spec import from_env
from tests.conftest import in_ci


def _no_cluster(reason: str) -> None:
    if in_ci():
        pytest.fail(f"CI=true and the e2e cluster is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


def _docker_client() -> object:
    try:
        import docker
    except ImportError:
        _no_cluster("the docker SDK is not installed (pip install -e '.[test]')")
    try:
        client = docker.from_env(timeout=300)
        client.ping()
    except Exception as exc:  # any failure means the same thing here: no usable daemon
        _no_cluster(f"no Docker daemon reachable ({exc.__class__.__name__}: {exc})")
    return client


@pytest.fixture(scope="session")
def docker_client() -> object:
    return _docker_client()


@pytest.fixture(scope="session")
def cluster(docker_client: object) -> Iterator[Harness]:
    client = docker_client
    c = Cluster(client, from_env(), progress=lambda m: print(f"[cluster] {m}", file=sys.stderr))
    # A fresh cluster per session: no drains, jobs or accounting left from an earlier run.
    c.down(keep_state=True)
    c.up(timeout=240)
    h = Harness(c)
    h.prepare_jobs_dir()
    yield h


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
