"""Prometheus, Alertmanager and node_exporter in the test cluster, started by the tests that
need them (tests/e2e/test_monitoring.py; docs/test-cluster.md, "Monitoring").

node_exporter runs on every node and on the controller and reads gpuwarden's textfiles
(`[health] prom_dir`), as on a site; Prometheus and Alertmanager run on the controller (the
admin host) with the rules `gpuwarden install-files` shipped there, their waits cut for tests
(`test_rules`): every `for:` is 0 s and the few thresholds that are hours or minutes are
seconds, so an alert fires within a scrape or two of what causes it. The rules' expressions are
otherwise the shipped ones; `promtool test rules` (tests/unit) checks the real durations.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from devcluster.exec import run_in
from devcluster.harness import Harness

PROM_DIR = "/var/lib/node_exporter/textfile"  # the test cluster's [health] prom_dir
RULES = "/opt/gpuwarden/prometheus/gpuwarden.rules.yml"  # where install-files put them
CONF_DIR = "/etc/gpuwarden-monitor"
EXPORTER_PORT, PROM_PORT, AM_PORT = 9100, 9090, 9093
# Scrapes and rule evaluations every 2 s: a test waits a few seconds for what it caused.
INTERVAL = "2s"
# Thresholds cut for tests: (the shipped text, the test's). Each must occur exactly once, so
# a change to the shipped rules fails here, loudly, rather than test something else.
TEST_THRESHOLDS = (
    # a node drained by gpuwarden "for longer than 24 h": any drain of its
    ("time() - gpuwarden_node_drained_since_timestamp_seconds > 24 * 3600",
     "time() - gpuwarden_node_drained_since_timestamp_seconds > 0"),
    # the placement snapshot older than the filter's 120 s: 20 s (the daemon writes every 5 s)
    ("time() - gpuwarden_placement_snapshot_timestamp_seconds > 120",
     "time() - gpuwarden_placement_snapshot_timestamp_seconds > 20"),
)

_PROMETHEUS_YML = """\
global:
  scrape_interval: {interval}
  evaluation_interval: {interval}
rule_files: [{conf}/rules.yml]
alerting:
  alertmanagers:
    - static_configs: [{{targets: ["127.0.0.1:{am}"]}}]
scrape_configs:
  - job_name: node
    static_configs:
      - targets: {targets}
"""
_ALERTMANAGER_YML = """\
route:
  receiver: none
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: none
"""


def test_rules(text: str) -> str:
    """The shipped rules with their waits cut for tests (module docstring)."""
    out, n = re.subn(r"(?m)^(\s+)for: \S+\s*$", r"\1for: 0s", text)
    if n == 0:
        raise AssertionError(f"{RULES}: no `for:` to cut")
    for old, new in TEST_THRESHOLDS:
        if out.count(old) != 1:
            raise AssertionError(f"{RULES}: expected {old!r} exactly once, found it "
                                 f"{out.count(old)} times: update devcluster/monitor.py")
        out = out.replace(old, new)
    return out


@dataclass
class Monitor:
    """The running monitoring stack of one test cluster."""

    h: Harness
    controller_ip: str

    # ---- queries -----------------------------------------------------------------------------
    def _get(self, port: int, path: str, params: Mapping[str, str] | None = None) -> Any:
        url = f"http://{self.controller_ip}:{port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as resp:  # noqa: S310 - the test cluster
            return json.loads(resp.read())

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Prometheus's instant vector for ``expr`` (each: {"metric": labels, "value": [t, v]})."""
        doc = self._get(PROM_PORT, "/api/v1/query", {"query": expr})
        if doc.get("status") != "success":
            raise AssertionError(f"query {expr!r}: {doc}")
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        """Alertmanager's active alerts (its v2 API), each with labels and annotations."""
        got: list[dict[str, Any]] = self._get(AM_PORT, "/api/v2/alerts", {"active": "true"})
        return [a for a in got if a.get("status", {}).get("state") == "active"]

    def firing(self, name: str, **labels: str) -> list[dict[str, Any]]:
        return [a for a in self.alerts() if a["labels"].get("alertname") == name
                and all(a["labels"].get(k) == v for k, v in labels.items())]

    def rule_alerts(self, name: str, **labels: str) -> list[dict[str, Any]]:
        """Prometheus's own view of an alert (pending or firing), from its ALERTS series."""
        sel = ",".join([f'alertname="{name}"', *(f'{k}="{v}"' for k, v in labels.items())])
        return self.query(f"ALERTS{{{sel}}}")

    def wait(self, cond: Callable[[], Any], timeout: float, what: str) -> Any:
        """Poll ``cond`` until it returns something true; past ``timeout``, fail naming
        ``what`` and the last value."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = cond()
            except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
                last = exc
            else:
                if last:
                    return last
            time.sleep(1.0)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: "
                             f"{str(last)[:2000]}")


def _start(h: Harness, host: str, script: str) -> None:
    h.container(host).exec_run(["bash", "-c", script], detach=True)


def start_exporters(h: Harness) -> None:
    """node_exporter (only its textfile collector: the tests read nothing else) on every node
    and the controller; again after a node was restarted."""
    for host in [*h.cluster.spec.node_names, "slurmctld"]:
        h.exec(host, ["install", "-d", "-m", "0755", PROM_DIR]).check("make the textfile dir")
        _start(h, host, "pgrep -x prometheus-node || exec prometheus-node-exporter "
               f"--web.listen-address=:{EXPORTER_PORT} --collector.disable-defaults "
               f"--collector.textfile --collector.textfile.directory={PROM_DIR} "
               ">> /var/log/node-exporter.log 2>&1")


def start(h: Harness, timeout: float = 90.0) -> Monitor:
    """node_exporters, then Prometheus and Alertmanager on the controller with the test rules;
    returns once Prometheus has scraped every exporter."""
    addresses = h.cluster.spec.addresses()
    start_exporters(h)
    targets = [f"{addresses[n]}:{EXPORTER_PORT}" for n in [*h.cluster.spec.node_names,
                                                             "slurmctld"]]
    rules = h.exec("slurmctld", ["cat", RULES]).check("read the installed rules").out
    files = {
        "prometheus.yml": _PROMETHEUS_YML.format(interval=INTERVAL, conf=CONF_DIR, am=AM_PORT,
                                                 targets=json.dumps(targets)),
        "alertmanager.yml": _ALERTMANAGER_YML,
        "rules.yml": test_rules(rules),
    }
    h.exec("slurmctld", ["install", "-d", "-m", "0755", CONF_DIR]).check("config dir")
    for name, text in files.items():
        run_in(h.container("slurmctld"), ["sh", "-c", f"cat > {CONF_DIR}/{name}"],
               stdin_text=text).check(f"write {CONF_DIR}/{name}")
    _start(h, "slurmctld", f"exec prometheus-alertmanager --config.file={CONF_DIR}/alertmanager.yml "
           f"--storage.path=/var/lib/gpuwarden-alertmanager --cluster.listen-address= "
           f"--web.listen-address=:{AM_PORT} >> /var/log/alertmanager.log 2>&1")
    _start(h, "slurmctld", f"exec prometheus --config.file={CONF_DIR}/prometheus.yml "
           f"--storage.tsdb.path=/var/lib/gpuwarden-prometheus --web.listen-address=:{PROM_PORT} "
           # Alerts re-sent every 2 s (1 min by default): their annotations, re-rendered at
           # each evaluation, reach Alertmanager as the evidence arrives.
           f"--rules.alert.resend-delay={INTERVAL} >> /var/log/prometheus.log 2>&1")
    mon = Monitor(h, addresses["slurmctld"])
    mon.wait(lambda: len([t for t in mon._get(PROM_PORT, "/api/v1/targets")["data"]
                          ["activeTargets"] if t.get("health") == "up"]) == len(targets),
             timeout, f"Prometheus scraping all {len(targets)} node_exporters")
    mon.wait(lambda: mon._get(AM_PORT, "/api/v2/status"), timeout, "Alertmanager answering")
    return mon
