"""How often the test cluster's slurmctld has each node run gpuwarden's periodic check:
a site's 300 s for `make demo` and `devcluster up`, set long by the e2e tests, which run the
check themselves (on Slurm's timer it fell between a test's fault and the epilog it watched)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devcluster import spec
from devcluster.cluster import rendered
from gpuwarden.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _interval(monkeypatch: pytest.MonkeyPatch, value: str | None) -> int:
    for var in ("GPUWARDEN_NODES", "GPUWARDEN_CLUSTER_NAME", "GPUWARDEN_SUBNET", "GPUWARDEN_SITE"):
        monkeypatch.delenv(var, raising=False)
    if value is None:
        monkeypatch.delenv("GPUWARDEN_HEALTHCHECK_INTERVAL", raising=False)
    else:
        monkeypatch.setenv("GPUWARDEN_HEALTHCHECK_INTERVAL", value)
    conf = rendered(spec.from_env(), REPO, "AK", "SK", "dbpw", "ab" * 32)["slurm.conf"]
    (line,) = re.findall(r"(?m)^HealthCheckInterval=(\d+)$", conf)
    return int(line)


def test_the_demo_cluster_checks_every_node_every_300_s(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _interval(monkeypatch, None) == 300


def test_the_e2e_tests_interval_reaches_slurm_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _interval(monkeypatch, "43200") == 43200


@pytest.mark.parametrize("value", ["0", "65536", "-5", "soon"])
def test_an_interval_slurm_cannot_take_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                  value: str) -> None:
    with pytest.raises(ConfigError, match="GPUWARDEN_HEALTHCHECK_INTERVAL"):
        _interval(monkeypatch, value)

