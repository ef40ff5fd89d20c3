"""The e2e session: one fresh cluster for the whole run, driven through the docker SDK.

Under pytest-xdist each worker owns a cluster named after it (gw0 -> gwt0, see
docs/test-cluster.md); run with `--dist loadfile --no-loadscope-reorder` so a module stays
on one worker and the longest modules (DURATION_ORDER) start first.
Without Docker the e2e tests skip with the reason; with CI=true they fail instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import replace

import pytest

from devcluster.cluster import Cluster
from devcluster.harness import Harness
from devcluster.spec import Spec, from_env, name_for_worker, objstore_name, subnet_for
from tests.conftest import in_ci

# The modules by their wall time on one cluster, longest first, from the parallel run of
# 2026-12-05 (4 workers beside the 26.05 run; seconds less the cluster's start): workers take
# modules in this order, so the longest does not start last. Modules not listed (each under
# 80 s) run after these, in file order.
DURATION_ORDER = (
    # Its own cluster's start (about a minute) and a requeue (about two and a half): first.
    "test_ckpt_objstore.py",  # 634 with its own cluster's start (CI-like run, 2026-12-06)
    "test_ckpt_spares.py",  # 400
    "test_ckpt_requeue.py",  # 343
    "test_lemons.py",  # 243
    "test_ckpt_torch.py",  # 218
    "test_ckpt_outages.py",  # 202
    "test_placement.py",  # 179
    "test_admin_guide.py",  # 153
    "test_health.py",  # 126
    "test_foundation.py",  # 119
    "test_report.py",  # 78
)


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker's session drives its own cluster: every from_env() in it (the cluster
    fixture, the admin guide's site, a devcluster command a test starts) names it."""
    # Slurm's own periodic checks off the tests' clusters for the session (12 h; each test
    # runs the check itself where it wants one): on its 300 s timer one fell between a fault
    # a test made and the epilog it watched, and drained first. Set for every from_env() of
    # the session, a devcluster command a test starts included; an explicit setting stands.
    os.environ.setdefault("GPUWARDEN_HEALTHCHECK_INTERVAL", "43200")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    if os.environ.get("GPUWARDEN_SUBNET") and int(
            os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        raise pytest.UsageError("GPUWARDEN_SUBNET names one subnet, but each of the xdist "
                                "workers brings up its own cluster: unset it")
    os.environ["GPUWARDEN_CLUSTER_NAME"] = name_for_worker(
        worker, os.environ.get("GPUWARDEN_CLUSTER_NAME"))


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
def cluster_spec() -> Spec:
    """The cluster this session (or this xdist worker) brings up."""
    return from_env()


@pytest.fixture(scope="session")
def cluster(docker_client: object, cluster_spec: Spec) -> Iterator[Harness]:
    client = docker_client
    c = Cluster(client, cluster_spec,
                progress=lambda m: print(f"[cluster {cluster_spec.name}] {m}", file=sys.stderr))
    # A fresh cluster per session: no drains, jobs or accounting left from an earlier run.
    c.down(keep_state=True)
    c.up(timeout=240)
    h = Harness(c)
    h.prepare_jobs_dir()
    yield h


@pytest.fixture(scope="module")
def objstore_cluster(docker_client: object, cluster_spec: Spec) -> Iterator[Harness]:
    """A second cluster of the same release beside this session's, of the object-store site
    (GPUWARDEN_SITE=objstore: no /fsx, checkpoints on node memory, peers and S3): brought up
    for the module that asks for it and taken down after it (11 more containers only then)."""
    name = objstore_name(cluster_spec.name)
    spec = replace(cluster_spec, name=name, subnet=subnet_for(name), site="objstore")
    c = Cluster(docker_client, spec,
                progress=lambda m: print(f"[cluster {name}] {m}", file=sys.stderr))
    c.down(keep_state=True)
    c.up(timeout=240)
    h = Harness(c)
    h.prepare_jobs_dir()
    try:
        yield h
    finally:
        c.down()


def _module_rank(item: pytest.Item) -> int:
    name = item.path.name
    return DURATION_ORDER.index(name) if name in DURATION_ORDER else len(DURATION_ORDER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.e2e)
            # An e2e test's timeout bounds its own body: the cluster fixtures a module's first
            # test pays for (a bring-up, 90-165 s on a loaded host) have their own deadlines
            # (devcluster.harness: every call has one); counted in, a DDP test's 600 s ran out
            # with 145 s of them charged to it. Unit tests' fixtures stay under their timeout.
            mark = item.get_closest_marker("timeout")
            seconds: object = item.config.getini("timeout")
            if mark is not None:
                seconds = mark.args[0] if mark.args else mark.kwargs.get("timeout", seconds)
            item.add_marker(pytest.mark.timeout(float(str(seconds)), func_only=True),
                            append=False)
    # Only workers reorder (a serial run keeps file order). Stable: the tests of a module
    # keep their order, and every worker sorts alike (xdist checks that they collect alike).
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    e2e = [i for i in items if "tests/e2e/" in str(i.fspath).replace("\\", "/")]
    if e2e:
        rest = [i for i in items if i not in e2e]
        items[:] = rest + sorted(e2e, key=_module_rank)
