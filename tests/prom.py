"""Prometheus's promtool for the tests of the alert rules and the dashboard, and the metric
names gpuwarden exports (issue 38's catalogue).

promtool() skips the calling test where promtool is not installed, with the reason; under
CI=true it fails instead (`scripts/host-deps.sh promtool` installs Debian's prometheus)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gpuwarden.core import metrics
from tests.conftest import in_ci

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "gpuwarden" / "sitefiles" / "prometheus" / "gpuwarden.rules.yml"
DASHBOARD = REPO / "gpuwarden" / "sitefiles" / "grafana" / "gpuwarden.json"
UNIT_TESTS = sorted((REPO / "tests" / "promtool").glob("*.test.yml"))

# The metric catalogue: every series gpuwarden writes (gpuwarden.core.metrics, the producers'
# own list); the rules and the dashboard may read only these.
CATALOGUE = frozenset(m.name for m in metrics.CATALOGUE)

_KEYWORDS = frozenset({"and", "or", "unless", "by", "without", "on", "ignoring", "group_left",
                       "group_right", "offset", "bool", "inf", "nan", "atan2"})


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        if in_ci():
            pytest.fail("CI=true and promtool is not installed: scripts/host-deps.sh promtool "
                        "(apt-get install -y --no-install-recommends prometheus)")
        pytest.skip("promtool is not installed (apt-get install -y --no-install-recommends "
                    "prometheus)")
    return exe


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60,
                          check=False)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers,
    ranges, grouping clauses, functions, keywords and numbers are taken out."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![A-Za-z0-9_:.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group().lower() in _KEYWORDS:
            continue
        names.add(m.group())
    return names
